//! What a closure or a collective uses stays alive while the library may
//! still use it, one scenario per run:
//!
//!   DP_LIBRARY=path/to/libdparallel.so lifetimes hook-timeout
//!   DP_LIBRARY=path/to/libdparallel.so lifetimes drop-in-hook
//!   DP_LIBRARY=path/to/libdparallel.so dp-run -n 2 lifetimes work-scope
//!
//!   hook-timeout  one rank, a group timeout of 500 ms: a comm hook waits
//!                 until the Ddp is dropped, so finish_backward is
//!                 DP_ETIMEOUT; the hook then reads what it captured
//!   drop-in-hook  one rank: the comm hook holds the last reference to its
//!                 own Ddp and drops it, then reads what it captured
//!   work-scope    two ranks: collectives started in a ProcessGroup::scope
//!                 whose Work is forgotten, or whose closure panics, have
//!                 written their tensors once the scope is over
//!
//! The closures capture a large vector (its memory is returned to the system
//! when it is freed): reading it after it was freed is a crash, not a wrong
//! sum. Prints "SCENARIO passed" when every check held.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use dparallel::{
    DType, Ddp, DdpOptions, Device, Error, Library, Module, ProcessGroup, ProcessGroupOptions, ReduceOp, Result, Store,
    Tensor, DP_EINVAL, DP_ETIMEOUT,
};

struct Checks {
    failures: usize,
}

impl Checks {
    fn expect(&mut self, what: &str, ok: bool, detail: impl std::fmt::Display) {
        if ok {
            println!("ok: {what}");
        } else {
            eprintln!("FAIL: {what}: {detail}");
            self.failures += 1;
        }
    }
}

/// 32 MiB of known values, and their sum.
fn captured() -> (Vec<u64>, u64) {
    let n = 4u64 << 20;
    ((0..n).collect(), n * (n - 1) / 2)
}

/// A one-rank group over a file store.
fn one_rank(lib: &Library, name: &str, timeout_ms: i32) -> Result<(Store, ProcessGroup)> {
    let path = std::env::temp_dir().join(format!("dp-rust-{name}-{}", std::process::id()));
    let path = path.to_str().expect("a UTF-8 temporary path").to_string();
    let _ = std::fs::remove_file(&path);
    let store = Store::file(lib, &path, 1)?;
    let options = ProcessGroupOptions {
        rank: Some(0),
        world_size: Some(1),
        store: Some(&store),
        timeout_ms,
        ..Default::default()
    };
    let pg = ProcessGroup::new(lib, &options)?;
    Ok((store, pg))
}

fn one_param(lib: &Library) -> Result<Module> {
    let mut m = Module::new(lib)?;
    m.register_parameter("w", &Tensor::from_slice(lib, &[1.0f32, 2.0], &[2], Device::cpu(0))?, true)?;
    Ok(m)
}

fn hook_timeout(lib: &Library, c: &mut Checks) -> Result<()> {
    let (_store, pg) = one_rank(lib, "hook-timeout", 500)?;
    let m = one_param(lib)?;
    let (data, want) = captured();
    let (tx, rx) = mpsc::channel::<u64>();
    let tx = Mutex::new(tx);
    // The hook returns only once the Ddp is dropped: finish_backward gives
    // up first (after the timeout plus 3 s).
    let dropped = Arc::new((Mutex::new(false), Condvar::new()));
    let signal = dropped.clone();
    let mut ddp = Ddp::with_comm_hook(&m, &pg, &DdpOptions::default(), move |_pg, _bucket, _flat| {
        let signal = signal.clone(); // on this frame: the wait itself never touches the closure
        let mut done = signal.0.lock().unwrap();
        while !*done {
            done = signal.1.wait(done).unwrap();
        }
        let sum: u64 = data.iter().sum();
        let _ = tx.lock().unwrap().send(sum);
        Ok(())
    })?;
    ddp.pre_forward()?;
    m.grad("w")?.as_mut_slice::<f32>()?.copy_from_slice(&[1.0, 1.0]);
    ddp.mark_grad_ready("w")?;
    let finished = ddp.finish_backward();
    c.expect(
        "finish_backward while the hook waits is DP_ETIMEOUT",
        matches!(&finished, Err(e) if e.code() == DP_ETIMEOUT),
        format!("{finished:?}"),
    );
    drop(ddp);
    *dropped.0.lock().unwrap() = true;
    dropped.1.notify_all();
    let got = rx.recv();
    c.expect("the hook, left running by the drop, reads what it captured", got == Ok(want), format!("{got:?}"));
    Ok(())
}

