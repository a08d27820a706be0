#include "core/releasable_memory.h"

#include "core/allocator.h"
#include "core/stream.h"

namespace dparallel {

std::shared_ptr<ReleasableMemory> ReleasableMemory::reserve(const Device& device, size_t nbytes) {
  const DeviceRuntime& runtime = device_runtime(device.type);
  PageReservation r = runtime.reserve_pages(device.index, nbytes);
  return std::shared_ptr<ReleasableMemory>(new ReleasableMemory(device, r));
}

ReleasableMemory::ReleasableMemory(const Device& device, PageReservation reservation)
    : device_(device), reservation_(reservation) {
  count_outside_memory(device_, reservation_.nbytes);
  counted_ = true;
}

ReleasableMemory::~ReleasableMemory() {
  if (counted_) uncount_outside_memory(device_, reservation_.nbytes);
  if (const DeviceRuntime* runtime = find_device_runtime(device_.type)) {
    runtime->unreserve_pages(device_.index, reservation_);
  }
}

std::shared_ptr<Storage> ReleasableMemory::storage() {
  std::shared_ptr<ReleasableMemory> self = shared_from_this();
  return Storage::wrap(device_, reservation_.data, reservation_.nbytes, [self](void*) {});
}

void ReleasableMemory::release() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!reservation_.backed || !reservation_.releases) return;
  const DeviceRuntime* runtime = find_device_runtime(device_.type);
  if (runtime == nullptr) return;
  try {
    // Queued reads of the pages (the host's kernels, the library's copies)
    // must be done before they go.
    if (runtime->default_stream_is_queued()) {
      Event host(device_);
      host.record(current_stream(device_));
      host.synchronize();
    }
    if (runtime->library_work_is_queued()) {
      Event library(device_);
      library.record(runtime->library_stream(device_.index));
      library.synchronize();
    }
  } catch (...) {
    return;
  }
  runtime->release_pages(device_.index, reservation_);
  if (counted_ && !reservation_.backed) {
    uncount_outside_memory(device_, reservation_.nbytes);
    counted_ = false;
  }
}

void ReleasableMemory::back() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (reservation_.backed) return;
  device_runtime(device_.type).back_pages(device_.index, reservation_);
  if (!counted_) {
    count_outside_memory(device_, reservation_.nbytes);
    counted_ = true;
  }
}

bool ReleasableMemory::backed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reservation_.backed;
}

}  // namespace dparallel
