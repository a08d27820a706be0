//! dparallel for Rust hosts, without crates: the library is `dlopen`ed, its
//! one table of entry points is read through `dp_get_api`, and this crate
//! wraps it in owned handle types.
//!
//! - Handles (`Tensor`, `Module`, `ReplicaSet`, `Store`, `ProcessGroup`,
//!   `Work`, `Ddp`, `Fsdp`, `Stream`) release their reference on drop, and each keeps the
//!   library loaded: it is closed when the last of them and the last
//!   `Library` are gone.
//! - A failing call is `Err(Error)` with the status code and the message of
//!   `dp_last_error()`, which names the offending argument.
//! - CPU tensors are read and written in place through guards that deref to
//!   `&[T]` / `&mut [T]`, borrowed from the tensor and checked per storage:
//!   a mutable slice is refused while another slice covers the same memory,
//!   through whichever handle (`Tensor::as_slice`), and so is a slice of
//!   memory the library uses, during a call or in work the call left
//!   running (DDP gradients marked ready until `finish_backward`, FSDP
//!   shards after `unshard_async` until `wait_unshard`, a DLPack export
//!   until its deleter runs). `as_slice_unchecked`
//!   skips the check and is `unsafe`.
//! - Thread safety: handles are `Send + Sync`; a call takes `&self` or
//!   `&mut self` and dropping takes the handle by value, so no handle is
//!   released while a call on it runs on another thread.
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

pub mod comm;
pub mod sys;

mod ddp;
mod device;
mod dist;
mod error;
mod fsdp;
mod library;
mod mesh;
mod module;
mod parallel;
mod stream;
mod tensor;
mod view;

pub use ddp::{Bucket, CommHook, Ddp, DdpHooks, DdpOptions, DdpStats};
pub use device::{DType, Device, DeviceKind, Element};
pub use dist::{Backend, ProcessGroup, ProcessGroupOptions, ReduceOp, Store, Work, WorkScope};
pub use error::{Error, Result};
pub use fsdp::{Fsdp, FsdpOptions};
pub use library::{Library, MemoryStats, DEFAULT_LIBRARY};
pub use mesh::DeviceMesh;
pub use module::Module;
pub use parallel::{parallel_apply, Replica, ReplicaSet};
pub use stream::{clear_current_stream, current_stream, Stream};
pub use sys::{
    DP_EDEVICE, DP_EINTERNAL, DP_EINVAL, DP_EIO, DP_ENOMEM, DP_EREMOTE, DP_ESTATE, DP_ETIMEOUT, DP_EUNSUPPORTED,
    DP_EUSER,
};
pub use tensor::{DlPack, DlPackVersioned, InPlace, Tensor};
pub use view::{TensorSlice, TensorSliceMut};
