#include "core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/stream.h"

namespace dparallel {

namespace {

// Blocks below this come from malloc and are not cached.
constexpr size_t kLargeBlock = size_t{64} << 10;
constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

size_t cache_limit_bytes() {
  static const size_t limit = [] {
    const char* text = std::getenv("DP_CACHE_LIMIT_MB");
    if (text != nullptr && *text != '\0') {
      char* end = nullptr;
      unsigned long long mb = std::strtoull(text, &end, 10);
      if (*end == '\0') return static_cast<size_t>(mb) << 20;
    }
    return static_cast<size_t>(1) << 30;
  }();
  return limit;
}

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

void release_pending_frees(const Device& device) noexcept;

// Freed large blocks of one device, keyed by rounded size.
class BlockCache {
 public:
  explicit BlockCache(Device device) : device_(device) {}
  ~BlockCache() { release(); }

  Allocation allocate(size_t rounded) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(rounded);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        total_cached().fetch_sub(rounded);
        return {p, false};
      }
    }
    return fresh(rounded);
  }

  void release_block(void* p, size_t rounded) {
    if (total_cached().load() + rounded <= cache_limit_bytes()) {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.emplace(rounded, p);
      total_cached().fetch_add(rounded);
      return;
    }
    unmap(p, rounded);
  }

  void release() {
    std::multimap<size_t, void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
    }
    for (auto& [bytes, p] : blocks) {
      total_cached().fetch_sub(bytes);
      unmap(p, bytes);
    }
  }

  static std::atomic<size_t>& total_cached() {
    static std::atomic<size_t> total{0};
    return total;
  }

 private:
  // Out of memory: the blocks freed while a stream still used them are
  // waited for, every cached block goes back to the device, and the
  // allocation is tried once more.
  Allocation fresh(size_t rounded) {
    const DeviceRuntime& runtime = device_runtime(device_.type);
    try {
      return runtime.allocate(device_.index, rounded);
    } catch (const Error& e) {
      if (e.code() != StatusCode::kOutOfMemory) throw;
    }
    release_pending_frees(device_);
    release();
    return runtime.allocate(device_.index, rounded);
  }

  void unmap(void* p, size_t rounded) noexcept {
    // A block exists only if its runtime allocated it.
    const DeviceRuntime* runtime = find_device_runtime(device_.type);
    if (runtime != nullptr) runtime->deallocate(device_.index, p, rounded);
  }

  Device device_;
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;
};

class CacheRegistry {
 public:
  BlockCache& of(const Device& device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = caches_[device];
    if (!slot) slot = std::make_unique<BlockCache>(device);
    return *slot;
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [device, cache] : caches_) cache->release();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<Device, std::unique_ptr<BlockCache>> caches_;
};

CacheRegistry& registry() {
  // Leaked on purpose: tensors may be freed from static destructors of hosts.
  static CacheRegistry* instance = new CacheRegistry();
  return *instance;
}

size_t block_size(const Device& device, size_t nbytes) {
  if (device.is_cpu()) return round_up(nbytes, nbytes >= kHugePage ? kHugePage : kPage);
  return round_up(nbytes, 512);
}

void free_now(const Device& device, void* data, size_t nbytes) noexcept {
  if (device.is_cpu() && nbytes < kLargeBlock) {
    std::free(data);
    return;
  }
  registry().of(device).release_block(data, block_size(device, nbytes));
}

// The events a freed block waits for: one on the freeing thread's stream,
// inside a LibraryWorkStaysQueued scope one on the scope's stream, and the
// uses recorded on its storage.
// Records `event` on `stream`; false where the stream is the legacy default
// stream and a blocking stream is being captured into a CUDA graph (the
// runtime refuses it then, to keep the host's capture valid).
bool record_unless_capturing(Event& event, void* stream) {
  try {
    event.record(stream);
    return true;
  } catch (const Error& error) {
    if (stream == nullptr && error.code() == StatusCode::kState) return false;
    throw;
  }
}

