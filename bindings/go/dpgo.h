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

/* Plain forwarders: dpgo_NAME(a, ...) calls a->NAME(...). X is for entry
 * points that return a value, V for those that return nothing. */
#define DPGO_FORWARDERS(X, V)                                                                                         \
  X(const char *, status_string, (const dp_api *a, dp_status s), (s))                                                 \
  X(const char *, last_error, (const dp_api *a), ())                                                                  \
  X(uint32_t, version_number, (const dp_api *a), ())                                                                  \
  X(dp_status, device_parse, (const dp_api *a, const char *text, dp_device *out), (text, out))                        \
  X(dp_status, device_format, (const dp_api *a, dp_device d, char *buf, size_t cap), (d, buf, cap))                   \
  X(dp_status, tensor_create,                                                                                         \
    (const dp_api *a, dp_tensor **out, int32_t dtype, int32_t ndim, const int64_t *shape, dp_device d),               \
    (out, dtype, ndim, shape, d))                                                                                     \
  V(tensor_destroy, (const dp_api *a, dp_tensor *t), (t))                                                             \
  X(dp_status, tensor_copy_from_host, (const dp_api *a, dp_tensor *t, const void *src, size_t n), (t, src, n))        \
  X(dp_status, tensor_copy_to_host, (const dp_api *a, const dp_tensor *t, void *dst, size_t n), (t, dst, n))          \
  X(int32_t, tensor_dtype, (const dp_api *a, const dp_tensor *t), (t))                                                \
  X(int32_t, tensor_ndim, (const dp_api *a, const dp_tensor *t), (t))                                                 \
  X(dp_status, tensor_shape, (const dp_api *a, const dp_tensor *t, int64_t *out, int32_t cap), (t, out, cap))         \
  X(int64_t, tensor_numel, (const dp_api *a, const dp_tensor *t), (t))                                                \
  X(size_t, tensor_nbytes, (const dp_api *a, const dp_tensor *t), (t))                                                \
  X(dp_device, tensor_device, (const dp_api *a, const dp_tensor *t), (t))                                             \
  X(void *, tensor_data, (const dp_api *a, const dp_tensor *t), (t))                                                  \
  X(dp_status, module_create, (const dp_api *a, dp_module **out), (out))                                              \
  V(module_destroy, (const dp_api *a, dp_module *m), (m))                                                             \
  X(dp_status, module_register_parameter, (const dp_api *a, dp_module *m, const char *name, dp_tensor *v, int rg),    \
    (m, name, v, rg))                                                                                                 \
  X(dp_status, module_register_module, (const dp_api *a, dp_module *m, const char *name, dp_module *c), (m, name, c)) \
  X(size_t, module_num_parameters, (const dp_api *a, const dp_module *m), (m))                                        \
  X(dp_status, module_parameter_at,                                                                                   \
    (const dp_api *a, const dp_module *m, size_t i, const char **name, dp_tensor **out), (m, i, name, out))           \
  X(dp_status, module_get_parameter, (const dp_api *a, const dp_module *m, const char *name, dp_tensor **out),        \
    (m, name, out))                                                                                                   \
  X(dp_status, module_grad, (const dp_api *a, dp_module *m, const char *name, dp_tensor **out), (m, name, out))       \
  X(dp_status, module_zero_grad, (const dp_api *a, dp_module *m), (m))                                                \
  X(dp_status, module_save, (const dp_api *a, const dp_module *m, const char *path), (m, path))                       \
  X(dp_status, module_load, (const dp_api *a, dp_module *m, const char *path, int strict), (m, path, strict))         \
  X(dp_status, replicate,                                                                                             \
    (const dp_api *a, const dp_module *m, const dp_device *d, size_t n, int detach, dp_module **out),                 \
    (m, d, n, detach, out))                                                                                           \
  X(dp_status, reduce_gradients, (const dp_api *a, dp_module *const *r, size_t n, dp_module *target), (r, n, target)) \
  X(dp_status, replica_set_create,                                                                                    \
    (const dp_api *a, dp_replica_set **out, dp_module *m, const dp_device *d, size_t n), (out, m, d, n))              \
  X(dp_status, replica_set_sync, (const dp_api *a, dp_replica_set *s), (s))                                           \
  X(dp_status, replica_set_replica, (const dp_api *a, const dp_replica_set *s, size_t i, dp_module **out),            \
    (s, i, out))                                                                                                      \
  X(dp_status, replica_set_reduce_gradients, (const dp_api *a, dp_replica_set *s), (s))                               \
  X(size_t, replica_set_size, (const dp_api *a, const dp_replica_set *s), (s))                                        \
  V(replica_set_destroy, (const dp_api *a, dp_replica_set *s), (s))                                                   \
  X(dp_status, process_group_create_from_env,                                                                         \
    (const dp_api *a, dp_process_group **out, const dp_process_group_options *o), (out, o))                           \
  X(int32_t, process_group_rank, (const dp_api *a, const dp_process_group *pg), (pg))                                 \
  X(int32_t, process_group_size, (const dp_api *a, const dp_process_group *pg), (pg))                                 \
  X(const char *, process_group_backend, (const dp_api *a, const dp_process_group *pg), (pg))                         \
  V(process_group_destroy, (const dp_api *a, dp_process_group *pg), (pg))                                             \
  X(dp_status, pg_all_reduce, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t op), (pg, t, op))         \
  X(dp_status, pg_broadcast, (const dp_api *a, dp_process_group *pg, dp_tensor *t, int32_t root), (pg, t, root))      \
  X(dp_status, pg_barrier, (const dp_api *a, dp_process_group *pg), (pg))                                             \
  X(dp_status, ddp_options_init, (const dp_api *a, dp_ddp_options *o, size_t n), (o, n))                              \
  X(dp_status, ddp_create,                                                                                            \
    (const dp_api *a, dp_ddp **out, dp_module *m, dp_process_group *pg, const dp_ddp_options *o), (out, m, pg, o))    \
  X(dp_status, ddp_pre_forward, (const dp_api *a, dp_ddp *d), (d))                                                    \
  X(dp_status, ddp_mark_grad_ready, (const dp_api *a, dp_ddp *d, const char *name), (d, name))                        \
  X(dp_status, ddp_mark_grad_ready_index, (const dp_api *a, dp_ddp *d, size_t i), (d, i))                             \
  X(dp_status, ddp_finish_backward, (const dp_api *a, dp_ddp *d), (d))                                                \
  X(size_t, ddp_num_buckets, (const dp_api *a, const dp_ddp *d), (d))                                                 \
  V(ddp_destroy, (const dp_api *a, dp_ddp *d), (d))

#define DPGO_DECLARE(ret, name, params, args) ret dpgo_##name params;
#define DPGO_DECLARE_VOID(name, params, args) void dpgo_##name params;
DPGO_FORWARDERS(DPGO_DECLARE, DPGO_DECLARE_VOID)

#endif
