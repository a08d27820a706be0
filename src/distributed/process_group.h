// Process groups: collectives across the processes of a job, as a front over
// backends (Gloo, NCCL, shared memory, and the hierarchical group over them).
// The front owns what every backend needs: argument checks, the ordered
// queue (async collectives on the group's worker thread), Work, the broken
// state, each collective's sequence number and deadline, the cross-rank
// check that calls agree (the call header and its one verdict, see
// call_header.h), refusals, and the failure reports that name the ranks
// that did not arrive. Backends move bytes: they swap the headers
// (swap_headers) and run the collectives' transfers.
// After a collective fails with kTimeout or kRemote the group is broken:
// later collectives fail at once with kState.
// A call with a bad argument is refused, but still takes part in the ranks'
// header exchange: the other ranks' matching calls fail at once naming this
// rank and why, and the group stays in step and usable.
// One thread drives a group at a time: a call made while another thread's
// call is in flight (running or queued) is refused with kState, and since
// which call each rank then paired with which is unknown, the call in flight
// fails too and every later call is refused through the header exchange
// (the other ranks fail naming this rank). A group made in another process
// (this one is a forked child) refuses every call with kState.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/process_origin.h"
#include "core/tensor.h"
#include "distributed/call_gate.h"
#include "distributed/call_header.h"
#include "distributed/collective.h"
#include "distributed/store/store.h"
#include "distributed/work.h"

namespace dparallel::dist {

enum class Backend : int32_t { kAuto = 0, kGloo = 1, kNccl = 2 };

struct ProcessGroupOptions {
  Backend backend = Backend::kAuto;
  int32_t rank = -1;
  int32_t world_size = -1;
  std::shared_ptr<Store> store;
  Millis timeout{300000};
  Device device{DeviceType::kCpu, 0};
  std::string master_addr;  // where the store lives, when known: picks the network interface
};

class ProcessGroup {
 public:
  ProcessGroup(int32_t rank, int32_t world_size, Device device, Millis timeout);
  virtual ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int32_t rank() const { return rank_; }
  int32_t size() const { return world_size_; }
  const Device& device() const { return device_; }
  Millis timeout() const { return timeout_; }
  virtual const char* backend_name() const = 0;

