// The DDP reducer: averages the gradients of a module's parameters across the
// ranks of a process group, bucket by bucket, while the host's backward still
// runs (PyTorch's c10d Reducer, driven by explicit ready marks instead of
// autograd hooks). See dparallel/dp_ddp.h for the contract.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "ddp/comm_hooks.h"
#include "ddp/plan_text.h"
#include "distributed/process_group.h"
#include "lane/comm_lane.h"
#include "lane/debug_level.h"
#include "module/memory_overlap.h"
#include "module/module.h"

namespace dparallel::ddp {

// Reduces `flat` (bucket `bucket`'s gradients, this rank's values) in place;
// throws on failure. Runs on the reducer's worker thread.
using CustomHook = std::function<void(size_t bucket, const Tensor& flat)>;

struct ReducerOptions {
  size_t bucket_cap_bytes = 25u << 20;
  size_t first_bucket_cap_bytes = 1u << 20;
  bool gradient_as_bucket_view = false;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool init_sync = true;
  std::vector<std::string> ignored_modules;
  std::vector<std::string> ignored_parameters;
  HookKind hook = HookKind::kAllReduce;
  CustomHook custom_hook;
  // After the first synced iteration the used set, the ready order and the
  // plan are final: no used map, and an iteration that departs from them
  // fails on every rank.
  bool static_graph = false;
  // The optimizer inside backward: on the lane, once a bucket's averaged
  // gradients are final, with its parameters' indices; non-zero fails
  // finish_backward with kUser.
  std::function<int(size_t bucket, const std::vector<size_t>& params)> on_bucket_reduced;
  // A plan from plan_text() to start with (empty: none); it is final.
  std::string bucket_plan;
  // While ranks have joined: the built-in hooks divide by the initial
  // world size (true) or by the ranks still active (false).
  bool join_divide_by_initial_world_size = true;
  // An argument error the caller found on this rank: refused in the
  // creation's place, so that with init_sync or a bucket plan (a creation
  // that makes collectives) every rank fails naming it.
  std::string argument_error;
};

struct ReducerStats {
  double backward_ms = 0;
  double reduce_ms = 0;
  double exposed_ms = 0;
  size_t num_buckets = 0;
  bool buckets_rebuilt = false;
};

// Bucket memory in a shared region: each bucket starts on a cache line.
constexpr size_t kBucketAlign = 64;
inline size_t align_bucket(size_t bytes) { return (bytes + kBucketAlign - 1) / kBucketAlign * kBucketAlign; }

class Reducer : public lane::LaneOwner, public std::enable_shared_from_this<Reducer> {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective when init_sync is set: every rank must call it.
  Reducer(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options);
  ~Reducer() override;
  // Stops for good: drops its queued reductions and waits, bounded by the
  // group's timeout, for its running one (a comm hook that never returns
  // is left running; the job keeps the reducer alive until it does).
  void close();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void pre_forward();
  // Managed index of a dotted name relative to the module; kInvalidArgument when unknown or not managed.
  size_t index_of(const std::string& name) const;
  const Device& device() const { return group_->device(); }
  // `stream` (a cudaStream_t) is used only with `has_stream`, for CUDA parameters.
  void mark_ready(size_t index, bool has_stream, void* stream);
  void finish_backward();
  void set_requires_sync(bool requires_sync);

  size_t num_parameters() const { return params_.size(); }
  size_t num_buckets() const;
  std::vector<size_t> bucket_parameters(size_t bucket) const;
  ReducerStats last_stats() const;
  // dp_ddp_join for `reducers` (every one this rank drives, the same order
  // on every rank): shadows the other ranks' jobs until every rank joined,
  // then every rank takes the parameters and buffers of the last to join.
  static void join(const std::vector<std::shared_ptr<Reducer>>& reducers);
  // The ranks still active for the job about to run (the lane sets it).
  void set_active_ranks(int32_t active) override { active_ranks_.store(active); }
  const char* owner_kind() const override { return "dp_ddp"; }
  // The current plan as text (plan_text.h).
  std::string plan_text() const;
  // Whether any rank used parameter `index` in the last synced iteration
  // (inside on_bucket_reduced: in the one being reduced); kState before any.
  bool parameter_used(size_t index) const;

  // dp_ddp_rebind (reducer_rebind.cpp). The options a reducer over another
  // group goes on with: these, with the current plan given and init_sync.
  ReducerOptions options_for_rebind() const;
  const std::shared_ptr<Module>& module() const { return module_; }
  bool requires_sync() const;
  // Takes no more calls that change it (kState from then on), between
  // iterations only: kState while a backward is in progress, unless an
  // earlier failure left it broken. Nothing is sent on the group.
  void retire();

