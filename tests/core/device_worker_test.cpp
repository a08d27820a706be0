#include "core/device_worker.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <thread>

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
