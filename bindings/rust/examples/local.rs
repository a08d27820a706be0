//! One process, no group: the single-process calls of the binding.
//!
//!   local
//!
//! Status text, device format and dtype sizes; device memory counters;
//! DLPack both ways (zero-copy, the producer's deleter run exactly once, a
//! refused import handing the tensor back); the in-process collectives'
//! values on cpu:0 and cpu:1; a module's buffers; a zero-copy gradient from
//! the host's memory, kept alive by the module; cpu streams running host
//! closures in order; dp_shutdown, refused from a forward closure.

use std::os::raw::c_void;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use dparallel::sys::{DLDataType, DLDevice, DLManagedTensor, DLTensor, DLPACK_FLAG_BITMASK_READ_ONLY};
use dparallel::{
    clear_current_stream, comm, current_stream, parallel_apply, DType, Device, DlPack, Library, Module, Result, Stream,
    Tensor, DP_EINVAL, DP_ESTATE,
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

    fn expect_err<T: std::fmt::Debug>(&mut self, what: &str, result: Result<T>, code: i32, needle: &str) {
        match result {
            Err(e) if e.code() == code && e.message().contains(needle) => println!("ok: {what}: {e}"),
            other => {
                eprintln!("FAIL: {what}: got {other:?}; want code {code} naming '{needle}'");
                self.failures += 1;
            }
        }
    }
}

fn base(lib: &Library, c: &mut Checks) -> Result<()> {
    let unknown = lib.status_string(12345);
    c.expect("status_string of an unknown code", unknown == "unknown status", &unknown);
    let einval = lib.status_string(DP_EINVAL);
    c.expect("status_string(DP_EINVAL) is its own text", !einval.is_empty() && einval != unknown, &einval);
    let text = lib.format_device(Device::cuda(12))?;
    c.expect("format_device(cuda:12)", text == "cuda:12", &text);
    let text = lib.format_device(Device::cpu(3))?;
    c.expect("format_device(cpu:3)", text == "cpu:3", &text);
    c.expect_err(
        "format_device of a bad type",
        lib.format_device(Device(dparallel::sys::dp_device { type_: 9, index: 0 })),
        DP_EINVAL,
        "device",
    );
    let sizes: Vec<usize> = [DType::F32, DType::F64, DType::BF16, DType::I8, DType::I64, DType::Bool]
        .iter()
        .map(|&d| lib.dtype_size(d))
        .collect();
    c.expect("dtype sizes", sizes == [4, 8, 2, 1, 8, 1], format!("{sizes:?}"));
    Ok(())
}

fn memory(lib: &Library, c: &mut Checks) -> Result<()> {
    let dev = Device::cpu(5);
    let before = lib.memory_stats(dev)?;
    let t = Tensor::zeros(lib, DType::F32, &[1 << 18], dev)?; // 1 MiB
    let during = lib.memory_stats(dev)?;
    c.expect(
        "a 1 MiB tensor is counted as allocated",
        during.allocated_bytes >= before.allocated_bytes + (1 << 20),
        format!("{before:?} then {during:?}"),
    );
    c.expect("the peak holds it", during.peak_allocated_bytes >= during.allocated_bytes, format!("{during:?}"));
    drop(t);
    let after = lib.memory_stats(dev)?;
    c.expect(
        "freeing it lowers the count",
        after.allocated_bytes + (1 << 20) <= during.allocated_bytes,
        format!("{during:?} then {after:?}"),
    );
    lib.reset_peak_memory(dev)?;
    let reset = lib.memory_stats(dev)?;
    c.expect(
        "reset_peak_memory starts the peak at what is in use",
        reset.peak_allocated_bytes == reset.allocated_bytes,
        format!("{reset:?}"),
    );
    // Memory the host lends is not the library's.
    let lent = Tensor::from_vec(lib, vec![0.0f32; 1 << 18], &[1 << 18], dev)?;
    let with_lent = lib.memory_stats(dev)?;
    c.expect(
        "a tensor over a Vec is not counted",
        with_lent.allocated_bytes == reset.allocated_bytes,
        format!("{reset:?} then {with_lent:?}"),
    );
    drop(lent);
    Ok(())
}

/// A DLManagedTensor made here, over a vector: counts its deleter's runs.
struct Producer {
    data: Vec<f32>,
    shape: Vec<i64>,
    strides: Vec<i64>,
    deleted: Arc<AtomicUsize>,
}

