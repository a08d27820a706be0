//! fully_shard (dp_fsdp.h): sharded data parallel with the semantics of
//! PyTorch's FSDP2.

use std::fmt;
use std::os::raw::c_int;
use std::ptr;

use crate::ddp::in_hook;
use crate::error::{cstring, owned_text};
use crate::view::{Access, CallAccess, Pending, StorageBorrow, FSDP_POST_BACKWARD, FSDP_UNSHARD};
use crate::{sys, DType, DeviceMesh, Library, Module, ProcessGroup, Result, Tensor, Work, DP_ESTATE, DP_ETIMEOUT};

/// dp_fsdp_options; the defaults are DP_FSDP_OPTIONS_INIT's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsdpOptions {
    /// true (ZeRO-3): `reshard` frees the full parameters; false (ZeRO-2):
    /// they stay until `post_backward`.
    pub reshard_after_forward: bool,
    /// The dtype of the full parameters and gradients (None: the
    /// parameters' own).
    pub param_dtype: Option<DType>,
    /// The dtype gradients are reduced in (None: `param_dtype`).
    pub reduce_dtype: Option<DType>,
    /// Rank 0's values and the agreement check before sharding (collective).
    pub init_sync: bool,
    /// On a shared-memory group (two or more ranks, `init_sync`), the full
    /// parameters are views of every rank's shards (an unshard copies
    /// nothing). A write to a full parameter then reaches every rank's
    /// shard, and shards may be written only while no rank has this `Fsdp`
    /// unsharded (after `finish_backward`, say). Elsewhere, or with a
    /// `param_dtype` cast, they stay copies.
    pub full_params_as_views: bool,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            reshard_after_forward: true,
            param_dtype: None,
            reduce_dtype: None,
            init_sync: true,
            full_params_as_views: false,
        }
    }
}

/// fully_shard over a module's parameters that no live `Fsdp` holds
/// (create the children's first). Each rank keeps only its rows of each
/// parameter (`shard`); the host drives it around its own forward and
/// backward: `unshard` (the module's slots hold full parameters),
/// `reshard`, `unshard` before the backward, `post_backward` once the full
/// gradients are final, `finish_backward`, then the optimizer steps on
/// `shard` / `shard_grad`. Dropping it is collective: every rank drops its
/// `Fsdp` of the pair, and the module's slots get the full parameters back.
///
/// Each full parameter keeps one address for the `Fsdp`'s life (dp_fsdp.h,
/// "Full parameters keep one address"): a handle taken while unsharded
/// names the values every later unshard writes there, and reads zeros
/// while resharded on the CPU (its pages are given back). A slice of it
/// therefore holds off `unshard`, `reshard` and the backward steps, which
/// write it, even while the module's slot holds the shard.
///
/// A shard handle shares the shard's memory. Work these calls leave running
/// keeps it out of reach of slices, through any handle, until the call that
/// completes it returns (or fails, or the `Fsdp` is dropped): after
/// `unshard_async`, a mutable slice of a shard (the module's slot holds it
/// meanwhile) is `DP_ESTATE` until `wait_unshard`, `unshard`, `reshard` or
/// `post_backward`; after a synced `post_backward`, any slice of a shard
/// gradient, or a mutable one of a full gradient taken before, until
/// `finish_backward` or the next `post_backward`. After a DP_ETIMEOUT that
/// memory stays out of reach for good (the work may still run).
pub struct Fsdp {
    raw: *mut sys::dp_fsdp,
    lib: Library,
    // The sharded module, whose memory the calls write.
    module: Module,
    // The shards an unshard_async's all-gather reads until it is waited for.
    unshard_in_flight: Option<StorageBorrow>,
    // The shard gradients (written) and the full gradients (read) of the
    // reduce-scatter of a synced post_backward, until it is waited for.
    post_in_flight: Option<StorageBorrow>,
    requires_sync: bool,
    // Per managed parameter: whether it takes a mark (it required grad at
    // create), and whether this backward marked it: the mark that completes
    // the set runs post_backward, whose memory is then held as its.
    takes_mark: Vec<bool>,
    marked: Vec<bool>,
    // Each full parameter's memory (address, bytes), fixed for the dp_fsdp's
    // life and noted at the first unshard: unshard, reshard and the backward
    // steps write it (the gathered values, the pages given back), even
    // while the module's slots hold the shards. Views of the shards are
    // left out (the shards stand for them).
    full_ranges: Vec<(usize, usize)>,
}

