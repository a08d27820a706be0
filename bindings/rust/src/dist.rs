//! Stores, process groups and their asynchronous work.

use std::ffi::CString;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Mutex;

use crate::error::{cstring, owned_text};
use crate::view::{borrow_tensor, StorageBorrow};
use crate::{sys, Device, InPlace, Library, Result, Tensor};

/// Borrows the memory of a collective's inputs (read) and outputs (written).
fn borrow_all(lib: &Library, inputs: &[&Tensor], outputs: &[Tensor]) -> Result<Vec<StorageBorrow>> {
    let mut borrows = Vec::with_capacity(inputs.len() + outputs.len());
    for t in inputs {
        borrows.push(borrow_tensor(lib, t.raw, false)?);
    }
    for t in outputs {
        borrows.push(borrow_tensor(lib, t.raw, true)?);
    }
    Ok(borrows)
}

/// A key-value store for rendezvous (dp_store_*); safe from any thread.
pub struct Store {
    pub(crate) raw: *mut sys::dp_store,
    pub(crate) lib: Library,
}

unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Store")
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        unsafe { (self.lib.api().store_destroy)(self.raw) };
    }
}

impl Store {
    pub fn file(lib: &Library, path: &str, world_size: i32) -> Result<Store> {
        let c = cstring("path", path)?;
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().store_create_file)(&mut out, c.as_ptr(), world_size) })?;
        Ok(Store { raw: out, lib: lib.clone() })
    }

    pub fn tcp(
        lib: &Library,
        host: &str,
        port: u16,
        world_size: i32,
        is_server: bool,
        timeout_ms: i32,
    ) -> Result<Store> {
        let c = cstring("host", host)?;
        let mut out = ptr::null_mut();
        lib.check(unsafe {
            (lib.api().store_create_tcp)(&mut out, c.as_ptr(), port, world_size, is_server as c_int, timeout_ms)
        })?;
        Ok(Store { raw: out, lib: lib.clone() })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let c = cstring("key", key)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.store_set)(self.raw, c.as_ptr(), value.as_ptr() as *const c_void, value.len()) })
    }

    /// Waits up to the store's timeout for `key`, then returns its value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let c = cstring("key", key)?;
        let api = self.lib.api();
        let mut len = 0usize;
        self.lib.check(unsafe { (api.store_get)(self.raw, c.as_ptr(), ptr::null_mut(), 0, &mut len) })?;
        let mut buf = vec![0u8; len];
        // A value that grew in between is DP_EINVAL giving its length.
        self.lib
            .check(unsafe { (api.store_get)(self.raw, c.as_ptr(), buf.as_mut_ptr() as *mut c_void, len, &mut len) })?;
        buf.truncate(len);
        Ok(buf)
    }

    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let c = cstring("key", key)?;
        let mut out = 0i64;
        self.lib.check(unsafe { (self.lib.api().store_add)(self.raw, c.as_ptr(), delta, &mut out) })?;
        Ok(out)
    }

    /// Waits until every key exists; `timeout_ms` < 0 means the store's timeout.
    pub fn wait(&self, keys: &[&str], timeout_ms: i32) -> Result<()> {
        let owned: Vec<CString> = keys.iter().map(|k| cstring("keys", k)).collect::<Result<_>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
        self.lib.check(unsafe { (self.lib.api().store_wait)(self.raw, ptrs.as_ptr(), ptrs.len(), timeout_ms) })
    }

    pub fn tcp_port(&self) -> Result<u16> {
        let mut port = 0u16;
        self.lib.check(unsafe { (self.lib.api().store_tcp_port)(self.raw, &mut port) })?;
        Ok(port)
    }

    pub fn set_timeout(&self, timeout_ms: i32) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().store_set_timeout)(self.raw, timeout_ms) })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Backend {
    Auto = 0,
    Gloo = 1,
    Nccl = 2,
    /// Shared memory; fails (unsupported) when the ranks span several hosts.
    Shm = 3,
    /// The site's MPI, loaded at run time; the ranks must be started by mpirun.
    Mpi = 4,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Min = 2,
    Max = 3,
    Prod = 4,
}

/// dp_process_group_options; `None` rank or world size come from the environment.
#[derive(Clone, Copy, Debug)]
pub struct ProcessGroupOptions<'s> {
    pub backend: Backend,
    pub rank: Option<i32>,
    pub world_size: Option<i32>,
    /// None: a TCP store served by rank 0 at DP_STORE_ADDR:DP_STORE_PORT,
    /// else MASTER_ADDR:MASTER_PORT.
    pub store: Option<&'s Store>,
    pub timeout_ms: i32,
    pub device: Device,
}

