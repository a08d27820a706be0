// dparallel's SWIG layer: replication, parallel_apply, data_parallel, replica sets.
#ifndef DPARALLEL_BINDINGS_SWIG_PARALLEL_HPP
#define DPARALLEL_BINDINGS_SWIG_PARALLEL_HPP

#include "dpswig_module.hpp"

namespace dpswig {

// The host's forward for parallelApply, dataParallel and ReplicaSet.apply.
// invoke runs on the worker thread of `device`; `replica` and `input` are
// valid only during the call. It returns the output (a new tensor, or
// `input`), which the library takes over, or null when the host's forward
// failed (the language side keeps the exception and rethrows it in the
// caller).
class ForwardFunction {
 public:
  virtual ~ForwardFunction() {}
  virtual Tensor* invoke(size_t index, Module& replica, Tensor& input, const Device& device) = 0;

  static int trampoline(void* user_data, size_t index, dp_module* replica, dp_tensor* input, dp_device device,
                        dp_tensor** output) {
    ForwardFunction* fn = static_cast<ForwardFunction*>(user_data);
    CallbackScope scope;
    try {
      Module m(replica, false);
      Tensor in(input, false);
      Device d = Device::fromRaw(device);
      Tensor* out = fn->invoke(index, m, in, d);
      if (out == nullptr) return 1;
      *output = out->release();
      return 0;
    } catch (...) {
      fn->pending_.set(std::current_exception());
      return 2;
    }
  }
  void rethrowPending() { pending_.rethrow(); }

 private:
  PendingException pending_;
};

inline ForwardFunction& functionArg(ForwardFunction* fn) {
  if (fn == nullptr) fail_argument("'fn' is null");
  return *fn;
}

// y = fn(module, input) over `devices`: scatter along `dim`, replicate, apply
// in parallel, reduce the replicas' gradients into `module`, gather on
// `outputDevice`.
inline Tensor* dataParallel(Module& module, Tensor& input, const std::vector<Device>& devices,
                            const Device& outputDevice, int dim, ForwardFunction* fn) {
  ForwardFunction& f = functionArg(fn);
  std::vector<dp_device> raw = rawDevices(devices);
  dp_tensor* out = nullptr;
  dp_status s = dp_data_parallel(module.handle(), input.handle(), raw.data(), raw.size(), outputDevice.raw(), dim,
                                 &ForwardFunction::trampoline, &f, &out);
  f.rethrowPending();
  check(s);
  return new Tensor(out, true);
}

// out[i] = fn(replicas[i], inputs[i]) in parallel; `devices` empty: each
// input's device.
inline TensorList* parallelApply(const std::vector<Module*>& replicas, const std::vector<Tensor*>& inputs,
                                 const std::vector<Device>& devices, ForwardFunction* fn) {
  ForwardFunction& f = functionArg(fn);
  if (replicas.size() != inputs.size()) fail_argument("'replicas' and 'inputs' differ in length");
  if (!devices.empty() && devices.size() != inputs.size()) fail_argument("'devices' and 'inputs' differ in length");
  ModuleArgs r(replicas, "replicas");
  TensorArgs in(inputs, "inputs");
  std::vector<dp_device> raw = rawDevices(devices);
  TensorList* list = new TensorList();
  list->handles().assign(inputs.size(), nullptr);
  dp_status s = dp_parallel_apply(r.raw().data(), in.raw().data(), raw.empty() ? nullptr : raw.data(), inputs.size(),
                                  &ForwardFunction::trampoline, &f, list->handles().data());
  try {
    f.rethrowPending();
    check(s);
  } catch (...) {
    delete list;
    throw;
  }
  return list;
}

inline ModuleList* replicate(const Module& module, const std::vector<Device>& devices, bool detach = false) {
  std::vector<dp_device> raw = rawDevices(devices);
  ModuleList* list = new ModuleList();
  list->handles().assign(raw.size(), nullptr);
  dp_status s = dp_replicate(module.handle(), raw.data(), raw.size(), detach ? 1 : 0, list->handles().data());
  if (s < 0) {
    list->handles().clear();
    delete list;
    check(s);
  }
  return list;
}

inline void reduceGradients(const std::vector<Module*>& replicas, Module& target) {
  ModuleArgs r(replicas, "replicas");
  check(dp_reduce_gradients(r.raw().data(), r.raw().size(), target.handle()));
}

class ReplicaSet {
 public:
  ReplicaSet(Module& module, const std::vector<Device>& devices) {
    std::vector<dp_device> raw = rawDevices(devices);
    check(dp_replica_set_create(&h_, module.handle(), raw.data(), raw.size()));
  }
  ~ReplicaSet() {
    if (h_ != nullptr) dp_replica_set_destroy(h_);
  }
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;
  // Destroys the set once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    dp_replica_set_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  size_t size() const { return dp_replica_set_size(handle()); }
  void sync() { check(dp_replica_set_sync(handle())); }
  Module* replica(size_t index) const {
    dp_module* m = nullptr;
    check(dp_replica_set_replica(handle(), index, &m));
    return new Module(m, true);
  }
  Tensor* apply(Tensor& input, int dim, const Device& outputDevice, ForwardFunction* fn) {
    ForwardFunction& f = functionArg(fn);
    dp_tensor* out = nullptr;
    dp_status s =
        dp_replica_set_apply(handle(), input.handle(), dim, outputDevice.raw(), &ForwardFunction::trampoline, &f, &out);
    f.rethrowPending();
    check(s);
    return new Tensor(out, true);
  }
  void reduceGradients() { check(dp_replica_set_reduce_gradients(handle())); }

 private:
  Lease<dp_replica_set> handle() const { return gate_.hold(h_, "replica set"); }
  mutable Gate gate_;
  dp_replica_set* h_ = nullptr;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_PARALLEL_HPP
