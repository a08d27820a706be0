//! The raw C ABI: dlopen/dlsym/dlerror and a `#[repr(C)]` mirror of
//! `struct dp_api` (include/dparallel/dp_api.h), field for field.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub const RTLD_NOW: c_int = 2;
pub const RTLD_LOCAL: c_int = 0;

// libdl: where glibc before 2.34 has them; later ones keep it as a stub
// (the functions moved into libc), so -ldl links everywhere.
#[link(name = "dl")]
extern "C" {
    pub fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    pub fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    pub fn dlerror() -> *mut c_char;
    pub fn dlclose(handle: *mut c_void) -> c_int;
}

/// The ABI major this mirror describes (DP_VERSION_MAJOR).
pub const DP_VERSION_MAJOR: u32 = 0;
/// The abi_minor of the table this mirror describes (DP_API_MINOR).
pub const DP_API_MINOR: u32 = 11;

pub type dp_status = i32;
pub const DP_OK: dp_status = 0;
pub const DP_EINVAL: dp_status = -1;
pub const DP_ENOMEM: dp_status = -2;
pub const DP_EDEVICE: dp_status = -3;
pub const DP_ETIMEOUT: dp_status = -4;
pub const DP_EREMOTE: dp_status = -5;
pub const DP_EUSER: dp_status = -6;
pub const DP_EIO: dp_status = -7;
pub const DP_ESTATE: dp_status = -8;
pub const DP_EUNSUPPORTED: dp_status = -9;
pub const DP_EINTERNAL: dp_status = -10;

pub const DP_DEVICE_CPU: i32 = 1;
pub const DP_DEVICE_CUDA: i32 = 2;

pub const DP_FLOAT32: i32 = 0;

pub const DP_HOOK_CUSTOM: i32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct dp_device {
    pub type_: i32,
    pub index: i32,
}

