// Process groups: collectives across the processes of a job, as a front over
// backends (Gloo, NCCL, shared memory, and the hierarchical group over them).
// The front owns what every backend needs: argument checks, the ordered
// queue (async collectives on the group's worker thread), Work, the broken
// state, each collective's sequence number and deadline, the cross-rank
// check that calls agree (the call header and its one verdict, see
// call_header.h), refusals, and the failure reports that name the ranks
// that did not arrive. The front owns its backend (backend.h), which moves
// bytes: it swaps the headers (swap_headers) and runs the collectives'
// transfers; the front drains its queue before the backend goes.
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

#include <atomic>
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
#include "distributed/backend.h"
#include "distributed/call_gate.h"
#include "distributed/call_header.h"
#include "distributed/collective.h"
#include "distributed/flight_recorder.h"
#include "distributed/group_options.h"
#include "distributed/store/store.h"
#include "distributed/work.h"

namespace dparallel::dist {

// Makes the backend a new group runs, as the group's CallSite sees it.
using BackendFactory = std::function<std::unique_ptr<Backend>(CallSite& site)>;

// How a group made by create_process_group came to be: what splitting it
// and asking about its hosts need, learnt at its creation.
struct GroupLineage {
  std::shared_ptr<Store> store;
  std::string prefix;                            // the group's keys in `store`
  std::string master_addr;                       // as its options had it
  BackendChoice backend = BackendChoice::kAuto;  // as its options asked
  bool network_paced = false;                    // it, or a group it was made from, spans hosts
  // Every rank's host, numbered in the order of each host's lowest rank.
  std::vector<int32_t> host_of_rank;
};

// What a split's new group asks for beyond its ranks: its backend, timeout and device.
struct SplitOptions {
  BackendChoice backend = BackendChoice::kAuto;
  Millis timeout{300000};
  Device device{DeviceType::kCpu, 0};
};

class ProcessGroup final : private CallSite {
 public:
  // A group of `rank` in `world_size` over the backend `make_backend` makes.
  ProcessGroup(int32_t rank, int32_t world_size, Device device, Millis timeout, const BackendFactory& make_backend);
  // Drains the queue before the backend goes.
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  using CallSite::device;
  using CallSite::rank;
  using CallSite::size;
  using CallSite::timeout;
  const char* backend_name() const { return backend_->name(); }
  // For tests that look at what a backend did.
  const Backend& backend() const { return *backend_; }
  BackendCapabilities capabilities() const { return backend_->capabilities(); }
  void* transfer_stream() const { return backend_->transfer_stream(); }
  void* control_stream() const { return backend_->control_stream(); }

