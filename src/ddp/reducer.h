// The DDP reducer: averages the gradients of a module's parameters across the
// ranks of a process group, bucket by bucket, while the host's backward still
// runs (PyTorch's c10d Reducer, driven by explicit ready marks instead of
// autograd hooks). See dparallel/dp_ddp.h for the contract.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "distributed/process_group.h"
#include "module/module.h"

namespace dparallel::ddp {

enum class HookKind : int32_t { kAllReduce = 0, kFp16 = 1, kBf16 = 2, kCustom = 3 };

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
};

struct ReducerStats {
  double backward_ms = 0;
  double reduce_ms = 0;
  double exposed_ms = 0;
  size_t num_buckets = 0;
  bool buckets_rebuilt = false;
};

enum class DebugLevel { kOff, kInfo, kDetail };

class Reducer;

// The one worker that runs every collective of every reducer on a process
// group: bucket reductions in the order buckets became ready, and the
// reducers' other collectives (agreement checks, broadcasts, the used map)
// in their place. Reducers over disjoint submodules of one model share a
// group; their collectives must reach it in the same order on every rank,
// and from one thread (a group refuses calls that overlap from two).
class CommQueue {
 public:
  using Clock = std::chrono::steady_clock;
  static std::shared_ptr<CommQueue> for_group(const dist::ProcessGroup* group);
  CommQueue();
  ~CommQueue();
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Queues owner->run_job(bucket, refusal) after what is queued; the job
  // keeps the reducer alive until it ran. False when the lane is stuck
  // (stuck_reason()): nothing was queued.
  bool push(const std::shared_ptr<Reducer>& owner, size_t bucket, std::string refusal);
  // Runs `fn` on the worker after what is queued and returns once it has,
  // rethrowing what it threw. When it has not started within `bound` (a
  // job before it never ends), it is dropped: kTimeout naming `what`; on a
  // stuck lane, kState at once.
  void call(const Reducer* owner, const char* what, const std::function<void()>& fn, Clock::duration bound);
  // Drops the owner's queued jobs and waits up to `bound` for its running
  // one to end. False when it did not: the lane is then stuck for good.
  bool cancel(const Reducer* owner, Clock::duration bound);
  // A reducer gave up waiting for its jobs: when one is running, the lane
  // is stuck for good (`why` and the running job in the reason), and every
  // queued job is dropped with that reason.
  void give_up(const std::string& why);
  bool on_worker() const { return std::this_thread::get_id() == worker_id_; }
  std::string stuck_reason();

 private:
  // A bucket's reduction (or refusal) of `reducer`, kept alive until it ran;
  // or, with `run`, a reducer's other collectives (call()).
  struct Job {
    const Reducer* owner = nullptr;
    std::shared_ptr<Reducer> reducer;
    size_t bucket = 0;
    std::string refusal;
    const char* what = nullptr;                    // call(): for messages
    std::function<void()> run;                     // call()
    std::function<void(const std::string&)> drop;  // call(): when the lane drops it unrun
    uint64_t id = 0;
    void execute();
    void drop_unrun(const std::string& why);
  };
  // What a message names a job by.
  struct JobName {
    const char* what = nullptr;  // call(); null for a bucket job
    size_t bucket = 0;
    bool refusal = false;
    std::string text() const;
  };
  // What the worker thread shares with the queue: it outlives the queue
  // when the worker is stuck in a job that never returns.
  struct Lane {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Job> jobs;
    const Reducer* running = nullptr;
    JobName running_name;
    Clock::time_point running_since;
    std::string stuck;  // why the lane stopped for good
    uint64_t next_id = 0;
    bool stopping = false;
  };
  static void loop(const std::shared_ptr<Lane>& lane);
  // Marks the lane stuck (locked) and returns the jobs to drop.
  std::deque<Job> stick_locked(const std::string& why);
  static void drop_all(std::deque<Job>& jobs, const std::string& why);

  std::shared_ptr<Lane> lane_;
  std::thread thread_;
  std::thread::id worker_id_;
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective when init_sync is set: every rank must call it.
  Reducer(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options);
  ~Reducer();
  // Stops for good: drops its queued reductions and waits, bounded by the
  // group's timeout, for its running one (a comm hook that never returns
  // is left running; the job keeps the reducer alive until it does).
  void close();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  void pre_forward();
  // Managed index of a dotted name relative to the module; kInvalidArgument when unknown or not managed.
  size_t index_of(const std::string& name) const;
  // `stream` (a cudaStream_t) is used only with `has_stream`, for CUDA parameters.
  void mark_ready(size_t index, bool has_stream, void* stream);
  void finish_backward();
  void set_requires_sync(bool requires_sync);

  size_t num_parameters() const { return params_.size(); }
  size_t num_buckets() const;
  std::vector<size_t> bucket_parameters(size_t bucket) const;
  ReducerStats last_stats() const;

