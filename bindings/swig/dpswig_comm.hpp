// dparallel's SWIG layer: in-process collectives across devices.
#ifndef DPARALLEL_BINDINGS_SWIG_COMM_HPP
#define DPARALLEL_BINDINGS_SWIG_COMM_HPP

#include "dpswig_tensor.hpp"

namespace dpswig {

inline std::vector<const dp_tensor*> tensorArgs(const std::vector<Tensor*>& tensors, const char* name) {
  std::vector<const dp_tensor*> out;
  out.reserve(tensors.size());
  for (Tensor* t : tensors) out.push_back(tensorArg(t, name));
  return out;
}

// `tensor` on every device: a view where it already lives, a copy elsewhere.
inline TensorList* broadcast(const Tensor& tensor, const std::vector<Device>& devices) {
  std::vector<dp_device> raw = rawDevices(devices);
  TensorList* list = new TensorList();
  list->handles().assign(raw.size(), nullptr);
  dp_status s = dp_broadcast(tensor.handle(), raw.data(), raw.size(), list->handles().data());
  if (s < 0) {
    delete list;
    check(s);
  }
  return list;
}

// Chunk i of `tensor` along `dim` on devices[i]: even chunks (possibly fewer
// than devices) with `chunkSizes` empty, else those sizes.
inline TensorList* scatter(const Tensor& tensor, const std::vector<Device>& devices, int dim = 0,
                           const std::vector<long long>& chunkSizes = std::vector<long long>()) {
  std::vector<dp_device> raw = rawDevices(devices);
  std::vector<int64_t> sizes(chunkSizes.begin(), chunkSizes.end());
  if (!sizes.empty() && sizes.size() != raw.size()) fail_argument("'chunkSizes' and 'devices' differ in length");
  TensorList* list = new TensorList();
  list->handles().assign(raw.size(), nullptr);
  size_t count = 0;
  dp_status s = dp_scatter(tensor.handle(), raw.data(), raw.size(), sizes.empty() ? nullptr : sizes.data(), dim,
                           list->handles().data(), &count);
  if (s < 0) {
    delete list;
    check(s);
  }
  list->handles().resize(count);
  return list;
}

// The tensors concatenated along `dim` on `destination`.
inline Tensor* gather(const std::vector<Tensor*>& tensors, int dim, const Device& destination) {
  std::vector<const dp_tensor*> in = tensorArgs(tensors, "tensors");
  dp_tensor* out = nullptr;
  check(dp_gather(in.data(), in.size(), dim, destination.raw(), &out));
  return new Tensor(out, true);
}

// The element-wise sum of `inputs` on `destination`.
inline Tensor* reduceAdd(const std::vector<Tensor*>& inputs, const Device& destination) {
  std::vector<const dp_tensor*> in = tensorArgs(inputs, "inputs");
  dp_tensor* out = nullptr;
  check(dp_reduce_add(in.data(), in.size(), destination.raw(), &out));
  return new Tensor(out, true);
}

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_COMM_HPP
