#include <map>

#include "comm/comm.h"
#include "core/error.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::comm {

std::vector<std::vector<size_t>> take_tensors(const std::vector<Tensor>& tensors, size_t limit) {
  std::vector<std::vector<size_t>> chunks;
  struct Open {
    std::vector<size_t> indices;
    size_t bytes = 0;
  };
  std::map<DType, Open> open;
  std::vector<DType> order;  // dtypes in first-seen order, so the result is deterministic
  for (size_t i = 0; i < tensors.size(); ++i) {
    DType dtype = tensors[i].dtype();
    auto [it, inserted] = open.try_emplace(dtype);
    if (inserted) order.push_back(dtype);
    Open& group = it->second;
    size_t bytes = tensors[i].nbytes();
    if (!group.indices.empty() && group.bytes + bytes > limit) {
      chunks.push_back(std::move(group.indices));
      group.indices.clear();
      group.bytes = 0;
    }
    group.indices.push_back(i);
    group.bytes += bytes;
  }
  for (DType dtype : order) {
    if (!open[dtype].indices.empty()) chunks.push_back(std::move(open[dtype].indices));
  }
  return chunks;
}

void flatten_into(const Tensor& flat, const std::vector<Tensor>& tensors) {
  size_t offset = 0;
  for (const Tensor& t : tensors) {
    copy_bytes(static_cast<char*>(flat.data()) + offset, flat.device(), t.data(), t.device(), t.nbytes());
    offset += t.nbytes();
  }
}

void unflatten_into(const std::vector<Tensor>& tensors, const Tensor& flat) {
  size_t offset = 0;
  for (const Tensor& t : tensors) {
    copy_bytes(t.data(), t.device(), static_cast<const char*>(flat.data()) + offset, flat.device(), t.nbytes());
    offset += t.nbytes();
  }
}

void copy_pairs(const std::vector<Tensor>& dsts, const std::vector<Tensor>& srcs) {
  if (dsts.size() != srcs.size())
    fail(StatusCode::kInternal, dsts.size(), " destinations for ", srcs.size(), " sources");
  if (dsts.empty()) return;
  const Device device = dsts[0].device();
  bool one_gpu = device.is_cuda();
  for (size_t i = 0; i < dsts.size() && one_gpu; ++i) {
    one_gpu = dsts[i].device() == device && srcs[i].device() == device;
  }
  if (!one_gpu) {
    for (size_t i = 0; i < dsts.size(); ++i) copy_tensor(dsts[i], srcs[i]);
    return;
  }
  std::vector<cuda::Segment> segments;
  segments.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (dsts[i].nbytes() != srcs[i].nbytes()) {
      fail(StatusCode::kInternal, "copy of ", srcs[i].describe(), " into ", dsts[i].describe());
    }
    if (dsts[i].nbytes() > 0) segments.push_back({dsts[i].data(), srcs[i].data(), dsts[i].nbytes()});
  }
  if (!segments.empty()) cuda::batched_copy(device.index, segments);
}

int64_t total_numel(const std::vector<Tensor>& tensors) {
  int64_t numel = 0;
  for (const Tensor& t : tensors) numel += t.numel();
  return numel;
}

int32_t wrap_dim(int32_t dim, int32_t ndim, const char* argument) {
  if (ndim == 0) fail_invalid("argument '", argument, "' is ", dim, " but the tensor has no dimensions (a scalar)");
  if (dim < -ndim || dim >= ndim) {
    fail_invalid("argument '", argument, "' is ", dim, ", out of range for a tensor of ", ndim,
                 " dimensions (expected ", -ndim, "..", ndim - 1, ")");
  }
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace dparallel::comm