  // With `async`, returns at once with the Work to wait on; otherwise returns
  // when done (the Work is then already finished).
  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op, bool async);
  // One all_reduce over `tensors` (one dtype, any shapes) as if they were
  // concatenated: the other ranks' matching call may be this or a plain
  // all_reduce of the concatenation. Backends that read and write the pieces
  // in place override run_all_reduce_coalesced; the others flatten.
  std::shared_ptr<Work> all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op, bool async);
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int32_t root, bool async);
  std::shared_ptr<Work> all_gather(const Tensor& input, const std::vector<Tensor>& outputs, bool async);
  std::shared_ptr<Work> reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op,
                                       bool async);
  std::shared_ptr<Work> barrier(bool async);

  // Runs `check`, which translates a call's arguments; an argument error it
  // throws (kInvalidArgument) refuses the collective `kind` (see refuse()).
  template <typename Check>
  void check_arguments(CallKind kind, bool async, Check&& check) {
    try {
      check();
    } catch (const Error& e) {
      if (e.code() != StatusCode::kInvalidArgument) throw;
      refuse(kind, e.what(), async);
    }
  }
  // Refuses this rank's call of `kind` for `reason`: the refusal takes the
  // call's place in the sequence, so that the other ranks' matching calls
  // fail naming this rank and `reason`. Always throws kInvalidArgument:
  // synchronously once every rank has seen the refusal (the verdict, naming
  // every rank that refused), with `async` at once (the refusal is queued).
  [[noreturn]] void refuse(CallKind kind, const std::string& reason, bool async);

  // Breaks the group for good and makes the peers' current or next
  // collective with it fail now rather than at their timeout (a group built
  // over this one calls it when another of its parts failed). Only between
  // collectives: not while one runs on this group.
  virtual void abort(const std::string& why) noexcept { mark_broken(why); }

  // While `gate` lives, calls from threads other than its own are refused
  // (kState, nothing sent) whenever it says so.
  void set_call_gate(std::weak_ptr<CallGate> gate);
  // Waits until no call of another thread is in flight (the gate's thread,
  // before it issues calls of its own).
  void wait_for_other_threads_calls();

 protected:
  using Clock = std::chrono::steady_clock;

  // One collective as the front tracks it for every backend.
  struct Call {
    CallHeader header;
    Clock::time_point deadline;
    bool exchanged = false;          // every rank's header has arrived
    const Tensor* tensor = nullptr;  // named in failures (the first of `pieces`); null for none
    size_t pieces = 1;               // tensors reduced as one (coalesced)
  };
  // Collective #n+1 of this group: its header and deadline. What it may need
  // must be allocated before: failing after the header exchange would leave
  // the peers waiting.
  Call begin_call(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root, const Tensor* tensor);
  // Swaps `call`'s header with every rank (the backend's swap_headers) and
  // reaches the verdict every rank reaches (check_call_headers); a verdict
  // that fails calls after_failed_verdict() first.
  void exchange_headers(Call& call);
  // Takes part in the header exchange of the collective `kind` as having
  // refused it; throws the verdict.
  void run_refused(CallKind kind, const std::string& reason);
  // Scratch for a collective could not be allocated before its header
  // exchange: refuses the call in its place (the other ranks fail too and the
  // group stays in step), then fails with kOutOfMemory naming `op` and `reason`.
  [[noreturn]] void refuse_out_of_memory(CallKind kind, const char* op, const std::string& reason);
  // A collective whose transfer failed (`code`: kTimeout, kRemote, or
  // kOutOfMemory): reports the failure through the store, then throws `code`
  // naming the collective, its tensor, the ranks that did not report the
  // failure, and `cause`.
  [[noreturn]] void fail_call(const Call& call, StatusCode code, const std::string& cause);
  // As fail_call, when this rank already knows who is missing (`missing`,
  // e.g. peers whose processes it saw exit): no listening for reports.
  [[noreturn]] void fail_call_knowing(const Call& call, StatusCode code, const std::string& missing,
                                      const std::string& cause);
  // Where failure reports go (find_missing_ranks); set by the backend's constructor.
  void set_failure_reports(std::shared_ptr<Store> store, std::string prefix);
  // What `call` moves, for messages: its tensor, or "no tensor", "a refused call".
  static std::string describe_call(const Call& call);

  // Moves `call.header` to every rank; afterwards received_header(r) is
  // rank r's. A transfer that fails goes through fail_call.
  virtual void swap_headers(Call& call) = 0;
  virtual CallHeader received_header(int32_t r) = 0;
  // After headers were swapped whose verdict failed (every rank fails alike).
  virtual void after_failed_verdict() {}

  virtual void run_all_reduce(const Tensor& tensor, ReduceOp op) = 0;
  // Default: copies the pieces into one scratch tensor, all-reduces it, copies back.
  virtual void run_all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op);
  virtual void run_broadcast(const Tensor& tensor, int32_t root) = 0;
  virtual void run_all_gather(const Tensor& input, const std::vector<Tensor>& outputs) = 0;
  virtual void run_reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) = 0;
  virtual void run_barrier() = 0;
  // The device type this backend's tensors must live on.
  virtual DeviceType tensor_device_type() const = 0;
  // Backends call this from their destructor, before their members go.
  void drain();
  // True once a collective has failed with kTimeout, kRemote or kInternal.
  bool broken();
  // Marks the group unusable: a failure that left the ranks out of step.
  void mark_broken(const std::string& why) noexcept;

 private:
  using Task = std::function<void()>;
  struct Outcome {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<Work> submit(CallKind kind, Task task, bool async);
  Outcome execute(CallKind kind, const Task& task);
  // Counts a call of `kind` from this thread as in flight; kState when
  // another thread's call is (the group is then misdriven for good).
  void claim_for_this_thread_locked(CallKind kind);
  void release_claim();
  // The call `kind` of a misdriven group, in its place in the sequence:
  // refused, so that the other ranks fail too.
  [[noreturn]] void refuse_misdriven(CallKind kind);
  void worker_loop();
  void check_tensor(const Tensor& t, const std::string& argument, const char* op) const;

  int32_t rank_;
  int32_t world_size_;
  Device device_;
  Millis timeout_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<Task, std::shared_ptr<Work>>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::string broken_;  // the failure that broke the group
  std::thread worker_;
  uint64_t seq_ = 0;  // the last collective's number; only the running collective touches it
  ProcessOrigin origin_;
  // The thread driving the group: its calls in flight, running or queued.
  std::thread::id driver_;
  long driver_tid_ = 0;
  // Its latest call, for messages (formatted only when one is needed).
  CallKind driver_kind_ = CallKind::kAllReduce;
  uint64_t driver_call_ = 0;
  size_t calls_in_flight_ = 0;
  uint64_t submitted_ = 0;  // calls submitted so far, named in messages
  std::string misdriven_;   // why the group was driven by several threads at once
  uint64_t misdrives_ = 0;  // grows when misdriven_ is set or a later overlap is seen
  std::shared_ptr<Store> report_store_;
  std::string report_prefix_;
  std::weak_ptr<CallGate> gate_;
};

std::unique_ptr<ProcessGroup> create_process_group(const ProcessGroupOptions& options);
// After a failed collective #seq whose deadline is `deadline`: reports this
// rank's failure through the store under `prefix` and names the ranks that
// reported none for it. The others fail soon too, so it listens briefly: under
// a second past the deadline, at most 2 s when it failed early.
std::string find_missing_ranks(Store& store, const std::string& prefix, int32_t rank, int32_t size, uint64_t seq,
                               bool exchanged, std::chrono::steady_clock::time_point deadline);
// Each backend's factory; the NCCL one fails with kUnsupported in a build without NCCL.
std::unique_ptr<ProcessGroup> create_gloo_process_group(const ProcessGroupOptions& options);
// A cpu group, unless DP_SHM is "0" on any rank: through shared memory
// (shm/) when every rank runs on this host; hierarchical (shared memory
// inside each host, Gloo across) when the ranks span hosts with the same
// number of ranks, at least 2, on each; else through Gloo.
std::unique_ptr<ProcessGroup> create_cpu_process_group(const ProcessGroupOptions& options);
// The address Gloo binds to and advertises when DP_SOCKET_IFNAME is unset:
// with a TCP store, this end's address of its connection to the store.
std::string gloo_host(const ProcessGroupOptions& options);
std::unique_ptr<ProcessGroup> create_nccl_process_group(const ProcessGroupOptions& options);

}  // namespace dparallel::dist