unsafe extern "C" fn producer_deleter(managed: *mut DLManagedTensor) {
    let owner = Box::from_raw((*managed).manager_ctx as *mut Producer);
    owner.deleted.fetch_add(1, Ordering::SeqCst);
    drop(owner);
    drop(Box::from_raw(managed));
}

fn produce(values: &[f32], shape: &[i64], strides: Option<&[i64]>, deleted: &Arc<AtomicUsize>) -> DlPack {
    let mut owner = Box::new(Producer {
        data: values.to_vec(),
        shape: shape.to_vec(),
        strides: strides.unwrap_or(&[]).to_vec(),
        deleted: deleted.clone(),
    });
    let dl_tensor = DLTensor {
        data: owner.data.as_mut_ptr() as *mut c_void,
        device: DLDevice { device_type: 1, device_id: 0 },
        ndim: shape.len() as i32,
        dtype: DLDataType { code: 2, bits: 32, lanes: 1 },
        shape: owner.shape.as_mut_ptr(),
        strides: if strides.is_some() { owner.strides.as_mut_ptr() } else { std::ptr::null_mut() },
        byte_offset: 0,
    };
    let managed = Box::new(DLManagedTensor {
        dl_tensor,
        manager_ctx: Box::into_raw(owner) as *mut c_void,
        deleter: Some(producer_deleter),
    });
    unsafe { DlPack::from_raw(Box::into_raw(managed)) }
}

fn dlpack(lib: &Library, c: &mut Checks) -> Result<()> {
    // Export: zero-copy, alive past the tensor.
    let t = Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], Device::cpu(0))?;
    let exported = t.to_dlpack()?;
    let dl = *exported.dl_tensor();
    c.expect("to_dlpack: shape", exported.shape() == [2, 3], format!("{:?}", exported.shape()));
    c.expect(
        "to_dlpack: float32 on cpu:0",
        dl.dtype == DLDataType { code: 2, bits: 32, lanes: 1 }
            && dl.device == DLDevice { device_type: 1, device_id: 0 },
        format!("{dl:?}"),
    );
    c.expect("to_dlpack shares the tensor's memory", exported.data_ptr() == t.data_ptr(), format!("{dl:?}"));
    drop(t);
    // And back: the same memory again, the values intact.
    let back = Tensor::from_dlpack(lib, exported)?;
    c.expect(
        "from_dlpack(to_dlpack(t)) holds t's values",
        back.to_vec::<f32>()? == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] && back.shape() == [2, 3],
        format!("{back:?}"),
    );

    // Import from a producer of our own: its deleter runs once, when the
    // last tensor over it is gone.
    let deleted = Arc::new(AtomicUsize::new(0));
    let managed = produce(&[7.0, 8.0, 9.0, 10.0], &[2, 2], None, &deleted);
    let data = managed.data_ptr();
    let mut imported = Tensor::from_dlpack(lib, managed)?;
    c.expect("from_dlpack is zero-copy", imported.data_ptr() == data, "another address");
    imported.as_mut_slice::<f32>()?[0] = 70.0;
    let view = comm::broadcast(&imported, &[Device::cpu(0)])?; // a view: a second tensor over it
    drop(imported);
    c.expect("the deleter waits for the last tensor", deleted.load(Ordering::SeqCst) == 0, "it ran early");
    c.expect("a write shows through the view", view[0].to_vec::<f32>()? == [70.0, 8.0, 9.0, 10.0], "values differ");
    drop(view);
    c.expect("the deleter ran once", deleted.load(Ordering::SeqCst) == 1, deleted.load(Ordering::SeqCst));

    // A refused import (strides that are not row-major) hands it back: its
    // deleter runs when the DlPack is dropped, once.
    let deleted = Arc::new(AtomicUsize::new(0));
    let transposed = produce(&[1.0, 2.0, 3.0, 4.0], &[2, 2], Some(&[1, 2]), &deleted);
    c.expect_err("from_dlpack of a transposed tensor", Tensor::from_dlpack(lib, transposed), DP_EINVAL, "row-major");
    c.expect(
        "the refused tensor was deleted once",
        deleted.load(Ordering::SeqCst) == 1,
        deleted.load(Ordering::SeqCst),
    );

    // DLPack 1.x: version 1.1, the read-only flag when asked; a writable
    // export comes back in place, a read-only one as a copy.
    let t = Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0], &[3], Device::cpu(0))?;
    let writable = t.to_dlpack_versioned(false)?;
    let read_only = t.to_dlpack_versioned(true)?;
    let v = read_only.version();
    c.expect(
        "to_dlpack_versioned: version 1.1, read-only flag only when asked",
        (v.major, v.minor) == (1, 1)
            && read_only.flags() == DLPACK_FLAG_BITMASK_READ_ONLY
            && writable.flags() == 0
            && writable.data_ptr() == t.data_ptr(),
        format!("{writable:?} {read_only:?}"),
    );
    let copied = Tensor::from_dlpack_versioned(lib, read_only)?;
    let in_place = Tensor::from_dlpack_versioned(lib, writable)?;
    c.expect(
        "from_dlpack_versioned: in place, or a copy when read-only",
        in_place.data_ptr() == t.data_ptr()
            && copied.data_ptr() != t.data_ptr()
            && copied.to_vec::<f32>()? == [1.0, 2.0, 3.0],
        format!("{in_place:?} {copied:?}"),
    );
    Ok(())
}

