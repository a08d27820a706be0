// dparallel's SWIG layer: modules and lists of them.
#ifndef DPARALLEL_BINDINGS_SWIG_MODULE_HPP
#define DPARALLEL_BINDINGS_SWIG_MODULE_HPP

#include "dpswig_tensor.hpp"

namespace dpswig {

class Module {
 public:
  Module() { check(dp_module_create(&h_)); }
  // No call is in flight when the object itself goes.
  ~Module() {
    if (owned_ && h_ != nullptr) dp_module_destroy(h_);
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  // Releases this reference once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    if (owned_) dp_module_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  // `value` may be null (an empty slot). The module holds its own reference.
  void registerParameter(const std::string& name, Tensor* value, bool requiresGrad = true) {
    Lease<dp_tensor> v = value != nullptr ? value->handle("value") : Lease<dp_tensor>(nullptr, nullptr);
    check(dp_module_register_parameter(handle(), name.c_str(), v, requiresGrad ? 1 : 0));
  }
  void registerBuffer(const std::string& name, Tensor* value, bool persistent = true) {
    Lease<dp_tensor> v = value != nullptr ? value->handle("value") : Lease<dp_tensor>(nullptr, nullptr);
    check(dp_module_register_buffer(handle(), name.c_str(), v, persistent ? 1 : 0));
  }
  void registerModule(const std::string& name, Module* child) {
    Lease<dp_module> c = child != nullptr ? child->handle("child") : Lease<dp_module>(nullptr, nullptr);
    check(dp_module_register_module(handle(), name.c_str(), c));
  }
  size_t numParameters() const { return dp_module_num_parameters(handle()); }
  size_t numBuffers() const { return dp_module_num_buffers(handle()); }
  std::string parameterName(size_t index) const {
    const char* name = nullptr;
    dp_tensor* t = nullptr;
    check(dp_module_parameter_at(handle(), index, &name, &t));
    std::string out = name != nullptr ? name : "";
    dp_tensor_destroy(t);
    return out;
  }
  Tensor* parameter(size_t index) const {
    dp_tensor* t = nullptr;
    check(dp_module_parameter_at(handle(), index, nullptr, &t));
    return wrap(t);
  }
  std::string bufferName(size_t index) const {
    const char* name = nullptr;
    dp_tensor* t = nullptr;
    check(dp_module_buffer_at(handle(), index, &name, &t));
    std::string out = name != nullptr ? name : "";
    dp_tensor_destroy(t);
    return out;
  }
  Tensor* buffer(size_t index) const {
    dp_tensor* t = nullptr;
    check(dp_module_buffer_at(handle(), index, nullptr, &t));
    return wrap(t);
  }
  Tensor* getParameter(const std::string& dottedName) const {
    dp_tensor* t = nullptr;
    check(dp_module_get_parameter(handle(), dottedName.c_str(), &t));
    return wrap(t);
  }
  Tensor* getBuffer(const std::string& dottedName) const {
    dp_tensor* t = nullptr;
    check(dp_module_get_buffer(handle(), dottedName.c_str(), &t));
    return wrap(t);
  }
  Module* getModule(const std::string& dottedName) const {
    dp_module* m = nullptr;
    check(dp_module_get_module(handle(), dottedName.c_str(), &m));
    return m != nullptr ? new Module(m, true) : nullptr;
  }
  // The parameter's gradient, in place: writes go to the module's gradient.
  Tensor* grad(const std::string& dottedName) {
    dp_tensor* t = nullptr;
    check(dp_module_grad(handle(), dottedName.c_str(), &t));
    return wrap(t);
  }
  // Makes `grad` the parameter's gradient, without a copy: a tensor over
  // the host's own memory (Tensor.fromBuffer, FromArray) is read and written
  // in place from then on. Null drops it (the next grad() is zeros). Same
  // dtype, shape and device as the parameter; not while a Ddp's backward is
  // in flight.
  void setGrad(const std::string& dottedName, Tensor* grad) {
    Lease<dp_tensor> g = grad != nullptr ? grad->handle("grad") : Lease<dp_tensor>(nullptr, nullptr);
    check(dp_module_set_grad(handle(), dottedName.c_str(), g));
  }
  void zeroGrad() { check(dp_module_zero_grad(handle())); }
  void save(const std::string& path) const { check(dp_module_save(handle(), path.c_str())); }
  void load(const std::string& path, bool strict = true) {
    check(dp_module_load(handle(), path.c_str(), strict ? 1 : 0));
  }
  void setRequiresGrad(const std::string& dottedName, bool requiresGrad) {
    check(dp_module_set_requires_grad(handle(), dottedName.c_str(), requiresGrad ? 1 : 0));
  }
  bool requiresGrad(const std::string& dottedName) const {
    int out = 0;
    check(dp_module_requires_grad(handle(), dottedName.c_str(), &out));
    return out != 0;
  }

  Module(dp_module* handle, bool owned) : h_(handle), owned_(owned) {}
  // The handle, held for one call (`arg`: the argument's name).
  Lease<dp_module> handle(const char* arg = nullptr) const { return gate_.hold(h_, "module", arg); }

 private:
  static Tensor* wrap(dp_tensor* t) { return t != nullptr ? new Tensor(t, true) : nullptr; }
  mutable Gate gate_;
  dp_module* h_ = nullptr;
  bool owned_ = true;
};

inline Lease<dp_module> moduleArg(Module* m, const char* name) {
  if (m == nullptr) throw Error(DP_EINVAL, "invalid argument: '" + std::string(name) + "' is null");
  return m->handle(name);
}

// Leases on every module of a list argument, held while the call runs.
class ModuleArgs {
 public:
  ModuleArgs(const std::vector<Module*>& modules, const char* name) {
    leases_.reserve(modules.size());
    raw_.reserve(modules.size());
    for (Module* m : modules) {
      leases_.push_back(moduleArg(m, name));
      raw_.push_back(leases_.back());
    }
  }
  std::vector<dp_module*>& raw() { return raw_; }

 private:
  std::vector<Lease<dp_module>> leases_;
  std::vector<dp_module*> raw_;
};

// Owned results of calls that make several handles; handle() gives a new
// reference, so the list can be closed independently of what came out of it.
class ModuleList {
 public:
  ModuleList() {}
  ~ModuleList() {
    for (dp_module* m : h_) dp_module_destroy(m);
  }
  ModuleList(const ModuleList&) = delete;
  ModuleList& operator=(const ModuleList&) = delete;
  size_t size() const {
    Lease<std::vector<dp_module*>> list = held();
    return list->size();
  }
  Module* get(size_t index) const {
    Lease<std::vector<dp_module*>> list = held();
    if (index >= list->size()) fail_argument("'index' is past the end of the list");
    dp_module* m = nullptr;
    check(dp_module_get_module((*list)[index], "", &m));
    return new Module(m, true);
  }
  // Releases the modules once the calls in flight on the list returned.
  void close() {
    if (!gate_.shut()) return;
    for (dp_module* m : h_) dp_module_destroy(m);
    h_.clear();
  }
  bool isClosed() const { return gate_.isShut(); }
  // For the call that fills the list, before any host code sees it.
  std::vector<dp_module*>& handles() { return h_; }

 private:
  Lease<std::vector<dp_module*>> held() const { return gate_.hold(self_, "module list"); }
  mutable Gate gate_;
  std::vector<dp_module*> h_;
  std::vector<dp_module*>* const self_ = &h_;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_MODULE_HPP
