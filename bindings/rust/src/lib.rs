//! dparallel for Rust hosts, without crates: the library is `dlopen`ed, its
//! one table of entry points is read through `dp_get_api`, and this crate
//! wraps it in owned handle types.
//!
//! - Handles (`Tensor`, `Module`, `ReplicaSet`, `Store`, `ProcessGroup`,
//!   `Work`, `Ddp`) release their reference on drop, and each keeps the
//!   library loaded: it is closed when the last of them and the last
//!   `Library` are gone.
//! - A failing call is `Err(Error)` with the status code and the message of
//!   `dp_last_error()`, which names the offending argument.
//! - CPU tensors are read and written in place as `&[T]` / `&mut [T]`,
//!   borrowed from the tensor.
//! - Forward callbacks are closures; one that returns `Err` or panics fails
//!   the call with `DP_EUSER`, its message (or the panic's) appended. A panic
//!   never unwinds into the library.
//!
//! ```no_run
//! use dparallel::{Device, Library, Tensor};
//! let lib = Library::open(None)?; // DP_LIBRARY, else libdparallel.so.0
//! let mut t = Tensor::from_slice(&lib, &[1.0f32, 2.0, 3.0], &[3], Device::cpu(0))?;
//! t.as_mut_slice::<f32>()?[0] = 5.0;
//! assert_eq!(t.as_slice::<f32>()?, &[5.0, 2.0, 3.0]);
//! # Ok::<(), dparallel::Error>(())
//! ```

pub mod sys;

use std::any::Any;
use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::{Arc, Mutex};

pub use sys::{
    DP_EDEVICE, DP_EINTERNAL, DP_EINVAL, DP_EIO, DP_ENOMEM, DP_EREMOTE, DP_ESTATE, DP_ETIMEOUT, DP_EUNSUPPORTED,
    DP_EUSER,
};

/// The library file opened when neither an argument nor DP_LIBRARY names
/// one: the SONAME of ABI major `sys::DP_VERSION_MAJOR`.
pub const DEFAULT_LIBRARY: &str = "libdparallel.so.0";

// ---------------------------------------------------------------------------
// errors

/// A failed call: its `dp_status` and the library's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: i32,
    message: String,
}

impl Error {
    /// An error of this crate's own (a bad argument caught before the call,
    /// a library that cannot be loaded), with a `DP_E*` code.
    pub fn new(code: i32, message: impl Into<String>) -> Error {
        Error { code, message: message.into() }
    }
    /// The `dp_status` (negative).
    pub fn code(&self) -> i32 {
        self.code
    }
    /// What `dp_last_error()` said, plus what a callback reported.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The name of the code, "DP_EINVAL" and so on.
    pub fn code_name(&self) -> &'static str {
        match self.code {
            DP_EINVAL => "DP_EINVAL",
            DP_ENOMEM => "DP_ENOMEM",
            DP_EDEVICE => "DP_EDEVICE",
            DP_ETIMEOUT => "DP_ETIMEOUT",
            DP_EREMOTE => "DP_EREMOTE",
            DP_EUSER => "DP_EUSER",
            DP_EIO => "DP_EIO",
            DP_ESTATE => "DP_ESTATE",
            DP_EUNSUPPORTED => "DP_EUNSUPPORTED",
            DP_EINTERNAL => "DP_EINTERNAL",
            _ => "unknown status",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.code_name(), self.code, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn cstring(argument: &str, text: &str) -> Result<CString> {
    CString::new(text)
        .map_err(|_| Error::new(DP_EINVAL, format!("{argument} '{}' contains a NUL byte", text.escape_debug())))
}

unsafe fn owned_text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

// ---------------------------------------------------------------------------
// the library

struct Loaded {
    handle: *mut c_void,
    api: *const sys::dp_api,
}

// The table is static and its entry points are thread-safe (dp_api.h).
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

impl Drop for Loaded {
    fn drop(&mut self) {
        unsafe { sys::dlclose(self.handle) };
    }
}

/// The loaded library. Cheap to clone; closed once every clone and every
/// handle made through it is dropped.
#[derive(Clone)]
pub struct Library {
    loaded: Arc<Loaded>,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Library(abi {}.{})", self.api().abi_major, self.api().abi_minor)
    }
}

unsafe fn dl_error(what: &str) -> Error {
    let e = sys::dlerror();
    let reason = if e.is_null() { "unknown reason".to_string() } else { owned_text(e) };
    Error::new(DP_EIO, format!("{what}: {reason}"))
}

impl Library {
    /// Opens `path`, or the file DP_LIBRARY names, or `libdparallel.so.0`
    /// (found the way dlopen finds it), and takes its table for ABI major
    /// `sys::DP_VERSION_MAJOR`. A library of another major, or one whose
    /// table is shorter than this crate's, is refused (DP_EUNSUPPORTED).
    pub fn open(path: Option<&str>) -> Result<Library> {
        Library::open_requesting_abi_major(path, sys::DP_VERSION_MAJOR)
    }