// One dp_fsdp's calls are serialised by the library (dp_fsdp.h).
unsafe impl Send for Fsdp {}
unsafe impl Sync for Fsdp {}

impl fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fsdp({} parameters)", self.num_parameters())
    }
}

impl Drop for Fsdp {
    fn drop(&mut self) {
        // Waits for the unshard and the reduce-scatter in flight; the held
        // memory is released after it (the fields drop after this).
        unsafe { (self.lib.api().fsdp_destroy)(self.raw) };
    }
}

impl Fsdp {
    /// Shards `module`'s parameters over `pg` (collective with init_sync;
    /// create them in the same order on every rank).
    pub fn new(module: &Module, pg: &ProcessGroup, options: &FsdpOptions) -> Result<Fsdp> {
        Fsdp::create(module, options, |lib, o, out| unsafe { (lib.api().fsdp_create)(out, module.raw, pg.raw, o) })
    }

    /// On a device mesh (FSDP2's mesh argument): 1-D, as `new` over its
    /// group; 2-D, HSDP: shards over dimension 1's group, replicas across
    /// dimension 0's (the gradients averaged over every rank of the mesh).
    pub fn on_mesh(module: &Module, mesh: &DeviceMesh, options: &FsdpOptions) -> Result<Fsdp> {
        Fsdp::create(module, options, |lib, o, out| unsafe {
            (lib.api().fsdp_create_on_mesh)(out, module.raw, mesh.raw(), o)
        })
    }

    fn create(
        module: &Module,
        options: &FsdpOptions,
        make: impl FnOnce(&Library, &sys::dp_fsdp_options, &mut *mut sys::dp_fsdp) -> sys::dp_status,
    ) -> Result<Fsdp> {
        let lib = module.lib.clone();
        let size = std::mem::size_of::<sys::dp_fsdp_options>();
        let mut o = sys::dp_fsdp_options {
            struct_size: size,
            reshard_after_forward: 0,
            param_dtype: 0,
            reduce_dtype: 0,
            init_sync: 0,
            full_params_as_views: 0,
        };
        lib.check(unsafe { (lib.api().fsdp_options_init)(&mut o, size) })?;
        o.reshard_after_forward = options.reshard_after_forward as c_int;
        o.param_dtype = options.param_dtype.map_or(-1, |d| d as i32);
        o.reduce_dtype = options.reduce_dtype.map_or(-1, |d| d as i32);
        o.init_sync = options.init_sync as c_int;
        o.full_params_as_views = options.full_params_as_views as c_int;
        let mut out = ptr::null_mut();
        // Sharding replaces the parameters (after a broadcast with init_sync).
        let _call = module.access(Access::Write, Access::Write, Access::Write).begin("Fsdp::new")?;
        lib.check(make(&lib, &o, &mut out))?;
        let mut fsdp = Fsdp {
            raw: out,
            lib,
            module: module.retain()?,
            unshard_in_flight: None,
            post_in_flight: None,
            requires_sync: true,
            takes_mark: Vec::new(),
            marked: Vec::new(),
            full_ranges: Vec::new(),
        };
        for index in 0..fsdp.num_parameters() {
            let name = fsdp.parameter_name(index)?;
            fsdp.takes_mark.push(fsdp.module.requires_grad(&name)?);
        }
        fsdp.marked = vec![false; fsdp.takes_mark.len()];
        Ok(fsdp)
    }

