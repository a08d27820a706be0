#include "core/device_worker.h"

#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/device_runtime.h"
#include "core/error.h"
#include "core/process_origin.h"
#include "core/thread_name.h"

namespace dparallel {

namespace {

thread_local Device t_current_device{DeviceType::kCpu, 0};
thread_local bool t_is_worker = false;

using TaskList = std::list<std::packaged_task<void()>>;

// Every worker's queue is guarded by one mutex, the workers' mutex, so that a
// submission to several devices enters all their queues at once: every queue
// then holds submissions in the same global order (see device_worker.h).
class DeviceWorker {
 public:
  DeviceWorker(const Device& device, std::mutex& mutex) : device_(device), mutex_(mutex) {
    thread_ = std::thread([this] { loop(); });
  }
  // Runs what is queued, then joins; a forked child has no such thread.
  ~DeviceWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (origin_.is_current())
      thread_.join();
    else
      thread_.detach();
  }
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  // Appends the one task of `task`; the caller holds the workers' mutex.
  // Splicing allocates nothing, so a submission cannot fail half-way.
  void push_locked(TaskList& task) noexcept { queue_.splice(queue_.end(), task); }
  void wake() { wake_.notify_one(); }

 private:
  void loop() {
    t_current_device = device_;
    t_is_worker = true;
    name_this_thread("dp-dev " + to_string(device_));
    for (;;) {
      TaskList task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything ran
        task.splice(task.end(), queue_, queue_.begin());
      }
      task.front()();
    }
  }

  Device device_;
  std::mutex& mutex_;
  std::condition_variable wake_;
  TaskList queue_;
  bool stopping_ = false;
  ProcessOrigin origin_;
  std::thread thread_;
};

class Workers {
 public:
  std::vector<std::future<void>> submit(const std::vector<Device>& devices, std::vector<std::function<void()>> works) {
    if (devices.size() != works.size()) {
      fail(StatusCode::kInternal, devices.size(), " devices but ", works.size(), " works submitted");
    }
    // Everything that allocates happens before the lock is taken.
    std::vector<TaskList> tasks(devices.size());
    std::vector<std::future<void>> done;
    done.reserve(devices.size());
    for (size_t i = 0; i < devices.size(); ++i) {
      // The device is made current before every task, so a task that
      // switches it cannot misplace the next one; a failure to do so is the
      // task's error.
      tasks[i].emplace_back([device = devices[i], work = std::move(works[i])] {
        device_runtime(device.type).set_device(device.index);
        work();
      });
      done.push_back(tasks[i].front().get_future());
    }
    std::vector<DeviceWorker*> targets(devices.size());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < devices.size(); ++i) targets[i] = &worker_locked(devices[i]);
      for (size_t i = 0; i < devices.size(); ++i) targets[i]->push_locked(tasks[i]);
    }
    for (DeviceWorker* worker : targets) worker->wake();
    return done;
  }

  // Ends every worker after what it has queued; later submissions start new ones.
  void stop_all() {
    std::unordered_map<Device, std::unique_ptr<DeviceWorker>> stopping;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping.swap(workers_);
    }
    stopping.clear();  // each destructor joins, outside the lock the workers take
  }

 private:
  DeviceWorker& worker_locked(const Device& device) {
    auto& slot = workers_[device];
    if (!slot) slot = std::make_unique<DeviceWorker>(device, mutex_);
    return *slot;
  }

  std::mutex mutex_;
  std::unordered_map<Device, std::unique_ptr<DeviceWorker>> workers_;
};

Workers& workers() {
  // Leaked on purpose: hosts' static destructors may still submit work.
  static auto* instance = new Workers();
  return *instance;
}

}  // namespace

std::future<void> run_on_device(const Device& device, std::function<void()> work) {
  std::vector<std::function<void()>> works;
  works.push_back(std::move(work));
  return std::move(workers().submit({device}, std::move(works)).front());
}

std::vector<std::future<void>> run_on_devices(const std::vector<Device>& devices,
                                              std::vector<std::function<void()>> works) {
  return workers().submit(devices, std::move(works));
}

Device current_device() { return t_current_device; }

void stop_device_workers() {
  if (t_is_worker) {
    fail(StatusCode::kState,
         "the library's worker threads cannot be stopped from one of them (a forward or host callback); "
         "call it from the host's own thread");
  }
  workers().stop_all();
}

}  // namespace dparallel
