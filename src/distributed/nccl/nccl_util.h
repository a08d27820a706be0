// What the NCCL backend asks of NCCL beside the collectives: the reduction
// for each dtype and op, a result's text, and aborting communicators. The
// element types and the status of each result are device/cuda/nccl_types.h's
// (one converter, shared with the single-process collectives).
#pragma once

#include <nccl.h>

#include <chrono>
#include <string>

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

// NCCL's text for `rc` and its last error message.
std::string error_text(ncclResult_t rc);

// Aborts both communicators (either may be null) together. Tearing one down
// frees device memory, which waits for every kernel on the GPU, the other
// communicator's kernel still spinning for a dead peer among them: so both
// are stopped before either is torn down, by ncclCommRevoke where NCCL has
// it (for up to `bound`), and the two aborts, each of which stops its own
// kernels first, run at once on two threads.
void abort_together(ncclComm_t first, ncclComm_t second, std::chrono::milliseconds bound) noexcept;

}  // namespace dparallel::dist::nccl