fn collectives(lib: &Library, c: &mut Checks) -> Result<()> {
    let (d0, d1) = (Device::cpu(0), Device::cpu(1));
    let a = Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], d0)?;
    let b = Tensor::from_slice(lib, &[10.0f32, 20.0, 30.0, 40.0, 50.0, 60.0], &[3, 2], d1)?;

    let out = comm::broadcast(&a, &[d0, d1])?;
    c.expect(
        "broadcast: a copy on each device, a view on its own",
        out.len() == 2
            && out[1].device() == d1
            && out[1].to_vec::<f32>()? == a.to_vec::<f32>()?
            && out[0].data_ptr() == a.data_ptr()
            && out[1].data_ptr() != a.data_ptr(),
        format!("{out:?}"),
    );

    let small = Tensor::from_slice(lib, &[7i64, 8], &[2], d0)?;
    let out = comm::broadcast_coalesced(&[&a, &small], &[d0, d1], 0)?;
    c.expect(
        "broadcast_coalesced: out[device][tensor]",
        out.len() == 2
            && out[1].len() == 2
            && out[1][0].device() == d1
            && out[1][0].to_vec::<f32>()? == a.to_vec::<f32>()?
            && out[1][1].to_vec::<i64>()? == [7, 8],
        format!("{out:?}"),
    );

    let sum = comm::reduce_add(&[&a, &b], d1)?;
    c.expect(
        "reduce_add on cpu:1",
        sum.device() == d1 && sum.to_vec::<f32>()? == [11.0, 22.0, 33.0, 44.0, 55.0, 66.0],
        format!("{sum:?}"),
    );

    let small1 = Tensor::from_slice(lib, &[1i64, 1], &[2], d1)?;
    let sums = comm::reduce_add_coalesced(&[&[&a, &small], &[&b, &small1]], d0, 0)?;
    c.expect(
        "reduce_add_coalesced: one sum per tensor",
        sums.len() == 2
            && sums[0].to_vec::<f32>()? == [11.0, 22.0, 33.0, 44.0, 55.0, 66.0]
            && sums[1].to_vec::<i64>()? == [8, 9],
        format!("{sums:?}"),
    );
    c.expect_err(
        "reduce_add_coalesced with lists of different lengths",
        comm::reduce_add_coalesced(&[&[&a, &small], &[&b]], d0, 0),
        DP_EINVAL,
        "inputs",
    );

    let parts = comm::scatter(&a, &[d0, d1], None, 0)?;
    c.expect(
        "scatter, even chunks of 3 rows: 2 and 1",
        parts.len() == 2
            && parts[0].to_vec::<f32>()? == [1.0, 2.0, 3.0, 4.0]
            && parts[1].to_vec::<f32>()? == [5.0, 6.0]
            && parts[1].device() == d1,
        format!("{parts:?}"),
    );
    let parts = comm::scatter(&a, &[d0, d1], Some(&[1, 2]), 0)?;
    c.expect(
        "scatter with chunk sizes 1 and 2",
        parts[0].shape() == [1, 2] && parts[1].to_vec::<f32>()? == [3.0, 4.0, 5.0, 6.0],
        format!("{parts:?}"),
    );
    c.expect_err(
        "scatter with a chunk size per device missing",
        comm::scatter(&a, &[d0, d1], Some(&[3]), 0),
        DP_EINVAL,
        "chunk_sizes",
    );
    let parts = comm::scatter(&a, &[d0, d1], None, -1)?;
    c.expect(
        "scatter along the last dim",
        parts.len() == 2
            && parts[0].to_vec::<f32>()? == [1.0, 3.0, 5.0]
            && parts[1].to_vec::<f32>()? == [2.0, 4.0, 6.0],
        format!("{parts:?}"),
    );

    let cat = comm::gather(&[&a, &b], 0, d0)?;
    c.expect(
        "gather along dim 0",
        cat.shape() == [6, 2] && cat.to_vec::<f32>()?[4..8] == [5.0, 6.0, 10.0, 20.0],
        format!("{cat:?}"),
    );
    let cat = comm::gather(&[&a, &b], 1, d1)?;
    c.expect(
        "gather along dim 1",
        cat.shape() == [3, 4] && cat.device() == d1 && cat.to_vec::<f32>()?[..4] == [1.0, 2.0, 10.0, 20.0],
        format!("{cat:?}"),
    );
    c.expect_err("gather of nothing", comm::gather(&[], 0, d0), DP_EINVAL, "tensors");
    Ok(())
}

