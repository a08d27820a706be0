//! fully_shard on two ranks under dp-run, as tests/fsdp/fsdp_worker.c drives
//! it from C:
//!
//!   DP_LIBRARY=path/to/libdparallel.so dp-run -n 2 fsdp
//!
//! The model: three Linear(3, 3) in `linears`, then `proj`, no biases; an
//! `Fsdp` on each linear and on `linears`, a `Ddp` on the root. Forward and
//! backward are written here, with prefetching unshards; SGD steps on the
//! shards. After 4 steps every parameter must match single-process training
//! on the whole batch; then a full state dict (written by rank 0) and a
//! sharded one (a file per rank) load back into fresh sharded models.
//! With `--views` the layers' full parameters are views of the shards
//! (`full_params_as_views`), which the run checks by address.

use std::process::ExitCode;

use dparallel::{Ddp, DdpOptions, Device, Fsdp, FsdpOptions, Library, Module, ProcessGroup, Result, Tensor};

const DIM: usize = 3;
const ROWS_PER_RANK: usize = 4;
const STEPS: usize = 4;
const LR: f64 = 0.2;
const WEIGHTS: [&str; 4] = ["linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight"];

fn initial(layer: usize, k: usize, skew: f32) -> f32 {
    0.3 * (1.7 * (layer * 9 + k) as f32 + 0.4).sin() + skew
}

fn batch(step: usize, rows: usize) -> (Vec<f64>, Vec<f64>) {
    let x = (0..rows * DIM).map(|k| (0.37 * k as f64 + 0.91 * step as f64).cos()).collect();
    let t = (0..rows * DIM).map(|k| 0.5 * (0.53 * k as f64 - 0.29 * step as f64).sin()).collect();
    (x, t)
}

/// y = x W^T.
fn linear(x: &[f64], w: &[f32]) -> Vec<f64> {
    let rows = x.len() / DIM;
    let mut y = vec![0.0; rows * DIM];
    for b in 0..rows {
        for o in 0..DIM {
            y[b * DIM + o] = (0..DIM).map(|i| x[b * DIM + i] * w[o * DIM + i] as f64).sum();
        }
    }
    y
}

/// (dW = dy^T x, dx = dy W).
fn backward(dy: &[f64], x: &[f64], w: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / DIM;
    let mut g = vec![0.0; DIM * DIM];
    let mut dx = vec![0.0; rows * DIM];
    for b in 0..rows {
        for o in 0..DIM {
            for i in 0..DIM {
                g[o * DIM + i] += dy[b * DIM + o] * x[b * DIM + i];
                dx[b * DIM + i] += dy[b * DIM + o] * w[o * DIM + i] as f64;
            }
        }
    }
    (g, dx)
}

/// Single-process training on the whole batch.
fn reference(world: usize) -> Vec<Vec<f32>> {
    let rows = ROWS_PER_RANK * world;
    let mut w: Vec<Vec<f32>> = (0..4).map(|l| (0..DIM * DIM).map(|k| initial(l, k, 0.0)).collect()).collect();
    for s in 0..STEPS {
        let (x, t) = batch(s, rows);
        let mut h = vec![x];
        for l in 0..4 {
            let next = linear(&h[l], &w[l]);
            h.push(next);
        }
        let mut dy: Vec<f64> = h[4].iter().zip(&t).map(|(y, t)| (y - t) / rows as f64).collect();
        let mut grads = vec![Vec::new(); 4];
        for l in (0..4).rev() {
            let (g, dx) = backward(&dy, &h[l], &w[l]);
            grads[l] = g;
            dy = dx;
        }
        for l in 0..4 {
            w[l].iter_mut().zip(&grads[l]).for_each(|(w, g)| *w -= (LR * g) as f32);
        }
    }
    w
}

struct Toy {
    root: Module,
    linears: Module,
    layers: Vec<Module>,
    fsdp: Vec<Fsdp>,
    fsdp_linears: Option<Fsdp>,
    ddp: Option<Ddp>,
}

