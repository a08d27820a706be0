// NCCL's types and reductions for each dtype and op; runs without a GPU
// (built only where NCCL is, since it includes nccl.h).
#include "distributed/nccl/nccl_ops.h"

#include <gtest/gtest.h>

#include "device/cuda/nccl_types.h"

namespace dparallel::dist::nccl {
namespace {

const DType kAll[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt8,
                      DType::kUInt8,   DType::kInt32,   DType::kInt64,   DType::kBool};

// The element size NCCL gives each type it documents.
size_t nccl_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

TEST(NcclOps, EveryDtypeMapsToItsOwnNcclType) {
  EXPECT_EQ(cuda::nccl_type(DType::kFloat32), ncclFloat32);
  EXPECT_EQ(cuda::nccl_type(DType::kFloat64), ncclFloat64);
  EXPECT_EQ(cuda::nccl_type(DType::kFloat16), ncclFloat16);
  EXPECT_EQ(cuda::nccl_type(DType::kBFloat16), ncclBfloat16);
  EXPECT_EQ(cuda::nccl_type(DType::kInt8), ncclInt8);
  EXPECT_EQ(cuda::nccl_type(DType::kUInt8), ncclUint8);
  EXPECT_EQ(cuda::nccl_type(DType::kInt32), ncclInt32);
  EXPECT_EQ(cuda::nccl_type(DType::kInt64), ncclInt64);
  EXPECT_EQ(cuda::nccl_type(DType::kBool), ncclUint8);
  for (DType d : kAll) EXPECT_EQ(nccl_size(cuda::nccl_type(d)), dtype_size(d)) << dtype_name(d);
}

TEST(NcclOps, ArithmeticOpsMapOneToOne) {
  for (DType d : kAll) {
    if (d == DType::kBool) continue;
    EXPECT_EQ(nccl_op(d, ReduceOp::kSum), ncclSum) << dtype_name(d);
    EXPECT_EQ(nccl_op(d, ReduceOp::kAvg), ncclAvg) << dtype_name(d);
    EXPECT_EQ(nccl_op(d, ReduceOp::kMin), ncclMin) << dtype_name(d);
    EXPECT_EQ(nccl_op(d, ReduceOp::kMax), ncclMax) << dtype_name(d);
    EXPECT_EQ(nccl_op(d, ReduceOp::kProd), ncclProd) << dtype_name(d);
  }
}

// On 0/1 bytes: or is the maximum, and the minimum.
TEST(NcclOps, BoolSumAndMaxAreOrMinAndProdAreAnd) {
  EXPECT_EQ(nccl_op(DType::kBool, ReduceOp::kSum), ncclMax);
  EXPECT_EQ(nccl_op(DType::kBool, ReduceOp::kMax), ncclMax);
  EXPECT_EQ(nccl_op(DType::kBool, ReduceOp::kMin), ncclMin);
  EXPECT_EQ(nccl_op(DType::kBool, ReduceOp::kProd), ncclMin);
}

TEST(NcclOps, APeersFailureIsRemoteTheRestIsThisDevice) {
  EXPECT_EQ(status_of(ncclRemoteError), StatusCode::kRemote);
  EXPECT_EQ(status_of(ncclSystemError), StatusCode::kRemote);
  EXPECT_EQ(status_of(ncclUnhandledCudaError), StatusCode::kDevice);
  EXPECT_EQ(status_of(ncclInternalError), StatusCode::kDevice);
  EXPECT_EQ(status_of(ncclInvalidUsage), StatusCode::kDevice);
}

// ncclAvg and ncclBfloat16 need NCCL >= 2.10, in the headers and the library loaded.
TEST(NcclOps, HeadersAndLoadedLibraryHaveAvgAndBfloat16) {
  EXPECT_GE(NCCL_VERSION_CODE, NCCL_VERSION(2, 10, 0));
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_GE(version, NCCL_VERSION(2, 10, 0)) << version;
}

}  // namespace
}  // namespace dparallel::dist::nccl