impl Default for ProcessGroupOptions<'_> {
    fn default() -> Self {
        ProcessGroupOptions {
            backend: Backend::Auto,
            rank: None,
            world_size: None,
            store: None,
            timeout_ms: 300_000,
            device: Device::cpu(0),
        }
    }
}

impl ProcessGroupOptions<'_> {
    pub(crate) fn raw_options(&self, lib: &Library) -> Result<sys::dp_process_group_options> {
        let mut o = sys::dp_process_group_options {
            struct_size: std::mem::size_of::<sys::dp_process_group_options>(),
            backend: 0,
            rank: -1,
            world_size: -1,
            store: ptr::null_mut(),
            timeout_ms: 0,
            device: Device::cpu(0).0,
        };
        lib.check(unsafe {
            (lib.api().process_group_options_init)(&mut o, std::mem::size_of::<sys::dp_process_group_options>())
        })?;
        o.backend = self.backend as i32;
        o.rank = self.rank.unwrap_or(-1);
        o.world_size = self.world_size.unwrap_or(-1);
        o.store = self.store.map_or(ptr::null_mut(), |s| s.raw);
        o.timeout_ms = self.timeout_ms;
        o.device = self.device.0;
        Ok(o)
    }
}

/// A process group (dp_process_group_*): calls from several threads are
/// serialised by the library.
pub struct ProcessGroup {
    pub(crate) raw: *mut sys::dp_process_group,
    pub(crate) lib: Library,
    pub(crate) owned: bool,
}

unsafe impl Send for ProcessGroup {}
unsafe impl Sync for ProcessGroup {}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProcessGroup(rank {} of {}, {})", self.rank(), self.size(), self.backend())
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if self.owned {
            unsafe { (self.lib.api().process_group_destroy)(self.raw) };
        }
    }
}

