/* dparallel — one table of every entry point, for hosts that dlopen the
 * library: one dlsym("dp_get_api") instead of one per function.
 *
 * The table is append-only within an ABI major: fields are never moved or
 * removed, new entry points are added at the end and raise abi_minor. The
 * first table (abi_minor 1) lists the entry points of the base contract in
 * its order, then the additions. A host
 * compiled against an older header reads only the prefix it knows;
 * struct_size says how much of the table this library fills. The one
 * exception: abi_minor 3 gave process_group_options_init and
 * ddp_options_init (same slots) the caller's struct_size as a second
 * parameter, so a host built against an older header must not call those
 * two through a newer table.
 *
 * Thread safety: dp_get_api may be called from any thread; the table is
 * static and never changes.
 */
#ifndef DPARALLEL_DP_API_H
#define DPARALLEL_DP_API_H

#include "dparallel/dp_base.h"
#include "dparallel/dp_comm.h"
#include "dparallel/dp_ddp.h"
#include "dparallel/dp_dist.h"
#include "dparallel/dp_dlpack.h"
#include "dparallel/dp_fsdp.h"
#include "dparallel/dp_module.h"
#include "dparallel/dp_parallel.h"
#include "dparallel/dp_replicate.h"
#include "dparallel/dp_stream.h"
#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* abi_minor of the table this header describes. */
#define DP_API_MINOR 11

/* Every slot of the table, in table order: X(return type, name, (parameters))
 * for the entry point dp_<name>. The struct below and the library's table are
 * both expanded from this list, so they cannot disagree. Append only. */
