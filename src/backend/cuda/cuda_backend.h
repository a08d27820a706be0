// The CUDA runtime as the core sees it. Every function is defined in both
// builds: without CUDA, device_count() is 0 and the rest fail with kDevice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"

namespace dparallel::cuda {

bool compiled();
int32_t device_count();
// Why no GPU can be used ("built without CUDA", the driver's error, ...).
const char* unavailable_reason();
void set_device(int32_t index);
void* allocate(int32_t index, size_t nbytes);
void free(int32_t index, void* data) noexcept;
void memset_zero(int32_t index, void* data, size_t nbytes);
// Any direction where at least one side is a GPU; returns when done.
void copy(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes);
void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src, const Device& src_device,
               size_t src_pitch, size_t row_bytes, size_t rows);
// Sum kernel on one GPU; every pointer is memory of that GPU. Semantics of cpu::add_n.
void add_n(int32_t index, DType dtype, void* out, const void* const* inputs, size_t count, size_t numel);

struct Segment {
  void* dst;
  const void* src;
  size_t nbytes;
};
// Copies many segments within one GPU in one kernel (flatten / unflatten).
void batched_copy(int32_t index, const std::vector<Segment>& segments);

bool nccl_compiled();
// In-process NCCL on distinct GPUs of this process, one communicator per
// device (created once per device list). buffers[i] lives on devices[i].
void nccl_broadcast(const std::vector<int32_t>& devices, const std::vector<void*>& buffers, size_t root, size_t nbytes);
// Sum of sends[i] (on devices[i]) into `recv` on devices[root].
void nccl_reduce_sum(const std::vector<int32_t>& devices, const std::vector<const void*>& sends, void* recv,
                     size_t root, DType dtype, size_t numel);

}  // namespace dparallel::cuda
