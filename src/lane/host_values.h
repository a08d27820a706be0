// Small int64 and byte vectors moved between the host and a process
// group's device, for the reducer's, the sharding's and the lane's own collectives.
#pragma once

#include <cstring>
#include <vector>

#include "core/tensor.h"

namespace dparallel::lane {

inline const Device kHostDevice{DeviceType::kCpu, 0};

inline Tensor to_device(const Tensor& t, const Device& device) { return t.device() == device ? t : t.to(device); }

inline Tensor host_int64(const std::vector<int64_t>& values) {
  Tensor t = Tensor::empty(DType::kInt64, {static_cast<int64_t>(values.size())}, kHostDevice);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

inline std::vector<int64_t> read_int64(const Tensor& t) {
  Tensor host = to_device(t, kHostDevice);
  std::vector<int64_t> values(static_cast<size_t>(host.numel()));
  if (!values.empty()) std::memcpy(values.data(), host.data(), values.size() * sizeof(int64_t));
  return values;
}

// One output per rank for an all_gather.
inline std::vector<Tensor> gather_outputs(int32_t world, DType dtype, int64_t numel, const Device& device) {
  std::vector<Tensor> outputs;
  outputs.reserve(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) outputs.push_back(Tensor::empty(dtype, {numel}, device));
  return outputs;
}

}  // namespace dparallel::lane
