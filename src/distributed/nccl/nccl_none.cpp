// The NCCL backend in a build without NCCL.
#include "core/error.h"
#include "distributed/backend.h"

namespace dparallel::dist {

namespace {

const char* const kWithoutNccl =
    "DP_BACKEND_NCCL: dparallel was built without NCCL (DP_WITH_NCCL=OFF or NCCL not found)";

}  // namespace

std::optional<Error> nccl_availability(const Device& /*device*/) {
  return Error(StatusCode::kUnsupported, kWithoutNccl);
}

std::unique_ptr<Backend> create_nccl_backend(CallSite&, const ProcessGroupOptions&) {
  fail(StatusCode::kUnsupported, kWithoutNccl);
}

}  // namespace dparallel::dist
