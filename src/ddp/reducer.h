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
  static std::shared_ptr<CommQueue> for_group(const dist::ProcessGroup* group);
  CommQueue();
  ~CommQueue();
  CommQueue(const CommQueue&) = delete;
  CommQueue& operator=(const CommQueue&) = delete;

  // Runs owner->run_job(bucket, refusal) on the worker, after what is queued.
  void push(Reducer* owner, size_t bucket, std::string refusal);
  // Runs `fn` on the worker after what is queued and returns once it has,
  // rethrowing what it threw. When it has not started within `bound` (a
  // job before it never ends), it is dropped: kTimeout naming `what`.
  void call(const Reducer* owner, const char* what, const std::function<void()>& fn,
            std::chrono::steady_clock::duration bound);
  // Drops the owner's queued jobs and waits for its running one to end.
  void cancel(const Reducer* owner);
  bool on_worker() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  struct Job {
    const Reducer* owner;
    std::function<void()> run;
    uint64_t id = 0;
  };
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  const Reducer* running_ = nullptr;
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

class Reducer {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective when init_sync is set: every rank must call it.
  Reducer(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options);
  ~Reducer();
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
  void reduce_bucket(size_t index);
  void check_fingerprint(size_t index);
  void copy_into_bucket(size_t index);
  Tensor slot_of(size_t index) const;
  void wait_all_done(std::unique_lock<std::mutex>& lock);
  void reset_iteration_locked();
  void rebuild(const std::vector<size_t>& rank0_order);
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
