//! Slices of a CPU tensor's memory, checked per storage.
//!
//! Several handles may reach one storage (`Module::grad` and
//! `Module::parameter` return a new handle each time, a registered tensor
//! shares the module's slot), so `&mut Tensor` alone cannot make a mutable
//! slice exclusive. Every live slice is recorded here by the address range
//! it covers, as `RefCell` records its borrows: a mutable slice over memory
//! any other slice covers, or a shared one over memory a mutable slice
//! covers, is refused with DP_ESTATE, whichever handle it comes through.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::{sys, Element, Error, Library, Result, DP_ESTATE};

struct Borrow {
    id: u64,
    start: usize,
    end: usize,
    exclusive: bool,
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
        if let Some(other) = borrows.iter().find(|b| b.start < end && start < b.end && (exclusive || b.exclusive)) {
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
        borrows.push(Borrow { id, start, end, exclusive });
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
        if let Some(i) = borrows.iter().position(|b| b.id == self.id) {
            borrows.swap_remove(i);
        }
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
