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
