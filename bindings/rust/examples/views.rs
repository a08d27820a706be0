//! Slices of one storage through several handles: a mutable slice is
//! exclusive whichever handle it comes through (two `Module::grad` handles,
//! a registered tensor and `Module::parameter`), also across threads.
//!
//!   DP_LIBRARY=path/to/libdparallel.so views

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};

use dparallel::comm::broadcast;
use dparallel::{
    Ddp, DdpOptions, Device, Fsdp, FsdpOptions, Library, Module, ProcessGroup, ProcessGroupOptions, ReduceOp, Result,
    Store, Tensor, DP_ESTATE,
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

fn refused<T>(r: &Result<T>) -> bool {
    matches!(r, Err(e) if e.code() == DP_ESTATE && e.message().contains("borrowed"))
}

fn refused_during_call<T>(r: &Result<T>) -> bool {
    matches!(r, Err(e) if e.code() == DP_ESTATE && e.message().contains("library call in progress"))
}

fn describe<T: std::fmt::Debug>(r: &Result<T>) -> String {
    match r {
        Ok(v) => format!("granted {v:?}"),
        Err(e) => format!("{e}"),
    }
}

fn run() -> Result<usize> {
    let lib = Library::open(None)?;
    let mut c = Checks { failures: 0 };
    let w = Tensor::from_slice(&lib, &[1.0f32, 2.0, 3.0, 4.0], &[4], Device::cpu(0))?;
    let mut m = Module::new(&lib)?;
    m.register_parameter("w", &w, true)?;

    // Two gradient handles over one storage.
    let mut g1 = m.grad("w")?;
    let mut g2 = m.grad("w")?;
    {
        let mut s1 = g1.as_mut_slice::<f32>()?;
        s1[0] = 5.0;
        let second = g2.as_mut_slice::<f32>();
        c.expect(
            "a second mutable slice of one gradient through another handle is refused",
            refused(&second),
            describe(&second),
        );
        drop(second);
        let shared = g2.as_slice::<f32>();
        c.expect(
            "a shared slice beside a mutable one through another handle is refused",
            refused(&shared),
            describe(&shared),
        );
        drop(shared);
        let copied = g2.copy_from(&[9.0f32; 4]);
        c.expect(
            "copy_from through another handle under a mutable slice is refused",
            refused(&copied),
            describe(&copied),
        );
        let mut out = [0.0f32; 4];
        let read = g2.copy_to(&mut out);
        c.expect("copy_to through another handle under a mutable slice is refused", refused(&read), describe(&read));
        c.expect("the mutable slice still holds what it wrote", s1[0] == 5.0, format!("{:?}", &*s1));
    }
    let again = g2.as_mut_slice::<f32>().map(|mut s| {
        s[1] = 6.0;
        s.to_vec()
    });
    c.expect(
        "once the first slice is dropped the other handle gets one",
        matches!(&again, Ok(v) if v[..2] == [5.0, 6.0]),
        describe(&again),
    );

    // Shared slices coexist; a write through any handle waits for them to go.
    {
        let a = g1.as_slice::<f32>()?;
        let b = g2.as_slice::<f32>()?;
        c.expect("shared slices through two handles coexist", a[..] == b[..], format!("{a:?} {b:?}"));
        let write = g2.copy_from(&[0.0f32; 4]);
        c.expect("copy_from under a shared slice of another handle is refused", refused(&write), describe(&write));
        let mut g3 = m.grad("w")?;
        let third = g3.as_mut_slice::<f32>();
        c.expect("a mutable slice under shared ones is refused", refused(&third), describe(&third));
    }

    // A registered tensor and the module's parameter handle are one storage too.
    let mut w_alias = w;
    let mut p = m.parameter("w")?;
    {
        let ps = p.as_mut_slice::<f32>()?;
        let via_registered = w_alias.as_slice::<f32>();
        c.expect(
            "the registered tensor's slice is refused under the parameter's mutable one",
            refused(&via_registered),
            describe(&via_registered),
        );
        drop(ps);
    }
    c.expect("a slice is granted once the other is gone", w_alias.as_mut_slice::<f32>().is_ok(), "refused");

    // The check is per storage: other tensors are not affected.
    let mut other = Tensor::from_slice(&lib, &[0.0f32; 4], &[4], Device::cpu(0))?;
    {
        let _held = p.as_mut_slice::<f32>()?;
        c.expect(
            "a mutable slice of another storage is granted meanwhile",
            other.as_mut_slice::<f32>().is_ok(),
            "refused",
        );
    }

    // Collectives write (and read) the memory while they run: refused while
    // another handle's slice covers it.
    let path = std::env::temp_dir().join(format!("dp-rust-views-{}", std::process::id()));
    let path = path.to_str().expect("a UTF-8 temporary path").to_string();
    let _ = std::fs::remove_file(&path);
    let store = Store::file(&lib, &path, 1)?;
    let options = ProcessGroupOptions { rank: Some(0), world_size: Some(1), store: Some(&store), ..Default::default() };
    let pg = ProcessGroup::new(&lib, &options)?;
    {
        let mut g5 = m.grad("w")?;
        let held = g1.as_slice::<f32>()?;
        let reduced = pg.all_reduce(&mut g5, ReduceOp::Sum);
        c.expect(
            "all_reduce of a gradient another handle's slice reads is refused",
            refused(&reduced),
            describe(&reduced),
        );
        let started = pg.scope(|s| s.all_reduce_async(&mut g5, ReduceOp::Sum).map(|w| w.wait()));
        c.expect(
            "all_reduce_async of it is refused too",
            matches!(&started, Err(e) if e.code() == DP_ESTATE),
            format!("{:?}", started.map(|_| ())),
        );
        drop(held);
        let reduced = pg.all_reduce(&mut g5, ReduceOp::Sum);
        c.expect("the all_reduce runs once the slice is gone", reduced.is_ok(), describe(&reduced));
        // While an async collective runs, the memory stays out of reach.
        pg.scope(|s| -> Result<()> {
            let work = s.all_reduce_async(&mut g5, ReduceOp::Sum)?;
            let during = g1.as_slice::<f32>().map(|v| v.len());
            c.expect(
                "a slice is refused while an async collective on the memory may run",
                refused(&during),
                describe(&during),
            );
            work.wait()
        })?;
        c.expect("a slice is granted once the scope is over", g1.as_slice::<f32>().is_ok(), "refused");
    }

    // Calls that write the module's memory on their own are refused while a
    // slice of it lives, whichever handle the slice comes through; calls
    // that read it only under a mutable slice.
    let saved = format!("{path}.safetensors");
    m.save(&saved)?;
    let mut ddp = Ddp::new(&m, &pg, &DdpOptions::default())?;
    ddp.pre_forward()?;
    {
        let mut g6 = m.grad("w")?;
        let mut held = g6.as_mut_slice::<f32>()?;
        held.fill(7.0);
        let zeroed = m.zero_grad();
        c.expect("zero_grad under a mutable slice of a gradient is refused", refused(&zeroed), describe(&zeroed));
        let marked = ddp.mark_grad_ready("w");
        c.expect("DDP mark_grad_ready under it is refused", refused(&marked), describe(&marked));
        let finished = ddp.finish_backward();
        c.expect("DDP finish_backward under it is refused", refused(&finished), describe(&finished));
        let copies = broadcast(&m.grad("w")?, &[Device::cpu(0)]);
        c.expect(
            "broadcast (a read) of the gradient under a mutable slice is refused",
            refused(&copies),
            describe(&copies.map(|v| v.len())),
        );
        c.expect("the refused calls left the slice's values alone", held[..] == [7.0; 4], format!("{:?}", &*held));
    }
    {
        let marked = ddp.mark_grad_ready("w").and_then(|()| ddp.finish_backward());
        c.expect("DDP's step runs once the slice is gone", marked.is_ok(), describe(&marked));
        m.zero_grad()?;
        c.expect("zero_grad runs once the slice is gone", m.grad("w")?.to_vec::<f32>()? == [0.0; 4], "not zeroed");
    }
    {
        let held = p.as_slice::<f32>()?;
        let loaded = m.load(&saved, true);
        c.expect("load under a shared slice of a parameter is refused", refused(&loaded), describe(&loaded));
        let read = m.save(&saved);
        c.expect("save (a read) under a shared slice of a parameter is fine", read.is_ok(), describe(&read));
        drop(held);
        let mut held = p.as_mut_slice::<f32>()?;
        held[0] = 8.0;
        let read = m.save(&saved);
        c.expect("save under a mutable slice of a parameter is refused", refused(&read), describe(&read));
        let loaded = m.load(&saved, true);
        c.expect("load under it is refused", refused(&loaded), describe(&loaded));
        c.expect("and leaves the parameter as the slice wrote it", held[0] == 8.0, format!("{:?}", &*held));
    }
    let loaded = m.load(&saved, true);
    c.expect("load runs once the slice is gone", loaded.is_ok(), describe(&loaded));
    let _ = std::fs::remove_file(&saved);

    // While a call runs, slices of the memory it writes are refused to other
    // threads (the closures it runs itself may take them).
    let input = Tensor::from_slice(&lib, &[1.0f32, 2.0], &[2, 1], Device::cpu(0))?;
    let other_handle = m.retain()?;
    let outcome = m.data_parallel(&input, &[Device::cpu(0)], Device::cpu(0), 0, |r| {
        let in_closure = r.module.grad("w")?.as_mut_slice::<f32>().map(|s| s.len());
        let other_thread = std::thread::scope(|s| {
            s.spawn(|| other_handle.grad("w").and_then(|mut g| g.as_mut_slice::<f32>().map(|s| s.len())))
                .join()
                .unwrap()
        });
        let during = refused_during_call(&other_thread);
        if in_closure.is_err() || !during {
            return Err(dparallel::Error::new(
                dparallel::DP_EINVAL,
                format!("in the closure: {}; another thread: {}", describe(&in_closure), describe(&other_thread)),
            ));
        }
        Tensor::from_slice(r.module.library(), &[0.0f32], &[1], r.device)
    });
    c.expect(
        "during data_parallel another thread's slice of the gradient is refused, the closure's replica granted",
        outcome.is_ok(),
        describe(&outcome.map(|_| ())),
    );
    drop(ddp);

    // FSDP: its backward steps write the shard gradients.
    let mut sharded = Module::new(&lib)?;
    sharded.register_parameter("v", &Tensor::from_slice(&lib, &[1.0f32; 4], &[4], Device::cpu(0))?, true)?;
    let mut fsdp = Fsdp::new(&sharded, &pg, &FsdpOptions::default())?;
    fsdp.unshard()?;
    sharded.grad("v")?.copy_from(&[2.0f32; 4])?;
    {
        let mut shard_grad = fsdp.shard_grad(0)?;
        let mut held = shard_grad.as_mut_slice::<f32>()?;
        held.fill(3.0);
        let stepped = fsdp.post_backward();
        c.expect(
            "FSDP post_backward under a slice of a shard gradient is refused",
            refused(&stepped),
            describe(&stepped),
        );
        c.expect("and leaves the shard gradient alone", held[..] == [3.0; 4], format!("{:?}", &*held));
    }
    let stepped = fsdp.post_backward().and_then(|()| fsdp.finish_backward());
    c.expect("FSDP's backward steps run once the slice is gone", stepped.is_ok(), describe(&stepped));
    let reduced = fsdp.shard_grad(0)?.to_vec::<f32>()?;
    c.expect("and add the gradient to what the slice wrote", reduced == [5.0; 4], format!("{reduced:?}"));
    drop(fsdp);
    drop(pg);
    drop(store);
    let _ = std::fs::remove_file(&path);

    // Threads racing for mutable slices of one gradient, each through its own
    // handle: a granted slice is exclusive, so unsynchronized increments of
    // its first element add up to the number granted.
    m.zero_grad()?;
    let granted = AtomicUsize::new(0);
    let threads = 8;
    let rounds = 1000;
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let m = &m;
                let granted = &granted;
                scope.spawn(move || -> Result<()> {
                    let mut g = m.grad("w")?;
                    for _ in 0..rounds {
                        match g.as_mut_slice::<f32>() {
                            Ok(mut s) => {
                                let v = s[0];
                                std::hint::black_box(&mut s);
                                s[0] = v + 1.0;
                                granted.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if e.code() == DP_ESTATE => {}
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("a racing thread panicked")?;
        }
        Ok(())
    })?;
    let total = m.grad("w")?.to_vec::<f32>()?[0] as usize;
    let granted = granted.load(Ordering::Relaxed);
    c.expect(
        "racing threads' granted slices were exclusive (no increment lost)",
        total == granted && granted > 0,
        format!("{total} increments seen, {granted} slices granted"),
    );

    // The unchecked path stays available, as unsafe.
    let mut g4 = m.grad("w")?;
    let _held = g1.as_slice::<f32>()?;
    let unchecked = unsafe { g4.as_mut_slice_unchecked::<f32>() }.map(|s| s.len());
    c.expect("as_mut_slice_unchecked skips the check", matches!(unchecked, Ok(4)), describe(&unchecked));
    Ok(c.failures)
}

fn main() -> ExitCode {
    match run() {
        Ok(0) => {
            println!("views passed");
            ExitCode::SUCCESS
        }
        Ok(n) => {
            eprintln!("{n} failure(s)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("views: {e}");
            ExitCode::FAILURE
        }
    }
}
