// Runs with DP_NUM_CPU_DEVICES=4 in its environment (see CMakeLists.txt).
#include "test_util.h"

using namespace dptest;

TEST(CpuDeviceLimit, EnvironmentVariableSetsTheNumberOfLogicalDevices) {
  int32_t n = 0;
  DP_ASSERT_OK(dp_device_count(DP_DEVICE_CPU, &n));
  EXPECT_EQ(n, 4);
  const int64_t dims[] = {1};
  dp_tensor* t = nullptr;
  DP_EXPECT_OK(dp_tensor_create(&t, DP_FLOAT32, 1, dims, cpu(3)));
  dp_tensor_destroy(t);
  t = nullptr;
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 1, dims, cpu(4)), DP_EINVAL);
  EXPECT_NE(last_error().find("only 4 logical CPU devices"), std::string::npos) << last_error();
}
