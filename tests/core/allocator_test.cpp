#include "core/allocator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/device_runtime.h"
#include "core/stream.h"
#include "core/tensor.h"

using namespace dparallel;

TEST(DeviceAllocator, FreedLargeBlockIsReusedForTheSameSize) {
  release_cached_memory();
  Device cpu{DeviceType::kCpu, 5};
  Allocation first = device_allocate(cpu, 4 << 20);
  ASSERT_NE(first.data, nullptr);
  EXPECT_TRUE(first.zeroed);  // fresh pages
  device_free(cpu, first.data, 4 << 20);
  EXPECT_GE(cached_bytes(), size_t{4} << 20);
  Allocation second = device_allocate(cpu, 4 << 20);
  EXPECT_EQ(second.data, first.data);
  EXPECT_FALSE(second.zeroed);
  device_free(cpu, second.data, 4 << 20);
  release_cached_memory();
  EXPECT_EQ(cached_bytes(), 0u);
}

TEST(DeviceAllocator, CachesAreSeparatePerLogicalDevice) {
  release_cached_memory();
  Device a{DeviceType::kCpu, 1};
  Device b{DeviceType::kCpu, 2};
  Allocation block = device_allocate(a, 1 << 20);
  device_free(a, block.data, 1 << 20);
  Allocation other = device_allocate(b, 1 << 20);
  EXPECT_NE(other.data, block.data);
  device_free(b, other.data, 1 << 20);
  release_cached_memory();
}

TEST(TensorZeros, ReusedBlockIsZeroedAgain) {
  Device cpu{DeviceType::kCpu, 0};
  {
    Tensor dirty = Tensor::empty(DType::kFloat32, {1 << 18}, cpu);
    std::memset(dirty.data(), 0xab, dirty.nbytes());
  }
  Tensor clean = Tensor::zeros(DType::kFloat32, {1 << 18}, cpu);
  const auto* bytes = static_cast<const unsigned char*>(clean.data());
  for (size_t i = 0; i < clean.nbytes(); ++i) ASSERT_EQ(bytes[i], 0) << i;
}

// A block whose storage a queued job still reads (Storage::record_use) is
// not handed out again when the host frees it, until that stream passes:
// here a cpu stream held by a host function stands in for the job's.
TEST(DeviceAllocator, AFreedBlockWaitsForTheQueuedUsesRecordedOnItsStorage) {
  release_cached_memory();
  const Device cpu{DeviceType::kCpu, 6};
  const DeviceRuntime& runtime = device_runtime(DeviceType::kCpu);
  void* stream = runtime.create_stream(cpu.index);
  std::atomic<bool> open{false};
  runtime.launch_host_func(cpu.index, stream, [&open] {
    while (!open) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  constexpr size_t kBytes = 4 << 20;
  std::shared_ptr<Storage> storage = Storage::allocate(cpu, kBytes, false);
  void* const first = storage->data();
  auto used = std::make_shared<Event>(cpu);
  used->record(stream);
  storage->record_use(used);
  storage.reset();  // the host's free, with no current stream
  std::shared_ptr<Storage> again = Storage::allocate(cpu, kBytes, false);
  EXPECT_NE(again->data(), first) << "handed out again while the stream still reads it";
  EXPECT_FALSE(used->query());
  open = true;
  runtime.stream_synchronize(cpu.index, stream);
  again.reset();
  // Once passed, the block is free to reuse: the next two allocations of
  // that size take both cached blocks.
  std::shared_ptr<Storage> one = Storage::allocate(cpu, kBytes, false);
  std::shared_ptr<Storage> two = Storage::allocate(cpu, kBytes, false);
  EXPECT_TRUE(one->data() == first || two->data() == first);
  one.reset();
  two.reset();
  runtime.destroy_stream(cpu.index, stream);
  release_cached_memory();
}

// The host's own memory under a queued use: its deleter runs only once the
// stream has passed the use, on the thread that dropped the last reference.
TEST(DeviceAllocator, AWrappedBuffersDeleterWaitsForTheQueuedUses) {
  const Device cpu{DeviceType::kCpu, 6};
  const DeviceRuntime& runtime = device_runtime(DeviceType::kCpu);
  void* stream = runtime.create_stream(cpu.index);
  std::atomic<bool> open{false}, deleted{false};
  runtime.launch_host_func(cpu.index, stream, [&open] {
    while (!open) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  std::vector<float> buffer(16);
  Storage::Deleter deleter = [&deleted](void*) { deleted = true; };
  std::shared_ptr<Storage> storage = Storage::wrap(cpu, buffer.data(), buffer.size() * sizeof(float), {});
  storage->arm(deleter);
  auto used = std::make_shared<Event>(cpu);
  used->record(stream);
  storage->record_use(used);
  std::thread dropper([&storage] { storage.reset(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(deleted) << "the deleter ran while the stream still read the buffer";
  open = true;
  dropper.join();
  EXPECT_TRUE(deleted);
  runtime.destroy_stream(cpu.index, stream);
}

// Uses already passed are dropped as new ones are recorded: memory a host
// keeps for many steps holds only those still in flight, and its free waits
// for nothing that is done.
TEST(DeviceAllocator, PassedUsesAreDroppedAsNewOnesAreRecorded) {
  const Device cpu{DeviceType::kCpu, 6};
  std::shared_ptr<Storage> storage = Storage::allocate(cpu, 4 << 20, false);
  std::weak_ptr<const Event> first;
  {
    auto used = std::make_shared<Event>(cpu);
    used->record(nullptr);  // nothing queued: passed at once
    first = used;
    storage->record_use(std::move(used));
  }
  EXPECT_FALSE(first.expired());
  storage->record_use(std::make_shared<Event>(cpu));
  EXPECT_TRUE(first.expired()) << "a passed use is still held";
  storage.reset();
  release_cached_memory();
}
