/* dparallel — in-process collectives across devices (torch.cuda.comm semantics).
 *
 * CPU devices copy and add with all cores; CUDA devices use NCCL (one
 * communicator per device, group calls) when every device involved is a GPU
 * of this process, and peer copies otherwise. Every output tensor is a new
 * owned reference.
 *
 * Thread safety: the calls may run concurrently from several threads on
 * different tensors. Inputs are only read.
 */
#ifndef DPARALLEL_DP_COMM_H
#define DPARALLEL_DP_COMM_H

#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DP_DEFAULT_BUFFER_SIZE (10u << 20)

/* out[i] is `tensor` on devices[i]: a view sharing its storage where
 * devices[i] is the tensor's own device, a new copy elsewhere. */
DP_API dp_status dp_broadcast(const dp_tensor *tensor, const dp_device *devices, size_t ndevices,
                              dp_tensor **out /* [ndevices] */);
/* Broadcasts many tensors, all on devices[0], through flat buffers of at
 * most `buffer_size` bytes (0 means DP_DEFAULT_BUFFER_SIZE): tensors are
 * grouped by dtype in order, a tensor larger than the buffer travels alone.
 * out[d * ntensors + t] is tensor t on devices[d]; for d = 0 it shares the
 * input's storage. */
DP_API dp_status dp_broadcast_coalesced(const dp_tensor *const *tensors, size_t ntensors, const dp_device *devices,
                                        size_t ndevices, size_t buffer_size,
                                        dp_tensor **out /* [ndevices * ntensors] */);
/* The element-wise sum of inputs of equal shape and dtype, as a new tensor on
 * `destination`. fp16 and bf16 are summed in float32 and rounded once per
 * element; bool sums are logical or. */
DP_API dp_status dp_reduce_add(const dp_tensor *const *inputs, size_t ninputs, dp_device destination, dp_tensor **out);
/* inputs[d * ntensors + t] is tensor t of device d's list; every list must
 * match list 0 in shapes and dtypes. out[t] is the sum over d of tensor t,
 * on `destination`; buffer_size as for dp_broadcast_coalesced. */
DP_API dp_status dp_reduce_add_coalesced(const dp_tensor *const *inputs, size_t ndevices, size_t ntensors,
                                         dp_device destination, size_t buffer_size, dp_tensor **out /* [ntensors] */);
/* Splits `tensor` along `dim` (negative wraps) and puts chunk i on
 * devices[i]. With `chunk_sizes` (ndevices positive sizes summing to the
 * dimension) every device gets a chunk; with NULL, torch.chunk's even split
 * (ceil(size / ndevices) each), which can give fewer chunks than devices.
 * `*out_count` receives the number of chunks; out[i] past it is set to NULL.
 * A chunk that stays on the tensor's device along dim 0 is a view. */
DP_API dp_status dp_scatter(const dp_tensor *tensor, const dp_device *devices, size_t ndevices,
                            const int64_t *chunk_sizes /* NULL: even chunks */, int32_t dim,
                            dp_tensor **out /* [ndevices] */, size_t *out_count);
/* Concatenates tensors of one dtype and ndim, equal in every dimension but
 * `dim` (negative wraps), into a new tensor on `destination`. */
DP_API dp_status dp_gather(const dp_tensor *const *tensors, size_t ntensors, int32_t dim, dp_device destination,
                           dp_tensor **out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_COMM_H */
