// Helpers shared by the C ABI tests: owned handles and host round trips.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"

namespace dptest {

struct TensorDeleter {
  void operator()(dp_tensor* t) const { dp_tensor_destroy(t); }
};
using TensorPtr = std::unique_ptr<dp_tensor, TensorDeleter>;

inline dp_device cpu(int index) { return dp_device{DP_DEVICE_CPU, index}; }
inline dp_device cuda(int index) { return dp_device{DP_DEVICE_CUDA, index}; }

inline int cuda_count() {
  int32_t n = 0;
  return dp_device_count(DP_DEVICE_CUDA, &n) == DP_OK ? n : 0;
}

template <typename T>
int32_t dtype_of();
template <>
inline int32_t dtype_of<float>() {
  return DP_FLOAT32;
}
template <>
inline int32_t dtype_of<double>() {
  return DP_FLOAT64;
}
template <>
inline int32_t dtype_of<int8_t>() {
  return DP_INT8;
}
template <>
inline int32_t dtype_of<uint8_t>() {
  return DP_UINT8;
}
template <>
inline int32_t dtype_of<int32_t>() {
  return DP_INT32;
}
template <>
inline int32_t dtype_of<int64_t>() {
  return DP_INT64;
}

// A tensor on `device` holding `values` with `shape`.
template <typename T>
TensorPtr make(const std::vector<int64_t>& shape, const std::vector<T>& values, dp_device device = cpu(0)) {
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_create(&t, dtype_of<T>(), static_cast<int32_t>(shape.size()), shape.data(), device), DP_OK)
      << dp_last_error();
  if (t != nullptr && !values.empty()) {
    EXPECT_EQ(dp_tensor_copy_from_host(t, values.data(), values.size() * sizeof(T)), DP_OK) << dp_last_error();
  }
  return TensorPtr(t);
}

template <typename T>
std::vector<T> iota(size_t n, T start = T(0)) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<T>(i));
  return v;
}

template <typename T>
std::vector<T> values(const dp_tensor* t) {
  std::vector<T> out(static_cast<size_t>(dp_tensor_numel(t)));
  EXPECT_EQ(dp_tensor_copy_to_host(t, out.data(), out.size() * sizeof(T)), DP_OK) << dp_last_error();
  return out;
}

inline std::vector<int64_t> shape(const dp_tensor* t) {
  std::vector<int64_t> s(static_cast<size_t>(dp_tensor_ndim(t)));
  EXPECT_EQ(dp_tensor_shape(t, s.data(), static_cast<int32_t>(s.size())), DP_OK);
  return s;
}

inline bool same_device(dp_device a, dp_device b) { return a.type == b.type && a.index == b.index; }

inline std::string last_error() { return dp_last_error(); }

// Threads of this process whose name starts with `prefix` (/proc/self/task);
// the library names its own ("dp-dev cpu:0", "dp-pool", "dp-lane", ...).
inline int threads_named(const std::string& prefix) {
  int count = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + entry->d_name + "/comm");
    std::string name;
    if (std::getline(comm, name) && name.rfind(prefix, 0) == 0) ++count;
  }
  closedir(dir);
  return count;
}

}  // namespace dptest

#define DP_EXPECT_OK(expr) EXPECT_EQ((expr), DP_OK) << dp_last_error()
#define DP_ASSERT_OK(expr) ASSERT_EQ((expr), DP_OK) << dp_last_error()
