//! Devices and dtypes.

use std::fmt;

use crate::sys;

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

pub(crate) fn dtype_name(code: i32) -> &'static str {
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