    /// `open` asking `dp_get_api` for the table of `abi_major`; any other
    /// major than this crate's is refused. Exists to test that refusal.
    #[doc(hidden)]
    pub fn open_requesting_abi_major(path: Option<&str>, abi_major: u32) -> Result<Library> {
        let path = match path {
            Some(p) => p.to_string(),
            None => {
                std::env::var("DP_LIBRARY").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| DEFAULT_LIBRARY.into())
            }
        };
        let c_path = cstring("path", &path)?;
        unsafe {
            sys::dlerror();
            let handle = sys::dlopen(c_path.as_ptr(), sys::RTLD_NOW | sys::RTLD_LOCAL);
            if handle.is_null() {
                return Err(dl_error(&format!("dlopen('{path}')")));
            }
            // Closes the library again on every refusal below.
            let loaded = Loaded { handle, api: ptr::null() };
            sys::dlerror();
            let sym = sys::dlsym(handle, c"dp_get_api".as_ptr());
            if sym.is_null() {
                return Err(dl_error(&format!("dlsym('{path}', 'dp_get_api')")));
            }
            let get_api: sys::dp_get_api_fn = std::mem::transmute::<*mut c_void, sys::dp_get_api_fn>(sym);
            let api = get_api(abi_major);
            if api.is_null() {
                return Err(Error::new(
                    DP_EUNSUPPORTED,
                    format!("{path}: dp_get_api({abi_major}) returned NULL: the library has no table for ABI major {abi_major}; refusing it"),
                ));
            }
            // Read the header through raw pointers: the slots are checked
            // before the table is seen as a `dp_api`.
            let header = api as *const u8;
            let struct_size = ptr::read_unaligned(header as *const usize);
            let major = ptr::read_unaligned(header.add(8) as *const u32);
            let minor = ptr::read_unaligned(header.add(12) as *const u32);
            if major != sys::DP_VERSION_MAJOR || abi_major != sys::DP_VERSION_MAJOR {
                return Err(Error::new(
                    DP_EUNSUPPORTED,
                    format!(
                        "{path}: ABI major {major} differs from this crate's {}: refusing the library",
                        sys::DP_VERSION_MAJOR
                    ),
                ));
            }
            let need = std::mem::size_of::<sys::dp_api>();
            if struct_size < need || minor < sys::DP_API_MINOR {
                return Err(Error::new(
                    DP_EUNSUPPORTED,
                    format!(
                        "{path}: its dp_api table (abi_minor {minor}, {struct_size} bytes) is older than this crate's (abi_minor {}, {need} bytes)",
                        sys::DP_API_MINOR
                    ),
                ));
            }
            let slots = (need - sys::FIRST_SLOT) / std::mem::size_of::<usize>();
            for i in 0..slots {
                let word =
                    ptr::read_unaligned(header.add(sys::FIRST_SLOT + i * std::mem::size_of::<usize>()) as *const usize);
                if word == 0 {
                    return Err(Error::new(DP_EUNSUPPORTED, format!("{path}: dp_api slot {i} is NULL")));
                }
            }
            let mut loaded = loaded;
            loaded.api = api;
            Ok(Library { loaded: Arc::new(loaded) })
        }
    }