impl ProcessGroup {
    /// Joins the group dp-run (or torchrun, mpirun, srun) describes in the
    /// environment: RANK, WORLD_SIZE and the store at DP_STORE_ADDR:
    /// DP_STORE_PORT (dp-run's, leaving MASTER_PORT to the program's own
    /// framework), else MASTER_ADDR:MASTER_PORT (dp_dist.h has the rest).
    pub fn from_env(lib: &Library) -> Result<ProcessGroup> {
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().process_group_create_from_env)(&mut out, ptr::null()) })?;
        Ok(ProcessGroup { raw: out, lib: lib.clone(), owned: true })
    }

    /// As `from_env`, with options.
    pub fn from_env_with(lib: &Library, options: &ProcessGroupOptions<'_>) -> Result<ProcessGroup> {
        let o = options.raw_options(lib)?;
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().process_group_create_from_env)(&mut out, &o) })?;
        Ok(ProcessGroup { raw: out, lib: lib.clone(), owned: true })
    }

    /// dp_process_group_create: the options' rank and world size win.
    pub fn new(lib: &Library, options: &ProcessGroupOptions<'_>) -> Result<ProcessGroup> {
        let o = options.raw_options(lib)?;
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().process_group_create)(&mut out, &o) })?;
        Ok(ProcessGroup { raw: out, lib: lib.clone(), owned: true })
    }

    pub fn rank(&self) -> i32 {
        unsafe { (self.lib.api().process_group_rank)(self.raw) }
    }

    pub fn size(&self) -> i32 {
        unsafe { (self.lib.api().process_group_size)(self.raw) }
    }

    /// "shm", "shm+gloo", "gloo" or "nccl".
    pub fn backend(&self) -> String {
        unsafe { owned_text((self.lib.api().process_group_backend)(self.raw)) }
    }

    /// This rank's index among the group's ranks on its host.
    pub fn local_rank(&self) -> i32 {
        unsafe { (self.lib.api().process_group_local_rank)(self.raw) }
    }

    /// How many of the group's ranks run on this host.
    pub fn local_size(&self) -> i32 {
        unsafe { (self.lib.api().process_group_local_size)(self.raw) }
    }

    /// How many hosts the group spans.
    pub fn num_hosts(&self) -> i32 {
        unsafe { (self.lib.api().process_group_num_hosts)(self.raw) }
    }

    /// Aborts the group, from any thread, also while another thread's call
    /// on it runs: every later call fails (DP_ESTATE, "aborted"), and the
    /// peers' next calls fail rather than wait for their timeout; a running
    /// call fails at once on shared memory, NCCL and MPI, at its deadline on Gloo
    /// (dp_dist.h).
    pub fn abort(&self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().process_group_abort)(self.raw) })
    }

    /// dp_process_group_split, collective over this group (MPI_Comm_split):
    /// the ranks passing the same `color` >= 0 form a new group ranked by
    /// (`key`, rank here); a negative color joins none (`None`). The new
    /// group has this one's timeout and device, and chooses its backend.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<ProcessGroup>> {
        self.split_raw(color, key, ptr::null())
    }

    /// As `split`, the new group with the options' backend, timeout and
    /// device (their rank, world size and store are not used).
    pub fn split_with(&self, color: i32, key: i32, options: &ProcessGroupOptions<'_>) -> Result<Option<ProcessGroup>> {
        let o = options.raw_options(&self.lib)?;
        self.split_raw(color, key, &o)
    }

    /// After a peer's failure, every survivor calls it: they agree on who
    /// is left and each gets a new group of the survivors in their old
    /// order (dp_dist.h). This group is left as it was.
    pub fn shrink(&self) -> Result<ProcessGroup> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().process_group_shrink)(self.raw, &mut out) })?;
        Ok(ProcessGroup { raw: out, lib: self.lib.clone(), owned: true })
    }

    /// The ranks this group's last shrink left out (for a group made by a
    /// shrink: those left out of the group it came from).
    pub fn lost_ranks(&self) -> Result<Vec<i32>> {
        let api = self.lib.api();
        let n = unsafe { (api.process_group_lost_ranks)(self.raw, ptr::null_mut(), 0) };
        if n < 0 {
            return Err(self.lib.error(sys::DP_EINVAL));
        }
        let mut ranks = vec![0i32; n as usize];
        let got = unsafe { (api.process_group_lost_ranks)(self.raw, ranks.as_mut_ptr(), ranks.len()) };
        if got < 0 {
            return Err(self.lib.error(sys::DP_EINVAL));
        }
        ranks.truncate(got as usize);
        Ok(ranks)
    }

    fn split_raw(
        &self,
        color: i32,
        key: i32,
        options: *const sys::dp_process_group_options,
    ) -> Result<Option<ProcessGroup>> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().process_group_split)(self.raw, color, key, options, &mut out) })?;
        Ok((!out.is_null()).then(|| ProcessGroup { raw: out, lib: self.lib.clone(), owned: true }))
    }

    // The collectives refuse a tensor whose memory a live slice covers,
    // through any handle (see `Tensor::as_slice`): they write their
    // outputs, and read their inputs, while the call runs.

    pub fn all_reduce<T: InPlace + ?Sized>(&self, tensor: &mut T, op: ReduceOp) -> Result<()> {
        let raw = tensor.raw_mut();
        let _written = borrow_tensor(&self.lib, raw, true)?;
        self.lib.check(unsafe { (self.lib.api().pg_all_reduce)(self.raw, raw, op as i32) })
    }

    pub fn broadcast<T: InPlace + ?Sized>(&self, tensor: &mut T, root: i32) -> Result<()> {
        let raw = tensor.raw_mut();
        let _written = borrow_tensor(&self.lib, raw, true)?;
        self.lib.check(unsafe { (self.lib.api().pg_broadcast)(self.raw, raw, root) })
    }

    /// `outputs[r]` receives rank r's input.
    pub fn all_gather(&self, input: &Tensor, outputs: &mut [Tensor]) -> Result<()> {
        let _borrows = borrow_all(&self.lib, &[input], outputs)?;
        let raw: Vec<*mut sys::dp_tensor> = outputs.iter().map(|t| t.raw).collect();
        self.lib.check(unsafe { (self.lib.api().pg_all_gather)(self.raw, input.raw, raw.as_ptr(), raw.len()) })
    }

    /// `output` = the reduction over the ranks of their `inputs[this rank]`
    /// (one input per rank).
    pub fn reduce_scatter<T: InPlace + ?Sized>(&self, inputs: &[&Tensor], output: &mut T, op: ReduceOp) -> Result<()> {
        let out = output.raw_mut();
        let _read = borrow_all(&self.lib, inputs, &[])?;
        let _written = borrow_tensor(&self.lib, out, true)?;
        let raw: Vec<*const sys::dp_tensor> = inputs.iter().map(|t| t.raw as *const _).collect();
        let api = self.lib.api();
        self.lib.check(unsafe { (api.pg_reduce_scatter)(self.raw, raw.as_ptr(), raw.len(), out, op as i32) })
    }

    /// Runs `body` with a [`WorkScope`], through which it starts
    /// asynchronous collectives on tensors from outside the scope; returns
    /// once every collective started there has finished, also when `body`
    /// panics (the panic then goes on) or forgot a [`Work`]. The tensors stay
    /// borrowed until then; a `Work` waited for (or dropped) in the scope
    /// gives the collective's result, a forgotten one's is not reported.
    ///
    /// ```no_run
    /// # use dparallel::{DType, Device, Library, ProcessGroup, ReduceOp, Tensor};
    /// # let lib = Library::open(None)?;
    /// # let pg = ProcessGroup::from_env(&lib)?;
    /// let mut grads = Tensor::zeros(&lib, DType::F32, &[1024], Device::cpu(0))?;
    /// let mut stats = Tensor::zeros(&lib, DType::F64, &[2], Device::cpu(0))?;
    /// pg.scope(|s| {
    ///     let a = s.all_reduce_async(&mut grads, ReduceOp::Avg)?;
    ///     let b = s.all_reduce_async(&mut stats, ReduceOp::Sum)?;
    ///     a.wait()?;
    ///     b.wait()
    /// })?;
    /// println!("{:?}", stats.to_vec::<f64>()?);
    /// # Ok::<(), dparallel::Error>(())
    /// ```
    pub fn scope<'env, R, F>(&'env self, body: F) -> R
    where
        F: for<'scope> FnOnce(&'scope WorkScope<'scope, 'env>) -> R,
    {
        let scope = WorkScope {
            pg: self,
            pending: Mutex::new(Vec::new()),
            borrows: Mutex::new(Vec::new()),
            _scope: PhantomData,
            _env: PhantomData,
        };
        // Declared after `scope`, dropped before it: waits on the way out,
        // panics included.
        let _wait_all = WaitAll(&scope);
        body(&scope)
    }

    fn work<'s>(
        &self,
        st: sys::dp_status,
        out: *mut sys::dp_work,
        scope: Option<&'s WorkScope<'s, '_>>,
    ) -> Result<Work<'s>> {
        self.lib.check(st)?;
        let slot = scope.map(|s| {
            let mut pending = s.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.push(PendingWork(out));
            (&s.pending, pending.len() - 1)
        });
        Ok(Work { raw: out, lib: self.lib.clone(), done: false, slot })
    }

    /// Starts a barrier.
    pub fn barrier_async(&self) -> Result<Work<'static>> {
        let mut out = ptr::null_mut();
        let st = unsafe { (self.lib.api().pg_barrier_async)(self.raw, &mut out) };
        self.work(st, out, None)
    }

    pub fn barrier(&self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().pg_barrier)(self.raw) })
    }
}

