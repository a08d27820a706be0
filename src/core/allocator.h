// Device memory with a per-device cache of freed blocks: large host buffers
// cost a page fault per 4 KiB on first touch, so collectives that allocate
// outputs every call reuse blocks instead of returning them to the system.
#pragma once

#include <cstddef>

#include "core/device_runtime.h"

namespace dparallel {

// Throws kOutOfMemory, or kDevice for a CUDA failure.
Allocation device_allocate(const Device& device, size_t nbytes);
void device_free(const Device& device, void* data, size_t nbytes) noexcept;
// Bytes held in caches of freed blocks, over all devices.
size_t cached_bytes();
// Returns every cached block to the system.
void release_cached_memory();

}  // namespace dparallel
