// Owned module handles and small module builders for the module tests.
#pragma once

#include <unistd.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "test_util.h"

namespace dptest {

// A per-process path under the test temp folder; `prefix` keeps suites apart.
inline std::string temp_path(const std::string& prefix, const std::string& name) {
  return ::testing::TempDir() + prefix + std::to_string(::getpid()) + "_" + name;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct ModuleDeleter {
  void operator()(dp_module* m) const { dp_module_destroy(m); }
};
using ModulePtr = std::unique_ptr<dp_module, ModuleDeleter>;

struct ReplicaSetDeleter {
  void operator()(dp_replica_set* s) const { dp_replica_set_destroy(s); }
};
using ReplicaSetPtr = std::unique_ptr<dp_replica_set, ReplicaSetDeleter>;

struct DdpDeleter {
  void operator()(dp_ddp* d) const { dp_ddp_destroy(d); }
};
using DdpPtr = std::unique_ptr<dp_ddp, DdpDeleter>;

struct FsdpDeleter {
  void operator()(dp_fsdp* f) const { dp_fsdp_destroy(f); }
};
using FsdpPtr = std::unique_ptr<dp_fsdp, FsdpDeleter>;

inline ModulePtr new_module() {
  dp_module* m = nullptr;
  EXPECT_EQ(dp_module_create(&m), DP_OK) << dp_last_error();
  return ModulePtr(m);
}

// A Linear(in, out) layer: "weight" (out x in) and "bias" (out), filled from `start`.
inline ModulePtr linear(int64_t in, int64_t out, float start = 0.0f, dp_device device = cpu(0)) {
  ModulePtr m = new_module();
  auto w = make<float>({out, in}, iota<float>(static_cast<size_t>(out * in), start), device);
  auto b = make<float>({out}, iota<float>(static_cast<size_t>(out), start + 100.0f), device);
  EXPECT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
  EXPECT_EQ(dp_module_register_parameter(m.get(), "bias", b.get(), 1), DP_OK) << dp_last_error();
  return m;
}

inline TensorPtr parameter(const dp_module* m, const char* name);

// "encoder" and "decoder" are one Linear(2, 2); "head.weight" is tied to its weight.
inline ModulePtr shared_and_tied() {
  ModulePtr root = new_module();
  ModulePtr shared = linear(2, 2);
  EXPECT_EQ(dp_module_register_module(root.get(), "encoder", shared.get()), DP_OK);
  EXPECT_EQ(dp_module_register_module(root.get(), "decoder", shared.get()), DP_OK);
  ModulePtr head = new_module();
  TensorPtr tied = parameter(shared.get(), "weight");
  EXPECT_EQ(dp_module_register_parameter(head.get(), "weight", tied.get(), 1), DP_OK) << dp_last_error();
  EXPECT_EQ(dp_module_register_module(root.get(), "head", head.get()), DP_OK);
  return root;
}

inline ReplicaSetPtr replica_set(dp_module* m, const std::vector<dp_device>& devices) {
  dp_replica_set* raw = nullptr;
  EXPECT_EQ(dp_replica_set_create(&raw, m, devices.data(), devices.size()), DP_OK) << dp_last_error();
  return ReplicaSetPtr(raw);
}

// The names that count() and at() list, in order.
inline std::vector<std::string> listed_names(const dp_module* m, size_t (*count)(const dp_module*),
                                             dp_status (*at)(const dp_module*, size_t, const char**, dp_tensor**)) {
  std::vector<std::string> names;
  for (size_t i = 0; i < count(m); ++i) {
    const char* name = nullptr;
    dp_tensor* t = nullptr;
    EXPECT_EQ(at(m, i, &name, &t), DP_OK) << dp_last_error();
    dp_tensor_destroy(t);
    names.push_back(name == nullptr ? "" : name);
  }
  return names;
}

inline std::vector<std::string> parameter_names(const dp_module* m) {
  return listed_names(m, dp_module_num_parameters, dp_module_parameter_at);
}

inline std::vector<std::string> buffer_names(const dp_module* m) {
  return listed_names(m, dp_module_num_buffers, dp_module_buffer_at);
}

inline TensorPtr parameter(const dp_module* m, const char* name) {
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &t), DP_OK) << dp_last_error();
  return TensorPtr(t);
}

inline TensorPtr grad(dp_module* m, const char* name) {
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_module_grad(m, name, &t), DP_OK) << dp_last_error();
  return TensorPtr(t);
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace dptest
