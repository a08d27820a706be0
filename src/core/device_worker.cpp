#include "core/device_worker.h"

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "backend/cuda/cuda_backend.h"

namespace dparallel {

namespace {

thread_local Device t_current_device{DeviceType::kCpu, 0};

class DeviceWorker {
 public:
  explicit DeviceWorker(const Device& device) : device_(device) {
    std::thread([this] { loop(); }).detach();
  }

  std::future<void> submit(std::function<void()> work) {
    // The device is made current before every task, so a task that switches
    // it cannot misplace the next one; a failure to do so is the task's error.
    std::packaged_task<void()> task([device = device_, work = std::move(work)] {
      if (device.is_cuda()) cuda::set_device(device.index);
      work();
    });
    std::future<void> done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    wake_.notify_one();
    return done;
  }

 private:
  void loop() {
    t_current_device = device_;
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  Device device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> queue_;
};

DeviceWorker& worker_of(const Device& device) {
  // Leaked on purpose: the workers are detached threads that live as long as the process.
  static auto* mutex = new std::mutex();
  static auto* workers = new std::unordered_map<Device, std::unique_ptr<DeviceWorker>>();
  std::lock_guard<std::mutex> lock(*mutex);
  auto& slot = (*workers)[device];
  if (!slot) slot = std::make_unique<DeviceWorker>(device);
  return *slot;
}

}  // namespace

std::future<void> run_on_device(const Device& device, std::function<void()> work) {
  return worker_of(device).submit(std::move(work));
}

Device current_device() { return t_current_device; }

}  // namespace dparallel
