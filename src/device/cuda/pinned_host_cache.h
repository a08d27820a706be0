// Pinned host blocks kept for reuse: cudaMallocHost and cudaFreeHost may wait
// for every kernel on the device, another NCCL group's kernel spinning for a
// peer among them, so a group's create and destroy take and give blocks
// here instead. Blocks are never given back to CUDA (a few KiB each). No
// CUDA here: the allocation is passed in, so that a test runs it without a GPU.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

namespace dparallel::cuda {

class PinnedHostCache {
 public:
  // A block of at least `nbytes`: a kept one of its size class, else
  // allocate(bytes, &block) for a new one (which may throw). Size classes
  // are powers of two from 4 KiB, so that groups of different sizes share.
  template <typename Allocate>
  void* take(size_t nbytes, Allocate&& allocate) {
    const size_t bytes = size_class(nbytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<void*>& kept = free_[bytes];
      if (!kept.empty()) {
        void* block = kept.back();
        kept.pop_back();
        sizes_[block] = bytes;
        return block;
      }
    }
    void* block = allocate(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[block] = bytes;
    return block;
  }

  // Keeps a block take() gave for the next take of its class; others
  // (null, unknown) are ignored.
  void give(void* block) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(block);
    if (it == sizes_.end()) return;
    try {
      free_[it->second].push_back(block);
    } catch (...) {
      // No room to keep it: it stays allocated, unused, as kept ones do.
    }
    sizes_.erase(it);
  }

  static size_t size_class(size_t nbytes) {
    size_t bytes = 4096;
    while (bytes < nbytes) bytes *= 2;
    return bytes;
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;  // by size class
  std::map<void*, size_t> sizes_;              // handed out, with their class
};

}  // namespace dparallel::cuda
