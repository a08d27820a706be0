// dp_parallel.h: host callbacks run on every replica.
#include "capi/capi_internal.h"
#include "dparallel/dp_parallel.h"
#include "parallel/data_parallel.h"

using namespace dparallel;

namespace {

// The C callback as a ReplicaForward: handles for the call, the status code
// turned into an exception, the output handle taken over.
ReplicaForward wrap_forward(dp_forward_fn fn, void* user_data) {
  return [fn, user_data](size_t index, const ModulePtr& replica, const Tensor& input, const Device& device) {
    std::unique_ptr<dp_module> replica_handle(capi::new_module_handle(replica));
    std::unique_ptr<dp_tensor> input_handle(capi::new_tensor_handle(input));
    replica_handle->borrowed = true;
    input_handle->borrowed = true;
    dp_tensor* output = nullptr;
    capi::set_last_error("");
    int code = fn(user_data, index, replica_handle.get(), input_handle.get(), capi::to_c(device), &output);
    // The callback may hand back the input handle itself: that one is freed
    // once, with input_handle, and never through `output`.
    const bool output_is_input = output == input_handle.get();
    if (code != 0) {
      if (!output_is_input) dp_tensor_destroy(output);
      std::string detail = dp_last_error();
      fail(StatusCode::kUser, "the callback returned ", code,
           detail.empty() ? "" : " (its last error: " + detail + ")");
    }
    if (output == nullptr) fail(StatusCode::kUser, "the callback returned 0 but stored no output");
    if (output_is_input) return input;
    if (output->tag != kTensorTag)
      fail(StatusCode::kUser, "the callback stored an output that is not a dp_tensor handle");
    if (output->borrowed) fail(StatusCode::kUser, "the callback stored a handle lent to it as its output");
    Tensor result = output->tensor;
    dp_tensor_destroy(output);
    return result;
  };
}

}  // namespace

extern "C" {

dp_status dp_parallel_apply(dp_module* const* replicas, dp_tensor* const* inputs, const dp_device* devices, size_t n,
                            dp_forward_fn fn, void* user_data, dp_tensor** out) {
  DP_API_BEGIN
  if (n > 0 && out == nullptr) fail_invalid("argument 'out' is NULL but ", n, " outputs are due");
  for (size_t i = 0; i < n; ++i) out[i] = nullptr;
  if (fn == nullptr) capi::null_argument("fn");
  std::vector<ModulePtr> modules = capi::modules_arg(replicas, n, "replicas");
  std::vector<Tensor> tensors = capi::tensors_arg(inputs, n, "inputs");
  std::vector<Device> targets;
  if (devices != nullptr) targets = capi::devices_arg(devices, n, "devices");
  std::vector<Device> touched = capi::devices_of(tensors, targets);
  for (const ModulePtr& m : modules) touched = capi::module_devices(*m, touched);
  std::vector<Tensor> outputs = capi::in_stream_order(
      touched, [&] { return parallel_apply(modules, tensors, targets, wrap_forward(fn, user_data)); });
  capi::export_tensors(outputs, out);
  DP_API_END
}

dp_status dp_data_parallel(dp_module* module, dp_tensor* input, const dp_device* devices, size_t ndevices,
                           dp_device output_device, int32_t dim, dp_forward_fn fn, void* user_data, dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  if (fn == nullptr) capi::null_argument("fn");
  const ModulePtr& m = capi::module_arg(module, "module");
  const Tensor& x = capi::tensor_arg(input, "input");
  if (ndevices == 0) fail_invalid("argument 'ndevices' is 0: data_parallel needs at least one device");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  Device destination = capi::device_arg(output_device, "output_device");
  std::vector<Device> touched = capi::module_devices(*m, capi::devices_of({x}, targets));
  touched.push_back(destination);
  Tensor output = capi::in_stream_order(
      touched, [&] { return data_parallel(m, x, targets, destination, dim, wrap_forward(fn, user_data)); });
  *out = capi::new_tensor_handle(output);
  DP_API_END
}

dp_status dp_replica_set_apply(dp_replica_set* set, dp_tensor* input, int32_t dim, dp_device output_device,
                               dp_forward_fn fn, void* user_data, dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  if (fn == nullptr) capi::null_argument("fn");
  ReplicaSet& s = capi::replica_set_arg(set, "set");
  const Tensor& x = capi::tensor_arg(input, "input");
  Device destination = capi::device_arg(output_device, "output_device");
  std::vector<Device> touched = capi::module_devices(*s.module(), capi::devices_of({x}, s.devices()));
  touched.push_back(destination);
  Tensor output = capi::in_stream_order(
      touched, [&] { return replica_set_apply(s, x, dim, destination, wrap_forward(fn, user_data)); });
  *out = capi::new_tensor_handle(output);
  DP_API_END
}

}  // extern "C"
