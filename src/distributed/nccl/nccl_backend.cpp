// The NCCL backend: a data communicator per rank, its unique id through the
// store, created non-blocking. Every wait polls the stream and
// ncclCommGetAsyncError and aborts the communicator at the group's deadline,
// so a dead peer is an error, not a hang. The headers the front checks
// before each collective, and the lane's agreement rounds, travel on a
// second communicator with a stream of its own (the control channel), so
// that they never queue behind a dp_fsdp job's transfers, which wait for
// the host's stream.
// Inside a dp_fsdp job (QueuedTransfers) a collective returns once queued on
// the stream, after the job's own work there; a watch thread polls its end
// event and aborts the communicator at its deadline or an asynchronous error.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "device/cuda/cuda_check.h"
#include "device/cuda/cuda_runtime.h"
#include "device/cuda/nccl_types.h"
#include "distributed/backend.h"
#include "distributed/call_header.h"
#include "distributed/nccl/nccl_util.h"
#include "distributed/nccl/queued_watch.h"

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

// The longest a destroy waits for a healthy communicator's finalize, as a
// Gloo group waits for its peers to leave.
constexpr Millis kFinalizeBound{5000};
// How often the watch polls the queued collectives' end events.
constexpr Millis kWatchPoll{10};

class NcclBackend : public Backend {
 public:
  NcclBackend(CallSite& site, const ProcessGroupOptions& options)
      : Backend(site), store_(options.store), talks_(size() > 1 || nccl::single_rank_for_tests()) {
    if (std::optional<Error> why = nccl_availability(options.device)) throw Error(*why);
    prefix_ = claim_key_prefix(store_, "pg");
    // A split's group comes from its parent's communicators: no ids.
    auto* parent = options.split ? dynamic_cast<NcclBackend*>(options.split->parent) : nullptr;
    // One rank has nobody to send headers or rounds to: no control communicator.
    std::vector<std::string> keys;
    if (parent == nullptr) keys.push_back(prefix_ + "nccl_id");
    if (parent == nullptr && talks_) keys.push_back(prefix_ + "nccl_control_id");
    // One deadline for the ids and both communicators: creation waits for
    // the other ranks no longer than the group's timeout in all.
    const auto deadline = Clock::now() + timeout();
    std::vector<ncclUniqueId> ids(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) ids[i] = nccl::unique_id(*store_, keys[i], rank(), deadline);
    // NCCL binds the communicator to the device current at init.
    cuda::DeviceGuard guard(device().index);
    try {
      // Before any job queues: a kernel loaded lazily later could wait for
      // the whole device while a queued collective spins for a peer.
      cuda::load_kernels(device().index);
      cuda::check(cudaStreamCreateWithFlags(&data_.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      cuda::check(cudaStreamCreateWithFlags(&control_.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      // Stream-ordered, as the scratch: see scratch().
      cuda::check(cuda::malloc_async(device().index, &headers_, sizeof(CallHeader) * static_cast<size_t>(size()),
                                     control_.stream),
                  "cudaMallocAsync");
      // Pinned, so that copies to and from it never block the host behind
      // NCCL work; from the cache, so that no allocation waits for another
      // group's kernels.
      host_headers_ = cuda::pinned_host_take(sizeof(CallHeader) * static_cast<size_t>(size()));
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
    try {
      if (parent != nullptr) {
        split_from(*parent, options.split->color, options.split->key, deadline);
      } else {
        init_comm(data_, ids[0], deadline, false);
        if (ids.size() > 1) init_comm(control_, ids[1], deadline, true);
      }
    } catch (...) {
      abort_comm();
      release();
      throw;
    }
    // Every rank joined the communicators with the ids: they are no longer needed.
    if (rank() == 0 && !keys.empty()) forget_keys(*store_, keys);
  }

  ~NcclBackend() override { release(); }

  const char* name() const override { return "nccl"; }

  // As the watch does at a deadline: a call waiting on the communicators
  // fails, and so does every later one.
  void abort(const std::string& /*why*/) noexcept override { abort_comm(); }

  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.transfer_stream = true;
    caps.control_stream = talks_;
    caps.tensor_device = DeviceType::kCuda;
    caps.threads = ThreadModel::kQueuesOnStream;
    return caps;
  }
  void* transfer_stream() const override { return data_.stream; }

  // A split into NCCL groups on this group's GPU: ncclCommSplit of both
  // communicators, where the NCCL in use has it and neither was aborted.
  bool splits_into(BackendChoice backend, const Device& device) const override {
    std::lock_guard<std::mutex> lock(comm_mutex_);
    return backend == BackendChoice::kNccl && device == this->device() && nccl::comm_split() != nullptr &&
           data_.comm != nullptr && (!talks_ || control_.comm != nullptr);
  }
  void split_without_color(Clock::time_point deadline) override {
    cuda::DeviceGuard guard(device().index);
    split_channel(data_, -1, 0, false, deadline);
    if (talks_) split_channel(control_, -1, 0, true, deadline);
  }
  void* control_stream() const override { return talks_ ? control_.stream : nullptr; }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    cuda::DeviceGuard guard(device().index);
    Channel& ch = channel_of_call();
    auto deadline = exchange(CallKind::kAllReduce, t.dtype(), t.numel(), op, -1, &t);
    // One rank: every op is the identity (see reduce_scatter), in place; the
    // header swap waited for the stream (unless queued: nothing to follow).
    if (!talks_) return;
    enqueue(
        ch,
        [&](ncclComm_t comm, cudaStream_t stream) {
          return ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), cuda::nccl_type(t.dtype()),
                               nccl::nccl_op(t.dtype(), op), comm, stream);
        },
        "ncclAllReduce", deadline, true);
    end_transfer(ch, deadline);
  }

  void broadcast(const Tensor& t, int32_t root) override {
    cuda::DeviceGuard guard(device().index);
    Channel& ch = channel_of_call();
    auto deadline = exchange(CallKind::kBroadcast, t.dtype(), t.numel(), ReduceOp::kSum, root, &t);
    if (!talks_) return;
    enqueue(
        ch,
        [&](ncclComm_t comm, cudaStream_t stream) {
          return ncclBroadcast(t.data(), t.data(), t.nbytes(), ncclUint8, root, comm, stream);
        },
        "ncclBroadcast", deadline, true);
    end_transfer(ch, deadline);
  }

  void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    cuda::DeviceGuard guard(device().index);
    size_t nbytes = input.nbytes();
    Channel& ch = channel_of_call();
    if (!talks_) {
      auto deadline = exchange(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input);
      copy_on_stream(ch, outputs[0], input, deadline, "all_gather");
      return;
    }
    // Outputs that lie back to back in rank order take the gather directly
    // (in place where the input is this rank's output); others go through
    // the scratch, allocated before the exchange: running out of memory
    // there fails this rank alone, in step.
    uint8_t* direct = nccl::back_to_back(outputs, input.data(), nbytes, rank());
    uint8_t* flat = direct != nullptr ? direct : scratch(ch, nbytes * static_cast<size_t>(size()), "all_gather");
    auto deadline = exchange(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input);
    enqueue(
        ch,
        [&](ncclComm_t comm, cudaStream_t stream) {
          return ncclAllGather(input.data(), flat, nbytes, ncclUint8, comm, stream);
        },
        "ncclAllGather", deadline, true);
    for (int32_t r = 0; r < size() && direct == nullptr; ++r) {
      check_cuda(cudaMemcpyAsync(outputs[r].data(), flat + nbytes * static_cast<size_t>(r), nbytes,
                                 cudaMemcpyDeviceToDevice, ch.stream),
                 "cudaMemcpyAsync");
    }
    end_transfer(ch, deadline);
  }

