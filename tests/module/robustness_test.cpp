// Module edge cases: UTF-8 names, the cycle check on shared
// children, temporary files of saves, bounded memory and time when loading,
// files that are not regular, and deep module trees.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
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

namespace {

// A safetensors file of `count` one-byte U8 tensors "t0", "t1", ... whose
// data section holds `data_bytes` bytes.
void write_many_keys(const std::string& path, size_t count, size_t data_bytes) {
  std::string header = "{";
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) header += ',';
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[" + std::to_string(i) +
              "," + std::to_string(i + 1) + "]}";
  }
  header += "}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream out(path, std::ios::binary);
  out << bytes << header << std::string(data_bytes, '\x01');
}

}  // namespace

TEST(ModuleLoad, AHeaderWithManyKeysIsCheckedInNearLinearTime) {
  // Looking each key up in the object built so far made this quadratic: 400k
  // keys took minutes. Linear work takes seconds even under sanitizers; the
  // bound is half the test timeout.
  const size_t keys = 400000;
  std::string path = temp_path("many_keys.safetensors");
  write_many_keys(path, keys, keys - 1);  // one byte short: refused once every key is read
  ModulePtr m = linear(1, 1);
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 0), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "\"t399999\" has data_offsets [399999, 400000] outside")) << last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  std::remove(path.c_str());
}

TEST(ModuleSave, ManyTensorsSaveAndLoadInNearLinearTime) {
  // 200 children of 1000 one-byte parameters each; writing the header key by
  // key into a JSON object was quadratic too.
  ModulePtr root = new_module();
  for (int c = 0; c < 200; ++c) {
    ModulePtr child = new_module();
    for (int p = 0; p < 1000; ++p) {
      auto t = make<uint8_t>({1}, {static_cast<uint8_t>(p)});
      DP_ASSERT_OK(dp_module_register_parameter(child.get(), ("p" + std::to_string(p)).c_str(), t.get(), 1));
    }
    DP_ASSERT_OK(dp_module_register_module(root.get(), ("c" + std::to_string(c)).c_str(), child.get()));
  }
  std::string path = temp_path("many_tensors.safetensors");
  auto start = std::chrono::steady_clock::now();
  DP_ASSERT_OK(dp_module_save(root.get(), path.c_str()));
  DP_EXPECT_OK(dp_module_load(root.get(), path.c_str(), 1));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  EXPECT_EQ(values<uint8_t>(parameter(root.get(), "c199.p999").get()), (std::vector<uint8_t>{999 % 256}));
  std::remove(path.c_str());
}

namespace {

std::string header_image(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// The entries of `dir` whose names start with `prefix`.
std::vector<std::string> entries_in(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
  }
  closedir(d);
  return names;
}

// A folder of this test's own (other tests save beside it at the same time).
std::string private_dir() {
  std::string pattern = ::testing::TempDir() + "dp_robustness_XXXXXX";
  return ::mkdtemp(pattern.data()) != nullptr ? pattern : ::testing::TempDir();
}

}  // namespace

TEST(ModuleLoad, DuplicateKeysAreRefusedNamingTheKey) {
  ModulePtr m = linear(1, 1, 5.0f);
  const std::string weight = R"("weight":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]})";
  const std::string bias = R"("bias":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})";
  const std::string data(8, '\0');
  struct Case {
    std::string header;
    std::string expected;
  };
  const Case cases[] = {
      // The second "weight" would win before: one checker sees one tensor, a loader another.
      {"{" + weight + "," + bias + "," + R"("weight":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]})" + "}",
       R"(the header has the key "weight" twice)"},
      {"{" + weight + "," + R"("bias":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[4,8]})" + "}",
       R"("bias" has the key "dtype" twice)"},
      {R"({"__metadata__":{"format":"pt","format":"np"},)" + weight + "," + bias + "}",
       R"("__metadata__" has the key "format" twice)"},
      {R"({"__metadata__":{},"__metadata__":{},)" + weight + "," + bias + "}",
       R"(the header has the key "__metadata__" twice)"},
  };
  std::string path = temp_path("duplicate.safetensors");
  for (const Case& c : cases) {
    write_file(path, header_image(c.header, data));
    EXPECT_EQ(dp_module_load(m.get(), path.c_str(), 1), DP_EIO) << c.header;
    EXPECT_TRUE(contains(last_error(), c.expected)) << last_error();
  }
  EXPECT_EQ(values<float>(parameter(m.get(), "weight").get()), (std::vector<float>{5.0f}));
  std::remove(path.c_str());
}