 private:
  struct Managed {
    std::string name;
    std::shared_ptr<Parameter> parameter;
    size_t nbytes = 0;
    size_t bucket = 0;
    size_t offset = 0;  // bytes into the bucket
  };
  struct Bucket {
    std::vector<size_t> params;
    DType dtype = DType::kFloat32;
    Tensor flat;  // undefined when the reduction reads the gradients in place
    int64_t numel = 0;
    size_t pending = 0;            // parameters not yet marked this iteration
    std::vector<void*> events;     // CUDA: wait for these, then copy the gradients in
    std::vector<size_t> deferred;  // parameters whose copy waits for `events`
    bool done = false;
    bool copied_back = false;  // its gradients already hold the result
    // This rank's own values, kept from just before the reduction, so that
    // a failed finish_backward can leave every gradient local.
    Tensor local;
    bool reduced = false;  // its reduction started: `local` holds the values to restore
    StatusCode code = StatusCode::kOk;
    std::string error;
    Clock::time_point start, end;
  };

  void build_buckets(const std::vector<std::vector<size_t>>& plan);
  std::vector<std::vector<size_t>> plan_for(const std::vector<size_t>& order) const;
  void check_agreement(const std::vector<std::string>& description);
  void broadcast_state(const std::vector<std::pair<std::string, Tensor>>& tensors);
  // Runs `fn`, which issues collectives on the group, on the comm queue's
  // worker, in its place among the bucket reductions.
  void on_queue(const char* what, const std::function<void()>& fn);
  void queue_ready_buckets_locked();
  friend class CommQueue;
  // On the queue's worker: one bucket's reduction (or, with `refusal`, its refusal).
  void run_job(size_t index, const std::string& refusal);
  // The lane dropped bucket `index`'s job unrun: it fails with `why`.
  void drop_job(size_t index, const std::string& why);
  void fail_bucket_locked(size_t index, const std::string& why);
  void reduce_bucket(size_t index);
  void check_fingerprint(size_t index);
  void copy_into_bucket(size_t index);
  Tensor slot_of(size_t index) const;
  void wait_all_done(std::unique_lock<std::mutex>& lock);
  // How long a wait for the lane may last: the group's timeout, and time
  // for a failed collective's reports.
  Clock::duration lane_bound() const;
  void reset_iteration_locked();
  // The module's gradient tensors of `bucket`'s parameters, in its order.
  std::vector<Tensor> bucket_grads(const Bucket& bucket) const;
  // The bucket's gradients as this rank holds them now, into `local`.
  void save_local(size_t index);
  // After a failed iteration: every reduced bucket's gradients back to this
  // rank's own values (and `saved_views`, unused views' own values).
  void restore_local_locked(const std::map<size_t, Tensor>& saved_views);
  // True when the plan changed (with views: the gradients' storage moved).
  bool rebuild(const std::vector<size_t>& rank0_order);
  std::string describe_params(const std::vector<size_t>& indices) const;
  // DP_DEBUG=INFO and DETAIL: `title`, then every bucket and its parameters.
  void log_plan(const std::string& title) const;
  void trace(const std::string& event);
  void flush_trace();

  std::shared_ptr<Module> module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  ReducerOptions options_;
  // The default hook on cpu gradients without views or the used map: each
  // bucket is one coalesced all_reduce straight over the module's gradients,
  // with no bucket memory and no copies in or out.
  bool in_place_ = false;
  DebugLevel debug_ = DebugLevel::kOff;
  std::string timeline_path_;
  std::vector<Managed> params_;
  std::vector<std::pair<std::string, Tensor>> buffers_;  // broadcast by pre_forward
  std::unordered_map<std::string, size_t> index_by_name_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Bucket> buckets_;
  bool broken_ = false;  // a wait outlived its bound: only destroy is left
  std::shared_ptr<CommQueue> queue_;

  bool requires_sync_ = true;
  bool rebuilt_ = false;
  size_t next_queue_ = 0;  // buckets queue in index order
  std::vector<uint8_t> marked_;
  std::vector<uint8_t> used_since_sync_;
  std::vector<size_t> ready_order_;
  bool any_mark_ = false;
  bool finishing_ = false;  // a finish_backward is running: other calls are refused
  bool closed_ = false;
  Clock::time_point first_mark_;
  ReducerStats stats_;
  std::vector<std::string> trace_events_;
};

// What this thread is running: a reducer's comm hook, for its bucket, or nothing.
struct RunningHook {
  const Reducer* reducer = nullptr;
  size_t bucket = 0;
};
RunningHook running_hook() noexcept;

const char* hook_name(HookKind hook);
DebugLevel debug_level_from_env();

}  // namespace dparallel::ddp
