// The NCCL backend: one communicator per rank, its unique id through the
// store, created non-blocking. Every wait polls the stream and
// ncclCommGetAsyncError and aborts the communicator at the group's deadline,
// so a dead peer is an error, not a hang. As with Gloo, the ranks swap a
// header first (an all-gather of 64 bytes) so mismatched sizes are an error.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/nccl_types.h"
#include "core/error.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

struct Header {
  uint32_t kind;
  int32_t dtype;
  int32_t op;
  int32_t root;
  int64_t numel;
  uint64_t seq;
  uint8_t reserved[32];
};
static_assert(sizeof(Header) == 64, "the header is part of the wire format");

const char* kind_name(uint32_t kind) {
  static const char* names[] = {"?", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  return kind < 6 ? names[kind] : "?";
}

ncclRedOp_t nccl_op(DType dtype, ReduceOp op) {
  if (dtype == DType::kBool) return op == ReduceOp::kSum || op == ReduceOp::kMax ? ncclMax : ncclMin;
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProd:
      return ncclProd;
  }
  return ncclSum;
}

class NcclProcessGroup : public ProcessGroup {
 public:
  explicit NcclProcessGroup(const ProcessGroupOptions& options)
      : ProcessGroup(options.rank, options.world_size, options.device, options.timeout), store_(options.store) {
    if (cuda::device_count() <= options.device.index) {
      fail(StatusCode::kDevice, "the NCCL backend needs ", to_string(options.device), " but ", cuda::device_count(),
           " GPU(s) are present (", cuda::unavailable_reason(), ")");
    }
    int64_t generation = store_->add(str_cat("dp/pg_count/", rank()), 1);
    prefix_ = str_cat("dp/pg", generation, "/");
    std::string key = prefix_ + "nccl_id";
    ncclUniqueId id;
    if (rank() == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store_->set(key, Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      Bytes value = store_->get(key, timeout());
      if (value.size() != sizeof(id)) fail(StatusCode::kRemote, "malformed NCCL unique id in the store");
      std::memcpy(&id, value.data(), sizeof(id));
    }
    cuda::DeviceGuard guard(device().index);
    try {
      cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      cuda::check(cudaMalloc(&headers_, sizeof(Header) * static_cast<size_t>(size())), "cudaMalloc");
      // Pinned, so that copies to and from it never block the host behind NCCL work.
      cuda::check(cudaMallocHost(&host_headers_, sizeof(Header) * static_cast<size_t>(size())), "cudaMallocHost");
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    auto deadline = Clock::now() + timeout();
    ncclResult_t rc = ncclCommInitRankConfig(&comm_, size(), id, rank(), &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      abort_comm();
      release();
      check_nccl(rc, "ncclCommInitRankConfig");
    }
    try {
      await_comm(deadline, "creating the NCCL communicator", false);
    } catch (...) {
      abort_comm();
      release();
      throw;
    }
  }

  ~NcclProcessGroup() override {
    drain();
    release();
  }

  const char* backend_name() const override { return "nccl"; }

 protected:
  DeviceType tensor_device_type() const override { return DeviceType::kCuda; }

  void run_all_reduce(const Tensor& t, ReduceOp op) override {
    cuda::DeviceGuard guard(device().index);
    auto deadline = exchange(1, t.dtype(), t.numel(), op, -1);
    enqueue(ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), cuda::nccl_type(t.dtype()),
                          nccl_op(t.dtype(), op), comm_, stream_),
            "ncclAllReduce", deadline);
    await(deadline, "all_reduce", t);
  }

  void run_broadcast(const Tensor& t, int32_t root) override {
    cuda::DeviceGuard guard(device().index);
    auto deadline = exchange(2, t.dtype(), t.numel(), ReduceOp::kSum, root);
    enqueue(ncclBroadcast(t.data(), t.data(), t.nbytes(), ncclUint8, root, comm_, stream_), "ncclBroadcast", deadline);
    await(deadline, "broadcast", t);
  }

