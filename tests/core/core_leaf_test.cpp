// The base types linked alone, without any backend: that this binary links
// at all pins that core/ needs nothing above it. With no runtime registered,
// every device is a clear kDevice error; a registered one is what the core
// allocates, copies, fills and switches devices with.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "core/allocator.h"
#include "core/device_runtime.h"
#include "core/device_worker.h"
#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "error_util.h"

using namespace dparallel;
using dptest::contains;
using dptest::device_error_of;

namespace {

// Host memory behind a recording runtime.
class RecordingRuntime final : public DeviceRuntime {
 public:
  int32_t device_count() const override { return 2; }
  const char* unavailable_reason() const override { return ""; }
  void set_device(int32_t index) const override { last_set_device = index; }
  // Holds at most `capacity` bytes at once, as a device would.
  Allocation allocate(int32_t, size_t nbytes) const override {
    if (in_use.load() + nbytes > capacity.load()) fail(StatusCode::kOutOfMemory, "out of recording memory");
    in_use += nbytes;
    ++allocations;
    return {std::malloc(nbytes), false};
  }
  void deallocate(int32_t, void* data, size_t nbytes) const noexcept override {
    in_use -= nbytes;
    ++deallocations;
    std::free(data);
  }
  void fill_zero(int32_t, void* data, size_t nbytes) const override {
    ++fills;
    std::memset(data, 0, nbytes);
  }
  void copy_rows(void* dst, const Device&, size_t dst_pitch, const void* src, const Device&, size_t src_pitch,
                 size_t row_bytes, size_t rows) const override {
    ++copies;
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, row_bytes);
    }
  }

  // A synchronous device: its work is done when the call returns, so every
  // stream is the calling thread and every event is complete.
  bool library_work_is_queued() const override { return false; }
  bool default_stream_is_queued() const override { return false; }
  void* library_stream(int32_t) const override { return nullptr; }
  void* create_stream(int32_t) const override { return nullptr; }
  void check_stream(int32_t, void*, const char*) const override {}
  void destroy_stream(int32_t, void*) const noexcept override {}
  void stream_synchronize(int32_t, void*) const override {}
  void launch_host_func(int32_t, void*, std::function<void()> fn) const override { fn(); }
  void* create_event(int32_t) const override { return new int(0); }
  void destroy_event(void* event) const noexcept override { delete static_cast<int*>(event); }
  void record_event(void*, int32_t, void*) const override {}
  void stream_wait_event(int32_t, void*, void*) const override {}
  bool event_query(void*) const override { return true; }
  void event_synchronize(void*) const override {}

  mutable std::atomic<int> allocations{0}, deallocations{0}, fills{0}, copies{0}, last_set_device{-1};
  mutable std::atomic<size_t> in_use{0};
  std::atomic<size_t> capacity{SIZE_MAX};
};

// Host memory behind a device that queues the library's work: events
// recorded on the library stream while it is busy complete only when the
// test finishes that work (finish_library_work).
class QueuedLibraryRuntime final : public DeviceRuntime {
 public:
  int32_t device_count() const override { return 1; }
  const char* unavailable_reason() const override { return ""; }
  void set_device(int32_t) const override {}
  Allocation allocate(int32_t, size_t nbytes) const override {
    ++allocations;
    return {std::malloc(nbytes), false};
  }
  void deallocate(int32_t, void* data, size_t) const noexcept override { std::free(data); }
  void fill_zero(int32_t, void* data, size_t nbytes) const override { std::memset(data, 0, nbytes); }
  void copy_rows(void*, const Device&, size_t, const void*, const Device&, size_t, size_t, size_t) const override {}
  bool library_work_is_queued() const override { return true; }
  bool default_stream_is_queued() const override { return true; }
  void* library_stream(int32_t) const override { return const_cast<int*>(&library_); }
  void* create_stream(int32_t) const override { return nullptr; }
  void check_stream(int32_t, void*, const char*) const override {}
  void destroy_stream(int32_t, void*) const noexcept override {}
  void stream_synchronize(int32_t, void*) const override {}
  void launch_host_func(int32_t, void*, std::function<void()> fn) const override { fn(); }
  // An event holds the library work's generation it waits for, or -1.
  void* create_event(int32_t) const override { return new int(-1); }
  void destroy_event(void* event) const noexcept override { delete static_cast<int*>(event); }
  void record_event(void* event, int32_t, void* stream) const override {
    *static_cast<int*>(event) = stream == &library_ && library_busy ? finished.load() + 1 : -1;
  }
  void stream_wait_event(int32_t, void* stream, void*) const override {
    if (stream == &library_) ++library_waits;
  }
  bool event_query(void* event) const override { return *static_cast<int*>(event) <= finished.load(); }
  void event_synchronize(void* event) const override {
    EXPECT_TRUE(event_query(event)) << "a wait for library work nobody finishes";
  }

