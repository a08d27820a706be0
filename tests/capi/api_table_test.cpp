#include <dlfcn.h>

#include <cstdio>
#include <set>

#include "test_util.h"

using namespace dptest;

TEST(ApiTable, UnsupportedMajorIsNull) { EXPECT_EQ(dp_get_api(DP_VERSION_MAJOR + 1), nullptr); }

TEST(ApiTable, EveryEntryIsTheExportedFunction) {
  const dp_api* api = dp_get_api(DP_VERSION_MAJOR);
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->struct_size, sizeof(dp_api));
  EXPECT_EQ(api->abi_major, static_cast<uint32_t>(DP_VERSION_MAJOR));
  EXPECT_EQ(api->abi_minor, static_cast<uint32_t>(DP_API_MINOR));
  EXPECT_EQ(api->tensor_create, &dp_tensor_create);
  EXPECT_EQ(api->gather, &dp_gather);
  EXPECT_EQ(api->tensor_to_device, &dp_tensor_to_device);
  EXPECT_EQ(api->module_create, &dp_module_create);
  EXPECT_EQ(api->pg_all_reduce, &dp_pg_all_reduce);
  EXPECT_EQ(api->process_group_backend, &dp_process_group_backend);
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

TEST(ApiTable, EveryExportedFunctionHasASlot) {
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(&dp_get_api), &info), 0);
  std::string command = std::string("nm -D --defined-only '") + info.dli_fname + "'";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  const dp_api* api = dp_get_api(DP_VERSION_MAJOR);
  const auto* slots = reinterpret_cast<void* const*>(reinterpret_cast<const char*>(api) + 16);
  std::set<void*> in_table(slots, slots + (sizeof(dp_api) - 16) / sizeof(void*));
  void* self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(self, nullptr);
  char line[512];
  size_t exported = 0;
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    char kind = 0;
    char name[256] = {};
    if (std::sscanf(line, "%*s %c %255s", &kind, name) != 2 || kind != 'T') continue;
    std::string symbol = name;
    symbol = symbol.substr(0, symbol.find('@'));
    if (symbol.rfind("dp_", 0) != 0 || symbol == "dp_get_api") continue;
    ++exported;
    EXPECT_TRUE(in_table.count(dlsym(self, symbol.c_str())) == 1) << symbol << " is exported but not in dp_api";
  }
  pclose(pipe);
  dlclose(self);
  EXPECT_EQ(exported, in_table.size());
}
