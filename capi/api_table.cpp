// dp_api.h: the function table for dlopen hosts.
#include <cstddef>

#include "dparallel/dp_api.h"

namespace {

// Frozen offsets: moving a field breaks every host built against the table.
constexpr size_t kFirstSlot = 16;
constexpr size_t slot(size_t index) { return kFirstSlot + index * sizeof(void*); }
static_assert(offsetof(dp_api, status_string) == slot(0), "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_create) == slot(7), "dp_api layout changed");
static_assert(offsetof(dp_api, broadcast) == slot(21), "dp_api layout changed");
static_assert(offsetof(dp_api, module_create) == slot(27), "dp_api layout changed");
static_assert(offsetof(dp_api, replicate) == slot(43), "dp_api layout changed");
static_assert(offsetof(dp_api, parallel_apply) == slot(50), "dp_api layout changed");
static_assert(offsetof(dp_api, store_create_file) == slot(53), "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_to_device) == slot(75), "dp_api layout changed");
static_assert(offsetof(dp_api, process_group_backend) == slot(85), "dp_api layout changed");
static_assert(offsetof(dp_api, ddp_options_init) == slot(86), "dp_api layout changed");
static_assert(sizeof(dp_api) == slot(98), "dp_api layout changed");

const dp_api kApi = {
    sizeof(dp_api),
    DP_VERSION_MAJOR,
    DP_API_MINOR,
    dp_status_string,
    dp_last_error,
    dp_version_number,
    dp_device_count,
    dp_device_parse,
    dp_device_format,
    dp_dtype_size,
    dp_tensor_create,
    dp_tensor_from_blob,
    dp_tensor_destroy,
    dp_tensor_copy_from_host,
    dp_tensor_copy_to_host,
    dp_tensor_dtype,
    dp_tensor_ndim,
    dp_tensor_shape,
    dp_tensor_numel,
    dp_tensor_nbytes,
    dp_tensor_device,
    dp_tensor_data,
    dp_tensor_from_dlpack,
    dp_tensor_to_dlpack,
    dp_broadcast,
    dp_broadcast_coalesced,
    dp_reduce_add,
    dp_reduce_add_coalesced,
    dp_scatter,
    dp_gather,
    dp_module_create,
    dp_module_destroy,
    dp_module_register_parameter,
    dp_module_register_buffer,
    dp_module_register_module,
    dp_module_num_parameters,
    dp_module_num_buffers,
    dp_module_parameter_at,
    dp_module_buffer_at,
    dp_module_get_parameter,
    dp_module_get_buffer,
    dp_module_get_module,
    dp_module_grad,
    dp_module_zero_grad,
    dp_module_save,
    dp_module_load,
    dp_replicate,
    dp_reduce_gradients,
    dp_replica_set_create,
    dp_replica_set_sync,
    dp_replica_set_replica,
    dp_replica_set_reduce_gradients,
    dp_replica_set_destroy,
    dp_parallel_apply,
    dp_data_parallel,
    dp_replica_set_apply,
    dp_store_create_file,
    dp_store_create_tcp,
    dp_store_set,
    dp_store_get,
    dp_store_add,
    dp_store_wait,
    dp_store_destroy,
    dp_process_group_options_init,
    dp_process_group_create,
    dp_process_group_create_from_env,
    dp_process_group_rank,
    dp_process_group_size,
    dp_process_group_destroy,
    dp_pg_all_reduce,
    dp_pg_all_reduce_async,
    dp_pg_broadcast,
    dp_pg_all_gather,
    dp_pg_reduce_scatter,
    dp_pg_barrier,
    dp_work_wait,
    dp_work_test,
    dp_work_destroy,
    dp_tensor_to_device,
    dp_module_set_requires_grad,
    dp_module_requires_grad,
    dp_replica_set_size,
    dp_store_tcp_port,
    dp_store_set_timeout,
    dp_pg_broadcast_async,
    dp_pg_all_gather_async,
    dp_pg_reduce_scatter_async,
    dp_pg_barrier_async,
    dp_process_group_backend,
    dp_ddp_options_init,
    dp_ddp_create,
    dp_ddp_pre_forward,
    dp_ddp_mark_grad_ready,
    dp_ddp_mark_grad_ready_index,
    dp_ddp_finish_backward,
    dp_ddp_set_requires_gradient_sync,
    dp_ddp_num_buckets,
    dp_ddp_bucket_parameters,
    dp_ddp_destroy,
    dp_ddp_mark_grad_ready_stream,
    dp_ddp_last_stats,
};

}  // namespace

extern "C" const dp_api* dp_get_api(uint32_t abi_major) { return abi_major == DP_VERSION_MAJOR ? &kApi : nullptr; }
