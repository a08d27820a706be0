#include "core/releasable_memory.h"

#include <condition_variable>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "core/stream.h"

namespace dparallel {

std::shared_ptr<ReleasableMemory> ReleasableMemory::reserve(const Device& device, size_t nbytes) {
  const DeviceRuntime& runtime = device_runtime(device.type);
  PageReservation r = runtime.reserve_pages(device.index, nbytes);
  // Until an object owns the range, a failure gives it back here; once one
  // does (a shared_ptr that fails to take it leaves it in the unique_ptr),
  // its destructor does.
  std::unique_ptr<ReleasableMemory> memory;
  try {
    memory.reset(new ReleasableMemory(device, r));
  } catch (...) {
    runtime.unreserve_pages(device.index, r);
    throw;
  }
  return std::shared_ptr<ReleasableMemory>(std::move(memory));
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

// Releases that wait for queued work, each on the work's events, in order,
// on one thread (made at the first): the caller of release() goes on.
class PendingReleases {
 public:
  struct Entry {
    // Kept alive by the entry: its destructor unmaps at once, which must
    // wait for the same work.
    std::shared_ptr<ReleasableMemory> memory;
    uint64_t generation = 0;
    std::vector<Event> after;
  };

  // Never destroyed: its thread may still wait when statics go at exit.
  static PendingReleases& instance() {
    static auto* releases = new PendingReleases();
    return *releases;
  }

  // Takes `entry` (left as it was where this throws: no thread to be had).
  void add(Entry& entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      std::thread([this] { run(); }).detach();
      started_ = true;
    }
    entries_.push_back(std::move(entry));
    wake_.notify_one();
  }

 private:
  PendingReleases() = default;

  [[noreturn]] void run() {
    for (;;) {
      Entry entry;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return !entries_.empty(); });
        entry = std::move(entries_.front());
        entries_.pop_front();
      }
      bool done = true;
      try {
        for (const Event& event : entry.after) event.synchronize();
      } catch (...) {
        done = false;
      }
      entry.after.clear();
      entry.memory->finish_release(entry.generation, done);
      entry.memory.reset();  // the last reference may go here, the work done
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> entries_;
  bool started_ = false;
};

void ReleasableMemory::release() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!reservation_.backed || !reservation_.releases || release_pending_) return;
  const DeviceRuntime* runtime = find_device_runtime(device_.type);
  if (runtime == nullptr) return;
  // Queued reads of the pages (the host's kernels, the library's copies)
  // must be done before they go.
  PendingReleases::Entry entry{nullptr, generation_ + 1, {}};
  bool recorded = false;
  try {
    if (runtime->default_stream_is_queued()) {
      entry.after.emplace_back(device_);
      entry.after.back().record(current_stream(device_));
    }
    if (runtime->library_work_is_queued()) {
      entry.after.emplace_back(device_);
      entry.after.back().record(runtime->library_stream(device_.index));
    }
    bool done = true;
    for (const Event& event : entry.after) done = done && event.query();
    recorded = true;
    if (!done) {
      entry.memory = shared_from_this();
      PendingReleases::instance().add(entry);
      generation_ = entry.generation;
      release_pending_ = true;
      return;
    }
  } catch (...) {
    if (!recorded) return;  // the pages stay
    // No thread for the wait: this one waits, as it must before the pages go.
    try {
      for (const Event& event : entry.after) event.synchronize();
    } catch (...) {
      return;
    }
  }
  give_back_locked();
}

void ReleasableMemory::finish_release(uint64_t generation, bool done) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!release_pending_ || generation != generation_) return;
  release_pending_ = false;
  if (done) give_back_locked();
}

void ReleasableMemory::give_back_locked() noexcept {
  const DeviceRuntime* runtime = find_device_runtime(device_.type);
  if (runtime == nullptr) return;
  runtime->release_pages(device_.index, reservation_);
  if (counted_ && !reservation_.backed) {
    uncount_outside_memory(device_, reservation_.nbytes);
    counted_ = false;
  }
}

void ReleasableMemory::back() {
  std::lock_guard<std::mutex> lock(mutex_);
  // A release still waiting never happens: the pages are still held.
  release_pending_ = false;
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
