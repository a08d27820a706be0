// In-process NCCL: one communicator per GPU of a device list, group calls.
// Waits poll the streams and the communicators' asynchronous errors until a
// deadline (nccl_wait.h); a failure aborts the communicators and drops them,
// so the next call creates new ones instead of hanging on broken ones.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda/cuda_check.h"
#include "device/cuda/cuda_runtime.h"
#include "device/cuda/nccl_types.h"
#include "device/cuda/nccl_wait.h"

namespace dparallel::cuda {

namespace {

void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) fail(nccl_status(result), call, " failed: ", ncclGetErrorString(result));
}

// The communicators of one device list. `aborted` is set under both
// launch_mutex() and `mutex`, so a launch (under the first) or a waiter
// reading their errors (under the second) never touches freed ones.
struct CommSet {
  std::vector<ncclComm_t> comms;
  std::mutex mutex;
  bool aborted = false;
};

std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Lives as long as the process: communicators are never destroyed at exit,
// when NCCL's own threads may already be gone.
std::map<std::vector<int32_t>, std::shared_ptr<CommSet>>& cache() {
  static auto* map = new std::map<std::vector<int32_t>, std::shared_ptr<CommSet>>();
  return *map;
}

std::shared_ptr<CommSet> comms_for(const std::vector<int32_t>& devices) {
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto it = cache().find(devices);
  if (it != cache().end()) return it->second;
  auto set = std::make_shared<CommSet>();
  set->comms.resize(devices.size());
  // Before NCCL looks: its in-process transport may use peers' buffers
  // directly. Best effort: NCCL sets up peer access itself otherwise.
  try {
    connect_peers(devices);
  } catch (const Error&) {
  }
  std::vector<int> ids(devices.begin(), devices.end());
  check_nccl(ncclCommInitAll(set->comms.data(), static_cast<int>(ids.size()), ids.data()), "ncclCommInitAll");
  return cache().emplace(devices, set).first->second;
}

// Launches go one call at a time: two threads' group calls on communicators
// that share GPUs (and the per-device streams) could otherwise interleave their
// kernels in different orders on different GPUs and deadlock; NCCL
// communicators are not thread-safe either.
std::mutex& launch_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Fetched before ncclGroupStart: a throw between start and end would leave
// this thread inside an NCCL group for good.
std::vector<cudaStream_t> streams_of(const std::vector<int32_t>& devices) {
  std::vector<cudaStream_t> streams;
  streams.reserve(devices.size());
  for (int32_t index : devices) streams.push_back(stream_of(index));
  return streams;
}

std::string describe(const std::vector<int32_t>& devices) {
  std::string text;
  for (int32_t index : devices) text += (text.empty() ? "cuda:" : ", cuda:") + std::to_string(index);
  return text;
}

std::chrono::milliseconds timeout() {
  static const std::chrono::milliseconds value = nccl_timeout_from(std::getenv("DP_NCCL_TIMEOUT_MS"));
  return value;
}

// Aborts the set's communicators and forgets them; a no-op when another
// call did it first. ncclCommAbort does not wait for the stuck kernels.
void abort_and_drop(const std::vector<int32_t>& devices, const std::shared_ptr<CommSet>& set) noexcept {
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    auto it = cache().find(devices);
    if (it != cache().end() && it->second == set) cache().erase(it);
  }
  std::lock_guard<std::mutex> launch(launch_mutex());
  std::lock_guard<std::mutex> lock(set->mutex);
  if (set->aborted) return;
  set->aborted = true;
  for (ncclComm_t comm : set->comms) ncclCommAbort(comm);
}

// Runs one(i) for each device inside one NCCL group, on a communicator set
// that no failure has aborted (a set aborted meanwhile is replaced).
template <typename One>
std::shared_ptr<CommSet> launch(const std::vector<int32_t>& devices, const char* call, One&& one) {
  for (;;) {
    std::shared_ptr<CommSet> set = comms_for(devices);
    std::lock_guard<std::mutex> lock(launch_mutex());
    if (set->aborted) continue;
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t result = ncclSuccess;
    for (size_t i = 0; i < devices.size() && result == ncclSuccess; ++i) result = one(i, set->comms[i]);
    ncclResult_t end = ncclGroupEnd();
    check_nccl(result, call);
    check_nccl(end, "ncclGroupEnd");
    return set;
  }
}

