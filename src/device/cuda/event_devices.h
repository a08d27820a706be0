// The GPU of each event the library made, so that destroying, querying or
// waiting for one makes that GPU current first: the first CUDA call on a
// thread without a context would otherwise make one on GPU 0, for a rank
// that runs on another GPU (about 0.5 GB each). No CUDA here, so that a
// test runs it without a GPU.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace dparallel::cuda {

class EventDevices {
 public:
  void remember(void* event, int32_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    devices_[event] = index;
  }
  // -1 for an event this table does not know (not the library's).
  int32_t device_of(void* event) const noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = devices_.find(event);
    return it == devices_.end() ? -1 : it->second;
  }
  void forget(void* event) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    devices_.erase(event);
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<void*, int32_t> devices_;
};

}  // namespace dparallel::cuda
