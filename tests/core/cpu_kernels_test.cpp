#include "device/cpu/cpu_kernels.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "core/half.h"

using namespace dparallel;

TEST(CpuAddN, SumsFloatsLeftToRightAcrossBlocksAndThreads) {
  const size_t n = 1 << 20;  // several blocks per thread
  std::vector<float> a(n), b(n), c(n), out(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i) * 0.5f;
    b[i] = 1.0f;
    c[i] = -static_cast<float>(i % 7);
  }
  const void* inputs[] = {a.data(), b.data(), c.data()};
  cpu::add_n(DType::kFloat32, out.data(), inputs, 3, n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], (a[i] + b[i]) + c[i]) << i;
}

TEST(CpuAddN, IntegersWrapOnOverflow) {
  std::vector<int8_t> a{127, -128}, b{1, -1}, out(2);
  const void* inputs[] = {a.data(), b.data()};
  cpu::add_n(DType::kInt8, out.data(), inputs, 2, 2);
  EXPECT_EQ(out[0], -128);
  EXPECT_EQ(out[1], 127);
}

TEST(CpuAddN, BoolIsLogicalOr) {
  std::vector<uint8_t> a{0, 1, 0, 1}, b{0, 0, 1, 1}, out(4);
  const void* inputs[] = {a.data(), b.data()};
  cpu::add_n(DType::kBool, out.data(), inputs, 2, 4);
  EXPECT_EQ(out, (std::vector<uint8_t>{0, 1, 1, 1}));
}

TEST(CpuAddN, HalfAccumulatesInFloatAndRoundsOnce) {
  // 2048 + 1 + 1: fp16 per-step rounding would give 2048 (ties to even) twice; float gives 2050.
  std::vector<uint16_t> a{float_to_half(2048.0f)}, b{float_to_half(1.0f)}, c{float_to_half(1.0f)}, out(1);
  const void* inputs[] = {a.data(), b.data(), c.data()};
  cpu::add_n(DType::kFloat16, out.data(), inputs, 3, 1);
  EXPECT_EQ(half_to_float(out[0]), 2050.0f);
}

TEST(CpuAddN, OutputMayAliasFirstInput) {
  std::vector<double> a{1, 2, 3}, b{10, 20, 30};
  const void* inputs[] = {a.data(), b.data()};
  cpu::add_n(DType::kFloat64, a.data(), inputs, 2, 3);
  EXPECT_EQ(a, (std::vector<double>{11, 22, 33}));
}

TEST(CpuCopyRows, CopiesAStridedBlock) {
  // A 3x4 int32 matrix; copy columns 1..2 into a 3x2 block.
  std::vector<int32_t> src{0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23}, dst(6);
  cpu::copy_rows(dst.data(), 8, src.data() + 1, 16, 8, 3);
  EXPECT_EQ(dst, (std::vector<int32_t>{1, 2, 11, 12, 21, 22}));
}

TEST(CpuCopyToMany, EveryDestinationGetsTheSource) {
  const size_t n = 3 << 20;
  std::vector<uint8_t> src(n), d1(n), d2(n), d3(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 31);
  void* dsts[] = {d1.data(), d2.data(), d3.data()};
  cpu::copy_to_many(dsts, 3, src.data(), n);
  EXPECT_EQ(d1, src);
  EXPECT_EQ(d2, src);
  EXPECT_EQ(d3, src);
}
