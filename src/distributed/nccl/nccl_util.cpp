#include "distributed/nccl/nccl_util.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "device/cuda/cuda_runtime.h"
#include "distributed/backend.h"

namespace dparallel::dist {

namespace nccl {

namespace {

using Clock = std::chrono::steady_clock;

// A symbol of the NCCL in use, or null where it has none: looked up at run
// time, since the library may run with an older NCCL than it was built with.
void* loaded_symbol(const char* name) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclCommAbort), &info) == 0 || info.dli_fname == nullptr) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  void* symbol = dlsym(lib, name);
  dlclose(lib);  // only the reference RTLD_NOLOAD took: the library stays loaded
  return symbol;
}

using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
// ncclCommRevoke (2.28 on), or null.
RevokeFn nccl_revoke() {
  static const auto revoke = reinterpret_cast<RevokeFn>(loaded_symbol("ncclCommRevoke"));
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

ncclUniqueId unique_id(Store& store, const std::string& key, int32_t rank, Clock::time_point deadline) {
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess) {
      fail(cuda::nccl_status(rc), "ncclGetUniqueId failed: ", error_text(rc));
    }
    store.set(key, Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
  } else {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    Bytes value = store.get(key, std::max(left, std::chrono::milliseconds{1}));
    if (value.size() != sizeof(id)) fail(StatusCode::kRemote, "malformed NCCL unique id in the store");
    std::memcpy(&id, value.data(), sizeof(id));
  }
  return id;
}

std::string queued_failure_cause(const QueuedWatch::Failure& failure, std::chrono::milliseconds timeout) {
  switch (failure.kind) {
    case QueuedWatch::Failure::Kind::kTimeout:
      return str_cat("did not finish within ", timeout.count(),
                     " ms of its call (the wait for this rank's stream included)");
    case QueuedWatch::Failure::Kind::kAsyncError:
      return str_cat("had not finished when the communicator failed: ",
                     error_text(static_cast<ncclResult_t>(failure.code)));
    case QueuedWatch::Failure::Kind::kEventError:
      break;
  }
  return str_cat("failed on the device: ", cudaGetErrorString(static_cast<cudaError_t>(failure.code)));
}

SplitFn comm_split() {
  if (const char* text = std::getenv("DP_NCCL_COMM_SPLIT"); text != nullptr && std::strcmp(text, "0") == 0)
    return nullptr;
  static const auto split = reinterpret_cast<SplitFn>(loaded_symbol("ncclCommSplit"));
  return split;
}

ncclResult_t state_of(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
  return rc != ncclSuccess ? rc : state;
}

bool single_rank_for_tests() {
  const char* text = std::getenv("DP_TEST_NCCL_SINGLE_RANK");
  return text != nullptr && text[0] == '1' && text[1] == '\0';
}

bool skipping_queued_for_tests(int32_t rank) {
  const char* text = std::getenv("DP_TEST_NCCL_SKIP_QUEUED");  // read each time: tests set it late
  return text != nullptr && *text != '\0' && std::atoi(text) == rank;
}

uint8_t* back_to_back(const std::vector<Tensor>& parts, const void* other, size_t nbytes, int32_t rank) {
  auto* first = static_cast<uint8_t*>(parts[0].data());
  const size_t ranks = parts.size();
  for (size_t r = 1; r < ranks; ++r) {
    if (parts[r].data() != first + nbytes * r) return nullptr;
  }
  const auto* o = static_cast<const uint8_t*>(other);
  const bool own_place = o == first + nbytes * static_cast<size_t>(rank);
  if (!own_place && o < first + nbytes * ranks && first < o + nbytes) return nullptr;
  return first;
}

}  // namespace nccl

std::optional<Error> nccl_availability(const Device& device) {
  if (device.type == DeviceType::kCuda && cuda::device_count() > device.index) return std::nullopt;
  return Error(StatusCode::kDevice, str_cat("the NCCL backend needs ", to_string(device), " but ", cuda::device_count(),
                                            " GPU(s) are present (", cuda::unavailable_reason(), ")"));
}

}  // namespace dparallel::dist