  void finish_library_work() {
    library_busy = false;
    ++finished;
  }

  mutable std::atomic<int> allocations{0}, library_waits{0};
  std::atomic<bool> library_busy{false};
  std::atomic<int> finished{0};

 private:
  int library_ = 0;
};

// Host memory behind a device whose default stream (null) queues work and,
// while `capturing` (a host capturing a graph on a blocking stream), refuses
// events as CUDA's legacy stream does.
class CapturingRuntime final : public DeviceRuntime {
 public:
  int32_t device_count() const override { return 1; }
  const char* unavailable_reason() const override { return ""; }
  void set_device(int32_t) const override {}
  Allocation allocate(int32_t, size_t nbytes) const override {
    ++allocations;
    return {std::malloc(nbytes), false};
  }
  void deallocate(int32_t, void* data, size_t) const noexcept override {
    ++deallocations;
    std::free(data);
  }
  void fill_zero(int32_t, void* data, size_t nbytes) const override { std::memset(data, 0, nbytes); }
  void copy_rows(void*, const Device&, size_t, const void*, const Device&, size_t, size_t, size_t) const override {}
  bool library_work_is_queued() const override { return true; }
  bool default_stream_is_queued() const override { return true; }
  void* library_stream(int32_t) const override { return nullptr; }
  void* create_stream(int32_t) const override { return nullptr; }
  void check_stream(int32_t, void*, const char*) const override {}
  void destroy_stream(int32_t, void*) const noexcept override {}
  void stream_synchronize(int32_t, void*) const override {}
  void launch_host_func(int32_t, void*, std::function<void()> fn) const override { fn(); }
  // An event holds the default stream's generation it waits for, or -1.
  void* create_event(int32_t) const override { return new int(-1); }
  void destroy_event(void* event) const noexcept override { delete static_cast<int*>(event); }
  void record_event(void* event, int32_t, void* stream) const override {
    if (stream == nullptr && capturing)
      fail(StatusCode::kState, "the legacy default stream is refused during a capture");
    *static_cast<int*>(event) = default_busy ? finished.load() + 1 : -1;
  }
  void stream_wait_event(int32_t, void*, void*) const override {}
  bool event_query(void* event) const override { return *static_cast<int*>(event) <= finished.load(); }
  void event_synchronize(void* event) const override {
    EXPECT_TRUE(event_query(event)) << "a wait for default-stream work nobody finishes";
  }

  void finish_default_work() {
    default_busy = false;
    ++finished;
  }

  mutable std::atomic<int> allocations{0}, deallocations{0};
  std::atomic<bool> capturing{false}, default_busy{false};
  std::atomic<int> finished{0};
};

}  // namespace

TEST(CoreWithoutBackends, EveryDeviceTypeIsAClearDeviceErrorWithoutARuntime) {
  ASSERT_EQ(find_device_runtime(DeviceType::kCpu), nullptr);
  ASSERT_EQ(find_device_runtime(DeviceType::kCuda), nullptr);
  EXPECT_TRUE(contains(device_error_of([] { Tensor::zeros(DType::kFloat32, {1}, Device{}); }),
                       "no runtime is registered for cpu devices"));
  std::string message = device_error_of([] {
    Tensor::zeros(DType::kFloat32, {1 << 16}, Device{DeviceType::kCuda, 0});
  });
  EXPECT_TRUE(contains(message, "no runtime is registered for cuda devices")) << message;
  message = device_error_of([] { check_device(Device{DeviceType::kCuda, 1}, "device"); });
  EXPECT_TRUE(contains(message, "argument 'device' is cuda:1 but no runtime is registered for cuda devices"))
      << message;
  EXPECT_EQ(cuda_device_count(), 0);
  EXPECT_TRUE(contains(device_error_of([] {
                         run_on_device(Device{DeviceType::kCuda, 0}, [] {}).get();
                       }),
                       "no runtime is registered for cuda devices"));
}

