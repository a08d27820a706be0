// Element types and their sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dparallel {

// Values equal the C ABI's dp_dtype.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
};

constexpr int32_t kNumDTypes = 9;

inline bool dtype_is_valid(int32_t code) { return code >= 0 && code < kNumDTypes; }
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Throws kInvalidArgument naming `argument` when `code` is not a dtype.
DType dtype_from_code(int32_t code, const char* argument);

}  // namespace dparallel
