#include "device/cpu/cpu_streams.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/process_origin.h"
#include "core/thread_name.h"

namespace dparallel::cpu {

namespace {

int64_t async_delay_us() {
  static const int64_t delay = [] {
    const char* text = std::getenv("DP_CPU_ASYNC_DELAY_US");
    if (text == nullptr || *text == '\0') return int64_t{500};
    char* end = nullptr;
    long long us = std::strtoll(text, &end, 10);
    return *end == '\0' && us >= 0 ? static_cast<int64_t>(us) : int64_t{500};
  }();
  return delay;
}

// A FIFO of host tasks run by one thread, in order.
class Stream {
 public:
  Stream(int32_t index, int64_t max_delay_us) : index_(index), max_delay_us_(max_delay_us) {
    std::lock_guard<std::mutex> lock(mutex_);
    start_locked();
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (!thread_.joinable()) return;  // parked
    if (origin_.is_current())
      thread_.join();
    else
      thread_.detach();  // a forked child has no such thread
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int32_t index() const { return index_; }
  bool runs_on_this_thread() const { return std::this_thread::get_id() == worker_.load(); }

  void push(std::function<void()> task) {
    origin_.check("a cpu stream");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
      ++pushed_;
      start_locked();
    }
    wake_.notify_all();
  }

  // dp_shutdown: ends the thread of a stream with nothing queued or running
  // (joins it); the next push starts another. False when it is at work or
  // this is its thread.
  bool park() {
    std::thread ending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable() || runs_on_this_thread() || !queue_.empty() || done_ != pushed_) return false;
      ++generation_;  // the thread sees it is no longer the stream's and ends
      ending = std::move(thread_);
    }
    wake_.notify_all();
    ending.join();
    return true;
  }

  void synchronize() {
    origin_.check("a cpu stream");
    if (runs_on_this_thread()) {
      fail(StatusCode::kState, "a host function waited for its own cpu stream, which would wait for itself");
    }
    std::unique_lock<std::mutex> lock(mutex_);
    uint64_t target = pushed_;
    done_changed_.wait(lock, [&] { return done_ >= target; });
  }

 private:
  // mutex_ held.
  void start_locked() {
    if (thread_.joinable()) return;
    thread_ = std::thread([this, generation = generation_] { loop(generation); });
  }

  void loop(uint64_t generation) {
    name_this_thread("dp-stream cpu:" + std::to_string(index_));
    worker_.store(std::this_thread::get_id());
    std::mt19937_64 random(std::random_device{}());
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != generation || !queue_.empty(); });
        if (generation_ != generation) return;  // parked: a newer thread, if any, runs the queue
        if (queue_.empty()) return;             // stopping, and everything ran
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      if (max_delay_us_ > 0) {
        std::uniform_int_distribution<int64_t> delay(0, max_delay_us_);
        std::this_thread::sleep_for(std::chrono::microseconds(delay(random)));
      }
      task();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++done_;
      }
      done_changed_.notify_all();
    }
  }

  const int32_t index_;
  const int64_t max_delay_us_;
  ProcessOrigin origin_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_changed_;
  std::deque<std::function<void()>> queue_;
  uint64_t pushed_ = 0;
  uint64_t done_ = 0;
  bool stopping_ = false;
  uint64_t generation_ = 0;  // which thread is the stream's: park() moves it on
  std::atomic<std::thread::id> worker_{};
  std::thread thread_;
};

// Live streams by handle: every use looks its stream up, so a handle
// destroyed while still current somewhere is an error, not a dangling
// pointer, and a use in flight keeps its stream alive.
struct StreamRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, std::shared_ptr<Stream>> live;
};

StreamRegistry& registry() {
  static StreamRegistry* instance = new StreamRegistry();  // outlives hosts' static destructors
  return *instance;
}

// The default streams of the asynchronous mode, one per device, made on
// first use and kept until stop_default_streams.
struct DefaultStreams {
  std::mutex mutex;
  std::vector<std::shared_ptr<Stream>> streams;
};
DefaultStreams& default_streams() {
  static auto* instance = new DefaultStreams();  // outlives hosts' static destructors
  return *instance;
}

std::shared_ptr<Stream> default_stream(int32_t index) {
  DefaultStreams& all = default_streams();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto slot = static_cast<size_t>(index);
  if (all.streams.size() <= slot) all.streams.resize(slot + 1);
  std::shared_ptr<Stream>& stream = all.streams[slot];
  if (!stream) stream = std::make_shared<Stream>(index, async_delay_us());
  return stream;
}

std::shared_ptr<Stream> live_stream(const void* stream) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  auto it = registry().live.find(stream);
  return it == registry().live.end() ? nullptr : it->second;
}

// The queue behind `stream`, or null where work runs on the calling thread.
std::shared_ptr<Stream> queue_of(int32_t index, void* stream) {
  if (stream == nullptr) return async_mode() ? default_stream(index) : nullptr;
  std::shared_ptr<Stream> queue = live_stream(stream);
  if (!queue) {
    fail(StatusCode::kInvalidArgument,
         "a cpu stream that was destroyed (or never made by dp_stream_create) is used "
         "as a stream of cpu:",
         index, "; clear it with dp_set_current_stream(device, NULL) before destroying it");
  }
  return queue;
}

// Generations: record() bumps `recorded`; the task it queues raises
// `completed` to that generation when the stream gets there.
struct Event {
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t recorded = 0;
  uint64_t completed = 0;
  // The generation a stream's own thread (a host function) recorded behind
  // itself: that thread waiting for it would wait forever.
  uint64_t behind_recorder = 0;
  std::thread::id recorder;

