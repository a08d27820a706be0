// What the NCCL backend asks of NCCL beside the collectives: the reduction
// for each dtype and op, a result's text, and aborting communicators. The
// element types and the status of each result are device/cuda/nccl_types.h's
// (one converter, shared with the single-process collectives).
#pragma once

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "device/cuda/nccl_types.h"
#include "distributed/collective.h"
#include "distributed/nccl/queued_watch.h"

namespace dparallel::dist {
class Store;
}  // namespace dparallel::dist

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

// Rank 0 makes a unique id and puts it in the store under `key`; the
// others read it, by the deadline.
ncclUniqueId unique_id(Store& store, const std::string& key, int32_t rank,
                       std::chrono::steady_clock::time_point deadline);

// Why the watch failed a queued collective, for its error.
std::string queued_failure_cause(const QueuedWatch::Failure& failure, std::chrono::milliseconds timeout);

using SplitFn = ncclResult_t (*)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
// ncclCommSplit where the NCCL in use has it (2.18 on) and DP_NCCL_COMM_SPLIT
// is not 0, else null: a split's group then makes new communicators.
SplitFn comm_split();

// A communicator's state (ncclCommGetAsyncError): ncclInProgress while it
// is still taking a call in, a failure, or ncclSuccess.
ncclResult_t state_of(ncclComm_t comm);

// DP_TEST_NCCL_SINGLE_RANK=1 (tests only, read when a group is made): a
// one-rank group calls NCCL as a larger one does (both communicators, the
// header all-gather on the control channel, every collective on the data
// channel), so that one GPU runs NCCL's paths; NCCL refuses two ranks on
// one GPU. Without it, one rank never calls NCCL after its creation.
bool single_rank_for_tests();

// DP_TEST_NCCL_SKIP_QUEUED=<rank> (tests only): that rank queues none of
// its queued collectives' transfers, as a peer that died after the call
// headers would, so the others' transfers never finish.
bool skipping_queued_for_tests(int32_t rank);

// The first of `parts` (one per rank, `nbytes` each) where they lie back
// to back in rank order and `other` (the collective's other buffer) is
// `rank`'s part or apart from them all: NCCL can use them in place. Null
// otherwise.
uint8_t* back_to_back(const std::vector<Tensor>& parts, const void* other, size_t nbytes, int32_t rank);

}  // namespace dparallel::dist::nccl
