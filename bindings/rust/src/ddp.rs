//! The DDP gradient reducer (dp_ddp.h).

use std::ffi::CString;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::Mutex;

use crate::error::cstring;
use crate::parallel::panic_text;
use crate::tensor::sealed;
use crate::{sys, Element, InPlace, Library, Module, ProcessGroup, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum CommHook {
    /// Sum, then divide by the world size.
    AllReduce = 0,
    /// Cast to float16, reduce, cast back, divide.
    Fp16 = 1,
    /// Cast to bfloat16, reduce, cast back, divide.
    Bf16 = 2,
}

/// dp_ddp_options; the defaults are DP_DDP_OPTIONS_INIT's.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    pub bucket_cap_mb: f64,
    pub first_bucket_cap_mb: f64,
    pub gradient_as_bucket_view: bool,
    pub broadcast_buffers: bool,
    pub find_unused_parameters: bool,
    pub init_sync: bool,
    pub ignored_modules: Vec<String>,
    pub ignored_parameters: Vec<String>,
    pub comm_hook: CommHook,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            gradient_as_bucket_view: false,
            broadcast_buffers: true,
            find_unused_parameters: false,
            init_sync: true,
            ignored_modules: Vec::new(),
            ignored_parameters: Vec::new(),
            comm_hook: CommHook::AllReduce,
        }
    }
}

/// What the last synced iteration cost (dp_ddp_stats).
#[derive(Clone, Copy, Debug, Default)]
pub struct DdpStats {
    pub backward_ms: f64,
    pub reduce_ms: f64,
    pub exposed_ms: f64,
    pub num_buckets: usize,
    pub buckets_rebuilt: bool,
}

/// The DDP gradient reducer over a module and a process group (dp_ddp.h).
/// `mark_grad_ready*` may be called from several threads at once (`&self`);
/// every other call takes `&mut self`. A gradient marked ready belongs to the
/// library until `finish_backward` returns: neither read nor write it meanwhile.
pub struct Ddp {
    pub(crate) raw: *mut sys::dp_ddp,
    pub(crate) lib: Library,
    // Dropped after dp_ddp_destroy, which waits for reductions in flight.
    hook: Option<Box<HookState>>,
}

/// The flat bucket a comm hook is lent: this rank's gradients of one
/// bucket, to be replaced by what the module's gradients should hold.
pub struct Bucket<'a> {
    pub(crate) tensor: Tensor,
    _call: PhantomData<&'a mut ()>,
}

impl std::ops::Deref for Bucket<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.tensor
    }
}

impl Bucket<'_> {
    /// The bucket's elements, writable in place.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.tensor.as_mut_slice()
    }
}

impl sealed::Sealed for Bucket<'_> {}
impl InPlace for Bucket<'_> {
    fn raw_mut(&mut self) -> *mut sys::dp_tensor {
        self.tensor.raw
    }
}

type CommHookFn = dyn Fn(&ProcessGroup, usize, &mut Bucket<'_>) -> Result<()> + Send + Sync;

struct HookState {
    pub(crate) hook: Box<CommHookFn>,
    pub(crate) lib: Library,
    failures: Mutex<Vec<String>>,
}

/// The dp_comm_hook_fn behind a closure, on the library's worker thread:
/// nothing unwinds out of it.
unsafe extern "C" fn comm_hook_trampoline(
    user_data: *mut c_void,
    pg: *mut sys::dp_process_group,
    bucket_index: usize,
    flat_bucket: *mut sys::dp_tensor,
) -> c_int {
    let state = &*(user_data as *const HookState);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let group = ProcessGroup { raw: pg, lib: state.lib.clone(), owned: false };
        let mut bucket = Bucket { tensor: Tensor::borrowed(&state.lib, flat_bucket), _call: PhantomData };
        (state.hook)(&group, bucket_index, &mut bucket)
    }));
    let (code, failure) = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => (1, format!("bucket {bucket_index}: the comm hook returned {e}")),
        Err(payload) => (2, format!("bucket {bucket_index}: the comm hook panicked: {}", panic_text(payload.as_ref()))),
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        state.failures.lock().unwrap_or_else(|p| p.into_inner()).push(failure);
    }));
    code
}

