// The CUDA backend: its device runtime (registered with the core), kernels
// and in-process NCCL, for comm/ and distributed/. Every function is defined
// in both builds: without CUDA, no runtime is registered, device_count() is 0
// and the rest fail with kDevice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"

namespace dparallel::cuda {

bool compiled();
// Registers the cuda device runtime (memory, copies, fills, the current
// device) with the core; without CUDA it registers nothing, so the core
// reports cuda devices as unsupported by this build.
void register_runtime();
int32_t device_count();
// Why no GPU can be used ("built without CUDA", the driver's error, ...).
const char* unavailable_reason();
// Sum kernel on one GPU; every pointer is memory of that GPU. Semantics of cpu::add_n.
void add_n(int32_t index, DType dtype, void* out, const void* const* inputs, size_t count, size_t numel);

struct Segment {
  void* dst;
  const void* src;
  size_t nbytes;
};
// Copies many segments within one GPU in one kernel (flatten / unflatten).
void batched_copy(int32_t index, const std::vector<Segment>& segments);

// dst = src converted, numel elements on GPU `index`; floating dtypes only.
void cast(int32_t index, DType dst_dtype, void* dst, DType src_dtype, const void* src, size_t numel);
// data[i] /= divisor on GPU `index`; floating dtypes only.
void divide(int32_t index, DType dtype, void* data, size_t numel, int64_t divisor);
// Loads every kernel above on GPU `index` now (once per device). Under lazy
// loading (CUDA_MODULE_LOADING=LAZY, CUDA's default from 12.2) a kernel's
// first launch may wait for the whole device, which must not happen while a
// queued collective of this process spins for a peer.
void load_kernels(int32_t index);

bool nccl_compiled();
// In-process NCCL on distinct GPUs of this process, one communicator per
// device (created once per device list). buffers[i] lives on devices[i].
void nccl_broadcast(const std::vector<int32_t>& devices, const std::vector<void*>& buffers, size_t root, size_t nbytes);
// Sum of sends[i] (on devices[i]) into `recv` on devices[root].
void nccl_reduce_sum(const std::vector<int32_t>& devices, const std::vector<const void*>& sends, void* recv,
                     size_t root, DType dtype, size_t numel);

}  // namespace dparallel::cuda
