#include <map>

#include "comm/comm.h"
#include "core/error.h"

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
