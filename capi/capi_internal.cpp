#include "capi/capi_internal.h"

#include <exception>
#include <new>

namespace dparallel::capi {

namespace {
thread_local std::string t_last_error;
}  // namespace

const char* last_error_text() noexcept { return t_last_error.c_str(); }

void set_last_error(const std::string& message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
    t_last_error.clear();  // out of memory for the message itself
  }
}

namespace {
// Builds "function: detail" without letting an allocation failure escape.
void record(const char* function, const char* prefix, const char* detail) noexcept {
  try {
    set_last_error(std::string(function) + ": " + prefix + detail);
  } catch (...) {
    set_last_error(std::string());
  }
}
}  // namespace

dp_status handle_exception(const char* function) noexcept {
  try {
    throw;
  } catch (const Error& e) {
    record(function, "", e.what());
    return static_cast<dp_status>(e.code());
  } catch (const std::bad_alloc&) {
    record(function, "", "out of memory");
    return DP_ENOMEM;
  } catch (const std::exception& e) {
    record(function, "internal error: ", e.what());
    return DP_EINTERNAL;
  } catch (...) {
    record(function, "internal error: ", "unknown exception");
    return DP_EINTERNAL;
  }
}

const Tensor& tensor_arg(const dp_tensor* handle, const std::string& name) {
  if (handle == nullptr) fail_invalid("argument '", name, "' is NULL");
  if (handle->tag != kTensorTag) {
    fail_invalid("argument '", name, "' is not a dp_tensor handle");
  }
  if (auto parameter = handle->grad_of.lock()) {
    Tensor current = parameter->grad_if_allocated();
    if (current.defined() && (current.storage() != handle->tensor.storage() ||
                              current.storage_offset() != handle->tensor.storage_offset())) {
      handle->tensor = std::move(current);
    }
  }
  return handle->tensor;
}

std::vector<Tensor> tensors_arg(const dp_tensor* const* handles, size_t count, const char* name) {
  if (count > 0 && handles == nullptr) fail_invalid("argument '", name, "' is NULL but its count is ", count);
  std::vector<Tensor> tensors;
  tensors.reserve(count);
  for (size_t i = 0; i < count; ++i) tensors.push_back(tensor_arg(handles[i], str_cat(name, "[", i, "]")));
  return tensors;
}

Device device_arg(const dp_device& device, const std::string& name) {
  return check_device(device.type, device.index, name.c_str());
}

std::vector<Device> devices_arg(const dp_device* devices, size_t count, const char* name) {
  if (count > 0 && devices == nullptr) fail_invalid("argument '", name, "' is NULL but its count is ", count);
  std::vector<Device> out;
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) out.push_back(device_arg(devices[i], str_cat(name, "[", i, "]")));
  return out;
}

std::vector<Device> devices_of(const std::vector<Tensor>& tensors, const std::vector<Device>& more) {
  std::vector<Device> out;
  auto add = [&](const Device& d) {
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const Tensor& t : tensors) {
    if (t.defined()) add(t.device());
  }
  for (const Device& d : more) add(d);
  return out;
}

std::vector<Device> module_devices(const Module& module, const std::vector<Device>& more) {
  std::vector<Tensor> tensors;
  for (const NamedParameter& p : module.named_parameters()) {
    tensors.push_back(p.parameter->value());
    tensors.push_back(p.parameter->grad_if_allocated());
  }
  for (const NamedBuffer& b : module.named_buffers()) tensors.push_back(b.slot->value);
  return devices_of(tensors, more);
}

DType dtype_arg(int32_t dtype, const char* name) { return dtype_from_code(dtype, name); }

Shape shape_arg(int32_t ndim, const int64_t* shape, const char* name) {
  if (ndim < 0 || ndim > kMaxNdim) fail_invalid("argument 'ndim' is ", ndim, "; it must be 0..", kMaxNdim);
  if (ndim > 0 && shape == nullptr) fail_invalid("argument '", name, "' is NULL but ndim is ", ndim);
  Shape out(shape, shape + ndim);
  checked_numel(out, name);
  return out;
}

dp_tensor* new_tensor_handle(Tensor tensor) {
  auto* handle = new dp_tensor();
  handle->tensor = std::move(tensor);
  return handle;
}

dp_tensor* new_grad_handle(const std::shared_ptr<Parameter>& parameter) {
  dp_tensor* handle = new_tensor_handle(parameter->grad());
  handle->grad_of = parameter;
  return handle;
}

void export_tensors(const std::vector<Tensor>& tensors, dp_tensor** out) {
  std::vector<dp_tensor*> handles;
  handles.reserve(tensors.size());
  try {
    for (const Tensor& t : tensors) handles.push_back(new_tensor_handle(t));
  } catch (...) {
    for (dp_tensor* h : handles) delete h;
    throw;
  }
  for (size_t i = 0; i < handles.size(); ++i) out[i] = handles[i];
}

const std::shared_ptr<Module>& module_arg(const dp_module* handle, const std::string& name) {
  if (handle == nullptr) fail_invalid("argument '", name, "' is NULL");
  if (handle->tag != kModuleTag) {
    fail_invalid("argument '", name, "' is not a dp_module handle");
  }
  return handle->module;
}

std::vector<std::shared_ptr<Module>> modules_arg(const dp_module* const* handles, size_t count, const char* name) {
  if (count > 0 && handles == nullptr) fail_invalid("argument '", name, "' is NULL but its count is ", count);
  std::vector<std::shared_ptr<Module>> modules;
  modules.reserve(count);
  for (size_t i = 0; i < count; ++i) modules.push_back(module_arg(handles[i], str_cat(name, "[", i, "]")));
  return modules;
}

ReplicaSet& replica_set_arg(const dp_replica_set* handle, const char* name) {
  if (handle == nullptr) fail_invalid("argument '", name, "' is NULL");
  if (handle->tag != kReplicaSetTag) {
    fail_invalid("argument '", name, "' is not a dp_replica_set handle");
  }
  return *handle->set;
}

dp_module* new_module_handle(std::shared_ptr<Module> module) {
  auto* handle = new dp_module();
  handle->module = std::move(module);
  return handle;
}

void export_modules(const std::vector<std::shared_ptr<Module>>& modules, dp_module** out) {
  std::vector<std::unique_ptr<dp_module>> handles;
  handles.reserve(modules.size());
  for (const auto& m : modules) handles.push_back(std::unique_ptr<dp_module>(new_module_handle(m)));
  for (size_t i = 0; i < handles.size(); ++i) out[i] = handles[i].release();
}

std::string string_arg(const char* text, const char* name) {
  if (text == nullptr) fail_invalid("argument '", name, "' is NULL");
  return text;
}

}  // namespace dparallel::capi
