// Module edge cases: UTF-8 names, the cycle check on shared
// children, temporary files of saves, and bounded memory when loading.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

#include "module/module_test_util.h"

using namespace dptest;

namespace {

std::string temp_path(const std::string& name) { return dptest::temp_path("dp_robustness_", name); }

// A "VmHWM:"-style line of /proc/self/status in kB, or -1.
long status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::string(key).size()));
  }
  return -1;
}

// Resets the peak RSS to the current RSS; false where the kernel refuses.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out) && status_kb("VmHWM:") >= 0;
}

// How much the peak RSS grows (in MB) while `work` runs.
template <typename Work>
long peak_growth_mb(Work&& work) {
  long before = status_kb("VmRSS:");
  work();
  return (status_kb("VmHWM:") - before) / 1024;
}

}  // namespace

TEST(ModuleNames, NamesThatAreNotUtf8AreRefusedAtRegistration) {
  ModulePtr m = new_module();
  auto t = make<float>({1}, {1});
  ModulePtr child = new_module();
  const char* bad[] = {"w\xff", "\xc0\xaf", "\xed\xa0\x80", "ab\xe2\x82"};
  for (const char* name : bad) {
    EXPECT_EQ(dp_module_register_parameter(m.get(), name, t.get(), 1), DP_EINVAL);
    EXPECT_TRUE(contains(last_error(), "argument 'name' is not valid UTF-8")) << last_error();
    EXPECT_EQ(dp_module_register_buffer(m.get(), name, t.get(), 1), DP_EINVAL);
    EXPECT_EQ(dp_module_register_module(m.get(), name, child.get()), DP_EINVAL);
  }
  EXPECT_EQ(dp_module_num_parameters(m.get()), 0u);
  DP_ASSERT_OK(dp_module_register_parameter(m.get(), "gewicht_\xc3\xa4_\xf0\x9f\x99\x82", t.get(), 1));
  std::string path = temp_path("utf8.safetensors");
  DP_EXPECT_OK(dp_module_save(m.get(), path.c_str()));
  std::remove(path.c_str());
}

TEST(ModuleCycles, TheCycleCheckVisitsASharedChildOnce) {
  // 40 levels, each child registered under two names: 2^40 paths, 41 modules.
  std::vector<ModulePtr> chain;
  chain.push_back(new_module());
  for (int level = 0; level < 40; ++level) {
    ModulePtr parent = new_module();
    DP_ASSERT_OK(dp_module_register_module(parent.get(), "a", chain.back().get()));
    DP_ASSERT_OK(dp_module_register_module(parent.get(), "b", chain.back().get()));
    chain.push_back(std::move(parent));
  }
  ModulePtr outside = new_module();
  auto start = std::chrono::steady_clock::now();
  DP_ASSERT_OK(dp_module_register_module(outside.get(), "top", chain.back().get()));
  EXPECT_EQ(dp_module_register_module(chain.front().get(), "loop", chain.back().get()), DP_EINVAL);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(ModuleSave, TheUsersTmpFileIsLeftAlone) {
  ModulePtr m = linear(2, 2);
  std::string path = temp_path("keep.safetensors");
  {
    std::ofstream out(path + ".tmp", std::ios::binary);
    out << "mine";
  }
  DP_ASSERT_OK(dp_module_save(m.get(), path.c_str()));
  EXPECT_EQ(read_bytes(path + ".tmp"), "mine");
  std::remove((path + ".tmp").c_str());
  std::remove(path.c_str());
}

TEST(ModuleSave, ConcurrentSavesToOnePathAllSucceed) {
  ModulePtr a = linear(8, 8, 1.0f), b = linear(8, 8, 2.0f);
  std::string path = temp_path("race.safetensors");
  std::atomic<int> failures{0};
  auto save_many = [&](dp_module* m) {
    for (int i = 0; i < 200; ++i) {
      if (dp_module_save(m, path.c_str()) != DP_OK) failures++;
    }
  };
  std::thread first(save_many, a.get()), second(save_many, b.get());
  first.join();
  second.join();
  EXPECT_EQ(failures.load(), 0);
  ModulePtr loaded = linear(8, 8, 0.0f);
  DP_EXPECT_OK(dp_module_load(loaded.get(), path.c_str(), 1));  // whole, from one of the two
  std::remove(path.c_str());
}

TEST(ModuleLoad, ADeeplyNestedHeaderIsRefusedWithoutBuildingIt) {
  const size_t header_bytes = 20u << 20;
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((header_bytes >> (8 * i)) & 0xff);
  bytes += '{';
  bytes += "\"a\":";
  bytes.append(header_bytes - 5, '[');
  std::string path = temp_path("deep.safetensors");
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  bytes.clear();
  bytes.shrink_to_fit();
  if (!reset_peak_rss()) GTEST_SKIP() << "the peak RSS cannot be reset here";
  ModulePtr m = linear(1, 1);
  long growth = peak_growth_mb([&] { EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 0), DP_EIO); });
  EXPECT_TRUE(contains(last_error(), "nests deeper")) << last_error();
  EXPECT_LT(growth, 80) << "MB of peak RSS for a 20 MB header";
  std::remove(path.c_str());
}

TEST(ModuleLoad, TensorBytesAreReadStraightIntoPlace) {
  const int64_t n = 16 << 20;  // 64 MB of float32
  ModulePtr m = new_module();
  {
    auto big = make<float>({n}, std::vector<float>(static_cast<size_t>(n), 1.5f));
    DP_ASSERT_OK(dp_module_register_parameter(m.get(), "big", big.get(), 1));
  }
  std::string path = temp_path("big.safetensors");
  DP_ASSERT_OK(dp_module_save(m.get(), path.c_str()));
  TensorPtr big = parameter(m.get(), "big");
  std::fill_n(static_cast<float*>(dp_tensor_data(big.get())), n, 0.0f);
  if (!reset_peak_rss()) GTEST_SKIP() << "the peak RSS cannot be reset here";
  long growth = peak_growth_mb([&] { DP_EXPECT_OK(dp_module_load(m.get(), path.c_str(), 1)); });
  EXPECT_LT(growth, 32) << "MB of peak RSS to load a 64 MB checkpoint";
  const float* data = static_cast<const float*>(dp_tensor_data(big.get()));
  EXPECT_EQ(data[0], 1.5f);
  EXPECT_EQ(data[n - 1], 1.5f);
  std::remove(path.c_str());
}
