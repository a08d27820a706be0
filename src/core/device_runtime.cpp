#include "core/device_runtime.h"

#include <array>
#include <atomic>

#include "core/error.h"

namespace dparallel {

namespace {

// Indexed by the DeviceType value. Constant-initialised and trivially
// destroyed, so registration during static initialisation and lookups from
// static destructors are both safe.
constexpr size_t kSlots = 8;
std::array<std::atomic<const DeviceRuntime*>, kSlots> g_runtimes{};

std::atomic<const DeviceRuntime*>* slot_of(DeviceType type) noexcept {
  auto index = static_cast<size_t>(static_cast<int32_t>(type));
  return index < kSlots ? &g_runtimes[index] : nullptr;
}

}  // namespace

PageReservation DeviceRuntime::reserve_pages(int32_t index, size_t nbytes) const {
  PageReservation r;
  r.data = allocate(index, nbytes).data;
  r.nbytes = r.reserved = nbytes;
  r.backed = true;
  return r;
}

void DeviceRuntime::release_pages(int32_t, PageReservation&) const noexcept {}

void DeviceRuntime::back_pages(int32_t, PageReservation& r) const { r.backed = true; }

void DeviceRuntime::unreserve_pages(int32_t index, PageReservation& r) const noexcept {
  if (r.data != nullptr) deallocate(index, r.data, r.reserved);
  r = PageReservation{};
}

void register_device_runtime(DeviceType type, const DeviceRuntime* runtime) {
  std::atomic<const DeviceRuntime*>* slot = slot_of(type);
  if (slot == nullptr) fail(StatusCode::kInternal, "device type ", static_cast<int32_t>(type), " has no runtime slot");
  slot->store(runtime, std::memory_order_release);
}

const DeviceRuntime* find_device_runtime(DeviceType type) noexcept {
  std::atomic<const DeviceRuntime*>* slot = slot_of(type);
  return slot == nullptr ? nullptr : slot->load(std::memory_order_acquire);
}

std::string missing_runtime_reason(DeviceType type) {
  switch (type) {
    case DeviceType::kCpu:
      return "no runtime is registered for cpu devices (the cpu backend is not linked in)";
    case DeviceType::kCuda:
      return "no runtime is registered for cuda devices: dparallel was built without CUDA support";
  }
  return str_cat("no runtime is registered for device type ", static_cast<int32_t>(type));
}

const DeviceRuntime& device_runtime(DeviceType type) {
  const DeviceRuntime* runtime = find_device_runtime(type);
  if (runtime == nullptr) fail(StatusCode::kDevice, missing_runtime_reason(type));
  return *runtime;
}

const DeviceRuntime& copy_runtime(const Device& dst, const Device& src) {
  return device_runtime(dst.is_cpu() ? src.type : dst.type);
}

}  // namespace dparallel
