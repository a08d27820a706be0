//! Slices of a CPU tensor's memory, checked per storage.
//!
//! Several handles may reach one storage (`Module::grad` and
//! `Module::parameter` return a new handle each time, a registered tensor
//! shares the module's slot), so `&mut Tensor` alone cannot make a mutable
//! slice exclusive. Every live slice is recorded here by the address range
//! it covers, as `RefCell` records its borrows: a mutable slice over memory
//! any other slice covers, or a shared one over memory a mutable slice
//! covers, is refused with DP_ESTATE, whichever handle it comes through.
//!
//! A library call that reads or writes memory on its own (zero_grad, load,
//! a DDP or FSDP step, a collective) records the ranges it may touch for
//! its duration ([`CallAccess`]): it is refused while a conflicting slice
//! lives, and a conflicting slice is refused while it runs. Calls do not
//! exclude one another (the library orders its own accesses), and closures
//! the library runs during a call (forward closures, comm hooks) may take
//! slices of the memory it lends them.
//!
//! Work a call leaves running (a DDP bucket's reduction after a mark, an
//! FSDP unshard or reduce-scatter, a DLPack export's holder) keeps its
//! ranges recorded past the call ([`CallAccess::begin_pending`]), held by
//! the handle that started it until the call (or deleter) that completes it.

use std::cell::Cell;
use std::collections::HashSet;
use std::ffi::CStr;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::{sys, Element, Error, Library, Module, Result, DP_ESTATE};

struct Borrow {
    id: u64,
    start: usize,
    end: usize,
    exclusive: bool,
    // Held by a library call rather than a slice.
    call: bool,
    // Held past its call by work the call left running: what that work is
    // and which call completes it.
    pending: Option<&'static str>,
    // Closures the library runs may take slices of it.
    lendable: bool,
}

thread_local! {
    // Closures the library is running on this thread, inside a call.
    static IN_CALLBACK: Cell<usize> = const { Cell::new(0) };
}

/// Marks the current thread as running a closure for the library while it
/// lives: the memory of the calls in progress is lent to it.
pub(crate) struct CallbackScope(());

impl CallbackScope {
    pub(crate) fn enter() -> CallbackScope {
        IN_CALLBACK.with(|n| n.set(n.get() + 1));
        CallbackScope(())
    }
}

impl Drop for CallbackScope {
    fn drop(&mut self) {
        IN_CALLBACK.with(|n| n.set(n.get() - 1));
    }
}

fn in_callback() -> bool {
    IN_CALLBACK.with(|n| n.get() > 0)
}

// Few slices are live at once: a scan is cheaper than an interval tree.
static BORROWS: Mutex<Vec<Borrow>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One recorded borrow of `[start, end)`; dropping it ends the borrow.
pub(crate) struct StorageBorrow {
    id: u64,
}