    /// The raw table, for calls this crate does not wrap.
    pub fn api(&self) -> &sys::dp_api {
        unsafe { &*self.loaded.api }
    }

    /// The loaded library's version: major*10000 + minor*100 + patch.
    pub fn version_number(&self) -> u32 {
        unsafe { (self.api().version_number)() }
    }

    fn error(&self, code: sys::dp_status) -> Error {
        let message = unsafe { owned_text((self.api().last_error)()) };
        Error { code, message }
    }

    fn check(&self, code: sys::dp_status) -> Result<()> {
        if code == sys::DP_OK {
            Ok(())
        } else {
            Err(self.error(code))
        }
    }

    /// Parses "cpu", "cpu:1", "cuda:0".
    pub fn parse_device(&self, text: &str) -> Result<Device> {
        let c = cstring("text", text)?;
        let mut d = sys::dp_device { type_: 0, index: 0 };
        self.check(unsafe { (self.api().device_parse)(c.as_ptr(), &mut d) })?;
        Ok(Device(d))
    }

    /// How many devices of `kind` there are (logical CPU devices allowed, GPUs present).
    pub fn device_count(&self, kind: DeviceKind) -> Result<usize> {
        let mut n = 0i32;
        self.check(unsafe { (self.api().device_count)(kind as i32, &mut n) })?;
        Ok(n as usize)
    }
}

// ---------------------------------------------------------------------------
// devices and dtypes

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DeviceKind {
    Cpu = sys::DP_DEVICE_CPU,
    Cuda = sys::DP_DEVICE_CUDA,
}

/// A device: `cpu:i` (a logical CPU device) or `cuda:i`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Device(pub sys::dp_device);

