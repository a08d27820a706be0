// Device memory with a per-device cache of freed blocks: large host buffers
// cost a page fault per 4 KiB on first touch, so collectives that allocate
// outputs every call reuse blocks instead of returning them to the system.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/device_runtime.h"

namespace dparallel {

// Throws kOutOfMemory, or kDevice for a CUDA failure.
Allocation device_allocate(const Device& device, size_t nbytes);
class Event;
// The block is reused once the freeing thread's stream, and each of `uses`
// (Storage::record_use), has passed it.
void device_free(const Device& device, void* data, size_t nbytes,
                 std::vector<std::shared_ptr<const Event>> uses = {}) noexcept;
// What a device's tensors hold now and at most since the last reset
// (requested bytes, counted at allocation and free).
struct MemoryUsage {
  size_t in_use = 0;
  size_t peak = 0;
};
MemoryUsage memory_usage(const Device& device);
// Memory a device's tensors may occupy that the allocator did not hand out
// (a process group's shared regions): counted in use while held.
void count_outside_memory(const Device& device, size_t nbytes);
void uncount_outside_memory(const Device& device, size_t nbytes) noexcept;
void reset_peak_memory(const Device& device);
// Bytes held in caches of freed blocks, over all devices.
size_t cached_bytes();
// Returns every cached block to the system.
void release_cached_memory();

}  // namespace dparallel
