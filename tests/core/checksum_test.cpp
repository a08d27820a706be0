// CRC-32C: the check value of the standard, and agreement with a bitwise
// reference at every length and alignment around the 8-byte steps.
#include "module/checksum.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

uint32_t bitwise(const uint8_t* p, size_t n) {
  uint32_t crc = ~0u;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82f63b78u : 0u);
  }
  return ~crc;
}

TEST(Crc32c, CheckValueOfTheStandard) {
  const std::string digits = "123456789";
  EXPECT_EQ(dparallel::crc32c(0, digits.data(), digits.size()), 0xe3069283u);
  EXPECT_EQ(dparallel::crc32c(0, nullptr, 0), 0u);
}

TEST(Crc32c, MatchesABitwiseReferenceAtEveryLengthAndAlignmentAndWhenChained) {
  std::vector<uint8_t> data(200);
  uint32_t x = 12345;
  for (uint8_t& b : data) {
    x = x * 1103515245u + 12345u;
    b = static_cast<uint8_t>(x >> 16);
  }
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n + offset <= 80; ++n) {
      const uint32_t want = bitwise(data.data() + offset, n);
      EXPECT_EQ(dparallel::crc32c(0, data.data() + offset, n), want) << offset << " " << n;
      for (size_t split : {size_t(0), n / 3, n}) {
        const uint32_t first = dparallel::crc32c(0, data.data() + offset, split);
        EXPECT_EQ(dparallel::crc32c(first, data.data() + offset + split, n - split), want) << offset << " " << n;
      }
    }
  }
}

TEST(Crc32c, TextIsEightLowercaseHexDigitsAndNothingElseParses) {
  uint32_t crc = 0;
  EXPECT_EQ(dparallel::crc32c_text(0xe3069283u), "e3069283");
  EXPECT_EQ(dparallel::crc32c_text(0x1u), "00000001");
  EXPECT_TRUE(dparallel::parse_crc32c("e3069283", &crc));
  EXPECT_EQ(crc, 0xe3069283u);
  for (const char* bad : {"", "e306928", "e30692830", "E3069283", "e306928g", " e306928", "-3069283"}) {
    EXPECT_FALSE(dparallel::parse_crc32c(bad, &crc)) << bad;
  }
}

}  // namespace
