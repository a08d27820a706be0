#include "core/device.h"

#include <cstdlib>
#include <string>
#include <unordered_map>

#include "core/device_runtime.h"
#include "core/error.h"

namespace dparallel {

namespace {
constexpr int32_t kDefaultCpuDevices = 64;
constexpr int32_t kMaxCpuDevices = 4096;

int32_t read_cpu_device_count() {
  const char* text = std::getenv("DP_NUM_CPU_DEVICES");
  if (text == nullptr || *text == '\0') return kDefaultCpuDevices;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 1 || value > kMaxCpuDevices) return kDefaultCpuDevices;
  return static_cast<int32_t>(value);
}
}  // namespace

std::string to_string(const Device& device) {
  return str_cat(device.is_cuda() ? "cuda:" : device.is_cpu() ? "cpu:" : "device?:", device.index);
}

Device parse_device(const std::string& text, const char* argument) {
  Device device;
  std::string kind = text;
  std::string index_text;
  size_t colon = text.find(':');
  if (colon != std::string::npos) {
    kind = text.substr(0, colon);
    index_text = text.substr(colon + 1);
  }
  if (kind == "cpu") {
    device.type = DeviceType::kCpu;
  } else if (kind == "cuda") {
    device.type = DeviceType::kCuda;
  } else {
    fail_invalid("argument '", argument, "' is \"", text, "\": expected \"cpu\", \"cpu:N\", \"cuda\" or \"cuda:N\"");
  }
  if (colon == std::string::npos) return device;
  bool digits = !index_text.empty() && index_text.size() <= 9;
  for (char c : index_text) digits = digits && c >= '0' && c <= '9';
  if (!digits) {
    fail_invalid("argument '", argument, "' is \"", text, "\": the index after ':' must be a number 0..999999999");
  }
  device.index = static_cast<int32_t>(std::stol(index_text));
  return device;
}

int32_t cpu_device_count() {
  static const int32_t count = read_cpu_device_count();
  return count;
}

int32_t cuda_device_count() {
  const DeviceRuntime* runtime = find_device_runtime(DeviceType::kCuda);
  return runtime == nullptr ? 0 : runtime->device_count();
}

Device check_device(int32_t type, int32_t index, const char* argument) {
  if (type != static_cast<int32_t>(DeviceType::kCpu) && type != static_cast<int32_t>(DeviceType::kCuda)) {
    fail_invalid("argument '", argument, "' has device type ", type,
                 ", which is not a dp_device_type (1 = cpu, 2 = cuda)");
  }
  Device device{static_cast<DeviceType>(type), index};
  if (index < 0) fail_invalid("argument '", argument, "' has device index ", index, "; it must be >= 0");
  if (device.is_cpu()) {
    if (index >= cpu_device_count()) {
      fail_invalid("argument '", argument, "' is ", to_string(device), " but only ", cpu_device_count(),
                   " logical CPU devices are allowed (set DP_NUM_CPU_DEVICES for more)");
    }
  } else {
    const DeviceRuntime* runtime = find_device_runtime(device.type);
    if (runtime == nullptr) {
      fail(StatusCode::kDevice, "argument '", argument, "' is ", to_string(device), " but ",
           missing_runtime_reason(device.type));
    }
    int32_t gpus = runtime->device_count();
    if (index >= gpus) {
      fail(StatusCode::kDevice, "argument '", argument, "' is ", to_string(device), " but ",
           gpus == 0 ? std::string(runtime->unavailable_reason()) : str_cat("only ", gpus, " GPU(s) are present"));
    }
  }
  return device;
}

void check_distinct_devices(const std::vector<Device>& devices, const char* argument, const char* verb) {
  std::unordered_map<Device, size_t> first;
  for (size_t i = 0; i < devices.size(); ++i) {
    auto [it, inserted] = first.emplace(devices[i], i);
    if (!inserted) {
      fail_invalid(argument, "[", it->second, "] and ", argument, "[", i, "] ", verb, " ", to_string(devices[i]),
                   ": each replica needs a device of its own");
    }
  }
}

}  // namespace dparallel
