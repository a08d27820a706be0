// Element types and their sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

namespace dparallel {

// Every dtype, one line each: X(enumerator, code, name, size in bytes, C ABI
// name). The code is the C ABI's dp_dtype; codes run 0, 1, 2... in this
// order. A new dtype is one line here (and its dp_dtype in dp_base.h).
#define DP_DTYPES(X)                          \
  X(kFloat32, 0, "float32", 4, DP_FLOAT32)    \
  X(kFloat64, 1, "float64", 8, DP_FLOAT64)    \
  X(kFloat16, 2, "float16", 2, DP_FLOAT16)    \
  X(kBFloat16, 3, "bfloat16", 2, DP_BFLOAT16) \
  X(kInt8, 4, "int8", 1, DP_INT8)             \
  X(kUInt8, 5, "uint8", 1, DP_UINT8)          \
  X(kInt32, 6, "int32", 4, DP_INT32)          \
  X(kInt64, 7, "int64", 8, DP_INT64)          \
  X(kBool, 8, "bool", 1, DP_BOOL)

enum class DType : int32_t {
#define DP_DTYPE_ENUMERATOR(id, code, name, size, c_name) id = (code),
  DP_DTYPES(DP_DTYPE_ENUMERATOR)
#undef DP_DTYPE_ENUMERATOR
};

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

// Indexed by code.
inline constexpr DTypeInfo kDTypes[] = {
#define DP_DTYPE_INFO(id, code, name, size, c_name) {DType::id, name, size},
    DP_DTYPES(DP_DTYPE_INFO)
#undef DP_DTYPE_INFO
};

constexpr int32_t kNumDTypes = static_cast<int32_t>(std::size(kDTypes));

constexpr bool dtype_codes_are_indices() {
  for (int32_t i = 0; i < kNumDTypes; ++i) {
    if (static_cast<int32_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(dtype_codes_are_indices(), "DP_DTYPES lists the codes 0, 1, 2... in order");

inline bool dtype_is_valid(int32_t code) { return code >= 0 && code < kNumDTypes; }
// 0 for a value that is not a dtype.
size_t dtype_size(DType dtype);
// "unknown" for a value that is not a dtype.
const char* dtype_name(DType dtype);
// Throws kInvalidArgument naming `argument` when `code` is not a dtype.
DType dtype_from_code(int32_t code, const char* argument);

}  // namespace dparallel
