#include "distributed/reduce_ops.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"

namespace dparallel::dist {

namespace {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return static_cast<T>(a + b);
  }
};
struct Prod {
  template <typename T>
  static T apply(T a, T b) {
    return static_cast<T>(a * b);
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return std::min(a, b);
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return std::max(a, b);
  }
};

template <typename T, typename Op>
void native(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::apply(x[i], y[i]);
}

// Integer sums and products wrap, as two's complement hardware does.
template <typename T, typename Op>
void wrapping(void* out, const void* a, const void* b, size_t n) {
  using U = std::make_unsigned_t<T>;
  U* o = static_cast<U*>(out);
  const U* x = static_cast<const U*>(a);
  const U* y = static_cast<const U*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::apply(x[i], y[i]);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float), typename Op>
void half_like(void* out, const void* a, const void* b, size_t n) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = FromFloat(Op::apply(ToFloat(x[i]), ToFloat(y[i])));
}

template <bool Or>
void logical(void* out, const void* a, const void* b, size_t n) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Or ? (x[i] != 0 || y[i] != 0) : (x[i] != 0 && y[i] != 0);
}

template <typename Op>
ReduceFn for_dtype(DType dtype) {
  constexpr bool kArith = std::is_same_v<Op, Sum> || std::is_same_v<Op, Prod>;
  switch (dtype) {
    case DType::kFloat32:
      return &native<float, Op>;
    case DType::kFloat64:
      return &native<double, Op>;
    case DType::kFloat16:
      return &half_like<half_to_float, float_to_half, Op>;
    case DType::kBFloat16:
      return &half_like<bfloat16_to_float, float_to_bfloat16, Op>;
    case DType::kInt8:
      return kArith ? &wrapping<int8_t, Op> : &native<int8_t, Op>;
    case DType::kUInt8:
      return &native<uint8_t, Op>;
    case DType::kInt32:
      return kArith ? &wrapping<int32_t, Op> : &native<int32_t, Op>;
    case DType::kInt64:
      return kArith ? &wrapping<int64_t, Op> : &native<int64_t, Op>;
    case DType::kBool:
      return std::is_same_v<Op, Sum> || std::is_same_v<Op, Max> ? &logical<true> : &logical<false>;
  }
  fail_invalid("unknown dtype ", static_cast<int32_t>(dtype));
}

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

template <typename T>
void divide_native(void* out, const void* data, size_t n, int64_t divisor) {
  T* o = static_cast<T*>(out);
  const T* p = static_cast<const T*>(data);
  if constexpr (std::is_floating_point_v<T>) {
    // Multiplying by the reciprocal of a power of two is exact, the same
    // bits as the division, and several times faster.
    if (power_of_two(divisor)) {
      const T inverse = T(1) / static_cast<T>(divisor);
      for (size_t i = 0; i < n; ++i) o[i] = p[i] * inverse;
      return;
    }
  }
  for (size_t i = 0; i < n; ++i) o[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
}

template <typename T>
void halved_sum(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = (x[i] + y[i]) * T(0.5);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void divide_half(void* out, const void* data, size_t n, int64_t divisor) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* p = static_cast<const uint16_t*>(data);
  for (size_t i = 0; i < n; ++i) o[i] = FromFloat(ToFloat(p[i]) / static_cast<float>(divisor));
}

}  // namespace

ReduceFn reduce_function(DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return for_dtype<Sum>(dtype);
    case ReduceOp::kProd:
      return for_dtype<Prod>(dtype);
    case ReduceOp::kMin:
      return for_dtype<Min>(dtype);
    case ReduceOp::kMax:
      return for_dtype<Max>(dtype);
  }
  fail_invalid("unknown reduce op ", static_cast<int32_t>(op));
}

ReduceFn average_of_two_function(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return &halved_sum<float>;
    case DType::kFloat64:
      return &halved_sum<double>;
    default:
      return nullptr;
  }
}

void divide_in_place(DType dtype, void* data, size_t n, int64_t divisor) { divide_into(dtype, data, data, n, divisor); }

void divide_into(DType dtype, void* out, const void* data, size_t n, int64_t divisor) {
  switch (dtype) {
    case DType::kFloat32:
      return divide_native<float>(out, data, n, divisor);
    case DType::kFloat64:
      return divide_native<double>(out, data, n, divisor);
    case DType::kFloat16:
      return divide_half<half_to_float, float_to_half>(out, data, n, divisor);
    case DType::kBFloat16:
      return divide_half<bfloat16_to_float, float_to_bfloat16>(out, data, n, divisor);
    case DType::kInt8:
      return divide_native<int8_t>(out, data, n, divisor);
    case DType::kUInt8:
      return divide_native<uint8_t>(out, data, n, divisor);
    case DType::kInt32:
      return divide_native<int32_t>(out, data, n, divisor);
    case DType::kInt64:
      return divide_native<int64_t>(out, data, n, divisor);
    case DType::kBool:
      break;
  }
  fail_invalid("DP_AVG is not defined for ", dtype_name(dtype), " tensors");
}

}  // namespace dparallel::dist
