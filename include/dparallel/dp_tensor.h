/* dparallel — tensors: contiguous, row-major, on one device.
 *
 * A dp_tensor handle refers to a range of a reference-counted storage. Views
 * made by the library (for example a dim-0 chunk that dp_scatter leaves on
 * its own device) share the storage of the tensor they came from; the storage
 * lives until its last tensor is destroyed.
 *
 * Thread safety: any number of threads may read a tensor (accessors, copies
 * to host, use as a collective's input) at once. Writing its data while
 * others read or write it, or destroying a handle while another thread uses
 * that same handle, is the caller's to prevent.
 */
#ifndef DPARALLEL_DP_TENSOR_H
#define DPARALLEL_DP_TENSOR_H

#include "dparallel/dp_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_tensor dp_tensor;

/* Largest ndim a tensor may have. */
#define DP_MAX_NDIM 16

/* A new zero-filled tensor. ndim may be 0 (a scalar, numel 1); shape may be
 * NULL only when ndim is 0; every extent must be >= 0 and the byte size must
 * fit in size_t. */
DP_API dp_status dp_tensor_create(dp_tensor **out, int32_t dtype, int32_t ndim, const int64_t *shape, dp_device device);
/* A tensor over memory the caller owns (host memory for CPU devices, device
 * memory for CUDA ones), without copying. `deleter(ctx)` runs once when the
 * last tensor over this memory is destroyed; it may be NULL, and then the
 * caller keeps ownership and must keep the memory alive that long. On failure
 * the deleter is not called. `data` may be NULL only for an empty tensor. */
DP_API dp_status dp_tensor_from_blob(dp_tensor **out, void *data, int32_t dtype, int32_t ndim, const int64_t *shape,
                                     dp_device device, void (*deleter)(void *ctx), void *ctx);
/* Drops this reference; NULL is accepted. */
DP_API void dp_tensor_destroy(dp_tensor *tensor);
/* Copies exactly dp_tensor_nbytes(tensor) bytes; `nbytes` must equal it. */
DP_API dp_status dp_tensor_copy_from_host(dp_tensor *tensor, const void *src, size_t nbytes);
DP_API dp_status dp_tensor_copy_to_host(const dp_tensor *tensor, void *dst, size_t nbytes);
/* Accessors. On a NULL or invalid handle they return -1 (dtype, ndim, numel),
 * 0 (nbytes), {0, -1} (device) or NULL (data) and set dp_last_error(). */
DP_API int32_t dp_tensor_dtype(const dp_tensor *tensor);
DP_API int32_t dp_tensor_ndim(const dp_tensor *tensor);
/* Writes ndim extents; `cap` must be at least ndim. */
DP_API dp_status dp_tensor_shape(const dp_tensor *tensor, int64_t *out, int32_t cap);
DP_API int64_t dp_tensor_numel(const dp_tensor *tensor);
DP_API size_t dp_tensor_nbytes(const dp_tensor *tensor);
DP_API dp_device dp_tensor_device(const dp_tensor *tensor);
/* The first element (device memory for CUDA tensors); NULL for an empty
 * tensor that owns no memory. */
DP_API void *dp_tensor_data(const dp_tensor *tensor);

/* Additions beyond the base contract. */

/* A copy of `tensor` on `device` (always a new storage, even on the same
 * device). */
DP_API dp_status dp_tensor_to_device(dp_tensor **out, const dp_tensor *tensor, dp_device device);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_TENSOR_H */
