#include <algorithm>

#include "comm/comm.h"
#include "core/error.h"
#include "device/cpu/cpu_kernels.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::comm {

namespace {

bool nccl_applies(const std::vector<Device>& inputs, const Device& destination) {
  if (!cuda::nccl_compiled() || inputs.size() < 2 || !destination.is_cuda()) return false;
  std::vector<Device> sorted = inputs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (!sorted[i].is_cuda() || (i > 0 && sorted[i] == sorted[i - 1])) return false;
  }
  return std::find(inputs.begin(), inputs.end(), destination) != inputs.end();
}

// out = sum of srcs[i] (each on devices[i]), numel elements of `dtype`; `out` on `destination`.
void sum_into(void* out, const Device& destination, const std::vector<const void*>& srcs,
              const std::vector<Device>& devices, DType dtype, size_t numel) {
  if (numel == 0) return;
  bool host =
      destination.is_cpu() && std::all_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_cpu(); });
  if (host) {
    cpu::add_n(dtype, out, srcs.data(), srcs.size(), numel);
    return;
  }
  if (nccl_applies(devices, destination)) {
    std::vector<int32_t> indices;
    indices.reserve(devices.size());
    for (const Device& d : devices) indices.push_back(d.index);
    size_t root = static_cast<size_t>(std::find(devices.begin(), devices.end(), destination) - devices.begin());
    cuda::nccl_reduce_sum(indices, srcs, out, root, dtype, numel);
    return;
  }
  // Bring every input to the destination, then one sum kernel there.
  size_t nbytes = numel * dtype_size(dtype);
  std::vector<Tensor> staged;
  std::vector<const void*> local;
  for (size_t i = 0; i < srcs.size(); ++i) {
    bool same_memory = devices[i] == destination || (devices[i].is_cpu() && destination.is_cpu());
    if (same_memory) {
      local.push_back(srcs[i]);
      continue;
    }
    staged.push_back(Tensor::empty(DType::kUInt8, {static_cast<int64_t>(nbytes)}, destination));
    copy_bytes(staged.back().data(), destination, srcs[i], devices[i], nbytes);
    local.push_back(staged.back().data());
  }
  if (destination.is_cpu()) {
    cpu::add_n(dtype, out, local.data(), local.size(), numel);
  } else {
    cuda::add_n(destination.index, dtype, out, local.data(), local.size(), numel);
  }
}

void check_like(const Tensor& input, const Tensor& expected, const std::string& name) {
  if (input.shape() != expected.shape()) {
    fail_invalid(name, " has invalid size: got ", shape_string(input.shape()), ", but expected ",
                 shape_string(expected.shape()));
  }
  if (input.dtype() != expected.dtype()) {
    fail_invalid(name, " has dtype ", dtype_name(input.dtype()), ", but expected ", dtype_name(expected.dtype()));
  }
}

}  // namespace

Tensor reduce_add(const std::vector<Tensor>& inputs, const Device& destination) {
  if (inputs.empty()) fail_invalid("argument 'inputs' is empty: reduce_add needs at least one input");
  Tensor out = Tensor::empty(inputs[0].dtype(), inputs[0].shape(), destination);
  reduce_add_into(out, inputs);
  return out;
}

void reduce_add_into(const Tensor& out, const std::vector<Tensor>& inputs) {
  if (inputs.empty()) fail_invalid("argument 'inputs' is empty: reduce_add_into needs at least one input");
  for (size_t i = 0; i < inputs.size(); ++i) check_like(inputs[i], out, str_cat("input ", i));
  std::vector<const void*> srcs;
  std::vector<Device> devices;
  for (const Tensor& t : inputs) {
    srcs.push_back(t.data());
    devices.push_back(t.device());
  }
  sum_into(out.data(), out.device(), srcs, devices, out.dtype(), static_cast<size_t>(out.numel()));
}

std::vector<Tensor> reduce_add_coalesced(const std::vector<std::vector<Tensor>>& inputs, const Device& destination,
                                         size_t buffer_size) {
  if (inputs.empty()) fail_invalid("argument 'ndevices' is 0: reduce_add_coalesced needs at least one device's list");
  const std::vector<Tensor>& first = inputs[0];
  for (size_t d = 1; d < inputs.size(); ++d) {
    if (inputs[d].size() != first.size()) {
      fail_invalid("list ", d, " has ", inputs[d].size(), " tensors, but list 0 has ", first.size());
    }
    for (size_t t = 0; t < first.size(); ++t) {
      check_like(inputs[d][t], first[t], str_cat("inputs[", d * first.size() + t, "] (list ", d, ", tensor ", t, ")"));
    }
  }
  if (buffer_size == 0) buffer_size = kDefaultBufferSize;
  std::vector<Tensor> out(first.size());
  for (const std::vector<size_t>& chunk : take_tensors(first, buffer_size)) {
    size_t chunk_bytes = 0;
    for (size_t t : chunk) chunk_bytes += first[t].nbytes();
    DType dtype = first[chunk.front()].dtype();
    // The chunk's results share one flat buffer, as torch's unflatten views do.
    Tensor flat = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(chunk_bytes)}, destination);
    size_t offset = 0;
    for (size_t t : chunk) {
      out[t] = flat.view_at(offset, dtype, first[t].shape());
      offset += first[t].nbytes();
    }
    std::vector<Device> devices;
    devices.reserve(inputs.size());
    for (const auto& list : inputs) devices.push_back(list[chunk.front()].device());
    bool per_device_flat = std::all_of(inputs.begin(), inputs.end(), [&](const std::vector<Tensor>& list) {
      return std::all_of(chunk.begin(), chunk.end(),
                         [&](size_t t) { return list[t].device() == list[chunk.front()].device(); });
    });
    bool gpu_lists =
        per_device_flat && std::any_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_cuda(); });
    if (gpu_lists && chunk.size() > 1) {
      // Flatten each list on its own device so the chunk is one reduction.
      std::vector<Tensor> flats;
      std::vector<const void*> srcs;
      for (size_t d = 0; d < inputs.size(); ++d) {
        flats.push_back(Tensor::empty(DType::kUInt8, {static_cast<int64_t>(chunk_bytes)}, devices[d]));
        size_t pos = 0;
        std::vector<cuda::Segment> segments;
        for (size_t t : chunk) {
          const Tensor& src = inputs[d][t];
          if (devices[d].is_cuda()) {
            segments.push_back({static_cast<char*>(flats.back().data()) + pos, src.data(), src.nbytes()});
          } else {
            copy_bytes(static_cast<char*>(flats.back().data()) + pos, devices[d], src.data(), src.device(),
                       src.nbytes());
          }
          pos += src.nbytes();
        }
        if (devices[d].is_cuda()) cuda::batched_copy(devices[d].index, segments);
        srcs.push_back(flats.back().data());
      }
      sum_into(flat.data(), destination, srcs, devices, dtype, chunk_bytes / dtype_size(dtype));
      continue;
    }
    // Host memory (or single tensors): sum each tensor straight into its place.
    for (size_t t : chunk) {
      std::vector<const void*> srcs;
      std::vector<Device> tensor_devices;
      for (const auto& list : inputs) {
        srcs.push_back(list[t].data());
        tensor_devices.push_back(list[t].device());
      }
      sum_into(out[t].data(), destination, srcs, tensor_devices, dtype, static_cast<size_t>(first[t].numel()));
    }
  }
  return out;
}

}  // namespace dparallel::comm