impl StorageBorrow {
    /// Records a borrow of `bytes` bytes at `start`, or refuses one that
    /// conflicts with a live slice. An empty range borrows nothing.
    pub(crate) fn acquire(start: usize, bytes: usize, exclusive: bool) -> Result<StorageBorrow> {
        if bytes == 0 || start == 0 {
            return Ok(StorageBorrow { id: 0 });
        }
        let end = start.saturating_add(bytes);
        // Nothing panics while the lock is held, so a poisoned lock is sound.
        let mut borrows = BORROWS.lock().unwrap_or_else(|e| e.into_inner());
        let lent = in_callback();
        if let Some(other) = borrows
            .iter()
            .find(|b| b.start < end && start < b.end && (exclusive || b.exclusive) && !(b.lendable && lent))
        {
            if let Some(pending) = other.pending {
                return Err(Error::new(DP_ESTATE, format!("tensor: {pending}; take the slice after that")));
            }
            if other.call {
                return Err(Error::new(
                    DP_ESTATE,
                    format!(
                        "tensor: its memory is being {} by a library call in progress on another thread; take the \
                         slice once it returns",
                        if other.exclusive { "written" } else { "read" }
                    ),
                ));
            }
            let (held, wanted) = if other.exclusive { ("a mutable", "") } else { ("a shared", "mutable ") };
            return Err(Error::new(
                DP_ESTATE,
                format!(
                    "tensor: its memory is borrowed by {held} slice (through this or another handle on the same \
                     storage); drop that slice before taking a {wanted}one"
                ),
            ));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        borrows.push(Borrow { id, start, end, exclusive, call: false, pending: None, lendable: false });
        Ok(StorageBorrow { id })
    }

    /// Keeps the ranges recorded for the rest of the process: work that
    /// may still use the memory was left running (a timeout).
    pub(crate) fn keep_forever(self) {
        std::mem::forget(self);
    }
}

/// Whether work of kind `pending` holds memory overlapping `bytes` bytes
/// at `start`.
pub(crate) fn pending_over(start: usize, bytes: usize, pending: Pending) -> bool {
    let end = start.saturating_add(bytes);
    let borrows = BORROWS.lock().unwrap_or_else(|e| e.into_inner());
    borrows.iter().any(|b| b.start < end && start < b.end && b.pending == Some(pending.why))
}

/// Work a library call leaves running past its return, which keeps its
/// memory out of reach of slices until the call that completes it.
#[derive(Clone, Copy)]
pub(crate) struct Pending {
    /// Why a slice is refused meanwhile, naming the completing call.
    pub(crate) why: &'static str,
    /// Closures the library runs (comm hooks, on_bucket_reduced, stream
    /// host functions, forwards) are ordered with that work, as with a call.
    pub(crate) lent_to_closures: bool,
}

pub(crate) const DDP_MARKED: Pending = Pending {
    why:
        "its memory is a gradient marked ready (Ddp::mark_grad_ready*), which its bucket's reduction reads and writes \
          in the background until Ddp::finish_backward returns",
    lent_to_closures: true,
};

pub(crate) const FSDP_UNSHARD: Pending = Pending {
    why:
        "its memory is a shard the all-gather of Fsdp::unshard_async reads in the background until Fsdp::wait_unshard \
          (or unshard, reshard, post_backward) returns",
    lent_to_closures: true,
};

pub(crate) const FSDP_POST_BACKWARD: Pending = Pending {
    why: "its memory is a gradient the reduce-scatter of Fsdp::post_backward uses in the background until \
          Fsdp::finish_backward (or the next post_backward) returns",
    lent_to_closures: true,
};

pub(crate) const DLPACK_EXPORT: Pending = Pending {
    why: "its memory is exported through DLPack (Tensor::to_dlpack), whose holder may write it until the capsule's \
          deleter runs (the DlPack dropped, or its consumer done with it)",
    lent_to_closures: false,
};

/// How a library call uses one kind of memory.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Untouched,
    Read,
    Write,
}

/// The memory one library call may read or write, collected before the
/// call and held by it ([`CallAccess::begin`]) while it runs.
pub(crate) struct CallAccess {
    // (start, end, written)
    ranges: Vec<(usize, usize, bool)>,
}

// Parameters whose gradient a host can reach (it took it through
// `Module::grad` or set it), by the address of the parameter's value: only
// those gradients are enumerated, as dp_module_grad allocates the others.
static GRADS_REACHED: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// Records that the gradient of the parameter whose value is at `value` is
/// reachable from the host.
pub(crate) fn note_grad_reached(value: usize) {
    if value != 0 {
        GRADS_REACHED.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashSet::new).insert(value);
    }
}

impl CallAccess {
    pub(crate) fn new() -> CallAccess {
        CallAccess { ranges: Vec::new() }
    }

    pub(crate) fn range(&mut self, start: usize, bytes: usize, access: Access) -> &mut CallAccess {
        if access != Access::Untouched && start != 0 && bytes != 0 {
            self.ranges.push((start, start.saturating_add(bytes), access == Access::Write));
        }
        self
    }

    pub(crate) fn tensor(&mut self, lib: &Library, raw: *mut sys::dp_tensor, access: Access) -> &mut CallAccess {
        if raw.is_null() {
            return self;
        }
        let data = unsafe { (lib.api().tensor_data)(raw) } as usize;
        let bytes = unsafe { (lib.api().tensor_nbytes)(raw) };
        self.range(data, bytes, access)
    }