impl Toy {
    fn new(lib: &Library, skew: f32) -> Result<Toy> {
        let mut root = Module::new(lib)?;
        let mut linears = Module::new(lib)?;
        let mut layers = Vec::new();
        for l in 0..4 {
            let v: Vec<f32> = (0..DIM * DIM).map(|k| initial(l, k, skew)).collect();
            let mut layer = Module::new(lib)?;
            layer.register_parameter(
                "weight",
                &Tensor::from_slice(lib, &v, &[DIM as i64, DIM as i64], Device::cpu(0))?,
                true,
            )?;
            if l < 3 {
                linears.register_module(&l.to_string(), &layer)?;
            }
            layers.push(layer);
        }
        root.register_module("linears", &linears)?;
        root.register_module("proj", &layers[3])?;
        Ok(Toy { root, linears, layers, fsdp: Vec::new(), fsdp_linears: None, ddp: None })
    }

    /// fully_shard each linear, then `linears` (children first).
    fn shard(&mut self, pg: &ProcessGroup, layer_options: &FsdpOptions) -> Result<()> {
        for l in 0..3 {
            self.fsdp.push(Fsdp::new(&self.layers[l], pg, layer_options)?);
        }
        self.fsdp_linears = Some(Fsdp::new(&self.linears, pg, &FsdpOptions::default())?);
        Ok(())
    }

    fn weights(&self, l: usize) -> Result<Vec<f32>> {
        self.weights_tensor(l)?.to_vec::<f32>()
    }

    fn weights_tensor(&self, l: usize) -> Result<Tensor> {
        self.root.parameter(WEIGHTS[l])
    }

    /// Every rank tears down in the same order (the destroys are collective).
    fn teardown(mut self) {
        drop(self.ddp.take());
        drop(self.fsdp_linears.take());
        while let Some(f) = self.fsdp.pop() {
            drop(f);
        }
    }
}

fn train_step(t: &mut Toy, rank: usize, world: usize, step: usize) -> Result<()> {
    let rows = ROWS_PER_RANK;
    let (all_x, all_t) = batch(step, rows * world);
    let x = all_x[rank * rows * DIM..(rank + 1) * rows * DIM].to_vec();
    let target = &all_t[rank * rows * DIM..(rank + 1) * rows * DIM];
    let mut w = vec![Vec::new(); 4];
    let mut h = vec![x];
    let linears = t.fsdp_linears.as_mut().expect("sharded");
    linears.unshard()?;
    t.fsdp[0].unshard()?;
    for l in 0..3 {
        if l + 1 < 3 {
            t.fsdp[l + 1].unshard_async()?; // prefetch
        }
        t.fsdp[l].wait_unshard()?;
        w[l] = t.weights(l)?;
        let next = linear(&h[l], &w[l]);
        h.push(next);
        t.fsdp[l].reshard()?;
    }
    let ddp = t.ddp.as_mut().expect("wrapped");
    ddp.pre_forward()?;
    w[3] = t.weights(3)?;
    let y = linear(&h[3], &w[3]);
    let mut dy: Vec<f64> = y.iter().zip(target).map(|(y, t)| (y - t) / rows as f64).collect();
    for l in (0..4).rev() {
        if l < 3 {
            if l == 2 {
                t.fsdp[2].unshard()?;
            }
            if l > 0 {
                t.fsdp[l - 1].unshard_async()?;
            }
            t.fsdp[l].wait_unshard()?;
            w[l] = t.weights(l)?;
        }
        let (g, dx) = backward(&dy, &h[l], &w[l]);
        let mut grad = t.root.grad(WEIGHTS[l])?;
        grad.as_mut_slice::<f32>()?.iter_mut().zip(&g).for_each(|(a, g)| *a += *g as f32);
        if l == 3 {
            t.ddp.as_ref().expect("wrapped").mark_grad_ready(WEIGHTS[3])?;
        } else if l == 2 {
            t.fsdp[l].post_backward()?;
        } else {
            // The per-parameter mark runs post_backward; layer 0's explicit
            // one after it is a no-op.
            drop(grad);
            t.fsdp[l].mark_grad_ready("weight")?;
            if l == 0 {
                t.fsdp[l].post_backward()?;
            }
        }
        dy = dx;
    }
    t.fsdp_linears.as_mut().expect("sharded").post_backward()?;
    for f in t.fsdp.iter_mut() {
        f.finish_backward()?;
    }
    t.fsdp_linears.as_mut().expect("sharded").finish_backward()?;
    t.ddp.as_mut().expect("wrapped").finish_backward()?;
    // SGD on the shards and on proj.
    for f in &t.fsdp {
        let g = f.shard_grad(0)?.to_vec::<f32>()?;
        let mut shard = f.shard(0)?;
        shard.as_mut_slice::<f32>()?.iter_mut().zip(&g).for_each(|(v, g)| *v -= LR as f32 * g);
    }
    let g = t.root.grad(WEIGHTS[3])?.to_vec::<f32>()?;
    let mut p = t.root.parameter(WEIGHTS[3])?;
    p.as_mut_slice::<f32>()?.iter_mut().zip(&g).for_each(|(v, g)| *v -= LR as f32 * g);
    t.root.zero_grad()
}

