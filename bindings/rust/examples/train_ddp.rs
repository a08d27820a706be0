//! DDP training of the tanh MLP, one process per rank, under dp-run:
//!
//!   DP_LIBRARY=path/to/libdparallel.so dp-run -n 2 train_ddp
//!
//! Every rank starts from its own random parameters (dp_ddp_create gives it
//! rank 0's), trains on its shard of each batch in two micro-batches (the
//! first under no_sync, so gradients accumulate locally), marks each layer's
//! gradients ready during the backward, last layer first, and after
//! finish_backward holds the average. Each rank then checks its parameters
//! against single-process training on the full batch.
//!
//!   train_ddp --comm-hook         the buckets are averaged by a Rust closure
//!                                 (all_reduce, then divide) instead
//!   train_ddp --comm-hook-panics  every rank's hook panics: finish_backward
//!                                 is DP_EUSER with the panic's message

mod mlp;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use dparallel::{DType, Ddp, DdpOptions, Device, Library, Module, ProcessGroup, ReduceOp, Result, Tensor, DP_EUSER};
use mlp::CONFIG;

#[derive(Clone, Copy, PartialEq)]
enum Hook {
    Library,
    Closure,
    Panics,
}

fn run(hook: Hook) -> Result<bool> {
    let c = CONFIG;
    let lib = Library::open(None)?;
    let pg = ProcessGroup::from_env(&lib)?;
    let (rank, world) = (pg.rank() as usize, pg.size() as usize);
    let say = |text: String| println!("{text}");
    let mut ok = true;

    let mut model = mlp::build_module(&lib, &c, &mlp::init_network(&c, 42 + rank as u64), Device::cpu(0))?;
    // Small buckets, so that several reductions overlap the backward.
    let options = DdpOptions { bucket_cap_mb: 0.002, first_bucket_cap_mb: 0.001, ..DdpOptions::default() };
    let hook_calls = Arc::new(Mutex::new(BTreeMap::<usize, usize>::new()));
    let mut ddp = match hook {
        Hook::Library => Ddp::new(&model, &pg, &options)?,
        Hook::Closure => {
            let calls = hook_calls.clone();
            Ddp::with_comm_hook(&model, &pg, &options, move |group, index, bucket| {
                *calls.lock().unwrap().entry(index).or_default() += 1;
                group.all_reduce(bucket, ReduceOp::Sum)?;
                let size = group.size() as f32;
                bucket.as_mut_slice::<f32>()?.iter_mut().for_each(|g| *g /= size);
                Ok(())
            })?
        }
        Hook::Panics => {
            Ddp::with_comm_hook(&model, &pg, &options, |_, index, _| panic!("hook panic on bucket {index}"))?
        }
    };
    let buckets = ddp.num_buckets();
    say(format!("{world} ranks over {}, {} parameters in {buckets} buckets", pg.backend(), model.num_parameters()));
    if buckets < 2 {
        eprintln!("FAIL: rank {rank}: {buckets} buckets, want several");
        ok = false;
    }

    // init_sync: every rank now holds rank 0's initial parameters.
    let init = mlp::init_network(&c, 42);
    let (bad, _) = mlp::compare(&c, &model, &init)?;
    if bad != 0 {
        eprintln!("FAIL: rank {rank}: {bad} parameters differ from rank 0's after Ddp::new");
        ok = false;
    }

    if hook == Hook::Panics {
        // Every rank's hook panics, so no rank waits on another.
        println!("(panic messages from the comm hook follow)");
        let rows = mlp::batch(&c, &mlp::make_dataset(&c), 0);
        ddp.pre_forward()?;
        let shard = &rows[c.batch * rank / world * 2 * c.width..c.batch * (rank + 1) / world * 2 * c.width];
        mlp::module_forward_backward(&c, &model, shard, shard.len() / (2 * c.width), world, |layer| {
            ddp.mark_grad_ready(&mlp::weight_name(layer))?;
            ddp.mark_grad_ready(&mlp::bias_name(layer))
        })?;
        return Ok(match ddp.finish_backward() {
            Err(e) if e.code() == DP_EUSER && e.message().contains("the comm hook panicked: hook panic on bucket") => {
                say(format!("ok: finish_backward: {e}"));
                ok
            }
            other => {
                eprintln!("FAIL: rank {rank}: finish_backward gave {other:?}, want DP_EUSER with the hook's panic");
                false
            }
        });
    }

    let data = mlp::make_dataset(&c);
    let (expected, reference_losses) = mlp::reference_training(&c, &data, &init);
    let pitch = 2 * c.width;
    let (lo, hi) = (c.batch * rank / world, c.batch * (rank + 1) / world);
    let mid = (lo + hi) / 2;
    let mut synced_buckets = 0;
    let mut loss_sum = Tensor::zeros(&lib, DType::F32, &[1], Device::cpu(0))?;
    for step in 0..c.steps {
        let rows = mlp::batch(&c, &data, step);
        let mut loss = 0.0;
        // Micro-batch [lo, mid) only accumulates; [mid, hi) reduces the sum.
        for (a, b, sync) in [(lo, mid, false), (mid, hi, true)] {
            ddp.set_requires_gradient_sync(sync)?;
            ddp.pre_forward()?;
            let shard = &rows[a * pitch..b * pitch];
            loss += mlp::module_forward_backward(&c, &model, shard, b - a, world, |layer| {
                ddp.mark_grad_ready(&mlp::weight_name(layer))?;
                ddp.mark_grad_ready(&mlp::bias_name(layer))
            })?;
            if sync {
                // The plan in force for this backward (it is rebuilt once, after the first).
                synced_buckets += ddp.num_buckets();
            }
            ddp.finish_backward()?;
            // Unsynced gradients are this rank's own; synced ones the same everywhere.
            let (low, high) = gradient_checksum_range(&model, &pg)?;
            if sync != (low == high) {
                eprintln!(
                    "FAIL: rank {rank}: step {}: gradient sums over the ranks span [{low}, {high}] after a{} backward",
                    step + 1,
                    if sync { " synced" } else { "n unsynced" }
                );
                ok = false;
            }
        }
        mlp::module_sgd(&model, c.lr)?;
        // The backward accumulates: each step starts from zero.
        model.zero_grad()?;

        // The whole batch's loss: the ranks' parts summed.
        loss_sum.as_mut_slice::<f32>()?[0] = loss as f32;
        pg.scope(|s| s.all_reduce_async(&mut loss_sum, ReduceOp::Sum)?.wait())?;
        let total = loss_sum.as_slice::<f32>()?[0] as f64;
        let want = reference_losses[step];
        if rank == 0 {
            say(format!("step {:2}/{}  loss {total:.6} (single process {want:.6})", step + 1, c.steps));
        }
        if (total - want).abs() > 1e-5 * want.abs() + 1e-7 {
            eprintln!("FAIL: rank {rank}: step {}: loss {total}, single-process loss {want}", step + 1);
            ok = false;
        }
    }
    let stats = ddp.last_stats()?;
    if stats.num_buckets != ddp.num_buckets() {
        eprintln!("FAIL: rank {rank}: stats count {} buckets, the plan {}", stats.num_buckets, ddp.num_buckets());
        ok = false;
    }
    if hook == Hook::Closure {
        // One call per bucket of every synced backward, and every bucket reduced.
        let calls = hook_calls.lock().unwrap().clone();
        let total: usize = calls.values().sum();
        let all: Vec<usize> = (0..ddp.num_buckets()).collect();
        say(format!("the Rust comm hook reduced {total} buckets: {calls:?}"));
        if calls.keys().copied().collect::<Vec<_>>() != all || total != synced_buckets {
            eprintln!("FAIL: rank {rank}: hook calls per bucket {calls:?}, want {synced_buckets} in all over {all:?}");
            ok = false;
        }
    }
    let (bad, worst) = mlp::compare(&c, &model, &expected)?;
    say(format!(
        "parity with single-process training on the full batch: max |difference| {worst:.3e}, {bad} values outside rtol {} atol {}: {}",
        mlp::RTOL,
        mlp::ATOL,
        if bad == 0 { "OK" } else { "FAIL" }
    ));
    drop(ddp);
    pg.barrier()?;
    Ok(ok && bad == 0)
}

/// The smallest and largest over the ranks of this rank's gradient sum.
fn gradient_checksum_range(model: &Module, pg: &ProcessGroup) -> Result<(f64, f64)> {
    let mut sum = 0.0f64;
    for (name, _) in model.parameters()? {
        sum += model.grad(&name)?.as_slice::<f32>()?.iter().map(|&g| g as f64).sum::<f64>();
    }
    let mut t = Tensor::from_slice(model.library(), &[sum, -sum], &[2], Device::cpu(0))?;
    pg.all_reduce(&mut t, ReduceOp::Max)?;
    let v = t.as_slice::<f64>()?;
    Ok((-v[1], v[0]))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hook = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => Hook::Library,
        ["--comm-hook"] => Hook::Closure,
        ["--comm-hook-panics"] => Hook::Panics,
        _ => {
            eprintln!("usage: train_ddp [--comm-hook | --comm-hook-panics]");
            return ExitCode::from(2);
        }
    };
    match run(hook) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("train_ddp: {e}");
            ExitCode::FAILURE
        }
    }
}