impl Device {
    pub fn cpu(index: i32) -> Device {
        Device(sys::dp_device { type_: sys::DP_DEVICE_CPU, index })
    }
    pub fn cuda(index: i32) -> Device {
        Device(sys::dp_device { type_: sys::DP_DEVICE_CUDA, index })
    }
    pub fn is_cpu(&self) -> bool {
        self.0.type_ == sys::DP_DEVICE_CPU
    }
    pub fn index(&self) -> i32 {
        self.0.index
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.type_ {
            sys::DP_DEVICE_CPU => write!(f, "cpu:{}", self.0.index),
            sys::DP_DEVICE_CUDA => write!(f, "cuda:{}", self.0.index),
            t => write!(f, "device(type {t}):{}", self.0.index),
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I32 = 6,
    I64 = 7,
    Bool = 8,
}

/// Element types a tensor can be viewed as.
pub trait Element: Copy + 'static {
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i8 {
    const DTYPE: DType = DType::I8;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

fn dtype_name(code: i32) -> &'static str {
    match code {
        0 => "float32",
        1 => "float64",
        2 => "float16",
        3 => "bfloat16",
        4 => "int8",
        5 => "uint8",
        6 => "int32",
        7 => "int64",
        8 => "bool",
        _ => "unknown",
    }
}

// ---------------------------------------------------------------------------
// tensors

/// A reference to a tensor. Tensors taken out of a module (parameters,
/// gradients) share its storage: writing through them writes the module's.
/// The slices borrow this handle; other handles over the same storage are
/// the caller's to keep from writing meanwhile, as in C.
pub struct Tensor {
    raw: *mut sys::dp_tensor,
    lib: Library,
    owned: bool,
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

    fn borrowed(lib: &Library, raw: *mut sys::dp_tensor) -> Tensor {
        Tensor { raw, lib: lib.clone(), owned: false }
    }

    /// The handle, still owned by `self`.
    pub fn as_raw(&self) -> *mut sys::dp_tensor {
        self.raw
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

    fn dtype_code(&self) -> i32 {
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

    /// The elements, in place (CPU tensors of dtype T).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = unsafe { (self.lib.api().tensor_data)(self.raw) } as *const T;
        if n == 0 || data.is_null() {
            return Ok(&[]);
        }
        Ok(unsafe { std::slice::from_raw_parts(data, n) })
    }

    /// The elements, writable in place (CPU tensors of dtype T).
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_view::<T>()?;
        let n = self.numel();
        let data = unsafe { (self.lib.api().tensor_data)(self.raw) } as *mut T;
        if n == 0 || data.is_null() {
            return Ok(&mut []);
        }
        Ok(unsafe { std::slice::from_raw_parts_mut(data, n) })
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
        self.lib.check(unsafe { (self.lib.api().tensor_to_device)(&mut out, self.raw, device.0) })?;
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }
}

mod sealed {
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

// ---------------------------------------------------------------------------
// modules

/// A reference to a module tree (see dp_module.h). Methods taking `&self`
/// are the ones dp_module.h allows from several threads at once.
pub struct Module {
    raw: *mut sys::dp_module,
    lib: Library,
    owned: bool,
}

unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.owned {
            unsafe { (self.lib.api().module_destroy)(self.raw) };
        }
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Module({} parameters)", self.num_parameters())
    }
}

impl Module {
    /// A new, empty module.
    pub fn new(lib: &Library) -> Result<Module> {
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().module_create)(&mut out) })?;
        Ok(Module { raw: out, lib: lib.clone(), owned: true })
    }

    /// Takes over an owned `dp_module*`.
    ///
    /// # Safety
    /// `raw` must be a valid module reference the caller owns.
    pub unsafe fn from_raw(lib: &Library, raw: *mut sys::dp_module) -> Module {
        Module { raw, lib: lib.clone(), owned: true }
    }

    pub fn as_raw(&self) -> *mut sys::dp_module {
        self.raw
    }

    pub fn library(&self) -> &Library {
        &self.lib
    }

    /// A new owned reference to this same module (handy inside a callback,
    /// whose replica is only lent).
    pub fn retain(&self) -> Result<Module> {
        Ok(self.submodule("")?.expect("a module is never a NULL slot of itself"))
    }

    pub fn register_parameter(&mut self, name: &str, value: &Tensor, requires_grad: bool) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib
            .check(unsafe { (api.module_register_parameter)(self.raw, c.as_ptr(), value.raw, requires_grad as c_int) })
    }

    pub fn register_buffer(&mut self, name: &str, value: &Tensor, persistent: bool) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_register_buffer)(self.raw, c.as_ptr(), value.raw, persistent as c_int) })
    }

    pub fn register_module(&mut self, name: &str, child: &Module) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_register_module)(self.raw, c.as_ptr(), child.raw) })
    }

    pub fn num_parameters(&self) -> usize {
        unsafe { (self.lib.api().module_num_parameters)(self.raw) }
    }

    pub fn num_buffers(&self) -> usize {
        unsafe { (self.lib.api().module_num_buffers)(self.raw) }
    }

    /// The index-th parameter in listing order, with its dotted name.
    pub fn parameter_at(&self, index: usize) -> Result<(String, Tensor)> {
        let mut name = ptr::null();
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_parameter_at)(self.raw, index, &mut name, &mut out) })?;
        Ok((unsafe { owned_text(name) }, unsafe { Tensor::from_raw(&self.lib, out) }))
    }

    /// Every parameter in listing order (dotted names).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        (0..self.num_parameters()).map(|i| self.parameter_at(i)).collect()
    }

    /// The parameter by dotted name; `None` for a slot registered empty.
    pub fn get_parameter(&self, name: &str) -> Result<Option<Tensor>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_parameter)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Tensor::from_raw(&self.lib, out) }) })
    }

    /// The parameter by dotted name; an empty slot is DP_EINVAL.
    pub fn parameter(&self, name: &str) -> Result<Tensor> {
        self.get_parameter(name)?
            .ok_or_else(|| Error::new(DP_EINVAL, format!("dotted_name: parameter '{name}' is an empty slot")))
    }

    /// The buffer by dotted name; `None` for a slot registered empty.
    pub fn get_buffer(&self, name: &str) -> Result<Option<Tensor>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_buffer)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Tensor::from_raw(&self.lib, out) }) })
    }

    /// The child by dotted name ("" is the module itself).
    pub fn submodule(&self, name: &str) -> Result<Option<Module>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_module)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Module::from_raw(&self.lib, out) }) })
    }

    /// The parameter's gradient (allocated zeroed on first use, then the
    /// same storage every time).
    pub fn grad(&self, name: &str) -> Result<Tensor> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_grad)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }

    pub fn zero_grad(&mut self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().module_zero_grad)(self.raw) })
    }

    pub fn set_requires_grad(&mut self, name: &str, requires_grad: bool) -> Result<()> {
        let c = cstring("dotted_name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_set_requires_grad)(self.raw, c.as_ptr(), requires_grad as c_int) })
    }

    pub fn requires_grad(&self, name: &str) -> Result<bool> {
        let c = cstring("dotted_name", name)?;
        let mut out: c_int = 0;
        self.lib.check(unsafe { (self.lib.api().module_requires_grad)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(out != 0)
    }

    /// The state dict as a safetensors file.
    pub fn save(&self, path: &str) -> Result<()> {
        let c = cstring("path", path)?;
        self.lib.check(unsafe { (self.lib.api().module_save)(self.raw, c.as_ptr()) })
    }

    pub fn load(&mut self, path: &str, strict: bool) -> Result<()> {
        let c = cstring("path", path)?;
        self.lib.check(unsafe { (self.lib.api().module_load)(self.raw, c.as_ptr(), strict as c_int) })
    }

    /// A new replica on each device.
    pub fn replicate(&self, devices: &[Device], detach: bool) -> Result<Vec<Module>> {
        let mut out = vec![ptr::null_mut(); devices.len()];
        let raw_devices: Vec<sys::dp_device> = devices.iter().map(|d| d.0).collect();
        let api = self.lib.api();
        self.lib.check(unsafe {
            (api.replicate)(self.raw, raw_devices.as_ptr(), raw_devices.len(), detach as c_int, out.as_mut_ptr())
        })?;
        Ok(out.into_iter().map(|m| unsafe { Module::from_raw(&self.lib, m) }).collect())
    }

    /// Adds every replica's gradients into this module's (dp_reduce_gradients).
    pub fn reduce_gradients_from(&mut self, replicas: &[&Module]) -> Result<()> {
        let raw: Vec<*mut sys::dp_module> = replicas.iter().map(|m| m.raw).collect();
        self.lib.check(unsafe { (self.lib.api().reduce_gradients)(raw.as_ptr(), raw.len(), self.raw) })
    }

    /// dp_data_parallel: scatter `input` along `dim` over `devices`, run
    /// `forward` on a replica per device, reduce the replicas' gradients into
    /// this module's and gather the outputs on `output_device`.
    pub fn data_parallel<F>(
        &mut self,
        input: &Tensor,
        devices: &[Device],
        output_device: Device,
        dim: i32,
        forward: F,
    ) -> Result<Tensor>
    where
        F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
    {
        let raw_devices: Vec<sys::dp_device> = devices.iter().map(|d| d.0).collect();
        let lib = self.lib.clone();
        let raw = self.raw;
        run_forward(&lib, &forward, |f, ud, out| unsafe {
            (lib.api().data_parallel)(
                raw,
                input.raw,
                raw_devices.as_ptr(),
                raw_devices.len(),
                output_device.0,
                dim,
                f,
                ud,
                out,
            )
        })
    }
}

// ---------------------------------------------------------------------------
// forward callbacks

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
    lib: Library,
    failures: Mutex<Vec<(usize, String)>>,
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
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

fn run_forward<F, C>(lib: &Library, forward: &F, call: C) -> Result<Tensor>
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

fn with_failures(mut err: Error, failures: &Mutex<Vec<(usize, String)>>) -> Error {
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
    raw: *mut sys::dp_replica_set,
    lib: Library,
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
        lib.check(unsafe {
            (lib.api().replica_set_create)(&mut out, module.raw, raw_devices.as_ptr(), raw_devices.len())
        })?;
        Ok(ReplicaSet { raw: out, lib })
    }

    pub fn len(&self) -> usize {
        unsafe { (self.lib.api().replica_set_size)(self.raw) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the module's parameters and buffers into the replicas.
    pub fn sync(&mut self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().replica_set_sync)(self.raw) })
    }

    pub fn replica(&self, index: usize) -> Result<Module> {
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().replica_set_replica)(self.raw, index, &mut out) })?;
        Ok(unsafe { Module::from_raw(&self.lib, out) })
    }

    /// Adds the replicas' gradients into the module's, then zeroes theirs.
    pub fn reduce_gradients(&mut self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().replica_set_reduce_gradients)(self.raw) })
    }

    /// Scatter along `dim`, `forward` on every replica, gather on `output_device`.
    pub fn apply<F>(&mut self, input: &Tensor, dim: i32, output_device: Device, forward: F) -> Result<Tensor>
    where
        F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
    {
        let lib = self.lib.clone();
        let raw = self.raw;
        run_forward(&lib, &forward, |f, ud, out| unsafe {
            (lib.api().replica_set_apply)(raw, input.raw, dim, output_device.0, f, ud, out)
        })
    }
}