TEST(CoreWithoutBackends, TheRegisteredRuntimeAllocatesCopiesFillsAndSetsTheDevice) {
  static RecordingRuntime runtime;  // outlives the registration
  register_device_runtime(DeviceType::kCuda, &runtime);
  const Device gpu{DeviceType::kCuda, 1};
  EXPECT_EQ(cuda_device_count(), 2);
  EXPECT_EQ(check_device(gpu, "device"), gpu);
  {
    Tensor zeros = Tensor::zeros(DType::kInt32, {64}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 1);
    EXPECT_EQ(runtime.fills.load(), 1);  // the runtime's memory is not known to be zero
    for (int64_t i = 0; i < zeros.numel(); ++i) EXPECT_EQ(static_cast<const int32_t*>(zeros.data())[i], 0);
    int32_t host[64];
    for (int32_t i = 0; i < 64; ++i) host[i] = i;
    copy_bytes(zeros.data(), gpu, host, Device{}, sizeof host);
    EXPECT_EQ(runtime.copies.load(), 1);
    EXPECT_EQ(static_cast<const int32_t*>(zeros.data())[63], 63);
  }
  release_cached_memory();
  EXPECT_EQ(runtime.deallocations.load(), 1);
  run_on_device(gpu, [] {}).get();
  EXPECT_EQ(runtime.last_set_device.load(), 1);
  register_device_runtime(DeviceType::kCuda, nullptr);
  EXPECT_EQ(find_device_runtime(DeviceType::kCuda), nullptr);
}

// A device that runs out of memory while the allocator's cache holds blocks
// of other sizes: they go back to the device and the allocation is tried
// once more; one that cannot fit even then is still kOutOfMemory.
TEST(CoreWithoutBackends, AnAllocationOutOfMemoryReleasesTheCachedBlocksAndTriesOnceMore) {
  static RecordingRuntime runtime;  // outlives the registration
  register_device_runtime(DeviceType::kCuda, &runtime);
  const Device gpu{DeviceType::kCuda, 0};
  runtime.capacity = size_t{3} << 20;
  { Tensor cached = Tensor::empty(DType::kUInt8, {int64_t{2} << 20}, gpu); }
  EXPECT_EQ(runtime.deallocations.load(), 0) << "the freed block was not kept in the cache";
  {
    // Another size: it fits only once the cached block is gone.
    Tensor other = Tensor::empty(DType::kUInt8, {(int64_t{2} << 20) + 4096}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 2);
    EXPECT_EQ(runtime.deallocations.load(), 1);
  }
  try {
    Tensor too_big = Tensor::empty(DType::kUInt8, {int64_t{4} << 20}, gpu);
    ADD_FAILURE() << "an allocation past the device's memory succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kOutOfMemory) << e.what();
  }
  release_cached_memory();
  EXPECT_EQ(runtime.in_use.load(), 0u);
  register_device_runtime(DeviceType::kCuda, nullptr);
}

TEST(CoreWithoutBackends, AFreedBlockIsNotReusedBeforeAQueuedJobsStreamPassedIt) {
  static QueuedLibraryRuntime runtime;  // outlives the registration
  register_device_runtime(DeviceType::kCuda, &runtime);
  const Device gpu{DeviceType::kCuda, 0};
  // A job whose library work stays queued on the runtime's "library" stream.
  LibraryWorkStaysQueued job(gpu, runtime.library_stream(0));
  {
    Tensor t = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 1);
    runtime.library_busy = true;  // the job's queued work still uses it
  }
  {
    // The freeing thread has no stream of its own, so only the job's
    // stream's event holds the block back.
    Tensor u = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 2) << "a block the job's stream still uses was handed out again";
  }
  runtime.finish_library_work();
  {
    Tensor v = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 2) << "a passed block was not reused";
  }
  release_cached_memory();
  register_device_runtime(DeviceType::kCuda, nullptr);
}