TEST(ModuleLoad, AFifoIsRefusedWithoutWaitingForAWriter) {
  std::string path = temp_path("fifo.safetensors");
  std::remove(path.c_str());
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  ModulePtr m = linear(1, 1);
  auto load = std::async(std::launch::async, [&] {
    dp_status status = dp_module_load(m.get(), path.c_str(), 1);
    return std::make_pair(status, last_error());
  });
  const bool returned = load.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!returned) {
    int writer = ::open(path.c_str(), O_WRONLY);  // meets the blocked reader, which then sees end of file
    if (writer >= 0) ::close(writer);
  }
  auto [status, message] = load.get();
  EXPECT_TRUE(returned) << "dp_module_load blocked opening a FIFO";
  EXPECT_EQ(status, DP_EINVAL);
  EXPECT_TRUE(contains(message, "'" + path + "') is a FIFO")) << message;
  // Saving over it is refused too, and leaves it in place.
  EXPECT_EQ(dp_module_save(m.get(), path.c_str()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "is a FIFO")) << last_error();
  struct stat info {};
  ASSERT_EQ(::lstat(path.c_str(), &info), 0);
  EXPECT_TRUE(S_ISFIFO(info.st_mode));
  std::remove(path.c_str());
}

TEST(ModuleSave, ASymbolicLinkIsKeptAndItsTargetReplaced) {
  ModulePtr m = linear(2, 2, 3.0f);
  const std::string name = "dp_robustness_" + std::to_string(::getpid()) + "_link_target.safetensors";
  std::string target = ::testing::TempDir() + name, link = temp_path("link.safetensors");
  write_file(target, "old");
  std::remove(link.c_str());
  ASSERT_EQ(::symlink(name.c_str(), link.c_str()), 0) << std::strerror(errno);  // relative, as ln -s makes
  DP_ASSERT_OK(dp_module_save(m.get(), link.c_str()));
  struct stat info {};
  ASSERT_EQ(::lstat(link.c_str(), &info), 0);
  EXPECT_TRUE(S_ISLNK(info.st_mode)) << "the link was replaced by a file";
  EXPECT_NE(read_bytes(target), "old");
  ModulePtr loaded = linear(2, 2);
  DP_EXPECT_OK(dp_module_load(loaded.get(), target.c_str(), 1));
  EXPECT_EQ(values<float>(parameter(loaded.get(), "weight").get()), iota<float>(4, 3.0f));
  // A dangling link: the save creates the file it names.
  std::remove(target.c_str());
  DP_ASSERT_OK(dp_module_save(m.get(), link.c_str()));
  ASSERT_EQ(::lstat(link.c_str(), &info), 0);
  EXPECT_TRUE(S_ISLNK(info.st_mode));
  DP_EXPECT_OK(dp_module_load(loaded.get(), link.c_str(), 1));
  std::remove(link.c_str());
  std::remove(target.c_str());
}

TEST(ModuleSave, AReadOnlyFileIsNotOverwritten) {
  ModulePtr m = linear(1, 1);
  const std::string dir = private_dir();
  std::string path = dir + "/read_only.safetensors";
  write_file(path, "keep me");
  ASSERT_EQ(::chmod(path.c_str(), 0444), 0);
  EXPECT_EQ(dp_module_save(m.get(), path.c_str()), DP_EIO);
  EXPECT_TRUE(contains(last_error(), "read-only file '" + path + "'")) << last_error();
  EXPECT_TRUE(contains(last_error(), std::strerror(EACCES))) << last_error();
  EXPECT_EQ(read_bytes(path), "keep me");
  EXPECT_TRUE(entries_in(dir, ".dp-save-").empty());
  ::chmod(path.c_str(), 0644);
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(ModuleSave, AReplacedFileKeepsItsPermissions) {
  ModulePtr m = linear(1, 1);
  std::string path = temp_path("mode.safetensors");
  write_file(path, "old");
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  DP_ASSERT_OK(dp_module_save(m.get(), path.c_str()));
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 07777, 0640u);
  std::remove(path.c_str());
}

