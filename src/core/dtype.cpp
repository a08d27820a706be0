#include "core/dtype.h"

#include "core/error.h"

namespace dparallel {

size_t dtype_size(DType dtype) {
  const auto code = static_cast<int32_t>(dtype);
  return dtype_is_valid(code) ? kDTypes[code].size : 0;
}

const char* dtype_name(DType dtype) {
  const auto code = static_cast<int32_t>(dtype);
  return dtype_is_valid(code) ? kDTypes[code].name : "unknown";
}

DType dtype_from_code(int32_t code, const char* argument) {
  if (!dtype_is_valid(code)) {
    fail_invalid("argument '", argument, "' is ", code, ", which is not a dp_dtype (expected 0..", kNumDTypes - 1, ")");
  }
  return static_cast<DType>(code);
}

}  // namespace dparallel