// A block freed while the default stream refuses events (a capture is in
// progress) is neither freed at once nor waited for: it waits until an
// event can be recorded, and then for the work queued before it.
TEST(CoreWithoutBackends, AFreeDuringACaptureWaitsForTheCaptureToEndAndThenForTheDefaultStream) {
  static CapturingRuntime runtime;  // outlives the registration
  register_device_runtime(DeviceType::kCuda, &runtime);
  const Device gpu{DeviceType::kCuda, 0};
  runtime.default_busy = true;  // a read of the first block is queued
  {
    Tensor t = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 1);
    runtime.capturing = true;
  }
  {
    Tensor u = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 2) << "a block freed during the capture was handed out again";
  }
  release_cached_memory();
  EXPECT_EQ(runtime.deallocations.load(), 0) << "a block freed during the capture was released";
  runtime.capturing = false;  // recorded now, behind the queued read
  {
    Tensor v = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 3) << "a block was handed out before the queued read";
  }
  runtime.finish_default_work();
  {
    Tensor w = Tensor::empty(DType::kUInt8, {1 << 20}, gpu);
    EXPECT_EQ(runtime.allocations.load(), 3) << "a passed block was not reused";
  }
  release_cached_memory();
  EXPECT_EQ(runtime.deallocations.load(), 3);
  register_device_runtime(DeviceType::kCuda, nullptr);
}

TEST(CoreWithoutBackends, ADeferredStreamOrderHandsTheHostsEventToTheCallerInsteadOfTheLibraryStream) {
  static QueuedLibraryRuntime runtime;  // outlives the registration
  register_device_runtime(DeviceType::kCuda, &runtime);
  const Device gpu{DeviceType::kCuda, 0};
  int host_stream = 0;
  set_current_stream(gpu, &host_stream);
  {
    StreamOrder now({gpu});
    EXPECT_EQ(runtime.library_waits.load(), 1);
    EXPECT_TRUE(now.take_deferred().empty());
  }
  {
    StreamOrder deferred({gpu}, StreamOrder::HostWait::kDeferred);
    EXPECT_EQ(runtime.library_waits.load(), 1) << "the library stream waited for the host's at the call";
    std::vector<Event> ready = deferred.take_deferred();
    ASSERT_EQ(ready.size(), 1u);
    EXPECT_EQ(ready[0].device(), gpu);
    library_streams_wait(ready);  // where the work that reads the host's tensors starts
    EXPECT_EQ(runtime.library_waits.load(), 2);
  }
  set_current_stream(gpu, nullptr);
  register_device_runtime(DeviceType::kCuda, nullptr);
}

TEST(CoreWithoutBackends, AQueuedScopeGivesItsStreamToItsDeviceOnItsThreadAndRestoresTheOneBefore) {
  const Device gpu0{DeviceType::kCuda, 0}, gpu1{DeviceType::kCuda, 1};
  int outer_stream = 0, inner_stream = 0;
  EXPECT_FALSE(library_work_stays_queued());
  {
    LibraryWorkStaysQueued outer(gpu0, &outer_stream);
    EXPECT_TRUE(library_work_stays_queued());
    EXPECT_EQ(library_stream_override(gpu0), &outer_stream);
    EXPECT_EQ(library_stream_override(gpu1), nullptr);
    EXPECT_EQ(library_stream_override(Device{}), nullptr);
    {
      LibraryWorkStaysQueued inner(gpu1, &inner_stream);
      EXPECT_EQ(library_stream_override(gpu1), &inner_stream);
      EXPECT_EQ(library_stream_override(gpu0), nullptr);
    }
    EXPECT_EQ(library_stream_override(gpu0), &outer_stream);
    std::thread other([&] {
      EXPECT_FALSE(library_work_stays_queued());
      EXPECT_EQ(library_stream_override(gpu0), nullptr);
    });
    other.join();
  }
  EXPECT_FALSE(library_work_stays_queued());
  EXPECT_EQ(library_stream_override(gpu0), nullptr);
}