/// Where the asynchronous collectives on borrowed tensors start
/// ([`ProcessGroup::scope`]): the scope waits for each of them before it
/// returns, so a tensor is never written after its borrow ends, even when a
/// [`Work`] is forgotten.
pub struct WorkScope<'scope, 'env: 'scope> {
    pg: &'env ProcessGroup,
    // What the scope waits for and destroys on the way out: a Work waited
    // for or dropped takes its own out (null).
    pending: Mutex<Vec<PendingWork>>,
    // The memory the collectives read or write, kept from slices until
    // every one of them is done (dropped after WaitAll).
    borrows: Mutex<Vec<StorageBorrow>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

struct PendingWork(*mut sys::dp_work);

// The handles are used under the lock, or by the one Work that took them.
unsafe impl Send for PendingWork {}

impl fmt::Debug for WorkScope<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WorkScope")
    }
}

/// Waits for, then destroys, what the scope still holds.
struct WaitAll<'a, 'scope, 'env>(&'a WorkScope<'scope, 'env>);

impl Drop for WaitAll<'_, '_, '_> {
    fn drop(&mut self) {
        let pending = std::mem::take(&mut *self.0.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let api = self.0.pg.lib.api();
        for PendingWork(raw) in pending {
            if !raw.is_null() {
                unsafe {
                    (api.work_wait)(raw);
                    (api.work_destroy)(raw);
                }
            }
        }
    }
}

