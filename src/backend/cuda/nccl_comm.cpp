// In-process NCCL: one communicator per GPU of a device list, group calls.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <map>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/nccl_types.h"

namespace dparallel::cuda {

namespace {

void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) fail(StatusCode::kDevice, call, " failed: ", ncclGetErrorString(result));
}

// Communicators live as long as the process, one set per device list.
const std::vector<ncclComm_t>& comms_for(const std::vector<int32_t>& devices) {
  static std::mutex mutex;
  static auto* cache = new std::map<std::vector<int32_t>, std::vector<ncclComm_t>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(devices);
  if (it != cache->end()) return it->second;
  std::vector<ncclComm_t> comms(devices.size());
  std::vector<int> ids(devices.begin(), devices.end());
  check_nccl(ncclCommInitAll(comms.data(), static_cast<int>(ids.size()), ids.data()), "ncclCommInitAll");
  return cache->emplace(devices, std::move(comms)).first->second;
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

void synchronize(const std::vector<int32_t>& devices) {
  for (int32_t index : devices) {
    DeviceGuard guard(index);
    check(cudaStreamSynchronize(stream_of(index)), "cudaStreamSynchronize");
  }
}

}  // namespace

bool nccl_compiled() { return true; }

void nccl_broadcast(const std::vector<int32_t>& devices, const std::vector<void*>& buffers, size_t root,
                    size_t nbytes) {
  const auto& comms = comms_for(devices);
  const std::vector<cudaStream_t> streams = streams_of(devices);
  {
    std::lock_guard<std::mutex> lock(launch_mutex());
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t result = ncclSuccess;
    for (size_t i = 0; i < devices.size() && result == ncclSuccess; ++i) {
      result =
          ncclBroadcast(buffers[root], buffers[i], nbytes, ncclUint8, static_cast<int>(root), comms[i], streams[i]);
    }
    ncclResult_t end = ncclGroupEnd();
    check_nccl(result, "ncclBroadcast");
    check_nccl(end, "ncclGroupEnd");
  }
  synchronize(devices);
}

void nccl_reduce_sum(const std::vector<int32_t>& devices, const std::vector<const void*>& sends, void* recv,
                     size_t root, DType dtype, size_t numel) {
  const auto& comms = comms_for(devices);
  // Logical or of 0/1 bytes is their maximum.
  ncclRedOp_t op = dtype == DType::kBool ? ncclMax : ncclSum;
  const std::vector<cudaStream_t> streams = streams_of(devices);
  {
    std::lock_guard<std::mutex> lock(launch_mutex());
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t result = ncclSuccess;
    for (size_t i = 0; i < devices.size() && result == ncclSuccess; ++i) {
      // recvbuff is only read on the root.
      result = ncclReduce(sends[i], i == root ? recv : nullptr, numel, nccl_type(dtype), op, static_cast<int>(root),
                          comms[i], streams[i]);
    }
    ncclResult_t end = ncclGroupEnd();
    check_nccl(result, "ncclReduce");
    check_nccl(end, "ncclGroupEnd");
  }
  synchronize(devices);
}

}  // namespace dparallel::cuda
