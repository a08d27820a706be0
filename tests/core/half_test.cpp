#include "core/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace dparallel;

TEST(HalfConversion, ExactValuesRoundTrip) {
  for (float v : {0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, -65504.0f, 6.103515625e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(half_to_float(float_to_half(v)), v) << v;
  }
}

TEST(HalfConversion, KnownBitPatterns) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(1e6f), 0x7c00);            // overflow rounds to inf
  EXPECT_EQ(float_to_half(5.9604645e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);
}

TEST(HalfConversion, RoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1).
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 lies halfway between 1 + 2^-10 and 1 + 2^-9: even is 1 + 2^-9.
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

TEST(HalfConversion, InfinityAndNanSurvive) {
  EXPECT_TRUE(std::isinf(half_to_float(float_to_half(std::numeric_limits<float>::infinity()))));
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(BFloat16Conversion, RoundsToNearestEvenAndKeepsNan) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(bfloat16_to_float(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: rounds to 1.
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
}
