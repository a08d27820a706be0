// dparallel's SWIG layer: in-process collectives across devices.
#ifndef DPARALLEL_BINDINGS_SWIG_COMM_HPP
#define DPARALLEL_BINDINGS_SWIG_COMM_HPP

#include "dpswig_tensor.hpp"

namespace dpswig {

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

// Many tensors, all on devices[0], on every device, through flat buffers of
// at most `bufferSize` bytes (0: 10 MiB): item d * tensors.size() + t is
// tensor t on devices[d] (for d = 0 it shares the input's memory).
inline TensorList* broadcastCoalesced(const std::vector<Tensor*>& tensors, const std::vector<Device>& devices,
                                      size_t bufferSize = 0) {
  TensorArgs args(tensors, "tensors");
  const std::vector<const dp_tensor*>& in = args.craw();
  std::vector<dp_device> raw = rawDevices(devices);
  TensorList* list = new TensorList();
  list->handles().assign(raw.size() * in.size(), nullptr);
  dp_status s =
      dp_broadcast_coalesced(in.data(), in.size(), raw.data(), raw.size(), bufferSize, list->handles().data());
  if (s < 0) {
    list->handles().clear();
    delete list;
    check(s);
  }
  return list;
}

// `inputs` holds `ndevices` lists of equal shapes and dtypes one after the
// other (item d * n + t is tensor t of device d's list); item t of the
// result is the sum over d of tensor t, on `destination`. bufferSize as for
// broadcastCoalesced.
inline TensorList* reduceAddCoalesced(const std::vector<Tensor*>& inputs, size_t ndevices, const Device& destination,
                                      size_t bufferSize = 0) {
  if (ndevices == 0) fail_argument("'ndevices' is 0");
  if (inputs.size() % ndevices != 0) {
    throw Error(DP_EINVAL, "invalid argument: 'inputs' holds " + std::to_string(inputs.size()) +
                               " tensors, not a multiple of 'ndevices' (" + std::to_string(ndevices) + ")");
  }
  TensorArgs args(inputs, "inputs");
  const std::vector<const dp_tensor*>& in = args.craw();
  size_t ntensors = in.size() / ndevices;
  TensorList* list = new TensorList();
  list->handles().assign(ntensors, nullptr);
  dp_status s =
      dp_reduce_add_coalesced(in.data(), ndevices, ntensors, destination.raw(), bufferSize, list->handles().data());
  if (s < 0) {
    list->handles().clear();
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
  TensorArgs args(tensors, "tensors");
  const std::vector<const dp_tensor*>& in = args.craw();
  dp_tensor* out = nullptr;
  check(dp_gather(in.data(), in.size(), dim, destination.raw(), &out));
  return new Tensor(out, true);
}

// The element-wise sum of `inputs` on `destination`.
inline Tensor* reduceAdd(const std::vector<Tensor*>& inputs, const Device& destination) {
  TensorArgs args(inputs, "inputs");
  const std::vector<const dp_tensor*>& in = args.craw();
  dp_tensor* out = nullptr;
  check(dp_reduce_add(in.data(), in.size(), destination.raw(), &out));
  return new Tensor(out, true);
}

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_COMM_HPP
