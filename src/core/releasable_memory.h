// Memory that keeps one address for its whole life while its pages are
// given back and taken again: FSDP2 keeps one unsharded tensor per
// parameter and frees only its storage at reshard; a dp_fsdp's full
// parameters lie in one of these. Counted in the device's memory usage
// while its pages are held.
#pragma once

#include <cstddef>
#include <cstdint>
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
  // thread's current stream and on the library stream is done: at once
  // where it is, else on a thread of the library's that waits for it, so
  // that the caller never waits for the host's queued work. Nothing when
  // they are not held. A wait that fails keeps them.
  void release() noexcept;
  // Takes pages again (no-op while held; a release still waiting is called
  // off, and the pages stay).
  void back();
  // Held (a release still waiting included).
  bool backed() const;
  // Whether release gives pages back on this device (else it keeps them).
  bool releases() const { return reservation_.releases; }
  void* data() const { return reservation_.data; }
  size_t nbytes() const { return reservation_.nbytes; }
  const Device& device() const { return device_; }

 private:
  ReleasableMemory(const Device& device, PageReservation reservation);
  friend class PendingReleases;
  // The end of the release numbered `generation`, once what it waited for
  // is done (`done`) or failed: gives the pages back unless back() or the
  // destructor came first.
  void finish_release(uint64_t generation, bool done) noexcept;
  void give_back_locked() noexcept;

  Device device_;
  mutable std::mutex mutex_;
  PageReservation reservation_;
  bool counted_ = false;  // in the device's memory usage
  bool release_pending_ = false;
  uint64_t generation_ = 0;  // of the release pending, if any
};

}  // namespace dparallel
