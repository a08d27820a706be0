// dparallel's SWIG layer: tensors and lists of them.
#ifndef DPARALLEL_BINDINGS_SWIG_TENSOR_HPP
#define DPARALLEL_BINDINGS_SWIG_TENSOR_HPP

#include <dlpack/dlpack.h>

#include <memory>

#include "dpswig_common.hpp"

namespace dpswig {

// Keeps a host's memory alive for the tensors made over it (a pinned array,
// a direct buffer): deleted, on whatever thread drops the last of them, once
// none is left.
class HostMemory {
 public:
  virtual ~HostMemory() {}
};

// Host memory a tensor is made over: `size` bytes at `data`, kept alive by
// `keep` (null: the caller keeps it alive while any tensor over it lives).
struct HostBuffer {
  void* data = nullptr;
  size_t size = 0;
  std::unique_ptr<HostMemory> keep;
};

class Tensor {
 public:
  Tensor(const std::vector<long long>& shape, const Device& device = Device(), int dtype = DP_FLOAT32) {
    std::vector<int64_t> extents(shape.begin(), shape.end());
    check(dp_tensor_create(&h_, dtype, static_cast<int32_t>(extents.size()), extents.empty() ? nullptr : extents.data(),
                           device.raw()));
  }
  // No call is in flight when the object itself goes.
  ~Tensor() {
    if (owned_ && h_ != nullptr) dp_tensor_destroy(h_);
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  // Releases this reference once the calls in flight on it returned; later
  // calls on the object fail.
  void close() {
    if (!gate_.shut()) return;
    if (owned_) dp_tensor_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  int dtype() const { return dp_tensor_dtype(handle()); }
  int ndim() const { return dp_tensor_ndim(handle()); }
  std::vector<long long> shape() const {
    std::vector<int64_t> out(static_cast<size_t>(ndim()));
    check(dp_tensor_shape(handle(), out.data(), static_cast<int32_t>(out.size())));
    return std::vector<long long>(out.begin(), out.end());
  }
  long long numel() const { return dp_tensor_numel(handle()); }
  size_t nbytes() const { return dp_tensor_nbytes(handle()); }
  Device device() const { return Device::fromRaw(dp_tensor_device(handle())); }
  // The tensor's own memory (cpu tensors only), valid while this reference
  // lives: a view that may outlive the tensor takes it from viewReference().
  HostBytes hostBytes() const {
    Lease<dp_tensor> t = cpuHandle();
    return HostBytes{dp_tensor_data(t), dp_tensor_nbytes(t)};
  }
  // A new reference to this cpu tensor's memory for a zero-copy view to own,
  // so the view stays valid however this object is closed or collected.
  Tensor* viewReference() const {
    cpuHandle();
    return share();
  }
  // One copy from or to a host array of exactly numel float32 values.
  void copyFrom(const FloatSource& values) {
    Lease<dp_tensor> t = floatTensor(values.size(), "values");
    if (dp_tensor_device(t).type == DP_DEVICE_CPU) {
      values.read(static_cast<float*>(dp_tensor_data(t)));
    } else {
      std::vector<float> staging(values.size());
      values.read(staging.data());
      check(dp_tensor_copy_from_host(t, staging.data(), staging.size() * sizeof(float)));
    }
  }
  void copyTo(FloatSink& values) const {
    Lease<dp_tensor> t = floatTensor(values.size(), "values");
    if (dp_tensor_device(t).type == DP_DEVICE_CPU) {
      values.write(static_cast<const float*>(dp_tensor_data(t)));
    } else {
      std::vector<float> staging(values.size());
      check(dp_tensor_copy_to_host(t, staging.data(), staging.size() * sizeof(float)));
      values.write(staging.data());
    }
  }
  void copyFrom(const float* values, size_t count) {
    Lease<dp_tensor> t = floatTensor(count, "values");
    check(dp_tensor_copy_from_host(t, values, count * sizeof(float)));
  }
  void copyTo(float* values, size_t count) const {
    Lease<dp_tensor> t = floatTensor(count, "values");
    check(dp_tensor_copy_to_host(t, values, count * sizeof(float)));
  }
  // A tensor over `buffer`'s first bytes, without a copy: writes through
  // either are seen by the other. The buffer's owner is released once the
  // last tensor over it is destroyed.
  static Tensor* fromHost(HostBuffer& buffer, const std::vector<long long>& shape, int dtype = DP_FLOAT32,
                          const Device& device = Device()) {
    size_t element = DType::elementSize(dtype);
    std::vector<int64_t> extents(shape.begin(), shape.end());
    size_t bytes = element;
    for (size_t i = 0; i < extents.size(); ++i) {
      if (extents[i] < 0) fail_argument(("'shape[" + std::to_string(i) + "]' is negative").c_str());
      if (extents[i] != 0 && bytes > SIZE_MAX / static_cast<size_t>(extents[i])) fail_argument("'shape' is too large");
      bytes *= static_cast<size_t>(extents[i]);
    }
    if (bytes > buffer.size) {
      throw Error(DP_EINVAL, "invalid argument: 'buffer' holds " + std::to_string(buffer.size) +
                                 " bytes but the shape needs " + std::to_string(bytes));
    }
    HostMemory* keep = buffer.keep.get();
    dp_tensor* out = nullptr;
    check(dp_tensor_from_blob(&out, buffer.data, dtype, static_cast<int32_t>(extents.size()),
                              extents.empty() ? nullptr : extents.data(), device.raw(),
                              keep != nullptr ? &releaseHost : nullptr, keep));
    buffer.keep.release();  // the tensor's deleter owns it now
    return new Tensor(out, true);
  }
  // A tensor over memory at `data` (host memory for cpu, device memory for
  // cuda) that the caller keeps alive while any tensor over it lives.
  static Tensor* fromPointer(NativePointer data, size_t size, const std::vector<long long>& shape, int dtype,
                             const Device& device) {
    if (data == nullptr) fail_argument("'data' is null");
    HostBuffer buffer;
    buffer.data = data;
    buffer.size = size;
    return fromHost(buffer, shape, dtype, device);
  }
  // A DLManagedTensor over this tensor's memory (zero-copy), as an address.
  // Whoever gets it owns it: a framework's from_dlpack, fromDlpack, or
  // deleteDlpack; the memory stays alive until then.
  NativePointer toDlpack() const {
    DLManagedTensor* out = nullptr;
    check(dp_tensor_to_dlpack(handle(), &out));
    return out;
  }
  // Takes over the DLManagedTensor at `address` (from toDlpack or another
  // framework's to_dlpack): the tensor uses its memory in place. On failure
  // the caller still owns it.
  static Tensor* fromDlpack(NativePointer address) {
    if (address == nullptr) fail_argument("'address' is null");
    dp_tensor* out = nullptr;
    check(dp_tensor_from_dlpack(&out, static_cast<DLManagedTensor*>(address)));
    return new Tensor(out, true);
  }
  // Calls the deleter of a DLManagedTensor this process will not hand over.
  static void deleteDlpack(NativePointer address) {
    if (address == nullptr) fail_argument("'address' is null");
    DLManagedTensor* managed = static_cast<DLManagedTensor*>(address);
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
  // DLPack 1.x: a DLManagedTensorVersioned over this tensor's memory, as an
  // address, flagged read-only when asked (advice to its consumer). Owned
  // as toDlpack's: fromDlpackVersioned, a framework, or deleteDlpackVersioned.
  NativePointer toDlpackVersioned(bool readOnly = false) const {
    DLManagedTensorVersioned* out = nullptr;
    check(dp_tensor_to_dlpack_versioned(handle(), readOnly ? 1 : 0, &out));
    return out;
  }
  // Takes over the DLManagedTensorVersioned at `address` (major version 1):
  // in place, or, flagged read-only, as a copy (released at once). On
  // failure the caller still owns it.
  static Tensor* fromDlpackVersioned(NativePointer address) {
    if (address == nullptr) fail_argument("'address' is null");
    dp_tensor* out = nullptr;
    check(dp_tensor_from_dlpack_versioned(&out, static_cast<DLManagedTensorVersioned*>(address)));
    return new Tensor(out, true);
  }
  // Calls the deleter of a DLManagedTensorVersioned this process will not hand over.
  static void deleteDlpackVersioned(NativePointer address) {
    if (address == nullptr) fail_argument("'address' is null");
    DLManagedTensorVersioned* managed = static_cast<DLManagedTensorVersioned*>(address);
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
  // A copy on `device`.
  Tensor* to(const Device& device) const {
    dp_tensor* out = nullptr;
    check(dp_tensor_to_device(&out, handle(), device.raw()));
    return new Tensor(out, true);
  }
  // A new reference to the same memory: it stays valid after this one closes.
  Tensor* share() const {
    Lease<dp_tensor> t = handle();
    dp_device d = dp_tensor_device(t);
    dp_tensor* out = nullptr;
    check(dp_broadcast(t, &d, 1, &out));
    return new Tensor(out, true);
  }

  Tensor(dp_tensor* handle, bool owned) : h_(handle), owned_(owned) {}
  // The handle, held for one call (`arg`: the argument's name, for the
  // message when it is closed).
  Lease<dp_tensor> handle(const char* arg = nullptr) const { return gate_.hold(h_, "tensor", arg); }
  // Hands the handle over (to the library) once the calls in flight on it
  // returned; this object is closed after.
  dp_tensor* release() {
    if (!gate_.shut() || h_ == nullptr) throw Error(DP_ESTATE, "the tensor is " DPSWIG_CLOSED);
    dp_tensor* h = h_;
    h_ = nullptr;
    return h;
  }

 private:
  static void releaseHost(void* keep) { delete static_cast<HostMemory*>(keep); }
  Lease<dp_tensor> cpuHandle() const {
    Lease<dp_tensor> t = handle();
    if (dp_tensor_device(t).type != DP_DEVICE_CPU) {
      throw Error(DP_EUNSUPPORTED, "a view of the tensor's memory needs a cpu tensor; copy it with to() first");
    }
    return t;
  }
  Lease<dp_tensor> floatTensor(size_t count, const char* name) const {
    Lease<dp_tensor> t = handle();
    if (dp_tensor_dtype(t) != DP_FLOAT32) fail_argument("the tensor is not float32; float arrays copy only float32");
    if (static_cast<int64_t>(count) != dp_tensor_numel(t)) {
      throw Error(DP_EINVAL, "invalid argument: '" + std::string(name) + "' has " + std::to_string(count) +
                                 " elements but the tensor has " + std::to_string(dp_tensor_numel(t)));
    }
    return t;
  }

  mutable Gate gate_;
  dp_tensor* h_ = nullptr;
  bool owned_ = true;
};

inline Lease<dp_tensor> tensorArg(Tensor* t, const char* name) {
  if (t == nullptr) throw Error(DP_EINVAL, "invalid argument: '" + std::string(name) + "' is null");
  return t->handle(name);
}

// Leases on every tensor of a list argument, held while the call runs.
class TensorArgs {
 public:
  TensorArgs(const std::vector<Tensor*>& tensors, const char* name) {
    leases_.reserve(tensors.size());
    raw_.reserve(tensors.size());
    for (Tensor* t : tensors) {
      leases_.push_back(tensorArg(t, name));
      raw_.push_back(leases_.back());
    }
    craw_.assign(raw_.begin(), raw_.end());
  }
  std::vector<dp_tensor*>& raw() { return raw_; }
  const std::vector<const dp_tensor*>& craw() const { return craw_; }

 private:
  std::vector<Lease<dp_tensor>> leases_;
  std::vector<dp_tensor*> raw_;
  std::vector<const dp_tensor*> craw_;
};

class TensorList {
 public:
  TensorList() {}
  ~TensorList() {
    for (dp_tensor* t : h_) dp_tensor_destroy(t);
  }
  TensorList(const TensorList&) = delete;
  TensorList& operator=(const TensorList&) = delete;
  size_t size() const {
    Lease<std::vector<dp_tensor*>> list = held();
    return list->size();
  }
  Tensor* get(size_t index) const {
    Lease<std::vector<dp_tensor*>> list = held();
    if (index >= list->size()) fail_argument("'index' is past the end of the list");
    if ((*list)[index] == nullptr) return nullptr;
    Tensor borrowed((*list)[index], false);
    return borrowed.share();
  }
  // Releases the tensors once the calls in flight on the list returned.
  void close() {
    if (!gate_.shut()) return;
    for (dp_tensor* t : h_) dp_tensor_destroy(t);
    h_.clear();
  }
  bool isClosed() const { return gate_.isShut(); }
  // For the call that fills the list, before any host code sees it.
  std::vector<dp_tensor*>& handles() { return h_; }

 private:
  Lease<std::vector<dp_tensor*>> held() const { return gate_.hold(self_, "tensor list"); }
  mutable Gate gate_;
  std::vector<dp_tensor*> h_;
  std::vector<dp_tensor*>* const self_ = &h_;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_TENSOR_HPP