unsafe impl Send for Ddp {}
unsafe impl Sync for Ddp {}

impl fmt::Debug for Ddp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ddp({} buckets)", self.num_buckets())
    }
}

impl Drop for Ddp {
    fn drop(&mut self) {
        unsafe { (self.lib.api().ddp_destroy)(self.raw) };
    }
}

impl Ddp {
    /// Wraps `module` for data-parallel training over `pg`; every rank calls
    /// it with equal options. Holds its own references to both.
    pub fn new(module: &Module, pg: &ProcessGroup, options: &DdpOptions) -> Result<Ddp> {
        Ddp::create(module, pg, options, None)
    }

    /// As `new`, with `hook` reducing each flat bucket in place instead of
    /// `options.comm_hook` (DP_HOOK_CUSTOM), typically by collectives on the
    /// group it is lent. It runs on the library's worker thread; an `Err`
    /// or a panic fails `finish_backward` with DP_EUSER and its message.
    pub fn with_comm_hook<F>(module: &Module, pg: &ProcessGroup, options: &DdpOptions, hook: F) -> Result<Ddp>
    where
        F: Fn(&ProcessGroup, usize, &mut Bucket<'_>) -> Result<()> + Send + Sync + 'static,
    {
        let state = HookState { hook: Box::new(hook), lib: module.lib.clone(), failures: Mutex::new(Vec::new()) };
        Ddp::create(module, pg, options, Some(Box::new(state)))
    }

    fn create(module: &Module, pg: &ProcessGroup, options: &DdpOptions, hook: Option<Box<HookState>>) -> Result<Ddp> {
        let lib = module.lib.clone();
        let mut o = sys::dp_ddp_options {
            struct_size: std::mem::size_of::<sys::dp_ddp_options>(),
            bucket_cap_mb: 0.0,
            first_bucket_cap_mb: 0.0,
            gradient_as_bucket_view: 0,
            broadcast_buffers: 0,
            find_unused_parameters: 0,
            init_sync: 0,
            ignored_modules: ptr::null(),
            num_ignored_modules: 0,
            ignored_parameters: ptr::null(),
            num_ignored_parameters: 0,
            comm_hook: 0,
            hook_fn: None,
            hook_user_data: ptr::null_mut(),
        };
        lib.check(unsafe { (lib.api().ddp_options_init)(&mut o, std::mem::size_of::<sys::dp_ddp_options>()) })?;
        let modules: Vec<CString> =
            options.ignored_modules.iter().map(|n| cstring("ignored_modules", n)).collect::<Result<_>>()?;
        let params: Vec<CString> =
            options.ignored_parameters.iter().map(|n| cstring("ignored_parameters", n)).collect::<Result<_>>()?;
        let module_ptrs: Vec<*const c_char> = modules.iter().map(|c| c.as_ptr()).collect();
        let param_ptrs: Vec<*const c_char> = params.iter().map(|c| c.as_ptr()).collect();
        o.bucket_cap_mb = options.bucket_cap_mb;
        o.first_bucket_cap_mb = options.first_bucket_cap_mb;
        o.gradient_as_bucket_view = options.gradient_as_bucket_view as c_int;
        o.broadcast_buffers = options.broadcast_buffers as c_int;
        o.find_unused_parameters = options.find_unused_parameters as c_int;
        o.init_sync = options.init_sync as c_int;
        o.ignored_modules = if module_ptrs.is_empty() { ptr::null() } else { module_ptrs.as_ptr() };
        o.num_ignored_modules = module_ptrs.len();
        o.ignored_parameters = if param_ptrs.is_empty() { ptr::null() } else { param_ptrs.as_ptr() };
        o.num_ignored_parameters = param_ptrs.len();
        o.comm_hook = options.comm_hook as i32;
        if let Some(state) = hook.as_ref() {
            o.comm_hook = sys::DP_HOOK_CUSTOM;
            o.hook_fn = Some(comm_hook_trampoline);
            o.hook_user_data = &**state as *const HookState as *mut c_void;
        }
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().ddp_create)(&mut out, module.raw, pg.raw, &o) })?;
        Ok(Ddp { raw: out, lib, hook })
    }

    /// With broadcast_buffers, broadcasts the module's buffers from rank 0.
    pub fn pre_forward(&mut self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().ddp_pre_forward)(self.raw) })
    }

    /// The parameter's gradient is final for this backward.
    pub fn mark_grad_ready(&self, param_name: &str) -> Result<()> {
        let c = cstring("param_name", param_name)?;
        self.lib.check(unsafe { (self.lib.api().ddp_mark_grad_ready)(self.raw, c.as_ptr()) })
    }

    pub fn mark_grad_ready_index(&self, param_index: usize) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().ddp_mark_grad_ready_index)(self.raw, param_index) })
    }

    /// Waits for every bucket; the module's gradients then hold the average
    /// over the ranks.
    pub fn finish_backward(&mut self) -> Result<()> {
        let st = unsafe { (self.lib.api().ddp_finish_backward)(self.raw) };
        if st == sys::DP_OK {
            return Ok(());
        }
        let mut err = self.lib.error(st);
        if let Some(state) = self.hook.as_ref() {
            for text in std::mem::take(&mut *state.failures.lock().unwrap_or_else(|p| p.into_inner())) {
                err.message.push_str("; ");
                err.message.push_str(&text);
            }
        }
        Err(err)
    }

    /// `false`: later backwards only accumulate locally (PyTorch's
    /// no_sync); the next synced backward reduces the accumulated sum.
    pub fn set_requires_gradient_sync(&mut self, requires_sync: bool) -> Result<()> {
        let api = self.lib.api();
        self.lib.check(unsafe { (api.ddp_set_requires_gradient_sync)(self.raw, requires_sync as c_int) })
    }

    /// Runs `body` with gradient sync off, then turns it back on.
    pub fn no_sync<R>(&mut self, body: impl FnOnce(&mut Ddp) -> Result<R>) -> Result<R> {
        self.set_requires_gradient_sync(false)?;
        let result = body(self);
        let restored = self.set_requires_gradient_sync(true);
        let value = result?;
        restored?;
        Ok(value)
    }

    pub fn num_buckets(&self) -> usize {
        unsafe { (self.lib.api().ddp_num_buckets)(self.raw) }
    }

    /// The managed-parameter indices of bucket `bucket`, in their order in it.
    pub fn bucket_parameters(&self, bucket: usize) -> Result<Vec<usize>> {
        let api = self.lib.api();
        let mut count = 0usize;
        self.lib.check(unsafe { (api.ddp_bucket_parameters)(self.raw, bucket, ptr::null_mut(), 0, &mut count) })?;
        let mut indices = vec![0usize; count];
        self.lib
            .check(unsafe { (api.ddp_bucket_parameters)(self.raw, bucket, indices.as_mut_ptr(), count, &mut count) })?;
        indices.truncate(count);
        Ok(indices)
    }

    pub fn last_stats(&self) -> Result<DdpStats> {
        let mut s = sys::dp_ddp_stats { struct_size: std::mem::size_of::<sys::dp_ddp_stats>(), ..Default::default() };
        self.lib.check(unsafe { (self.lib.api().ddp_last_stats)(self.raw, &mut s) })?;
        Ok(DdpStats {
            backward_ms: s.backward_ms,
            reduce_ms: s.reduce_ms,
            exposed_ms: s.exposed_ms,
            num_buckets: s.num_buckets,
            buckets_rebuilt: s.buckets_rebuilt != 0,
        })
    }
}