// ---------------------------------------------------------------------------
// stores, process groups, work

/// A key-value store for rendezvous (dp_store_*); safe from any thread.
pub struct Store {
    raw: *mut sys::dp_store,
    lib: Library,
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
    /// None: a TCP store at MASTER_ADDR:MASTER_PORT, served by rank 0.
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
    fn raw_options(&self, lib: &Library) -> Result<sys::dp_process_group_options> {
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
    raw: *mut sys::dp_process_group,
    lib: Library,
    owned: bool,
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
    /// Joins the group dp-run (or torchrun, mpirun) describes in the
    /// environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
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

    pub fn all_reduce<T: InPlace + ?Sized>(&self, tensor: &mut T, op: ReduceOp) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().pg_all_reduce)(self.raw, tensor.raw_mut(), op as i32) })
    }

    /// Starts an all_reduce; the tensor stays borrowed until the work is
    /// waited for or dropped (dropping waits).
    pub fn all_reduce_async<'t, T: InPlace + ?Sized>(&self, tensor: &'t mut T, op: ReduceOp) -> Result<Work<'t>> {
        let mut out = ptr::null_mut();
        let raw = tensor.raw_mut();
        self.lib.check(unsafe { (self.lib.api().pg_all_reduce_async)(self.raw, raw, op as i32, &mut out) })?;
        Ok(Work { raw: out, lib: self.lib.clone(), done: false, _tensor: PhantomData })
    }

    pub fn broadcast<T: InPlace + ?Sized>(&self, tensor: &mut T, root: i32) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().pg_broadcast)(self.raw, tensor.raw_mut(), root) })
    }

    /// outputs[r] receives rank r's input.
    pub fn all_gather(&self, input: &Tensor, outputs: &mut [Tensor]) -> Result<()> {
        let raw: Vec<*mut sys::dp_tensor> = outputs.iter().map(|t| t.raw).collect();
        self.lib.check(unsafe { (self.lib.api().pg_all_gather)(self.raw, input.raw, raw.as_ptr(), raw.len()) })
    }

    pub fn barrier(&self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().pg_barrier)(self.raw) })
    }
}

/// An asynchronous collective (dp_work). Dropping it waits for the
/// collective, so the tensor it writes is never written after its borrow ends.
pub struct Work<'t> {
    raw: *mut sys::dp_work,
    lib: Library,
    done: bool,
    _tensor: PhantomData<&'t mut ()>,
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
        let api = self.lib.api();
        unsafe {
            if !self.done {
                (api.work_wait)(self.raw);
            }
            (api.work_destroy)(self.raw);
        }
    }
}

// ---------------------------------------------------------------------------
// DDP

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
    raw: *mut sys::dp_ddp,
    lib: Library,
    // Dropped after dp_ddp_destroy, which waits for reductions in flight.
    hook: Option<Box<HookState>>,
}

/// The flat bucket a comm hook is lent: this rank's gradients of one
/// bucket, to be replaced by what the module's gradients should hold.
pub struct Bucket<'a> {
    tensor: Tensor,
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
    hook: Box<CommHookFn>,
    lib: Library,
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
