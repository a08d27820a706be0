#include <cstring>
#include <string>
#include <thread>

#include "test_util.h"

using namespace dptest;

TEST(StatusString, EveryCodeHasItsOwnText) {
  std::vector<std::string> texts;
  for (dp_status s = DP_OK; s >= DP_EINTERNAL; --s) texts.push_back(dp_status_string(s));
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_NE(texts[i], "unknown status") << i;
    for (size_t j = 0; j < i; ++j) EXPECT_NE(texts[i], texts[j]);
  }
  EXPECT_STREQ(dp_status_string(-99), "unknown status");
}

TEST(Version, NumberMatchesTheHeaderMacros) {
  EXPECT_EQ(dp_version_number(), DP_VERSION_MAJOR * 10000u + DP_VERSION_MINOR * 100u + DP_VERSION_PATCH);
}

TEST(LastError, IsPerThreadAndNamesTheArgument) {
  EXPECT_EQ(dp_device_parse(nullptr, nullptr), DP_EINVAL);
  std::string here = dp_last_error();
  EXPECT_NE(here.find("dp_device_parse"), std::string::npos) << here;
  EXPECT_NE(here.find("'text'"), std::string::npos) << here;
  std::string other = "unset";
  std::thread([&] { other = dp_last_error(); }).join();
  EXPECT_EQ(other, "");
}

TEST(DeviceParse, AcceptsTypesWithAndWithoutIndex) {
  dp_device d{};
  DP_EXPECT_OK(dp_device_parse("cpu", &d));
  EXPECT_TRUE(same_device(d, cpu(0)));
  DP_EXPECT_OK(dp_device_parse("cpu:3", &d));
  EXPECT_TRUE(same_device(d, cpu(3)));
  DP_EXPECT_OK(dp_device_parse("cuda:1", &d));
  EXPECT_TRUE(same_device(d, cuda(1)));
  DP_EXPECT_OK(dp_device_parse("cuda", &d));
  EXPECT_TRUE(same_device(d, cuda(0)));
}

TEST(DeviceParse, RejectsMalformedTextWithTheText) {
  dp_device d{};
  for (const char* bad : {"gpu:0", "cpu:", "cpu:-1", "cpu:1x", "cuda:99999999999", "", ":0"}) {
    EXPECT_EQ(dp_device_parse(bad, &d), DP_EINVAL) << bad;
    EXPECT_NE(last_error().find(std::string("\"") + bad + "\""), std::string::npos) << last_error();
  }
  EXPECT_EQ(dp_device_parse("cpu:1", nullptr), DP_EINVAL);
  EXPECT_NE(last_error().find("'out'"), std::string::npos);
}

TEST(DeviceFormat, WritesTextAndChecksCapacity) {
  char buf[16];
  DP_EXPECT_OK(dp_device_format(cuda(12), buf, sizeof(buf)));
  EXPECT_STREQ(buf, "cuda:12");
  EXPECT_EQ(dp_device_format(cpu(3), buf, 5), DP_EINVAL);  // "cpu:3" needs 6
  EXPECT_NE(last_error().find("needs 6 bytes"), std::string::npos) << last_error();
  EXPECT_EQ(dp_device_format(dp_device{7, 0}, buf, sizeof(buf)), DP_EINVAL);
  EXPECT_EQ(dp_device_format(cpu(0), nullptr, 8), DP_EINVAL);
}

TEST(DeviceCount, CpuIsTheLogicalLimitAndCudaNeverFails) {
  int32_t n = -1;
  DP_EXPECT_OK(dp_device_count(DP_DEVICE_CPU, &n));
  EXPECT_EQ(n, 64);
  DP_EXPECT_OK(dp_device_count(DP_DEVICE_CUDA, &n));
  EXPECT_GE(n, 0);
  EXPECT_EQ(dp_device_count(3, &n), DP_EINVAL);
  EXPECT_EQ(dp_device_count(DP_DEVICE_CPU, nullptr), DP_EINVAL);
}