  void complete(uint64_t generation) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (generation > completed) completed = generation;
    }
    changed.notify_all();
  }
  // kState where the calling thread would wait for work queued behind the
  // task it is running.
  void refuse_waiting_for_itself(uint64_t generation) {
    std::lock_guard<std::mutex> lock(mutex);
    if (completed < generation && generation == behind_recorder && recorder == std::this_thread::get_id()) {
      fail(StatusCode::kState,
           "a host function waited for an event it recorded on its own cpu stream, which would wait for itself");
    }
  }
  void wait_for(uint64_t generation) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return completed >= generation; });
  }
};

// What a handle points at: the event is shared with the tasks that complete
// or wait for it, so destroying the handle early is safe.
struct EventHandle {
  std::shared_ptr<Event> event = std::make_shared<Event>();
};

std::shared_ptr<Event> event_of(void* handle) { return static_cast<EventHandle*>(handle)->event; }

}  // namespace

bool async_mode() {
  static const bool on = [] {
    const char* text = std::getenv("DP_CPU_ASYNC");
    return text != nullptr && text[0] == '1' && text[1] == '\0';
  }();
  return on;
}

void* create_stream(int32_t index) {
  auto stream = std::make_shared<Stream>(index, async_mode() ? async_delay_us() : 0);
  void* handle = stream.get();
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().live.emplace(handle, std::move(stream));
  return handle;
}

void destroy_stream(void* stream) noexcept {
  if (stream == nullptr) return;
  std::shared_ptr<Stream> dying;
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    auto it = registry().live.find(stream);
    if (it == registry().live.end()) return;
    dying = std::move(it->second);
    registry().live.erase(it);
  }
  // The last reference runs what was queued, then joins: here, or in a use
  // still in flight on another thread. A host function destroying its own
  // stream cannot join its own thread: another thread does, once it ends.
  if (dying->runs_on_this_thread()) std::thread([stream = std::move(dying)]() mutable { stream.reset(); }).detach();
}

void check_stream(int32_t index, void* stream, const char* argument) {
  if (stream == nullptr) return;
  std::shared_ptr<Stream> queue = live_stream(stream);
  int32_t owner = queue ? queue->index() : -1;
  if (owner < 0) {
    fail(StatusCode::kInvalidArgument, "argument '", argument,
         "' is not a live cpu stream (one from dp_stream_create, not yet destroyed)");
  }
  if (owner != index) {
    fail(StatusCode::kInvalidArgument, "argument '", argument, "' is a stream of cpu:", owner, ", not of cpu:", index);
  }
}

void stream_synchronize(int32_t index, void* stream) {
  if (std::shared_ptr<Stream> queue = queue_of(index, stream)) queue->synchronize();
}

void launch_host_func(int32_t index, void* stream, std::function<void()> fn) {
  std::shared_ptr<Stream> queue = queue_of(index, stream);
  if (queue == nullptr) {
    fn();
    return;
  }
  queue->push(std::move(fn));
}

void park_idle_streams() {
  std::vector<std::shared_ptr<Stream>> live;
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    for (const auto& [handle, stream] : registry().live) live.push_back(stream);
  }
  for (const auto& stream : live) stream->park();
}

void stop_default_streams() {
  std::vector<std::shared_ptr<Stream>> stopping;
  {
    DefaultStreams& all = default_streams();
    std::lock_guard<std::mutex> lock(all.mutex);
    for (const std::shared_ptr<Stream>& stream : all.streams) {
      if (stream && stream->runs_on_this_thread()) {
        fail(StatusCode::kState, "the default stream of cpu:", stream->index(),
             " cannot be stopped by a host function running on it; call it from the host's own thread");
      }
    }
    stopping.swap(all.streams);
  }
  // Each runs what it holds, then joins: here, or in a use still in flight.
}

void* create_event() { return new EventHandle(); }

void destroy_event(void* event) noexcept { delete static_cast<EventHandle*>(event); }

void record_event(void* event, int32_t index, void* stream) {
  std::shared_ptr<Stream> queue = queue_of(index, stream);  // may throw: before the event changes
  std::shared_ptr<Event> e = event_of(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = ++e->recorded;
    if (queue != nullptr && queue->runs_on_this_thread()) {
      e->behind_recorder = generation;
      e->recorder = std::this_thread::get_id();
    }
  }
  if (queue == nullptr) {
    e->complete(generation);  // the calling thread is the stream: all it queued is done
    return;
  }
  queue->push([e, generation] { e->complete(generation); });
}

void stream_wait_event(int32_t index, void* stream, void* event) {
  std::shared_ptr<Stream> queue = queue_of(index, stream);
  std::shared_ptr<Event> e = event_of(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = e->recorded;
  }
  if (queue == nullptr) {
    e->refuse_waiting_for_itself(generation);
    e->wait_for(generation);  // the calling thread is the stream
    return;
  }
  queue->push([e, generation] { e->wait_for(generation); });
}

bool event_query(void* event) {
  std::shared_ptr<Event> e = event_of(event);
  std::lock_guard<std::mutex> lock(e->mutex);
  return e->completed >= e->recorded;
}

void event_synchronize(void* event) {
  std::shared_ptr<Event> e = event_of(event);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = e->recorded;
  }
  e->refuse_waiting_for_itself(generation);
  e->wait_for(generation);
}

}  // namespace dparallel::cpu
