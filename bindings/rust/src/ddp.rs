//! The DDP gradient reducer (dp_ddp.h).

use std::cell::Cell;
use std::ffi::CString;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::{Arc, Mutex};

use crate::error::cstring;
use crate::parallel::panic_text;
use crate::tensor::sealed;
use crate::view::{Access, CallAccess, CallbackScope, StorageBorrow, DDP_MARKED};
use crate::{
    sys, Element, Error, InPlace, Library, Module, ProcessGroup, Result, Stream, Tensor, TensorSliceMut, DP_EINVAL,
    DP_EIO, DP_ETIMEOUT,
};

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
    /// The first synced iteration records the used parameters and the
    /// plan; later ones run no used-map collective (dp_ddp_options).
    pub static_graph: bool,
    /// While ranks have joined (`Ddp::join`), the built-in hooks divide by
    /// the initial world size (true) or by the ranks still active.
    pub join_divide_by_initial_world_size: bool,
    /// Text from `Ddp::bucket_plan` to start with: those buckets, final.
    pub bucket_plan: Option<String>,
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
            static_graph: false,
            join_divide_by_initial_world_size: true,
            bucket_plan: None,
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
/// library until `finish_backward` returns (its bucket is reduced, and the
/// result written back, in the background): from the mark on, a slice of it
/// is `DP_ESTATE` through any handle, until `finish_backward` returns, fails,
/// or the `Ddp` is dropped (which waits for the reduction running). Closures
/// the library runs (comm hooks, on_bucket_reduced, stream host functions)
/// may take such slices.
///
/// Dropping it destroys the reducer, which waits for the reduction running.
/// Two cases leak instead, so that a closure the library may still run never
/// sees its captures freed: a `Ddp` whose `finish_backward` or `join` ever
/// failed with DP_ETIMEOUT (a comm hook ran past the group's timeout and is
/// left running) keeps its closures, what they capture and a reference to
/// the library for the rest of the process; and a `Ddp` dropped inside a
/// comm hook or an on_bucket_reduced closure (of any `Ddp`, e.g. the closure
/// held its last `Arc<Ddp>`) is not destroyed at all: the reducer, its
/// closures and its references to the module and the group stay. In both
/// cases the gradients marked ready stay out of reach of slices for good.
pub struct Ddp {
    pub(crate) raw: *mut sys::dp_ddp,
    pub(crate) lib: Library,
    // Shared with the trampolines while a closure runs; released after
    // dp_ddp_destroy, which waits for the reduction running, unless a
    // closure may still run (see Drop).
    hooks: Option<Arc<HookState>>,
    // finish_backward or join returned DP_ETIMEOUT: a closure may be left
    // running past dp_ddp_destroy.
    timed_out: bool,
    // false for the handle a bucket-reduced closure is lent.
    owned: bool,
    // The wrapped module, whose memory the reducer writes (None when lent).
    module: Option<Module>,
    // The gradients marked ready in the backward in flight: the library may
    // read and write them until finish_backward.
    marked: Mutex<Vec<StorageBorrow>>,
    // Managed-parameter index -> name, for the index forms of the marks.
    managed_names: Vec<String>,
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
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<TensorSliceMut<'_, T>> {
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
type BucketReducedFn = dyn Fn(&Ddp, usize, &[usize]) -> Result<()> + Send + Sync;

/// The closures of a `Ddp` (`Ddp::with_hooks`); both run on the library's
/// worker thread, and an `Err` or a panic in either fails
/// `finish_backward` with DP_EUSER and its message.
#[derive(Default)]
pub struct DdpHooks {
    comm_hook: Option<Box<CommHookFn>>,
    on_bucket_reduced: Option<Box<BucketReducedFn>>,
}

impl fmt::Debug for DdpHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DdpHooks")
            .field("comm_hook", &self.comm_hook.is_some())
            .field("on_bucket_reduced", &self.on_bucket_reduced.is_some())
            .finish()
    }
}

impl DdpHooks {
    pub fn new() -> DdpHooks {
        DdpHooks::default()
    }