    /// The handle, still owned by `self`.
    // Unshard, reshard and the backward steps may write any parameter,
    // gradient, shard or shard gradient of the module.
    fn begin_call(&self, what: &str) -> Result<StorageBorrow> {
        let mut access = self.module.access(Access::Write, Access::Untouched, Access::Write);
        for &(start, bytes) in &self.full_ranges {
            access.range(start, bytes, Access::Write);
        }
        let api = self.lib.api();
        for index in 0..self.num_parameters() {
            for get in [api.fsdp_shard, api.fsdp_shard_grad] {
                let mut tensor = ptr::null_mut();
                if unsafe { get(self.raw, index, &mut tensor) } == sys::DP_OK && !tensor.is_null() {
                    access.tensor(&self.lib, tensor, Access::Write);
                    unsafe { (api.tensor_destroy)(tensor) };
                }
            }
        }
        access.begin(what)
    }

    pub fn as_raw(&self) -> *mut sys::dp_fsdp {
        self.raw
    }

    /// The memory work of this `Fsdp` left running uses: its shards (read by
    /// an unshard), or its shard gradients (written) and the full gradients
    /// the host can reach (read) by a post_backward's reduce-scatter.
    fn hold(&self, what: &str, pending: Pending, post_backward: bool) -> Result<StorageBorrow> {
        let mut access = CallAccess::new();
        if !post_backward {
            // The all-gather writes the full parameters.
            for &(start, bytes) in &self.full_ranges {
                access.range(start, bytes, Access::Write);
            }
        }
        let api = self.lib.api();
        for index in 0..self.num_parameters() {
            let get = if post_backward { api.fsdp_shard_grad } else { api.fsdp_shard };
            let mut tensor = ptr::null_mut();
            if unsafe { get(self.raw, index, &mut tensor) } == sys::DP_OK && !tensor.is_null() {
                access.tensor(&self.lib, tensor, if post_backward { Access::Write } else { Access::Read });
                unsafe { (api.tensor_destroy)(tensor) };
            }
            if post_backward {
                let mut name = ptr::null();
                if unsafe { (api.fsdp_parameter_name)(self.raw, index, &mut name) } == sys::DP_OK && !name.is_null() {
                    access.reached_grad(&self.module, unsafe { std::ffi::CStr::from_ptr(name) }, Access::Read);
                }
            }
        }
        access.begin_pending(what, pending)
    }

    /// After a call with status `st` that waits for the work `held`: it is
    /// done, unless the wait gave up (a timeout: it stays held for good) or
    /// the call was refused inside a DDP closure (still in flight).
    fn settle(st: sys::dp_status, held: &mut Option<StorageBorrow>) {
        if st == DP_ETIMEOUT {
            if let Some(held) = held.take() {
                held.keep_forever();
            }
        } else if st == sys::DP_OK || !in_hook() {
            *held = None;
        }
    }

    /// Notes each full parameter's memory once the slots first hold them
    /// (their addresses then stay for the dp_fsdp's life).
    fn note_full_ranges(&mut self) {
        if !self.full_ranges.is_empty() {
            return;
        }
        let api = self.lib.api();
        let mut ranges = Vec::new();
        for index in 0..self.num_parameters() {
            let mut name = ptr::null();
            if unsafe { (api.fsdp_parameter_name)(self.raw, index, &mut name) } != sys::DP_OK || name.is_null() {
                return;
            }
            let mut full = ptr::null_mut();
            if unsafe { (api.module_get_parameter)(self.module.raw, name, &mut full) } != sys::DP_OK || full.is_null() {
                return;
            }
            let start = unsafe { (api.tensor_data)(full) } as usize;
            let bytes = unsafe { (api.tensor_nbytes)(full) };
            unsafe { (api.tensor_destroy)(full) };
            let mut shard = ptr::null_mut();
            let mut view = false;
            if unsafe { (api.fsdp_shard)(self.raw, index, &mut shard) } == sys::DP_OK && !shard.is_null() {
                let at = unsafe { (api.tensor_data)(shard) } as usize;
                view = unsafe { (api.tensor_nbytes)(shard) } > 0 && at >= start && at < start.saturating_add(bytes);
                unsafe { (api.tensor_destroy)(shard) };
            }
            if !view {
                ranges.push((start, bytes));
            }
        }
        self.full_ranges = ranges;
    }