TEST(DtypeSize, CoversEveryDtypeAndZeroForUnknown) {
  EXPECT_EQ(dp_dtype_size(DP_FLOAT32), 4u);
  EXPECT_EQ(dp_dtype_size(DP_FLOAT64), 8u);
  EXPECT_EQ(dp_dtype_size(DP_FLOAT16), 2u);
  EXPECT_EQ(dp_dtype_size(DP_BFLOAT16), 2u);
  EXPECT_EQ(dp_dtype_size(DP_INT8), 1u);
  EXPECT_EQ(dp_dtype_size(DP_UINT8), 1u);
  EXPECT_EQ(dp_dtype_size(DP_INT32), 4u);
  EXPECT_EQ(dp_dtype_size(DP_INT64), 8u);
  EXPECT_EQ(dp_dtype_size(DP_BOOL), 1u);
  EXPECT_EQ(dp_dtype_size(9), 0u);
  EXPECT_EQ(dp_dtype_size(-1), 0u);
}

// cpu:7 is used by no other test in this binary: its counts are this test's.
TEST(DeviceMemory, CountsATensorsBytesWhileItLivesAndKeepsThePeak) {
  const dp_device device = cpu(7);
  DP_ASSERT_OK(dp_device_reset_peak_memory(device));
  dp_memory_stats before{};
  before.struct_size = sizeof before;
  DP_ASSERT_OK(dp_device_memory_stats(device, &before));
  EXPECT_EQ(before.peak_allocated_bytes, before.allocated_bytes);
  {
    auto big = make<float>({1 << 18}, std::vector<float>(1 << 18, 1.0f), device);  // 1 MiB
    auto small = make<float>({10}, std::vector<float>(10, 1.0f), device);
    dp_memory_stats during{};
    during.struct_size = sizeof during;
    DP_ASSERT_OK(dp_device_memory_stats(device, &during));
    EXPECT_EQ(during.allocated_bytes, before.allocated_bytes + (1u << 20) + 40u);
    EXPECT_EQ(during.peak_allocated_bytes, during.allocated_bytes);
  }
  dp_memory_stats after{};
  after.struct_size = sizeof after;
  DP_ASSERT_OK(dp_device_memory_stats(device, &after));
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes, before.allocated_bytes + (1u << 20) + 40u);
  EXPECT_GE(after.cached_bytes, 1u << 20);  // the freed block is kept for reuse
  DP_ASSERT_OK(dp_device_reset_peak_memory(device));
  DP_ASSERT_OK(dp_device_memory_stats(device, &after));
  EXPECT_EQ(after.peak_allocated_bytes, after.allocated_bytes);
}

TEST(DeviceMemory, ABadDeviceOrStructSizeIsEinvalNamingIt) {
  dp_memory_stats stats{};
  stats.struct_size = sizeof stats;
  EXPECT_EQ(dp_device_memory_stats(dp_device{3, 0}, &stats), DP_EINVAL);
  EXPECT_NE(last_error().find("device"), std::string::npos) << last_error();
  EXPECT_EQ(dp_device_memory_stats(cpu(0), nullptr), DP_EINVAL);
  stats.struct_size = 4;
  EXPECT_EQ(dp_device_memory_stats(cpu(0), &stats), DP_EINVAL);
  EXPECT_NE(last_error().find("struct_size"), std::string::npos) << last_error();
  // An older, shorter struct (its first two fields) gets only its own bytes written.
  alignas(dp_memory_stats) unsigned char bytes[sizeof(dp_memory_stats)];
  std::memset(bytes, 0xA5, sizeof bytes);
  const size_t older = sizeof(size_t) + sizeof(uint64_t);
  std::memcpy(bytes, &older, sizeof older);
  DP_ASSERT_OK(dp_device_memory_stats(cpu(0), reinterpret_cast<dp_memory_stats*>(bytes)));
  for (size_t i = older; i < sizeof bytes; ++i) EXPECT_EQ(bytes[i], 0xA5) << "byte " << i;
  EXPECT_EQ(dp_device_reset_peak_memory(dp_device{DP_DEVICE_CPU, -1}), DP_EINVAL);
}
