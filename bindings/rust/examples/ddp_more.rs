//! Two ranks under dp-run, one scenario per run:
//!
//!   DP_LIBRARY=path/to/libdparallel.so dp-run -n 2 ddp_more SCENARIO
//!
//!   collectives           reduce_scatter and the async broadcast, all_gather,
//!                         reduce_scatter and barrier: the values each rank gets
//!   join                  uneven inputs (rank r has 2 + 2r batches): after
//!                         Ddp::join every rank holds the hand-computed result
//!   join-active           the same, the averages divided by the active ranks
//!   bucket-reduced        SGD inside the backward (a Rust closure per reduced
//!                         bucket) matches SGD after finish_backward exactly;
//!                         the latter under static_graph, started from the
//!                         former's bucket plan, which it keeps
//!   bucket-reduced-error  a closure's Err (rank 1) or panic (rank 0) fails
//!                         that rank's finish_backward with DP_EUSER and its
//!                         message; the gradients are averaged all the same
//!   stream-marks          gradients written by host closures queued on a cpu
//!                         stream and marked with mark_grad_ready_stream: the
//!                         reduction waits for them
//!   rebind                the Ddp goes on over a split of the group (rank 1's
//!                         drifted parameters become rank 0's again), then
//!                         over a group of its own rank alone (its gradients
//!                         are then its own); the plan is kept
//!   mesh                  subgroups (a split reversing the ranks, one only
//!                         rank 0 joins) and the 1-D and by-host meshes: ranks,
//!                         shapes, coordinates and an all_reduce per group
//!
//! The module has three parameters, a[4], b[3], c[2], with buckets of one
//! parameter each. Prints "rank R: SCENARIO passed" when every check held.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use dparallel::{
    DType, Ddp, DdpHooks, DdpOptions, Device, DeviceMesh, Error, Fsdp, FsdpOptions, Library, Module, ProcessGroup,
    ReduceOp, Result, Stream, Tensor, DP_EINVAL, DP_EUSER,
};

const NAMES: [&str; 3] = ["a", "b", "c"];
const SIZES: [usize; 3] = [4, 3, 2];

struct Checks {
    rank: usize,
    failures: usize,
}

impl Checks {
    fn expect(&mut self, what: &str, ok: bool, detail: impl std::fmt::Display) {
        if ok {
            println!("rank {}: ok: {what}", self.rank);
        } else {
            eprintln!("FAIL: rank {}: {what}: {detail}", self.rank);
            self.failures += 1;
        }
    }
}

/// a = [0, 1, 2, 3], b = [0, 1, 2], c = [0, 1], plus `offset`.
fn three_params(lib: &Library, offset: f32) -> Result<Module> {
    let mut m = Module::new(lib)?;
    for (name, n) in NAMES.iter().zip(SIZES) {
        let values: Vec<f32> = (0..n).map(|k| k as f32 + offset).collect();
        m.register_parameter(name, &Tensor::from_slice(lib, &values, &[n as i64], Device::cpu(0))?, true)?;
    }
    Ok(m)
}

/// One parameter per bucket.
fn small_buckets() -> DdpOptions {
    DdpOptions { bucket_cap_mb: 1e-6, first_bucket_cap_mb: 1e-6, ..DdpOptions::default() }
}

fn params_of(m: &Module) -> Result<Vec<f32>> {
    let mut all = Vec::new();
    for name in NAMES {
        all.extend(m.parameter(name)?.to_vec::<f32>()?);
    }
    Ok(all)
}

fn grads_of(m: &Module) -> Result<Vec<f32>> {
    let mut all = Vec::new();
    for name in NAMES {
        all.extend(m.grad(name)?.to_vec::<f32>()?);
    }
    Ok(all)
}

/// Sets every gradient element with `value(p, k)`.
fn fill_grads(m: &Module, value: impl Fn(usize, usize) -> f32) -> Result<()> {
    for (p, name) in NAMES.iter().enumerate() {
        let mut g = m.grad(name)?;
        g.as_mut_slice::<f32>()?.iter_mut().enumerate().for_each(|(k, v)| *v = value(p, k));
    }
    Ok(())
}

