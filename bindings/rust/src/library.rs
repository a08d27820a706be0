//! The loaded library and its table.

use std::fmt;
use std::os::raw::{c_char, c_void};
use std::ptr;
use std::sync::Arc;

use crate::error::{cstring, owned_text};
use crate::{sys, DType, Device, DeviceKind, Error, Result, DP_EIO, DP_EUNSUPPORTED};

/// The library file opened when neither an argument nor DP_LIBRARY names
/// one: the SONAME of ABI major `sys::DP_VERSION_MAJOR`.
pub const DEFAULT_LIBRARY: &str = "libdparallel.so.0";

pub(crate) struct Loaded {
    pub(crate) handle: *mut c_void,
    pub(crate) api: *const sys::dp_api,
}

// The table is static and its entry points are thread-safe (dp_api.h).
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

impl Drop for Loaded {
    fn drop(&mut self) {
        unsafe {
            // The library's own threads end first: dlclose must not unmap
            // code they still run.
            if !self.api.is_null() {
                ((*self.api).shutdown)();
            }
            sys::dlclose(self.handle);
        }
    }
}

/// The loaded library. Cheap to clone; closed once every clone and every
/// handle made through it is dropped.
#[derive(Clone)]
pub struct Library {
    pub(crate) loaded: Arc<Loaded>,
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
                        "{path}: its dp_api table (abi_minor {minor}, {struct_size} bytes) is older than this crate's (abi_minor {}, {need} bytes): this crate needs a library with every entry point of abi_minor {}",
                        sys::DP_API_MINOR,
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

    pub(crate) fn error(&self, code: sys::dp_status) -> Error {
        let message = unsafe { owned_text((self.api().last_error)()) };
        Error { code, message }
    }

    pub(crate) fn check(&self, code: sys::dp_status) -> Result<()> {
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

    /// The static text of a status code ("unknown status" for an unknown one).
    pub fn status_string(&self, code: i32) -> String {
        unsafe { owned_text((self.api().status_string)(code)) }
    }

    /// "cpu:3" or "cuda:1", as the library writes it.
    pub fn format_device(&self, device: Device) -> Result<String> {
        // "cuda:" and an i32 fit in 32 bytes.
        let mut buf = [0u8; 32];
        self.check(unsafe { (self.api().device_format)(device.0, buf.as_mut_ptr() as *mut c_char, buf.len()) })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// Bytes per element of `dtype`.
    pub fn dtype_size(&self, dtype: DType) -> usize {
        unsafe { (self.api().dtype_size)(dtype as i32) }
    }

    /// Memory of the device's tensors the library allocated (not memory
    /// lent through `Tensor::from_vec`, `from_blob` or DLPack).
    pub fn memory_stats(&self, device: Device) -> Result<MemoryStats> {
        let mut s =
            sys::dp_memory_stats { struct_size: std::mem::size_of::<sys::dp_memory_stats>(), ..Default::default() };
        self.check(unsafe { (self.api().device_memory_stats)(device.0, &mut s) })?;
        Ok(MemoryStats {
            allocated_bytes: s.allocated_bytes,
            peak_allocated_bytes: s.peak_allocated_bytes,
            cached_bytes: s.cached_bytes,
        })
    }

    /// Starts the device's peak (`MemoryStats::peak_allocated_bytes`) afresh.
    pub fn reset_peak_memory(&self, device: Device) -> Result<()> {
        self.check(unsafe { (self.api().device_reset_peak_memory)(device.0) })
    }

    /// dp_shutdown: ends the threads the library keeps for itself (device
    /// workers, the compute pool); a later call that needs them starts them
    /// again. Dropping the last handle of the library does this too, before
    /// it is closed. DP_ESTATE from a forward closure or host function.
    pub fn shutdown(&self) -> Result<()> {
        self.check(unsafe { (self.api().shutdown)() })
    }
}

/// Memory of one device's tensors, in bytes (dp_memory_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// In use now.
    pub allocated_bytes: u64,
    /// The most in use at once since the last `reset_peak_memory`.
    pub peak_allocated_bytes: u64,
    /// Freed blocks kept for reuse, all devices together.
    pub cached_bytes: u64,
}
