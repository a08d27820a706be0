//! Errors: a failed call's status code and message.

use std::ffi::{CStr, CString};
use std::fmt;
use std::os::raw::c_char;

use crate::sys::{
    DP_EDEVICE, DP_EINTERNAL, DP_EINVAL, DP_EIO, DP_ENOMEM, DP_EREMOTE, DP_ESTATE, DP_ETIMEOUT, DP_EUNSUPPORTED,
    DP_EUSER,
};

/// A failed call: its `dp_status` and the library's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub(crate) code: i32,
    pub(crate) message: String,
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

pub(crate) fn cstring(argument: &str, text: &str) -> Result<CString> {
    CString::new(text)
        .map_err(|_| Error::new(DP_EINVAL, format!("{argument} '{}' contains a NUL byte", text.escape_debug())))
}

pub(crate) unsafe fn owned_text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}
