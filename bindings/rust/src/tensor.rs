//! Tensors.

use std::os::raw::{c_int, c_void};
use std::ptr;

use crate::device::dtype_name;
use crate::view::{Access, CallAccess, StorageBorrow, TensorSlice, TensorSliceMut, DLPACK_EXPORT};
use crate::{sys, DType, Device, Element, Error, Library, Result, DP_EINVAL, DP_EUNSUPPORTED};
use std::fmt;

/// A reference to a tensor. Tensors taken out of a module (parameters,
/// gradients) share its storage: writing through them writes the module's.
/// Slices of the memory borrow this handle and are checked per storage, so
/// two handles over the same memory never give a mutable slice and another
/// slice at once (see [`Tensor::as_slice`]).
///
/// Dropping a handle needs it owned, so no call on it can be running then:
/// the borrow checker is its lease, across threads too.
pub struct Tensor {
    pub(crate) raw: *mut sys::dp_tensor,
    pub(crate) lib: Library,
    pub(crate) owned: bool,
}

// A handle may move between threads; concurrent writers are the caller's
// to prevent (dp_tensor.h), which &mut ensures for this handle.
unsafe impl Send for Tensor {}
unsafe impl Sync for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        if self.owned {
            unsafe { (self.lib.api().tensor_destroy)(self.raw) };
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({} {:?} on {})", dtype_name(self.dtype_code()), self.shape(), self.device())
    }
}

unsafe extern "C" fn run_boxed_deleter(ctx: *mut c_void) {
    let deleter = Box::from_raw(ctx as *mut Box<dyn FnOnce() + Send>);
    // Nothing may unwind into the library.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(deleter));
}

unsafe extern "C" fn drop_boxed_vec<T>(ctx: *mut c_void) {
    drop(Box::from_raw(ctx as *mut Vec<T>));
}

impl Tensor {
    /// Takes over an owned `dp_tensor*`.
    ///
    /// # Safety
    /// `raw` must be a valid tensor reference the caller owns.
    pub unsafe fn from_raw(lib: &Library, raw: *mut sys::dp_tensor) -> Tensor {
        Tensor { raw, lib: lib.clone(), owned: true }
    }

    pub(crate) fn borrowed(lib: &Library, raw: *mut sys::dp_tensor) -> Tensor {
        Tensor { raw, lib: lib.clone(), owned: false }
    }

    /// The handle, still owned by `self`.
    pub fn as_raw(&self) -> *mut sys::dp_tensor {
        self.raw
    }

    /// The first element's address (device memory for a cuda tensor); NULL
    /// for an empty tensor that owns no memory.
    pub fn data_ptr(&self) -> *mut c_void {
        unsafe { (self.lib.api().tensor_data)(self.raw) }
    }

    pub fn library(&self) -> &Library {
        &self.lib
    }

    /// A new zero-filled tensor.
    pub fn zeros(lib: &Library, dtype: DType, shape: &[i64], device: Device) -> Result<Tensor> {
        let mut out = ptr::null_mut();
        let ndim = i32::try_from(shape.len()).map_err(|_| Error::new(DP_EINVAL, "shape: too many dimensions"))?;
        lib.check(unsafe { (lib.api().tensor_create)(&mut out, dtype as i32, ndim, shape.as_ptr(), device.0) })?;
        Ok(unsafe { Tensor::from_raw(lib, out) })
    }

    /// A new tensor holding a copy of `data` (one copy).
    pub fn from_slice<T: Element>(lib: &Library, data: &[T], shape: &[i64], device: Device) -> Result<Tensor> {
        let mut t = Tensor::zeros(lib, T::DTYPE, shape, device)?;
        t.copy_from(data)?;
        Ok(t)
    }

