// dp_tensor.h: creation, copies and accessors.
#include <cstring>

#include "capi/capi_internal.h"
#include "dparallel/dp_tensor.h"

using namespace dparallel;

namespace {

void check_byte_count(const Tensor& tensor, size_t nbytes) {
  if (nbytes != tensor.nbytes()) {
    fail_invalid("argument 'nbytes' is ", nbytes, " but the tensor (", tensor.describe(), ") holds ", tensor.nbytes(),
                 " bytes");
  }
}

}  // namespace

extern "C" {

dp_status dp_tensor_create(dp_tensor** out, int32_t dtype, int32_t ndim, const int64_t* shape, dp_device device) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  DType type = capi::dtype_arg(dtype, "dtype");
  Shape dims = capi::shape_arg(ndim, shape, "shape");
  Device dev = capi::device_arg(device, "device");
  *out = capi::new_tensor_handle(Tensor::zeros(type, dims, dev));
  DP_API_END
}

dp_status dp_tensor_from_blob(dp_tensor** out, void* data, int32_t dtype, int32_t ndim, const int64_t* shape,
                              dp_device device, void (*deleter)(void* ctx), void* ctx) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  DType type = capi::dtype_arg(dtype, "dtype");
  Shape dims = capi::shape_arg(ndim, shape, "shape");
  Device dev = capi::device_arg(device, "device");
  const size_t nbytes = checked_nbytes(type, dims, "shape");
  if (data == nullptr && nbytes > 0)
    fail_invalid("argument 'data' is NULL but the shape ", shape_string(dims), " has ", checked_numel(dims, "shape"),
                 " elements");
  Storage::Deleter release;
  if (deleter != nullptr) release = [deleter, ctx](void*) { deleter(ctx); };
  auto storage = Storage::wrap(dev, data, nbytes, nullptr);
  dp_tensor* handle = capi::new_tensor_handle(Tensor::wrap(storage, 0, type, dims));
  storage->arm(release);
  *out = handle;
  DP_API_END
}

void dp_tensor_destroy(dp_tensor* tensor) {
  if (tensor == nullptr || tensor->tag != kTensorTag || !capi::destroy_allowed(tensor, __func__)) return;
  try {
    tensor->tag = 0;
    delete tensor;
  } catch (...) {
    capi::set_last_error("dp_tensor_destroy: a deleter threw; the exception was dropped");
  }
}

dp_status dp_tensor_copy_from_host(dp_tensor* tensor, const void* src, size_t nbytes) {
  DP_API_BEGIN
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  check_byte_count(t, nbytes);
  if (nbytes > 0) capi::require_arg(src, "src");
  capi::in_stream_order({t.device()}, [&] {
    copy_bytes(t.data(), t.device(), src, Device{DeviceType::kCpu, 0}, nbytes);
  });
  DP_API_END
}

dp_status dp_tensor_copy_to_host(const dp_tensor* tensor, void* dst, size_t nbytes) {
  DP_API_BEGIN
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  check_byte_count(t, nbytes);
  if (nbytes > 0) capi::require_arg(dst, "dst");
  capi::in_stream_order({t.device()}, [&] {
    copy_bytes(dst, Device{DeviceType::kCpu, 0}, t.data(), t.device(), nbytes);
  });
  DP_API_END
}

int32_t dp_tensor_dtype(const dp_tensor* tensor) {
  DP_API_BEGIN
  return static_cast<int32_t>(capi::tensor_arg(tensor, "tensor").dtype());
  DP_API_END_VALUE(-1)
}

int32_t dp_tensor_ndim(const dp_tensor* tensor) {
  DP_API_BEGIN
  return capi::tensor_arg(tensor, "tensor").ndim();
  DP_API_END_VALUE(-1)
}

dp_status dp_tensor_shape(const dp_tensor* tensor, int64_t* out, int32_t cap) {
  DP_API_BEGIN
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  if (cap < t.ndim()) fail_invalid("argument 'cap' is ", cap, " but the tensor has ", t.ndim(), " dimensions");
  if (t.ndim() > 0) capi::require_arg(out, "out");
  for (int32_t i = 0; i < t.ndim(); ++i) out[i] = t.shape()[static_cast<size_t>(i)];
  DP_API_END
}

int64_t dp_tensor_numel(const dp_tensor* tensor) {
  DP_API_BEGIN
  return capi::tensor_arg(tensor, "tensor").numel();
  DP_API_END_VALUE(-1)
}

size_t dp_tensor_nbytes(const dp_tensor* tensor) {
  DP_API_BEGIN
  return capi::tensor_arg(tensor, "tensor").nbytes();
  DP_API_END_VALUE(0)
}

dp_device dp_tensor_device(const dp_tensor* tensor) {
  DP_API_BEGIN
  return capi::to_c(capi::tensor_arg(tensor, "tensor").device());
  DP_API_END_VALUE((dp_device{0, -1}))
}

void* dp_tensor_data(const dp_tensor* tensor) {
  DP_API_BEGIN
  return capi::tensor_arg(tensor, "tensor").data();
  DP_API_END_VALUE(nullptr)
}

dp_status dp_tensor_to_device(dp_tensor** out, const dp_tensor* tensor, dp_device device) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  Device dev = capi::device_arg(device, "device");
  Tensor copy = capi::in_stream_order({t.device(), dev}, [&] { return t.to(dev); });
  *out = capi::new_tensor_handle(copy);
  DP_API_END
}

}  // extern "C"