 private:
  friend class lane::CommLane;
  struct Managed {
    std::string name;
    std::shared_ptr<Parameter> parameter;
    size_t nbytes = 0;
    size_t bucket = 0;
    size_t offset = 0;  // bytes into the bucket
  };
  // A job of this iteration on the lane: issued, then done with an outcome.
  struct JobState {
    bool issued = false;
    bool done = false;
    StatusCode code = StatusCode::kOk;
    std::string error;
    Clock::time_point start, end;
  };
  struct Bucket {
    std::vector<size_t> params;
    DType dtype = DType::kFloat32;
    Tensor flat;  // undefined when the reduction reads the gradients in place
    int64_t numel = 0;
    size_t pending = 0;            // parameters not yet marked this iteration
    std::vector<Event> events;     // the host's streams at the marks: wait, then copy in
    std::vector<size_t> deferred;  // parameters whose copy waits for `events`
    bool copied_back = false;      // its gradients already hold the result
    int64_t divide_by = 1;         // hold_results_: what the copy back divides the held sum by
    // This rank's own values, kept from just before the reduction, so that
    // a failed finish_backward can leave every gradient local.
    Tensor local;
    bool reduced = false;  // its reduction started: `local` holds the values to restore
    JobState job;
  };
  // What the constructor gathers before its collectives.
  struct Setup {
    std::string local_error;  // an argument error found on this rank (init_sync: every rank fails naming it)
    std::vector<std::pair<std::string, Tensor>> state;  // broadcast from rank 0 with init_sync
  };

  // Constructor steps.
  Setup collect_managed();
  // With gradient_as_bucket_view on a shared-memory group (after the
  // agreement check: every rank then asks alike): bucket memory the other
  // ranks map, so that a bucket's all_reduce reads theirs where it is. Room
  // for any plan's buckets; none (private buckets) when there is no room.
  void create_bucket_region();
  // The size create_bucket_region asks for (the same on every rank).
  size_t bucket_region_bytes() const;
  void create_gradient_region();
  void check_no_overlap() const;
  std::vector<std::string> describe_for_agreement(const Setup& setup) const;
  // Makes this reducer the owner of params_ (kInvalidArgument naming the
  // first one another live dp_ddp or dp_fsdp holds: then it claims none).
  void claim_parameters();
  void release_parameters();

  // The plan (reducer_plan.cpp). The buckets go into `region` (null:
  // private memory), which must be fresh: memory a bucket had may still be
  // held by the host (a DLPack export of a gradient view), so none is laid
  // out twice.
  void build_buckets(const std::vector<std::vector<size_t>>& plan, const std::shared_ptr<Storage>& region);
  std::vector<std::vector<size_t>> plan_for(const std::vector<size_t>& order) const;
  std::vector<PlanParam> plan_params() const;
  // True when the plan changed (with views: the gradients' storage moved).
  // `region`: the one the ready-order job made for the new buckets, if any.
  bool rebuild(const std::vector<size_t>& rank0_order, std::shared_ptr<Storage> region);
  Tensor slot_of(size_t index) const;
  // Whether parameter `index`'s gradient is its view into the bucket (the
  // host may have set a gradient of its own since).
  bool grad_is_view(size_t index) const;
  // Whether parameter `index`'s gradient goes into its bucket slot and the
  // result back by copies (not in place, not a view).
  bool needs_copy(size_t index) const;
  // Parameter `index`'s values in its bucket's saved local copy.
  Tensor local_slot(size_t index) const;
  std::string describe_params(const std::vector<size_t>& indices) const;
  // The module's gradient tensors of `bucket`'s parameters, in its order.
  std::vector<Tensor> bucket_grads(const Bucket& bucket) const;
  // The bucket's gradients as this rank holds them now, into `local`.
  void save_local(size_t index);
  // Whether a failure of this iteration could still come after the bucket
  // is reduced; else saving the bucket would be a copy for nothing.
  bool needs_save(size_t index) const;
  // The bucket's reduction waits for the last bucket's job (defer_).
  bool defers(size_t index) const { return defer_ && index + 1 < buckets_.size(); }
  // The last bucket's job with defer_: in place (and no on_bucket_reduced),
  // one all_reduce per dtype over every bucket's gradients; else bucket by
  // bucket (zeros when `shadow`).
  void reduce_deferred(bool shadow);
  // The bucket's results into the gradients that are not views of it; then
  // on_bucket_reduced. Once per iteration.
  void copy_back(size_t index);
  // A joined rank's stand-in for bucket `index`'s reduction: zeros, the
  // same calls as the others make.
  void reduce_zeros(size_t index);
  // One all_reduce of `tensors` taken as their concatenation, divided by
  // divisor(): as kAvg when that is the world size.
  void average_coalesced(const std::vector<Tensor>& tensors);
  // After a failed iteration: every reduced bucket's gradients back to this
  // rank's own values (and `saved_views`, unused views' own values).
  void restore_local_locked(const std::map<size_t, Tensor>& saved_views);

