// The NCCL backend in a build without NCCL.
#include "core/error.h"
#include "distributed/backend.h"

namespace dparallel::dist {

std::unique_ptr<Backend> create_nccl_backend(CallSite&, const ProcessGroupOptions&) {
  fail(StatusCode::kUnsupported,
       "DP_BACKEND_NCCL: dparallel was built without NCCL (DP_WITH_NCCL=OFF or NCCL not found)");
}

}  // namespace dparallel::dist