fn module_buffers_and_grads(lib: &Library, c: &mut Checks) -> Result<()> {
    let d = Device::cpu(0);
    let mut root = Module::new(lib)?;
    let mut child = Module::new(lib)?;
    root.register_parameter("w", &Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0, 4.0], &[4], d)?, true)?;
    root.register_buffer("steps", &Tensor::from_slice(lib, &[5i64], &[1], d)?, true)?;
    child.register_buffer("mean", &Tensor::from_slice(lib, &[0.5f32, 0.25], &[2], d)?, false)?;
    root.register_module("norm", &child)?;
    let buffers = root.buffers()?;
    let names: Vec<&str> = buffers.iter().map(|(n, _)| n.as_str()).collect();
    c.expect("buffers in listing order", names == ["steps", "norm.mean"], format!("{names:?}"));
    c.expect("buffer_at(1)'s values", buffers[1].1.to_vec::<f32>()? == [0.5, 0.25], format!("{:?}", buffers[1].1));
    c.expect_err("buffer_at past the end", root.buffer_at(2), DP_EINVAL, "index");

    // set_grad: the host's memory becomes the gradient, no copy; the module
    // keeps it alive past the host's handle.
    let freed = Arc::new(AtomicUsize::new(0));
    let memory: &'static mut [f32] = Box::leak(vec![0.0f32; 4].into_boxed_slice());
    let address = memory.as_mut_ptr();
    let flag = freed.clone();
    // The address travels as an integer: the deleter may run on another thread.
    let owned = address as usize;
    let deleter: Box<dyn FnOnce() + Send> = Box::new(move || {
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(owned as *mut f32, 4)) });
        flag.fetch_add(1, Ordering::SeqCst);
    });
    let mut grad = unsafe { Tensor::from_blob(lib, address as *mut c_void, DType::F32, &[4], d, Some(deleter))? };
    root.set_grad("w", Some(&grad))?;
    grad.as_mut_slice::<f32>()?.copy_from_slice(&[0.5, 0.5, 1.0, 1.0]);
    let seen = root.grad("w")?;
    c.expect("set_grad is zero-copy", seen.data_ptr() == address as *mut c_void, "another address");
    c.expect("the module sees the host's writes", seen.to_vec::<f32>()? == [0.5, 0.5, 1.0, 1.0], format!("{seen:?}"));
    drop(grad);
    drop(seen);
    c.expect("the module keeps the memory alive", freed.load(Ordering::SeqCst) == 0, "freed early");
    // An SGD step reads it after the host's handle is gone.
    let (mut w, g) = (root.parameter("w")?, root.grad("w")?);
    let gv = g.to_vec::<f32>()?;
    w.as_mut_slice::<f32>()?.iter_mut().zip(&gv).for_each(|(p, g)| *p -= 2.0 * g);
    c.expect("SGD with the lent gradient", w.to_vec::<f32>()? == [0.0, 1.0, 1.0, 2.0], format!("{w:?}"));
    drop(g);
    c.expect_err(
        "set_grad of the wrong shape",
        root.set_grad("w", Some(&Tensor::zeros(lib, DType::F32, &[3], d)?)),
        DP_EINVAL,
        "grad",
    );
    root.set_grad("w", None)?;
    c.expect(
        "set_grad(None) releases the host's memory",
        freed.load(Ordering::SeqCst) == 1,
        freed.load(Ordering::SeqCst),
    );
    let fresh = root.grad("w")?;
    c.expect("the next grad is zeros", fresh.to_vec::<f32>()? == [0.0; 4], format!("{fresh:?}"));

    // A Vec works the same way, without unsafe.
    let v = Tensor::from_vec(lib, vec![9.0f32; 4], &[4], d)?;
    root.set_grad("w", Some(&v))?;
    drop(v);
    c.expect("a Vec as the gradient", root.grad("w")?.to_vec::<f32>()? == [9.0; 4], "values differ");
    Ok(())
}