// Opaque handles.
#[repr(C)]
pub struct dp_tensor {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_module {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_replica_set {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_store {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_process_group {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_device_mesh {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_work {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_ddp {
    _private: [u8; 0],
}
#[repr(C)]
pub struct dp_fsdp {
    _private: [u8; 0],
}

/// DLPack's DLDevice (dlpack.h, the DLManagedTensor protocol).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

/// DLPack's DLDataType.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

/// DLPack's DLTensor.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

/// DLPack's DLManagedTensor.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// DLPack 1.x's DLPackVersion.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

/// DLPack 1.x's DLManagedTensorVersioned (dp_dlpack.h).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

/// DLPack 1.x's flags.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;
pub const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct dp_process_group_options {
    pub struct_size: usize,
    pub backend: i32,
    pub rank: i32,
    pub world_size: i32,
    pub store: *mut dp_store,
    pub timeout_ms: i32,
    pub device: dp_device,
}

pub type dp_comm_hook_fn =
    Option<unsafe extern "C" fn(*mut c_void, *mut dp_process_group, usize, *mut dp_tensor) -> c_int>;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct dp_ddp_options {
    pub struct_size: usize,
    pub bucket_cap_mb: f64,
    pub first_bucket_cap_mb: f64,
    pub gradient_as_bucket_view: c_int,
    pub broadcast_buffers: c_int,
    pub find_unused_parameters: c_int,
    pub init_sync: c_int,
    pub ignored_modules: *const *const c_char,
    pub num_ignored_modules: usize,
    pub ignored_parameters: *const *const c_char,
    pub num_ignored_parameters: usize,
    pub comm_hook: i32,
    pub hook_fn: dp_comm_hook_fn,
    pub hook_user_data: *mut c_void,
    // ---- abi_minor 6 ----
    pub static_graph: c_int,
    pub join_divide_by_initial_world_size: c_int,
    pub on_bucket_reduced: dp_bucket_reduced_fn,
    pub on_bucket_reduced_data: *mut c_void,
    pub bucket_plan: *const c_char,
}

pub type dp_bucket_reduced_fn =
    Option<unsafe extern "C" fn(*mut c_void, *mut dp_ddp, usize, *const usize, usize) -> c_int>;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dp_fsdp_options {
    pub struct_size: usize,
    pub reshard_after_forward: c_int,
    pub param_dtype: i32,
    pub reduce_dtype: i32,
    pub init_sync: c_int,
    pub full_params_as_views: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct dp_memory_stats {
    pub struct_size: usize,
    pub allocated_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub cached_bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct dp_ddp_stats {
    pub struct_size: usize,
    pub backward_ms: f64,
    pub reduce_ms: f64,
    pub exposed_ms: f64,
    pub num_buckets: usize,
    pub buckets_rebuilt: c_int,
}

pub type dp_forward_fn = unsafe extern "C" fn(
    user_data: *mut c_void,
    replica_index: usize,
    replica: *mut dp_module,
    input: *mut dp_tensor,
    device: dp_device,
    output: *mut *mut dp_tensor,
) -> c_int;

pub type dp_get_api_fn = unsafe extern "C" fn(abi_major: u32) -> *const dp_api;

type St = dp_status;

/// Declares `dp_api` and `SLOT_NAMES` from one list, so that the names a
/// test compares with dp_api.h are the fields themselves.
macro_rules! dp_api_slots {
    ($($(#[$doc:meta])* $name:ident: $ty:ty,)*) => {
        /// `struct dp_api` of abi_minor 8. Every slot after the header is a
        /// function pointer; `Library::open` checks that none is NULL before
        /// this type is read.
        #[repr(C)]
        pub struct dp_api {
            pub struct_size: usize,
            pub abi_major: u32,
            pub abi_minor: u32,
            $($(#[$doc])* pub $name: $ty,)*
        }

        /// The slots' names in table order.
        pub const SLOT_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}

dp_api_slots! {
    // ---- abi_minor 1 ----
    // base
    status_string: unsafe extern "C" fn(St) -> *const c_char,
    last_error: unsafe extern "C" fn() -> *const c_char,
    version_number: unsafe extern "C" fn() -> u32,
    device_count: unsafe extern "C" fn(i32, *mut i32) -> St,
    device_parse: unsafe extern "C" fn(*const c_char, *mut dp_device) -> St,
    device_format: unsafe extern "C" fn(dp_device, *mut c_char, usize) -> St,
    dtype_size: unsafe extern "C" fn(i32) -> usize,
    // tensor
    tensor_create: unsafe extern "C" fn(*mut *mut dp_tensor, i32, i32, *const i64, dp_device) -> St,
    tensor_from_blob: unsafe extern "C" fn(
        *mut *mut dp_tensor,
        *mut c_void,
        i32,
        i32,
        *const i64,
        dp_device,
        Option<unsafe extern "C" fn(*mut c_void)>,
        *mut c_void,
    ) -> St,
    tensor_destroy: unsafe extern "C" fn(*mut dp_tensor),
    tensor_copy_from_host: unsafe extern "C" fn(*mut dp_tensor, *const c_void, usize) -> St,
    tensor_copy_to_host: unsafe extern "C" fn(*const dp_tensor, *mut c_void, usize) -> St,
    tensor_dtype: unsafe extern "C" fn(*const dp_tensor) -> i32,
    tensor_ndim: unsafe extern "C" fn(*const dp_tensor) -> i32,
    tensor_shape: unsafe extern "C" fn(*const dp_tensor, *mut i64, i32) -> St,
    tensor_numel: unsafe extern "C" fn(*const dp_tensor) -> i64,
    tensor_nbytes: unsafe extern "C" fn(*const dp_tensor) -> usize,
    tensor_device: unsafe extern "C" fn(*const dp_tensor) -> dp_device,
    tensor_data: unsafe extern "C" fn(*const dp_tensor) -> *mut c_void,
    tensor_from_dlpack: unsafe extern "C" fn(*mut *mut dp_tensor, *mut DLManagedTensor) -> St,
    tensor_to_dlpack: unsafe extern "C" fn(*const dp_tensor, *mut *mut DLManagedTensor) -> St,
    // in-process collectives
    broadcast: unsafe extern "C" fn(*const dp_tensor, *const dp_device, usize, *mut *mut dp_tensor) -> St,
    broadcast_coalesced:
        unsafe extern "C" fn(*const *const dp_tensor, usize, *const dp_device, usize, usize, *mut *mut dp_tensor) -> St,
    reduce_add: unsafe extern "C" fn(*const *const dp_tensor, usize, dp_device, *mut *mut dp_tensor) -> St,
    reduce_add_coalesced:
        unsafe extern "C" fn(*const *const dp_tensor, usize, usize, dp_device, usize, *mut *mut dp_tensor) -> St,
    scatter: unsafe extern "C" fn(
        *const dp_tensor,
        *const dp_device,
        usize,
        *const i64,
        i32,
        *mut *mut dp_tensor,
        *mut usize,
    ) -> St,
    gather: unsafe extern "C" fn(*const *const dp_tensor, usize, i32, dp_device, *mut *mut dp_tensor) -> St,
    // modules
    module_create: unsafe extern "C" fn(*mut *mut dp_module) -> St,
    module_destroy: unsafe extern "C" fn(*mut dp_module),
    module_register_parameter: unsafe extern "C" fn(*mut dp_module, *const c_char, *mut dp_tensor, c_int) -> St,
    module_register_buffer: unsafe extern "C" fn(*mut dp_module, *const c_char, *mut dp_tensor, c_int) -> St,
    module_register_module: unsafe extern "C" fn(*mut dp_module, *const c_char, *mut dp_module) -> St,
    module_num_parameters: unsafe extern "C" fn(*const dp_module) -> usize,
    module_num_buffers: unsafe extern "C" fn(*const dp_module) -> usize,
    module_parameter_at:
        unsafe extern "C" fn(*const dp_module, usize, *mut *const c_char, *mut *mut dp_tensor) -> St,
    module_buffer_at: unsafe extern "C" fn(*const dp_module, usize, *mut *const c_char, *mut *mut dp_tensor) -> St,
    module_get_parameter: unsafe extern "C" fn(*const dp_module, *const c_char, *mut *mut dp_tensor) -> St,
    module_get_buffer: unsafe extern "C" fn(*const dp_module, *const c_char, *mut *mut dp_tensor) -> St,
    module_get_module: unsafe extern "C" fn(*const dp_module, *const c_char, *mut *mut dp_module) -> St,
    module_grad: unsafe extern "C" fn(*mut dp_module, *const c_char, *mut *mut dp_tensor) -> St,
    module_zero_grad: unsafe extern "C" fn(*mut dp_module) -> St,
    module_save: unsafe extern "C" fn(*const dp_module, *const c_char) -> St,
    module_load: unsafe extern "C" fn(*mut dp_module, *const c_char, c_int) -> St,
    // replication
    replicate: unsafe extern "C" fn(*const dp_module, *const dp_device, usize, c_int, *mut *mut dp_module) -> St,
    reduce_gradients: unsafe extern "C" fn(*const *mut dp_module, usize, *mut dp_module) -> St,
    replica_set_create:
        unsafe extern "C" fn(*mut *mut dp_replica_set, *mut dp_module, *const dp_device, usize) -> St,
    replica_set_sync: unsafe extern "C" fn(*mut dp_replica_set) -> St,
    replica_set_replica: unsafe extern "C" fn(*const dp_replica_set, usize, *mut *mut dp_module) -> St,
    replica_set_reduce_gradients: unsafe extern "C" fn(*mut dp_replica_set) -> St,
    replica_set_destroy: unsafe extern "C" fn(*mut dp_replica_set),
    // parallel
    parallel_apply: unsafe extern "C" fn(
        *const *mut dp_module,
        *const *mut dp_tensor,
        *const dp_device,
        usize,
        dp_forward_fn,
        *mut c_void,
        *mut *mut dp_tensor,
    ) -> St,
    data_parallel: unsafe extern "C" fn(
        *mut dp_module,
        *mut dp_tensor,
        *const dp_device,
        usize,
        dp_device,
        i32,
        dp_forward_fn,
        *mut c_void,
        *mut *mut dp_tensor,
    ) -> St,
    replica_set_apply: unsafe extern "C" fn(
        *mut dp_replica_set,
        *mut dp_tensor,
        i32,
        dp_device,
        dp_forward_fn,
        *mut c_void,
        *mut *mut dp_tensor,
    ) -> St,
    // distributed
    store_create_file: unsafe extern "C" fn(*mut *mut dp_store, *const c_char, i32) -> St,
    store_create_tcp: unsafe extern "C" fn(*mut *mut dp_store, *const c_char, u16, i32, c_int, i32) -> St,
    store_set: unsafe extern "C" fn(*mut dp_store, *const c_char, *const c_void, usize) -> St,
    store_get: unsafe extern "C" fn(*mut dp_store, *const c_char, *mut c_void, usize, *mut usize) -> St,
    store_add: unsafe extern "C" fn(*mut dp_store, *const c_char, i64, *mut i64) -> St,
    store_wait: unsafe extern "C" fn(*mut dp_store, *const *const c_char, usize, i32) -> St,
    store_destroy: unsafe extern "C" fn(*mut dp_store),
    process_group_options_init: unsafe extern "C" fn(*mut dp_process_group_options, usize) -> St,
    process_group_create: unsafe extern "C" fn(*mut *mut dp_process_group, *const dp_process_group_options) -> St,
    process_group_create_from_env:
        unsafe extern "C" fn(*mut *mut dp_process_group, *const dp_process_group_options) -> St,
    process_group_rank: unsafe extern "C" fn(*const dp_process_group) -> i32,
    process_group_size: unsafe extern "C" fn(*const dp_process_group) -> i32,
    process_group_destroy: unsafe extern "C" fn(*mut dp_process_group),
    pg_all_reduce: unsafe extern "C" fn(*mut dp_process_group, *mut dp_tensor, i32) -> St,
    pg_all_reduce_async: unsafe extern "C" fn(*mut dp_process_group, *mut dp_tensor, i32, *mut *mut dp_work) -> St,
    pg_broadcast: unsafe extern "C" fn(*mut dp_process_group, *mut dp_tensor, i32) -> St,
    pg_all_gather:
        unsafe extern "C" fn(*mut dp_process_group, *const dp_tensor, *const *mut dp_tensor, usize) -> St,
    pg_reduce_scatter:
        unsafe extern "C" fn(*mut dp_process_group, *const *const dp_tensor, usize, *mut dp_tensor, i32) -> St,
    pg_barrier: unsafe extern "C" fn(*mut dp_process_group) -> St,
    work_wait: unsafe extern "C" fn(*mut dp_work) -> St,
    work_test: unsafe extern "C" fn(*mut dp_work, *mut c_int) -> St,
    work_destroy: unsafe extern "C" fn(*mut dp_work),
    // additions beyond the base contract
    tensor_to_device: unsafe extern "C" fn(*mut *mut dp_tensor, *const dp_tensor, dp_device) -> St,
    module_set_requires_grad: unsafe extern "C" fn(*mut dp_module, *const c_char, c_int) -> St,
    module_requires_grad: unsafe extern "C" fn(*const dp_module, *const c_char, *mut c_int) -> St,
    replica_set_size: unsafe extern "C" fn(*const dp_replica_set) -> usize,
    store_tcp_port: unsafe extern "C" fn(*const dp_store, *mut u16) -> St,
    store_set_timeout: unsafe extern "C" fn(*mut dp_store, i32) -> St,
    pg_broadcast_async: unsafe extern "C" fn(*mut dp_process_group, *mut dp_tensor, i32, *mut *mut dp_work) -> St,
    pg_all_gather_async: unsafe extern "C" fn(
        *mut dp_process_group,
        *const dp_tensor,
        *const *mut dp_tensor,
        usize,
        *mut *mut dp_work,
    ) -> St,
    pg_reduce_scatter_async: unsafe extern "C" fn(
        *mut dp_process_group,
        *const *const dp_tensor,
        usize,
        *mut dp_tensor,
        i32,
        *mut *mut dp_work,
    ) -> St,
    pg_barrier_async: unsafe extern "C" fn(*mut dp_process_group, *mut *mut dp_work) -> St,
    process_group_backend: unsafe extern "C" fn(*const dp_process_group) -> *const c_char,
    // the DDP reducer (dp_ddp.h)
    ddp_options_init: unsafe extern "C" fn(*mut dp_ddp_options, usize) -> St,
    ddp_create:
        unsafe extern "C" fn(*mut *mut dp_ddp, *mut dp_module, *mut dp_process_group, *const dp_ddp_options) -> St,
    ddp_pre_forward: unsafe extern "C" fn(*mut dp_ddp) -> St,
    ddp_mark_grad_ready: unsafe extern "C" fn(*mut dp_ddp, *const c_char) -> St,
    ddp_mark_grad_ready_index: unsafe extern "C" fn(*mut dp_ddp, usize) -> St,
    ddp_finish_backward: unsafe extern "C" fn(*mut dp_ddp) -> St,
    ddp_set_requires_gradient_sync: unsafe extern "C" fn(*mut dp_ddp, c_int) -> St,
    ddp_num_buckets: unsafe extern "C" fn(*const dp_ddp) -> usize,
    ddp_bucket_parameters: unsafe extern "C" fn(*const dp_ddp, usize, *mut usize, usize, *mut usize) -> St,
    ddp_destroy: unsafe extern "C" fn(*mut dp_ddp),
    ddp_mark_grad_ready_stream: unsafe extern "C" fn(*mut dp_ddp, usize, *mut c_void) -> St,
    ddp_last_stats: unsafe extern "C" fn(*const dp_ddp, *mut dp_ddp_stats) -> St,
    module_set_grad: unsafe extern "C" fn(*mut dp_module, *const c_char, *mut dp_tensor) -> St,
    // ---- abi_minor 5: streams (dp_stream.h) ----
    set_current_stream: unsafe extern "C" fn(dp_device, *mut c_void) -> St,
    get_current_stream: unsafe extern "C" fn(dp_device, *mut *mut c_void) -> St,
    stream_create: unsafe extern "C" fn(dp_device, *mut *mut c_void) -> St,
    stream_destroy: unsafe extern "C" fn(dp_device, *mut c_void) -> St,
    stream_synchronize: unsafe extern "C" fn(dp_device, *mut c_void) -> St,
    stream_launch_host_func:
        unsafe extern "C" fn(dp_device, *mut c_void, Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void) -> St,
    // ---- abi_minor 6: DDP beyond PyTorch's ----
    ddp_parameter_used: unsafe extern "C" fn(*const dp_ddp, usize, *mut c_int) -> St,
    ddp_bucket_plan: unsafe extern "C" fn(*const dp_ddp, *mut c_char, usize, *mut usize) -> St,
    ddp_join: unsafe extern "C" fn(*const *mut dp_ddp, usize) -> St,
    // ---- abi_minor 7: fully_shard (dp_fsdp.h), device memory ----
    fsdp_options_init: unsafe extern "C" fn(*mut dp_fsdp_options, usize) -> St,
    fsdp_create:
        unsafe extern "C" fn(*mut *mut dp_fsdp, *mut dp_module, *mut dp_process_group, *const dp_fsdp_options) -> St,
    fsdp_unshard: unsafe extern "C" fn(*mut dp_fsdp, c_int) -> St,
    fsdp_wait_unshard: unsafe extern "C" fn(*mut dp_fsdp) -> St,
    fsdp_reshard: unsafe extern "C" fn(*mut dp_fsdp) -> St,
    fsdp_post_backward: unsafe extern "C" fn(*mut dp_fsdp) -> St,
    fsdp_finish_backward: unsafe extern "C" fn(*mut dp_fsdp) -> St,
    fsdp_set_requires_gradient_sync: unsafe extern "C" fn(*mut dp_fsdp, c_int) -> St,
    fsdp_num_parameters: unsafe extern "C" fn(*const dp_fsdp) -> usize,
    fsdp_parameter_name: unsafe extern "C" fn(*const dp_fsdp, usize, *mut *const c_char) -> St,
    fsdp_shard: unsafe extern "C" fn(*const dp_fsdp, usize, *mut *mut dp_tensor) -> St,
    fsdp_shard_grad: unsafe extern "C" fn(*const dp_fsdp, usize, *mut *mut dp_tensor) -> St,
    fsdp_destroy: unsafe extern "C" fn(*mut dp_fsdp),
    fsdp_save_full_state_dict: unsafe extern "C" fn(*mut dp_module, *mut dp_process_group, *const c_char) -> St,
    fsdp_load_full_state_dict: unsafe extern "C" fn(*mut dp_module, *const c_char, c_int) -> St,
    fsdp_save_sharded_state_dict: unsafe extern "C" fn(*mut dp_module, *mut dp_process_group, *const c_char) -> St,
    fsdp_load_sharded_state_dict: unsafe extern "C" fn(*mut dp_module, *const c_char) -> St,
    // device memory (dp_base.h)
    device_memory_stats: unsafe extern "C" fn(dp_device, *mut dp_memory_stats) -> St,
    device_reset_peak_memory: unsafe extern "C" fn(dp_device) -> St,
    // ---- abi_minor 8: the library's own threads (dp_base.h) ----
    shutdown: unsafe extern "C" fn() -> St,
    // ---- abi_minor 9: subgroups and device meshes (dp_dist.h) ----
    process_group_split: unsafe extern "C" fn(
        *mut dp_process_group,
        i32,
        i32,
        *const dp_process_group_options,
        *mut *mut dp_process_group,
    ) -> St,
    process_group_local_rank: unsafe extern "C" fn(*const dp_process_group) -> i32,
    process_group_local_size: unsafe extern "C" fn(*const dp_process_group) -> i32,
    process_group_num_hosts: unsafe extern "C" fn(*const dp_process_group) -> i32,
    device_mesh_create: unsafe extern "C" fn(
        *mut *mut dp_device_mesh,
        *mut dp_process_group,
        *const i32,
        usize,
        *const *const c_char,
    ) -> St,
    device_mesh_create_by_host: unsafe extern "C" fn(*mut *mut dp_device_mesh, *mut dp_process_group) -> St,
    device_mesh_ndim: unsafe extern "C" fn(*const dp_device_mesh) -> usize,
    device_mesh_group: unsafe extern "C" fn(*const dp_device_mesh, *const c_char, *mut *mut dp_process_group) -> St,
    device_mesh_destroy: unsafe extern "C" fn(*mut dp_device_mesh),
    device_mesh_shape: unsafe extern "C" fn(*const dp_device_mesh, *mut i32, usize) -> St,
    device_mesh_coordinate: unsafe extern "C" fn(*const dp_device_mesh, *mut i32, usize) -> St,
    device_mesh_dim_name: unsafe extern "C" fn(*const dp_device_mesh, usize, *mut *const c_char) -> St,
    // ---- also abi_minor 9: hosts with their own autograd (dp_fsdp.h), DLPack 1.x (dp_dlpack.h) ----
    fsdp_mark_grad_ready: unsafe extern "C" fn(*mut dp_fsdp, *const c_char) -> St,
    tensor_to_dlpack_versioned: unsafe extern "C" fn(*const dp_tensor, c_int, *mut *mut DLManagedTensorVersioned) -> St,
    tensor_from_dlpack_versioned: unsafe extern "C" fn(*mut *mut dp_tensor, *mut DLManagedTensorVersioned) -> St,
    fsdp_full_state_dict:
        unsafe extern "C" fn(*mut dp_module, *mut dp_process_group, i32, *mut *mut dp_module) -> St,
    fsdp_create_on_mesh:
        unsafe extern "C" fn(*mut *mut dp_fsdp, *mut dp_module, *const dp_device_mesh, *const dp_fsdp_options) -> St,
    // ---- abi_minor 10: elastic and fault tolerant (dp_dist.h) ----
    process_group_abort: unsafe extern "C" fn(*mut dp_process_group) -> St,
    // ---- abi_minor 11: shrink, checkpoints in the background (dp_dist.h, dp_fsdp.h) ----
    process_group_shrink: unsafe extern "C" fn(*mut dp_process_group, *mut *mut dp_process_group) -> St,
    process_group_lost_ranks: unsafe extern "C" fn(*const dp_process_group, *mut i32, usize) -> i32,
    fsdp_save_sharded_state_dict_async:
        unsafe extern "C" fn(*mut dp_module, *mut dp_process_group, *const c_char, *mut *mut dp_work) -> St,
    ddp_rebind: unsafe extern "C" fn(*mut dp_ddp, *mut dp_process_group) -> St,
}

/// Offset of the first function pointer.
pub const FIRST_SLOT: usize = 16;

const fn slot(index: usize) -> usize {
    FIRST_SLOT + index * std::mem::size_of::<usize>()
}

// The frozen offsets of capi/api_table.cpp: the mirror cannot drift silently.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(offset_of!(dp_api, status_string) == slot(0));
    assert!(offset_of!(dp_api, tensor_create) == slot(7));
    assert!(offset_of!(dp_api, broadcast) == slot(21));
    assert!(offset_of!(dp_api, module_create) == slot(27));
    assert!(offset_of!(dp_api, replicate) == slot(43));
    assert!(offset_of!(dp_api, parallel_apply) == slot(50));
    assert!(offset_of!(dp_api, store_create_file) == slot(53));
    assert!(offset_of!(dp_api, tensor_to_device) == slot(75));
    assert!(offset_of!(dp_api, process_group_backend) == slot(85));
    assert!(offset_of!(dp_api, ddp_options_init) == slot(86));
    assert!(offset_of!(dp_api, module_set_grad) == slot(98));
    assert!(offset_of!(dp_api, set_current_stream) == slot(99));
    assert!(offset_of!(dp_api, ddp_parameter_used) == slot(105));
    assert!(offset_of!(dp_api, fsdp_options_init) == slot(108));
    assert!(offset_of!(dp_api, device_memory_stats) == slot(125));
    assert!(offset_of!(dp_api, shutdown) == slot(127));
    assert!(offset_of!(dp_api, process_group_split) == slot(128));
    assert!(offset_of!(dp_api, device_mesh_dim_name) == slot(139));
    assert!(offset_of!(dp_api, fsdp_mark_grad_ready) == slot(140));
    assert!(offset_of!(dp_api, process_group_abort) == slot(145));
    assert!(offset_of!(dp_api, process_group_shrink) == slot(146));
    assert!(offset_of!(dp_api, fsdp_save_sharded_state_dict_async) == slot(148));
    assert!(offset_of!(dp_api, ddp_rebind) == slot(149));
    assert!(size_of::<dp_api>() == slot(150));
    assert!(size_of::<dp_process_group_options>() == 48);
    assert!(offset_of!(dp_ddp_options, static_graph) == 96);
    assert!(offset_of!(dp_ddp_options, bucket_plan) == 120);
    assert!(size_of::<dp_ddp_options>() == 128);
    assert!(size_of::<dp_ddp_stats>() == 48);
    assert!(offset_of!(dp_fsdp_options, full_params_as_views) == 24);
    assert!(size_of::<dp_fsdp_options>() == 32);
    assert!(size_of::<dp_memory_stats>() == 32);
    assert!(size_of::<DLTensor>() == 48);
    assert!(size_of::<DLManagedTensor>() == 64);
    assert!(offset_of!(DLManagedTensorVersioned, flags) == 24);
    assert!(size_of::<DLManagedTensorVersioned>() == 80);
};
