// The plan behind cuda::batched_copy: how segments are cut into chunks and
// which word width each chunk copies with. Host code only; the kernel follows
// the plan as run_plan below does.
#include "device/cuda/batched_copy_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace dparallel::cuda {
namespace {

void* at(uintptr_t address) { return reinterpret_cast<void*>(address); }

// The kernel's copy on the host: the byte head, aligned words, the byte tail.
void run_plan(const std::vector<CopyChunk>& plan) {
  for (const CopyChunk& c : plan) {
    ASSERT_LE(c.head, c.nbytes);
    std::memcpy(c.dst, c.src, c.head);
    size_t words = (c.nbytes - c.head) / c.width;
    const char* src = c.src + c.head;
    char* dst = c.dst + c.head;
    if (words > 0) {
      ASSERT_EQ(reinterpret_cast<uintptr_t>(src) % c.width, 0u);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(dst) % c.width, 0u);
    }
    std::memcpy(dst, src, words * c.width);
    size_t done = c.head + words * c.width;
    std::memcpy(c.dst + done, c.src + done, c.nbytes - done);
  }
}

TEST(BatchedCopyPlan, WidthIsTheWidestWordBothPointersAlignTo) {
  EXPECT_EQ(copy_width(0x1000, 0x2000), 16u);
  EXPECT_EQ(copy_width(0x1004, 0x2004), 16u);  // the same misalignment: a head, then 16 bytes
  EXPECT_EQ(copy_width(0x100f, 0x200f), 16u);
  EXPECT_EQ(copy_width(0x1000, 0x2008), 8u);
  EXPECT_EQ(copy_width(0x1004, 0x2008), 4u);
  EXPECT_EQ(copy_width(0x1002, 0x2000), 2u);
  EXPECT_EQ(copy_width(0x1001, 0x2000), 1u);
  EXPECT_EQ(copy_width(0x1003, 0x2006), 1u);
}

TEST(BatchedCopyPlan, HeadReachesTheAlignmentButNotPastTheChunk) {
  EXPECT_EQ(copy_head(0x1000, 16, 100), 0u);
  EXPECT_EQ(copy_head(0x1004, 16, 100), 12u);
  EXPECT_EQ(copy_head(0x1004, 16, 5), 5u);
  EXPECT_EQ(copy_head(0x1007, 8, 100), 1u);
  EXPECT_EQ(copy_head(0x1007, 1, 100), 0u);
}

TEST(BatchedCopyPlan, ChunkSizeStaysBetween64KiBAnd1MiBInWholeVectors) {
  EXPECT_EQ(copy_chunk_bytes(0, 528), kMinCopyChunk);
  EXPECT_EQ(copy_chunk_bytes(size_t{10} << 20, 528), kMinCopyChunk);
  EXPECT_EQ(copy_chunk_bytes(size_t{1} << 40, 528), kMaxCopyChunk);
  EXPECT_EQ(copy_chunk_bytes(std::numeric_limits<size_t>::max(), 1), kMaxCopyChunk);
  EXPECT_EQ(copy_chunk_bytes(size_t{100} << 20, 0), kMaxCopyChunk);
  size_t between = copy_chunk_bytes((size_t{200} << 20) + 12345, 528);
  EXPECT_GT(between, kMinCopyChunk);
  EXPECT_LT(between, kMaxCopyChunk);
  EXPECT_EQ(between % 16, 0u);
}

// The case the plan exists for: one large segment used to run on one SM.
TEST(BatchedCopyPlan, OneLargeSegmentSpreadsOverManyBlocks) {
  std::vector<Segment> segments{{at(0x10000001), at(0x20000003), size_t{10} << 20}};
  auto plan = plan_batched_copy(segments, 132 * 4);
  EXPECT_EQ(plan.size(), (size_t{10} << 20) / kMinCopyChunk);
  for (const CopyChunk& c : plan) {
    EXPECT_EQ(c.width, 2u);
    EXPECT_EQ(c.head, 1u);
  }
}

TEST(BatchedCopyPlan, ChunksCoverEachSegmentInOrderAndSkipEmptyOnes) {
  std::vector<Segment> segments{{at(0x1000), at(0x9000), 0},
                                {at(0x100003), at(0x900003), (size_t{3} << 20) + 5},
                                {at(0x500000), at(0xa00001), 17}};
  auto plan = plan_batched_copy(segments, 8);
  size_t chunk = copy_chunk_bytes((size_t{3} << 20) + 22, 8);
  size_t i = 0;
  for (const Segment& s : segments) {
    size_t covered = 0;
    while (covered < s.nbytes) {
      ASSERT_LT(i, plan.size());
      const CopyChunk& c = plan[i++];
      EXPECT_EQ(c.dst, static_cast<char*>(s.dst) + covered);
      EXPECT_EQ(c.src, static_cast<const char*>(s.src) + covered);
      EXPECT_GT(c.nbytes, 0u);
      EXPECT_LE(c.nbytes, chunk);
      EXPECT_LT(c.head, c.width);
      covered += c.nbytes;
    }
    EXPECT_EQ(covered, s.nbytes);
  }
  EXPECT_EQ(i, plan.size());
  EXPECT_TRUE(plan_batched_copy({}, 8).empty());
}

TEST(BatchedCopyPlan, GridNeverExceedsItsLimit) {
  EXPECT_EQ(copy_grid(0), 0u);
  EXPECT_EQ(copy_grid(5), 5u);
  EXPECT_EQ(copy_grid(kMaxCopyGrid), 2147483647u);
  EXPECT_EQ(copy_grid(std::numeric_limits<size_t>::max()), 2147483647u);
}

// Every offset pairing and a range of sizes, followed as the kernel does,
// copies exactly the segments' bytes and nothing else.
TEST(BatchedCopyPlan, FollowingThePlanCopiesMisalignedSegmentsExactly) {
  const size_t kSize = size_t{6} << 20;
  std::vector<unsigned char> src(kSize), dst(kSize, 0), expected(kSize, 0);
  std::mt19937 rng(7);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  const size_t sizes[] = {1, 3, 15, 16, 17, 100, 4095, 65536 + 3, (size_t{1} << 20) + 7, (size_t{2} << 20) + 1};
  std::vector<Segment> segments;
  size_t dst_at = 0, src_at = 0, n = 0;
  for (size_t nbytes : sizes) {
    for (size_t skew = 0; skew < 3; ++skew, ++n) {
      dst_at += n % 16;               // a spread of misalignments,
      src_at += (n * 7 + skew) % 16;  // equal or not to the destination's
      if (dst_at + nbytes > kSize || src_at + nbytes > kSize) break;
      segments.push_back({dst.data() + dst_at, src.data() + src_at, nbytes});
      std::memcpy(expected.data() + dst_at, src.data() + src_at, nbytes);
      dst_at += nbytes + 5;
      src_at = (src_at + 4099) % (kSize / 2);
    }
  }
  ASSERT_GT(segments.size(), 20u);
  run_plan(plan_batched_copy(segments, 16));
  EXPECT_TRUE(dst == expected);
}

}  // namespace
}  // namespace dparallel::cuda