  void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    cuda::DeviceGuard guard(device().index);
    size_t nbytes = output.nbytes();
    Channel& ch = channel_of_call();
    if (!talks_) {
      // Every op of one rank is the identity: a copy, without NCCL, whose
      // versions before 2.29.7 left the tail of a one-rank avg unwritten
      // (NVIDIA/nccl#1950).
      auto deadline = exchange(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
      copy_on_stream(ch, output, inputs[0], deadline, "reduce_scatter");
      return;
    }
    // Inputs that lie back to back in rank order are reduced where they lie
    // (in place where the output is this rank's input); others are copied
    // into the scratch first.
    uint8_t* direct = nccl::back_to_back(inputs, output.data(), nbytes, rank());
    uint8_t* flat = direct != nullptr ? direct : scratch(ch, nbytes * static_cast<size_t>(size()), "reduce_scatter");
    auto deadline = exchange(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
    for (int32_t r = 0; r < size() && direct == nullptr; ++r) {
      check_cuda(cudaMemcpyAsync(flat + nbytes * static_cast<size_t>(r), inputs[r].data(), nbytes,
                                 cudaMemcpyDeviceToDevice, ch.stream),
                 "cudaMemcpyAsync");
    }
    // recvcount is per rank: the output's element count.
    enqueue(
        ch,
        [&](ncclComm_t comm, cudaStream_t stream) {
          return ncclReduceScatter(flat, output.data(), static_cast<size_t>(output.numel()),
                                   cuda::nccl_type(output.dtype()), nccl::nccl_op(output.dtype(), op), comm, stream);
        },
        "ncclReduceScatter", deadline, true);
    end_transfer(ch, deadline);
  }

  void barrier() override {
    cuda::DeviceGuard guard(device().index);
    exchange(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr);
  }

  // An all-gather of the headers on the control channel, into pinned host
  // memory: it never waits for the data stream, nor for what a queued job
  // there waits for.
  void swap_headers(Call& call) override {
    cuda::DeviceGuard guard(device().index);
    current_ = call;
    in_call_ = true;
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(comm_mutex_);
      aborted = data_.comm == nullptr;
    }
    if (aborted) fail_aborted_by_watch();
    auto* all = static_cast<CallHeader*>(host_headers_);
    all[rank()] = call.header;
    if (!talks_) {
      // Nobody to compare with; the wait keeps what a finished call means
      // (the caller's stream, which this one follows, reached it), except
      // for a queued one, whose end the job's end event covers instead.
      if (!queued()) wait_stream(data_, call.deadline, false);
      return;
    }
    auto* slot = static_cast<uint8_t*>(headers_) + sizeof(CallHeader) * static_cast<size_t>(rank());
    check_cuda(cudaMemcpyAsync(slot, &all[rank()], sizeof(CallHeader), cudaMemcpyHostToDevice, control_.stream),
               "cudaMemcpyAsync");
    // In place: this rank's slot of the gathered buffer is its send buffer.
    enqueue(
        control_,
        [&](ncclComm_t comm, cudaStream_t stream) {
          return ncclAllGather(slot, headers_, sizeof(CallHeader), ncclUint8, comm, stream);
        },
        "ncclAllGather", call.deadline, false);
    check_cuda(cudaMemcpyAsync(all, headers_, sizeof(CallHeader) * static_cast<size_t>(size()), cudaMemcpyDeviceToHost,
                               control_.stream),
               "cudaMemcpyAsync");
    wait_stream(control_, call.deadline, false);
  }

