// Memory that keeps one address for its whole life while its pages are
// given back and taken again: FSDP2 keeps one unsharded tensor per
// parameter and frees only its storage at reshard; a dp_fsdp's full
// parameters lie in one of these. Counted in the device's memory usage
// while its pages are held.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>

#include "core/device_runtime.h"
#include "core/tensor.h"

namespace dparallel {

class ReleasableMemory : public std::enable_shared_from_this<ReleasableMemory> {
 public:
  // nbytes (> 0) on `device`, backed on return; throws kOutOfMemory or kDevice.
  static std::shared_ptr<ReleasableMemory> reserve(const Device& device, size_t nbytes);
  ~ReleasableMemory();
  ReleasableMemory(const ReleasableMemory&) = delete;
  ReleasableMemory& operator=(const ReleasableMemory&) = delete;

  // A storage over the whole range that keeps this memory reserved.
  std::shared_ptr<Storage> storage();
  // Gives the pages back once the work queued so far on the calling
  // thread's current stream and on the library stream is done (it waits
  // for both on the host where the device queues work). Nothing when they
  // are not held. A wait that fails keeps them.
  void release() noexcept;
  // Takes pages again (no-op while held).
  void back();
  bool backed() const;
  // Whether release gives pages back on this device (else it keeps them).
  bool releases() const { return reservation_.releases; }
  void* data() const { return reservation_.data; }
  size_t nbytes() const { return reservation_.nbytes; }
  const Device& device() const { return device_; }

 private:
  ReleasableMemory(const Device& device, PageReservation reservation);

  Device device_;
  mutable std::mutex mutex_;
  PageReservation reservation_;
  bool counted_ = false;  // in the device's memory usage
};

}  // namespace dparallel
