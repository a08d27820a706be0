//! Streams (dp_stream.h): PyTorch's current-stream contract.

use std::fmt;
use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use crate::view::CallbackScope;
use crate::{sys, Device, Library, Result};

/// A queue of device work: a `cudaStream_t` on a cuda device, a queue run by
/// a thread of its own on a cpu device. One from `Stream::new` is destroyed
/// on drop (after its queued work); the others are only named.
pub struct Stream {
    raw: *mut c_void,
    device: Device,
    lib: Library,
    owned: bool,
}

// A stream may be used from any thread (dp_stream.h).
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({:p} on {})", self.raw, self.device)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            unsafe { (self.lib.api().stream_destroy)(self.device.0, self.raw) };
        }
    }
}

unsafe extern "C" fn host_func_trampoline(user_data: *mut c_void) {
    let f = Box::from_raw(user_data as *mut Box<dyn FnOnce() + Send>);
    // Work on a stream is ordered with the calls that take the stream
    // (mark_grad_ready_stream waits for it): they lend it their memory.
    let _lent = CallbackScope::enter();
    // Nothing may unwind into the library's thread; the panic message has
    // been printed by the panic hook.
    let _ = catch_unwind(AssertUnwindSafe(f));
}

impl Stream {
    /// A new stream of `device` (dp_stream_create).
    pub fn new(lib: &Library, device: Device) -> Result<Stream> {
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().stream_create)(device.0, &mut out) })?;
        Ok(Stream { raw: out, device, lib: lib.clone(), owned: true })
    }

    /// The device's legacy default stream (NULL).
    pub fn legacy_default(lib: &Library, device: Device) -> Stream {
        Stream { raw: ptr::null_mut(), device, lib: lib.clone(), owned: false }
    }

    /// Names a stream the host owns (a `cudaStream_t` of `device`); it is
    /// not destroyed on drop.
    ///
    /// # Safety
    /// `raw` must be a stream of `device` that outlives every use of this value.
    pub unsafe fn from_raw(lib: &Library, device: Device, raw: *mut c_void) -> Stream {
        Stream { raw, device, lib: lib.clone(), owned: false }
    }

    /// The stream handle (NULL for the legacy default stream).
    pub fn as_raw(&self) -> *mut c_void {
        self.raw
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Returns once the work queued so far is done.
    pub fn synchronize(&self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().stream_synchronize)(self.device.0, self.raw) })
    }

    /// Queues `f`: it runs on a host thread after the work queued before it,
    /// and work queued after it waits for it. A panic in it is caught there.
    pub fn launch_host_func<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        let boxed: Box<Box<dyn FnOnce() + Send>> = Box::new(Box::new(f));
        let user_data = Box::into_raw(boxed) as *mut c_void;
        let api = self.lib.api();
        let st =
            unsafe { (api.stream_launch_host_func)(self.device.0, self.raw, Some(host_func_trampoline), user_data) };
        if st != sys::DP_OK {
            // Not queued: the closure is still ours.
            drop(unsafe { Box::from_raw(user_data as *mut Box<dyn FnOnce() + Send>) });
            return Err(self.lib.error(st));
        }
        Ok(())
    }

    /// Waits for the queued work, then frees the stream; the error a plain
    /// drop would not report.
    pub fn destroy(mut self) -> Result<()> {
        if !self.owned {
            return Ok(());
        }
        self.owned = false;
        self.lib.check(unsafe { (self.lib.api().stream_destroy)(self.device.0, self.raw) })
    }

    /// Makes this stream current for its device on the calling thread: later
    /// calls on this thread that touch tensors there queue after its work.
    pub fn make_current(&self) -> Result<()> {
        self.lib.check(unsafe { (self.lib.api().set_current_stream)(self.device.0, self.raw) })
    }
}

/// Clears the calling thread's current stream for `device`: calls wait for
/// the legacy default stream and complete before they return.
pub fn clear_current_stream(lib: &Library, device: Device) -> Result<()> {
    lib.check(unsafe { (lib.api().set_current_stream)(device.0, ptr::null_mut()) })
}

/// The calling thread's current stream handle for `device`; NULL when none
/// is set.
pub fn current_stream(lib: &Library, device: Device) -> Result<*mut c_void> {
    let mut out = ptr::null_mut();
    lib.check(unsafe { (lib.api().get_current_stream)(device.0, &mut out) })?;
    Ok(out)
}
