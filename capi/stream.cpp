// dp_stream.h: current streams and the streams hosts make.
#include "core/stream.h"

#include "capi/capi_internal.h"
#include "core/device_runtime.h"
#include "dparallel/dp_stream.h"

using namespace dparallel;

extern "C" {

dp_status dp_set_current_stream(dp_device device, void* stream) {
  DP_API_BEGIN
  Device d = capi::device_arg(device, "device");
  device_runtime(d.type).check_stream(d.index, stream, "stream");
  set_current_stream(d, stream);
  DP_API_END
}

dp_status dp_get_current_stream(dp_device device, void** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = current_stream(capi::device_arg(device, "device"));
  DP_API_END
}

dp_status dp_stream_create(dp_device device, void** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  Device d = capi::device_arg(device, "device");
  *out = device_runtime(d.type).create_stream(d.index);
  DP_API_END
}

dp_status dp_stream_destroy(dp_device device, void* stream) {
  DP_API_BEGIN
  Device d = capi::device_arg(device, "device");
  if (stream == nullptr) return DP_OK;
  const DeviceRuntime& runtime = device_runtime(d.type);
  runtime.check_stream(d.index, stream, "stream");
  if (current_stream(d) == stream) set_current_stream(d, nullptr);
  runtime.destroy_stream(d.index, stream);
  DP_API_END
}

dp_status dp_stream_synchronize(dp_device device, void* stream) {
  DP_API_BEGIN
  Device d = capi::device_arg(device, "device");
  const DeviceRuntime& runtime = device_runtime(d.type);
  runtime.check_stream(d.index, stream, "stream");
  runtime.stream_synchronize(d.index, stream);
  DP_API_END
}

dp_status dp_stream_launch_host_func(dp_device device, void* stream, void (*fn)(void* user_data), void* user_data) {
  DP_API_BEGIN
  if (fn == nullptr) capi::null_argument("fn");
  Device d = capi::device_arg(device, "device");
  const DeviceRuntime& runtime = device_runtime(d.type);
  runtime.check_stream(d.index, stream, "stream");
  runtime.launch_host_func(d.index, stream, [fn, user_data, d, stream] {
    HostFunctionScope running(d, stream);
    fn(user_data);
  });
  DP_API_END
}

}  // extern "C"