fn sgd(m: &Module, params: &[usize], lr: f32) -> Result<()> {
    for &p in params {
        let g = m.grad(NAMES[p])?.to_vec::<f32>()?;
        let mut w = m.parameter(NAMES[p])?;
        w.as_mut_slice::<f32>()?.iter_mut().zip(&g).for_each(|(w, g)| *w -= lr * g);
    }
    Ok(())
}

fn backward(ddp: &mut Ddp) -> Result<()> {
    for name in ["c", "b", "a"] {
        ddp.mark_grad_ready(name)?;
    }
    ddp.finish_backward()
}

/// Whether every rank holds `values` (all-gathered and compared).
fn same_on_every_rank(pg: &ProcessGroup, values: &[f32]) -> Result<bool> {
    let lib = Library::open(None)?;
    let input = Tensor::from_slice(&lib, values, &[values.len() as i64], Device::cpu(0))?;
    let mut outputs: Vec<Tensor> = (0..pg.size())
        .map(|_| Tensor::zeros(&lib, DType::F32, &[values.len() as i64], Device::cpu(0)))
        .collect::<Result<_>>()?;
    pg.all_gather(&input, &mut outputs)?;
    for o in &outputs {
        if o.to_vec::<f32>()? != values {
            return Ok(false);
        }
    }
    Ok(true)
}