impl<'scope> WorkScope<'scope, '_> {
    /// The group the collectives run on.
    pub fn group(&self) -> &ProcessGroup {
        self.pg
    }

    // Keeps the collective's memory from slices until the scope ends.
    fn keep(&self, borrows: Vec<StorageBorrow>) {
        self.borrows.lock().unwrap_or_else(|p| p.into_inner()).extend(borrows);
    }

    /// Starts an all_reduce of `tensor` in place.
    pub fn all_reduce_async<T: InPlace + ?Sized>(
        &'scope self,
        tensor: &'scope mut T,
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        let mut out = ptr::null_mut();
        let raw = tensor.raw_mut();
        let written = borrow_tensor(&self.pg.lib, raw, true)?;
        let st = unsafe { (self.pg.lib.api().pg_all_reduce_async)(self.pg.raw, raw, op as i32, &mut out) };
        self.keep(vec![written]);
        self.pg.work(st, out, Some(self))
    }

    /// Starts a broadcast of `tensor` from `root`.
    pub fn broadcast_async<T: InPlace + ?Sized>(
        &'scope self,
        tensor: &'scope mut T,
        root: i32,
    ) -> Result<Work<'scope>> {
        let mut out = ptr::null_mut();
        let raw = tensor.raw_mut();
        let written = borrow_tensor(&self.pg.lib, raw, true)?;
        let st = unsafe { (self.pg.lib.api().pg_broadcast_async)(self.pg.raw, raw, root, &mut out) };
        self.keep(vec![written]);
        self.pg.work(st, out, Some(self))
    }

    /// Starts an all_gather: `outputs[r]` receives rank r's `input`.
    pub fn all_gather_async(
        &'scope self,
        input: &'scope Tensor,
        outputs: &'scope mut [Tensor],
    ) -> Result<Work<'scope>> {
        let borrows = borrow_all(&self.pg.lib, &[input], outputs)?;
        let raw: Vec<*mut sys::dp_tensor> = outputs.iter().map(|t| t.raw).collect();
        let mut out = ptr::null_mut();
        let api = self.pg.lib.api();
        let st = unsafe { (api.pg_all_gather_async)(self.pg.raw, input.raw, raw.as_ptr(), raw.len(), &mut out) };
        self.keep(borrows);
        self.pg.work(st, out, Some(self))
    }

    /// Starts a reduce_scatter (`ProcessGroup::reduce_scatter`).
    pub fn reduce_scatter_async<T: InPlace + ?Sized>(
        &'scope self,
        inputs: &[&'scope Tensor],
        output: &'scope mut T,
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        let output = output.raw_mut();
        let mut borrows = borrow_all(&self.pg.lib, inputs, &[])?;
        borrows.push(borrow_tensor(&self.pg.lib, output, true)?);
        let raw: Vec<*const sys::dp_tensor> = inputs.iter().map(|t| t.raw as *const _).collect();
        let mut out = ptr::null_mut();
        let api = self.pg.lib.api();
        let st =
            unsafe { (api.pg_reduce_scatter_async)(self.pg.raw, raw.as_ptr(), raw.len(), output, op as i32, &mut out) };
        self.keep(borrows);
        self.pg.work(st, out, Some(self))
    }
}

/// An asynchronous collective (dp_work). Dropping it waits for the
/// collective. One on borrowed tensors comes from a [`WorkScope`], which
/// waits for it, forgotten or not, before the borrow ends.
pub struct Work<'s> {
    pub(crate) raw: *mut sys::dp_work,
    pub(crate) lib: Library,
    pub(crate) done: bool,
    // The scope's entry for it, taken out when it is waited for or dropped.
    slot: Option<(&'s Mutex<Vec<PendingWork>>, usize)>,
}

unsafe impl Send for Work<'_> {}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Work")
    }
}

impl Work<'_> {
    /// The collective's result once it has finished.
    pub fn wait(mut self) -> Result<()> {
        self.done = true;
        self.lib.check(unsafe { (self.lib.api().work_wait)(self.raw) })
    }

    /// Whether it has finished.
    pub fn test(&mut self) -> Result<bool> {
        let mut done: c_int = 0;
        self.lib.check(unsafe { (self.lib.api().work_test)(self.raw, &mut done) })?;
        Ok(done != 0)
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if let Some((pending, index)) = self.slot {
            pending.lock().unwrap_or_else(|p| p.into_inner())[index].0 = ptr::null_mut();
        }
        let api = self.lib.api();
        unsafe {
            if !self.done {
                (api.work_wait)(self.raw);
            }
            (api.work_destroy)(self.raw);
        }
    }
}
