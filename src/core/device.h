// Devices: a type and an index. cpu:i is a logical device with its own
// allocations and worker thread; cuda:i is a GPU of this process.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dparallel {

// Values equal the C ABI's dp_device_type (and DLPack's).
enum class DeviceType : int32_t { kCpu = 1, kCuda = 2 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int32_t index = 0;

  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool is_cuda() const { return type == DeviceType::kCuda; }
  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
  bool operator!=(const Device& other) const { return !(*this == other); }
  bool operator<(const Device& other) const { return type != other.type ? type < other.type : index < other.index; }
};

std::string to_string(const Device& device);
// "cpu", "cpu:3", "cuda", "cuda:1"; throws kInvalidArgument naming `argument`.
Device parse_device(const std::string& text, const char* argument);
// Logical CPU devices allowed (DP_NUM_CPU_DEVICES, default 64).
int32_t cpu_device_count();
// GPUs present; 0 without CUDA.
int32_t cuda_device_count();
// Throws kInvalidArgument for an unknown type or negative index, kDevice for
// a device that is absent, naming `argument`.
Device check_device(int32_t type, int32_t index, const char* argument);
inline Device check_device(const Device& device, const char* argument) {
  return check_device(static_cast<int32_t>(device.type), device.index, argument);
}
// Throws kInvalidArgument naming the first repeat ("devices[0] and devices[2]
// are both cpu:0"): replicas sharing a device would share its one worker.
// `verb` joins the names to the device ("are both on" for tensors).
void check_distinct_devices(const std::vector<Device>& devices, const char* argument, const char* verb = "are both");

}  // namespace dparallel

template <>
struct std::hash<dparallel::Device> {
  size_t operator()(const dparallel::Device& d) const noexcept {
    return std::hash<int64_t>()((static_cast<int64_t>(d.type) << 32) | static_cast<uint32_t>(d.index));
  }
};
