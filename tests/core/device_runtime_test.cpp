// The device runtimes the library registers as it loads.
#include "core/device_runtime.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "core/device_worker.h"
#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "device/cuda/cuda_runtime.h"
#include "error_util.h"

using namespace dparallel;
using dptest::contains;
using dptest::device_error_of;

namespace {

// A task on a cpu stream that records an event behind itself on that stream
// and then waits for it would wait forever: the wait is kState instead.
TEST(DeviceRuntimes, ACpuStreamTaskWaitingForAnEventQueuedBehindItselfIsStateNotAHang) {
  const DeviceRuntime& runtime = device_runtime(DeviceType::kCpu);
  void* stream = runtime.create_stream(0);
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  StatusCode synchronize_code = StatusCode::kOk, wait_code = StatusCode::kOk;
  std::string message;
  runtime.launch_host_func(0, stream, [&] {
    auto code_of = [&](auto fn) {
      try {
        fn();
      } catch (const Error& e) {
        message = e.what();
        return e.code();
      }
      return StatusCode::kOk;
    };
    Event behind(Device{DeviceType::kCpu, 0});
    behind.record(stream);
    synchronize_code = code_of([&] { behind.synchronize(); });
    wait_code = code_of([&] { behind.block(nullptr); });  // the calling thread waits: no queue there
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
    finished.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    ASSERT_TRUE(finished.wait_for(lock, std::chrono::seconds(60), [&] { return done; }))
        << "the task waited for itself";
  }
  EXPECT_EQ(synchronize_code, StatusCode::kState);
  if (!runtime.default_stream_is_queued()) {
    EXPECT_EQ(wait_code, StatusCode::kState);
  }
  EXPECT_TRUE(contains(message, "wait for itself")) << message;
  runtime.stream_synchronize(0, stream);
  runtime.destroy_stream(0, stream);
}

}  // namespace

TEST(DeviceRuntimes, TheCpuRuntimeIsRegisteredWhenTheLibraryLoads) {
  const DeviceRuntime* cpu = find_device_runtime(DeviceType::kCpu);
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(cpu->device_count(), cpu_device_count());
  // Large enough to come from the runtime rather than malloc.
  std::vector<int32_t> values(size_t{1} << 16);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int32_t>(i);
  Tensor host = Tensor::zeros(DType::kInt32, {static_cast<int64_t>(values.size())}, Device{DeviceType::kCpu, 2});
  copy_bytes(host.data(), host.device(), values.data(), Device{}, host.nbytes());
  Tensor moved = host.to(Device{DeviceType::kCpu, 3});
  EXPECT_EQ(std::vector<int32_t>(static_cast<const int32_t*>(moved.data()),
                                 static_cast<const int32_t*>(moved.data()) + moved.numel()),
            values);
}

TEST(DeviceRuntimes, CudaDevicesHaveARuntimeExactlyInBuildsWithCuda) {
  const Device gpu{DeviceType::kCuda, 0};
  if (cuda::compiled()) {
    const DeviceRuntime* runtime = find_device_runtime(DeviceType::kCuda);
    ASSERT_NE(runtime, nullptr);
    EXPECT_EQ(runtime->device_count(), cuda::device_count());
    EXPECT_EQ(cuda_device_count(), cuda::device_count());
    return;
  }
  EXPECT_EQ(find_device_runtime(DeviceType::kCuda), nullptr);
  EXPECT_EQ(cuda_device_count(), 0);
  const std::string built_without = "dparallel was built without CUDA support";
  EXPECT_TRUE(contains(device_error_of([] { device_runtime(DeviceType::kCuda); }), built_without));
  std::string message = device_error_of([&] { check_device(gpu, "device"); });
  EXPECT_TRUE(contains(message, "argument 'device' is cuda:0 but ")) << message;
  EXPECT_TRUE(contains(message, built_without)) << message;
  message = device_error_of([&] { Tensor::zeros(DType::kFloat32, {4}, gpu); });
  EXPECT_TRUE(contains(message, built_without)) << message;
  message = device_error_of([&] { run_on_device(gpu, [] {}).get(); });
  EXPECT_TRUE(contains(message, built_without)) << message;
}