struct Passed {
  std::optional<Event> host, library;
  // Freed with no current stream during a capture: the event on the legacy
  // stream is recorded once the capture has ended. Recorded later, it
  // still follows every use queued before the free.
  std::optional<Device> host_deferred;
  std::vector<std::shared_ptr<const Event>> uses;
  // False while the deferred event cannot be recorded yet.
  bool recorded() {
    if (!host_deferred) return true;
    Event event(*host_deferred);
    if (!record_unless_capturing(event, nullptr)) return false;
    host.emplace(std::move(event));
    host_deferred.reset();
    return true;
  }
  bool query() {
    return recorded() && (!host || host->query()) && (!library || library->query()) &&
           std::all_of(uses.begin(), uses.end(), [](const auto& used) { return used->query(); });
  }
  void synchronize() const {
    if (host) host->synchronize();
    if (library) library->synchronize();
    for (const auto& used : uses) used->synchronize();
  }
};

// Blocks freed while a stream may still use them: each is released once
// the events recorded at the free have completed, so the next owner never
// writes what a queued kernel of the last one still reads.
class PendingFrees {
 public:
  // Holds no more than this many blocks before waiting for the oldest.
  static constexpr size_t kLimit = 4096;

  void add(const Device& device, void* data, size_t nbytes, Passed passed) {
    std::deque<Block> due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.push_back({device, data, nbytes, std::move(passed)});
      any_.store(true, std::memory_order_relaxed);
      if (blocks_.size() > kLimit) {
        // The oldest that can be waited for: during a capture the list
        // may outgrow the limit by the blocks freed meanwhile.
        auto oldest = std::find_if(blocks_.begin(), blocks_.end(), ready_to_wait);
        if (oldest != blocks_.end()) {
          due.push_back(std::move(*oldest));
          blocks_.erase(oldest);
        }
      }
      take_passed_locked(due);
    }
    release(due, true);
  }

  // Releases the blocks whose streams have passed them; with `all`, waits
  // for the others first. Costs one relaxed load while none is held.
  void drain(bool all) {
    if (!all && !any_.load(std::memory_order_relaxed)) return;
    std::deque<Block> due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (all) {
        take_locked(due, [](Block& b) { return ready_to_wait(b); });
      } else {
        take_passed_locked(due);
      }
      any_.store(!blocks_.empty(), std::memory_order_relaxed);
    }
    release(due, all);
  }

  // Waits for the blocks of `device` and releases them (out of memory
  // there: another device's blocks would not help, and its streams may
  // wait for this thread).
  void drain_device(const Device& device) {
    std::deque<Block> due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      take_locked(due, [&device](Block& b) { return b.device == device && ready_to_wait(b); });
      any_.store(!blocks_.empty(), std::memory_order_relaxed);
    }
    release(due, true);
  }

 private:
  struct Block {
    Device device;
    void* data;
    size_t nbytes;
    Passed passed;
  };

  // Whether a block's events can be waited for (a failing device: yes,
  // nothing more will run there).
  static bool ready_to_wait(Block& block) noexcept {
    try {
      return block.passed.recorded();
    } catch (...) {
      return true;
    }
  }

  static bool passed(Block& block) noexcept {
    try {
      return block.passed.query();
    } catch (...) {
      return true;
    }
  }

  // Moves the blocks `take` selects into `due`.
  template <typename Take>
  void take_locked(std::deque<Block>& due, Take take) noexcept {
    try {
      for (auto it = blocks_.begin(); it != blocks_.end();) {
        if (take(*it)) {
          due.push_back(std::move(*it));  // on a throw, nothing moved: the block stays listed
          it = blocks_.erase(it);
        } else {
          ++it;
        }
      }
    } catch (...) {
      // Out of memory for the list: release those taken so far.
    }
  }

  void take_passed_locked(std::deque<Block>& due) noexcept { take_locked(due, passed); }

  static void release(std::deque<Block>& due, bool wait) noexcept {
    for (Block& b : due) {
      if (wait) {
        try {
          b.passed.synchronize();
        } catch (...) {
        }
      }
      free_now(b.device, b.data, b.nbytes);
    }
  }

  std::mutex mutex_;
  std::deque<Block> blocks_;
  std::atomic<bool> any_{false};  // blocks_ is not empty (a hint read without the lock)
};

