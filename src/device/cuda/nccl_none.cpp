// The in-process NCCL interface of a build without NCCL: callers use peer copies instead.
#include "core/error.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::cuda {

bool nccl_compiled() { return false; }

void nccl_broadcast(const std::vector<int32_t>&, const std::vector<void*>&, size_t, size_t) {
  fail(StatusCode::kUnsupported, "dparallel was built without NCCL (DP_WITH_NCCL=OFF)");
}

void nccl_reduce_sum(const std::vector<int32_t>&, const std::vector<const void*>&, void*, size_t, DType, size_t) {
  fail(StatusCode::kUnsupported, "dparallel was built without NCCL (DP_WITH_NCCL=OFF)");
}

}  // namespace dparallel::cuda
