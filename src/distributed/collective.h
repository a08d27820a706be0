// The collectives a process group runs and the reductions they apply: what
// the front (process_group.h) and the call headers (call_header.h) share.
#pragma once

#include <cstdint>

namespace dparallel::dist {

// Every reduction, one line each: X(enumerator, code, name, C ABI name). The
// code is the C ABI's dp_reduce_op; codes run 0, 1, 2... in this order. A
// new reduction is one line here (and its dp_reduce_op in dp_dist.h).
#define DP_REDUCE_OPS(X)    \
  X(kSum, 0, "sum", DP_SUM) \
  X(kAvg, 1, "avg", DP_AVG) \
  X(kMin, 2, "min", DP_MIN) \
  X(kMax, 3, "max", DP_MAX) \
  X(kProd, 4, "prod", DP_PROD)

enum class ReduceOp : int32_t {
#define DP_REDUCE_OP_ENUMERATOR(id, code, name, c_name) id = (code),
  DP_REDUCE_OPS(DP_REDUCE_OP_ENUMERATOR)
#undef DP_REDUCE_OP_ENUMERATOR
};

struct ReduceOpInfo {
  ReduceOp op;
  const char* name;
  const char* c_name;
};

// Indexed by code.
inline constexpr ReduceOpInfo kReduceOps[] = {
#define DP_REDUCE_OP_INFO(id, code, name, c_name) {ReduceOp::id, name, #c_name},
    DP_REDUCE_OPS(DP_REDUCE_OP_INFO)
#undef DP_REDUCE_OP_INFO
};

constexpr bool reduce_op_codes_are_indices() {
  int32_t i = 0;
  for (const ReduceOpInfo& info : kReduceOps) {
    if (static_cast<int32_t>(info.op) != i++) return false;
  }
  return true;
}
static_assert(reduce_op_codes_are_indices(), "DP_REDUCE_OPS lists the codes 0, 1, 2... in order");

// Every collective, one line each: X(enumerator, wire value, name). The
// value travels in the call header (call_header.h): never reuse one.
#define DP_CALL_KINDS(X)                 \
  X(kAllReduce, 1, "all_reduce")         \
  X(kBroadcast, 2, "broadcast")          \
  X(kAllGather, 3, "all_gather")         \
  X(kReduceScatter, 4, "reduce_scatter") \
  X(kBarrier, 5, "barrier")

enum class CallKind : uint32_t {
#define DP_CALL_KIND_ENUMERATOR(id, value, name) id = (value),
  DP_CALL_KINDS(DP_CALL_KIND_ENUMERATOR)
#undef DP_CALL_KIND_ENUMERATOR
};

struct CallKindInfo {
  CallKind kind;
  const char* name;
};

inline constexpr CallKindInfo kCallKinds[] = {
#define DP_CALL_KIND_INFO(id, value, name) {CallKind::id, name},
    DP_CALL_KINDS(DP_CALL_KIND_INFO)
#undef DP_CALL_KIND_INFO
};

// "unknown" for a value that is not a reduction.
const char* reduce_op_name(ReduceOp op);
// Throws kInvalidArgument naming `argument`, and listing the C ABI's names,
// when `code` is not a dp_reduce_op.
ReduceOp reduce_op_arg(int32_t code, const char* argument);

}  // namespace dparallel::dist