fn drop_in_hook(lib: &Library, c: &mut Checks) -> Result<()> {
    let (_store, pg) = one_rank(lib, "drop-in-hook", 300_000)?;
    let m = one_param(lib)?;
    let (data, want) = captured();
    let (tx, rx) = mpsc::channel::<(bool, u64)>();
    let tx = Mutex::new(tx);
    let slot: Arc<Mutex<Option<Arc<Ddp>>>> = Arc::new(Mutex::new(None));
    let own = slot.clone();
    let mut ddp = Ddp::with_comm_hook(&m, &pg, &DdpOptions::default(), move |_pg, _bucket, _flat| {
        let last = own.lock().unwrap().take();
        let had = last.is_some();
        drop(last); // the last reference: the Ddp is dropped here, in its own hook
        let sum: u64 = data.iter().sum();
        let _ = tx.lock().unwrap().send((had, sum));
        Ok(())
    })?;
    ddp.pre_forward()?;
    m.grad("w")?.as_mut_slice::<f32>()?.copy_from_slice(&[1.0, 1.0]);
    let ddp = Arc::new(ddp);
    *slot.lock().unwrap() = Some(ddp.clone());
    drop(slot);
    ddp.mark_grad_ready("w")?;
    drop(ddp);
    let got = rx.recv();
    c.expect(
        "a hook that drops the last reference to its Ddp goes on with what it captured",
        got == Ok((true, want)),
        format!("{got:?}"),
    );
    Ok(())
}

/// One rank arrives late, so that the collectives are still running when
/// the scope's closure ends on the other.
fn late(pg: &ProcessGroup, rank: i32) {
    if pg.rank() == rank {
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn work_scope(lib: &Library, c: &mut Checks) -> Result<()> {
    let pg = ProcessGroup::from_env(lib)?;
    let (rank, world) = (pg.rank(), pg.size());
    let last = world - 1;
    let cpu = Device::cpu(0);

    // A forgotten all_reduce: the scope waits for it.
    let mut t = Tensor::from_slice(lib, &[(rank + 1) as f32; 4], &[4], cpu)?;
    late(&pg, last);
    pg.scope(|s| -> Result<()> {
        std::mem::forget(s.all_reduce_async(&mut t, ReduceOp::Sum)?);
        Ok(())
    })?;
    let sum = (world * (world + 1) / 2) as f32;
    let got = t.to_vec::<f32>()?;
    c.expect(
        &format!("rank {rank}: a forgotten all_reduce_async is done when the scope returns"),
        got == [sum; 4],
        format!("{got:?}"),
    );

    // A forgotten all_gather and a reduce_scatter waited for, in one scope.
    let input = Tensor::from_slice(lib, &[rank as f64, -(rank as f64)], &[2], cpu)?;
    let mut outputs: Vec<Tensor> =
        (0..world).map(|_| Tensor::zeros(lib, DType::F64, &[2], cpu)).collect::<Result<_>>()?;
    let inputs: Vec<Tensor> =
        (0..world).map(|j| Tensor::from_slice(lib, &[(10 * j + rank) as f32], &[1], cpu)).collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let mut scattered = Tensor::zeros(lib, DType::F32, &[1], cpu)?;
    late(&pg, 0);
    pg.scope(|s| {
        std::mem::forget(s.all_gather_async(&input, &mut outputs)?);
        s.reduce_scatter_async(&refs, &mut scattered, ReduceOp::Max)?.wait()
    })?;
    let gathered: Vec<Vec<f64>> = outputs.iter().map(|t| t.to_vec::<f64>()).collect::<Result<_>>()?;
    let want: Vec<Vec<f64>> = (0..world).map(|r| vec![r as f64, -(r as f64)]).collect();
    c.expect(
        &format!("rank {rank}: a forgotten all_gather_async is done when the scope returns"),
        gathered == want,
        format!("{gathered:?}"),
    );
    let got = scattered.to_vec::<f32>()?;
    c.expect(
        &format!("rank {rank}: reduce_scatter_async waited for in the same scope"),
        got == [(10 * rank + last) as f32],
        format!("{got:?}"),
    );

    // A closure that forgets its broadcast and panics: the scope waits, then
    // the panic goes on.
    let mut b = Tensor::from_slice(lib, &[rank as i64 * 7, 1, 2], &[3], cpu)?;
    late(&pg, last);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        pg.scope(|s| -> Result<()> {
            std::mem::forget(s.broadcast_async(&mut b, last)?);
            panic!("the closure panics with its broadcast running (expected)");
        })
    }));
    c.expect(&format!("rank {rank}: the closure's panic goes on out of the scope"), outcome.is_err(), "it returned");
    let got = b.to_vec::<i64>()?;
    c.expect(
        &format!("rank {rank}: a broadcast_async of a panicking scope is done when the panic leaves it"),
        got == [last as i64 * 7, 1, 2],
        format!("{got:?}"),
    );
    pg.barrier()
}

fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let mut c = Checks { failures: 0 };
    let run = |c: &mut Checks| -> Result<()> {
        let lib = Library::open(None)?;
        match scenario.as_str() {
            "hook-timeout" => hook_timeout(&lib, c),
            "drop-in-hook" => drop_in_hook(&lib, c),
            "work-scope" => work_scope(&lib, c),
            _ => Err(Error::new(DP_EINVAL, format!("scenario: unknown '{scenario}'"))),
        }
    };
    if let Err(e) = run(&mut c) {
        eprintln!("FAIL: {scenario}: {e}");
        c.failures += 1;
    }
    if c.failures == 0 {
        println!("{scenario} passed");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
