#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/process_origin.h"
#include "core/thread_name.h"

namespace dparallel {

namespace {

thread_local bool t_in_pool = false;
thread_local bool t_serial = false;

struct Job {
  const std::function<void(size_t)>* task = nullptr;
  size_t ntasks = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_done;
  std::exception_ptr error;

  // Runs claimed tasks until none are left; returns whether it ran any.
  void work() {
    for (;;) {
      size_t i = next.fetch_add(1);
      if (i >= ntasks) return;
      try {
        (*task)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
      }
      if (finished.fetch_add(1) + 1 == ntasks) {
        std::lock_guard<std::mutex> lock(mutex);
        all_done.notify_all();
      }
    }
  }
};

class ThreadPool {
 public:
  explicit ThreadPool(size_t helpers) {
    threads_.reserve(helpers);
    for (size_t i = 0; i < helpers; ++i) threads_.emplace_back([this] { loop(); });
    helpers_ = helpers;
  }
  // Called by the last user: no job is queued. A forked child has no helpers.
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) {
      if (origin_.is_current())
        thread.join();
      else
        thread.detach();
    }
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t helpers() const { return helpers_; }

  void run(size_t ntasks, const std::function<void(size_t)>& task) {
    auto job = std::make_shared<Job>();
    job->task = &task;
    job->ntasks = ntasks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(job);
    }
    if (ntasks > 2) {
      wake_.notify_all();
    } else {
      wake_.notify_one();
    }
    job->work();
    {
      std::unique_lock<std::mutex> lock(job->mutex);
      job->all_done.wait(lock, [&] { return job->finished.load() == ntasks; });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = std::find(queue_.begin(), queue_.end(), job);
      if (it != queue_.end()) queue_.erase(it);
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void loop() {
    t_in_pool = true;
    name_this_thread("dp-pool");
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] {
          while (!queue_.empty() && queue_.front()->next.load() >= queue_.front()->ntasks) queue_.pop_front();
          return stopping_ || !queue_.empty();
        });
        if (queue_.empty()) return;  // stopping
        job = queue_.front();
      }
      job->work();
    }
  }

  size_t helpers_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  ProcessOrigin origin_;
  std::vector<std::thread> threads_;
};

size_t read_concurrency() {
  const char* text = std::getenv("DP_NUM_THREADS");
  if (text != nullptr && *text != '\0') {
    char* end = nullptr;
    long value = std::strtol(text, &end, 10);
    if (*end == '\0' && value >= 1 && value <= 1024) return static_cast<size_t>(value);
  }
  return std::max<size_t>(1, std::thread::hardware_concurrency());
}

// The pool, started on first use and again after stop_compute_threads. Each
// parallel_for holds it, so a stop waits for the jobs in flight. The holder
// is leaked on purpose: hosts' static destructors may still compute.
struct PoolHolder {
  std::mutex mutex;
  std::shared_ptr<ThreadPool> pool;
};
PoolHolder& pool_holder() {
  static auto* holder = new PoolHolder();
  return *holder;
}

std::shared_ptr<ThreadPool> pool() {
  PoolHolder& holder = pool_holder();
  std::lock_guard<std::mutex> lock(holder.mutex);
  if (!holder.pool) holder.pool = std::make_shared<ThreadPool>(compute_concurrency() - 1);
  return holder.pool;
}

}  // namespace

SerialScope::SerialScope() : was_serial_(t_serial) { t_serial = true; }
SerialScope::~SerialScope() { t_serial = was_serial_; }

size_t compute_concurrency() {
  static const size_t concurrency = read_concurrency();
  return concurrency;
}

void parallel_for(size_t ntasks, const std::function<void(size_t)>& task) {
  if (ntasks == 0) return;
  if (ntasks == 1 || t_in_pool || t_serial || compute_concurrency() == 1) {
    for (size_t i = 0; i < ntasks; ++i) task(i);
    return;
  }
  pool()->run(ntasks, task);
}

void parallel_range(size_t n, size_t min_grain, const std::function<void(size_t, size_t)>& body) {
  if (n == 0) return;
  size_t grain = std::max<size_t>(min_grain, 1);
  size_t parts = std::min(compute_concurrency(), (n + grain - 1) / grain);
  if (parts <= 1 || t_serial || t_in_pool) {
    body(0, n);
    return;
  }
  size_t per_part = (n + parts - 1) / parts;
  parallel_for(parts, [&](size_t part) {
    size_t begin = part * per_part;
    size_t end = std::min(n, begin + per_part);
    if (begin < end) body(begin, end);
  });
}

void stop_compute_threads() {
  std::shared_ptr<ThreadPool> stopping;
  {
    PoolHolder& holder = pool_holder();
    std::lock_guard<std::mutex> lock(holder.mutex);
    stopping.swap(holder.pool);
  }
  // The last holder, this call or a parallel_for in flight, joins the helpers.
}

}  // namespace dparallel