  void broadcast_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int32_t root = 0);
  // A joined rank's part in another rank's job: zeros, nothing kept.
  void run_shadow(const lane::JobSpec& spec);
  // What the built-in hooks divide by: the world size, or with
  // join_divide_by_initial_world_size off, the ranks still active.
  int64_t divisor() const;
  // Averages `flat`, bucket `index`'s values (or zeros standing in for them).
  void reduce_flat(size_t index, const Tensor& flat);
  // After dp_ddp_join: the rank that ran the most iterations (the highest
  // of them) broadcasts the parameters and buffers; every rank takes its
  // iteration count.
  void sync_after_join();
  // Runs `fn`, which issues collectives on the group, as this reducer's next
  // job on the lane.
  void on_lane(dist::CallItem item, const std::function<void()>& fn);

  // Issuing this iteration's jobs.
  void issue_locked(lane::JobSpec spec, JobState& state);
  void issue_ready_buckets_locked();
  // The used map and the ready order, once every bucket is issued and the
  // marks are final (all marked, or the host finished).
  void issue_tail_locked(const std::string& refusal);
  // LaneOwner: a job of this iteration (or, with a refusal, its refusal).
  lane::JobResult run_job(const lane::JobSpec& spec) override;
  void complete_job(const lane::JobSpec& spec, lane::JobResult result) override;
  JobState& job_state(const lane::JobSpec& spec);
  void drop_job(const lane::JobSpec& spec, StatusCode code, const std::string& why) override;
  void fail_job_locked(JobState& state, StatusCode code, const std::string& why);
  void run_bucket(size_t index);
  // Calls on_bucket_reduced for bucket `index` (no lock held); a non-zero
  // return is kept for finish_backward.
  void report_bucket(size_t index);
  // static_graph, once recorded: the recorded-unused parameters go in as
  // zeros at the iteration's first mark (or finish), so their buckets need
  // not wait for finish_backward.
  void premark_static_unused_locked();
  // At a synced iteration's start: records in memory_departure_ a gradient
  // that overlaps another managed gradient or value (dp_module_set_grad can
  // make one), which would be reduced twice on this rank alone.
  void check_memory_apart_locked();
  void run_used_map();
  void run_ready_order();
  void reduce_bucket(size_t index);
  void check_fingerprint(size_t index);
  void copy_into_bucket(size_t index);
  void wait_all_done(std::unique_lock<std::mutex>& lock);
  // What wait_all_done names when it gives up: the first job not done.
  std::string first_unfinished_locked() const;
  // How long a wait for the lane may last: the group's timeout, and time
  // for a failed collective's reports.
  Clock::duration lane_bound() const;
  void reset_iteration_locked();

  // finish_backward's steps.
  [[noreturn]] void refuse_unmarked_locked(std::unique_lock<std::mutex>& lock, const std::vector<size_t>& unmarked);
  [[noreturn]] void refuse_static_departure_locked(std::unique_lock<std::mutex>& lock,
                                                   const std::vector<size_t>& unmarked);
  [[noreturn]] void refuse_rest_locked(std::unique_lock<std::mutex>& lock, const std::string& refusal,
                                       const std::string& message);
  std::map<size_t, Tensor> fill_unused_locked(const std::vector<size_t>& unmarked);
  // The first failed job's error, with what this rank marked; empty when none failed.
  const JobState* first_failure_locked(std::string& message) const;
  void copy_results_back_locked(const std::map<size_t, Tensor>& saved_views);
  ReducerStats measure_locked(Clock::time_point finish_start);

  // The log and the timeline (reducer_log.cpp).
  // DP_DEBUG=INFO and DETAIL: `title`, then every bucket and its parameters.
  void log_plan(const std::string& title) const;
  void trace(const std::string& event);
  void trace_mark(size_t index, Clock::time_point now);
  void trace_iteration(Clock::time_point finish_start, Clock::time_point reduced);
  void flush_trace();