  void run_all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    cuda::DeviceGuard guard(device().index);
    auto deadline = exchange(3, input.dtype(), input.numel(), ReduceOp::kSum, -1);
    size_t nbytes = input.nbytes();
    uint8_t* flat = scratch(nbytes * static_cast<size_t>(size()));
    enqueue(ncclAllGather(input.data(), flat, nbytes, ncclUint8, comm_, stream_), "ncclAllGather", deadline);
    for (int32_t r = 0; r < size(); ++r) {
      cuda::check(cudaMemcpyAsync(outputs[r].data(), flat + nbytes * static_cast<size_t>(r), nbytes,
                                  cudaMemcpyDeviceToDevice, stream_),
                  "cudaMemcpyAsync");
    }
    await(deadline, "all_gather", input);
  }

  void run_reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    cuda::DeviceGuard guard(device().index);
    auto deadline = exchange(4, output.dtype(), output.numel(), op, -1);
    size_t nbytes = output.nbytes();
    uint8_t* flat = scratch(nbytes * static_cast<size_t>(size()));
    for (int32_t r = 0; r < size(); ++r) {
      cuda::check(cudaMemcpyAsync(flat + nbytes * static_cast<size_t>(r), inputs[r].data(), nbytes,
                                  cudaMemcpyDeviceToDevice, stream_),
                  "cudaMemcpyAsync");
    }
    enqueue(ncclReduceScatter(flat, output.data(), static_cast<size_t>(output.numel()), cuda::nccl_type(output.dtype()),
                              nccl_op(output.dtype(), op), comm_, stream_),
            "ncclReduceScatter", deadline);
    await(deadline, "reduce_scatter", output);
  }

  void run_barrier() override { exchange(5, DType::kUInt8, 0, ReduceOp::kSum, -1); }

 private:
  static void check_nccl(ncclResult_t rc, const char* call) {
    if (rc != ncclSuccess && rc != ncclInProgress) {
      fail(rc == ncclRemoteError || rc == ncclSystemError ? StatusCode::kRemote : StatusCode::kDevice, call,
           " failed: ", ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")");
    }
  }

  // A non-blocking communicator may still be taking a call in when it
  // returns ncclInProgress: the next call waits until it has (by the deadline).
  void enqueue(ncclResult_t rc, const char* call, Clock::time_point deadline, bool exchanged = true) {
    if (rc != ncclSuccess && rc != ncclInProgress) abort_comm();
    check_nccl(rc, call);
    if (rc == ncclInProgress) await_comm(deadline, call, exchanged);
  }

  void abort_comm() {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  void await_comm(Clock::time_point deadline, const char* what, bool exchanged) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        abort_comm();
        check_nccl(state, what);
      }
      if (Clock::now() >= deadline) {
        abort_comm();
        fail(StatusCode::kTimeout, what, " on rank ", rank(), " of ", size(), " timed out after ", timeout().count(),
             " ms; the communicator was aborted: ", missing_ranks(exchanged));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Polls the stream and the communicator until the queued work is done.
  void await(Clock::time_point deadline, const char* op, const Tensor& t) {
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda::check(q, "cudaStreamQuery");
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        abort_comm();
        fail(StatusCode::kRemote, op, " of ", t.describe(), " on rank ", rank(), " of ", size(),
             " failed: ", ncclGetErrorString(state), "; the communicator was aborted: ", missing_ranks(true));
      }
      if (Clock::now() >= deadline) {
        abort_comm();
        fail(StatusCode::kTimeout, op, " of ", t.describe(), " on rank ", rank(), " of ", size(), " timed out after ",
             timeout().count(), " ms; the communicator was aborted: ", missing_ranks(true));
      }
      std::this_thread::yield();
    }
  }

  Clock::time_point exchange(uint32_t kind, DType dtype, int64_t numel, ReduceOp op, int32_t root) {
    if (comm_ == nullptr) fail(StatusCode::kState, kind_name(kind), ": the NCCL communicator was aborted earlier");
    auto deadline = Clock::now() + timeout();
    cuda::DeviceGuard guard(device().index);
    Header mine{};
    mine.kind = kind;
    mine.dtype = static_cast<int32_t>(dtype);
    mine.op = static_cast<int32_t>(op);
    mine.root = root;
    mine.numel = numel;
    mine.seq = ++seq_;
    auto* all = static_cast<Header*>(host_headers_);
    all[rank()] = mine;
    auto* slot = static_cast<uint8_t*>(headers_) + sizeof(Header) * static_cast<size_t>(rank());
    cuda::check(cudaMemcpyAsync(slot, &all[rank()], sizeof(Header), cudaMemcpyHostToDevice, stream_),
                "cudaMemcpyAsync");
    enqueue(ncclAllGather(slot, headers_, sizeof(Header), ncclUint8, comm_, stream_), "ncclAllGather", deadline, false);
    cuda::check(
        cudaMemcpyAsync(all, headers_, sizeof(Header) * static_cast<size_t>(size()), cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync");
    await_header(deadline, kind_name(kind));
    for (int32_t r = 0; r < size(); ++r) {
      const Header h = all[r];
      if (h.kind != kind || h.seq != mine.seq) {
        fail(StatusCode::kRemote, kind_name(kind), " (collective #", mine.seq, "): rank ", r, " called ",
             kind_name(h.kind), " as its collective #", h.seq);
      }
      if (h.numel != numel || h.dtype != mine.dtype || h.op != mine.op || h.root != root) {
        fail_invalid(kind_name(kind), ": arguments differ across ranks: rank ", rank(), " has ", numel, " elements of ",
                     dtype_name(dtype), " (op ", reduce_op_name(op), ", root ", root, "), rank ", r, " has ", h.numel,
                     " elements of ", dtype_name(static_cast<DType>(h.dtype)), " (op ",
                     reduce_op_name(static_cast<ReduceOp>(h.op)), ", root ", h.root, ")");
      }
    }
    return deadline;
  }

  void await_header(Clock::time_point deadline, const char* op) {
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda::check(q, "cudaStreamQuery");
      if (Clock::now() >= deadline) {
        abort_comm();
        fail(StatusCode::kTimeout, op, " on rank ", rank(), " of ", size(), " timed out after ", timeout().count(),
             " ms waiting for the other ranks' headers; the communicator was aborted: ", missing_ranks(false));
      }
      std::this_thread::yield();
    }
  }

  // The ranks that did not report the failure of the current collective
  // (see find_missing_ranks); before the first collective, of the creation.
  std::string missing_ranks(bool exchanged) {
    return find_missing_ranks(*store_, prefix_, rank(), size(), seq_, exchanged);
  }

  uint8_t* scratch(size_t nbytes) {
    if (scratch_bytes_ < nbytes) {
      if (scratch_ != nullptr) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      cuda::check(cudaMalloc(&scratch_, nbytes), "cudaMalloc");
      scratch_bytes_ = nbytes;
    }
    return static_cast<uint8_t*>(scratch_);
  }

  // A healthy communicator is finalized (bounded by the timeout) and
  // destroyed; a failed one, or one whose finalize does not finish, aborted.
  void release() noexcept {
    if (comm_ != nullptr) {
      bool finalized = false;
      if (!broken() && ncclCommFinalize(comm_) == ncclSuccess) {
        auto deadline = Clock::now() + timeout();
        ncclResult_t state = ncclInProgress;
        while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
               Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        finalized = state == ncclSuccess;
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (headers_ != nullptr) cudaFree(headers_);
    if (host_headers_ != nullptr) cudaFreeHost(host_headers_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    scratch_ = headers_ = host_headers_ = nullptr;
    stream_ = nullptr;
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* headers_ = nullptr;
  void* host_headers_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<ProcessGroup> create_nccl_process_group(const ProcessGroupOptions& options) {
  return std::make_unique<NcclProcessGroup>(options);
}

}  // namespace dparallel::dist