TEST(ModuleSave, ABasenameNearNameMaxCanBeSaved) {
  // path + ".XXXXXX" as the temporary name passed NAME_MAX (255) from 249 characters on.
  ModulePtr m = linear(1, 1);
  const std::string dir = private_dir();
  std::string path = dir + "/" + std::string(255, 'n');
  DP_ASSERT_OK(dp_module_save(m.get(), path.c_str()));
  DP_EXPECT_OK(dp_module_load(m.get(), path.c_str(), 1));
  EXPECT_TRUE(entries_in(dir, ".dp-save-").empty());
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST(ModuleTree, AChainOf200000NestedModulesIsDestroyedWithoutRecursing) {
  ModulePtr root = new_module();
  dp_module* deepest = root.get();
  for (int level = 0; level < 200000; ++level) {
    dp_module* child = nullptr;
    DP_ASSERT_OK(dp_module_create(&child));
    DP_ASSERT_OK(dp_module_register_module(deepest, "a", child));
    if (deepest != root.get()) dp_module_destroy(deepest);  // the tree holds it
    deepest = child;
  }
  dp_module_destroy(deepest);
  // Walks refuse it (dotted names 400k characters long) rather than build them.
  EXPECT_EQ(dp_module_num_parameters(root.get()), 0u);
  EXPECT_TRUE(contains(last_error(), "deeper than 1024 levels")) << last_error();
  root.reset();  // recursed once per level before: a stack overflow
}

TEST(ModuleTree, WalksAcceptTreesUpToTheDepthLimitAndRefuseDeeperOnes) {
  // kMaxModuleDepth (1024) levels below the root, a parameter at the bottom.
  ModulePtr root = new_module();
  std::vector<ModulePtr> chain;
  dp_module* deepest = root.get();
  for (int level = 0; level < 1024; ++level) {
    chain.push_back(new_module());
    DP_ASSERT_OK(dp_module_register_module(deepest, "m", chain.back().get()));
    deepest = chain.back().get();
  }
  auto t = make<float>({1}, {2.0f});
  DP_ASSERT_OK(dp_module_register_parameter(deepest, "w", t.get(), 1));
  EXPECT_EQ(dp_module_num_parameters(root.get()), 1u);
  std::string path = temp_path("deep_tree.safetensors");
  DP_ASSERT_OK(dp_module_save(root.get(), path.c_str()));
  DP_EXPECT_OK(dp_module_load(root.get(), path.c_str(), 1));
  // One level more: every walk says why.
  ModulePtr extra = new_module();
  DP_ASSERT_OK(dp_module_register_module(deepest, "m", extra.get()));
  EXPECT_EQ(dp_module_num_parameters(root.get()), 0u);
  EXPECT_TRUE(contains(last_error(), "the module tree is deeper than 1024 levels")) << last_error();
  EXPECT_EQ(dp_module_save(root.get(), path.c_str()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "deeper than 1024 levels")) << last_error();
  EXPECT_EQ(dp_module_load(root.get(), path.c_str(), 1), DP_EINVAL);
  dp_replica_set* set = nullptr;
  const dp_device devices[] = {cpu(0), cpu(1)};
  EXPECT_EQ(dp_replica_set_create(&set, root.get(), devices, 2), DP_EINVAL);
  EXPECT_EQ(set, nullptr);
  // The subtree below the root is within the limit again.
  EXPECT_EQ(dp_module_num_parameters(chain[0].get()), 1u);
  std::remove(path.c_str());
}
