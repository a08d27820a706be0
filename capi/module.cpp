// dp_module.h: the module tree, gradients and safetensors files.
#include "capi/capi_internal.h"
#include "dparallel/dp_module.h"
#include "module/state_dict.h"

using namespace dparallel;

namespace {

Tensor optional_tensor(const dp_tensor* value) {
  return value == nullptr ? Tensor() : capi::tensor_arg(value, "value");
}

// A new handle for `tensor`, or NULL for an undefined one (a NULL slot).
dp_tensor* tensor_or_null(const Tensor& tensor) { return tensor.defined() ? capi::new_tensor_handle(tensor) : nullptr; }

const Module& checked_module(const dp_module* module, dp_tensor** out) {
  capi::clear_out(out, "out");
  return *capi::module_arg(module, "module");
}

}  // namespace

extern "C" {

dp_status dp_module_create(dp_module** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = capi::new_module_handle(std::make_shared<Module>());
  DP_API_END
}

void dp_module_destroy(dp_module* module) {
  if (module == nullptr || module->tag != kModuleTag || !capi::destroy_allowed(module, __func__)) return;
  module->tag = 0;
  delete module;
}

dp_status dp_module_register_parameter(dp_module* module, const char* name, dp_tensor* value, int requires_grad) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  m.register_parameter(capi::string_arg(name, "name"), optional_tensor(value), requires_grad != 0);
  DP_API_END
}

dp_status dp_module_register_buffer(dp_module* module, const char* name, dp_tensor* value, int persistent) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  m.register_buffer(capi::string_arg(name, "name"), optional_tensor(value), persistent != 0);
  DP_API_END
}

dp_status dp_module_register_module(dp_module* module, const char* name, dp_module* child) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  std::string text = capi::string_arg(name, "name");
  m.register_module(text, child == nullptr ? nullptr : capi::module_arg(child, "child"));
  DP_API_END
}

size_t dp_module_num_parameters(const dp_module* module) {
  DP_API_BEGIN
  return capi::module_arg(module, "module")->num_parameters();
  DP_API_END_VALUE(0)
}

size_t dp_module_num_buffers(const dp_module* module) {
  DP_API_BEGIN
  return capi::module_arg(module, "module")->num_buffers();
  DP_API_END_VALUE(0)
}

dp_status dp_module_parameter_at(const dp_module* module, size_t index, const char** name_out, dp_tensor** out) {
  DP_API_BEGIN
  NamedParameter p = checked_module(module, out).parameter_at(index);
  *out = capi::new_tensor_handle(p.parameter->value());
  if (name_out != nullptr) *name_out = p.name->c_str();
  DP_API_END
}

dp_status dp_module_buffer_at(const dp_module* module, size_t index, const char** name_out, dp_tensor** out) {
  DP_API_BEGIN
  NamedBuffer b = checked_module(module, out).buffer_at(index);
  *out = capi::new_tensor_handle(b.slot->value);
  if (name_out != nullptr) *name_out = b.name->c_str();
  DP_API_END
}

dp_status dp_module_get_parameter(const dp_module* module, const char* dotted_name, dp_tensor** out) {
  DP_API_BEGIN
  const Module& m = checked_module(module, out);
  auto parameter = m.get_parameter(capi::string_arg(dotted_name, "dotted_name"));
  *out = parameter ? capi::new_tensor_handle(parameter->value()) : nullptr;
  DP_API_END
}

dp_status dp_module_get_buffer(const dp_module* module, const char* dotted_name, dp_tensor** out) {
  DP_API_BEGIN
  const Module& m = checked_module(module, out);
  *out = tensor_or_null(m.get_buffer(capi::string_arg(dotted_name, "dotted_name")).value);
  DP_API_END
}

dp_status dp_module_get_module(const dp_module* module, const char* dotted_name, dp_module** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const auto& m = capi::module_arg(module, "module");
  std::string name = capi::string_arg(dotted_name, "dotted_name");
  auto found = name.empty() ? m : m->get_module(name);
  *out = found ? capi::new_module_handle(found) : nullptr;
  DP_API_END
}

