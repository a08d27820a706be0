#include "core/device_worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/error.h"

using namespace dparallel;

TEST(DeviceWorker, RunsWorkWithItsDeviceCurrent) {
  Device seen{DeviceType::kCuda, 99};
  run_on_device(Device{DeviceType::kCpu, 3}, [&] { seen = current_device(); }).get();
  EXPECT_EQ(seen, (Device{DeviceType::kCpu, 3}));
}

TEST(DeviceWorker, OneThreadPerDevicePersistsAcrossCalls) {
  std::thread::id first;
  std::thread::id second;
  std::thread::id other;
  run_on_device(Device{DeviceType::kCpu, 4}, [&] { first = std::this_thread::get_id(); }).get();
  run_on_device(Device{DeviceType::kCpu, 4}, [&] { second = std::this_thread::get_id(); }).get();
  run_on_device(Device{DeviceType::kCpu, 5}, [&] { other = std::this_thread::get_id(); }).get();
  EXPECT_EQ(first, second);
  EXPECT_NE(first, other);
  EXPECT_NE(first, std::this_thread::get_id());
}

TEST(DeviceWorker, ExceptionsReachTheFuture) {
  auto done = run_on_device(Device{DeviceType::kCpu, 6}, [] { throw std::runtime_error("boom"); });
  EXPECT_THROW(done.get(), std::runtime_error);
}

// A device that cannot be made current fails each task through its future,
// and the task does not run (before, the failure was dropped at thread start).
TEST(DeviceWorker, FailureToMakeTheDeviceCurrentReachesEveryTaskAndSkipsIt) {
  const Device absent{DeviceType::kCuda, 9999};
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool ran = false;
    auto done = run_on_device(absent, [&] { ran = true; });
    EXPECT_ANY_THROW(done.get()) << "attempt " << attempt;
    EXPECT_FALSE(ran) << "attempt " << attempt;
  }
}

namespace {

// Submits, `rounds` times, one task per device that waits (bounded) until
// every task of its submission has started; returns how many gave up waiting
// (it stops after the first round where one did).
int barrier_rounds(const std::vector<Device>& devices, int rounds) {
  int gave_up = 0;
  for (int round = 0; round < rounds && gave_up == 0; ++round) {
    std::mutex mutex;
    std::condition_variable all_started;
    size_t started = 0;
    std::vector<std::function<void()>> works;
    for (size_t i = 0; i < devices.size(); ++i) {
      works.emplace_back([&] {
        std::unique_lock<std::mutex> lock(mutex);
        if (++started == devices.size()) all_started.notify_all();
        if (!all_started.wait_for(lock, std::chrono::seconds(10), [&] { return started == devices.size(); })) {
          throw std::runtime_error("a task of the submission never started");
        }
      });
    }
    for (auto& done : run_on_devices(devices, std::move(works))) {
      try {
        done.get();
      } catch (const std::runtime_error&) {
        ++gave_up;
      }
    }
  }
  return gave_up;
}

}  // namespace

// Submitted one device at a time, the two threads' tasks interleave in
// opposite orders on the two workers and wait on each other until they give up.
TEST(DeviceWorker, SubmissionsInOppositeDeviceOrdersRunEachWholeAtOnce) {
  const Device a{DeviceType::kCpu, 7};
  const Device b{DeviceType::kCpu, 8};
  std::atomic<int> gave_up{0};
  std::thread other([&] { gave_up += barrier_rounds({b, a}, 200); });
  gave_up += barrier_rounds({a, b}, 200);
  other.join();
  EXPECT_EQ(gave_up.load(), 0);
}

TEST(DeviceWorker, MismatchedDevicesAndWorksAreAnInternalErrorAndSubmitNothing) {
  std::vector<std::function<void()>> works(1, [] {});
  EXPECT_THROW(run_on_devices({Device{DeviceType::kCpu, 7}, Device{DeviceType::kCpu, 8}}, std::move(works)), Error);
}
