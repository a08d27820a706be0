#include "distributed/nccl/nccl_util.h"

#include <dlfcn.h>

#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "device/cuda/cuda_runtime.h"
#include "distributed/backend.h"

namespace dparallel::dist {

namespace nccl {

namespace {

using Clock = std::chrono::steady_clock;

using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
// ncclCommRevoke where the NCCL in use has it (2.28 on), else null: looked up
// at run time, since the library may run with an older NCCL than it was
// built with.
RevokeFn nccl_revoke() {
  static const RevokeFn revoke = []() -> RevokeFn {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ncclCommAbort), &info) == 0 || info.dli_fname == nullptr) return nullptr;
    void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    void* symbol = dlsym(lib, "ncclCommRevoke");
    dlclose(lib);  // only the reference RTLD_NOLOAD took: the library stays loaded
    return reinterpret_cast<RevokeFn>(symbol);
  }();
  return revoke;
}

}  // namespace

std::string error_text(ncclResult_t rc) {
  return str_cat(ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")");
}

void abort_together(ncclComm_t first, ncclComm_t second, std::chrono::milliseconds bound) noexcept {
  if (first == nullptr) std::swap(first, second);
  if (first == nullptr) return;
  if (second == nullptr) {
    ncclCommAbort(first);
    return;
  }
  if (RevokeFn revoke = nccl_revoke()) {
    ncclComm_t comms[] = {first, second};
    ncclResult_t states[] = {revoke(first, 0), revoke(second, 0)};
    auto deadline = Clock::now() + bound;
    for (size_t i = 0; i < 2; ++i) {
      while (states[i] == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(comms[i], &states[i]) != ncclSuccess) break;
      }
    }
  }
  std::thread other;
  try {
    other = std::thread([second] { ncclCommAbort(second); });
  } catch (...) {
    // No thread to be had: in turn, after the first.
  }
  ncclCommAbort(first);
  if (other.joinable()) {
    other.join();
  } else {
    ncclCommAbort(second);
  }
}

}  // namespace nccl

std::optional<Error> nccl_availability(const Device& device) {
  if (device.type == DeviceType::kCuda && cuda::device_count() > device.index) return std::nullopt;
  return Error(StatusCode::kDevice, str_cat("the NCCL backend needs ", to_string(device), " but ", cuda::device_count(),
                                            " GPU(s) are present (", cuda::unavailable_reason(), ")"));
}

}  // namespace dparallel::dist