    /// After a call that waits for an unshard in flight.
    fn settle_unshard(&mut self, st: sys::dp_status) -> Result<()> {
        Fsdp::settle(st, &mut self.unshard_in_flight);
        if st == DP_ETIMEOUT {
            // The dp_fsdp is unusable: nothing waits for the reduce-scatter.
            Fsdp::settle(st, &mut self.post_in_flight);
        }
        self.lib.check(st)
    }

    /// All-gathers: the module's slots hold the full parameters.
    pub fn unshard(&mut self) -> Result<()> {
        let _call = self.begin_call("unshard")?;
        let st = unsafe { (self.lib.api().fsdp_unshard)(self.raw, 0) };
        if st == sys::DP_OK {
            self.note_full_ranges();
        }
        self.settle_unshard(st)
    }

    /// Starts the all-gather and returns at once (prefetch); `wait_unshard`,
    /// or a blocking `unshard`, completes it (as do `reshard` and
    /// `post_backward`). Until then the library reads the shards, which the
    /// module's slots hold meanwhile: a mutable slice of one is `DP_ESTATE`.
    pub fn unshard_async(&mut self) -> Result<()> {
        let _call = self.begin_call("unshard_async")?;
        let held = self.hold("unshard_async", FSDP_UNSHARD, false)?;
        let st = unsafe { (self.lib.api().fsdp_unshard)(self.raw, 1) };
        if st == sys::DP_OK {
            // One in flight already is this one (it adds nothing).
            self.unshard_in_flight = Some(held);
            return Ok(());
        }
        if st == DP_ETIMEOUT {
            held.keep_forever();
        }
        self.settle_unshard(st)
    }

    /// Waits for the all-gather of `unshard_async`: the slots hold the full
    /// parameters, and the shards may be sliced again.
    pub fn wait_unshard(&mut self) -> Result<()> {
        let _call = self.begin_call("wait_unshard")?;
        let st = unsafe { (self.lib.api().fsdp_wait_unshard)(self.raw) };
        if st == sys::DP_OK {
            self.note_full_ranges();
        }
        self.settle_unshard(st)
    }

    /// The slots hold the shards again (see `reshard_after_forward`).
    pub fn reshard(&mut self) -> Result<()> {
        let _call = self.begin_call("reshard")?;
        let st = unsafe { (self.lib.api().fsdp_reshard)(self.raw) };
        self.settle_unshard(st)
    }

    /// The full gradients are final: reshards, then reduce-scatters their
    /// average into the shard gradients, asynchronously. With gradient sync,
    /// until `finish_backward` (or the next `post_backward`) the shard
    /// gradients may not be sliced, nor the full gradients taken before
    /// sliced mutably.
    pub fn post_backward(&mut self) -> Result<()> {
        let _call = self.begin_call("post_backward")?;
        // It ends this backward's marks (a no-op when they completed it).
        self.marked.iter_mut().for_each(|m| *m = false);
        let held = if self.requires_sync { Some(self.hold("post_backward", FSDP_POST_BACKWARD, true)?) } else { None };
        let st = unsafe { (self.lib.api().fsdp_post_backward)(self.raw) };
        // It waited for the previous reduce-scatter first.
        Fsdp::settle(st, &mut self.post_in_flight);
        if st == sys::DP_OK {
            self.post_in_flight = held;
        } else if let (Some(held), true) = (held, st == DP_ETIMEOUT) {
            held.keep_forever();
        }
        self.settle_unshard(st)
    }