    /// Every parameter, buffer and host-reachable gradient of `module`'s
    /// tree, in one pass over its listing.
    pub(crate) fn module(&mut self, module: &Module, parameters: Access, buffers: Access, grads: Access) -> &mut Self {
        let lib = &module.lib;
        let api = lib.api();
        if parameters != Access::Untouched || grads != Access::Untouched {
            let reached = GRADS_REACHED.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default();
            for index in 0..module.num_parameters() {
                let mut name = std::ptr::null();
                let mut value = std::ptr::null_mut();
                if unsafe { (api.module_parameter_at)(module.raw, index, &mut name, &mut value) } != sys::DP_OK
                    || value.is_null()
                {
                    continue;
                }
                let address = unsafe { (api.tensor_data)(value) } as usize;
                self.tensor(lib, value, parameters);
                unsafe { (api.tensor_destroy)(value) };
                if grads == Access::Untouched || !reached.contains(&address) {
                    continue;
                }
                let mut grad = std::ptr::null_mut();
                if unsafe { (api.module_grad)(module.raw, name, &mut grad) } == sys::DP_OK && !grad.is_null() {
                    self.tensor(lib, grad, grads);
                    unsafe { (api.tensor_destroy)(grad) };
                }
            }
        }
        if buffers != Access::Untouched {
            for index in 0..module.num_buffers() {
                let mut name = std::ptr::null();
                let mut value = std::ptr::null_mut();
                if unsafe { (api.module_buffer_at)(module.raw, index, &mut name, &mut value) } == sys::DP_OK
                    && !value.is_null()
                {
                    self.tensor(lib, value, buffers);
                    unsafe { (api.tensor_destroy)(value) };
                }
            }
        }
        self
    }

    /// The gradient of `module`'s parameter `name`, which dp_module_grad
    /// allocates (zeroed) if it has none yet; nothing when there is none to
    /// have (an unknown name, a sharded slot).
    pub(crate) fn grad(&mut self, module: &Module, name: &CStr, access: Access) -> &mut Self {
        let api = module.lib.api();
        let mut grad = std::ptr::null_mut();
        if unsafe { (api.module_grad)(module.raw, name.as_ptr(), &mut grad) } == sys::DP_OK && !grad.is_null() {
            self.tensor(&module.lib, grad, access);
            unsafe { (api.tensor_destroy)(grad) };
        }
        self
    }

    /// As [`CallAccess::grad`], only when the host can reach that gradient
    /// (see [`note_grad_reached`]), so that nothing is allocated.
    pub(crate) fn reached_grad(&mut self, module: &Module, name: &CStr, access: Access) -> &mut Self {
        let api = module.lib.api();
        let mut value = std::ptr::null_mut();
        if unsafe { (api.module_get_parameter)(module.raw, name.as_ptr(), &mut value) } != sys::DP_OK || value.is_null()
        {
            return self;
        }
        let address = unsafe { (api.tensor_data)(value) } as usize;
        unsafe { (api.tensor_destroy)(value) };
        let reached =
            GRADS_REACHED.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|r| r.contains(&address));
        if reached {
            self.grad(module, name, access);
        }
        self
    }

    /// Refuses the call named `what` with DP_ESTATE when a live slice
    /// covers memory it writes, or a live mutable slice memory it reads;
    /// otherwise holds the ranges until the returned borrow drops.
    pub(crate) fn begin(&self, what: &str) -> Result<StorageBorrow> {
        self.hold(what, None)
    }

    /// As [`CallAccess::begin`], for work `what` leaves running past its
    /// return: the caller keeps the borrow until the work is complete, and
    /// slices refused meanwhile say why (`pending`).
    pub(crate) fn begin_pending(&self, what: &str, pending: Pending) -> Result<StorageBorrow> {
        self.hold(what, Some(pending))
    }

    fn hold(&self, what: &str, pending: Option<Pending>) -> Result<StorageBorrow> {
        if self.ranges.is_empty() {
            return Ok(StorageBorrow { id: 0 });
        }
        let mut borrows = BORROWS.lock().unwrap_or_else(|e| e.into_inner());
        for &(start, end, written) in &self.ranges {
            let conflict =
                borrows.iter().find(|b| !b.call && b.start < end && start < b.end && (written || b.exclusive));
            if let Some(other) = conflict {
                let held = if other.exclusive { "a mutable" } else { "a shared" };
                let used = if written { "writes" } else { "reads" };
                return Err(Error::new(
                    DP_ESTATE,
                    format!(
                        "{what}: memory it {used} is borrowed by {held} slice (through a tensor handle on the same \
                         storage); drop that slice before the call"
                    ),
                ));
            }
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        for &(start, end, written) in &self.ranges {
            borrows.push(Borrow {
                id,
                start,
                end,
                exclusive: written,
                call: true,
                pending: pending.map(|p| p.why),
                lendable: pending.map_or(true, |p| p.lent_to_closures),
            });
        }
        Ok(StorageBorrow { id })
    }
}