/// The number of weights off `expected`, each sharded layer unsharded to read it.
fn mismatches(t: &mut Toy, expected: &[Vec<f32>], what: &str, rank: usize) -> Result<usize> {
    let mut bad = 0;
    for l in 0..4 {
        if l < 3 {
            t.fsdp[l].unshard()?;
        }
        let got = t.weights(l)?;
        for (k, (g, e)) in got.iter().zip(&expected[l]).enumerate() {
            if (g - e).abs() > 2e-5 * (1.0 + e.abs()) {
                eprintln!("FAIL: rank {rank}: {what}: {}[{k}] is {g}, expected {e}", WEIGHTS[l]);
                bad += 1;
            }
        }
        if l < 3 {
            t.fsdp[l].reshard()?;
        }
    }
    println!("rank {rank}: {what}: {}", if bad == 0 { "every weight matches" } else { "weights differ" });
    Ok(bad)
}

/// Whether each unsharded layer's weight holds this rank's shard at its
/// rows (views) or lies elsewhere (copies): the number of layers that differ.
fn check_views(t: &mut Toy, views: bool, start: usize, rank: usize) -> Result<usize> {
    let mut bad = 0;
    for l in 0..3 {
        let shard = t.fsdp[l].shard(0)?.data_ptr() as usize;
        t.fsdp[l].unshard()?;
        let full = t.weights_tensor(l)?.data_ptr() as usize;
        t.fsdp[l].reshard()?;
        let rows_at = full + start * DIM * std::mem::size_of::<f32>();
        if (rows_at == shard) != views {
            eprintln!(
                "FAIL: rank {rank}: layer {l}: the full weight at {full:#x}, this rank's shard at {shard:#x}; want {}",
                if views { "a view holding the shard" } else { "a copy" }
            );
            bad += 1;
        }
    }
    Ok(bad)
}