    /// FSDP2's per-parameter hook: parameter `name`'s full gradient is
    /// final. The mark that completes the set of parameters that required
    /// grad at create runs `post_backward` itself (an explicit one after it
    /// is a no-op); `finish_backward` with some marked but not all fails
    /// naming the others. Marks take `&mut self`: threads of a host's
    /// autograd share the `Fsdp` through a `Mutex`.
    pub fn mark_grad_ready(&mut self, name: &str) -> Result<()> {
        let c = cstring("name", name)?;
        let index = (0..self.num_parameters()).find(|&i| self.parameter_name(i).is_ok_and(|n| n == name));
        let completes = index.is_some_and(|i| {
            self.takes_mark[i]
                && !self.marked[i]
                && (0..self.marked.len()).all(|j| j == i || !self.takes_mark[j] || self.marked[j])
        });
        let _call = self.begin_call("mark_grad_ready")?;
        let held = if completes && self.requires_sync {
            Some(self.hold("mark_grad_ready", FSDP_POST_BACKWARD, true)?)
        } else {
            None
        };
        let st = unsafe { (self.lib.api().fsdp_mark_grad_ready)(self.raw, c.as_ptr()) };
        if !completes {
            if st == sys::DP_OK {
                if let Some(i) = index {
                    self.marked[i] = true;
                }
            }
            return self.lib.check(st);
        }
        self.marked.iter_mut().for_each(|m| *m = false);
        if st == DP_ESTATE {
            // Refused before any post_backward ran (a second mark, say): what
            // is in flight stays held.
            return self.lib.check(st);
        }
        // As post_backward: it ran, whatever its outcome.
        Fsdp::settle(st, &mut self.post_in_flight);
        if st == sys::DP_OK {
            self.post_in_flight = held;
        } else if let (Some(held), true) = (held, st == DP_ETIMEOUT) {
            held.keep_forever();
        }
        self.settle_unshard(st)
    }

    /// Waits for the last `post_backward`'s reduce-scatter: the shard
    /// gradients may be sliced again.
    pub fn finish_backward(&mut self) -> Result<()> {
        let _call = self.begin_call("finish_backward")?;
        // Marks left incomplete end here (the library refuses them).
        self.marked.iter_mut().for_each(|m| *m = false);
        let st = unsafe { (self.lib.api().fsdp_finish_backward)(self.raw) };
        Fsdp::settle(st, &mut self.post_in_flight);
        if st == DP_ETIMEOUT {
            Fsdp::settle(st, &mut self.unshard_in_flight);
        }
        self.lib.check(st)
    }

    /// `false`: `post_backward` keeps the full gradients, which later
    /// backwards add to; the next synced one reduces the sum.
    pub fn set_requires_gradient_sync(&mut self, requires_sync: bool) -> Result<()> {
        let api = self.lib.api();
        self.lib.check(unsafe { (api.fsdp_set_requires_gradient_sync)(self.raw, requires_sync as c_int) })?;
        self.requires_sync = requires_sync;
        Ok(())
    }

    /// The managed parameters, in the module's listing order.
    pub fn num_parameters(&self) -> usize {
        unsafe { (self.lib.api().fsdp_num_parameters)(self.raw) }
    }

    /// The index-th managed parameter's name, relative to the module.
    pub fn parameter_name(&self, index: usize) -> Result<String> {
        let mut name = ptr::null();
        self.lib.check(unsafe { (self.lib.api().fsdp_parameter_name)(self.raw, index, &mut name) })?;
        Ok(unsafe { owned_text(name) })
    }

    /// This rank's rows of the index-th parameter: the shard itself, which
    /// the optimizer updates in place.
    pub fn shard(&self, index: usize) -> Result<Tensor> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().fsdp_shard)(self.raw, index, &mut out) })?;
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }

    /// The shard's gradient (same shape and dtype); it accumulates until
    /// zeroed (`Module::zero_grad` zeroes it too).
    pub fn shard_grad(&self, index: usize) -> Result<Tensor> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().fsdp_shard_grad)(self.raw, index, &mut out) })?;
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }
}

