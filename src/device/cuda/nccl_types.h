// NCCL's element type for each dtype (bool travels as bytes), and the
// status of each NCCL result.
#pragma once

#include <nccl.h>

#include "core/dtype.h"
#include "core/error.h"

namespace dparallel::cuda {

inline ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt8:
      return ncclInt8;
    case DType::kUInt8:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kBool:
      return ncclUint8;
  }
  return ncclUint8;
}

// A peer's failure (its socket closed, its report) is kRemote; the rest is this device's.
inline StatusCode nccl_status(ncclResult_t rc) {
  return rc == ncclRemoteError || rc == ncclSystemError ? StatusCode::kRemote : StatusCode::kDevice;
}

}  // namespace dparallel::cuda
