//! Work a call leaves running keeps its memory out of reach of slices until
//! the call that completes it: DDP gradients marked ready until
//! finish_backward (or a failed one, or the dropped Ddp), the shards an
//! unshard_async reads until wait_unshard, the shard gradients of a
//! post_backward until finish_backward, a DLPack export until its deleter.
//!
//!   DP_LIBRARY=path/to/libdparallel.so outliving ddp|fsdp|dlpack

use std::process::ExitCode;

use dparallel::{
    Ddp, DdpHooks, DdpOptions, Device, Fsdp, FsdpOptions, Library, Module, ProcessGroup, ProcessGroupOptions, Result,
    Store, Stream, Tensor, DP_ESTATE,
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

/// Refused because of work left running until `until`.
fn held_until<T>(r: &Result<T>, until: &str) -> bool {
    matches!(r, Err(e) if e.code() == DP_ESTATE && e.message().contains(until))
}

fn describe<T: std::fmt::Debug>(r: &Result<T>) -> String {
    match r {
        Ok(v) => format!("granted {v:?}"),
        Err(e) => format!("{e}"),
    }
}

fn mutable_len(t: &mut Tensor) -> Result<usize> {
    t.as_mut_slice::<f32>().map(|s| s.len())
}

fn shared_len(t: &Tensor) -> Result<usize> {
    t.as_slice::<f32>().map(|s| s.len())
}

/// A group of one rank over a file store (nothing to wait for).
struct Solo {
    pg: ProcessGroup,
    _store: Store,
    path: String,
}

impl Solo {
    fn new(lib: &Library, what: &str) -> Result<Solo> {
        let path = std::env::temp_dir().join(format!("dp-rust-outliving-{what}-{}", std::process::id()));
        let path = path.to_str().expect("a UTF-8 temporary path").to_string();
        let _ = std::fs::remove_file(&path);
        let store = Store::file(lib, &path, 1)?;
        let options =
            ProcessGroupOptions { rank: Some(0), world_size: Some(1), store: Some(&store), ..Default::default() };
        let pg = ProcessGroup::new(lib, &options)?;
        Ok(Solo { pg, _store: store, path })
    }
}

impl Drop for Solo {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn two_params(lib: &Library) -> Result<Module> {
    let mut m = Module::new(lib)?;
    m.register_parameter("a", &Tensor::from_slice(lib, &[1.0f32; 4], &[4], Device::cpu(0))?, true)?;
    m.register_parameter("b", &Tensor::from_slice(lib, &[2.0f32; 4], &[4], Device::cpu(0))?, true)?;
    Ok(m)
}

const DDP_UNTIL: &str = "until Ddp::finish_backward";

fn ddp(lib: &Library, c: &mut Checks) -> Result<()> {
    let solo = Solo::new(lib, "ddp")?;
    let m = two_params(lib)?;
    let mut ddp = Ddp::new(&m, &solo.pg, &DdpOptions::default())?;
    ddp.pre_forward()?;
    m.grad("a")?.copy_from(&[3.0f32; 4])?;
    m.grad("b")?.copy_from(&[4.0f32; 4])?;
    ddp.mark_grad_ready("a")?;
    // A handle taken after the mark reaches the same memory.
    let mut a = m.grad("a")?;
    let during = mutable_len(&mut a);
    c.expect(
        "a mutable slice of a gradient marked ready is refused",
        held_until(&during, DDP_UNTIL),
        describe(&during),
    );
    let during = shared_len(&a);
    c.expect("a shared one too (the reduction writes it)", held_until(&during, DDP_UNTIL), describe(&during));
    let copied = a.to_vec::<f32>();
    c.expect("and a copy out of it", held_until(&copied, DDP_UNTIL), describe(&copied));
    let mut b = m.grad("b")?;
    let unmarked = mutable_len(&mut b);
    c.expect("a gradient not yet marked is still the host's", unmarked.is_ok(), describe(&unmarked));
    let twice = ddp.mark_grad_ready("a");
    c.expect("marking it twice fails", matches!(&twice, Err(e) if e.code() == DP_ESTATE), describe(&twice));
    let during = mutable_len(&mut a);
    c.expect("and leaves the first mark's hold", held_until(&during, DDP_UNTIL), describe(&during));
    let replaced = m.retain()?.set_grad("a", Some(&Tensor::zeros(lib, dparallel::DType::F32, &[4], Device::cpu(0))?));
    c.expect(
        "set_grad of a marked gradient is refused (the reduction would write the new one)",
        held_until(&replaced, DDP_UNTIL),
        describe(&replaced),
    );
    ddp.mark_grad_ready_index(1)?;
    let during = mutable_len(&mut b);
    c.expect("a gradient marked by index is refused", held_until(&during, DDP_UNTIL), describe(&during));
    ddp.finish_backward()?;
    let after = a.as_mut_slice::<f32>().map(|s| s.to_vec());
    c.expect(
        "after finish_backward the slice is granted, with the averaged values",
        matches!(&after, Ok(v) if v[..] == [3.0; 4]),
        describe(&after),
    );
    c.expect("and so is the one marked by index", mutable_len(&mut b).is_ok(), "refused");
    let own = Tensor::from_slice(lib, &[3.0f32; 4], &[4], Device::cpu(0))?;
    let replaced = m.retain()?.set_grad("a", Some(&own));
    c.expect("set_grad between backwards is fine", replaced.is_ok(), describe(&replaced));
    a = m.grad("a")?;

    // A stream mark: the host func on the stream is lent the gradient.
    let stream = Stream::new(lib, Device::cpu(0))?;
    ddp.mark_grad_ready("a")?;
    let mut on_stream = m.grad("b")?;
    stream.launch_host_func(move || {
        if let Ok(mut s) = on_stream.as_mut_slice::<f32>() {
            s.fill(6.0);
        }
    })?;
    ddp.mark_grad_ready_stream(1, &stream)?;
    let during = mutable_len(&mut b);
    c.expect("a gradient marked on a stream is refused to the host", held_until(&during, DDP_UNTIL), describe(&during));
    ddp.finish_backward()?;
    let after = b.to_vec::<f32>();
    c.expect(
        "the stream's work wrote it, and it is granted after finish_backward",
        matches!(&after, Ok(v) if v[..] == [6.0; 4]),
        describe(&after),
    );

    // A backward that fails (a parameter left unmarked) is over all the same.
    ddp.mark_grad_ready("a")?;
    let failed = ddp.finish_backward();
    c.expect(
        "finish_backward with b unmarked fails",
        matches!(&failed, Err(e) if e.code() == DP_ESTATE),
        describe(&failed),
    );
    let after = mutable_len(&mut a);
    c.expect("after the failed finish_backward the slice is granted", after.is_ok(), describe(&after));

    // finish_backward refused under a slice leaves the backward in flight.
    ddp.mark_grad_ready("a")?;
    {
        let held = b.as_mut_slice::<f32>()?;
        let refused = ddp.finish_backward();
        c.expect(
            "finish_backward under a slice of another gradient is refused",
            matches!(&refused, Err(e) if e.code() == DP_ESTATE && e.message().contains("borrowed")),
            describe(&refused),
        );
        drop(held);
    }
    let during = mutable_len(&mut a);
    c.expect("and the marked gradient stays held", held_until(&during, DDP_UNTIL), describe(&during));
    ddp.mark_grad_ready("b")?;
    ddp.finish_backward()?;

    // Dropping the Ddp mid-backward waits for the reduction, then frees it.
    ddp.mark_grad_ready("a")?;
    let during = mutable_len(&mut a);
    c.expect("marked again, it is refused", held_until(&during, DDP_UNTIL), describe(&during));
    drop(ddp);
    let after = mutable_len(&mut a);
    c.expect("once the Ddp is dropped mid-backward the slice is granted", after.is_ok(), describe(&after));

    // on_bucket_reduced (the optimizer inside backward) is lent the
    // gradients it is reported.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let lent = m.retain()?;
    let hooks = DdpHooks::new().on_bucket_reduced(move |_, _, _| {
        let sum: f32 = lent.grad("a")?.as_slice::<f32>()?.iter().sum();
        record.lock().unwrap().push(sum);
        Ok(())
    });
    let mut ddp = Ddp::with_hooks(&m, &solo.pg, &DdpOptions::default(), hooks)?;
    ddp.mark_grad_ready("a")?;
    ddp.mark_grad_ready("b")?;
    ddp.finish_backward()?;
    let sums = seen.lock().unwrap().clone();
    c.expect("on_bucket_reduced reads a marked gradient", !sums.is_empty() && sums[0] == 12.0, format!("{sums:?}"));
    drop(ddp);
    Ok(())
}

const UNSHARD_UNTIL: &str = "until Fsdp::wait_unshard";
const POST_UNTIL: &str = "until Fsdp::finish_backward";

fn fsdp(lib: &Library, c: &mut Checks) -> Result<()> {
    let solo = Solo::new(lib, "fsdp")?;
    let mut m = Module::new(lib)?;
    m.register_parameter("v", &Tensor::from_slice(lib, &[1.0f32; 4], &[4], Device::cpu(0))?, true)?;
    let mut fsdp = Fsdp::new(&m, &solo.pg, &FsdpOptions::default())?;
    let mut shard = fsdp.shard(0)?;
    fsdp.unshard_async()?;
    let during = mutable_len(&mut shard);
    c.expect(
        "a mutable slice of a shard while unshard_async's all-gather may read it is refused",
        held_until(&during, UNSHARD_UNTIL),
        describe(&during),
    );
    // The slot holds the shard until the wait.
    let mut slot = m.parameter("v")?;
    let during = mutable_len(&mut slot);
    c.expect("so is one through the module's slot", held_until(&during, UNSHARD_UNTIL), describe(&during));
    let read = shared_len(&shard);
    c.expect("a shared slice of the shard is fine (it is only read)", read.is_ok(), describe(&read));
    fsdp.wait_unshard()?;
    let after = mutable_len(&mut shard);
    c.expect("after wait_unshard the shard's mutable slice is granted", after.is_ok(), describe(&after));
    let full = m.parameter("v")?.to_vec::<f32>();
    c.expect("and the slot holds the full parameter", matches!(&full, Ok(v) if v[..] == [1.0; 4]), describe(&full));

    // The full parameter keeps its address across unshards: a handle kept on
    // it names what the next unshard writes, even while the slot holds the
    // shard, so a slice of it holds that unshard off and is refused while
    // the all-gather writes it.
    let kept = m.parameter("v")?;
    fsdp.reshard()?;
    let zeros = kept.to_vec::<f32>();
    c.expect(
        "a kept full parameter reads zeros while resharded (its pages are given back)",
        matches!(&zeros, Ok(v) if v[..] == [0.0; 4]),
        describe(&zeros),
    );
    {
        let _slice = kept.as_slice::<f32>()?;
        let refused = fsdp.unshard_async();
        c.expect(
            "unshard_async while a slice of the kept full parameter lives is refused",
            matches!(&refused, Err(e) if e.code() == DP_ESTATE),
            describe(&refused),
        );
    }
    fsdp.unshard_async()?;
    let during = shared_len(&kept);
    c.expect(
        "a slice of the kept full parameter while the all-gather writes it is refused",
        held_until(&during, UNSHARD_UNTIL),
        describe(&during),
    );
    fsdp.wait_unshard()?;
    let again = m.parameter("v")?;
    c.expect("the next unshard's full parameter is at the same address", again.data_ptr() == kept.data_ptr(), "moved");
    let refilled = kept.to_vec::<f32>();
    c.expect(
        "and the kept handle reads the refilled values",
        matches!(&refilled, Ok(v) if v[..] == [1.0; 4]),
        describe(&refilled),
    );
    drop((kept, again));

    // Completed by a reshard, or a blocking unshard, too.
    fsdp.reshard()?;
    fsdp.unshard_async()?;
    c.expect("unshard_async again: refused", held_until(&mutable_len(&mut shard), UNSHARD_UNTIL), "granted");
    fsdp.reshard()?;
    c.expect("after reshard it is granted", mutable_len(&mut shard).is_ok(), "refused");
    fsdp.unshard_async()?;
    fsdp.unshard()?;
    c.expect("after a blocking unshard it is granted", mutable_len(&mut shard).is_ok(), "refused");

    // post_backward's reduce-scatter writes the shard gradients and reads
    // the full ones until finish_backward.
    let mut full_grad = m.grad("v")?;
    full_grad.copy_from(&[2.0f32; 4])?;
    let shard_grad = fsdp.shard_grad(0)?;
    fsdp.post_backward()?;
    let during = shared_len(&shard_grad);
    c.expect(
        "a slice of a shard gradient after post_backward is refused",
        held_until(&during, POST_UNTIL),
        describe(&during),
    );
    let during = mutable_len(&mut full_grad);
    c.expect(
        "a mutable slice of the full gradient it reads is refused",
        held_until(&during, POST_UNTIL),
        describe(&during),
    );
    fsdp.finish_backward()?;
    let after = shard_grad.as_slice::<f32>().map(|s| s.to_vec());
    c.expect(
        "after finish_backward the shard gradient is granted, reduced",
        matches!(&after, Ok(v) if v[..] == [2.0; 4]),
        describe(&after),
    );
    c.expect("and the full gradient", mutable_len(&mut full_grad).is_ok(), "refused");

    // The mark that completes the set runs post_backward: its reduce-scatter
    // is held the same way, also past a second mark, refused.
    fsdp.unshard()?;
    m.grad("v")?.copy_from(&[4.0f32; 4])?;
    fsdp.mark_grad_ready("v")?;
    let again = fsdp.mark_grad_ready("v");
    c.expect("a second mark is DP_ESTATE", matches!(&again, Err(e) if e.code() == DP_ESTATE), describe(&again));
    let during = shared_len(&shard_grad);
    c.expect(
        "a slice of a shard gradient after the last mark is refused",
        held_until(&during, POST_UNTIL),
        describe(&during),
    );
    fsdp.finish_backward()?;
    let after = shard_grad.as_slice::<f32>().map(|s| s.to_vec());
    c.expect(
        "after finish_backward the marked gradient is reduced into it",
        matches!(&after, Ok(v) if v[..] == [6.0; 4]),
        describe(&after),
    );

    // Dropping the Fsdp waits for the unshard in flight.
    fsdp.unshard_async()?;
    c.expect("in flight once more: refused", held_until(&mutable_len(&mut shard), UNSHARD_UNTIL), "granted");
    drop(fsdp);
    c.expect("once the Fsdp is dropped the shard is granted", mutable_len(&mut shard).is_ok(), "refused");
    Ok(())
}

const DLPACK_UNTIL: &str = "until the capsule's deleter runs";

fn dlpack(lib: &Library, c: &mut Checks) -> Result<()> {
    let mut t = Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0], &[3], Device::cpu(0))?;
    let exported = t.to_dlpack()?;
    let during = mutable_len(&mut t);
    c.expect("a mutable slice of exported memory is refused", held_until(&during, DLPACK_UNTIL), describe(&during));
    let during = shared_len(&t);
    c.expect("a shared one too (the holder may write)", held_until(&during, DLPACK_UNTIL), describe(&during));
    drop(exported);
    let after = mutable_len(&mut t);
    c.expect("once the DlPack is dropped (its deleter ran) it is granted", after.is_ok(), describe(&after));

    // Handed over raw, the consumer's call of the deleter ends it.
    let raw = t.to_dlpack()?.into_raw();
    c.expect("handed over raw: refused", held_until(&mutable_len(&mut t), DLPACK_UNTIL), "granted");
    unsafe {
        let deleter = (*raw).deleter.expect("a deleter");
        deleter(raw);
    }
    c.expect("after the consumer ran the deleter it is granted", mutable_len(&mut t).is_ok(), "refused");

    // Imported back: the new tensor is checked as any other.
    let mut back = Tensor::from_dlpack(lib, t.to_dlpack()?)?;
    let mine = t.as_mut_slice::<f32>().map(|mut s| {
        s[0] = 7.0;
        s.len()
    });
    c.expect("imported back, the export's hold is gone", mine.is_ok(), describe(&mine));
    {
        let _held = t.as_mut_slice::<f32>()?;
        let other = mutable_len(&mut back);
        c.expect(
            "and the imported tensor's slice is checked against the original's",
            matches!(&other, Err(e) if e.code() == DP_ESTATE && e.message().contains("borrowed")),
            describe(&other),
        );
    }
    let values = back.to_vec::<f32>();
    c.expect("the same memory", matches!(&values, Ok(v) if v[..] == [7.0, 2.0, 3.0]), describe(&values));
    Ok(())
}

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let run = || -> Result<usize> {
        let lib = Library::open(None)?;
        let mut c = Checks { failures: 0 };
        match mode.as_str() {
            "ddp" => ddp(&lib, &mut c)?,
            "fsdp" => fsdp(&lib, &mut c)?,
            "dlpack" => dlpack(&lib, &mut c)?,
            other => {
                eprintln!("outliving: unknown mode '{other}' (ddp, fsdp or dlpack)");
                return Ok(1);
            }
        }
        Ok(c.failures)
    };
    match run() {
        Ok(0) => {
            println!("outliving {mode} passed");
            ExitCode::SUCCESS
        }
        Ok(n) => {
            eprintln!("{n} failure(s)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("outliving {mode}: {e}");
            ExitCode::FAILURE
        }
    }
}
