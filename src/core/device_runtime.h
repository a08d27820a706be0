// The per-device runtime the core stands on: memory, copies, fills and the
// current device, one implementation per device type. Each backend registers
// its own (as c10 registers a DeviceGuardImplInterface per device type), so
// the core never includes a backend and links without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device.h"

namespace dparallel {

struct Allocation {
  void* data = nullptr;
  bool zeroed = false;  // memory is known to hold zeros (fresh pages)
};

class DeviceRuntime {
 public:
  DeviceRuntime() = default;
  virtual ~DeviceRuntime() = default;
  DeviceRuntime(const DeviceRuntime&) = delete;
  DeviceRuntime& operator=(const DeviceRuntime&) = delete;

  // Devices of this type that can be used; may be 0.
  virtual int32_t device_count() const = 0;
  // Why device_count() is 0 (no GPU, the driver's error, ...).
  virtual const char* unavailable_reason() const = 0;
  // Makes device `index` current on the calling thread; throws kDevice.
  virtual void set_device(int32_t index) const = 0;
  // nbytes (> 0) of memory on device `index`; throws kOutOfMemory or kDevice.
  virtual Allocation allocate(int32_t index, size_t nbytes) const = 0;
  // Returns what allocate(index, nbytes) gave.
  virtual void deallocate(int32_t index, void* data, size_t nbytes) const noexcept = 0;
  virtual void fill_zero(int32_t index, void* data, size_t nbytes) const = 0;
  // rows x row_bytes from src to dst, rows `pitch` bytes apart; each side is
  // a device of this type or the host (cpu). Returns when done.
  virtual void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src,
                         const Device& src_device, size_t src_pitch, size_t row_bytes, size_t rows) const = 0;
};

// Installs `runtime` for `type`, replacing any (nullptr removes it). It must
// outlive every use: backends register objects that live as long as the
// process.
void register_device_runtime(DeviceType type, const DeviceRuntime* runtime);
// The runtime registered for `type`, or nullptr.
const DeviceRuntime* find_device_runtime(DeviceType type) noexcept;
// The runtime registered for `type`; throws kDevice when there is none.
const DeviceRuntime& device_runtime(DeviceType type);
// Why `type` has no runtime, for messages that name the device asked for.
std::string missing_runtime_reason(DeviceType type);
// The runtime that copies between the two: the non-host side's, or the
// host's when both are host memory.
const DeviceRuntime& copy_runtime(const Device& dst, const Device& src);

}  // namespace dparallel
