// The CUDA interface of a build without CUDA: no GPUs, every use an error.
// (nccl_none.cpp supplies the NCCL half.)
#include "core/error.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::cuda {

namespace {
[[noreturn]] void unavailable() { fail(StatusCode::kDevice, unavailable_reason()); }
}  // namespace

bool compiled() { return false; }
void register_runtime() {}
int32_t device_count() { return 0; }
const char* unavailable_reason() { return "dparallel was built without CUDA support (DP_WITH_CUDA=OFF)"; }
void add_n(int32_t, DType, void*, const void* const*, size_t, size_t) { unavailable(); }
void batched_copy(int32_t, const std::vector<Segment>&) { unavailable(); }
void cast(int32_t, DType, void*, DType, const void*, size_t) { unavailable(); }
void divide(int32_t, DType, void*, size_t, int64_t) { unavailable(); }
void load_kernels(int32_t) { unavailable(); }

}  // namespace dparallel::cuda
