#include "lane/float_math.h"

#include "core/error.h"
#include "core/half.h"
#include "device/cuda/cuda_runtime.h"
#include "distributed/reduce_ops.h"

namespace dparallel::lane {

namespace {

// Host loops for the 16-bit hooks' casts (cpu tensors): the dtypes are
// dispatched once per call, not per element.
template <typename Load>
void store_floats(DType dtype, void* out, size_t n, Load load) {
  switch (dtype) {
    case DType::kFloat32:
      for (size_t i = 0; i < n; ++i) static_cast<float*>(out)[i] = load(i);
      return;
    case DType::kFloat64:
      for (size_t i = 0; i < n; ++i) static_cast<double*>(out)[i] = load(i);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = float_to_half(load(i));
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = float_to_bfloat16(load(i));
      return;
    default:
      fail(StatusCode::kInternal, "cast to ", dtype_name(dtype));
  }
}

}  // namespace

void cast_into(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype()) {
    copy_tensor(dst, src);
    return;
  }
  size_t n = static_cast<size_t>(src.numel());
  if (dst.device().type == DeviceType::kCuda) {
    cuda::cast(dst.device().index, dst.dtype(), dst.data(), src.dtype(), src.data(), n);
    return;
  }
  const void* in = src.data();
  void* out = dst.data();
  switch (src.dtype()) {
    case DType::kFloat32:
      return store_floats(dst.dtype(), out, n, [in](size_t i) { return static_cast<const float*>(in)[i]; });
    case DType::kFloat64:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return static_cast<float>(static_cast<const double*>(in)[i]); });
    case DType::kFloat16:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return half_to_float(static_cast<const uint16_t*>(in)[i]); });
    case DType::kBFloat16:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return bfloat16_to_float(static_cast<const uint16_t*>(in)[i]); });
    default:
      fail(StatusCode::kInternal, "cast from ", dtype_name(src.dtype()));
  }
}

void divide_tensor(const Tensor& t, int64_t divisor) {
  if (divisor == 1) return;
  if (t.device().type == DeviceType::kCuda) {
    cuda::divide(t.device().index, t.dtype(), t.data(), static_cast<size_t>(t.numel()), divisor);
    return;
  }
  dist::divide_in_place(t.dtype(), t.data(), static_cast<size_t>(t.numel()), divisor);
}

}  // namespace dparallel::lane
