//! Forward callbacks, dp_parallel_apply and replica sets.

use std::any::Any;
use std::fmt;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::Mutex;

use crate::view::{Access, CallAccess, CallbackScope};
use crate::{sys, Device, Error, Library, Module, Result, Tensor, DP_EINVAL};

/// What a forward callback receives: the replica and its input, lent for
/// the call only, on the replica's device worker.
pub struct Replica<'a> {
    pub index: usize,
    pub module: &'a Module,
    pub input: &'a Tensor,
    pub device: Device,
}

struct ForwardState<'f, F> {
    forward: &'f F,
    pub(crate) lib: Library,
    failures: Mutex<Vec<(usize, String)>>,
}

pub(crate) fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string payload".to_string()
    }
}

/// The dp_forward_fn behind every closure: nothing unwinds out of it.
unsafe extern "C" fn forward_trampoline<F>(
    user_data: *mut c_void,
    index: usize,
    replica: *mut sys::dp_module,
    input: *mut sys::dp_tensor,
    device: sys::dp_device,
    output: *mut *mut sys::dp_tensor,
) -> c_int
where
    F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
{
    let state = &*(user_data as *const ForwardState<'_, F>);
    let _lent = CallbackScope::enter();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let module = Module { raw: replica, lib: state.lib.clone(), owned: false };
        let input = Tensor::borrowed(&state.lib, input);
        (state.forward)(Replica { index, module: &module, input: &input, device: Device(device) })
    }));
    let (code, failure) = match outcome {
        Ok(Ok(tensor)) => {
            if !output.is_null() {
                let raw = tensor.raw;
                std::mem::forget(tensor);
                *output = raw;
            }
            return 0;
        }
        Ok(Err(e)) => (1, format!("replica {index}: the forward closure returned {e}")),
        Err(payload) => (2, format!("replica {index}: the forward closure panicked: {}", panic_text(payload.as_ref()))),
    };
    // Neither can panic unwind from here: a poisoned lock is still usable.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        state.failures.lock().unwrap_or_else(|p| p.into_inner()).push((index, failure));
    }));
    code
}

pub(crate) fn run_forward<F, C>(lib: &Library, forward: &F, call: C) -> Result<Tensor>
where
    F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
    C: FnOnce(sys::dp_forward_fn, *mut c_void, *mut *mut sys::dp_tensor) -> sys::dp_status,
{
    let state = ForwardState { forward, lib: lib.clone(), failures: Mutex::new(Vec::new()) };
    let mut out = ptr::null_mut();
    let st = call(forward_trampoline::<F>, &state as *const ForwardState<'_, F> as *mut c_void, &mut out);
    if st == sys::DP_OK {
        return Ok(unsafe { Tensor::from_raw(lib, out) });
    }
    Err(with_failures(lib.error(st), &state.failures))
}

pub(crate) fn with_failures(mut err: Error, failures: &Mutex<Vec<(usize, String)>>) -> Error {
    let mut list = std::mem::take(&mut *failures.lock().unwrap_or_else(|p| p.into_inner()));
    list.sort_by_key(|(i, _)| *i);
    for (_, text) in list {
        err.message.push_str("; ");
        err.message.push_str(&text);
    }
    err
}

/// dp_parallel_apply: `forward` on every (replica, input) pair at once, one
/// per device (`devices` None: each input's device). Returns the outputs in
/// replica order.
pub fn parallel_apply<F>(
    replicas: &[&Module],
    inputs: &[&Tensor],
    devices: Option<&[Device]>,
    forward: F,
) -> Result<Vec<Tensor>>
where
    F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
{
    let lib = match replicas.first() {
        Some(m) => m.lib.clone(),
        None => return Ok(Vec::new()),
    };
    if inputs.len() != replicas.len() || devices.is_some_and(|d| d.len() != replicas.len()) {
        return Err(Error::new(
            DP_EINVAL,
            format!(
                "inputs/devices: {} replicas need as many inputs (got {}) and devices (got {})",
                replicas.len(),
                inputs.len(),
                devices.map_or(replicas.len(), |d| d.len())
            ),
        ));
    }
    let raw_replicas: Vec<*mut sys::dp_module> = replicas.iter().map(|m| m.raw).collect();
    let raw_inputs: Vec<*mut sys::dp_tensor> = inputs.iter().map(|t| t.raw).collect();
    let raw_devices: Option<Vec<sys::dp_device>> = devices.map(|d| d.iter().map(|d| d.0).collect());
    let mut access = CallAccess::new();
    for input in inputs {
        // Copied to another device when it is not on its replica's.
        access.tensor(&lib, input.raw, Access::Read);
    }
    let _call = access.begin("parallel_apply")?;
    let state = ForwardState { forward: &forward, lib: lib.clone(), failures: Mutex::new(Vec::new()) };
    let mut out = vec![ptr::null_mut(); replicas.len()];
    let st = unsafe {
        (lib.api().parallel_apply)(
            raw_replicas.as_ptr(),
            raw_inputs.as_ptr(),
            raw_devices.as_ref().map_or(ptr::null(), |d| d.as_ptr()),
            raw_replicas.len(),
            forward_trampoline::<F>,
            &state as *const ForwardState<'_, F> as *mut c_void,
            out.as_mut_ptr(),
        )
    };
    if st != sys::DP_OK {
        return Err(with_failures(lib.error(st), &state.failures));
    }
    Ok(out.into_iter().map(|t| unsafe { Tensor::from_raw(&lib, t) }).collect())
}

// ---------------------------------------------------------------------------
// replica sets

/// Replicas of a module kept across steps (dp_replica_set_*).
pub struct ReplicaSet {
    pub(crate) raw: *mut sys::dp_replica_set,
    pub(crate) lib: Library,
    // The replicated module, whose memory sync and reduce_gradients touch.
    module: Module,
}

unsafe impl Send for ReplicaSet {}

impl fmt::Debug for ReplicaSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReplicaSet({} replicas)", self.len())
    }
}