    /// A CPU tensor over `data` itself (no copy); the vector is freed when
    /// the last tensor over it is destroyed.
    pub fn from_vec<T: Element>(lib: &Library, data: Vec<T>, shape: &[i64], device: Device) -> Result<Tensor> {
        let ndim = i32::try_from(shape.len()).map_err(|_| Error::new(DP_EINVAL, "shape: too many dimensions"))?;
        if !device.is_cpu() {
            return Err(Error::new(
                DP_EINVAL,
                format!("device: {device}; a vector is host memory, for cpu devices only"),
            ));
        }
        // The library cannot see the vector's length: the shape must match it.
        let numel = shape.iter().try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) });
        if numel != Some(data.len() as i64) {
            return Err(Error::new(
                DP_EINVAL,
                format!("shape: {shape:?} does not hold the {} elements of data", data.len()),
            ));
        }
        let mut boxed = Box::new(data);
        let ptr_data = boxed.as_mut_ptr() as *mut c_void;
        let ctx = Box::into_raw(boxed);
        let mut out = ptr::null_mut();
        let st = unsafe {
            (lib.api().tensor_from_blob)(
                &mut out,
                ptr_data,
                T::DTYPE as i32,
                ndim,
                shape.as_ptr(),
                device.0,
                Some(drop_boxed_vec::<T>),
                ctx as *mut c_void,
            )
        };
        if st != sys::DP_OK {
            // On failure the memory stays with the caller.
            let err = lib.error(st);
            drop(unsafe { Box::from_raw(ctx) });
            return Err(err);
        }
        Ok(unsafe { Tensor::from_raw(lib, out) })
    }

    /// A tensor over memory the caller owns (host memory for cpu devices,
    /// device memory for cuda ones), without copying. `deleter` runs once
    /// when the last tensor over the memory is destroyed (the library may
    /// keep one, in a module or as a gradient, past this handle); with
    /// `None` the caller keeps the memory alive that long. On failure
    /// `deleter` is dropped without being called.
    ///
    /// # Safety
    /// `data` must hold `shape`'s elements of `dtype` on `device`, stay
    /// valid until the deleter runs (or, without one, as long as any tensor
    /// over it lives), and not be written elsewhere while the library uses it.
    pub unsafe fn from_blob(
        lib: &Library,
        data: *mut c_void,
        dtype: DType,
        shape: &[i64],
        device: Device,
        deleter: Option<Box<dyn FnOnce() + Send>>,
    ) -> Result<Tensor> {
        let ndim = i32::try_from(shape.len()).map_err(|_| Error::new(DP_EINVAL, "shape: too many dimensions"))?;
        let (fn_ptr, ctx): (Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) = match deleter {
            Some(d) => (Some(run_boxed_deleter), Box::into_raw(Box::new(d)) as *mut c_void),
            None => (None, ptr::null_mut()),
        };
        let mut out = ptr::null_mut();
        let st =
            (lib.api().tensor_from_blob)(&mut out, data, dtype as i32, ndim, shape.as_ptr(), device.0, fn_ptr, ctx);
        if st != sys::DP_OK {
            // On failure the deleter is not called: it is still ours.
            if !ctx.is_null() {
                drop(Box::from_raw(ctx as *mut Box<dyn FnOnce() + Send>));
            }
            return Err(lib.error(st));
        }
        Ok(Tensor::from_raw(lib, out))
    }

    /// Takes over a DLPack tensor (zero-copy): the new tensor uses its memory
    /// in place and calls its deleter when the last tensor over it is
    /// destroyed. It must be compact row-major on a cpu or cuda device with
    /// a dtype the library knows; on failure it is dropped (its deleter runs).
    pub fn from_dlpack(lib: &Library, managed: DlPack) -> Result<Tensor> {
        // One of `to_dlpack`'s: the new tensor's slices are checked as any
        // other, so the export's hold on the memory can go.
        unsafe { release_export(managed.raw) };
        let raw = managed.raw;
        let mut out = ptr::null_mut();
        let st = unsafe { (lib.api().tensor_from_dlpack)(&mut out, raw) };
        if st != sys::DP_OK {
            // Nothing was taken: `managed` still owns it and drops it here.
            return Err(lib.error(st));
        }
        std::mem::forget(managed);
        Ok(unsafe { Tensor::from_raw(lib, out) })
    }

    /// A DLPack tensor over this tensor's memory (zero-copy); the memory
    /// stays alive until it is dropped, even after every `Tensor` over it.
    ///
    /// Its holder may read and write the memory until the capsule's deleter
    /// runs: until then a slice of it is `DP_ESTATE` through any handle
    /// (and `to_dlpack` is refused under a slice). The deleter runs when
    /// the `DlPack` is dropped, or, after `into_raw`, when the consumer
    /// calls it; `Tensor::from_dlpack` of it ends the hold at once, its
    /// tensor's slices being checked as any other's.
    pub fn to_dlpack(&self) -> Result<DlPack> {
        let mut out = ptr::null_mut();
        let held = self.call_access(Access::Write).begin_pending("to_dlpack", DLPACK_EXPORT)?;
        self.lib.check(unsafe { (self.lib.api().tensor_to_dlpack)(self.raw, &mut out) })?;
        // The capsule's deleter ends the hold, then runs the library's.
        unsafe {
            let export = Box::new(Export { manager_ctx: (*out).manager_ctx, deleter: (*out).deleter, _held: held });
            (*out).manager_ctx = Box::into_raw(export) as *mut c_void;
            (*out).deleter = Some(delete_export);
        }
        Ok(DlPack { raw: out })
    }

    /// Takes over a DLPack 1.x tensor (major version 1; another is
    /// `DP_EINVAL` naming it). Without the read-only flag the new tensor
    /// uses its memory in place, as `from_dlpack`; flagged read-only it is
    /// copied into memory of the tensor's own and released at once. On
    /// failure it is dropped (its deleter runs).
    pub fn from_dlpack_versioned(lib: &Library, managed: DlPackVersioned) -> Result<Tensor> {
        // One of `to_dlpack_versioned`'s: the export's hold on the memory
        // can go (as in `from_dlpack`).
        unsafe { release_export_versioned(managed.raw) };
        let raw = managed.raw;
        let mut out = ptr::null_mut();
        let st = unsafe { (lib.api().tensor_from_dlpack_versioned)(&mut out, raw) };
        if st != sys::DP_OK {
            return Err(lib.error(st));
        }
        std::mem::forget(managed);
        Ok(unsafe { Tensor::from_raw(lib, out) })
    }

    /// A DLPack 1.x tensor over this tensor's memory (zero-copy), version
    /// 1.1, flagged read-only when `read_only`. As with `to_dlpack`, the
    /// memory is held until the capsule's deleter runs: a read-only export
    /// refuses mutable slices meanwhile, a writable one every slice.
    pub fn to_dlpack_versioned(&self, read_only: bool) -> Result<DlPackVersioned> {
        let mut out = ptr::null_mut();
        let access = if read_only { Access::Read } else { Access::Write };
        let held = self.call_access(access).begin_pending("to_dlpack_versioned", DLPACK_EXPORT)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.tensor_to_dlpack_versioned)(self.raw, read_only as c_int, &mut out) })?;
        unsafe {
            let export =
                Box::new(ExportVersioned { manager_ctx: (*out).manager_ctx, deleter: (*out).deleter, _held: held });
            (*out).manager_ctx = Box::into_raw(export) as *mut c_void;
            (*out).deleter = Some(delete_export_versioned);
        }
        Ok(DlPackVersioned { raw: out })
    }

    pub(crate) fn dtype_code(&self) -> i32 {
        unsafe { (self.lib.api().tensor_dtype)(self.raw) }
    }

    pub fn dtype(&self) -> Result<DType> {
        let code = self.dtype_code();
        Ok(match code {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::F16,
            3 => DType::BF16,
            4 => DType::I8,
            5 => DType::U8,
            6 => DType::I32,
            7 => DType::I64,
            8 => DType::Bool,
            _ => return Err(self.lib.error(DP_EINVAL)),
        })
    }

    pub fn shape(&self) -> Vec<i64> {
        let api = self.lib.api();
        let ndim = unsafe { (api.tensor_ndim)(self.raw) };
        if ndim <= 0 {
            return Vec::new();
        }
        let mut shape = vec![0i64; ndim as usize];
        if unsafe { (api.tensor_shape)(self.raw, shape.as_mut_ptr(), ndim) } != sys::DP_OK {
            return Vec::new();
        }
        shape
    }

    pub fn numel(&self) -> usize {
        unsafe { (self.lib.api().tensor_numel)(self.raw) }.max(0) as usize
    }

    pub fn nbytes(&self) -> usize {
        unsafe { (self.lib.api().tensor_nbytes)(self.raw) }
    }

    pub fn device(&self) -> Device {
        Device(unsafe { (self.lib.api().tensor_device)(self.raw) })
    }

    fn check_view<T: Element>(&self) -> Result<()> {
        let code = self.dtype_code();
        if code != T::DTYPE as i32 {
            return Err(Error::new(
                DP_EINVAL,
                format!("tensor: its dtype is {}, not {}", dtype_name(code), dtype_name(T::DTYPE as i32)),
            ));
        }
        let device = self.device();
        if !device.is_cpu() {
            return Err(Error::new(
                DP_EUNSUPPORTED,
                format!("tensor: its memory is on {device}; copy it with copy_to or to_device"),
            ));
        }
        Ok(())
    }

    /// The elements, read in place (CPU tensors of dtype T), through a
    /// guard that derefs to `&[T]`.
    ///
    /// Checked per storage, whichever handle reaches it (`Module::grad` and
    /// `Module::parameter` give a new handle each call): while a mutable
    /// slice over this memory lives, this is DP_ESTATE, and while this one
    /// lives no mutable slice is taken, nor does `copy_from` or a
    /// collective of the process group write it. Memory that work a call
    /// left running uses is refused the same way until the call that
    /// completes it: a gradient marked ready (`Ddp::mark_grad_ready*`)
    /// until `Ddp::finish_backward`, a shard after `Fsdp::unshard_async`
    /// (mutable slices) until `Fsdp::wait_unshard`, the shard gradients
    /// after `Fsdp::post_backward` until `Fsdp::finish_backward`, an
    /// exported tensor until its DLPack deleter runs (see [`Ddp`],
    /// [`Fsdp`], [`Tensor::to_dlpack`]).
    ///
    /// [`Ddp`]: crate::Ddp
    /// [`Fsdp`]: crate::Fsdp
    pub fn as_slice<T: Element>(&self) -> Result<TensorSlice<'_, T>> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = unsafe { (self.lib.api().tensor_data)(self.raw) } as *const T;
        unsafe { TensorSlice::new(data, n) }
    }

    /// The elements, written in place (CPU tensors of dtype T), through a
    /// guard that derefs to `&mut [T]`. Checked as [`Tensor::as_slice`]: no
    /// other slice over this memory may be live, through any handle.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<TensorSliceMut<'_, T>> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = unsafe { (self.lib.api().tensor_data)(self.raw) } as *mut T;
        unsafe { TensorSliceMut::new(data, n) }
    }

    /// The elements as a plain slice, without the per-storage check.
    ///
    /// # Safety
    /// While the slice lives, nothing writes this memory: no mutable slice
    /// through another handle on the same storage, no `copy_from`, no
    /// library call that writes it.
    pub unsafe fn as_slice_unchecked<T: Element>(&self) -> Result<&[T]> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = (self.lib.api().tensor_data)(self.raw) as *const T;
        if n == 0 || data.is_null() {
            return Ok(&[]);
        }
        Ok(std::slice::from_raw_parts(data, n))
    }

    /// The elements as a plain mutable slice, without the per-storage check.
    ///
    /// # Safety
    /// While the slice lives, nothing else reads or writes this memory:
    /// no slice through another handle on the same storage, no copy, no
    /// library call that uses it.
    pub unsafe fn as_mut_slice_unchecked<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = (self.lib.api().tensor_data)(self.raw) as *mut T;
        if n == 0 || data.is_null() {
            return Ok(&mut []);
        }
        Ok(std::slice::from_raw_parts_mut(data, n))
    }

    /// Runs `f` on the elements read in place (see [`Tensor::as_slice`]).
    pub fn with_slice<T: Element, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        Ok(f(&self.as_slice::<T>()?))
    }

    /// Runs `f` on the elements written in place (see [`Tensor::as_mut_slice`]).
    pub fn with_mut_slice<T: Element, R>(&mut self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        Ok(f(&mut self.as_mut_slice::<T>()?))
    }

    // Keeps slices over this memory out while the library reads or writes
    // it from the host (a no-op range for device memory, which no slice covers).
    fn call_access(&self, access: Access) -> CallAccess {
        let mut call = CallAccess::new();
        call.tensor(&self.lib, self.raw, access);
        call
    }

    fn borrow_storage(&self, exclusive: bool) -> Result<StorageBorrow> {
        let data = unsafe { (self.lib.api().tensor_data)(self.raw) } as usize;
        StorageBorrow::acquire(data, self.nbytes(), exclusive)
    }

    /// Copies `src` (exactly numel elements of the tensor's dtype) in, on any device.
    pub fn copy_from<T: Element>(&mut self, src: &[T]) -> Result<()> {
        let code = self.dtype_code();
        if code != T::DTYPE as i32 {
            return Err(Error::new(
                DP_EINVAL,
                format!("src: {} elements into a {} tensor", dtype_name(T::DTYPE as i32), dtype_name(code)),
            ));
        }
        let _borrow = self.borrow_storage(true)?;
        let api = self.lib.api();
        self.lib.check(unsafe {
            (api.tensor_copy_from_host)(self.raw, src.as_ptr() as *const c_void, std::mem::size_of_val(src))
        })
    }

    /// Copies the tensor out into `dst` (exactly numel elements), from any device.
    pub fn copy_to<T: Element>(&self, dst: &mut [T]) -> Result<()> {
        let code = self.dtype_code();
        if code != T::DTYPE as i32 {
            return Err(Error::new(
                DP_EINVAL,
                format!("dst: {} elements from a {} tensor", dtype_name(T::DTYPE as i32), dtype_name(code)),
            ));
        }
        let _borrow = self.borrow_storage(false)?;
        let api = self.lib.api();
        self.lib.check(unsafe {
            (api.tensor_copy_to_host)(self.raw, dst.as_mut_ptr() as *mut c_void, std::mem::size_of_val(dst))
        })
    }

    /// The elements, copied into a new vector.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.numel());
        // Zero-initialised first: copy_to writes every element or fails.
        v.resize(self.numel(), unsafe { std::mem::zeroed() });
        self.copy_to(&mut v)?;
        Ok(v)
    }

    /// A copy on `device` (always new storage).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        let mut out = ptr::null_mut();
        let _call = self.call_access(Access::Read).begin("to_device")?;
        self.lib.check(unsafe { (self.lib.api().tensor_to_device)(&mut out, self.raw, device.0) })?;
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }
}

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// Tensors a collective may write in place: `Tensor`, and the `Bucket` a
/// comm hook is lent.
pub trait InPlace: sealed::Sealed {
    #[doc(hidden)]
    fn raw_mut(&mut self) -> *mut sys::dp_tensor;
}