// Waits for the call's streams by the deadline, watching the communicators.
void wait_for(const std::vector<int32_t>& devices, const std::vector<cudaStream_t>& streams,
              const std::shared_ptr<CommSet>& set, const char* call) {
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  const std::chrono::milliseconds limit = timeout();
  NcclWaitResult result = wait_streams(
      devices.size(), WaitClock::now() + limit,
      [&](size_t i) {
        cudaError_t rc = cudaStreamQuery(streams[i]);
        if (rc == cudaErrorNotReady) return kStreamBusy;
        return rc == cudaSuccess ? kStreamDone : static_cast<int>(rc);
      },
      [&](size_t i) {
        std::lock_guard<std::mutex> lock(set->mutex);
        if (set->aborted) return static_cast<int>(ncclInternalError);
        ncclResult_t state = ncclSuccess;
        ncclResult_t rc = ncclCommGetAsyncError(set->comms[i], &state);
        if (rc != ncclSuccess) state = rc;
        return state == ncclInProgress ? 0 : static_cast<int>(state);
      },
      [] { return WaitClock::now(); },
      [](std::chrono::microseconds pause) {
        if (pause.count() == 0) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(pause);
        }
      });
  if (result.kind == NcclWaitResult::Kind::kDone) return;
  bool already_aborted = false;
  {
    std::lock_guard<std::mutex> lock(set->mutex);
    already_aborted = set->aborted;
  }
  abort_and_drop(devices, set);
  const std::string where = str_cat(call, " over ", describe(devices));
  const std::string after = "; its NCCL communicators were aborted and the next call creates new ones";
  const int32_t device = devices[result.index];
  switch (result.kind) {
    case NcclWaitResult::Kind::kStreamError: {
      auto rc = static_cast<cudaError_t>(result.code);
      cudaGetLastError();  // not left for a later launch check to report
      fail(StatusCode::kDevice, where, ": the stream of cuda:", device, " failed: ", cudaGetErrorString(rc), after);
    }
    case NcclWaitResult::Kind::kAsyncError: {
      if (already_aborted) {
        fail(StatusCode::kDevice, where, ": another call on the same GPUs failed and aborted its NCCL communicators");
      }
      auto rc = static_cast<ncclResult_t>(result.code);
      fail(nccl_status(rc), where, ": the communicator of cuda:", device, " failed: ", ncclGetErrorString(rc), after);
    }
    case NcclWaitResult::Kind::kTimeout: {
      std::vector<int32_t> pending;
      for (size_t i : result.pending) pending.push_back(devices[i]);
      fail(StatusCode::kTimeout, where, " did not finish within ", limit.count(),
           " ms (DP_NCCL_TIMEOUT_MS); not done on ", describe(pending), after);
    }
    case NcclWaitResult::Kind::kDone:
      break;
  }
}

}  // namespace

bool nccl_compiled() { return true; }

void nccl_broadcast(const std::vector<int32_t>& devices, const std::vector<void*>& buffers, size_t root,
                    size_t nbytes) {
  // NCCL switches devices and puts back the one current on entry: make that
  // one of ours, so it never makes a context on a GPU the call does not use.
  DeviceGuard guard(devices.front());
  const std::vector<cudaStream_t> streams = streams_of(devices);
  auto set = launch(devices, "ncclBroadcast", [&](size_t i, ncclComm_t comm) {
    return ncclBroadcast(buffers[root], buffers[i], nbytes, ncclUint8, static_cast<int>(root), comm, streams[i]);
  });
  wait_for(devices, streams, set, "ncclBroadcast");
}

void nccl_reduce_sum(const std::vector<int32_t>& devices, const std::vector<const void*>& sends, void* recv,
                     size_t root, DType dtype, size_t numel) {
  DeviceGuard guard(devices.front());  // as in nccl_broadcast
  // Logical or of 0/1 bytes is their maximum.
  ncclRedOp_t op = dtype == DType::kBool ? ncclMax : ncclSum;
  const std::vector<cudaStream_t> streams = streams_of(devices);
  auto set = launch(devices, "ncclReduce", [&](size_t i, ncclComm_t comm) {
    // recvbuff is only read on the root.
    return ncclReduce(sends[i], i == root ? recv : nullptr, numel, nccl_type(dtype), op, static_cast<int>(root), comm,
                      streams[i]);
  });
  wait_for(devices, streams, set, "ncclReduce");
}

}  // namespace dparallel::cuda