  std::shared_ptr<Module> module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  ReducerOptions options_;
  // The default hook on cpu gradients without views or the used map, on a
  // group with shared regions: each bucket is one coalesced all_reduce
  // straight over the module's gradients, with no bucket memory and no
  // copies in or out. Elsewhere a coalesced all_reduce would flatten into
  // scratch and back, and the in-place result would need a save.
  bool in_place_ = false;
  // Copies into cpu buckets without views, the used map or
  // on_bucket_reduced, on a group without shared regions (Gloo, the
  // hierarchical group): every bucket's result stays in the bucket until
  // finish_backward, once every job succeeded, so the gradients keep this
  // rank's own values until nothing can fail the iteration and no bucket
  // needs a save. Per step: one copy in, the reduction, one copy back. The
  // default hook's division is made by the copy back (one pass, not two).
  bool hold_results_ = false;
  // On a shared-memory group with a built-in hook (no custom hook or used
  // map): every bucket is reduced in the last bucket's job, once every rank
  // has marked everything, so no refusal can follow a reduction and no
  // bucket needs a save. There the reduction is memory-bound work on the
  // cores the host's backward runs on: overlapping it slows the backward by
  // as much (bench/RESULTS.md), and each bucket reduced early would cost a
  // save of it besides. With on_bucket_reduced each bucket is reported
  // before the next one is reduced.
  bool defer_ = false;
  // The region the buckets view (create_bucket_region's, then the
  // rebuild's); the one before goes once nothing else holds it.
  std::shared_ptr<Storage> region_storage_;
  lane::DebugLevel debug_ = lane::DebugLevel::kOff;
  std::string timeline_path_;
  std::vector<Managed> params_;
  std::shared_ptr<ParameterOwner> parameter_owner_;         // holds params_ (claim_parameters) while the reducer lives
  std::vector<std::pair<std::string, Tensor>> buffers_;     // broadcast by pre_forward
  std::vector<std::pair<std::string, Tensor>> sync_state_;  // parameters and buffers: broadcast at create and join
  std::vector<std::vector<size_t>> given_plan_;             // parsed from options_.bucket_plan
  std::unordered_map<std::string, size_t> index_by_name_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Bucket> buckets_;
  bool broken_ = false;  // a wait outlived its bound: only destroy is left
  std::shared_ptr<lane::CommLane> lane_;
  uint32_t lane_id_ = 0;
  uint32_t iteration_ = 0;                // synced backwards begun: the jobs' iteration
  std::atomic<int32_t> active_ranks_{0};  // 0 until the lane sets it: the world

  bool requires_sync_ = true;
  bool rebuilt_ = false;
  size_t next_issue_ = 0;  // buckets are issued in index order
  size_t marked_count_ = 0;
  std::vector<uint8_t> marked_;
  std::vector<uint8_t> used_since_sync_;
  std::vector<size_t> ready_order_;
  // The tail jobs of this iteration and what they brought back.
  JobState used_map_job_;
  JobState order_job_;
  std::vector<uint8_t> used_result_;
  std::vector<size_t> rank0_order_;
  // With the buckets in a region: the fresh one the ready-order job made
  // (on every rank alike) when the rebuilt plan differs.
  std::shared_ptr<Storage> next_region_;
  // Whether any rank used each parameter, for the iteration whose results
  // were last delivered; empty before the first.
  std::vector<uint8_t> used_flags_;
  bool used_flags_current_ = false;  // used_flags_ already holds this iteration's
  // static_graph, once recorded: the used set every iteration must keep.
  std::vector<uint8_t> static_used_;
  bool graph_recorded_ = false;
  std::string static_departure_;    // this iteration's first departure from it
  std::string memory_departure_;    // this iteration's overlapping gradient, if any
  uint64_t apart_at_ = UINT64_MAX;  // Parameter::assignments() when last found apart
  std::vector<uint8_t> premarked_;  // recorded unused, put in as zeros at the iteration's start
  size_t premarked_count_ = 0;
  std::map<size_t, Tensor> premarked_views_;  // their views' own values, put back at finish
  std::string report_error_;                  // this iteration's first failed on_bucket_reduced
  bool tail_issued_ = false;
  bool any_mark_ = false;
  bool finishing_ = false;  // a finish_backward is running: other calls are refused
  bool closed_ = false;
  bool retired_ = false;  // dp_ddp_rebind moved the dp_ddp to another reducer
  Clock::time_point first_mark_;
  ReducerStats stats_;
  std::vector<std::string> trace_events_;
};

}  // namespace dparallel::ddp