impl sealed::Sealed for Tensor {}
impl InPlace for Tensor {
    fn raw_mut(&mut self) -> *mut sys::dp_tensor {
        self.raw
    }
}

/// What `to_dlpack` puts in the capsule's place: the library's own context
/// and deleter, and the hold on the memory that the deleter ends.
struct Export {
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut sys::DLManagedTensor)>,
    _held: StorageBorrow,
}

/// Puts the library's context and deleter back into a capsule of
/// `to_dlpack` and ends its hold on the memory; nothing for another one.
///
/// # Safety
/// `raw` is a valid DLManagedTensor whose deleter has not run.
unsafe fn release_export(raw: *mut sys::DLManagedTensor) {
    if !is_export(raw) {
        return;
    }
    let export = Box::from_raw((*raw).manager_ctx as *mut Export);
    (*raw).manager_ctx = export.manager_ctx;
    (*raw).deleter = export.deleter;
}

/// The deleter of a capsule from `to_dlpack`, called once by its holder,
/// from any thread.
unsafe extern "C" fn delete_export(raw: *mut sys::DLManagedTensor) {
    if raw.is_null() {
        return;
    }
    // Nothing may unwind into the caller.
    let _ = std::panic::catch_unwind(|| release_export(raw));
    if is_export(raw) {
        return;
    }
    if let Some(deleter) = (*raw).deleter {
        deleter(raw);
    }
}

