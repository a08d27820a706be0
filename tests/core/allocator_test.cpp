#include "core/allocator.h"

#include <gtest/gtest.h>

#include <cstring>

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
