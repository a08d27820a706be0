// The collectives a process group runs and the reductions they apply: what
// the front (process_group.h) and the call headers (call_header.h) share.
#pragma once

#include <cstdint>

namespace dparallel::dist {

enum class ReduceOp : int32_t { kSum = 0, kAvg = 1, kMin = 2, kMax = 3, kProd = 4 };
enum class CallKind : uint32_t { kAllReduce = 1, kBroadcast = 2, kAllGather = 3, kReduceScatter = 4, kBarrier = 5 };
const char* reduce_op_name(ReduceOp op);
ReduceOp reduce_op_arg(int32_t code, const char* argument);

}  // namespace dparallel::dist