  // With `async`, returns at once with the Work to wait on; otherwise returns
  // when done (the Work is then already finished).
  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op, bool async);
  // One all_reduce over `tensors` (one dtype, any shapes) as if they were
  // concatenated: the other ranks' matching call may be this or a plain
  // all_reduce of the concatenation.
  std::shared_ptr<Work> all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op, bool async);
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int32_t root, bool async);
  // A collective (every rank asks for the same `bytes`): memory the other
  // ranks map too, for tensors whose all_reduce then copies less, from the
  // backend's RegionService (shm); null where the backend has none.
  std::shared_ptr<SharedRegion> create_region(size_t bytes);
  // create_region as the storage of tensors (which keep the region alive),
  // where running out of memory is no error: null then (on every rank
  // alike), with the reason in *why; null too where the backend has none.
  // With `all_parts`, the storage is every rank's part, back to back
  // (world * bytes, rounded up as the backend rounds a part).
  std::shared_ptr<Storage> create_region_storage(size_t bytes, std::string* why, bool all_parts = false);
  std::shared_ptr<Work> all_gather(const Tensor& input, const std::vector<Tensor>& outputs, bool async);
  std::shared_ptr<Work> reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op,
                                       bool async);
  // An all_gather of `segment` bytes per rank (the other ranks' matching call
  // may be this or a plain all_gather of that many uint8): this rank's bytes
  // are read from `sources`, rank q's land in `places[q]` (Backend::
  // all_gather_runs); runs lie inside the segment, on the group's device.
  std::shared_ptr<Work> all_gather_runs(size_t segment, std::vector<SegmentRun> sources,
                                        std::vector<std::vector<SegmentRun>> places, bool async);
  // A reduce_scatter (the other ranks' matching call may be this or a plain
  // one) whose rank-q part is made of the runs of `parts[q]`
  // (Backend::reduce_scatter_runs: byte offsets into the part, in order,
  // not overlapping each other or `output`, views of output's dtype on the
  // group's device). With `accumulate`, output += the result (a gradient
  // accumulating across steps, with no scratch for the result).
  std::shared_ptr<Work> reduce_scatter_runs(std::vector<std::vector<SegmentRun>> parts, const Tensor& output,
                                            ReduceOp op, bool async, bool accumulate = false);
  std::shared_ptr<Work> barrier(bool async);

  // Refuses this rank's call of `kind` for `reason`: the refusal takes the
  // call's place in the sequence, so that the other ranks' matching calls
  // fail naming this rank and `reason`. Always throws kInvalidArgument:
  // synchronously once every rank has seen the refusal (the verdict, naming
  // every rank that refused), with `async` at once (the refusal is queued).
  [[noreturn]] void refuse(CallKind kind, const std::string& reason, bool async);

  // Records how the group was made (create_chosen_process_group); groups
  // made inside a backend have none.
  void set_lineage(GroupLineage lineage);
  // Among the group's ranks on this rank's host (GroupLineage::host_of_rank):
  // this rank's index in rank order, and how many there are; the hosts the
  // group spans. kState for a group without a lineage.
  int32_t local_rank() const;
  int32_t local_size() const;
  int32_t num_hosts() const;
  // A collective over this group, run as one all_gather (so it keeps its
  // place among the group's collectives and a peer's other call fails it as
  // out of step): the ranks passing the same `color` >= 0 form a new group,
  // ranked by (`key`, rank here), over this group's store under keys of
  // their own; a negative color joins none (null). `agreement` must be the
  // same on every rank (kInvalidArgument on every rank naming those that
  // differ, `what` saying what it stands for): callers that split on every
  // rank with arguments they must agree on (a mesh's shape) pass their hash.
  // A bad `options` refuses the exchange (the other ranks fail naming this
  // rank). The new group holds its own reference to the store.
  std::unique_ptr<ProcessGroup> split(int32_t color, int32_t key, const SplitOptions& options, uint64_t agreement = 0,
                                      const char* what = "");
  const GroupLineage& lineage() const;
  // After a peer failed (any time, in fact): the ranks still alive agree,
  // through the store, on who is left, and form a new group of them in
  // their old order over the same backend choice, timeout and device. A
  // rank counts as lost once its connection to the TCP store closed (its
  // process died or left; seen at once), or when it has not called shrink
  // within twice the timeout. The first rank to see every rank alive or
  // lost (or to reach that deadline) decides for all; a rank the decision
  // left out gets kState, and one that saw no other rank alive or lost
  // forms no group (kTimeout). This group is left as it was (destroy it).
  std::unique_ptr<ProcessGroup> shrink();
  // The ranks (this group's numbering) the group's last shrink left out; a
  // group made by shrink answers those of the group it came from.
  std::vector<int32_t> lost_ranks();

  // Why the group is unusable, or "" while it is usable.
  std::string broken_reason();

  // Breaks the group for good and makes the peers' current or next
  // collective with it fail now rather than at their timeout (a group built
  // over this one calls it when another of its parts failed). Only between
  // collectives: not while one runs on this group.
  void abort(const std::string& why) noexcept;
  // The host's abort (dp_process_group_abort): as abort, from any thread,
  // also while a collective runs. Every later call fails with kState naming
  // `why`, and so does the running one once the backend's abort reaches it
  // (at once on shared memory, NCCL and MPI; Gloo's waits end at their deadline).
  void abort_calls(const std::string& why) noexcept;

  // While `gate` lives, calls from threads other than its own are refused
  // (kState, nothing sent) whenever it says so.
  void set_call_gate(std::weak_ptr<CallGate> gate);
  // Waits until no call of another thread is in flight (the gate's thread,
  // before it issues calls of its own).
  void wait_for_other_threads_calls();

 private:
  using Clock = std::chrono::steady_clock;
  using Task = std::function<void()>;
  struct Outcome {
    StatusCode code;
    std::string message;
  };

  // CallSite: what the backend calls mid-collective.
  Call begin_call(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root, const Tensor* tensor) override;
  void exchange_headers(Call& call) override;
  Error refuse_out_of_memory(CallKind kind, const char* op, const std::string& reason) override;
  Error call_failed(const Call& call, StatusCode code, const std::string& cause) override;
  Error call_failed_knowing(const Call& call, StatusCode code, const std::string& missing,
                            const std::string& cause) override;
  void set_failure_reports(std::shared_ptr<Store> store, std::string prefix) override;
  bool broken() override;
  void mark_broken(const std::string& why) noexcept override;

  // Runs `check`, which checks a call's arguments; an argument error it
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
  // Takes part in the header exchange of the collective `kind` as having
  // refused it; throws the verdict.
  void run_refused(CallKind kind, const std::string& reason);
  std::shared_ptr<Work> submit(CallKind kind, Task task, bool async);
  Outcome execute(CallKind kind, const Task& task);
  void drain();
  // Counts a call of `kind` from this thread as in flight; kState when
  // another thread's call is (the group is then misdriven for good).
  void claim_for_this_thread_locked(CallKind kind);
  void release_claim();
  // The call `kind` of a misdriven group, in its place in the sequence:
  // refused, so that the other ranks fail too.
  [[noreturn]] void refuse_misdriven(CallKind kind);
  void worker_loop();
  void check_tensor(const Tensor& t, const std::string& argument, const char* op) const;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<Task, std::shared_ptr<Work>>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::string broken_;                // the failure that broke the group
  std::atomic<bool> aborted_{false};  // by abort_calls: failures are reported as the abort
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
  std::shared_ptr<const GroupLineage> lineage_;
  std::shared_ptr<FlightRecorder> recorder_;       // made once the backend is
  std::atomic<TraceCall*> running_call_{nullptr};  // the running call's record, null: none
  uint64_t splits_ = 0;                            // splits so far: each new group's keys are "split<n>/"
  uint64_t shrinks_ = 0;                           // shrinks so far: each one's keys are "shrink<n>/"
  std::vector<int32_t> lost_ranks_;                // by mutex_: lost_ranks()
  // Last: made after the state above, and gone before it.
  std::unique_ptr<Backend> backend_;
};

// The key (under a group's store prefix) the TCP store sets once `rank`'s
// connection closes: that rank's process died or left.
std::string departure_key(const std::string& prefix, int32_t rank);

// Checks what `options` ask for: rank, world size, backend, device, timeout
// and store; kInvalidArgument naming the field.
void check_process_group_options(const ProcessGroupOptions& options);
// The group `options` ask for (backend_choice.h), after the checks above.
std::unique_ptr<ProcessGroup> create_process_group(const ProcessGroupOptions& options);
// A group of the rank in `options` over the backend `make_backend` makes.
std::unique_ptr<ProcessGroup> make_process_group(const ProcessGroupOptions& options,
                                                 const BackendFactory& make_backend);

}  // namespace dparallel::dist
