#include "ddp/comm_hooks.h"

#include <iterator>

#include "core/error.h"
#include "lane/float_math.h"

namespace dparallel::ddp {

const char* hook_name(HookKind hook) {
  const auto code = static_cast<size_t>(hook);
  return code < std::size(kHookKinds) ? kHookKinds[code].name : "unknown";
}

void reduce_with_builtin_hook(HookKind hook, dist::ProcessGroup& group, const Tensor& flat, int64_t divisor) {
  switch (hook) {
    case HookKind::kAllReduce:
      if (divisor == group.size()) {
        group.all_reduce(flat, dist::ReduceOp::kAvg, false);
      } else {
        group.all_reduce(flat, dist::ReduceOp::kSum, false);
        lane::divide_tensor(flat, divisor);
      }
      return;
    case HookKind::kFp16:
    case HookKind::kBf16: {
      // As PyTorch's fp16/bf16_compress_hook: cast, divide by the world
      // size, then sum, so that large gradients do not overflow the sum.
      DType wire = hook == HookKind::kFp16 ? DType::kFloat16 : DType::kBFloat16;
      Tensor compressed = flat.dtype() == wire ? flat : Tensor::empty(wire, flat.shape(), flat.device());
      if (compressed.data() != flat.data()) lane::cast_into(compressed, flat);
      lane::divide_tensor(compressed, divisor);
      group.all_reduce(compressed, dist::ReduceOp::kSum, false);
      if (compressed.data() != flat.data()) lane::cast_into(flat, compressed);
      return;
    }
    case HookKind::kCustom:
      break;
  }
  fail(StatusCode::kInternal, "the ", hook_name(hook), " comm hook is not a built-in one");
}

}  // namespace dparallel::ddp