    /// Reduces each flat bucket in place instead of `DdpOptions::comm_hook`
    /// (DP_HOOK_CUSTOM), typically by collectives on the group it is lent.
    pub fn comm_hook<F>(mut self, hook: F) -> DdpHooks
    where
        F: Fn(&ProcessGroup, usize, &mut Bucket<'_>) -> Result<()> + Send + Sync + 'static,
    {
        self.comm_hook = Some(Box::new(hook));
        self
    }

    /// The optimizer inside backward: called with the reducer, the bucket
    /// index and its managed-parameter indices as soon as that bucket's
    /// averaged gradients are final in the module's gradients, while later
    /// buckets still reduce; every managed parameter is reported once per
    /// synced iteration. The reducer is lent for reading (`parameter_used`,
    /// `bucket_parameters`, ...); other calls on it are DP_ESTATE there.
    pub fn on_bucket_reduced<F>(mut self, callback: F) -> DdpHooks
    where
        F: Fn(&Ddp, usize, &[usize]) -> Result<()> + Send + Sync + 'static,
    {
        self.on_bucket_reduced = Some(Box::new(callback));
        self
    }
}

thread_local! {
    // How many comm hooks / on_bucket_reduced closures run on this thread.
    static IN_HOOK: Cell<usize> = const { Cell::new(0) };
}

pub(crate) fn in_hook() -> bool {
    IN_HOOK.with(|n| n.get() > 0)
}

/// A closure's call from the library: the state stays alive for the call
/// (it holds a reference), and `IN_HOOK` counts it.
struct HookCall {
    state: Option<Arc<HookState>>,
    _lent: CallbackScope,
}

impl HookCall {
    /// `user_data` is the pointer of an `Arc<HookState>` a `Ddp` holds.
    unsafe fn enter(user_data: *mut c_void) -> HookCall {
        let ptr = user_data as *const HookState;
        Arc::increment_strong_count(ptr);
        IN_HOOK.with(|n| n.set(n.get() + 1));
        HookCall { state: Some(Arc::from_raw(ptr)), _lent: CallbackScope::enter() }
    }

    fn state(&self) -> &HookState {
        self.state.as_deref().expect("held until dropped")
    }
}

impl Drop for HookCall {
    fn drop(&mut self) {
        IN_HOOK.with(|n| n.set(n.get() - 1));
        if let Some(state) = self.state.take() {
            // The Ddp was dropped meanwhile: its library reference may be
            // the last, and closing the library on its own worker thread
            // would unmap the code that runs: leak it instead.
            if Arc::strong_count(&state) == 1 {
                std::mem::forget(state);
            }
        }
    }
}

struct HookState {
    hooks: DdpHooks,
    lib: Library,
    failures: Mutex<Vec<String>>,
}

impl HookState {
    fn record(&self, failure: String) {
        // Nothing may unwind from a callback: a poisoned lock is still usable.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            self.failures.lock().unwrap_or_else(|p| p.into_inner()).push(failure);
        }));
    }

    fn append_to(&self, err: &mut Error) {
        for text in std::mem::take(&mut *self.failures.lock().unwrap_or_else(|p| p.into_inner())) {
            err.message.push_str("; ");
            err.message.push_str(&text);
        }
    }
}

/// The dp_comm_hook_fn behind a closure, on the library's worker thread:
/// nothing unwinds out of it.
unsafe extern "C" fn comm_hook_trampoline(
    user_data: *mut c_void,
    pg: *mut sys::dp_process_group,
    bucket_index: usize,
    flat_bucket: *mut sys::dp_tensor,
) -> c_int {
    let call = HookCall::enter(user_data);
    let state = call.state();
    let Some(hook) = state.hooks.comm_hook.as_ref() else { return 3 };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let group = ProcessGroup { raw: pg, lib: state.lib.clone(), owned: false };
        let mut bucket = Bucket { tensor: Tensor::borrowed(&state.lib, flat_bucket), _call: PhantomData };
        hook(&group, bucket_index, &mut bucket)
    }));
    let (code, failure) = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => (1, format!("bucket {bucket_index}: the comm hook returned {e}")),
        Err(payload) => (2, format!("bucket {bucket_index}: the comm hook panicked: {}", panic_text(payload.as_ref()))),
    };
    state.record(failure);
    code
}

