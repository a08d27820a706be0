// dp_base.h: status text, errors, version, devices, dtypes.
#include <cstring>

#include "capi/capi_internal.h"
#include "core/allocator.h"
#include "core/device_worker.h"
#include "core/thread_pool.h"
#include "device/cpu/cpu_streams.h"
#include "distributed/mpi/mpi_library.h"
#include "lane/comm_lane.h"

namespace dparallel::capi {
const char* last_error_text() noexcept;
}

using namespace dparallel;

static_assert(DP_OK == static_cast<int32_t>(StatusCode::kOk));
static_assert(DP_EINVAL == static_cast<int32_t>(StatusCode::kInvalidArgument));
static_assert(DP_ENOMEM == static_cast<int32_t>(StatusCode::kOutOfMemory));
static_assert(DP_EDEVICE == static_cast<int32_t>(StatusCode::kDevice));
static_assert(DP_ETIMEOUT == static_cast<int32_t>(StatusCode::kTimeout));
static_assert(DP_EREMOTE == static_cast<int32_t>(StatusCode::kRemote));
static_assert(DP_EUSER == static_cast<int32_t>(StatusCode::kUser));
static_assert(DP_EIO == static_cast<int32_t>(StatusCode::kIo));
static_assert(DP_ESTATE == static_cast<int32_t>(StatusCode::kState));
static_assert(DP_EUNSUPPORTED == static_cast<int32_t>(StatusCode::kUnsupported));
static_assert(DP_EINTERNAL == static_cast<int32_t>(StatusCode::kInternal));
static_assert(DP_DEVICE_CPU == static_cast<int32_t>(DeviceType::kCpu));
static_assert(DP_DEVICE_CUDA == static_cast<int32_t>(DeviceType::kCuda));
#define DP_CHECK_DTYPE_CODE(id, code, name, size, c_name) static_assert((c_name) == static_cast<int32_t>(DType::id));
DP_DTYPES(DP_CHECK_DTYPE_CODE)
#undef DP_CHECK_DTYPE_CODE

extern "C" {

const char* dp_status_string(dp_status status) {
  switch (status) {
    case DP_OK:
      return "ok";
    case DP_EINVAL:
      return "invalid argument";
    case DP_ENOMEM:
      return "out of memory";
    case DP_EDEVICE:
      return "device unavailable or driver failure";
    case DP_ETIMEOUT:
      return "timed out";
    case DP_EREMOTE:
      return "a peer failed or disconnected";
    case DP_EUSER:
      return "a host callback failed";
    case DP_EIO:
      return "I/O error or malformed data";
    case DP_ESTATE:
      return "call not valid in the current state";
    case DP_EUNSUPPORTED:
      return "not supported";
    case DP_EINTERNAL:
      return "internal error";
    default:
      return "unknown status";
  }
}

const char* dp_last_error(void) { return capi::last_error_text(); }

uint32_t dp_version_number(void) { return DP_VERSION_MAJOR * 10000u + DP_VERSION_MINOR * 100u + DP_VERSION_PATCH; }

dp_status dp_device_count(int32_t type, int32_t* out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  if (type == DP_DEVICE_CPU) {
    *out = cpu_device_count();
  } else if (type == DP_DEVICE_CUDA) {
    *out = cuda_device_count();
  } else {
    fail_invalid("argument 'type' is ", type, ", which is not a dp_device_type (1 = cpu, 2 = cuda)");
  }
  DP_API_END
}

dp_status dp_device_parse(const char* text, dp_device* out) {
  DP_API_BEGIN
  capi::require_arg(text, "text");
  capi::require_arg(out, "out");
  *out = capi::to_c(parse_device(text, "text"));
  DP_API_END
}

dp_status dp_device_format(dp_device device, char* buf, size_t cap) {
  DP_API_BEGIN
  capi::require_arg(buf, "buf");
  if (device.type != DP_DEVICE_CPU && device.type != DP_DEVICE_CUDA) {
    fail_invalid("argument 'device' has type ", device.type, ", which is not a dp_device_type (1 = cpu, 2 = cuda)");
  }
  if (device.index < 0) fail_invalid("argument 'device' has index ", device.index, "; it must be >= 0");
  std::string text = to_string(Device{static_cast<DeviceType>(device.type), device.index});
  if (cap < text.size() + 1) {
    fail_invalid("argument 'cap' is ", cap, " but \"", text, "\" needs ", text.size() + 1, " bytes");
  }
  std::memcpy(buf, text.c_str(), text.size() + 1);
  DP_API_END
}

dp_status dp_device_memory_stats(dp_device device, dp_memory_stats* out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  const MemoryUsage usage = memory_usage(capi::device_arg(device, "device"));
  dp_memory_stats full{};
  full.allocated_bytes = usage.in_use;
  full.peak_allocated_bytes = usage.peak;
  full.cached_bytes = cached_bytes();
  capi::write_stats(out, full);
  DP_API_END
}

dp_status dp_device_reset_peak_memory(dp_device device) {
  DP_API_BEGIN
  reset_peak_memory(capi::device_arg(device, "device"));
  DP_API_END
}

dp_status dp_shutdown(void) {
  DP_API_BEGIN
  stop_device_workers();  // first: a forward in flight may still compute and queue
  cpu::stop_default_streams();
  cpu::park_idle_streams();
  stop_compute_threads();
  lane::CommLane::park_idle_lanes();
  dist::MpiLibrary::finalize_if_ours();
  DP_API_END
}

size_t dp_dtype_size(int32_t dtype) { return dtype_is_valid(dtype) ? dtype_size(static_cast<DType>(dtype)) : 0; }

}  // extern "C"
