/* C side of the Go binding: loads the library and calls through its
 * dp_get_api table. cgo cannot call through C function pointers, so every
 * entry point the binding uses has a one-line forwarder here. */
#ifndef DPARALLEL_DPGO_H
#define DPARALLEL_DPGO_H

#include <stddef.h>
#include <stdint.h>

#include "dparallel/dp_api.h"

/* dlopen(path), one dlsym("dp_get_api"), the table for `major`. On failure
 * returns NULL with the reason in err (the loader's messages are per thread,
 * so they are read here, in the same C call). */
const dp_api *dpgo_open(const char *path, uint32_t major, void **handle, char *err, size_t cap);
int dpgo_close(void *handle, char *err, size_t cap);

/* The forward callbacks: user_data carries a runtime/cgo.Handle. */
dp_status dpgo_parallel_apply(const dp_api *a, dp_module *const *replicas, dp_tensor *const *inputs,
                              const dp_device *devices, size_t n, uintptr_t call, dp_tensor **out);
dp_status dpgo_data_parallel(const dp_api *a, dp_module *module, dp_tensor *input, const dp_device *devices,
                             size_t ndevices, dp_device output_device, int32_t dim, uintptr_t call, dp_tensor **out);
dp_status dpgo_replica_set_apply(const dp_api *a, dp_replica_set *set, dp_tensor *input, int32_t dim,
                                 dp_device output_device, uintptr_t call, dp_tensor **out);

/* The DDP callbacks (comm hook, on_bucket_reduced): `call` is a
 * runtime/cgo.Handle; each is set only when its flag is non-zero. */
void dpgo_ddp_set_callbacks(dp_ddp_options *o, int hook, int bucket_reduced, uintptr_t call);
/* `release` is a cgo.Handle of the Go function to run once the memory is no
 * longer used, or 0 for none. */
dp_status dpgo_tensor_from_blob(const dp_api *a, dp_tensor **out, void *data, int32_t dtype, int32_t ndim,
                                const int64_t *shape, dp_device device, uintptr_t release);
dp_status dpgo_stream_launch_host_func(const dp_api *a, dp_device device, void *stream, uintptr_t call);

/* Plain forwarders: dpgo_NAME(a, ...) calls a->NAME(...). X is for entry
 * points that return a value, V for those that return nothing. */