fn collectives(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let (rank, world) = (pg.rank() as usize, pg.size() as usize);
    let cpu = Device::cpu(0);
    // inputs[j][k] on rank q is (q+1)*100 + 10j + k.
    let inputs: Vec<Tensor> = (0..world)
        .map(|j| {
            let v: Vec<f32> = (0..2).map(|k| ((rank + 1) * 100 + 10 * j + k) as f32).collect();
            Tensor::from_slice(lib, &v, &[2], cpu)
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let ranks_sum: usize = (1..=world).sum::<usize>() * 100;
    let want: Vec<f32> = (0..2).map(|k| (ranks_sum + world * (10 * rank + k)) as f32).collect();
    let mut out = Tensor::zeros(lib, DType::F32, &[2], cpu)?;
    pg.reduce_scatter(&refs, &mut out, ReduceOp::Sum)?;
    c.expect(
        "reduce_scatter sums the ranks' inputs[rank]",
        out.to_vec::<f32>()? == want,
        format!("{out:?} vs {want:?}"),
    );

    let mut avg = Tensor::zeros(lib, DType::F32, &[2], cpu)?;
    pg.scope(|s| s.reduce_scatter_async(&refs, &mut avg, ReduceOp::Avg)?.wait())?;
    let want_avg: Vec<f32> = want.iter().map(|v| v / world as f32).collect();
    c.expect("reduce_scatter_async averages", avg.to_vec::<f32>()? == want_avg, format!("{avg:?}"));

    match pg.reduce_scatter(&refs[..1], &mut out, ReduceOp::Sum) {
        Err(e) if e.code() == DP_EINVAL && e.message().contains("inputs") => {
            c.expect(&format!("reduce_scatter with one input: {e}"), true, "")
        }
        other => c.expect("reduce_scatter with one input is DP_EINVAL naming inputs", false, format!("{other:?}")),
    }

    let root = world - 1;
    let mut b = Tensor::from_slice(lib, &[(rank * 7) as i64, 1, 2], &[3], cpu)?;
    pg.scope(|s| s.broadcast_async(&mut b, root as i32)?.wait())?;
    c.expect("broadcast_async from the last rank", b.to_vec::<i64>()? == [(root * 7) as i64, 1, 2], format!("{b:?}"));

    let input = Tensor::from_slice(lib, &[rank as f64, 2.0 * rank as f64], &[2], cpu)?;
    let mut outputs: Vec<Tensor> =
        (0..world).map(|_| Tensor::zeros(lib, DType::F64, &[2], cpu)).collect::<Result<_>>()?;
    pg.scope(|s| s.all_gather_async(&input, &mut outputs)?.wait())?;
    let gathered: Vec<Vec<f64>> = outputs.iter().map(|t| t.to_vec::<f64>()).collect::<Result<_>>()?;
    let want: Vec<Vec<f64>> = (0..world).map(|r| vec![r as f64, 2.0 * r as f64]).collect();
    c.expect("all_gather_async: outputs[r] is rank r's input", gathered == want, format!("{gathered:?}"));

    let mut work = pg.barrier_async()?;
    while !work.test()? {
        std::thread::yield_now();
    }
    work.wait()?;
    c.expect("barrier_async completes", true, "");
    Ok(())
}

/// The gradient rank r produces for parameter p, element k, in iteration i.
fn join_grad(r: usize, i: usize, p: usize, k: usize) -> f32 {
    ((r + 1) * (i + 2) + p + k) as f32
}

const JOIN_LR: f32 = 0.25;

fn join(lib: &Library, pg: &ProcessGroup, c: &mut Checks, divide_by_initial: bool) -> Result<()> {
    let (rank, world) = (pg.rank() as usize, pg.size() as usize);
    let batches: Vec<usize> = (0..world).map(|r| 2 + 2 * r).collect();
    let m = three_params(lib, 0.0)?;
    let options = DdpOptions { join_divide_by_initial_world_size: divide_by_initial, ..small_buckets() };
    let mut ddp = Ddp::new(&m, pg, &options)?;
    for i in 0..batches[rank] {
        ddp.pre_forward()?;
        fill_grads(&m, |p, k| join_grad(rank, i, p, k))?;
        backward(&mut ddp)?;
        sgd(&m, &[0, 1, 2], JOIN_LR)?;
    }
    ddp.join()?;
    // Each iteration averages the ranks that still had a batch.
    let most = *batches.iter().max().unwrap_or(&0);
    let mut want = Vec::new();
    for (p, n) in SIZES.iter().enumerate() {
        for k in 0..*n {
            let mut value = k as f64;
            for i in 0..most {
                let active: Vec<usize> = (0..world).filter(|&r| batches[r] > i).collect();
                let sum: f64 = active.iter().map(|&r| join_grad(r, i, p, k) as f64).sum();
                value -= JOIN_LR as f64 * sum / if divide_by_initial { world } else { active.len() } as f64;
            }
            want.push(value as f32);
        }
    }
    let got = params_of(&m)?;
    let close = got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-4 * (1.0 + w.abs()));
    c.expect(
        &format!("after {} batches and join: the reference parameters", batches[rank]),
        close && got.len() == want.len(),
        format!("{got:?} vs {want:?}"),
    );
    // Every rank goes on together after the join.
    fill_grads(&m, |_, _| rank as f32)?;
    backward(&mut ddp)?;
    let g = grads_of(&m)?;
    let mean = (0..world).sum::<usize>() as f32 / world as f32;
    c.expect("a synced backward after the join", g.iter().all(|&v| v == mean), format!("{g:?}"));
    c.expect("join of no Ddp is an error", Ddp::join_all(&mut []).is_err(), "it succeeded");
    Ok(())
}

/// SGD inside backward against SGD after finish_backward.
fn bucket_reduced(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let rank = pg.rank() as usize;
    let lr = 0.5;
    let grad = move |it: usize| ((rank + 1) * (it + 1)) as f32;
    let mut finals = Vec::new();
    let mut plan = String::new();
    for inside in [true, false] {
        let m = three_params(lib, 1.0)?;
        let reported = Arc::new(Mutex::new(vec![0usize; 3]));
        let mut ddp = if inside {
            let (module, seen) = (m.retain()?, reported.clone());
            let hooks = DdpHooks::new().on_bucket_reduced(move |ddp, _bucket, params| {
                for &p in params {
                    if !ddp.parameter_used(p)? {
                        return Err(Error::new(DP_EINVAL, format!("parameter {p} reads as unused")));
                    }
                    seen.lock().unwrap()[p] += 1;
                }
                sgd(&module, params, lr)
            });
            Ddp::with_hooks(&m, pg, &small_buckets(), hooks)?
        } else {
            // Static graph, and the plan the first run ended with.
            let options = DdpOptions { static_graph: true, bucket_plan: Some(plan.clone()), ..small_buckets() };
            let ddp = Ddp::new(&m, pg, &options)?;
            let kept = ddp.bucket_plan()?;
            c.expect("bucket_plan option: the plan is the one given", kept == plan, format!("{kept:?} vs {plan:?}"));
            ddp
        };
        c.expect("three buckets", ddp.num_buckets() == 3, ddp.num_buckets());
        for it in 0..4 {
            let synced = it != 1; // iteration 1 accumulates without sync
            ddp.set_requires_gradient_sync(synced)?;
            fill_grads(&m, |_, _| grad(it))?;
            backward(&mut ddp)?;
            if !inside && synced {
                sgd(&m, &[0, 1, 2], lr)?;
            }
            if inside {
                let want = [1, 1, 2, 3][it];
                let seen = reported.lock().unwrap().clone();
                c.expect(
                    &format!("iteration {it}: each parameter reported once per synced iteration"),
                    seen == [want; 3],
                    format!("{seen:?}"),
                );
            }
        }
        if inside {
            plan = ddp.bucket_plan()?;
            c.expect(
                "bucket_plan: a comment, then one line per bucket",
                plan.lines().count() == 4 && plan.lines().skip(1).all(|l| l.starts_with("bucket float32 ")),
                format!("{plan:?}"),
            );
        }
        finals.push(params_of(&m)?);
    }
    c.expect("SGD inside backward equals SGD after finish_backward", finals[0] == finals[1], format!("{finals:?}"));
    c.expect("the steps moved the parameters", finals[0] != params_of(&three_params(lib, 1.0)?)?, "unchanged");
    c.expect("every rank stepped alike", same_on_every_rank(pg, &finals[0])?, "ranks differ");
    Ok(())
}

fn bucket_reduced_error(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let rank = pg.rank() as usize;
    let world = pg.size() as usize;
    let m = three_params(lib, 0.0)?;
    let iteration = Arc::new(Mutex::new(0usize));
    let now = iteration.clone();
    let hooks = DdpHooks::new().on_bucket_reduced(move |_, bucket, _| {
        let it = *now.lock().unwrap();
        if it == 0 && rank == 1 && bucket == 1 {
            return Err(Error::new(DP_EINVAL, "refused on purpose"));
        }
        if it == 1 && rank == 0 && bucket == 0 {
            panic!("(expected) a bucket closure panics");
        }
        Ok(())
    });
    let mut ddp = Ddp::with_hooks(&m, pg, &small_buckets(), hooks)?;
    let mean = (0..world).map(|r| 2.0 * r as f32).sum::<f32>() / world as f32;
    for (it, failing_rank, needle) in [(0, 1, "the on_bucket_reduced closure returned"), (1, 0, "panicked"), (2, 9, "")]
    {
        *iteration.lock().unwrap() = it;
        fill_grads(&m, |_, _| 2.0 * rank as f32)?;
        let result = backward(&mut ddp);
        if rank == failing_rank {
            let ok = matches!(&result, Err(e) if e.code() == DP_EUSER && e.message().contains(needle)
                && e.message().contains(if it == 0 { "refused on purpose" } else { "bucket closure panics" }));
            c.expect(
                &format!("iteration {it}: finish_backward is DP_EUSER with the closure's message"),
                ok,
                format!("{result:?}"),
            );
            if let Err(e) = &result {
                println!("rank {rank}: finish_backward: {e}");
            }
        } else {
            c.expect(&format!("iteration {it}: finish_backward succeeds"), result.is_ok(), format!("{result:?}"));
        }
        let g = grads_of(&m)?;
        c.expect(
            &format!("iteration {it}: the gradients are averaged"),
            g.iter().all(|&v| v == mean),
            format!("{g:?}"),
        );
    }
    Ok(())
}

fn stream_marks(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let (rank, world) = (pg.rank() as usize, pg.size() as usize);
    let m = three_params(lib, 0.0)?;
    let mut ddp = Ddp::new(&m, pg, &small_buckets())?;
    let stream = Stream::new(lib, Device::cpu(0))?;
    for it in 0..3 {
        for p in [2, 1, 0] {
            let mut g = m.grad(NAMES[p])?;
            let value = ((rank + 1) * (p + 1) * (it + 1)) as f32;
            // The gradient is written on the stream, after the mark is made.
            stream.launch_host_func(move || {
                std::thread::sleep(std::time::Duration::from_millis(3));
                if let Ok(mut s) = g.as_mut_slice::<f32>() {
                    s.fill(value);
                }
            })?;
            ddp.mark_grad_ready_stream(p, &stream)?;
        }
        ddp.finish_backward()?;
        let ranks_sum = (1..=world).sum::<usize>() as f32;
        let want: Vec<f32> = (0..3)
            .flat_map(|p| std::iter::repeat((ranks_sum * ((p + 1) * (it + 1)) as f32) / world as f32).take(SIZES[p]))
            .collect();
        let got = grads_of(&m)?;
        c.expect(
            &format!("iteration {it}: the average of what the stream wrote"),
            got == want,
            format!("{got:?} vs {want:?}"),
        );
    }
    stream.destroy()
}

fn rebind(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let rank = pg.rank();
    let m = three_params(lib, 0.0)?;
    let mut ddp = Ddp::new(&m, pg, &small_buckets())?;
    fill_grads(&m, |p, k| (rank + 1) as f32 * (p * 10 + k) as f32)?;
    backward(&mut ddp)?;
    let plan = ddp.bucket_plan()?;
    if rank == 1 {
        m.parameter("a")?.as_mut_slice::<f32>()?.iter_mut().for_each(|v| *v += 10.0);
    }
    let both = pg.split(0, rank)?.expect("every rank passes color 0");
    ddp.rebind(&both)?;
    drop(both);
    c.expect("rebind: every rank holds rank 0's parameters", same_on_every_rank(pg, &params_of(&m)?)?, rank);
    let alone = pg.split(rank, 0)?.expect("each rank has a color of its own");
    ddp.rebind(&alone)?;
    drop(alone);
    let kept = ddp.bucket_plan()?;
    c.expect("rebind keeps the plan", kept == plan, format!("{kept:?} vs {plan:?}"));
    let own = |p: usize, k: usize| (rank + 1) as f32 * (p * 100 + k) as f32;
    fill_grads(&m, own)?;
    backward(&mut ddp)?;
    let want: Vec<f32> = SIZES.iter().enumerate().flat_map(|(p, &n)| (0..n).map(move |k| own(p, k))).collect();
    let got = grads_of(&m)?;
    c.expect("rebind onto a group of one: the gradients are this rank's own", got == want, format!("{got:?}"));
    Ok(())
}

fn mesh(lib: &Library, pg: &ProcessGroup, c: &mut Checks) -> Result<()> {
    let (rank, world) = (pg.rank(), pg.size());
    let cpu = Device::cpu(0);
    c.expect(
        "one host: local rank, local size and hosts",
        (pg.local_rank(), pg.local_size(), pg.num_hosts()) == (rank, world, 1),
        format!("{} of {} on {}", pg.local_rank(), pg.local_size(), pg.num_hosts()),
    );
    let reversed = pg.split(0, -rank)?.expect("every rank passes color 0");
    c.expect("split by key -rank reverses the ranks", reversed.rank() == world - 1 - rank, reversed.rank());
    let mut t = Tensor::from_slice(lib, &[rank as f32], &[1], cpu)?;
    reversed.broadcast(&mut t, 0)?;
    c.expect(
        "broadcast from the reversed group's rank 0",
        t.to_vec::<f32>()? == [(world - 1) as f32],
        format!("{t:?}"),
    );
    drop(reversed);
    let again = pg.shrink()?;
    c.expect(
        "a shrink with no rank lost gives a group of every rank",
        (again.rank(), again.size(), again.lost_ranks()?) == (rank, world, vec![]),
        format!("rank {} of {}", again.rank(), again.size()),
    );
    drop(again);
    let alone = pg.split(if rank == 0 { 7 } else { -1 }, 0)?;
    c.expect(
        "a negative color joins no group; rank 0 is alone in its own",
        alone.as_ref().map(|g| g.size()) == (rank == 0).then_some(1),
        format!("{alone:?}"),
    );
    drop(alone);

    let mesh = DeviceMesh::new(pg, &[world], &["dp"])?;
    c.expect("a 1-D mesh named dp", mesh.ndim() == 1 && mesh.dim_names() == ["dp"], format!("{mesh:?}"));
    c.expect(
        "the mesh's shape and this rank's coordinate",
        mesh.shape()? == [world] && mesh.coordinate()? == [rank],
        "",
    );
    match mesh.group("tp") {
        Err(e) if e.code() == DP_EINVAL && e.message().contains("'tp'") => {
            c.expect(&format!("unknown dimension: {e}"), true, "")
        }
        other => c.expect("an unknown dimension is DP_EINVAL naming it", false, format!("{other:?}")),
    }
    let mut t = Tensor::from_slice(lib, &[(rank + 1) as f32], &[1], cpu)?;
    mesh.group("dp")?.all_reduce(&mut t, ReduceOp::Sum)?;
    c.expect(
        "all_reduce over the mesh's group",
        t.to_vec::<f32>()? == [(world * (world + 1) / 2) as f32],
        format!("{t:?}"),
    );
    drop(mesh);
    match DeviceMesh::new(pg, &[world + 1], &[]) {
        Err(e) if e.code() == DP_EINVAL && e.message().contains("'shape'") => {
            c.expect(&format!("a wrong shape: {e}"), true, "")
        }
        other => c.expect("a shape not the world size is DP_EINVAL naming it", false, format!("{other:?}")),
    }

    let hosts = DeviceMesh::by_host(pg)?;
    let local = hosts.group("local")?;
    c.expect("by host: one row of the world", hosts.shape()? == [1, world], format!("{hosts:?}"));
    c.expect(
        "the local group is this host's, on shm",
        local.size() == world && local.backend() == "shm",
        local.backend(),
    );
    c.expect("one host: the host group is this rank alone", hosts.group("host")?.size() == 1, "");
    // HSDP on the by-host mesh: shards over "local", rank 0's values (init_sync).
    let mut m = Module::new(lib)?;
    m.register_parameter("w", &Tensor::from_slice(lib, &[rank as f32, 1.0, 2.0, 3.0], &[4], cpu)?, true)?;
    let f = Fsdp::on_mesh(&m, &hosts, &FsdpOptions::default())?;
    let shard = f.shard(0)?.to_vec::<f32>()?;
    c.expect(
        "the shard on the mesh's local group",
        shard == [(2 * rank) as f32, (2 * rank + 1) as f32],
        format!("{shard:?}"),
    );
    drop(f);
    Ok(())
}

fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let run = |c: &mut Checks| -> Result<()> {
        let lib = Library::open(None)?;
        let pg = ProcessGroup::from_env(&lib)?;
        c.rank = pg.rank() as usize;
        match scenario.as_str() {
            "collectives" => collectives(&lib, &pg, c)?,
            "join" => join(&lib, &pg, c, true)?,
            "join-active" => join(&lib, &pg, c, false)?,
            "bucket-reduced" => bucket_reduced(&lib, &pg, c)?,
            "bucket-reduced-error" => bucket_reduced_error(&lib, &pg, c)?,
            "stream-marks" => stream_marks(&lib, &pg, c)?,
            "mesh" => mesh(&lib, &pg, c)?,
            "rebind" => rebind(&lib, &pg, c)?,
            _ => return Err(Error::new(DP_EINVAL, format!("scenario: unknown '{scenario}'"))),
        }
        pg.barrier()
    };
    let mut c = Checks { rank: 0, failures: 0 };
    if let Err(e) = run(&mut c) {
        eprintln!("FAIL: rank {}: {scenario}: {e}", c.rank);
        c.failures += 1;
    }
    if c.failures == 0 {
        println!("rank {}: {scenario} passed", c.rank);
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