/* clang-format off */
#define DP_API_SLOTS(X)                                                                                                \
  /* ---- abi_minor 1 ---- */                                                                                          \
  /* base */                                                                                                           \
  X(const char *, status_string, (dp_status status))                                                                   \
  X(const char *, last_error, (void))                                                                                  \
  X(uint32_t, version_number, (void))                                                                                  \
  X(dp_status, device_count, (int32_t type, int32_t *out))                                                             \
  X(dp_status, device_parse, (const char *text, dp_device *out))                                                       \
  X(dp_status, device_format, (dp_device device, char *buf, size_t cap))                                               \
  X(size_t, dtype_size, (int32_t dtype))                                                                               \
  /* tensor */                                                                                                         \
  X(dp_status, tensor_create, (dp_tensor **out, int32_t dtype, int32_t ndim, const int64_t *shape, dp_device device))  \
  X(dp_status, tensor_from_blob,                                                                                       \
    (dp_tensor **out, void *data, int32_t dtype, int32_t ndim, const int64_t *shape, dp_device device,                 \
     void (*deleter)(void *ctx), void *ctx))                                                                           \
  X(void, tensor_destroy, (dp_tensor *tensor))                                                                         \
  X(dp_status, tensor_copy_from_host, (dp_tensor *tensor, const void *src, size_t nbytes))                             \
  X(dp_status, tensor_copy_to_host, (const dp_tensor *tensor, void *dst, size_t nbytes))                               \
  X(int32_t, tensor_dtype, (const dp_tensor *tensor))                                                                  \
  X(int32_t, tensor_ndim, (const dp_tensor *tensor))                                                                   \
  X(dp_status, tensor_shape, (const dp_tensor *tensor, int64_t *out, int32_t cap))                                     \
  X(int64_t, tensor_numel, (const dp_tensor *tensor))                                                                  \
  X(size_t, tensor_nbytes, (const dp_tensor *tensor))                                                                  \
  X(dp_device, tensor_device, (const dp_tensor *tensor))                                                               \
  X(void *, tensor_data, (const dp_tensor *tensor))                                                                    \
  X(dp_status, tensor_from_dlpack, (dp_tensor **out, struct DLManagedTensor *managed))                                 \
  X(dp_status, tensor_to_dlpack, (const dp_tensor *tensor, struct DLManagedTensor **out))                              \
  /* in-process collectives */                                                                                         \
  X(dp_status, broadcast, (const dp_tensor *tensor, const dp_device *devices, size_t ndevices, dp_tensor **out))       \
  X(dp_status, broadcast_coalesced,                                                                                    \
    (const dp_tensor *const *tensors, size_t ntensors, const dp_device *devices, size_t ndevices,                      \
     size_t buffer_size, dp_tensor **out))                                                                             \
  X(dp_status, reduce_add, (const dp_tensor *const *inputs, size_t ninputs, dp_device destination, dp_tensor **out))   \
  X(dp_status, reduce_add_coalesced,                                                                                   \
    (const dp_tensor *const *inputs, size_t ndevices, size_t ntensors, dp_device destination, size_t buffer_size,      \
     dp_tensor **out))                                                                                                 \
  X(dp_status, scatter,                                                                                                \
    (const dp_tensor *tensor, const dp_device *devices, size_t ndevices, const int64_t *chunk_sizes, int32_t dim,      \
     dp_tensor **out, size_t *out_count))                                                                              \
  X(dp_status, gather,                                                                                                 \
    (const dp_tensor *const *tensors, size_t ntensors, int32_t dim, dp_device destination, dp_tensor **out))           \
  /* modules */                                                                                                        \
  X(dp_status, module_create, (dp_module **out))                                                                       \
  X(void, module_destroy, (dp_module *module))                                                                         \
  X(dp_status, module_register_parameter, (dp_module *module, const char *name, dp_tensor *value, int requires_grad))  \
  X(dp_status, module_register_buffer, (dp_module *module, const char *name, dp_tensor *value, int persistent))        \
  X(dp_status, module_register_module, (dp_module *module, const char *name, dp_module *child))                        \
  X(size_t, module_num_parameters, (const dp_module *module))                                                          \
  X(size_t, module_num_buffers, (const dp_module *module))                                                             \
  X(dp_status, module_parameter_at, (const dp_module *module, size_t index, const char **name_out, dp_tensor **out))   \
  X(dp_status, module_buffer_at, (const dp_module *module, size_t index, const char **name_out, dp_tensor **out))      \
  X(dp_status, module_get_parameter, (const dp_module *module, const char *dotted_name, dp_tensor **out))              \
  X(dp_status, module_get_buffer, (const dp_module *module, const char *dotted_name, dp_tensor **out))                 \
  X(dp_status, module_get_module, (const dp_module *module, const char *dotted_name, dp_module **out))                 \
  X(dp_status, module_grad, (dp_module *module, const char *dotted_name, dp_tensor **out))                             \
  X(dp_status, module_zero_grad, (dp_module *module))                                                                  \
  X(dp_status, module_save, (const dp_module *module, const char *path))                                               \
  X(dp_status, module_load, (dp_module *module, const char *path, int strict))                                         \
  /* replication */                                                                                                    \
  X(dp_status, replicate,                                                                                              \
    (const dp_module *module, const dp_device *devices, size_t ndevices, int detach, dp_module **out))                 \
  X(dp_status, reduce_gradients, (dp_module *const *replicas, size_t nreplicas, dp_module *target))                    \
  X(dp_status, replica_set_create,                                                                                     \
    (dp_replica_set **out, dp_module *module, const dp_device *devices, size_t ndevices))                              \
  X(dp_status, replica_set_sync, (dp_replica_set *set))                                                                \
  X(dp_status, replica_set_replica, (const dp_replica_set *set, size_t index, dp_module **out))                        \
  X(dp_status, replica_set_reduce_gradients, (dp_replica_set *set))                                                    \
  X(void, replica_set_destroy, (dp_replica_set *set))                                                                  \
  /* parallel */                                                                                                       \
  X(dp_status, parallel_apply,                                                                                         \
    (dp_module *const *replicas, dp_tensor *const *inputs, const dp_device *devices, size_t n, dp_forward_fn fn,       \
     void *user_data, dp_tensor **out))                                                                                \
  X(dp_status, data_parallel,                                                                                          \
    (dp_module *module, dp_tensor *input, const dp_device *devices, size_t ndevices, dp_device output_device,          \
     int32_t dim, dp_forward_fn fn, void *user_data, dp_tensor **out))                                                 \
  X(dp_status, replica_set_apply,                                                                                      \
    (dp_replica_set *set, dp_tensor *input, int32_t dim, dp_device output_device, dp_forward_fn fn, void *user_data,   \
     dp_tensor **out))                                                                                                 \
  /* distributed */                                                                                                    \
  X(dp_status, store_create_file, (dp_store **out, const char *path, int32_t world_size))                              \
  X(dp_status, store_create_tcp,                                                                                       \
    (dp_store **out, const char *host, uint16_t port, int32_t world_size, int is_server, int32_t timeout_ms))          \
  X(dp_status, store_set, (dp_store *store, const char *key, const void *value, size_t len))                           \
  X(dp_status, store_get, (dp_store *store, const char *key, void *buf, size_t cap, size_t *len_out))                  \
  X(dp_status, store_add, (dp_store *store, const char *key, int64_t delta, int64_t *out))                             \
  X(dp_status, store_wait, (dp_store *store, const char *const *keys, size_t nkeys, int32_t timeout_ms))               \
  X(void, store_destroy, (dp_store *store))                                                                            \
  X(dp_status, process_group_options_init, (dp_process_group_options *opts, size_t struct_size))                       \
  X(dp_status, process_group_create, (dp_process_group **out, const dp_process_group_options *opts))                   \
  X(dp_status, process_group_create_from_env, (dp_process_group **out, const dp_process_group_options *opts))          \
  X(int32_t, process_group_rank, (const dp_process_group *pg))                                                         \
  X(int32_t, process_group_size, (const dp_process_group *pg))                                                         \
  X(void, process_group_destroy, (dp_process_group *pg))                                                               \
  X(dp_status, pg_all_reduce, (dp_process_group *pg, dp_tensor *tensor, int32_t op))                                   \
  X(dp_status, pg_all_reduce_async, (dp_process_group *pg, dp_tensor *tensor, int32_t op, dp_work **out))              \
  X(dp_status, pg_broadcast, (dp_process_group *pg, dp_tensor *tensor, int32_t root))                                  \
  X(dp_status, pg_all_gather,                                                                                          \
    (dp_process_group *pg, const dp_tensor *input, dp_tensor *const *outputs, size_t noutputs))                        \
  X(dp_status, pg_reduce_scatter,                                                                                      \
    (dp_process_group *pg, const dp_tensor *const *inputs, size_t ninputs, dp_tensor *output, int32_t op))             \
  X(dp_status, pg_barrier, (dp_process_group *pg))                                                                     \
  X(dp_status, work_wait, (dp_work *work))                                                                             \
  X(dp_status, work_test, (dp_work *work, int *done))                                                                  \
  X(void, work_destroy, (dp_work *work))                                                                               \
  /* additions beyond the base contract */                                                                             \
  X(dp_status, tensor_to_device, (dp_tensor **out, const dp_tensor *tensor, dp_device device))                         \
  X(dp_status, module_set_requires_grad, (dp_module *module, const char *dotted_name, int requires_grad))              \
  X(dp_status, module_requires_grad, (const dp_module *module, const char *dotted_name, int *out))                     \
  X(size_t, replica_set_size, (const dp_replica_set *set))                                                             \
  X(dp_status, store_tcp_port, (const dp_store *store, uint16_t *out))                                                 \
  X(dp_status, store_set_timeout, (dp_store *store, int32_t timeout_ms))                                               \
  X(dp_status, pg_broadcast_async, (dp_process_group *pg, dp_tensor *tensor, int32_t root, dp_work **out))             \
  X(dp_status, pg_all_gather_async,                                                                                    \
    (dp_process_group *pg, const dp_tensor *input, dp_tensor *const *outputs, size_t noutputs, dp_work **out))         \
  X(dp_status, pg_reduce_scatter_async,                                                                                \
    (dp_process_group *pg, const dp_tensor *const *inputs, size_t ninputs, dp_tensor *output, int32_t op,              \
     dp_work **out))                                                                                                   \
  X(dp_status, pg_barrier_async, (dp_process_group *pg, dp_work **out))                                                \
  X(const char *, process_group_backend, (const dp_process_group *pg))                                                 \
  /* the DDP reducer (dp_ddp.h) */                                                                                     \
  X(dp_status, ddp_options_init, (dp_ddp_options *opts, size_t struct_size))                                           \
  X(dp_status, ddp_create, (dp_ddp **out, dp_module *module, dp_process_group *pg, const dp_ddp_options *opts))        \
  X(dp_status, ddp_pre_forward, (dp_ddp *ddp))                                                                         \
  X(dp_status, ddp_mark_grad_ready, (dp_ddp *ddp, const char *param_name))                                             \
  X(dp_status, ddp_mark_grad_ready_index, (dp_ddp *ddp, size_t param_index))                                           \
  X(dp_status, ddp_finish_backward, (dp_ddp *ddp))                                                                     \
  X(dp_status, ddp_set_requires_gradient_sync, (dp_ddp *ddp, int requires_sync))                                       \
  X(size_t, ddp_num_buckets, (const dp_ddp *ddp))                                                                      \
  X(dp_status, ddp_bucket_parameters, (const dp_ddp *ddp, size_t bucket, size_t *indices, size_t cap, size_t *count))  \
  X(void, ddp_destroy, (dp_ddp *ddp))                                                                                  \
  X(dp_status, ddp_mark_grad_ready_stream, (dp_ddp *ddp, size_t param_index, void *cuda_stream))                       \
  X(dp_status, ddp_last_stats, (const dp_ddp *ddp, dp_ddp_stats *out))                                                   \
  X(dp_status, module_set_grad, (dp_module * module, const char *dotted_name, dp_tensor *grad))                       \
  /* ---- abi_minor 5: streams (dp_stream.h) ---- */                                                                   \
  X(dp_status, set_current_stream, (dp_device device, void *stream))                                                   \
  X(dp_status, get_current_stream, (dp_device device, void **out))                                                     \
  X(dp_status, stream_create, (dp_device device, void **out))                                                          \
  X(dp_status, stream_destroy, (dp_device device, void *stream))                                                       \
  X(dp_status, stream_synchronize, (dp_device device, void *stream))                                                   \
  X(dp_status, stream_launch_host_func, (dp_device device, void *stream, void (*fn)(void *user_data), void *user_data)) \
  /* ---- abi_minor 6: DDP beyond PyTorch's (dp_ddp.h; options fields appended too) ---- */                         \
  X(dp_status, ddp_parameter_used, (const dp_ddp *ddp, size_t param_index, int *out))                                   \
  X(dp_status, ddp_bucket_plan, (const dp_ddp *ddp, char *buf, size_t cap, size_t *len))                               \
  X(dp_status, ddp_join, (dp_ddp *const *ddps, size_t n))                                                               \
  /* ---- abi_minor 7: fully_shard (dp_fsdp.h), device memory ---- */                                                                  \
  X(dp_status, fsdp_options_init, (dp_fsdp_options *opts, size_t struct_size))                                          \
  X(dp_status, fsdp_create, (dp_fsdp **out, dp_module *module, dp_process_group *pg, const dp_fsdp_options *opts))      \
  X(dp_status, fsdp_unshard, (dp_fsdp *fsdp, int async))                                                                \
  X(dp_status, fsdp_wait_unshard, (dp_fsdp *fsdp))                                                                      \
  X(dp_status, fsdp_reshard, (dp_fsdp *fsdp))                                                                           \
  X(dp_status, fsdp_post_backward, (dp_fsdp *fsdp))                                                                     \
  X(dp_status, fsdp_finish_backward, (dp_fsdp *fsdp))                                                                   \
  X(dp_status, fsdp_set_requires_gradient_sync, (dp_fsdp *fsdp, int requires_sync))                                     \
  X(size_t, fsdp_num_parameters, (const dp_fsdp *fsdp))                                                                 \
  X(dp_status, fsdp_parameter_name, (const dp_fsdp *fsdp, size_t index, const char **out))                              \
  X(dp_status, fsdp_shard, (const dp_fsdp *fsdp, size_t index, dp_tensor **out))                                        \
  X(dp_status, fsdp_shard_grad, (const dp_fsdp *fsdp, size_t index, dp_tensor **out))                                   \
  X(void, fsdp_destroy, (dp_fsdp *fsdp))                                                                                \
  X(dp_status, fsdp_save_full_state_dict, (dp_module *module, dp_process_group *pg, const char *path))                  \
  X(dp_status, fsdp_load_full_state_dict, (dp_module *module, const char *path, int strict))                            \
  X(dp_status, fsdp_save_sharded_state_dict, (dp_module *module, dp_process_group *pg, const char *folder))             \
  X(dp_status, fsdp_load_sharded_state_dict, (dp_module *module, const char *folder))                                   \
  /* device memory (dp_base.h) */                                                                                       \
  X(dp_status, device_memory_stats, (dp_device device, dp_memory_stats *out))                                           \
  X(dp_status, device_reset_peak_memory, (dp_device device))                                                          \
  /* ---- abi_minor 8: the library's own threads (dp_base.h) ---- */                                                   \
  X(dp_status, shutdown, (void))                                                                                        \
  /* ---- abi_minor 9: subgroups and device meshes (dp_dist.h) ---- */                                                 \
  X(dp_status, process_group_split,                                                                                    \
    (dp_process_group * pg, int32_t color, int32_t key, const dp_process_group_options *opts, dp_process_group **out)) \
  X(int32_t, process_group_local_rank, (const dp_process_group *pg))                                                   \
  X(int32_t, process_group_local_size, (const dp_process_group *pg))                                                   \
  X(int32_t, process_group_num_hosts, (const dp_process_group *pg))                                                    \
  X(dp_status, device_mesh_create,                                                                                     \
    (dp_device_mesh **out, dp_process_group *pg, const int32_t *shape, size_t ndim, const char *const *dim_names))     \
  X(dp_status, device_mesh_create_by_host, (dp_device_mesh **out, dp_process_group *pg))                              \
  X(size_t, device_mesh_ndim, (const dp_device_mesh *mesh))                                                            \
  X(dp_status, device_mesh_group, (const dp_device_mesh *mesh, const char *dim_name, dp_process_group **out))          \
  X(void, device_mesh_destroy, (dp_device_mesh *mesh))                                                                 \
  X(dp_status, device_mesh_shape, (const dp_device_mesh *mesh, int32_t *out, size_t cap))                              \
  X(dp_status, device_mesh_coordinate, (const dp_device_mesh *mesh, int32_t *out, size_t cap))                         \
  X(dp_status, device_mesh_dim_name, (const dp_device_mesh *mesh, size_t dim, const char **out))                       \
  /* ---- also abi_minor 9: hosts with their own autograd (dp_fsdp.h), DLPack 1.x (dp_dlpack.h) ---- */                \
  X(dp_status, fsdp_mark_grad_ready, (dp_fsdp *fsdp, const char *name))                                                \
  X(dp_status, tensor_to_dlpack_versioned,                                                                             \
    (const dp_tensor *tensor, int read_only, struct DLManagedTensorVersioned **out))                                   \
  X(dp_status, tensor_from_dlpack_versioned, (dp_tensor **out, struct DLManagedTensorVersioned *managed))              \
  X(dp_status, fsdp_full_state_dict, (dp_module *module, dp_process_group *pg, int32_t root, dp_module **out))          \
  X(dp_status, fsdp_create_on_mesh,                                                                                    \
    (dp_fsdp **out, dp_module *module, const dp_device_mesh *mesh, const dp_fsdp_options *opts))                       \
  /* ---- abi_minor 10: elastic and fault tolerant (dp_dist.h) ---- */                                                 \
  X(dp_status, process_group_abort, (dp_process_group *pg))                                                            \
  /* ---- abi_minor 11: shrink (dp_dist.h), checkpoints in the background (dp_fsdp.h) ---- */                          \
  X(dp_status, process_group_shrink, (dp_process_group *pg, dp_process_group **out))                                   \
  X(int32_t, process_group_lost_ranks, (const dp_process_group *pg, int32_t *ranks, size_t cap))                       \
  X(dp_status, fsdp_save_sharded_state_dict_async,                                                                     \
    (dp_module *module, dp_process_group *pg, const char *folder, dp_work **out))                                      \
  X(dp_status, ddp_rebind, (dp_ddp *ddp, dp_process_group *pg))
/* clang-format on */

/* A type, a name and a parameter list cannot be parenthesised. */
/* NOLINTNEXTLINE(bugprone-macro-parentheses) */
#define DP_API_SLOT_FIELD_(ret, name, params) ret(*name) params;
typedef struct dp_api {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  DP_API_SLOTS(DP_API_SLOT_FIELD_)
} dp_api;
#undef DP_API_SLOT_FIELD_

/* The table for `abi_major` (DP_VERSION_MAJOR), or NULL for a major this
 * library does not provide. */
DP_API const dp_api *dp_get_api(uint32_t abi_major);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_API_H */
