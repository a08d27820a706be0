/* dparallel — one table of every entry point, for hosts that dlopen the
 * library: one dlsym("dp_get_api") instead of one per function.
 *
 * The table is append-only within an ABI major: fields are never moved or
 * removed, new entry points are added at the end and raise abi_minor. A host
 * compiled against an older header reads only the prefix it knows;
 * struct_size says how much of the table this library fills.
 *
 * Thread safety: dp_get_api may be called from any thread; the table is
 * static and never changes.
 */
#ifndef DPARALLEL_DP_API_H
#define DPARALLEL_DP_API_H

#include "dparallel/dp_base.h"
#include "dparallel/dp_comm.h"
#include "dparallel/dp_dlpack.h"
#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* abi_minor of the table this header describes. */
#define DP_API_MINOR 1

typedef struct dp_api {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  /* ---- abi_minor 1: base ---- */
  const char *(*status_string)(dp_status status);
  const char *(*last_error)(void);
  uint32_t (*version_number)(void);
  dp_status (*device_count)(int32_t type, int32_t *out);
  dp_status (*device_parse)(const char *text, dp_device *out);
  dp_status (*device_format)(dp_device device, char *buf, size_t cap);
  size_t (*dtype_size)(int32_t dtype);
  /* tensor */
  dp_status (*tensor_create)(dp_tensor **out, int32_t dtype, int32_t ndim, const int64_t *shape,
                             dp_device device);
  dp_status (*tensor_from_blob)(dp_tensor **out, void *data, int32_t dtype, int32_t ndim,
                                const int64_t *shape, dp_device device, void (*deleter)(void *ctx),
                                void *ctx);
  void (*tensor_destroy)(dp_tensor *tensor);
  dp_status (*tensor_copy_from_host)(dp_tensor *tensor, const void *src, size_t nbytes);
  dp_status (*tensor_copy_to_host)(const dp_tensor *tensor, void *dst, size_t nbytes);
  int32_t (*tensor_dtype)(const dp_tensor *tensor);
  int32_t (*tensor_ndim)(const dp_tensor *tensor);
  dp_status (*tensor_shape)(const dp_tensor *tensor, int64_t *out, int32_t cap);
  int64_t (*tensor_numel)(const dp_tensor *tensor);
  size_t (*tensor_nbytes)(const dp_tensor *tensor);
  dp_device (*tensor_device)(const dp_tensor *tensor);
  void *(*tensor_data)(const dp_tensor *tensor);
  dp_status (*tensor_from_dlpack)(dp_tensor **out, DLManagedTensor *managed);
  dp_status (*tensor_to_dlpack)(const dp_tensor *tensor, DLManagedTensor **out);
  /* in-process collectives */
  dp_status (*broadcast)(const dp_tensor *tensor, const dp_device *devices, size_t ndevices,
                         dp_tensor **out);
  dp_status (*broadcast_coalesced)(const dp_tensor *const *tensors, size_t ntensors,
                                   const dp_device *devices, size_t ndevices, size_t buffer_size,
                                   dp_tensor **out);
  dp_status (*reduce_add)(const dp_tensor *const *inputs, size_t ninputs, dp_device destination,
                          dp_tensor **out);
  dp_status (*reduce_add_coalesced)(const dp_tensor *const *inputs, size_t ndevices, size_t ntensors,
                                    dp_device destination, size_t buffer_size, dp_tensor **out);
  dp_status (*scatter)(const dp_tensor *tensor, const dp_device *devices, size_t ndevices,
                       const int64_t *chunk_sizes, int32_t dim, dp_tensor **out, size_t *out_count);
  dp_status (*gather)(const dp_tensor *const *tensors, size_t ntensors, int32_t dim,
                      dp_device destination, dp_tensor **out);
  /* additions */
  dp_status (*tensor_to_device)(dp_tensor **out, const dp_tensor *tensor, dp_device device);
} dp_api;

/* The table for `abi_major` (DP_VERSION_MAJOR), or NULL for a major this
 * library does not provide. */
DP_API const dp_api *dp_get_api(uint32_t abi_major);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_API_H */
