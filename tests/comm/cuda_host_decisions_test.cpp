// The CUDA backend's copy path, kept batched-copy table, pinned host cache
// and event devices: host decisions, checked without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#include "device/cuda/copy_path.h"
#include "device/cuda/event_devices.h"
#include "device/cuda/pinned_host_cache.h"

namespace dparallel::cuda {
namespace {

constexpr size_t kMaxPitch = 2147483647;  // cudaDevAttrMaxPitch on current GPUs
constexpr size_t kGiB = size_t{1} << 30;

TEST(CudaCopyPath, OneRowOfTwoAndAHalfGiBIsOneLinearCopyNotAPitchedOne) {
  const size_t nbytes = 5 * kGiB / 2;
  EXPECT_EQ(copy_path(1, nbytes, nbytes, nbytes, kMaxPitch), CopyPath::kLinear);
  // Exactly at and just past the pitch limit, as one row.
  EXPECT_EQ(copy_path(1, kMaxPitch + 1, kMaxPitch + 1, kMaxPitch + 1, kMaxPitch), CopyPath::kLinear);
}

TEST(CudaCopyPath, RowsBackToBackAreOneLinearCopy) {
  EXPECT_EQ(copy_path(4096, 1024, 1024, 1024, kMaxPitch), CopyPath::kLinear);
  EXPECT_EQ(copy_path(3, kGiB, kGiB, kGiB, kMaxPitch), CopyPath::kLinear);
}

TEST(CudaCopyPath, PitchedRowsWithinTheLimitAreOnePitchedCopy) {
  EXPECT_EQ(copy_path(8, 4096, 1024, 512, kMaxPitch), CopyPath::kPitched);
  EXPECT_EQ(copy_path(2, kMaxPitch, 16, 16, kMaxPitch), CopyPath::kPitched);
}

TEST(CudaCopyPath, APitchBeyondTheLimitGoesRowByRow) {
  EXPECT_EQ(copy_path(2, kMaxPitch + 1, 16, 16, kMaxPitch), CopyPath::kRowByRow);
  EXPECT_EQ(copy_path(3, 16, 3 * kGiB, 16, kMaxPitch), CopyPath::kRowByRow);
  EXPECT_EQ(copy_path(2, 3 * kGiB, 3 * kGiB, kMaxPitch + 1, kMaxPitch), CopyPath::kRowByRow);
}

TEST(CudaCopyTable, GrowsByDoublingFromFourKiBAndNeverShrinks) {
  EXPECT_EQ(copy_table_capacity(1, 0), 4096u);
  EXPECT_EQ(copy_table_capacity(4096, 0), 4096u);
  EXPECT_EQ(copy_table_capacity(4097, 4096), 8192u);
  EXPECT_EQ(copy_table_capacity(100, 65536), 65536u);
  EXPECT_EQ(copy_table_capacity(65537, 65536), 131072u);
  // A run of growing plans reallocates a logarithmic number of times.
  size_t capacity = 0;
  int grown = 0;
  for (size_t needed = 32; needed <= (size_t{1} << 20); needed += 32) {
    const size_t next = copy_table_capacity(needed, capacity);
    if (next != capacity) ++grown;
    EXPECT_GE(next, needed);
    capacity = next;
  }
  EXPECT_LE(grown, 9);
}

TEST(CudaPinnedHostCache, GroupsMadeAndDestroyedOverAndOverAllocateOnce) {
  PinnedHostCache cache;
  int allocations = 0;
  std::vector<void*> owned;
  auto allocate = [&](size_t bytes) {
    ++allocations;
    owned.push_back(std::malloc(bytes));
    return owned.back();
  };
  for (int i = 0; i < 100; ++i) {
    void* headers = cache.take(8 * 96, allocate);
    ASSERT_NE(headers, nullptr);
    cache.give(headers);
  }
  EXPECT_EQ(allocations, 1);
  for (void* p : owned) std::free(p);
}

TEST(CudaPinnedHostCache, BlocksInUseAreNeverHandedOutTwiceAndClassesAreSeparate) {
  PinnedHostCache cache;
  std::vector<void*> owned;
  auto allocate = [&](size_t bytes) {
    owned.push_back(std::malloc(bytes));
    return owned.back();
  };
  void* a = cache.take(100, allocate);
  void* b = cache.take(100, allocate);
  EXPECT_NE(a, b);
  void* big = cache.take(5000, allocate);
  cache.give(big);
  void* c = cache.take(100, allocate);  // the 8 KiB block is not of its class
  EXPECT_NE(c, big);
  cache.give(a);
  EXPECT_EQ(cache.take(4096, allocate), a);
  EXPECT_EQ(cache.take(8192, allocate), big);
  cache.give(nullptr);  // ignored
  int stranger = 0;
  cache.give(&stranger);  // not the cache's: ignored
  EXPECT_EQ(PinnedHostCache::size_class(1), 4096u);
  EXPECT_EQ(PinnedHostCache::size_class(4097), 8192u);
  for (void* p : owned) std::free(p);
}

TEST(CudaPinnedHostCache, AFailedAllocationKeepsNothing) {
  PinnedHostCache cache;
  EXPECT_THROW(cache.take(64, [](size_t) -> void* { throw std::bad_alloc(); }), std::bad_alloc);
  int block = 0;
  EXPECT_EQ(cache.take(64, [&](size_t) { return static_cast<void*>(&block); }), &block);
}

TEST(CudaEventDevices, EachEventKnowsItsDeviceUntilForgotten) {
  EventDevices table;
  int e0 = 0, e1 = 0;
  EXPECT_EQ(table.device_of(&e0), -1);
  table.remember(&e0, 0);
  table.remember(&e1, 3);
  EXPECT_EQ(table.device_of(&e0), 0);
  EXPECT_EQ(table.device_of(&e1), 3);
  table.forget(&e1);
  EXPECT_EQ(table.device_of(&e1), -1);
  EXPECT_EQ(table.device_of(&e0), 0);
}

}  // namespace
}  // namespace dparallel::cuda
