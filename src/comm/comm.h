// In-process collectives across devices, with torch.cuda.comm's semantics.
// Arguments are checked here and errors name them as the C ABI does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace dparallel::comm {

constexpr size_t kDefaultBufferSize = 10u << 20;

// out[i] on devices[i]; a view of `tensor` where devices[i] is its device.
std::vector<Tensor> broadcast(const Tensor& tensor, const std::vector<Device>& devices);
// Copies `tensor` into each existing output (same dtype and shape); an output
// that is the source itself is left alone.
void broadcast_into(const Tensor& tensor, const std::vector<Tensor>& outputs);
// result[d][t]: tensor t on devices[d]; every tensor must be on devices[0].
std::vector<std::vector<Tensor>> broadcast_coalesced(const std::vector<Tensor>& tensors,
                                                     const std::vector<Device>& devices, size_t buffer_size);
Tensor reduce_add(const std::vector<Tensor>& inputs, const Device& destination);
// out = inputs[0] + ... + inputs[n-1] on out's device, in place; out may be inputs[0].
void reduce_add_into(const Tensor& out, const std::vector<Tensor>& inputs);
// inputs[d][t]; result[t] is the sum over d, on `destination`.
std::vector<Tensor> reduce_add_coalesced(const std::vector<std::vector<Tensor>>& inputs, const Device& destination,
                                         size_t buffer_size);
// `chunk_sizes` empty: torch.chunk's even split, possibly fewer chunks than devices.
std::vector<Tensor> scatter(const Tensor& tensor, const std::vector<Device>& devices,
                            const std::vector<int64_t>& chunk_sizes, int32_t dim);
Tensor gather(const std::vector<Tensor>& tensors, int32_t dim, const Device& destination);

// `flat` (as many bytes as the tensors together) = the tensors' bytes one
// after another; unflatten_into copies them back out. Any devices.
void flatten_into(const Tensor& flat, const std::vector<Tensor>& tensors);
void unflatten_into(const std::vector<Tensor>& tensors, const Tensor& flat);
// Copies between equal-sized tensor pairs (dsts[i] <- srcs[i]); where every
// one lives on one GPU, in one kernel launch instead of one copy each.
void copy_pairs(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs);
// The tensors' elements together, for a flat tensor that holds them all.
int64_t total_numel(const std::vector<Tensor>& tensors);

// Wraps a possibly negative `dim` for a tensor of `ndim` dimensions, naming `argument`.
int32_t wrap_dim(int32_t dim, int32_t ndim, const char* argument);

// Groups tensor indices by dtype, in order, into chunks of at most `limit`
// bytes (a larger tensor forms its own chunk); torch's _take_tensors.
std::vector<std::vector<size_t>> take_tensors(const std::vector<Tensor>& tensors, size_t limit);

}  // namespace dparallel::comm