/// Keeps slices over `raw`'s memory out while the library reads it
/// (`exclusive` false) or writes it (true) for a call: a collective on a
/// tensor whose memory another handle's slice covers is refused.
pub(crate) fn borrow_tensor(lib: &Library, raw: *mut sys::dp_tensor, exclusive: bool) -> Result<StorageBorrow> {
    let data = unsafe { (lib.api().tensor_data)(raw) } as usize;
    let bytes = unsafe { (lib.api().tensor_nbytes)(raw) };
    StorageBorrow::acquire(data, bytes, exclusive)
}

impl Drop for StorageBorrow {
    fn drop(&mut self) {
        if self.id == 0 {
            return;
        }
        let mut borrows = BORROWS.lock().unwrap_or_else(|e| e.into_inner());
        borrows.retain(|b| b.id != self.id);
    }
}

/// A CPU tensor's elements, read in place (from [`crate::Tensor::as_slice`]).
/// It derefs to `&[T]`; while it lives no mutable slice over the same
/// memory can be taken, through any handle.
pub struct TensorSlice<'a, T> {
    data: &'a [T],
    _borrow: StorageBorrow,
}

/// A CPU tensor's elements, written in place (from
/// [`crate::Tensor::as_mut_slice`]). It derefs to `&mut [T]`; while it lives
/// no other slice over the same memory can be taken, through any handle.
pub struct TensorSliceMut<'a, T> {
    data: *mut T,
    len: usize,
    _borrow: StorageBorrow,
    _tensor: PhantomData<&'a mut [T]>,
}

// As &[T] and &mut [T]: the registry keeps the memory exclusive.
unsafe impl<T: Sync> Send for TensorSliceMut<'_, T> {}
unsafe impl<T: Sync> Sync for TensorSliceMut<'_, T> {}

impl<'a, T: Element> TensorSlice<'a, T> {
    /// # Safety
    /// `data` holds `len` elements that live for `'a` and are not written
    /// except through a mutable slice (which `acquire` refuses meanwhile).
    pub(crate) unsafe fn new(data: *const T, len: usize) -> Result<TensorSlice<'a, T>> {
        let bytes = len * std::mem::size_of::<T>();
        let borrow = StorageBorrow::acquire(data as usize, bytes, false)?;
        let data = if len == 0 || data.is_null() { &[] } else { std::slice::from_raw_parts(data, len) };
        Ok(TensorSlice { data, _borrow: borrow })
    }
}

impl<'a, T: Element> TensorSliceMut<'a, T> {
    /// # Safety
    /// As for [`TensorSlice::new`], writable.
    pub(crate) unsafe fn new(data: *mut T, len: usize) -> Result<TensorSliceMut<'a, T>> {
        let bytes = len * std::mem::size_of::<T>();
        let borrow = StorageBorrow::acquire(data as usize, bytes, true)?;
        let (data, len) =
            if len == 0 || data.is_null() { (std::ptr::NonNull::dangling().as_ptr(), 0) } else { (data, len) };
        Ok(TensorSliceMut { data, len, _borrow: borrow, _tensor: PhantomData })
    }
}

impl<T> Deref for TensorSlice<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data
    }
}

impl<T> Deref for TensorSliceMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl<T> DerefMut for TensorSliceMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

impl<T: fmt::Debug> fmt::Debug for TensorSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl<T: fmt::Debug> fmt::Debug for TensorSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

// Compared as the slices they deref to.
macro_rules! slice_eq {
    ($view:ident) => {
        impl<T: PartialEq> PartialEq<[T]> for $view<'_, T> {
            fn eq(&self, other: &[T]) -> bool {
                **self == *other
            }
        }
        impl<T: PartialEq> PartialEq<&[T]> for $view<'_, T> {
            fn eq(&self, other: &&[T]) -> bool {
                **self == **other
            }
        }
        impl<T: PartialEq, const N: usize> PartialEq<[T; N]> for $view<'_, T> {
            fn eq(&self, other: &[T; N]) -> bool {
                **self == other[..]
            }
        }
        impl<T: PartialEq, const N: usize> PartialEq<&[T; N]> for $view<'_, T> {
            fn eq(&self, other: &&[T; N]) -> bool {
                **self == other[..]
            }
        }
        impl<T: PartialEq> PartialEq<Vec<T>> for $view<'_, T> {
            fn eq(&self, other: &Vec<T>) -> bool {
                **self == other[..]
            }
        }
    };
}
slice_eq!(TensorSlice);
slice_eq!(TensorSliceMut);