dp_status dp_module_grad(dp_module* module, const char* dotted_name, dp_tensor** out) {
  DP_API_BEGIN
  const Module& m = checked_module(module, out);
  std::string name = capi::string_arg(dotted_name, "dotted_name");
  auto parameter = m.get_parameter(name);
  if (!parameter) fail_invalid("parameter \"", name, "\" is a NULL slot and has no gradient");
  *out = capi::new_grad_handle(parameter);
  DP_API_END
}

dp_status dp_module_set_grad(dp_module* module, const char* dotted_name, dp_tensor* grad) {
  DP_API_BEGIN
  const auto& m = capi::module_arg(module, "module");
  std::string name = capi::string_arg(dotted_name, "dotted_name");
  auto parameter = m->get_parameter(name);
  if (!parameter) fail_invalid("parameter \"", name, "\" is a NULL slot and has no gradient");
  if (grad == nullptr) {
    parameter->set_grad(Tensor());
    return DP_OK;
  }
  const Tensor& g = capi::tensor_arg(grad, "grad");
  // While a dp_fsdp's slot holds this rank's shard, a gradient of the
  // shard's shape would pass the checks below and fail post_backward.
  if (auto sharding = parameter->sharding()) {
    std::string refusal = sharding->grad_refusal(*parameter);
    if (!refusal.empty()) fail(StatusCode::kState, "argument 'grad' cannot be set now: ", refusal);
  }
  const Tensor& value = parameter->value();
  if (g.dtype() != value.dtype() || g.shape() != value.shape() || g.device() != value.device()) {
    fail_invalid("argument 'grad' is ", g.describe(), " but parameter \"", name, "\" is ", value.describe(),
                 ": a gradient has its parameter's dtype, shape and device");
  }
  if (g.nbytes() > 0 && g.data() == value.data()) {
    fail_invalid("argument 'grad' is the memory of parameter \"", name, "\" itself");
  }
  parameter->set_grad(g);
  DP_API_END
}

dp_status dp_module_zero_grad(dp_module* module) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  StreamOrder order(capi::module_devices(m));
  try {
    m.zero_grad();
  } catch (...) {
    // The gradients were zeroed all the same (one failure is reported):
    // the host's stream follows the fills before the error goes back.
    try {
      order.finish();
    } catch (...) {
    }
    throw;
  }
  order.finish();
  DP_API_END
}

dp_status dp_module_save(const dp_module* module, const char* path) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  std::string file = capi::string_arg(path, "path");
  capi::in_stream_order(capi::module_devices(m), [&] { save_module(m, file); });
  DP_API_END
}

dp_status dp_module_load(dp_module* module, const char* path, int strict) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  std::string file = capi::string_arg(path, "path");
  capi::in_stream_order(capi::module_devices(m), [&] { load_module(m, file, strict != 0); });
  DP_API_END
}

dp_status dp_module_set_requires_grad(dp_module* module, const char* dotted_name, int requires_grad) {
  DP_API_BEGIN
  const Module& m = *capi::module_arg(module, "module");
  std::string name = capi::string_arg(dotted_name, "dotted_name");
  NamedTensorSlot slot = m.find_tensor(name);
  if (slot.parameter) {
    slot.parameter->set_requires_grad(requires_grad != 0);
  } else {
    slot.buffer->requires_grad = requires_grad != 0;
  }
  DP_API_END
}

dp_status dp_module_requires_grad(const dp_module* module, const char* dotted_name, int* out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  const Module& m = *capi::module_arg(module, "module");
  NamedTensorSlot slot = m.find_tensor(capi::string_arg(dotted_name, "dotted_name"));
  *out = slot.parameter ? slot.parameter->requires_grad() : slot.buffer->requires_grad;
  DP_API_END
}

}  // extern "C"
