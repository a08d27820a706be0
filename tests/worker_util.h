// What the multi-process test workers (conformance_worker, shm_worker) share: the
// CHECK macros that count failures instead of stopping, the dtypes and ops
// every collective is tried with, and each rank's values and the reduction
// they must give.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "core/half.h"
#include "dparallel/dparallel.h"

namespace dptest_worker {

inline int g_failures = 0;
inline int g_rank = -1;

#define CHECK(cond, ...)                                                                       \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "rank %d: check failed at line %d: %s: ", g_rank, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                       \
      std::fprintf(stderr, "\n");                                                              \
      ++g_failures;                                                                            \
    }                                                                                          \
  } while (0)

#define CHECK_OK(expr) CHECK((expr) == DP_OK, "%s", dp_last_error())

inline const int32_t kDtypes[] = {DP_FLOAT32, DP_FLOAT64, DP_FLOAT16, DP_BFLOAT16, DP_INT8,
                                  DP_UINT8,   DP_INT32,   DP_INT64,   DP_BOOL};
inline const char* kDtypeNames[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                    "uint8",   "int32",   "int64",   "bool"};
inline const char* kOpNames[] = {"sum", "avg", "min", "max", "prod"};

inline bool is_integer(int32_t dtype) { return dtype >= DP_INT8 && dtype <= DP_INT64; }

// Rank r's element i: small integers, exact in every dtype and reduction here.
inline double value(int32_t dtype, int r, size_t i) {
  if (dtype == DP_BOOL) return static_cast<double>((i + static_cast<size_t>(r)) % 2);
  return static_cast<double>(r + 1) + static_cast<double>(i % 3);
}

inline void store(int32_t dtype, void* data, size_t i, double v) {
  switch (dtype) {
    case DP_FLOAT32:
      static_cast<float*>(data)[i] = static_cast<float>(v);
      break;
    case DP_FLOAT64:
      static_cast<double*>(data)[i] = v;
      break;
    case DP_FLOAT16:
      static_cast<uint16_t*>(data)[i] = dparallel::float_to_half(static_cast<float>(v));
      break;
    case DP_BFLOAT16:
      static_cast<uint16_t*>(data)[i] = dparallel::float_to_bfloat16(static_cast<float>(v));
      break;
    case DP_INT8:
      static_cast<int8_t*>(data)[i] = static_cast<int8_t>(v);
      break;
    case DP_UINT8:
      static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v);
      break;
    case DP_INT32:
      static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v);
      break;
    case DP_INT64:
      static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v);
      break;
    default:
      static_cast<uint8_t*>(data)[i] = v != 0 ? 1 : 0;
      break;
  }
}

inline double load(int32_t dtype, const void* data, size_t i) {
  switch (dtype) {
    case DP_FLOAT32:
      return static_cast<const float*>(data)[i];
    case DP_FLOAT64:
      return static_cast<const double*>(data)[i];
    case DP_FLOAT16:
      return dparallel::half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DP_BFLOAT16:
      return dparallel::bfloat16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DP_INT8:
      return static_cast<const int8_t*>(data)[i];
    case DP_UINT8:
      return static_cast<const uint8_t*>(data)[i];
    case DP_INT32:
      return static_cast<const int32_t*>(data)[i];
    case DP_INT64:
      return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    default:
      return static_cast<const uint8_t*>(data)[i];
  }
}

// A new cpu tensor of rank r's n elements value(dtype, r, offset + i).
inline dp_tensor* host_values(int32_t dtype, size_t n, int r, size_t offset) {
  int64_t shape[1] = {static_cast<int64_t>(n)};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, dtype, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  if (t == nullptr) std::exit(4);
  for (size_t i = 0; i < n; ++i) store(dtype, dp_tensor_data(t), i, value(dtype, r, i + offset));
  return t;
}

// The reduction over ranks 0..world-1 of value(dtype, r, i).
inline double expected(int32_t dtype, int32_t op, int world, size_t i) {
  double acc = value(dtype, 0, i);
  for (int r = 1; r < world; ++r) {
    double v = value(dtype, r, i);
    switch (op) {
      case DP_SUM:
      case DP_AVG:
        acc = dtype == DP_BOOL ? (acc != 0 || v != 0) : acc + v;
        break;
      case DP_MIN:
        acc = std::min(acc, v);
        break;
      case DP_MAX:
        acc = std::max(acc, v);
        break;
      default:
        acc = dtype == DP_BOOL ? (acc != 0 && v != 0) : acc * v;
        break;
    }
  }
  if (op == DP_AVG) acc = is_integer(dtype) ? std::trunc(acc / world) : acc / world;
  // Products of four ranks pass 255: 8-bit integers wrap.
  if (dtype == DP_INT8) acc = static_cast<int8_t>(static_cast<int64_t>(acc));
  if (dtype == DP_UINT8) acc = static_cast<uint8_t>(static_cast<int64_t>(acc));
  return acc;
}

}  // namespace dptest_worker

// The macros name the failure counter and rank unqualified.
using dptest_worker::g_failures;
using dptest_worker::g_rank;