/// The dp_bucket_reduced_fn behind a closure, on the library's worker
/// thread: nothing unwinds out of it.
unsafe extern "C" fn bucket_reduced_trampoline(
    user_data: *mut c_void,
    ddp: *mut sys::dp_ddp,
    bucket_index: usize,
    param_indices: *const usize,
    nparams: usize,
) -> c_int {
    let call = HookCall::enter(user_data);
    let state = call.state();
    let Some(callback) = state.hooks.on_bucket_reduced.as_ref() else { return 3 };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let lent = Ddp {
            raw: ddp,
            lib: state.lib.clone(),
            hooks: None,
            timed_out: false,
            owned: false,
            module: None,
            marked: Mutex::new(Vec::new()),
            managed_names: Vec::new(),
        };
        let params = if nparams == 0 || param_indices.is_null() {
            &[][..]
        } else {
            std::slice::from_raw_parts(param_indices, nparams)
        };
        callback(&lent, bucket_index, params)
    }));
    let (code, failure) = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => (1, format!("bucket {bucket_index}: the on_bucket_reduced closure returned {e}")),
        Err(payload) => (
            2,
            format!("bucket {bucket_index}: the on_bucket_reduced closure panicked: {}", panic_text(payload.as_ref())),
        ),
    };
    state.record(failure);
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
        if !self.owned {
            return;
        }
        if in_hook() {
            // Inside a comm hook or an on_bucket_reduced closure,
            // dp_ddp_destroy destroys nothing (dp_ddp.h), and this reducer's
            // own closure may be the one running: leak the reducer and its
            // closures. A reduction may still write the marked gradients.
            std::mem::forget(self.hooks.take());
            self.keep_marked_forever();
            return;
        }
        // Returns at once when a hook is stuck past the timeout, leaving it
        // running.
        unsafe { (self.lib.api().ddp_destroy)(self.raw) };
        // A closure still running after the destroy's wait was left running:
        // the reduction it belongs to writes the gradients once it returns.
        let closure_running = self.hooks.as_ref().is_some_and(|h| Arc::strong_count(h) > 1);
        if self.timed_out {
            // A closure may still run, now or later: its state stays, and
            // with it a reference to the library.
            std::mem::forget(self.hooks.take());
        }
        if self.timed_out || closure_running {
            self.keep_marked_forever();
        }
        // Otherwise no closure runs any more: a trampoline still returning
        // holds its own reference; the destroy dropped the queued reductions
        // and waited for the running one, so the marked gradients are free.
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
        Ddp::with_hooks(module, pg, options, DdpHooks::new().comm_hook(hook))
    }

    /// As `new`, with the closures of `hooks` (a comm hook, an
    /// on_bucket_reduced step, or both).
    pub fn with_hooks(module: &Module, pg: &ProcessGroup, options: &DdpOptions, hooks: DdpHooks) -> Result<Ddp> {
        let state = HookState { hooks, lib: module.lib.clone(), failures: Mutex::new(Vec::new()) };
        Ddp::create(module, pg, options, Some(Arc::new(state)))
    }

    fn create(module: &Module, pg: &ProcessGroup, options: &DdpOptions, hooks: Option<Arc<HookState>>) -> Result<Ddp> {
        let lib = module.lib.clone();
        let size = std::mem::size_of::<sys::dp_ddp_options>();
        // dp_ddp_options_init fills every field: zeroed bytes are a valid start
        // (null pointers, None callbacks).
        let mut o: sys::dp_ddp_options = unsafe { std::mem::zeroed() };
        lib.check(unsafe { (lib.api().ddp_options_init)(&mut o, size) })?;
        let modules: Vec<CString> =
            options.ignored_modules.iter().map(|n| cstring("ignored_modules", n)).collect::<Result<_>>()?;
        let params: Vec<CString> =
            options.ignored_parameters.iter().map(|n| cstring("ignored_parameters", n)).collect::<Result<_>>()?;
        let plan = options.bucket_plan.as_deref().map(|p| cstring("bucket_plan", p)).transpose()?;
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
        o.static_graph = options.static_graph as c_int;
        o.join_divide_by_initial_world_size = options.join_divide_by_initial_world_size as c_int;
        o.bucket_plan = plan.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        if let Some(state) = hooks.as_ref() {
            let user_data = Arc::as_ptr(state) as *mut c_void;
            if state.hooks.comm_hook.is_some() {
                o.comm_hook = sys::DP_HOOK_CUSTOM;
                o.hook_fn = Some(comm_hook_trampoline);
                o.hook_user_data = user_data;
            }
            if state.hooks.on_bucket_reduced.is_some() {
                o.on_bucket_reduced = Some(bucket_reduced_trampoline);
                o.on_bucket_reduced_data = user_data;
            }
        }
        let mut out = ptr::null_mut();
        // The initial broadcast writes the state; bucket views move gradients.
        let _call = module.access(Access::Write, Access::Write, Access::Write).begin("Ddp::new")?;
        lib.check(unsafe { (lib.api().ddp_create)(&mut out, module.raw, pg.raw, &o) })?;
        let mut ddp = Ddp {
            raw: out,
            lib,
            hooks,
            timed_out: false,
            owned: true,
            module: None,
            marked: Mutex::new(Vec::new()),
            managed_names: Vec::new(),
        };
        ddp.module = Some(module.retain()?);
        ddp.managed_names = ddp.read_managed_names();
        Ok(ddp)
    }

    /// Each managed parameter's name by its index: the bucket plan names
    /// each bucket's parameters in the order `bucket_parameters` gives their
    /// indices. Empty when they disagree (an index mark then holds every
    /// gradient the host can reach).
    fn read_managed_names(&self) -> Vec<String> {
        let Ok(plan) = self.bucket_plan() else { return Vec::new() };
        let mut names: Vec<Option<String>> = Vec::new();
        let buckets = plan.lines().filter(|line| line.starts_with("bucket "));
        let mut count = 0;
        for (bucket, line) in buckets.enumerate() {
            count += 1;
            let Ok(indices) = self.bucket_parameters(bucket) else { return Vec::new() };
            // "bucket <dtype> <names...>"
            let words: Vec<&str> = line.split(' ').skip(2).collect();
            if words.len() != indices.len() {
                return Vec::new();
            }
            for (index, word) in indices.into_iter().zip(words) {
                if names.len() <= index {
                    names.resize(index + 1, None);
                }
                names[index] = percent_decoded(word);
            }
        }
        if count != self.num_buckets() {
            return Vec::new();
        }
        names.into_iter().collect::<Option<Vec<String>>>().unwrap_or_default()
    }

    /// Marks a gradient ready through `mark`: from now on the library may
    /// read and write it in the background, so it is held (`marked`) from
    /// before the call until the backward ends.
    fn mark(&self, what: &str, name: Option<&str>, mark: impl FnOnce() -> sys::dp_status) -> Result<()> {
        let _call = self.begin_call(what, Access::Untouched, Access::Untouched)?;
        let held = match &self.module {
            Some(module) => {
                let mut access = CallAccess::new();
                match name.map(CString::new) {
                    Some(Ok(name)) => access.grad(module, &name, Access::Write),
                    // No name to find it by: every gradient the host can reach.
                    _ => access.module(module, Access::Untouched, Access::Untouched, Access::Write),
                };
                access.begin_pending(what, DDP_MARKED)?
            }
            None => CallAccess::new().begin(what)?,
        };
        let st = mark();
        if st == sys::DP_OK {
            self.marked.lock().unwrap_or_else(|p| p.into_inner()).push(held);
        }
        self.lib.check(st)
    }

    /// After a call that ends the backward with status `st`: the marked
    /// gradients are free again, unless the reduction may still run.
    fn settle_marked(&mut self, st: sys::dp_status) {
        if st == DP_ETIMEOUT {
            // A reduction was left running past the timeout.
            self.keep_marked_forever();
        } else if st == sys::DP_OK || !in_hook() {
            // Inside a hook every call is refused at once, the backward still
            // in flight; anywhere else a failed finish_backward has waited
            // for every reduction.
            self.marked.get_mut().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    fn keep_marked_forever(&mut self) {
        for held in self.marked.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            held.keep_forever();
        }
    }

    // Bucket copies and reductions write gradients; broadcasts (buffers
    // before a forward, all of the state at a join) write the rest.
    fn begin_call(&self, what: &str, parameters: Access, buffers: Access) -> Result<StorageBorrow> {
        match &self.module {
            Some(module) => module.access(parameters, buffers, Access::Write).begin(what),
            None => CallAccess::new().begin(what),
        }
    }

    /// The handle, still owned by `self`.
    pub fn as_raw(&self) -> *mut sys::dp_ddp {
        self.raw
    }

    /// `err` with what the closures reported.
    fn with_failures(&self, mut err: Error) -> Error {
        if let Some(state) = self.hooks.as_ref() {
            state.append_to(&mut err);
        }
        err
    }

    fn check(&mut self, st: sys::dp_status) -> Result<()> {
        if st == sys::DP_OK {
            return Ok(());
        }
        self.timed_out |= st == DP_ETIMEOUT;
        Err(self.with_failures(self.lib.error(st)))
    }

    /// With broadcast_buffers, broadcasts the module's buffers from rank 0.
    pub fn pre_forward(&mut self) -> Result<()> {
        let _call = self.begin_call("pre_forward", Access::Untouched, Access::Write)?;
        self.check(unsafe { (self.lib.api().ddp_pre_forward)(self.raw) })
    }

    /// The parameter's gradient is final for this backward.
    /// From here until `finish_backward` returns, the library may read and
    /// write this gradient: slices of it are `DP_ESTATE` meanwhile.
    pub fn mark_grad_ready(&self, param_name: &str) -> Result<()> {
        let c = cstring("param_name", param_name)?;
        self.mark("mark_grad_ready", Some(param_name), || unsafe {
            (self.lib.api().ddp_mark_grad_ready)(self.raw, c.as_ptr())
        })
    }

    /// As `mark_grad_ready`, by managed-parameter index.
    pub fn mark_grad_ready_index(&self, param_index: usize) -> Result<()> {
        let name = self.managed_names.get(param_index).map(String::as_str);
        self.mark("mark_grad_ready_index", name, || unsafe {
            (self.lib.api().ddp_mark_grad_ready_index)(self.raw, param_index)
        })
    }

    /// The gradient is final once the work queued so far on `stream` (a
    /// stream of the parameter's device) completes; the library waits on an
    /// event, never the whole device.
    /// Slices of the gradient are refused until `finish_backward`, as after
    /// `mark_grad_ready`; work on `stream` is lent them.
    pub fn mark_grad_ready_stream(&self, param_index: usize, stream: &Stream) -> Result<()> {
        let name = self.managed_names.get(param_index).map(String::as_str);
        self.mark("mark_grad_ready_stream", name, || unsafe {
            (self.lib.api().ddp_mark_grad_ready_stream)(self.raw, param_index, stream.as_raw())
        })
    }

    /// Waits for every bucket; the module's gradients then hold the average
    /// over the ranks. A closure's `Err` or panic is DP_EUSER with its message.
    /// DP_ETIMEOUT when a comm hook ran past the group's timeout: the hook is
    /// left running, and dropping this `Ddp` then leaks its closures (see
    /// [`Ddp`]), and the marked gradients then stay out of reach of
    /// slices. Otherwise, failed or not, the backward is over once it
    /// returns: slices of the marked gradients are granted again.
    pub fn finish_backward(&mut self) -> Result<()> {
        let _call = self.begin_call("finish_backward", Access::Untouched, Access::Untouched)?;
        let st = unsafe { (self.lib.api().ddp_finish_backward)(self.raw) };
        self.settle_marked(st);
        self.check(st)
    }

    /// Goes on over `pg`, another group (a shrunk one after a peer failed):
    /// every rank of `pg` calls it between iterations. The plan and options
    /// are kept, the parameters and buffers broadcast from pg's rank 0, the
    /// averages divide by pg's size and a comm hook is given `pg` from then
    /// on. A refusal (DP_EINVAL, DP_ESTATE) leaves it on its group; a failed
    /// broadcast leaves only drop (dp_ddp.h).
    pub fn rebind(&mut self, pg: &ProcessGroup) -> Result<()> {
        // The broadcast writes the state; bucket views move gradients.
        let _call = self.begin_call("rebind", Access::Write, Access::Write)?;
        let st = unsafe { (self.lib.api().ddp_rebind)(self.raw, pg.raw) };
        self.check(st)
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

    /// Whether some rank used managed parameter `param_index` in the last
    /// synced iteration (inside on_bucket_reduced: the one being reduced);
    /// without find_unused_parameters every parameter counts as used.
    /// DP_ESTATE before any synced iteration has reduced gradients.
    pub fn parameter_used(&self, param_index: usize) -> Result<bool> {
        let mut out: c_int = 0;
        self.lib.check(unsafe { (self.lib.api().ddp_parameter_used)(self.raw, param_index, &mut out) })?;
        Ok(out != 0)
    }

    /// The current bucket plan as text, stable across runs of the same
    /// module: give it back as `DdpOptions::bucket_plan` to start with it.
    pub fn bucket_plan(&self) -> Result<String> {
        let api = self.lib.api();
        let mut len = 0usize;
        self.lib.check(unsafe { (api.ddp_bucket_plan)(self.raw, ptr::null_mut(), 0, &mut len) })?;
        let mut buf = vec![0u8; len + 1];
        self.lib
            .check(unsafe { (api.ddp_bucket_plan)(self.raw, buf.as_mut_ptr() as *mut c_char, buf.len(), &mut len) })?;
        buf.truncate(len);
        String::from_utf8(buf).map_err(|e| Error::new(DP_EIO, format!("the bucket plan is not UTF-8: {e}")))
    }

    /// Uneven inputs: this rank has no more data (`join_all` for one
    /// reducer). Returns once every rank has joined.
    pub fn join(&mut self) -> Result<()> {
        Ddp::join_all(&mut [self])
    }

    /// Uneven inputs: this rank has no more data for any of `ddps` (the same
    /// ones, in the same order, on every rank). It stands in for the other
    /// ranks' iterations until every rank has joined; then every rank holds
    /// the parameters and buffers of the rank that ran the most synced
    /// iterations. DP_ESTATE during a backward.
    pub fn join_all(ddps: &mut [&mut Ddp]) -> Result<()> {
        let Some(first) = ddps.first() else {
            return Err(Error::new(DP_EINVAL, "ddps: empty; pass every Ddp this rank drives"));
        };
        let lib = first.lib.clone();
        let _calls =
            ddps.iter().map(|d| d.begin_call("join", Access::Write, Access::Write)).collect::<Result<Vec<_>>>()?;
        let raw: Vec<*mut sys::dp_ddp> = ddps.iter().map(|d| d.raw).collect();
        let st = unsafe { (lib.api().ddp_join)(raw.as_ptr(), raw.len()) };
        if st == sys::DP_OK {
            return Ok(());
        }
        let mut err = lib.error(st);
        for d in ddps.iter_mut() {
            d.timed_out |= st == DP_ETIMEOUT;
            // A join during a backward is refused, which goes on; only a
            // timeout leaves work running.
            if st == DP_ETIMEOUT {
                d.keep_marked_forever();
            }
            if let Some(state) = d.hooks.as_ref() {
                state.append_to(&mut err);
            }
        }
        Err(err)
    }
}

/// A name of the bucket plan, its `%XX` escapes decoded; None if malformed.
fn percent_decoded(word: &str) -> Option<String> {
    let bytes = word.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}
