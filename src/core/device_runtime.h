// The per-device runtime the core stands on: memory, copies, fills, the
// current device, streams and events, one implementation per device type.
// Each backend registers its own (as c10 registers a
// DeviceGuardImplInterface per device type), so the core never includes a
// backend and links without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "core/device.h"

namespace dparallel {

struct Allocation {
  void* data = nullptr;
  bool zeroed = false;  // memory is known to hold zeros (fresh pages)
};

// Address space whose pages can be given back and filled again while its
// addresses stay (a dp_fsdp's full parameters).
struct PageReservation {
  void* data = nullptr;
  size_t nbytes = 0;      // what was asked for
  size_t reserved = 0;    // the range's size (rounded up to the device's granularity)
  uint64_t handle = 0;    // the device's own (cuda: the physical memory mapped there)
  bool releases = false;  // false: release_pages keeps the pages (no support on this device)
  bool backed = false;    // pages are there (after reserve and back_pages)
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
  // nbytes (> 0) of address space on device `index`, backed on return. The
  // default, for a device without a way to release pages at a fixed
  // address: allocate(), and release_pages keeps them (releases = false).
  virtual PageReservation reserve_pages(int32_t index, size_t nbytes) const;
  // Gives the pages back; the addresses stay reserved. The caller has made
  // sure no queued work still uses them. cpu: later reads see zeros; cuda:
  // nothing may touch them until back_pages.
  virtual void release_pages(int32_t index, PageReservation& r) const noexcept;
  // Backs the range with pages again (cpu: zeros on first touch); throws
  // kOutOfMemory or kDevice.
  virtual void back_pages(int32_t index, PageReservation& r) const;
  // Releases the pages and the address range.
  virtual void unreserve_pages(int32_t index, PageReservation& r) const noexcept;
  // rows x row_bytes from src to dst, rows `pitch` bytes apart; each side is
  // a device of this type or the host (cpu). Returns when done.
  virtual void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src,
                         const Device& src_device, size_t src_pitch, size_t row_bytes, size_t rows) const = 0;

  // ---- streams and events: every ordering decision goes through these ----
  // A stream is an opaque pointer: a cudaStream_t for cuda, a queue the cpu
  // runtime made for cpu; nullptr is the device's legacy default stream
  // (for cpu in the synchronous mode, the calling thread itself).

  // True when the library's own work on this device (copies, sums) is
  // queued on library_stream() and may still run after the call that queued
  // it returned; false when it runs on the calling thread and is done when
  // the call returns (cpu).
  virtual bool library_work_is_queued() const = 0;
  // True when host-visible streams exist as queues that run later (cuda;
  // cpu with DP_CPU_ASYNC=1): work on the default stream may be pending.
  virtual bool default_stream_is_queued() const = 0;
  // The stream the library queues its own work on, for device `index`.
  virtual void* library_stream(int32_t index) const = 0;
  virtual void* create_stream(int32_t index) const = 0;
  // kInvalidArgument naming `argument` unless `stream` can be used as a
  // stream of device `index` (nullptr always can).
  virtual void check_stream(int32_t index, void* stream, const char* argument) const = 0;
  // Waits for the stream's queued work, then frees it.
  virtual void destroy_stream(int32_t index, void* stream) const noexcept = 0;
  virtual void stream_synchronize(int32_t index, void* stream) const = 0;
  // Runs `fn` on a host thread once the work queued before it on `stream` is
  // done; work queued after it waits for it. `fn` must not throw.
  virtual void launch_host_func(int32_t index, void* stream, std::function<void()> fn) const = 0;

  // An event completes once the work queued on its stream before its last
  // record has; one never recorded is complete.
  virtual void* create_event(int32_t index) const = 0;
  virtual void destroy_event(void* event) const noexcept = 0;
  virtual void record_event(void* event, int32_t index, void* stream) const = 0;
  // Work queued on `stream` after this call starts after `event` completes;
  // it never blocks the caller where the device has queues of its own.
  virtual void stream_wait_event(int32_t index, void* stream, void* event) const = 0;
  virtual bool event_query(void* event) const = 0;
  virtual void event_synchronize(void* event) const = 0;
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
