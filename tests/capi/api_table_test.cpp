#include <dlfcn.h>

#include "test_util.h"

using namespace dptest;

TEST(ApiTable, UnsupportedMajorIsNull) {
  EXPECT_EQ(dp_get_api(DP_VERSION_MAJOR + 1), nullptr);
}

TEST(ApiTable, EveryEntryIsTheExportedFunction) {
  const dp_api* api = dp_get_api(DP_VERSION_MAJOR);
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->struct_size, sizeof(dp_api));
  EXPECT_EQ(api->abi_major, static_cast<uint32_t>(DP_VERSION_MAJOR));
  EXPECT_EQ(api->abi_minor, static_cast<uint32_t>(DP_API_MINOR));
  EXPECT_EQ(api->tensor_create, &dp_tensor_create);
  EXPECT_EQ(api->gather, &dp_gather);
  EXPECT_EQ(api->tensor_to_device, &dp_tensor_to_device);
  // No slot is empty.
  const auto* slots = reinterpret_cast<void* const*>(reinterpret_cast<const char*>(api) + 16);
  size_t nslots = (sizeof(dp_api) - 16) / sizeof(void*);
  for (size_t i = 0; i < nslots; ++i) EXPECT_NE(slots[i], nullptr) << "slot " << i;
}

TEST(ApiTable, DlopenHostReachesEverythingThroughOneSymbol) {
  void* lib = dlopen("libdparallel.so.0", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  dlerror();
  auto get_api = reinterpret_cast<const dp_api* (*)(uint32_t)>(dlsym(lib, "dp_get_api"));
  ASSERT_NE(get_api, nullptr) << dlerror();
  const dp_api* api = get_api(DP_VERSION_MAJOR);
  ASSERT_NE(api, nullptr);
  const int64_t dims[] = {3};
  dp_tensor* t = nullptr;
  ASSERT_EQ(api->tensor_create(&t, DP_INT32, 1, dims, cpu(0)), DP_OK);
  EXPECT_EQ(api->tensor_numel(t), 3);
  api->tensor_destroy(t);
  // Internal symbols stay hidden.
  EXPECT_EQ(dlsym(lib, "_ZN9dparallel6Tensor5zerosENS_5DTypeERKSt6vectorIlSaIlEERKNS_6DeviceE"), nullptr);
  dlclose(lib);
}