fn run() -> Result<usize> {
    let lib = Library::open(None)?;
    let pg = ProcessGroup::from_env(&lib)?;
    let (rank, world) = (pg.rank() as usize, pg.size() as usize);
    let dir = std::env::temp_dir().join(format!("dp-rust-fsdp-{}", std::env::var("MASTER_PORT").unwrap_or_default()));
    let mut bad = 0;
    let expected = reference(world);

    let views = std::env::args().any(|a| a == "--views");
    // init_sync: every rank starts from rank 0's values.
    let mut t = Toy::new(&lib, 0.05 * rank as f32)?;
    t.shard(&pg, &FsdpOptions { full_params_as_views: views, ..FsdpOptions::default() })?;
    t.ddp = Some(Ddp::new(&t.root, &pg, &DdpOptions::default())?);
    // torch.chunk's split of the 3 rows.
    let chunk = DIM.div_ceil(world);
    let start = (chunk * rank).min(DIM);
    let rows = chunk.min(DIM - start) as i64;
    for (l, f) in t.fsdp.iter().enumerate() {
        let shape = f.shard(0)?.shape();
        let name = f.parameter_name(0)?;
        if f.num_parameters() != 1 || name != "weight" || shape.first() != Some(&rows) {
            eprintln!(
                "FAIL: rank {rank}: layer {l}: {} parameters, '{name}', shard {shape:?}; want 1, 'weight', {rows} rows",
                f.num_parameters()
            );
            bad += 1;
        }
    }
    bad += check_views(&mut t, views, start, rank)?;
    let held = t.fsdp_linears.as_ref().map_or(usize::MAX, |f| f.num_parameters());
    if held != 0 || t.ddp.as_ref().map(|d| d.num_buckets()) != Some(1) {
        eprintln!("FAIL: rank {rank}: `linears` manages {held} parameters (want 0), the Ddp {:?}", t.ddp);
        bad += 1;
    }
    for s in 0..STEPS {
        train_step(&mut t, rank, world, s)?;
    }
    bad += mismatches(&mut t, &expected, "after training, against single-process training", rank)?;

    // The full state dict in memory: on every rank, or on the last alone.
    let state = t.root.full_state_dict(&pg, None)?.expect("on every rank");
    for l in 0..4 {
        let want = {
            if l < 3 {
                t.fsdp[l].unshard()?;
            }
            let w = t.weights(l)?;
            if l < 3 {
                t.fsdp[l].reshard()?;
            }
            w
        };
        if state.parameter(WEIGHTS[l])?.to_vec::<f32>()? != want {
            eprintln!(
                "FAIL: rank {rank}: the in-memory full state dict's {} differs from the unsharded one",
                WEIGHTS[l]
            );
            bad += 1;
        }
    }
    drop(state);
    let on_last = t.root.full_state_dict(&pg, Some(world as i32 - 1))?;
    if on_last.is_some() != (rank + 1 == world) {
        eprintln!("FAIL: rank {rank}: the in-memory full state dict for the last rank is {on_last:?}");
        bad += 1;
    }
    drop(on_last);

    // The full state dict: rank 0 writes it, every rank loads its rows.
    if rank == 0 {
        std::fs::create_dir_all(&dir).map_err(|e| dparallel::Error::new(dparallel::DP_EIO, format!("{dir:?}: {e}")))?;
    }
    pg.barrier()?;
    let full = dir.join("full.safetensors");
    t.root.save_full_state_dict(&pg, full.to_str().expect("a UTF-8 path"))?;
    pg.barrier()?;
    let mut other = Toy::new(&lib, 1.0 + rank as f32)?;
    other.shard(&pg, &FsdpOptions { init_sync: false, ..FsdpOptions::default() })?;
    other.root.load_full_state_dict(full.to_str().expect("a UTF-8 path"), true)?;
    bad += mismatches(&mut other, &expected, "the full state dict loaded", rank)?;

    // The sharded one: a file per rank, read back by rows.
    let folder = dir.join("sharded");
    t.root.save_sharded_state_dict(&pg, folder.to_str().expect("a UTF-8 path"))?;
    pg.barrier()?;
    let mut third = Toy::new(&lib, 2.0 + rank as f32)?;
    third.shard(&pg, &FsdpOptions { init_sync: false, ..FsdpOptions::default() })?;
    third.root.load_sharded_state_dict(folder.to_str().expect("a UTF-8 path"))?;
    bad += mismatches(&mut third, &expected, "the sharded state dict loaded", rank)?;

    // In the background: the Work reports the save; it loads as the synchronous one.
    let in_background = dir.join("sharded-async");
    t.root.save_sharded_state_dict_async(&pg, in_background.to_str().expect("a UTF-8 path"))?.wait()?;
    let mut fourth = Toy::new(&lib, 4.0 + rank as f32)?;
    fourth.shard(&pg, &FsdpOptions { init_sync: false, ..FsdpOptions::default() })?;
    fourth.root.load_sharded_state_dict(in_background.to_str().expect("a UTF-8 path"))?;
    bad += mismatches(&mut fourth, &expected, "the background save loaded", rank)?;

    fourth.teardown();

    third.teardown();
    other.teardown();
    t.teardown();
    pg.barrier()?;
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(bad)
}

fn main() -> ExitCode {
    match run() {
        Ok(0) => {
            println!("fsdp passed");
            ExitCode::SUCCESS
        }
        Ok(n) => {
            eprintln!("fsdp: {n} checks failed");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("FAIL: fsdp: {e}");
            ExitCode::FAILURE
        }
    }
}
