// The collectives a backend queued on its device and returned from without
// waiting (QueuedTransfers): a thread polls each one's end event, in queue
// order, and the communicator's asynchronous error, and at the first failure
// or passed deadline reports it once (the backend aborts its communicator
// then, which ends the stuck kernels, so a dead peer cannot hang the host's
// stream). Nothing here includes CUDA or NCCL: the backend passes its
// queries in, and a test drives every outcome without a GPU.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "core/process_origin.h"

namespace dparallel::dist {

class QueuedWatch {
 public:
  using Clock = std::chrono::steady_clock;
  // An end event's state: done, busy, or an error code (> 0).
  static constexpr int kDone = 0;
  static constexpr int kBusy = -1;

  struct Failure {
    enum class Kind { kEventError, kAsyncError, kTimeout };
    Kind kind = Kind::kTimeout;
    int code = 0;      // the event's or the communicator's error; 0 for a timeout
    std::string what;  // the collective, as add() named it
  };
  struct Hooks {
    std::function<int(void* event)> query;  // kDone, kBusy or an error
    std::function<int()> async_error;       // 0 or the communicator's error
    std::function<void(const Failure&)> on_failure;
    std::function<void(void* event)> release;  // the watch is done with the event
    std::function<void()> on_start;            // on the watch's thread, before it polls
  };

  QueuedWatch(Hooks hooks, Clock::duration poll) : hooks_(std::move(hooks)), poll_(poll) {}
  ~QueuedWatch() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) {
      if (origin_.is_current()) {
        thread_.join();
      } else {
        thread_.detach();  // a forked child: the thread is its parent's
      }
    }
    for (Entry& e : entries_) hooks_.release(e.event);
  }
  QueuedWatch(const QueuedWatch&) = delete;
  QueuedWatch& operator=(const QueuedWatch&) = delete;

  // Watches `event`, recorded after the collective `what`, until `deadline`.
  // After a failure was reported the event is released at once.
  void add(void* event, Clock::time_point deadline, std::string what) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (failed_) {
      lock.unlock();
      hooks_.release(event);
      return;
    }
    entries_.push_back({event, deadline, std::move(what)});
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_all();
  }

  bool failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_;
  }
  size_t pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

 private:
  struct Entry {
    void* event;
    Clock::time_point deadline;
    std::string what;
  };

  void loop() {
    if (hooks_.on_start) hooks_.on_start();
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !entries_.empty(); });
      if (stopping_) return;
      lock.unlock();
      const bool go_on = poll_once();
      lock.lock();
      if (!go_on) return;
      if (!entries_.empty()) cv_.wait_for(lock, poll_, [&] { return stopping_; });
    }
  }

  // Retires the finished collectives at the front; false after a failure.
  bool poll_once() {
    for (;;) {
      Entry front;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (entries_.empty() || stopping_) return true;
        front = entries_.front();
      }
      const int state = hooks_.query(front.event);
      if (state == kDone) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          entries_.pop_front();
        }
        hooks_.release(front.event);
        continue;
      }
      if (state != kBusy) return fail({Failure::Kind::kEventError, state, front.what});
      if (int error = hooks_.async_error(); error != 0) return fail({Failure::Kind::kAsyncError, error, front.what});
      if (Clock::now() >= front.deadline) return fail({Failure::Kind::kTimeout, 0, front.what});
      return true;
    }
  }

  bool fail(const Failure& failure) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed_ = true;  // first: a collective queued meanwhile sees it
    }
    hooks_.on_failure(failure);
    std::deque<Entry> left;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      left.swap(entries_);
    }
    for (Entry& e : left) hooks_.release(e.event);
    return false;
  }

  Hooks hooks_;
  Clock::duration poll_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Entry> entries_;
  bool stopping_ = false;
  bool failed_ = false;
  std::thread thread_;
  ProcessOrigin origin_;
};

}  // namespace dparallel::dist