  CallHeader received_header(int32_t r) override { return static_cast<const CallHeader*>(host_headers_)[r]; }

 private:
  // A communicator with its own stream and scratch.
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    void* scratch = nullptr;
    size_t scratch_bytes = 0;
  };

  // Non-blocking; `small`: for the control channel, whose calls are a few
  // KiB: one CTA takes fewer of the SMs and buffers the data channel uses.
  static ncclConfig_t channel_config(bool small) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (small) config.minCTAs = config.maxCTAs = 1;
    return config;
  }
  void init_comm(Channel& ch, const ncclUniqueId& id, Clock::time_point deadline, bool small) {
    ncclConfig_t config = channel_config(small);
    ncclResult_t rc = ncclCommInitRankConfig(&ch.comm, size(), id, rank(), &config);
    check_enqueued(ch, rc, "ncclCommInitRankConfig", deadline, false);
  }

  // This group's communicators split from `parent`'s (a rank whose group
  // has no control channel joins none of the parent's).
  void split_from(NcclBackend& parent, int32_t color, int32_t key, Clock::time_point deadline) {
    data_.comm = parent.split_channel(parent.data_, color, key, false, deadline);
    if (parent.talks_) control_.comm = parent.split_channel(parent.control_, talks_ ? color : -1, key, true, deadline);
  }

  // This rank's part of ncclCommSplit of a communicator of this group, over
  // all its ranks (a negative color joins none: null), polled by the
  // deadline. One that fails or times out aborts this group's communicators.
  ncclComm_t split_channel(Channel& ch, int32_t color, int32_t key, bool small, Clock::time_point deadline) {
    ncclConfig_t config = channel_config(small);
    const nccl::SplitFn split = nccl::comm_split();  // null only if DP_NCCL_COMM_SPLIT changed since
    ncclComm_t made = nullptr;
    ncclResult_t rc = ncclInvalidUsage;
    bool aborted = false;
    for (bool first = true; split != nullptr; first = false) {
      {
        std::lock_guard<std::mutex> lock(comm_mutex_);
        aborted = ch.comm == nullptr;
        if (aborted) break;
        if (first) rc = split(ch.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &made, &config);
        // The parent stays ncclInProgress until its part is done, even after a call that returned ncclSuccess.
        if (rc == ncclSuccess || rc == ncclInProgress) rc = nccl::state_of(ch.comm);
      }
      if ((rc == ncclSuccess || rc == ncclInProgress) && made != nullptr) {
        const ncclResult_t made_state = nccl::state_of(made);
        if (made_state != ncclSuccess) rc = made_state;
      }
      if (rc != ncclInProgress || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (rc == ncclSuccess && !aborted) return made;
    nccl::abort_together(made, nullptr, kFinalizeBound);
    if (aborted) fail_aborted_by_watch();
    abort_comm();
    const std::string cause = rc == ncclInProgress ? str_cat("did not finish within ", timeout().count(), " ms")
                                                   : str_cat("failed: ", nccl::error_text(rc));
    mark_broken(str_cat("nccl: splitting the group ", cause, "; the communicators were aborted"));
    fail(rc == ncclInProgress ? StatusCode::kTimeout : cuda::nccl_status(rc), "splitting the NCCL group on rank ",
         rank(), " of ", size(), ": ncclCommSplit ", cause, "; this group's communicators were aborted");
  }

  // The lane's agreement rounds go on the control channel: a round decides
  // which jobs run, so it must not wait behind a queued job's transfers.
  // The tag is the same on every rank (the headers check it), so every
  // rank puts the call on the same communicator.
  Channel& channel_of_call() { return talks_ && current_call_tag().owner == kLaneRoundOwner ? control_ : data_; }

  // A CUDA failure mid-collective leaves the ranks out of step: the communicator goes.
  void check_cuda(cudaError_t rc, const char* call) {
    if (rc == cudaSuccess) return;
    abort_comm();
    cuda::check(rc, call);
  }

  // Runs `nccl_call(comm, stream)` on the channel (under comm_mutex_: the
  // watch may abort it meanwhile). A non-blocking communicator may return
  // ncclInProgress while it is still taking a call in: nothing else may
  // touch it or its stream until its state is ncclSuccess (NCCL's docs), so
  // this waits for that, by the deadline.
  template <typename NcclCall>
  void enqueue(Channel& ch, NcclCall&& nccl_call, const char* call, Clock::time_point deadline, bool exchanged) {
    if (exchanged && queued() && nccl::skipping_queued_for_tests(rank())) return;
    ncclResult_t rc = ncclSuccess;
    {
      std::unique_lock<std::mutex> lock(comm_mutex_);
      if (ch.comm == nullptr) {
        lock.unlock();
        fail_aborted_by_watch();
      }
      rc = nccl_call(ch.comm, ch.stream);
    }
    check_enqueued(ch, rc, call, deadline, exchanged);
  }

  void check_enqueued(Channel& ch, ncclResult_t rc, const char* call, Clock::time_point deadline, bool exchanged) {
    if (rc == ncclInProgress) {
      wait(ch, deadline, false, exchanged);
    } else if (rc != ncclSuccess) {
      abort_comm();
      fail(cuda::nccl_status(rc),
           in_call_ ? str_cat(call_kind_name(current_.header.kind), " of ", describe_call(current_))
                    : std::string("creating the NCCL communicator"),
           " on rank ", rank(), " of ", size(), ": ", call, " failed: ", nccl::error_text(rc));
    }
  }

  void abort_comm() noexcept {
    std::lock_guard<std::mutex> lock(comm_mutex_);
    abort_comm_locked();
  }
  // Both communicators go together: a call waits on either.
  void abort_comm_locked() noexcept {
    nccl::abort_together(data_.comm, control_.comm, kFinalizeBound);
    data_.comm = control_.comm = nullptr;
  }

  // Inside a dp_fsdp job (QueuedTransfers with this group's stream): the
  // job's own library work is on this stream already, so a collective
  // follows it in stream order and returns once queued.
  bool queued() const { return library_stream_override(device()) == data_.stream; }

  // The end of a collective's transfer: waits for the stream, or, queued
  // (only ever on the data channel), records an end event the watch polls.
  void end_transfer(Channel& ch, Clock::time_point deadline) {
    if (!queued() || &ch != &data_) {
      wait_stream(ch, deadline, true);
      return;
    }
    cudaEvent_t done = take_event();
    if (cudaError_t rc = cudaEventRecord(done, data_.stream); rc != cudaSuccess) {
      release_event(done);
      check_cuda(rc, "cudaEventRecord");
    }
    QueuedWatch& watching = watch();
    watching.add(done, deadline,
                 str_cat(call_kind_name(current_.header.kind), " #", current_.header.seq, " of ",
                         describe_call(current_), " on rank ", rank(), " of ", size()));
    // An earlier queued collective failed meanwhile: this one will not finish right.
    if (watching.failed()) fail_aborted_by_watch();
  }

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(events_mutex_);
      if (!spare_events_.empty()) {
        cudaEvent_t event = spare_events_.back();
        spare_events_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return event;
  }
  void release_event(cudaEvent_t event) noexcept {
    std::lock_guard<std::mutex> lock(events_mutex_);
    spare_events_.push_back(event);
  }

  QueuedWatch& watch() {
    if (watch_ != nullptr) return *watch_;
    QueuedWatch::Hooks hooks;
    const int32_t index = device().index;
    hooks.on_start = [index] {
      if (cudaSetDevice(index) != cudaSuccess) cudaGetLastError();  // the queries then fail, and say why
    };
    hooks.query = [](void* event) {
      cuda::RelaxedCapture relaxed;
      cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event));
      if (rc == cudaSuccess) return QueuedWatch::kDone;
      if (rc == cudaErrorNotReady) return QueuedWatch::kBusy;
      cudaGetLastError();
      // The process is exiting with work still queued: nothing left to abort.
      if (rc == cudaErrorCudartUnloading) return QueuedWatch::kDone;
      return static_cast<int>(rc);
    };
    hooks.async_error = [this] {
      std::lock_guard<std::mutex> lock(comm_mutex_);
      return static_cast<int>(async_error_locked());
    };
    hooks.release = [this](void* event) { release_event(static_cast<cudaEvent_t>(event)); };
    hooks.on_failure = [this](const QueuedWatch::Failure& f) {
      std::string why = str_cat("nccl: the queued ", f.what, " ", nccl::queued_failure_cause(f, timeout()),
                                "; the communicator was aborted");
      {
        std::lock_guard<std::mutex> lock(comm_mutex_);
        aborted_why_ = why;
        abort_comm_locked();
      }
      mark_broken(why);
    };
    watch_ = std::make_unique<QueuedWatch>(std::move(hooks), kWatchPoll);
    return *watch_;
  }

  // The first asynchronous error of either communicator; ncclSuccess
  // while both are healthy or still taking a call in, or once aborted.
  ncclResult_t async_error_locked() {
    for (Channel* ch : {&data_, &control_}) {
      if (ch->comm == nullptr) continue;
      ncclResult_t state = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(ch->comm, &state);
      if (rc != ncclSuccess) state = rc;
      if (state != ncclSuccess && state != ncclInProgress) return state;
    }
    return ncclSuccess;
  }

  void wait_stream(Channel& ch, Clock::time_point deadline, bool exchanged) { wait(ch, deadline, true, exchanged); }

  // A one-rank collective: the input's bytes into the output, on the stream;
  // through the scratch where the two overlap in part (a copy between
  // overlapping buffers is undefined).
  void copy_on_stream(Channel& ch, const Tensor& output, const Tensor& input, Clock::time_point deadline,
                      const char* op) {
    auto* out = static_cast<uint8_t*>(output.data());
    const auto* in = static_cast<const uint8_t*>(input.data());
    const size_t nbytes = input.nbytes();
    if (out != in && nbytes > 0) {
      if (in < out + nbytes && out < in + nbytes) {
        uint8_t* flat = scratch(ch, nbytes, op);
        check_cuda(cudaMemcpyAsync(flat, in, nbytes, cudaMemcpyDeviceToDevice, ch.stream), "cudaMemcpyAsync");
        in = flat;
      }
      check_cuda(cudaMemcpyAsync(out, in, nbytes, cudaMemcpyDeviceToDevice, ch.stream), "cudaMemcpyAsync");
    }
    end_transfer(ch, deadline);
  }

  // Polls the channel's communicator state, and with `stream` its stream,
  // until done; an asynchronous error (of either communicator) or the
  // deadline aborts the communicators and fails.
  void wait(Channel& ch, Clock::time_point deadline, bool stream, bool exchanged) {
    for (;;) {
      bool stream_done = false;
      if (stream) {
        cudaError_t q = cudaStreamQuery(ch.stream);
        stream_done = q == cudaSuccess;
        if (!stream_done && q != cudaErrorNotReady) check_cuda(q, "cudaStreamQuery");
      }
      ncclResult_t state = ncclSuccess;
      bool aborted = false;
      {
        std::lock_guard<std::mutex> lock(comm_mutex_);
        aborted = ch.comm == nullptr;
        if (!aborted && !stream_done) {
          ncclResult_t rc = ncclCommGetAsyncError(ch.comm, &state);
          if (rc != ncclSuccess) state = rc;
          if (state == ncclSuccess || state == ncclInProgress) {
            ncclResult_t other = async_error_locked();
            if (other != ncclSuccess) state = other;
          }
        }
      }
      // The watch aborted it (a queued collective before this one failed):
      // the aborted kernels end, so a finished stream proves nothing.
      if (aborted) fail_aborted_by_watch();
      if (stream_done) return;
      if (!stream && state == ncclSuccess) return;
      if (state != ncclSuccess && state != ncclInProgress) {
        abort_comm();
        fail_nccl(cuda::nccl_status(state),
                  str_cat("nccl: ", nccl::error_text(state), "; the communicator was aborted"), exchanged, deadline);
      }
      if (Clock::now() >= deadline) {
        abort_comm();
        fail_nccl(StatusCode::kTimeout,
                  str_cat("nccl: the communicator was aborted", exchanged ? "" : " waiting for the other ranks"),
                  exchanged, deadline);
      }
      if (stream) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  [[noreturn]] void fail_aborted_by_watch() {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(comm_mutex_);
      why = aborted_why_;
    }
    fail(StatusCode::kState,
         in_call_ ? str_cat(call_kind_name(current_.header.kind), " of ", describe_call(current_), " on rank ", rank(),
                            " of ", size(), ": ")
                  : std::string(),
         why.empty() ? std::string("the NCCL communicator was aborted earlier") : why);
  }

  // Starts a collective: its header goes to every rank and every rank reaches the verdict.
  Clock::time_point exchange(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root,
                             const Tensor* tensor) {
    Call call = begin_call(kind, dtype, numel, op, root, tensor);
    exchange_headers(call);
    return call.deadline;
  }

  // A failure of the current collective (after `exchanged` headers), or
  // before the first one, of the communicator's creation: names the ranks
  // that did not report it.
  [[noreturn]] void fail_nccl(StatusCode code, const std::string& cause, bool exchanged, Clock::time_point deadline) {
    if (in_call_) {
      Call call = current_;
      call.exchanged = exchanged;
      fail_call(call, code, cause);
    }
    fail(code, "creating the NCCL communicator on rank ", rank(), " of ", size(),
         code == StatusCode::kTimeout ? str_cat(" timed out after ", timeout().count(), " ms") : std::string(" failed"),
         ": ", find_missing_ranks(*store_, prefix_, rank(), size(), 0, false, deadline), "; ", cause);
  }

  // Grown in stream order on the channel's stream: cudaFree would wait for
  // every kernel on the device, another group's NCCL kernel among them, which
  // may wait in turn for this rank (the deadlock NCCL's docs warn about).
  uint8_t* scratch(Channel& ch, size_t nbytes, const char* op) {
    if (ch.scratch_bytes < nbytes) {
      if (ch.scratch != nullptr) cudaFreeAsync(ch.scratch, ch.stream);
      ch.scratch = nullptr;
      ch.scratch_bytes = 0;
      cudaError_t rc = cuda::malloc_async(device().index, &ch.scratch, nbytes, ch.stream);
      if (rc == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        fail(StatusCode::kOutOfMemory, op, ": could not allocate ", nbytes, " bytes of scratch on ",
             to_string(device()));
      }
      cuda::check(rc, "cudaMallocAsync");
      ch.scratch_bytes = nbytes;
    }
    return static_cast<uint8_t*>(ch.scratch);
  }

  // Healthy communicators are finalized and destroyed; failed ones, or ones
  // whose finalize does not finish within kFinalizeBound (it waits for the
  // peers to finalize too, and one may be gone), aborted.
  // Any thread may destroy the group, so the group's device is made current
  // (and the thread's own device put back only where it had one).
  void release() noexcept {
    watch_.reset();  // first: it polls the communicators and the events
    cuda::DeviceGuard guard(device().index, std::nothrow);
    Channel* channels[] = {&data_, &control_};
    // Non-blocking: ncclInProgress means the finalize has started; both
    // start before either is waited for, so one bound covers both.
    ncclResult_t states[] = {ncclSystemError, ncclSystemError};
    const bool healthy = !broken();
    for (size_t i = 0; i < 2; ++i) {
      if (channels[i]->comm != nullptr && healthy) states[i] = ncclCommFinalize(channels[i]->comm);
    }
    auto deadline = Clock::now() + std::min(timeout(), kFinalizeBound);
    for (size_t i = 0; i < 2; ++i) {
      while (states[i] == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(channels[i]->comm, &states[i]) != ncclSuccess) break;
      }
    }
    // The failed ones first: a finalized one's destroy would wait for
    // their kernels too (see abort_together).
    nccl::abort_together(states[0] != ncclSuccess ? channels[0]->comm : nullptr,
                         states[1] != ncclSuccess ? channels[1]->comm : nullptr, kFinalizeBound);
    for (size_t i = 0; i < 2; ++i) {
      if (channels[i]->comm != nullptr && states[i] == ncclSuccess) ncclCommDestroy(channels[i]->comm);
      channels[i]->comm = nullptr;
    }
    // Each was allocated on its channel's stream, so that stream exists;
    // destroying it lets its queued work (the frees) finish first.
    if (headers_ != nullptr) cudaFreeAsync(headers_, control_.stream);
    for (Channel* ch : channels) {
      if (ch->scratch != nullptr) cudaFreeAsync(ch->scratch, ch->stream);
    }
    // Back to the cache once the control stream's copies out of it are done:
    // every wait for that stream has returned or the call failed, and a
    // failed call's copy may still be queued, so the stream is waited for
    // first (bounded: its NCCL kernels were aborted above).
    if (host_headers_ != nullptr) {
      if (control_.stream == nullptr || cudaStreamSynchronize(control_.stream) == cudaSuccess) {
        cuda::pinned_host_give(host_headers_);
      }
    }
    // Queued work that waits on these still sees them: an event destroyed
    // while recorded is released once it completes.
    for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
    spare_events_.clear();
    for (Channel* ch : channels) {
      if (ch->stream != nullptr) cudaStreamDestroy(ch->stream);
      *ch = Channel();
    }
    headers_ = host_headers_ = nullptr;
    cudaGetLastError();  // a teardown failure is not left for a later launch check to report
  }

  std::shared_ptr<Store> store_;
  // Whether calls go through NCCL: more than one rank, or one under
  // DP_TEST_NCCL_SINGLE_RANK=1.
  const bool talks_;
  std::string prefix_;
  // The collectives, queued dp_fsdp transfers among them.
  Channel data_;
  // The call headers and the lane's agreement rounds (no communicator for
  // one rank: nothing goes between ranks then).
  Channel control_;
  void* headers_ = nullptr;  // on the control stream
  void* host_headers_ = nullptr;
  // Guards both communicators (and aborted_why_), which the watch may abort
  // while the calling thread uses them.
  mutable std::mutex comm_mutex_;
  std::string aborted_why_;  // why the watch aborted the communicators
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> spare_events_;  // end events the watch is done with
  std::unique_ptr<QueuedWatch> watch_;     // made at the first queued collective
  // The collective in progress (from its header exchange on), for error
  // messages; before the first, the communicator's creation is.
  Call current_;
  bool in_call_ = false;
};

}  // namespace

std::unique_ptr<Backend> create_nccl_backend(CallSite& site, const ProcessGroupOptions& options) {
  return std::make_unique<NcclBackend>(site, options);
}

}  // namespace dparallel::dist