/// Whether `raw`'s deleter is still `delete_export` (one function, one
/// address: it is no generic).
unsafe fn is_export(raw: *mut sys::DLManagedTensor) -> bool {
    (*raw).deleter.map(|f| f as usize) == Some(delete_export as *const () as usize)
}

/// An owned DLPack `DLManagedTensor` (dlpack.h): its deleter runs on drop.
/// `into_raw` hands it to another framework; `from_raw` takes one from it.
pub struct DlPack {
    raw: *mut sys::DLManagedTensor,
}

// DLPack's producer owns the memory until the deleter runs, from any thread.
unsafe impl Send for DlPack {}

impl fmt::Debug for DlPack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.dl_tensor();
        write!(f, "DlPack({:?} {:?} on {:?})", t.dtype, self.shape(), t.device)
    }
}

/// What both owned capsules share: drop runs the deleter; from_raw,
/// into_raw, and the DLTensor's fields.
macro_rules! owned_capsule {
    ($owner:ident, $raw:ty, $what:literal) => {
        impl Drop for $owner {
            fn drop(&mut self) {
                unsafe {
                    if let Some(deleter) = (*self.raw).deleter {
                        deleter(self.raw);
                    }
                }
            }
        }

        impl $owner {
            #[doc = concat!("Takes ownership of a `", $what, "*`.")]
            ///
            /// # Safety
            #[doc = concat!("`raw` must be a valid, non-NULL ", $what, " the caller owns; its")]
            /// deleter (if any) is called exactly once, by this value.
            pub unsafe fn from_raw(raw: *mut $raw) -> $owner {
                $owner { raw }
            }

            /// Gives up ownership: the receiver calls `(*raw).deleter(raw)`.
            pub fn into_raw(self) -> *mut $raw {
                let raw = self.raw;
                std::mem::forget(self);
                raw
            }

            /// The `DLTensor`: data pointer, device, dtype, shape and strides.
            pub fn dl_tensor(&self) -> &sys::DLTensor {
                unsafe { &(*self.raw).dl_tensor }
            }

            pub fn shape(&self) -> Vec<i64> {
                let t = self.dl_tensor();
                if t.ndim <= 0 || t.shape.is_null() {
                    return Vec::new();
                }
                unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize) }.to_vec()
            }

            /// The first element (`data` + `byte_offset`).
            pub fn data_ptr(&self) -> *mut c_void {
                let t = self.dl_tensor();
                (t.data as *mut u8).wrapping_add(t.byte_offset as usize) as *mut c_void
            }
        }
    };
}

