// dp_dlpack.h: zero-copy exchange through DLManagedTensor.
#include <dlpack/dlpack.h>

#include <memory>
#include <utility>

#include "capi/capi_internal.h"
#include "dparallel/dp_dlpack.h"

using namespace dparallel;

namespace {

// DLPack 0.8 added kDLBool = 6; older headers lack the name.
constexpr uint8_t kDLPackBoolCode = 6;

DLDataType to_dl(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return {kDLFloat, 32, 1};
    case DType::kFloat64:
      return {kDLFloat, 64, 1};
    case DType::kFloat16:
      return {kDLFloat, 16, 1};
    case DType::kBFloat16:
      return {kDLBfloat, 16, 1};
    case DType::kInt8:
      return {kDLInt, 8, 1};
    case DType::kUInt8:
      return {kDLUInt, 8, 1};
    case DType::kInt32:
      return {kDLInt, 32, 1};
    case DType::kInt64:
      return {kDLInt, 64, 1};
    case DType::kBool:
      return {kDLPackBoolCode, 8, 1};
  }
  return {kDLUInt, 8, 1};
}

DType from_dl(DLDataType type) {
  if (type.lanes != 1) fail_invalid("DLPack tensor has ", type.lanes, " lanes; only 1 is supported");
  int code = type.code;
  int bits = type.bits;
  if (code == kDLFloat && bits == 32) return DType::kFloat32;
  if (code == kDLFloat && bits == 64) return DType::kFloat64;
  if (code == kDLFloat && bits == 16) return DType::kFloat16;
  if (code == kDLBfloat && bits == 16) return DType::kBFloat16;
  if (code == kDLInt && bits == 8) return DType::kInt8;
  if (code == kDLUInt && bits == 8) return DType::kUInt8;
  if (code == kDLInt && bits == 32) return DType::kInt32;
  if (code == kDLInt && bits == 64) return DType::kInt64;
  if (code == kDLPackBoolCode && bits == 8) return DType::kBool;
  fail(StatusCode::kUnsupported, "DLPack dtype (code ", code, ", ", bits, " bits) has no dparallel dtype");
}

Device from_dl(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      return Device{DeviceType::kCpu, 0};  // host memory; logical devices do not exist in DLPack
    case kDLCUDA:
      return check_device(DP_DEVICE_CUDA, device.device_id, "managed->dl_tensor.device");
    default:
      fail(StatusCode::kUnsupported, "DLPack device type ", static_cast<int>(device.device_type),
           " is not supported (CPU, CUDA host and CUDA are)");
  }
}

struct Exported {
  DLManagedTensor managed{};
  Tensor tensor;
  Shape shape;
};

void delete_exported(DLManagedTensor* managed) {
  if (managed != nullptr) delete static_cast<Exported*>(managed->manager_ctx);
}

// A DLTensor the library can take: checked, with where its bytes start.
struct Imported {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  Device device;
  size_t nbytes = 0;
};

Imported check_import(const DLTensor& dl) {
  Imported in;
  if (dl.ndim < 0 || dl.ndim > kMaxNdim) fail_invalid("DLPack tensor has ndim ", dl.ndim, "; expected 0..", kMaxNdim);
  if (dl.ndim > 0 && dl.shape == nullptr) fail_invalid("DLPack tensor has ndim ", dl.ndim, " but a NULL shape");
  in.shape.assign(dl.shape, dl.shape + dl.ndim);
  int64_t numel = checked_numel(in.shape, "managed->dl_tensor.shape");
  in.dtype = from_dl(dl.dtype);
  in.nbytes = checked_nbytes(in.dtype, in.shape, "managed->dl_tensor.shape");
  in.device = from_dl(dl.device);
  if (dl.strides != nullptr && numel > 0) {
    int64_t expected = 1;
    for (int32_t i = dl.ndim - 1; i >= 0; --i) {
      if (in.shape[static_cast<size_t>(i)] != 1 && dl.strides[i] != expected) {
        fail_invalid("DLPack tensor is not compact row-major: stride ", i, " is ", dl.strides[i], ", expected ",
                     expected);
      }
      expected *= in.shape[static_cast<size_t>(i)];
    }
  }
  if (dl.data == nullptr && numel > 0) fail_invalid("DLPack tensor has NULL data but ", numel, " elements");
  in.data = dl.data == nullptr ? nullptr : static_cast<char*>(dl.data) + dl.byte_offset;
  return in;
}