// Bytes in use per device: a fixed table, so that counting costs no lock.
class UsageTable {
 public:
  struct Counters {
    std::atomic<size_t> in_use{0};
    std::atomic<size_t> peak{0};
  };
  // Null for a device past the table (not counted).
  Counters* of(const Device& device) {
    const size_t kind = device.is_cpu() ? 0 : 1;
    if (device.index < 0 || static_cast<size_t>(device.index) >= kPerType) return nullptr;
    return &counters_[kind][static_cast<size_t>(device.index)];
  }
  void add(const Device& device, size_t nbytes) {
    Counters* c = of(device);
    if (c == nullptr) return;
    const size_t now = c->in_use.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
    size_t peak = c->peak.load(std::memory_order_relaxed);
    while (now > peak && !c->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void remove(const Device& device, size_t nbytes) {
    if (Counters* c = of(device)) c->in_use.fetch_sub(nbytes, std::memory_order_relaxed);
  }

  static constexpr size_t kPerType = 4096;

 private:
  Counters counters_[2][kPerType];
};

UsageTable& usage() {
  static UsageTable* instance = new UsageTable();  // leaked like the registry
  return *instance;
}

PendingFrees& pending_frees() {
  static PendingFrees* instance = new PendingFrees();  // leaked like the registry
  return *instance;
}

void release_pending_frees(const Device& device) noexcept {
  try {
    pending_frees().drain_device(device);
  } catch (...) {
    // No memory even for the list of blocks: the retry fails as it would.
  }
}

}  // namespace

Allocation device_allocate(const Device& device, size_t nbytes) {
  if (nbytes == 0) return {nullptr, true};
  pending_frees().drain(false);
  if (device.is_cpu() && nbytes < kLargeBlock) {
    void* p = std::aligned_alloc(64, round_up(nbytes, 64));
    if (p == nullptr) fail(StatusCode::kOutOfMemory, "could not allocate ", nbytes, " bytes on ", to_string(device));
    usage().add(device, nbytes);
    return {p, false};
  }
  Allocation a = registry().of(device).allocate(block_size(device, nbytes));
  usage().add(device, nbytes);
  return a;
}

void device_free(const Device& device, void* data, size_t nbytes,
                 std::vector<std::shared_ptr<const Event>> uses) noexcept {
  if (data == nullptr) return;
  usage().remove(device, nbytes);
  void* stream = current_stream(device);
  const DeviceRuntime* runtime = find_device_runtime(device.type);
  const bool host_queued = runtime != nullptr && (stream != nullptr || runtime->default_stream_is_queued());
  if (host_queued || (runtime != nullptr && !uses.empty())) {
    try {
      Passed passed;
      passed.uses = std::move(uses);
      if (host_queued) {
        Event host(device);
        if (record_unless_capturing(host, stream)) {
          passed.host.emplace(std::move(host));
        } else {
          passed.host_deferred = device;
        }
      }
      // Elsewhere the library's work is done when its call returns.
      if (void* queued = library_stream_override(device); queued != nullptr && queued != stream) {
        passed.library.emplace(device);
        passed.library->record(queued);
      }
      pending_frees().add(device, data, nbytes, std::move(passed));
      return;
    } catch (...) {
      // No event to wait on: the device failed; free as before.
    }
  }
  free_now(device, data, nbytes);
}

void count_outside_memory(const Device& device, size_t nbytes) { usage().add(device, nbytes); }

void uncount_outside_memory(const Device& device, size_t nbytes) noexcept { usage().remove(device, nbytes); }

size_t cached_bytes() { return BlockCache::total_cached().load(); }

MemoryUsage memory_usage(const Device& device) {
  MemoryUsage out;
  if (UsageTable::Counters* c = usage().of(device)) {
    out.in_use = c->in_use.load(std::memory_order_relaxed);
    out.peak = c->peak.load(std::memory_order_relaxed);
  }
  return out;
}

void reset_peak_memory(const Device& device) {
  if (UsageTable::Counters* c = usage().of(device)) c->peak.store(c->in_use.load(std::memory_order_relaxed));
}

void release_cached_memory() {
  pending_frees().drain(true);
  registry().release_all();
}

}  // namespace dparallel
