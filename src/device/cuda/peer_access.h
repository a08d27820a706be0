// Which GPU pairs have peer access: enabled once per pair, remembered for the
// process, whichever threads ask. No CUDA here, so that a test runs it
// without a GPU.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace dparallel::cuda {

class PeerAccessTable {
 public:
  // Whether GPU `from` reaches `to`'s memory directly. The first call for a
  // pair runs enable(from, to) and keeps its answer; calls for that pair from
  // other threads wait for it. A throwing enable records nothing, so the next
  // call tries again.
  template <typename Enable>
  bool ensure(int32_t from, int32_t to, Enable&& enable) {
    if (from == to) return true;
    std::lock_guard<std::mutex> lock(mutex_);
    auto key = std::make_pair(from, to);
    auto it = pairs_.find(key);
    if (it != pairs_.end()) return it->second;
    bool enabled = enable(from, to);
    pairs_.emplace(key, enabled);
    return enabled;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<int32_t, int32_t>, bool> pairs_;
};

}  // namespace dparallel::cuda