// A tensor over the producer's memory; `release` runs when its last tensor goes.
dp_tensor* wrap_import(const Imported& in, Storage::Deleter release) {
  auto storage = Storage::wrap(in.device, in.data, in.nbytes, nullptr);
  dp_tensor* handle = capi::new_tensor_handle(Tensor::wrap(storage, 0, in.dtype, in.shape));
  storage->arm(release);
  return handle;
}

DLTensor export_dl(const Tensor& t, const Shape& shape) {
  DLTensor dl{};
  dl.data = t.data();
  dl.device = DLDevice{t.device().is_cuda() ? kDLCUDA : kDLCPU, t.device().is_cuda() ? t.device().index : 0};
  dl.ndim = t.ndim();
  dl.dtype = to_dl(t.dtype());
  dl.shape = shape.empty() ? nullptr : const_cast<int64_t*>(shape.data());
  dl.strides = nullptr;  // compact row-major
  dl.byte_offset = 0;
  return dl;
}

struct ExportedVersioned {
  DLManagedTensorVersioned managed{};
  Tensor tensor;
  Shape shape;
};

void delete_exported_versioned(DLManagedTensorVersioned* managed) {
  if (managed != nullptr) delete static_cast<ExportedVersioned*>(managed->manager_ctx);
}

}  // namespace

extern "C" {

dp_status dp_tensor_from_dlpack(dp_tensor** out, DLManagedTensor* managed) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  capi::require_arg(managed, "managed");
  const Imported in = check_import(managed->dl_tensor);
  *out = wrap_import(in, [managed](void*) {
    if (managed->deleter != nullptr) managed->deleter(managed);
  });
  DP_API_END
}

dp_status dp_tensor_from_dlpack_versioned(dp_tensor** out, DLManagedTensorVersioned* managed) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  capi::require_arg(managed, "managed");
  if (managed->version.major != DP_DLPACK_VERSIONED_MAJOR) {
    fail_invalid("argument 'managed' is DLPack version ", managed->version.major, ".", managed->version.minor,
                 "; only major version ", DP_DLPACK_VERSIONED_MAJOR, " is supported");
  }
  const Imported in = check_import(managed->dl_tensor);
  if ((managed->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == 0) {
    *out = wrap_import(in, [managed](void*) {
      if (managed->deleter != nullptr) managed->deleter(managed);
    });
  } else {
    // The library writes tensors in place: a read-only one is copied, and
    // the producer's is released once the copy is made.
    // After the host's stream (the producer's writes), as dp_tensor_to_device.
    Tensor copy = capi::in_stream_order({in.device}, [&] {
      Tensor c = Tensor::empty(in.dtype, in.shape, in.device);
      copy_bytes(c.data(), in.device, in.data, in.device, in.nbytes);
      return c;
    });
    dp_tensor* handle = capi::new_tensor_handle(copy);
    if (managed->deleter != nullptr) managed->deleter(managed);
    *out = handle;
  }
  DP_API_END
}

dp_status dp_tensor_to_dlpack(const dp_tensor* tensor, DLManagedTensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  auto exported = std::make_unique<Exported>();
  exported->tensor = t;
  exported->shape = t.shape();
  exported->managed.dl_tensor = export_dl(t, exported->shape);
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = delete_exported;
  *out = &exported.release()->managed;
  DP_API_END
}

dp_status dp_tensor_to_dlpack_versioned(const dp_tensor* tensor, int read_only, DLManagedTensorVersioned** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const Tensor& t = capi::tensor_arg(tensor, "tensor");
  auto exported = std::make_unique<ExportedVersioned>();
  exported->tensor = t;
  exported->shape = t.shape();
  exported->managed.version = DLPackVersion{DP_DLPACK_VERSIONED_MAJOR, DP_DLPACK_VERSIONED_MINOR};
  exported->managed.flags = read_only != 0 ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
  exported->managed.dl_tensor = export_dl(t, exported->shape);
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = delete_exported_versioned;
  *out = &exported.release()->managed;
  DP_API_END
}

}  // extern "C"
