// dparallel's SWIG layer: modules and lists of them.
#ifndef DPARALLEL_BINDINGS_SWIG_MODULE_HPP
#define DPARALLEL_BINDINGS_SWIG_MODULE_HPP

#include "dpswig_tensor.hpp"

namespace dpswig {

class Module {
 public:
  Module() { check(dp_module_create(&h_)); }
  ~Module() {
    if (owned_) dp_module_destroy(h_);
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  void close() {
    if (owned_) dp_module_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return h_ == nullptr; }
  // `value` may be null (an empty slot). The module holds its own reference.
  void registerParameter(const std::string& name, Tensor* value, bool requiresGrad = true) {
    check(dp_module_register_parameter(handle(), name.c_str(), value != nullptr ? value->handle() : nullptr,
                                       requiresGrad ? 1 : 0));
  }
  void registerBuffer(const std::string& name, Tensor* value, bool persistent = true) {
    check(dp_module_register_buffer(handle(), name.c_str(), value != nullptr ? value->handle() : nullptr,
                                    persistent ? 1 : 0));
  }
  void registerModule(const std::string& name, Module* child) {
    check(dp_module_register_module(handle(), name.c_str(), child != nullptr ? child->handle() : nullptr));
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
    check(dp_module_set_grad(handle(), dottedName.c_str(), grad != nullptr ? grad->handle() : nullptr));
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
  dp_module* handle() const {
    if (h_ == nullptr) throw Error(DP_ESTATE, "the module is closed");
    return h_;
  }

 private:
  static Tensor* wrap(dp_tensor* t) { return t != nullptr ? new Tensor(t, true) : nullptr; }
  dp_module* h_ = nullptr;
  bool owned_ = true;
};

inline dp_module* moduleArg(Module* m, const char* name) {
  if (m == nullptr) throw Error(DP_EINVAL, "invalid argument: '" + std::string(name) + "' is null");
  return m->handle();
}

// Owned results of calls that make several handles; handle() gives a new
// reference, so the list can be closed independently of what came out of it.
class ModuleList {
 public:
  ModuleList() {}
  ~ModuleList() { close(); }
  ModuleList(const ModuleList&) = delete;
  ModuleList& operator=(const ModuleList&) = delete;
  size_t size() const { return h_.size(); }
  Module* get(size_t index) const {
    if (index >= h_.size()) fail_argument("'index' is past the end of the list");
    dp_module* m = nullptr;
    check(dp_module_get_module(h_[index], "", &m));
    return new Module(m, true);
  }
  void close() {
    for (dp_module* m : h_) dp_module_destroy(m);
    h_.clear();
  }
  std::vector<dp_module*>& handles() { return h_; }

 private:
  std::vector<dp_module*> h_;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_MODULE_HPP
