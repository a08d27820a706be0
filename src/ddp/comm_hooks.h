// The built-in comm hooks (PyTorch's default_comm_hooks): how a bucket's
// flat gradients are averaged across the ranks.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "distributed/process_group.h"

namespace dparallel::ddp {

// Every comm hook, one line each: X(enumerator, code, name, C ABI name). The
// code is the C ABI's dp_comm_hook; codes run 0, 1, 2... in this order. A
// new hook is one line here (and its dp_comm_hook in dp_ddp.h).
#define DP_COMM_HOOKS(X)                           \
  X(kAllReduce, 0, "allreduce", DP_HOOK_ALLREDUCE) \
  X(kFp16, 1, "fp16", DP_HOOK_FP16)                \
  X(kBf16, 2, "bf16", DP_HOOK_BF16)                \
  X(kCustom, 3, "custom", DP_HOOK_CUSTOM)

enum class HookKind : int32_t {
#define DP_COMM_HOOK_ENUMERATOR(id, code, name, c_name) id = (code),
  DP_COMM_HOOKS(DP_COMM_HOOK_ENUMERATOR)
#undef DP_COMM_HOOK_ENUMERATOR
};

struct HookKindInfo {
  HookKind hook;
  const char* name;
  const char* c_name;
};

// Indexed by code.
inline constexpr HookKindInfo kHookKinds[] = {
#define DP_COMM_HOOK_INFO(id, code, name, c_name) {HookKind::id, name, #c_name},
    DP_COMM_HOOKS(DP_COMM_HOOK_INFO)
#undef DP_COMM_HOOK_INFO
};

constexpr bool hook_codes_are_indices() {
  int32_t i = 0;
  for (const HookKindInfo& info : kHookKinds) {
    if (static_cast<int32_t>(info.hook) != i++) return false;
  }
  return true;
}
static_assert(hook_codes_are_indices(), "DP_COMM_HOOKS lists the codes 0, 1, 2... in order");

// "unknown" for a value that is not a hook.
const char* hook_name(HookKind hook);

// Averages `flat` in place with a built-in hook (not kCustom): the sum over
// the ranks divided by `divisor` (the world size, or while ranks have
// joined, possibly the ranks still active).
void reduce_with_builtin_hook(HookKind hook, dist::ProcessGroup& group, const Tensor& flat, int64_t divisor);

}  // namespace dparallel::ddp