fn streams(lib: &Library, c: &mut Checks) -> Result<()> {
    let d = Device::cpu(0);
    let stream = Stream::new(lib, d)?;
    let order = Arc::new(Mutex::new(Vec::new()));
    for i in 0..5 {
        let order = order.clone();
        stream.launch_host_func(move || {
            std::thread::sleep(std::time::Duration::from_millis(2 * (5 - i)));
            order.lock().unwrap().push(i);
        })?;
    }
    stream.synchronize()?;
    let seen = order.lock().unwrap().clone();
    c.expect("host closures run in queue order, all done at synchronize", seen == [0, 1, 2, 3, 4], format!("{seen:?}"));
    c.expect("no current stream at first", current_stream(lib, d)?.is_null(), "one is set");
    stream.make_current()?;
    c.expect("make_current", current_stream(lib, d)? == stream.as_raw(), "another stream");
    clear_current_stream(lib, d)?;
    c.expect("clear_current_stream", current_stream(lib, d)?.is_null(), "still set");
    // A panicking closure is caught on the stream's thread; the stream goes on.
    stream.launch_host_func(|| panic!("(expected) a host closure panics"))?;
    let after = order.clone();
    stream.launch_host_func(move || after.lock().unwrap().push(99))?;
    stream.destroy()?;
    c.expect("destroy waits for the queued work", order.lock().unwrap().last() == Some(&99), "99 missing");
    // A live cpu:0 stream named as one of cpu:1, on purpose.
    let other = Stream::new(lib, d)?;
    let misnamed = unsafe { Stream::from_raw(lib, Device::cpu(1), other.as_raw()) };
    c.expect_err("make_current on the wrong device", misnamed.make_current(), DP_EINVAL, "stream");
    let legacy = Stream::legacy_default(lib, d);
    c.expect("the legacy default stream is NULL", legacy.as_raw().is_null(), "not NULL");
    legacy.synchronize()?;
    Ok(())
}

fn shutdown(lib: &Library, c: &mut Checks) -> Result<()> {
    // From a forward closure (a library thread) it is refused.
    let m = Module::new(lib)?;
    let replicas = m.replicate(&[Device::cpu(0), Device::cpu(1)], false)?;
    let x0 = Tensor::from_slice(lib, &[1.0f32], &[1], Device::cpu(0))?;
    let x1 = Tensor::from_slice(lib, &[2.0f32], &[1], Device::cpu(1))?;
    let codes = Arc::new(Mutex::new(Vec::new()));
    let seen = codes.clone();
    parallel_apply(&[&replicas[0], &replicas[1]], &[&x0, &x1], None, move |r| {
        let code = r.module.library().shutdown().err().map(|e| e.code());
        seen.lock().unwrap().push(code);
        r.input.to_device(r.device)
    })?;
    let codes = codes.lock().unwrap().clone();
    c.expect("shutdown from a forward closure is DP_ESTATE", codes == [Some(DP_ESTATE); 2], format!("{codes:?}"));
    lib.shutdown()?;
    lib.shutdown()?;
    // The threads start again on the next use.
    let out = parallel_apply(&[&replicas[0], &replicas[1]], &[&x0, &x1], None, |r| r.input.to_device(r.device))?;
    c.expect("forwards run after shutdown", out[1].to_vec::<f32>()? == [2.0], format!("{out:?}"));
    Ok(())
}

fn main() -> ExitCode {
    let mut c = Checks { failures: 0 };
    let run = |c: &mut Checks| -> Result<()> {
        let lib = Library::open(None)?;
        base(&lib, c)?;
        memory(&lib, c)?;
        dlpack(&lib, c)?;
        collectives(&lib, c)?;
        module_buffers_and_grads(&lib, c)?;
        streams(&lib, c)?;
        shutdown(&lib, c)
    };
    if let Err(e) = run(&mut c) {
        eprintln!("FAIL: local: {e}");
        c.failures += 1;
    }
    if c.failures == 0 {
        println!("local: every check passed");
        ExitCode::SUCCESS
    } else {
        eprintln!("local: {} checks failed", c.failures);
        ExitCode::FAILURE
    }
}