owned_capsule!(DlPack, sys::DLManagedTensor, "DLManagedTensor");

struct ExportVersioned {
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut sys::DLManagedTensorVersioned)>,
    _held: StorageBorrow,
}

/// `release_export` for a capsule of `to_dlpack_versioned`.
///
/// # Safety
/// `raw` is a valid DLManagedTensorVersioned whose deleter has not run.
unsafe fn release_export_versioned(raw: *mut sys::DLManagedTensorVersioned) {
    if !is_export_versioned(raw) {
        return;
    }
    let export = Box::from_raw((*raw).manager_ctx as *mut ExportVersioned);
    (*raw).manager_ctx = export.manager_ctx;
    (*raw).deleter = export.deleter;
}

/// The deleter of a capsule from `to_dlpack_versioned`.
unsafe extern "C" fn delete_export_versioned(raw: *mut sys::DLManagedTensorVersioned) {
    if raw.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(|| release_export_versioned(raw));
    if is_export_versioned(raw) {
        return;
    }
    if let Some(deleter) = (*raw).deleter {
        deleter(raw);
    }
}

unsafe fn is_export_versioned(raw: *mut sys::DLManagedTensorVersioned) -> bool {
    (*raw).deleter.map(|f| f as usize) == Some(delete_export_versioned as *const () as usize)
}

/// An owned DLPack 1.x `DLManagedTensorVersioned`: its deleter runs on drop.
/// `into_raw` hands it to another framework; `from_raw` takes one from it.
pub struct DlPackVersioned {
    raw: *mut sys::DLManagedTensorVersioned,
}

// DLPack's producer owns the memory until the deleter runs, from any thread.
unsafe impl Send for DlPackVersioned {}

impl fmt::Debug for DlPackVersioned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.version();
        write!(
            f,
            "DlPackVersioned({}.{}, flags {:#x}, {:?} {:?})",
            v.major,
            v.minor,
            self.flags(),
            self.dl_tensor().dtype,
            self.shape()
        )
    }
}

owned_capsule!(DlPackVersioned, sys::DLManagedTensorVersioned, "DLManagedTensorVersioned");

impl DlPackVersioned {
    pub fn version(&self) -> sys::DLPackVersion {
        unsafe { (*self.raw).version }
    }

    /// `sys::DLPACK_FLAG_BITMASK_*` bits.
    pub fn flags(&self) -> u64 {
        unsafe { (*self.raw).flags }
    }
}