impl Drop for ReplicaSet {
    fn drop(&mut self) {
        unsafe { (self.lib.api().replica_set_destroy)(self.raw) };
    }
}

impl ReplicaSet {
    pub fn new(module: &Module, devices: &[Device]) -> Result<ReplicaSet> {
        let lib = module.lib.clone();
        let raw_devices: Vec<sys::dp_device> = devices.iter().map(|d| d.0).collect();
        let mut out = ptr::null_mut();
        let _call = module.access(Access::Read, Access::Read, Access::Untouched).begin("ReplicaSet::new")?;
        lib.check(unsafe {
            (lib.api().replica_set_create)(&mut out, module.raw, raw_devices.as_ptr(), raw_devices.len())
        })?;
        Ok(ReplicaSet { raw: out, lib, module: module.retain()? })
    }

    pub fn len(&self) -> usize {
        unsafe { (self.lib.api().replica_set_size)(self.raw) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the module's parameters and buffers into the replicas.
    pub fn sync(&mut self) -> Result<()> {
        let access = self.access(Access::Read, Access::Untouched, Access::Write, Access::Untouched)?;
        let _call = access.begin("replica set sync")?;
        self.lib.check(unsafe { (self.lib.api().replica_set_sync)(self.raw) })
    }

    // The module's parameters and gradients, and every replica's
    // parameters and buffers, and gradients.
    fn access(&self, module: Access, grads: Access, replicas: Access, replica_grads: Access) -> Result<CallAccess> {
        let mut access = self.module.access(module, module, grads);
        for index in 0..self.len() {
            access.module(&self.replica(index)?, replicas, replicas, replica_grads);
        }
        Ok(access)
    }

    pub fn replica(&self, index: usize) -> Result<Module> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().replica_set_replica)(self.raw, index, &mut out) })?;
        Ok(unsafe { Module::from_raw(&self.lib, out) })
    }

    /// Adds the replicas' gradients into the module's, then zeroes theirs.
    pub fn reduce_gradients(&mut self) -> Result<()> {
        let access = self.access(Access::Untouched, Access::Write, Access::Untouched, Access::Write)?;
        let _call = access.begin("replica set reduce_gradients")?;
        self.lib.check(unsafe { (self.lib.api().replica_set_reduce_gradients)(self.raw) })
    }

    /// Scatter along `dim`, `forward` on every replica, gather on `output_device`.
    pub fn apply<F>(&mut self, input: &Tensor, dim: i32, output_device: Device, forward: F) -> Result<Tensor>
    where
        F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
    {
        let mut access = self.access(Access::Untouched, Access::Untouched, Access::Read, Access::Untouched)?;
        let _call = access.tensor(&self.lib, input.raw, Access::Read).begin("replica set apply")?;
        let lib = self.lib.clone();
        let raw = self.raw;
        run_forward(&lib, &forward, |f, ud, out| unsafe {
            (lib.api().replica_set_apply)(raw, input.raw, dim, output_device.0, f, ud, out)
        })
    }
}
