// The built-in comm hooks (PyTorch's default_comm_hooks): how a bucket's
// flat gradients are averaged across the ranks.
#pragma once

#include "core/tensor.h"
#include "distributed/process_group.h"

namespace dparallel::ddp {

enum class HookKind : int32_t { kAllReduce = 0, kFp16 = 1, kBf16 = 2, kCustom = 3 };

const char* hook_name(HookKind hook);

// Averages `flat` in place with a built-in hook (not kCustom): the sum over
// the ranks divided by `divisor` (the world size, or while ranks have
// joined, possibly the ranks still active).
void reduce_with_builtin_hook(HookKind hook, dist::ProcessGroup& group, const Tensor& flat, int64_t divisor);

}  // namespace dparallel::ddp