#define DPGO_FORWARDERS(X, V)                                                                                          \
  X(const char *, status_string, (const dp_api *a, dp_status s), (s))                                                  \
  X(const char *, last_error, (const dp_api *a), ())                                                                   \
  X(uint32_t, version_number, (const dp_api *a), ())                                                                   \
  X(dp_status, device_parse, (const dp_api *a, const char *text, dp_device *out), (text, out))                         \
  X(dp_status, device_format, (const dp_api *a, dp_device d, char *buf, size_t cap), (d, buf, cap))                    \
  X(dp_status, tensor_create,                                                                                          \
    (const dp_api *a, dp_tensor **out, int32_t dtype, int32_t ndim, const int64_t *shape, dp_device d),                \
    (out, dtype, ndim, shape, d))                                                                                      \
  V(tensor_destroy, (const dp_api *a, dp_tensor *t), (t))                                                              \
  X(dp_status, tensor_copy_from_host, (const dp_api *a, dp_tensor *t, const void *src, size_t n), (t, src, n))         \
  X(dp_status, tensor_copy_to_host, (const dp_api *a, const dp_tensor *t, void *dst, size_t n), (t, dst, n))           \
  X(int32_t, tensor_dtype, (const dp_api *a, const dp_tensor *t), (t))                                                 \
  X(int32_t, tensor_ndim, (const dp_api *a, const dp_tensor *t), (t))                                                  \
  X(dp_status, tensor_shape, (const dp_api *a, const dp_tensor *t, int64_t *out, int32_t cap), (t, out, cap))          \
  X(int64_t, tensor_numel, (const dp_api *a, const dp_tensor *t), (t))                                                 \
  X(size_t, tensor_nbytes, (const dp_api *a, const dp_tensor *t), (t))                                                 \
  X(dp_device, tensor_device, (const dp_api *a, const dp_tensor *t), (t))                                              \
  X(void *, tensor_data, (const dp_api *a, const dp_tensor *t), (t))                                                   \
  X(dp_status, module_create, (const dp_api *a, dp_module **out), (out))                                               \
  V(module_destroy, (const dp_api *a, dp_module *m), (m))                                                              \
  X(dp_status, module_register_parameter, (const dp_api *a, dp_module *m, const char *name, dp_tensor *v, int rg),     \
    (m, name, v, rg))                                                                                                  \
  X(dp_status, module_register_module, (const dp_api *a, dp_module *m, const char *name, dp_module *c), (m, name, c))  \
  X(size_t, module_num_parameters, (const dp_api *a, const dp_module *m), (m))                                         \
  X(dp_status, module_parameter_at,                                                                                    \
    (const dp_api *a, const dp_module *m, size_t i, const char **name, dp_tensor **out), (m, i, name, out))            \
  X(dp_status, module_get_parameter, (const dp_api *a, const dp_module *m, const char *name, dp_tensor **out),         \
    (m, name, out))                                                                                                    \
  X(dp_status, module_grad, (const dp_api *a, dp_module *m, const char *name, dp_tensor **out), (m, name, out))        \
  X(dp_status, module_zero_grad, (const dp_api *a, dp_module *m), (m))                                                 \
  X(dp_status, module_save, (const dp_api *a, const dp_module *m, const char *path), (m, path))                        \
  X(dp_status, module_load, (const dp_api *a, dp_module *m, const char *path, int strict), (m, path, strict))          \
  X(dp_status, replicate,                                                                                              \
    (const dp_api *a, const dp_module *m, const dp_device *d, size_t n, int detach, dp_module **out),                  \
    (m, d, n, detach, out))                                                                                            \
  X(dp_status, reduce_gradients, (const dp_api *a, dp_module *const *r, size_t n, dp_module *target), (r, n, target))  \
  X(dp_status, replica_set_create,                                                                                     \
    (const dp_api *a, dp_replica_set **out, dp_module *m, const dp_device *d, size_t n), (out, m, d, n))               \
  X(dp_status, replica_set_sync, (const dp_api *a, dp_replica_set *s), (s))                                            \
  X(dp_status, replica_set_replica, (const dp_api *a, const dp_replica_set *s, size_t i, dp_module **out),             \
    (s, i, out))                                                                                                       \
  X(dp_status, replica_set_reduce_gradients, (const dp_api *a, dp_replica_set *s), (s))                                \
  X(size_t, replica_set_size, (const dp_api *a, const dp_replica_set *s), (s))                                         \
  V(replica_set_destroy, (const dp_api *a, dp_replica_set *s), (s))                                                    \
  X(dp_status, process_group_create_from_env,                                                                          \
    (const dp_api *a, dp_process_group **out, const dp_process_group_options *o), (out, o))                            \
  X(int32_t, process_group_rank, (const dp_api *a, const dp_process_group *pg), (pg))                                  \
  X(int32_t, process_group_size, (const dp_api *a, const dp_process_group *pg), (pg))                                  \
  X(const char *, process_group_backend, (const dp_api *a, const dp_process_group *pg), (pg))                          \
  V(process_group_destroy, (const dp_api *a, dp_process_group *pg), (pg))                                              \
  X(dp_status, pg_all_reduce, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t op), (pg, t, op))          \
  X(dp_status, pg_broadcast, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t root), (pg, t, root))       \
  X(dp_status, pg_barrier, (const dp_api *a, dp_process_group *pg), (pg))                                              \
  X(dp_status, ddp_options_init, (const dp_api *a, dp_ddp_options *o, size_t n), (o, n))                               \
  X(dp_status, ddp_create,                                                                                             \
    (const dp_api *a, dp_ddp **out, dp_module *m, dp_process_group *pg, const dp_ddp_options *o), (out, m, pg, o))     \
  X(dp_status, ddp_pre_forward, (const dp_api *a, dp_ddp *d), (d))                                                     \
  X(dp_status, ddp_mark_grad_ready, (const dp_api *a, dp_ddp *d, const char *name), (d, name))                         \
  X(dp_status, ddp_mark_grad_ready_index, (const dp_api *a, dp_ddp *d, size_t i), (d, i))                              \
  X(dp_status, ddp_finish_backward, (const dp_api *a, dp_ddp *d), (d))                                                 \
  X(size_t, ddp_num_buckets, (const dp_api *a, const dp_ddp *d), (d))                                                  \
  V(ddp_destroy, (const dp_api *a, dp_ddp *d), (d))                                                                    \
  X(dp_status, device_count, (const dp_api *a, int32_t type, int32_t *out), (type, out))                               \
  X(size_t, dtype_size, (const dp_api *a, int32_t dtype), (dtype))                                                     \
  X(dp_status, device_memory_stats, (const dp_api *a, dp_device d, dp_memory_stats *out), (d, out))                    \
  X(dp_status, device_reset_peak_memory, (const dp_api *a, dp_device d), (d))                                          \
  X(dp_status, shutdown, (const dp_api *a), ())                                                                        \
  X(dp_status, tensor_to_device, (const dp_api *a, dp_tensor **out, const dp_tensor *t, dp_device d), (out, t, d))     \
  X(dp_status, tensor_from_dlpack, (const dp_api *a, dp_tensor **out, void *managed), (out, managed))                  \
  X(dp_status, tensor_to_dlpack, (const dp_api *a, const dp_tensor *t, void **out),                                    \
    (t, (struct DLManagedTensor **)out))                                                                               \
  X(dp_status, broadcast, (const dp_api *a, const dp_tensor *t, const dp_device *d, size_t n, dp_tensor **out),        \
    (t, d, n, out))                                                                                                    \
  X(dp_status, broadcast_coalesced,                                                                                    \
    (const dp_api *a, const dp_tensor *const *t, size_t nt, const dp_device *d, size_t nd, size_t cap,                 \
     dp_tensor **out),                                                                                                 \
    (t, nt, d, nd, cap, out))                                                                                          \
  X(dp_status, reduce_add, (const dp_api *a, const dp_tensor *const *in, size_t n, dp_device d, dp_tensor **out),      \
    (in, n, d, out))                                                                                                   \
  X(dp_status, reduce_add_coalesced,                                                                                   \
    (const dp_api *a, const dp_tensor *const *in, size_t nd, size_t nt, dp_device d, size_t cap, dp_tensor **out),     \
    (in, nd, nt, d, cap, out))                                                                                         \
  X(dp_status, scatter,                                                                                                \
    (const dp_api *a, const dp_tensor *t, const dp_device *d, size_t n, const int64_t *chunks, int32_t dim,            \
     dp_tensor **out, size_t *count),                                                                                  \
    (t, d, n, chunks, dim, out, count))                                                                                \
  X(dp_status, gather,                                                                                                 \
    (const dp_api *a, const dp_tensor *const *t, size_t n, int32_t dim, dp_device d, dp_tensor **out),                 \
    (t, n, dim, d, out))                                                                                               \
  X(dp_status, module_register_buffer, (const dp_api *a, dp_module *m, const char *name, dp_tensor *v, int p),         \
    (m, name, v, p))                                                                                                   \
  X(size_t, module_num_buffers, (const dp_api *a, const dp_module *m), (m))                                            \
  X(dp_status, module_buffer_at, (const dp_api *a, const dp_module *m, size_t i, const char **name, dp_tensor **out),  \
    (m, i, name, out))                                                                                                 \
  X(dp_status, module_get_buffer, (const dp_api *a, const dp_module *m, const char *name, dp_tensor **out),            \
    (m, name, out))                                                                                                    \
  X(dp_status, module_get_module, (const dp_api *a, const dp_module *m, const char *name, dp_module **out),            \
    (m, name, out))                                                                                                    \
  X(dp_status, module_set_requires_grad, (const dp_api *a, dp_module *m, const char *name, int rg), (m, name, rg))     \
  X(dp_status, module_requires_grad, (const dp_api *a, const dp_module *m, const char *name, int *out),                \
    (m, name, out))                                                                                                    \
  X(dp_status, module_set_grad, (const dp_api *a, dp_module *m, const char *name, dp_tensor *g), (m, name, g))         \
  X(dp_status, store_create_file, (const dp_api *a, dp_store **out, const char *path, int32_t world),                  \
    (out, path, world))                                                                                                \
  X(dp_status, store_create_tcp,                                                                                       \
    (const dp_api *a, dp_store **out, const char *host, uint16_t port, int32_t world, int server, int32_t ms),         \
    (out, host, port, world, server, ms))                                                                              \
  X(dp_status, store_set, (const dp_api *a, dp_store *s, const char *key, const void *v, size_t n), (s, key, v, n))    \
  X(dp_status, store_get, (const dp_api *a, dp_store *s, const char *key, void *buf, size_t cap, size_t *n),           \
    (s, key, buf, cap, n))                                                                                             \
  X(dp_status, store_add, (const dp_api *a, dp_store *s, const char *key, int64_t delta, int64_t *out),                \
    (s, key, delta, out))                                                                                              \
  X(dp_status, store_wait, (const dp_api *a, dp_store *s, const char *const *keys, size_t n, int32_t ms),              \
    (s, keys, n, ms))                                                                                                  \
  X(dp_status, store_tcp_port, (const dp_api *a, const dp_store *s, uint16_t *out), (s, out))                          \
  X(dp_status, store_set_timeout, (const dp_api *a, dp_store *s, int32_t ms), (s, ms))                                 \
  V(store_destroy, (const dp_api *a, dp_store *s), (s))                                                                \
  X(dp_status, process_group_options_init, (const dp_api *a, dp_process_group_options *o, size_t n), (o, n))           \
  X(dp_status, process_group_create, (const dp_api *a, dp_process_group **out, const dp_process_group_options *o),     \
    (out, o))                                                                                                          \
  X(dp_status, pg_all_reduce_async, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t op, dp_work **out),  \
    (pg, t, op, out))                                                                                                  \
  X(dp_status, pg_broadcast_async, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t root, dp_work **out), \
    (pg, t, root, out))                                                                                                \
  X(dp_status, pg_all_gather,                                                                                          \
    (const dp_api *a, dp_process_group *pg, const dp_tensor *in, dp_tensor *const *o, size_t n), (pg, in, o, n))       \
  X(dp_status, pg_all_gather_async,                                                                                    \
    (const dp_api *a, dp_process_group *pg, const dp_tensor *in, dp_tensor *const *o, size_t n, dp_work **out),        \
    (pg, in, o, n, out))                                                                                               \
  X(dp_status, pg_reduce_scatter,                                                                                      \
    (const dp_api *a, dp_process_group *pg, const dp_tensor *const *in, size_t n, dp_tensor *o, int32_t op),           \
    (pg, in, n, o, op))                                                                                                \
  X(dp_status, pg_reduce_scatter_async,                                                                                \
    (const dp_api *a, dp_process_group *pg, const dp_tensor *const *in, size_t n, dp_tensor *o, int32_t op,            \
     dp_work **out),                                                                                                   \
    (pg, in, n, o, op, out))                                                                                           \
  X(dp_status, pg_barrier_async, (const dp_api *a, dp_process_group *pg, dp_work **out), (pg, out))                    \
  X(dp_status, work_wait, (const dp_api *a, dp_work *w), (w))                                                          \
  X(dp_status, work_test, (const dp_api *a, dp_work *w, int *done), (w, done))                                         \
  V(work_destroy, (const dp_api *a, dp_work *w), (w))                                                                  \
  X(dp_status, ddp_set_requires_gradient_sync, (const dp_api *a, dp_ddp *d, int sync), (d, sync))                      \
  X(dp_status, ddp_bucket_parameters,                                                                                  \
    (const dp_api *a, const dp_ddp *d, size_t b, size_t *idx, size_t cap, size_t *count), (d, b, idx, cap, count))     \
  X(dp_status, ddp_mark_grad_ready_stream, (const dp_api *a, dp_ddp *d, size_t i, void *stream), (d, i, stream))       \
  X(dp_status, ddp_last_stats, (const dp_api *a, const dp_ddp *d, dp_ddp_stats *out), (d, out))                        \
  X(dp_status, ddp_parameter_used, (const dp_api *a, const dp_ddp *d, size_t i, int *out), (d, i, out))                \
  X(dp_status, ddp_bucket_plan, (const dp_api *a, const dp_ddp *d, char *buf, size_t cap, size_t *n),                  \
    (d, buf, cap, n))                                                                                                  \
  X(dp_status, ddp_join, (const dp_api *a, dp_ddp *const *d, size_t n), (d, n))                                        \
  X(dp_status, set_current_stream, (const dp_api *a, dp_device d, void *s), (d, s))                                    \
  X(dp_status, get_current_stream, (const dp_api *a, dp_device d, void **out), (d, out))                               \
  X(dp_status, stream_create, (const dp_api *a, dp_device d, void **out), (d, out))                                    \
  X(dp_status, stream_destroy, (const dp_api *a, dp_device d, void *s), (d, s))                                        \
  X(dp_status, stream_synchronize, (const dp_api *a, dp_device d, void *s), (d, s))                                    \
  X(dp_status, fsdp_options_init, (const dp_api *a, dp_fsdp_options *o, size_t n), (o, n))                             \
  X(dp_status, fsdp_create,                                                                                            \
    (const dp_api *a, dp_fsdp **out, dp_module *m, dp_process_group *pg, const dp_fsdp_options *o), (out, m, pg, o))   \
  X(dp_status, fsdp_unshard, (const dp_api *a, dp_fsdp *f, int async), (f, async))                                     \
  X(dp_status, fsdp_wait_unshard, (const dp_api *a, dp_fsdp *f), (f))                                                  \
  X(dp_status, fsdp_reshard, (const dp_api *a, dp_fsdp *f), (f))                                                       \
  X(dp_status, fsdp_post_backward, (const dp_api *a, dp_fsdp *f), (f))                                                 \
  X(dp_status, fsdp_finish_backward, (const dp_api *a, dp_fsdp *f), (f))                                               \
  X(dp_status, fsdp_set_requires_gradient_sync, (const dp_api *a, dp_fsdp *f, int sync), (f, sync))                    \
  X(size_t, fsdp_num_parameters, (const dp_api *a, const dp_fsdp *f), (f))                                             \
  X(dp_status, fsdp_parameter_name, (const dp_api *a, const dp_fsdp *f, size_t i, const char **out), (f, i, out))      \
  X(dp_status, fsdp_shard, (const dp_api *a, const dp_fsdp *f, size_t i, dp_tensor **out), (f, i, out))                \
  X(dp_status, fsdp_shard_grad, (const dp_api *a, const dp_fsdp *f, size_t i, dp_tensor **out), (f, i, out))           \
  V(fsdp_destroy, (const dp_api *a, dp_fsdp *f), (f))                                                                  \
  X(dp_status, fsdp_save_full_state_dict, (const dp_api *a, dp_module *m, dp_process_group *pg, const char *path),     \
    (m, pg, path))                                                                                                     \
  X(dp_status, fsdp_load_full_state_dict, (const dp_api *a, dp_module *m, const char *path, int strict),               \
    (m, path, strict))                                                                                                 \
  X(dp_status, fsdp_save_sharded_state_dict, (const dp_api *a, dp_module *m, dp_process_group *pg, const char *dir),   \
    (m, pg, dir))                                                                                                      \
  X(dp_status, fsdp_load_sharded_state_dict, (const dp_api *a, dp_module *m, const char *dir), (m, dir))               \
  X(dp_status, process_group_split,                                                                                    \
    (const dp_api *a, dp_process_group *pg, int32_t color, int32_t key, const dp_process_group_options *o,             \
     dp_process_group **out),                                                                                          \
    (pg, color, key, o, out))                                                                                          \
  X(int32_t, process_group_local_rank, (const dp_api *a, const dp_process_group *pg), (pg))                            \
  X(int32_t, process_group_local_size, (const dp_api *a, const dp_process_group *pg), (pg))                            \
  X(int32_t, process_group_num_hosts, (const dp_api *a, const dp_process_group *pg), (pg))                             \
  X(dp_status, device_mesh_create,                                                                                     \
    (const dp_api *a, dp_device_mesh **out, dp_process_group *pg, const int32_t *shape, size_t ndim,                   \
     const char *const *names),                                                                                        \
    (out, pg, shape, ndim, names))                                                                                     \
  X(dp_status, device_mesh_create_by_host, (const dp_api *a, dp_device_mesh **out, dp_process_group *pg), (out, pg))   \
  X(size_t, device_mesh_ndim, (const dp_api *a, const dp_device_mesh *m), (m))                                         \
  X(dp_status, device_mesh_group,                                                                                      \
    (const dp_api *a, const dp_device_mesh *m, const char *name, dp_process_group **out), (m, name, out))              \
  V(device_mesh_destroy, (const dp_api *a, dp_device_mesh *m), (m))                                                    \
  X(dp_status, device_mesh_shape, (const dp_api *a, const dp_device_mesh *m, int32_t *out, size_t cap), (m, out, cap)) \
  X(dp_status, device_mesh_coordinate, (const dp_api *a, const dp_device_mesh *m, int32_t *out, size_t cap),           \
    (m, out, cap))                                                                                                     \
  X(dp_status, device_mesh_dim_name, (const dp_api *a, const dp_device_mesh *m, size_t d, const char **out),           \
    (m, d, out))                                                                                                       \
  X(dp_status, fsdp_mark_grad_ready, (const dp_api *a, dp_fsdp *f, const char *name), (f, name))                       \
  X(dp_status, fsdp_full_state_dict,                                                                                   \
    (const dp_api *a, dp_module *m, dp_process_group *pg, int32_t root, dp_module **out), (m, pg, root, out))          \
  X(dp_status, tensor_from_dlpack_versioned, (const dp_api *a, dp_tensor **out, void *managed), (out, managed))        \
  X(dp_status, tensor_to_dlpack_versioned, (const dp_api *a, const dp_tensor *t, int read_only, void **out),           \
    (t, read_only, (struct DLManagedTensorVersioned **)out))                                                           \
  X(dp_status, fsdp_create_on_mesh,                                                                                    \
    (const dp_api *a, dp_fsdp **out, dp_module *m, const dp_device_mesh *mesh, const dp_fsdp_options *o),              \
    (out, m, mesh, o))                                                                                                 \
  X(dp_status, process_group_abort, (const dp_api *a, dp_process_group *pg), (pg))                                     \
  X(dp_status, process_group_shrink, (const dp_api *a, dp_process_group *pg, dp_process_group **out), (pg, out))       \
  X(int32_t, process_group_lost_ranks, (const dp_api *a, const dp_process_group *pg, int32_t *ranks, size_t cap),      \
    (pg, ranks, cap))                                                                                                  \
  X(dp_status, fsdp_save_sharded_state_dict_async,                                                                     \
    (const dp_api *a, dp_module *m, dp_process_group *pg, const char *dir, dp_work **out), (m, pg, dir, out))          \
  X(dp_status, ddp_rebind, (const dp_api *a, dp_ddp *d, dp_process_group *pg), (d, pg))

#define DPGO_DECLARE(ret, name, params, args) ret dpgo_##name params;
#define DPGO_DECLARE_VOID(name, params, args) void dpgo_##name params;
DPGO_FORWARDERS(DPGO_DECLARE, DPGO_DECLARE_VOID)

#endif
