//! In-process collectives across this process's devices (dp_comm.h,
//! torch.cuda.comm's semantics). Every output is a new tensor reference.

use std::ptr;

use crate::view::{Access, CallAccess, StorageBorrow};
use crate::{sys, Device, Error, Library, Result, Tensor, DP_EINVAL};

/// Each of these calls reads its inputs: refused while a mutable slice
/// covers one, and holding them against one meanwhile.
fn reading<'a>(lib: &Library, inputs: impl IntoIterator<Item = &'a Tensor>, what: &str) -> Result<StorageBorrow> {
    let mut access = CallAccess::new();
    for t in inputs {
        access.tensor(lib, t.raw, Access::Read);
    }
    access.begin(what)
}

/// The library of the first tensor; an empty list names `argument`.
fn lib_of(tensors: &[&Tensor], argument: &str) -> Result<Library> {
    tensors.first().map(|t| t.lib.clone()).ok_or_else(|| Error::new(DP_EINVAL, format!("{argument}: empty")))
}

fn raw_devices(devices: &[Device]) -> Vec<sys::dp_device> {
    devices.iter().map(|d| d.0).collect()
}

fn owned(lib: &Library, raw: Vec<*mut sys::dp_tensor>) -> Vec<Tensor> {
    raw.into_iter().filter(|t| !t.is_null()).map(|t| unsafe { Tensor::from_raw(lib, t) }).collect()
}

/// `tensor` on each of `devices`: a view sharing its storage on its own
/// device, a copy elsewhere.
pub fn broadcast(tensor: &Tensor, devices: &[Device]) -> Result<Vec<Tensor>> {
    let lib = tensor.lib.clone();
    let d = raw_devices(devices);
    let mut out = vec![ptr::null_mut(); d.len()];
    let _call = reading(&lib, [tensor], "broadcast")?;
    lib.check(unsafe { (lib.api().broadcast)(tensor.raw, d.as_ptr(), d.len(), out.as_mut_ptr()) })?;
    Ok(owned(&lib, out))
}

/// Many tensors, all on `devices[0]`, to every device through flat buffers
/// of at most `buffer_size` bytes (0: the library's default). `out[d][t]` is
/// tensor t on `devices[d]`; for d = 0 it shares the input's storage.
pub fn broadcast_coalesced(tensors: &[&Tensor], devices: &[Device], buffer_size: usize) -> Result<Vec<Vec<Tensor>>> {
    let lib = lib_of(tensors, "tensors")?;
    let raw: Vec<*const sys::dp_tensor> = tensors.iter().map(|t| t.raw as *const _).collect();
    let d = raw_devices(devices);
    let mut out = vec![ptr::null_mut(); d.len() * raw.len()];
    let _call = reading(&lib, tensors.iter().copied(), "broadcast_coalesced")?;
    lib.check(unsafe {
        (lib.api().broadcast_coalesced)(raw.as_ptr(), raw.len(), d.as_ptr(), d.len(), buffer_size, out.as_mut_ptr())
    })?;
    let mut all = owned(&lib, out).into_iter();
    Ok((0..d.len()).map(|_| all.by_ref().take(raw.len()).collect()).collect())
}

/// The element-wise sum of `inputs` (equal shape and dtype), as a new
/// tensor on `destination`.
pub fn reduce_add(inputs: &[&Tensor], destination: Device) -> Result<Tensor> {
    let lib = lib_of(inputs, "inputs")?;
    let raw: Vec<*const sys::dp_tensor> = inputs.iter().map(|t| t.raw as *const _).collect();
    let mut out = ptr::null_mut();
    let _call = reading(&lib, inputs.iter().copied(), "reduce_add")?;
    lib.check(unsafe { (lib.api().reduce_add)(raw.as_ptr(), raw.len(), destination.0, &mut out) })?;
    Ok(unsafe { Tensor::from_raw(&lib, out) })
}

/// `inputs[d]` is device d's list of tensors, each list matching the first
/// in shapes and dtypes; `out[t]` is the sum over d of tensor t, on
/// `destination`. `buffer_size` as for `broadcast_coalesced`.
pub fn reduce_add_coalesced(inputs: &[&[&Tensor]], destination: Device, buffer_size: usize) -> Result<Vec<Tensor>> {
    let first = inputs.first().ok_or_else(|| Error::new(DP_EINVAL, "inputs: no device's list"))?;
    let ntensors = first.len();
    if let Some((d, list)) = inputs.iter().enumerate().find(|(_, l)| l.len() != ntensors) {
        return Err(Error::new(
            DP_EINVAL,
            format!("inputs: device list {d} holds {} tensors, list 0 holds {ntensors}", list.len()),
        ));
    }
    let lib = lib_of(first, "inputs[0]")?;
    let raw: Vec<*const sys::dp_tensor> = inputs.iter().flat_map(|l| l.iter().map(|t| t.raw as *const _)).collect();
    let mut out = vec![ptr::null_mut(); ntensors];
    let _call = reading(&lib, inputs.iter().flat_map(|l| l.iter().copied()), "reduce_add_coalesced")?;
    lib.check(unsafe {
        (lib.api().reduce_add_coalesced)(
            raw.as_ptr(),
            inputs.len(),
            ntensors,
            destination.0,
            buffer_size,
            out.as_mut_ptr(),
        )
    })?;
    Ok(owned(&lib, out))
}

/// Splits `tensor` along `dim` (negative wraps), chunk i to `devices[i]`:
/// with `chunk_sizes` (one positive size per device, summing to the
/// dimension) every device gets a chunk; with `None`, torch.chunk's even
/// split, which can give fewer chunks than devices. A chunk that stays on
/// the tensor's device along dim 0 is a view.
pub fn scatter(tensor: &Tensor, devices: &[Device], chunk_sizes: Option<&[i64]>, dim: i32) -> Result<Vec<Tensor>> {
    if let Some(sizes) = chunk_sizes {
        // The library reads one size per device.
        if sizes.len() != devices.len() {
            return Err(Error::new(
                DP_EINVAL,
                format!("chunk_sizes: {} sizes for {} devices", sizes.len(), devices.len()),
            ));
        }
    }
    let lib = tensor.lib.clone();
    let d = raw_devices(devices);
    let mut out = vec![ptr::null_mut(); d.len()];
    let mut count = 0usize;
    let _call = reading(&lib, [tensor], "scatter")?;
    lib.check(unsafe {
        (lib.api().scatter)(
            tensor.raw,
            d.as_ptr(),
            d.len(),
            chunk_sizes.map_or(ptr::null(), |s| s.as_ptr()),
            dim,
            out.as_mut_ptr(),
            &mut count,
        )
    })?;
    out.truncate(count);
    Ok(owned(&lib, out))
}

/// Concatenates `tensors` (one dtype and ndim, equal but along `dim`) into a
/// new tensor on `destination`.
pub fn gather(tensors: &[&Tensor], dim: i32, destination: Device) -> Result<Tensor> {
    let lib = lib_of(tensors, "tensors")?;
    let raw: Vec<*const sys::dp_tensor> = tensors.iter().map(|t| t.raw as *const _).collect();
    let mut out = ptr::null_mut();
    let _call = reading(&lib, tensors.iter().copied(), "gather")?;
    lib.check(unsafe { (lib.api().gather)(raw.as_ptr(), raw.len(), dim, destination.0, &mut out) })?;
    Ok(unsafe { Tensor::from_raw(&lib, out) })
}