/// State dicts of a module whose parameters `Fsdp` hold (the root, say).
impl Module {
    /// Collective over `pg`: gathers each sharded parameter and rank 0 writes
    /// `path` as `save` would for the unsharded module (the other ranks
    /// write nothing; rank 0's outcome is every rank's). Every `Fsdp`
    /// involved must be resharded.
    pub fn save_full_state_dict(&self, pg: &ProcessGroup, path: &str) -> Result<()> {
        let _call = self.access(Access::Read, Access::Read, Access::Untouched).begin("save_full_state_dict")?;
        let c = cstring("path", path)?;
        self.lib.check(unsafe { (self.lib.api().fsdp_save_full_state_dict)(self.raw, pg.raw, c.as_ptr()) })
    }

    /// The full state dict in memory: collective over `pg` as
    /// `save_full_state_dict`; on rank `root` (every rank for `None`) a new
    /// module of the unsharded tensors, cpu copies under the file's names;
    /// `None` on the other ranks.
    pub fn full_state_dict(&self, pg: &ProcessGroup, root: Option<i32>) -> Result<Option<Module>> {
        let _call = self.access(Access::Read, Access::Read, Access::Untouched).begin("full_state_dict")?;
        let mut out = ptr::null_mut();
        let api = self.lib.api();
        self.lib.check(unsafe { (api.fsdp_full_state_dict)(self.raw, pg.raw, root.unwrap_or(-1), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Module::from_raw(&self.lib, out) }) })
    }

    /// Local: every rank reads `path` and keeps its rows of the sharded
    /// parameters, every other tensor whole.
    pub fn load_full_state_dict(&mut self, path: &str, strict: bool) -> Result<()> {
        let _call = self.access(Access::Write, Access::Write, Access::Untouched).begin("load_full_state_dict")?;
        let c = cstring("path", path)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.fsdp_load_full_state_dict)(self.raw, c.as_ptr(), strict as c_int) })
    }

    /// Collective over `pg`: each rank writes its rows to
    /// `folder/shard-RRRRR-of-WWWWW-<id>.safetensors` (rank 0's also holds the
    /// tensors that are not sharded), then rank 0 writes `manifest.json`
    /// last. It succeeds on every rank or fails on every rank, and a failed
    /// save leaves the folder's last complete save loadable.
    pub fn save_sharded_state_dict(&self, pg: &ProcessGroup, folder: &str) -> Result<()> {
        let _call = self.access(Access::Read, Access::Read, Access::Untouched).begin("save_sharded_state_dict")?;
        let c = cstring("folder", folder)?;
        self.lib.check(unsafe { (self.lib.api().fsdp_save_sharded_state_dict)(self.raw, pg.raw, c.as_ptr()) })
    }

    /// [`save_sharded_state_dict`](Self::save_sharded_state_dict) in the
    /// background: copies this rank's part aside and returns; a library
    /// thread writes the same files and manifest, and the [`Work`] reports
    /// the save's outcome, the same on every rank. What the host changes
    /// after the call returns is not saved; `pg` stays the host's to drive.
    pub fn save_sharded_state_dict_async(&self, pg: &ProcessGroup, folder: &str) -> Result<Work<'static>> {
        let _call =
            self.access(Access::Read, Access::Read, Access::Untouched).begin("save_sharded_state_dict_async")?;
        let c = cstring("folder", folder)?;
        let mut out = ptr::null_mut();
        let api = self.lib.api();
        self.lib.check(unsafe { (api.fsdp_save_sharded_state_dict_async)(self.raw, pg.raw, c.as_ptr(), &mut out) })?;
        Ok(Work::unscoped(out, self.lib.clone()))
    }

    /// Reads the rows this rank keeps now from a complete sharded save (made
    /// at any world size), checked against its manifest. Collective over the
    /// group of the `Fsdp` holding the module: every rank loads, or none
    /// does and the module is unchanged.
    pub fn load_sharded_state_dict(&mut self, folder: &str) -> Result<()> {
        let _call = self.access(Access::Write, Access::Write, Access::Untouched).begin("load_sharded_state_dict")?;
        let c = cstring("folder", folder)?;
        self.lib.check(unsafe { (self.lib.api().fsdp_load_sharded_state_dict)(self.raw, c.as_ptr()) })
    }
}
