// NCCL's reduction for each dtype and op, and the status of each NCCL result.
#pragma once

#include <nccl.h>

#include "core/dtype.h"
#include "core/error.h"
#include "device/cuda/nccl_types.h"
#include "distributed/collective.h"

namespace dparallel::dist::nccl {

// Bools travel as 0/1 bytes: or (sum, max) is their maximum, and (min, prod)
// their minimum. AVG is ncclAvg (NCCL >= 2.10): integers sum, then divide
// truncating, as the Gloo backend does; floats pre-multiply by 1/size.
inline ncclRedOp_t nccl_op(DType dtype, ReduceOp op) {
  if (dtype == DType::kBool) return op == ReduceOp::kSum || op == ReduceOp::kMax ? ncclMax : ncclMin;
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProd:
      return ncclProd;
  }
  return ncclSum;
}

// A peer's failure (its socket closed, its report) is kRemote; the rest is this device's.
inline StatusCode status_of(ncclResult_t rc) { return cuda::nccl_status(rc); }

}  // namespace dparallel::dist::nccl
