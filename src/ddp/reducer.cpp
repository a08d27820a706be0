// The reducer at work: marks, the iteration's jobs on the lane, finish_backward.
#include "ddp/reducer.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "comm/comm.h"
#include "core/device_runtime.h"
#include "core/error.h"
#include "distributed/background_calls.h"
#include "distributed/reduce_ops.h"
#include "lane/float_math.h"
#include "lane/host_values.h"

namespace dparallel::ddp {

namespace {

using dist::CallItem;
using dist::ReduceOp;

[[noreturn]] void fail_finishing() {
  fail(StatusCode::kState,
       "dp_ddp_finish_backward is running on another thread; calls on one dp_ddp must not overlap it");
}

[[noreturn]] void fail_broken() { fail(StatusCode::kState, "the dp_ddp is unusable after an earlier failure"); }

double ms_between(Reducer::Clock::time_point a, Reducer::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// In every message about an iteration that departs from the recorded static
// graph; a peer's refusal carrying it fails finish_backward with kState.
constexpr const char* kStaticDeparture = "departs from the static graph";

}  // namespace

Reducer::Clock::duration Reducer::lane_bound() const { return group_->timeout() + std::chrono::seconds(3); }

void Reducer::close() {
  if (closed_) return;
  closed_ = true;
  if (lane_) lane_->detach(this, lane_bound());
  flush_trace();
  release_parameters();
}

Reducer::~Reducer() {
  close();
  lane_.reset();
}

void Reducer::on_lane(CallItem item, const std::function<void()>& fn) {
  lane::JobSpec spec;
  spec.item = item;
  // dp_ddp_join's sync pairs ranks whose iteration counts differ.
  spec.iteration = item == CallItem::kJoinSync ? 0 : iteration_;
  lane_->call(this, spec, fn, lane_bound());
}

// ---- forward and marks ----

void Reducer::pre_forward() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) fail_broken();
    if (finishing_) fail_finishing();
    if (any_mark_) {
      fail(StatusCode::kState,
           "a backward is in progress (parameters were marked ready); call "
           "dp_ddp_finish_backward first");
    }
  }
  if (options_.broadcast_buffers) on_lane(CallItem::kBuffers, [&] { broadcast_state(buffers_); });
}

size_t Reducer::index_of(const std::string& name) const {
  auto it = index_by_name_.find(name);
  if (it != index_by_name_.end()) return it->second;
  module_->get_parameter(name);  // throws naming an unknown name
  fail_invalid("argument 'param_name' is '", name,
               "', a parameter this dp_ddp does not manage (ignored, or it does not require grad)");
}

void Reducer::mark_ready(size_t index, bool has_stream, void* stream) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (broken_) fail_broken();
  if (finishing_) fail_finishing();
  if (index >= params_.size()) {
    fail_invalid("argument 'param_index' is ", index, " but this dp_ddp manages ", params_.size(),
                 " parameters (indices 0..", params_.size() - 1, ")");
  }
  if (marked_[index] != 0) {
    fail(StatusCode::kState, "parameter '", params_[index].name, "' (index ", index,
         ") was already marked ready in this backward; mark each parameter once per backward");
  }
  if (has_stream && stream != nullptr) {
    const Device& device = params_[index].parameter->value().device();
    device_runtime(device.type).check_stream(device.index, stream, "cuda_stream");
  }
  if (requires_sync_ && graph_recorded_ && static_used_[index] == 0) {
    std::string departure =
        str_cat("rank ", group_->rank(), " marked parameter '", params_[index].name, "' (index ", index, "), which ",
                kStaticDeparture,
                ": the first synced iteration recorded it as unused by every rank; with static_graph every iteration "
                "must use the same parameters");
    if (static_departure_.empty()) static_departure_ = departure;
    fail(StatusCode::kState, departure, " (this iteration's finish_backward fails on every rank)");
  }
  if (requires_sync_ && !any_mark_) {
    premark_static_unused_locked();
    check_memory_apart_locked();
  }
  marked_[index] = 1;
  ++marked_count_;
  used_since_sync_[index] = 1;
  auto now = Clock::now();
  if (!any_mark_) {
    any_mark_ = true;
    first_mark_ = now;
    lane_->set_in_backward(this, true);
  }
  trace_mark(index, now);
  if (!requires_sync_) return;
  if (!rebuilt_) ready_order_.push_back(index);
  Managed& m = params_[index];
  Bucket& bucket = buckets_[m.bucket];
  const Device device = m.parameter->value().device();
  const DeviceRuntime& runtime = device_runtime(device.type);
  // The mark's stream: the one passed, else this thread's current stream.
  void* mark_stream = has_stream ? stream : current_stream(device);
  if (mark_stream != nullptr || runtime.default_stream_is_queued()) {
    // The gradient is final once the host's stream gets there: the lane
    // waits on this event, then copies.
    Event ready(device);
    ready.record(mark_stream);
    bucket.events.push_back(std::move(ready));
    if (needs_copy(index)) bucket.deferred.push_back(index);
  } else if (needs_copy(index)) {
    Tensor slot = slot_of(index);
    lock.unlock();
    copy_tensor(slot, m.parameter->grad());
    lock.lock();
  }
  --bucket.pending;
  issue_ready_buckets_locked();
}

// ---- the iteration's jobs ----

void Reducer::issue_locked(lane::JobSpec spec, JobState& state) {
  spec.iteration = iteration_;
  state.issued = true;
  if (!lane_->push(shared_from_this(), std::move(spec))) {
    fail_job_locked(state, lane_->stuck_code(), lane_->stuck_reason());
  }
}

void Reducer::issue_ready_buckets_locked() {
  // Held back for finish_backward, which refuses them all.
  if (!memory_departure_.empty()) return;
  // static_graph: the last bucket waits for finish_backward, so that a rank
  // departing from the graph still has a collective to fail every rank with.
  const size_t issuable = graph_recorded_ && !finishing_ && !buckets_.empty() ? buckets_.size() - 1 : buckets_.size();
  while (next_issue_ < issuable && buckets_[next_issue_].pending == 0) {
    lane::JobSpec spec;
    spec.index = next_issue_;
    issue_locked(std::move(spec), buckets_[next_issue_].job);
    ++next_issue_;
  }
  // Every parameter marked: the marks are final, so the tail need not wait
  // for this rank's finish (which may come after another dp_ddp's).
  if (next_issue_ == buckets_.size() && marked_count_ + premarked_count_ == params_.size() && !tail_issued_) {
    issue_tail_locked("");
  }
}

void Reducer::issue_tail_locked(const std::string& refusal) {
  tail_issued_ = true;
  if (options_.find_unused_parameters && !graph_recorded_) {
    lane::JobSpec spec;
    spec.item = CallItem::kUsedMap;
    spec.refusal = refusal;
    issue_locked(std::move(spec), used_map_job_);
  }
  if (!rebuilt_) {
    lane::JobSpec spec;
    spec.item = CallItem::kReadyOrder;
    spec.refusal = refusal;
    issue_locked(std::move(spec), order_job_);
  }
}

Reducer::JobState& Reducer::job_state(const lane::JobSpec& spec) {
  switch (spec.item) {
    case CallItem::kBucket:
      return buckets_.at(spec.index).job;
    case CallItem::kUsedMap:
      return used_map_job_;
    case CallItem::kReadyOrder:
      return order_job_;
    default:
      fail(StatusCode::kInternal, "a dp_ddp job of unknown kind ", static_cast<uint32_t>(spec.item));
  }
}

lane::JobResult Reducer::run_job(const lane::JobSpec& spec) {
  lane::JobResult result;
  result.start = Clock::now();
  try {
    if (!spec.refusal.empty()) {
      // Stands in for the job's first collective, so that the other ranks'
      // matching call fails at once naming this rank's reason. A deferred
      // bucket's job makes none: the last bucket's stand-in does it.
      if (spec.item != CallItem::kBucket || !defers(spec.index)) {
        try {
          group_->refuse(dist::CallKind::kAllReduce, spec.refusal, false);
        } catch (const Error& e) {
          if (e.code() != StatusCode::kInvalidArgument) throw;
        }
      }
      result.code = StatusCode::kState;
      result.error = spec.refusal;
    } else if (spec.shadow) {
      run_shadow(spec);
    } else if (spec.item == CallItem::kBucket) {
      run_bucket(spec.index);
    } else if (spec.item == CallItem::kUsedMap) {
      run_used_map();
    } else {
      run_ready_order();
    }
  } catch (const Error& e) {
    result.code = e.code();
    result.error = e.what();
  } catch (const std::bad_alloc&) {
    result.code = StatusCode::kOutOfMemory;
    result.error = "out of memory";
  } catch (const std::exception& e) {
    result.code = StatusCode::kInternal;
    result.error = e.what();
  }
  result.end = Clock::now();
  return result;
}

void Reducer::complete_job(const lane::JobSpec& spec, lane::JobResult result) {
  // A joined rank's stand-in belongs to no iteration of its own: the other
  // ranks' iteration fails or not on their side; the join goes on.
  if (spec.shadow) return;
  std::lock_guard<std::mutex> lock(mutex_);
  JobState& state = job_state(spec);
  state.start = result.start;
  state.end = result.end;
  state.code = result.code;
  state.error = std::move(result.error);
  state.done = true;
  cv_.notify_all();
}

void Reducer::run_bucket(size_t index) {
  copy_into_bucket(index);
  if (debug_ == lane::DebugLevel::kDetail) check_fingerprint(index);
  if (defers(index)) return;
  // The results go back into the gradients here, while the host's backward
  // goes on, unless the used map must decide it first; what the used flags
  // say (dp_ddp_parameter_used, on_bucket_reduced) is known by then.
  bool final_now = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    final_now = in_place_ || !options_.find_unused_parameters || graph_recorded_;
    if (final_now && !used_flags_current_) {
      used_flags_ = graph_recorded_ ? static_used_ : std::vector<uint8_t>(params_.size(), 1);
      used_flags_current_ = true;
    }
  }
  if (defer_) {
    reduce_deferred(false);
    for (size_t b = 0; b < buckets_.size(); ++b) copy_back(b);
    return;
  }
  if (needs_save(index)) save_local(index);
  reduce_bucket(index);
  if (final_now) copy_back(index);
}

void Reducer::copy_back(size_t index) {
  Bucket& bucket = buckets_[index];
  if (bucket.copied_back) return;
  std::vector<Tensor> grads, slots;
  for (size_t p : bucket.params) {
    if (!needs_copy(p) || (graph_recorded_ && static_used_[p] == 0)) continue;
    grads.push_back(params_[p].parameter->grad());
    slots.push_back(slot_of(p));
  }
  comm::copy_pairs(grads, slots);
  bucket.copied_back = true;
  report_bucket(index);
}

bool Reducer::needs_save(size_t index) const {
  // The lane runs a job once every rank issued it, and a rank issues its
  // last bucket once it marked everything: no rank can refuse this
  // iteration any more, and no job follows (in place there is no used map,
  // rebuilt no ready order). A refusal met in this very collective fails
  // it at the verdict, before any data changed. Only the host's callback
  // could still fail the iteration.
  const bool last = index + 1 == buckets_.size();
  return !(in_place_ && last && rebuilt_ && options_.on_bucket_reduced == nullptr);
}

// Which parameters any rank used since the last synced backward.
void Reducer::run_used_map() {
  Tensor map = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(params_.size())}, lane::kHostDevice);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::memcpy(map.data(), used_since_sync_.data(), used_since_sync_.size());
  }
  Tensor on_device = lane::to_device(map, group_->device());
  group_->all_reduce(on_device, ReduceOp::kMax, false);
  Tensor back = lane::to_device(on_device, lane::kHostDevice);
  std::lock_guard<std::mutex> lock(mutex_);
  used_result_.assign(static_cast<const uint8_t*>(back.data()),
                      static_cast<const uint8_t*>(back.data()) + params_.size());
}

// Rank 0's ready order, then what it never marked, latest registered first.
void Reducer::run_ready_order() {
  std::vector<int64_t> values;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<bool> seen(params_.size(), false);
    for (size_t i : ready_order_) {
      values.push_back(static_cast<int64_t>(i));
      seen[i] = true;
    }
    for (size_t i = params_.size(); i-- > 0;) {
      if (!seen[i]) values.push_back(static_cast<int64_t>(i));
    }
  }
  Tensor t = lane::to_device(lane::host_int64(values), group_->device());
  group_->broadcast(t, 0, false);
  std::vector<size_t> order;
  for (int64_t v : lane::read_int64(t)) {
    if (v < 0 || static_cast<size_t>(v) >= params_.size()) {
      fail_invalid("rank 0's ready order names parameter ", v, " but this rank manages ", params_.size());
    }
    order.push_back(static_cast<size_t>(v));
  }
  // A plan that changes gets a fresh region (the rebuild never re-lays the
  // old one): made here, where every rank runs this job, from what every
  // rank holds alike (the region's existence, the plan, rank 0's order).
  bool fresh_region = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (region_storage_ != nullptr) {
      std::vector<std::vector<size_t>> current;
      for (const Bucket& b : buckets_) current.push_back(b.params);
      fresh_region = plan_for(order) != current;
    }
  }
  std::shared_ptr<Storage> region;
  if (fresh_region) {
    std::string why;
    region = group_->create_region_storage(bucket_region_bytes(), &why);
    if (debug_ != lane::DebugLevel::kOff && !why.empty()) {
      std::fprintf(stderr, "[dparallel ddp rank %d] no shared region for the rebuilt buckets: %s\n", group_->rank(),
                   why.c_str());
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  rank0_order_ = std::move(order);
  next_region_ = std::move(region);
}

void Reducer::fail_job_locked(JobState& state, StatusCode code, const std::string& why) {
  state.start = state.end = Clock::now();
  state.code = code;
  state.error = why;
  state.done = true;
  cv_.notify_all();
}

void Reducer::drop_job(const lane::JobSpec& spec, StatusCode code, const std::string& why) {
  if (spec.shadow) return;  // the lane is stuck: the join fails with its reason
  std::lock_guard<std::mutex> lock(mutex_);
  if (spec.item == CallItem::kBucket && spec.index >= buckets_.size()) return;
  JobState& state = job_state(spec);
  if (!state.done) fail_job_locked(state, code, why);
}

// Orders the bucket's work after the host's streams at the marks, then
// copies the gradients in. Where the device queues work (GPUs) the library
// stream (copies, the saved local values) and the group's transfer stream
// wait on the device; where the library's work runs on this thread (cpu),
// this thread waits.
void Reducer::copy_into_bucket(size_t index) {
  std::vector<Event> events;
  std::vector<size_t> deferred;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(buckets_[index].events);
    deferred.swap(buckets_[index].deferred);
  }
  if (!skipping_stream_waits_for_tests()) {
    void* transfers = group_->transfer_stream();
    for (const Event& e : events) {
      const DeviceRuntime& runtime = device_runtime(e.device().type);
      if (!runtime.library_work_is_queued()) {
        e.synchronize();
        continue;
      }
      e.block(runtime.library_stream(e.device().index));
      if (transfers != nullptr && e.device() == group_->device()) e.block(transfers);
    }
  }
  std::vector<Tensor> slots, grads;
  for (size_t p : deferred) {
    slots.push_back(slot_of(p));
    grads.push_back(params_[p].parameter->grad());
  }
  comm::copy_pairs(slots, grads);
}

void Reducer::check_fingerprint(size_t index) {
  const Bucket& bucket = buckets_[index];
  const Device device = group_->device();
  const int32_t world = group_->size();
  std::vector<Tensor> all = lane::gather_outputs(world, DType::kInt64, 3, device);
  Tensor mine = lane::host_int64({static_cast<int64_t>(index), bucket.numel, static_cast<int64_t>(bucket.dtype)});
  group_->all_gather(lane::to_device(mine, device), all, false);
  std::vector<int64_t> first = lane::read_int64(all[0]);
  auto describe = [](const std::vector<int64_t>& f) {
    const char* dtype = f[2] >= 0 && f[2] <= static_cast<int64_t>(DType::kBool) ? dtype_name(static_cast<DType>(f[2]))
                                                                                : "unknown-dtype";
    return str_cat("bucket ", f[0], " (", f[1], " ", dtype, " elements)");
  };
  for (int32_t r = 1; r < world; ++r) {
    std::vector<int64_t> theirs = lane::read_int64(all[r]);
    if (theirs != first) {
      fail_invalid("DP_DEBUG=DETAIL: the ranks' graphs diverge: rank ", r, " reduces ", describe(theirs),
                   " where rank 0 reduces ", describe(first),
                   "; every rank must manage the same parameters and mark the same ones");
    }
  }
}

int64_t Reducer::divisor() const {
  const int32_t active = active_ranks_.load();
  if (options_.join_divide_by_initial_world_size || active <= 0 || active >= group_->size()) return group_->size();
  return active;
}

void Reducer::reduce_bucket(size_t index) {
  const Bucket& bucket = buckets_[index];
  if (bucket.numel == 0) return;  // only empty parameters: the same on every rank
  if (in_place_) return average_coalesced(bucket_grads(bucket));
  reduce_flat(index, bucket.flat);
}

void Reducer::average_coalesced(const std::vector<Tensor>& tensors) {
  const int64_t by = divisor();
  if (by == group_->size()) {
    group_->all_reduce_coalesced(tensors, ReduceOp::kAvg, false);
    return;
  }
  group_->all_reduce_coalesced(tensors, ReduceOp::kSum, false);
  for (const Tensor& t : tensors) lane::divide_tensor(t, by);
}

void Reducer::reduce_deferred(bool shadow) {
  // Before the rebuild the ready order's broadcast still follows, and
  // could fail the iteration.
  if (!shadow && !rebuilt_) {
    for (size_t b = 0; b < buckets_.size(); ++b) save_local(b);
  }
  if (!in_place_ || options_.on_bucket_reduced) {
    // One bucket at a time; its results go back and are reported before
    // the next one's reduction (on_bucket_reduced steps while they are in
    // cache).
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (shadow) {
        reduce_zeros(b);
        continue;
      }
      reduce_bucket(b);
      copy_back(b);
    }
    return;
  }
  std::vector<std::pair<DType, std::vector<Tensor>>> by_dtype;
  for (const Bucket& bucket : buckets_) {
    if (bucket.numel == 0) continue;  // only empty parameters: the same on every rank
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(), [&](const auto& d) { return d.first == bucket.dtype; });
    if (it == by_dtype.end()) it = by_dtype.insert(by_dtype.end(), {bucket.dtype, {}});
    if (shadow) {
      it->second.push_back(Tensor::zeros(bucket.dtype, {bucket.numel}, group_->device()));
    } else {
      for (const Tensor& g : bucket_grads(bucket)) it->second.push_back(g);
    }
  }
  for (const auto& [dtype, tensors] : by_dtype) average_coalesced(tensors);
}

void Reducer::reduce_zeros(size_t index) {
  const Bucket& bucket = buckets_[index];
  if (bucket.numel == 0) return;
  // The bucket as one tensor: the same collective as the others' coalesced call.
  Tensor zeros = Tensor::zeros(bucket.dtype, {bucket.numel}, group_->device());
  if (in_place_) return average_coalesced({zeros});
  reduce_flat(index, zeros);
}

void Reducer::reduce_flat(size_t index, const Tensor& flat) {
  if (options_.hook != HookKind::kCustom) return reduce_with_builtin_hook(options_.hook, *group_, flat, divisor());
  lane::RunningHookScope running(lane::RunningHook{this, index, "comm hook"});
  options_.custom_hook(index, flat);
}

void Reducer::run_shadow(const lane::JobSpec& spec) {
  switch (spec.item) {
    case CallItem::kBucket: {
      if (spec.index >= buckets_.size()) {
        fail(StatusCode::kState, "dp_ddp_join: another rank reduces bucket ", spec.index, " but this rank has ",
             buckets_.size(), " buckets");
      }
      if (debug_ == lane::DebugLevel::kDetail) check_fingerprint(spec.index);
      if (defers(spec.index)) return;
      if (defer_) return reduce_deferred(true);
      return reduce_zeros(spec.index);
    }
    case CallItem::kUsedMap:
      run_used_map();  // this rank used nothing since its last synced backward
      return;
    case CallItem::kReadyOrder: {
      run_ready_order();
      // The other ranks rebuild from it at their finish: the same plan here.
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<size_t> order = std::move(rank0_order_);
      rebuild(order, std::move(next_region_));
      return;
    }
    case CallItem::kBuffers:
      broadcast_state(buffers_);
      return;
    default:
      fail(StatusCode::kState, "dp_ddp_join: another rank runs ", dist::call_item_name(spec.item, 0),
           ", which a joined rank cannot stand in for (make every rank create its dp_ddp before any joins)");
  }
}

void Reducer::join(const std::vector<std::shared_ptr<Reducer>>& reducers) {
  if (reducers.empty()) return;
  std::shared_ptr<lane::CommLane> shared_lane = reducers.front()->lane_;
  for (const auto& r : reducers) {
    std::lock_guard<std::mutex> lock(r->mutex_);
    if (r->broken_) fail_broken();
    if (r->finishing_ || r->any_mark_) {
      fail(StatusCode::kState,
           "dp_ddp_join: a backward of a dp_ddp passed is in progress; join after its "
           "dp_ddp_finish_backward");
    }
    if (r->lane_ != shared_lane) fail_invalid("argument 'ddps': the dp_ddp are on different process groups");
  }
  shared_lane->join(std::vector<std::shared_ptr<lane::LaneOwner>>(reducers.begin(), reducers.end()),
                    reducers.front()->lane_bound());
  for (const auto& r : reducers) {
    r->on_lane(CallItem::kJoinSync, [&] { r->sync_after_join(); });
  }
}

void Reducer::sync_after_join() {
  uint32_t mine = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mine = iteration_;
  }
  const int32_t world = group_->size();
  const Device device = group_->device();
  std::vector<Tensor> all = lane::gather_outputs(world, DType::kInt64, 1, device);
  group_->all_gather(lane::to_device(lane::host_int64({static_cast<int64_t>(mine)}), device), all, false);
  int32_t root = 0;
  int64_t most = -1;
  for (int32_t r = 0; r < world; ++r) {
    int64_t n = lane::read_int64(all[static_cast<size_t>(r)]).at(0);
    if (n >= most) {
      most = n;
      root = r;
    }
  }
  broadcast_state(sync_state_, root);
  // static_graph may have been recorded while this rank stood in: every
  // rank takes the root's record, so their later iterations run alike.
  Tensor graph = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(params_.size() + 1)}, lane::kHostDevice);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto* bytes = static_cast<uint8_t*>(graph.data());
    bytes[0] = graph_recorded_ ? 1 : 0;
    for (size_t i = 0; i < static_used_.size() && i < params_.size(); ++i) bytes[i + 1] = static_used_[i];
  }
  Tensor on_device = lane::to_device(graph, device);
  group_->broadcast(on_device, root, false);
  Tensor back = lane::to_device(on_device, lane::kHostDevice);
  const auto* bytes = static_cast<const uint8_t*>(back.data());
  std::lock_guard<std::mutex> lock(mutex_);
  graph_recorded_ = bytes[0] != 0;
  static_used_.assign(bytes + 1, bytes + 1 + params_.size());
  if (!graph_recorded_) static_used_.clear();
  iteration_ = static_cast<uint32_t>(most);
  active_ranks_.store(0);
}

void Reducer::report_bucket(size_t index) {
  if (!options_.on_bucket_reduced) return;
  int rc = 0;
  {
    lane::RunningHookScope running(lane::RunningHook{this, index, "on_bucket_reduced callback"});
    rc = options_.on_bucket_reduced(index, buckets_[index].params);
  }
  if (rc == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (report_error_.empty()) {
    report_error_ =
        str_cat("on_bucket_reduced returned ", rc, " for bucket ", index, " (", describe_params(buckets_[index].params),
                "); the gradients of every bucket are averaged and final");
  }
}

void Reducer::wait_all_done(std::unique_lock<std::mutex>& lock) {
  // Each collective ends by the group's timeout; the margin covers the
  // failure reports. A job finishing restarts the bound.
  dist::BackgroundCalls::Awaited awaited;
  const auto bound = lane_bound();
  size_t done_before = 0;
  auto deadline = Clock::now() + bound;
  const JobState* tail[] = {&used_map_job_, &order_job_};
  for (;;) {
    size_t done = 0;
    size_t issued = 0;
    auto count = [&](const JobState& job) {
      issued += job.issued ? 1 : 0;
      done += job.issued && job.done ? 1 : 0;
    };
    for (const Bucket& bucket : buckets_) count(bucket.job);
    for (const JobState* job : tail) count(*job);
    if (done == issued) return;
    if (done != done_before) {
      done_before = done;
      deadline = Clock::now() + bound;
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
      broken_ = true;
      std::string why = str_cat(first_unfinished_locked(), " did not finish within ",
                                std::chrono::duration_cast<std::chrono::milliseconds>(bound).count(),
                                " ms (its comm hook or the device never returned, or a rank never issued it)");
      // The other reducers on the group fail now rather than at their own bound.
      lock.unlock();
      lane_->give_up(why);
      lock.lock();
      fail(StatusCode::kTimeout, why, "; the dp_ddp is unusable");
    }
  }
}

std::string Reducer::first_unfinished_locked() const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const JobState& job = buckets_[b].job;
    if (job.issued && !job.done) return str_cat("bucket ", b, " (", describe_params(buckets_[b].params), ")");
  }
  if (used_map_job_.issued && !used_map_job_.done) return dist::call_item_name(CallItem::kUsedMap, 0);
  return dist::call_item_name(CallItem::kReadyOrder, 0);
}

void Reducer::reset_iteration_locked() {
  std::fill(marked_.begin(), marked_.end(), 0);
  marked_count_ = 0;
  any_mark_ = false;
  next_issue_ = 0;
  tail_issued_ = false;
  used_map_job_ = JobState{};
  order_job_ = JobState{};
  used_result_.clear();
  rank0_order_.clear();
  next_region_.reset();
  premarked_.assign(params_.size(), 0);
  premarked_count_ = 0;
  premarked_views_.clear();
  used_flags_current_ = false;
  static_departure_.clear();
  memory_departure_.clear();
  report_error_.clear();
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.copied_back = false;
    b.reduced = false;
    b.job = JobState{};
    b.events.clear();
    b.deferred.clear();
  }
}

// ---- finish_backward ----

void Reducer::finish_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (broken_) fail_broken();
  if (finishing_) fail_finishing();
  finishing_ = true;
  // Cleared however this ends; the lock is held or retaken by then.
  struct ClearFinishing {
    std::unique_lock<std::mutex>& lock;
    bool& flag;
    lane::CommLane& comm_lane;
    const Reducer* owner;
    ~ClearFinishing() {
      if (!lock.owns_lock()) lock.lock();
      flag = false;
      comm_lane.set_in_backward(owner, false);
    }
  } clear_finishing{lock, finishing_, *lane_, this};
  const auto finish_start = Clock::now();
  if (!requires_sync_) {
    // No communication: the gradients stay as accumulated; the next synced
    // backward reduces them.
    std::fill(marked_.begin(), marked_.end(), 0);
    marked_count_ = 0;
    any_mark_ = false;
    lock.unlock();
    flush_trace();
    return;
  }
  if (!any_mark_) {
    premark_static_unused_locked();
    check_memory_apart_locked();
  }
  if (!memory_departure_.empty()) {
    const std::string departure = memory_departure_;  // the refusal resets the iteration
    refuse_rest_locked(lock, departure, departure);
  }
  std::vector<size_t> unmarked;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (marked_[i] == 0 && premarked_[i] == 0) unmarked.push_back(i);
  }
  if (graph_recorded_ && (!unmarked.empty() || !static_departure_.empty())) {
    refuse_static_departure_locked(lock, unmarked);
  }
  if (!unmarked.empty() && !options_.find_unused_parameters) refuse_unmarked_locked(lock, unmarked);
  std::map<size_t, Tensor> saved_views = fill_unused_locked(unmarked);
  saved_views.insert(premarked_views_.begin(), premarked_views_.end());
  issue_ready_buckets_locked();
  if (!tail_issued_) issue_tail_locked("");
  wait_all_done(lock);
  const auto reduced = Clock::now();

  std::string message;
  if (const JobState* failed = first_failure_locked(message)) {
    StatusCode code = failed->code;
    // Another rank's refusal for departing from the static graph.
    if (code == StatusCode::kInvalidArgument && message.find(kStaticDeparture) != std::string::npos) {
      code = StatusCode::kState;
    }
    restore_local_locked(saved_views);
    std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
    ready_order_.clear();
    reset_iteration_locked();
    ++iteration_;
    throw Error(code, message);
  }
  if (graph_recorded_) {
    used_result_ = static_used_;
    used_flags_ = static_used_;
  } else {
    used_flags_ = options_.find_unused_parameters ? used_result_ : std::vector<uint8_t>(params_.size(), 1);
  }
  std::vector<size_t> to_report;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!buckets_[b].copied_back) to_report.push_back(b);
  }
  copy_results_back_locked(saved_views);
  if (options_.static_graph && !graph_recorded_) {
    static_used_ = used_flags_;
    graph_recorded_ = true;
  }
  if (!to_report.empty() && options_.on_bucket_reduced) {
    // Final only now (the used map decided them); finishing_ keeps other calls out.
    lock.unlock();
    for (size_t b : to_report) report_bucket(b);
    lock.lock();
  }
  ReducerStats stats = measure_locked(finish_start);
  trace_iteration(finish_start, reduced);
  std::vector<size_t> rank0_order = std::move(rank0_order_);
  std::shared_ptr<Storage> next_region = std::move(next_region_);
  std::string report_error = std::move(report_error_);
  const bool rebuild_now = order_job_.issued;
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  ready_order_.clear();
  reset_iteration_locked();
  ++iteration_;
  if (rebuild_now) stats.buckets_rebuilt = rebuild(rank0_order, std::move(next_region));
  stats.num_buckets = buckets_.size();
  stats_ = stats;
  if (debug_ != lane::DebugLevel::kOff) {
    std::fprintf(stderr, "[dparallel ddp rank %d] backward %.3f ms, reductions %.3f ms, exposed %.3f ms\n",
                 group_->rank(), stats.backward_ms, stats.reduce_ms, stats.exposed_ms);
  }
  lock.unlock();
  flush_trace();
  if (!report_error.empty()) fail(StatusCode::kUser, report_error);
}

// Parameters left unmarked without find_unused_parameters: the jobs that
// cannot start are refused, so that the other ranks fail at once instead of
// waiting for them until the timeout; every gradient is left local.
void Reducer::refuse_unmarked_locked(std::unique_lock<std::mutex>& lock, const std::vector<size_t>& unmarked) {
  std::string names = describe_params(unmarked);
  std::string message = str_cat(
      unmarked.size(), " parameter(s) were not marked ready in this backward: ", names,
      ". Mark every managed parameter once per backward, or create the dp_ddp with find_unused_parameters = 1 if "
      "some parameters are unused in some iterations");
  std::string refusal = str_cat("rank ", group_->rank(), " did not mark parameter(s) ", names, " ready");
  refuse_rest_locked(lock, refusal, message);
}

void Reducer::refuse_static_departure_locked(std::unique_lock<std::mutex>& lock, const std::vector<size_t>& unmarked) {
  std::string departure = static_departure_;
  if (departure.empty()) {
    departure = str_cat("rank ", group_->rank(), " did not mark parameter(s) ", describe_params(unmarked), ", which ",
                        kStaticDeparture,
                        ": the first synced iteration recorded them as used; with static_graph every iteration must "
                        "use the same parameters");
  }
  refuse_rest_locked(lock, departure, departure);
}

// The buckets (and tail) not yet issued go out as refusals naming `refusal`,
// so that every rank's matching call fails at once; then every gradient is
// left local and this rank fails with `message`.
void Reducer::refuse_rest_locked(std::unique_lock<std::mutex>& lock, const std::string& refusal,
                                 const std::string& message) {
  for (size_t b = next_issue_; b < buckets_.size(); ++b) {
    lane::JobSpec spec;
    spec.index = b;
    spec.refusal = refusal;
    issue_locked(std::move(spec), buckets_[b].job);
  }
  next_issue_ = buckets_.size();
  if (!tail_issued_) issue_tail_locked(refusal);
  wait_all_done(lock);
  restore_local_locked(premarked_views_);
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  ready_order_.clear();
  reset_iteration_locked();
  ++iteration_;
  fail(StatusCode::kState, message);
}

void Reducer::check_memory_apart_locked() {
  const uint64_t assignments = Parameter::assignments();
  if (assignments == apart_at_) return;
  std::vector<MemorySpan> spans;
  spans.reserve(2 * params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].nbytes == 0) continue;
    const Tensor& value = params_[i].parameter->value();
    spans.push_back({value.device(), static_cast<const char*>(value.data()), params_[i].nbytes, i, false});
    Tensor grad = params_[i].parameter->grad_if_allocated();
    if (grad.defined()) spans.push_back({grad.device(), static_cast<const char*>(grad.data()), grad.nbytes(), i, true});
  }
  // Values alone were checked at create (tied weights are one parameter).
  const auto pair = first_overlap(spans, false);
  if (!pair) {
    apart_at_ = assignments;
    return;
  }
  auto what = [&](const MemorySpan& s) {
    return str_cat(s.grad ? "the gradient" : "the value", " of parameter '", params_[s.param].name, "'");
  };
  memory_departure_ = str_cat("rank ", group_->rank(), ": ", what(pair->first), " and ", what(pair->second),
                              " share memory (a gradient set with dp_module_set_grad); each managed parameter needs "
                              "a gradient of its own, apart from every other gradient and value");
}

void Reducer::premark_static_unused_locked() {
  if (!graph_recorded_) return;
  std::vector<size_t> unused;
  for (size_t p = 0; p < params_.size(); ++p) {
    if (static_used_[p] == 0 && premarked_[p] == 0) {
      unused.push_back(p);
      premarked_[p] = 1;
    }
  }
  if (unused.empty()) return;
  premarked_count_ += unused.size();
  premarked_views_ = fill_unused_locked(unused);
}

// find_unused_parameters: what this rank did not use goes in as zeros (or
// as what earlier unsynced backwards accumulated). Returns the unused views'
// own values, put back once the used map says no rank used them.
std::map<size_t, Tensor> Reducer::fill_unused_locked(const std::vector<size_t>& unmarked) {
  std::map<size_t, Tensor> saved_views;
  for (size_t i : unmarked) {
    Tensor slot = slot_of(i);
    if (used_since_sync_[i] != 0) {
      if (needs_copy(i)) copy_tensor(slot, params_[i].parameter->grad());
    } else {
      if (grad_is_view(i)) saved_views[i] = slot.to(slot.device());
      fill_zero(slot.data(), slot.device(), slot.nbytes());
    }
    --buckets_[params_[i].bucket].pending;
  }
  return saved_views;
}

const Reducer::JobState* Reducer::first_failure_locked(std::string& message) const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    if (bucket.job.code == StatusCode::kOk) continue;
    std::vector<size_t> not_ready;
    for (size_t p : bucket.params) {
      if (marked_[p] == 0) not_ready.push_back(p);
    }
    message = str_cat("the reduction of bucket ", b, " (", describe_params(bucket.params), ") failed; ",
                      not_ready.empty() ? std::string("this rank marked all of them ready")
                                        : "this rank has not seen ready: " + describe_params(not_ready),
                      ": ", bucket.job.error);
    return &bucket.job;
  }
  if (used_map_job_.code != StatusCode::kOk) {
    message = str_cat(dist::call_item_name(CallItem::kUsedMap, 0), " failed: ", used_map_job_.error);
    return &used_map_job_;
  }
  if (order_job_.code != StatusCode::kOk) {
    message = str_cat(dist::call_item_name(CallItem::kReadyOrder, 0), " failed: ", order_job_.error);
    return &order_job_;
  }
  return nullptr;
}

void Reducer::copy_results_back_locked(const std::map<size_t, Tensor>& saved_views) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool used = !options_.find_unused_parameters || used_result_.at(i) != 0;
    if (!used) {
      auto it = saved_views.find(i);
      if (it != saved_views.end()) copy_tensor(slot_of(i), it->second);
      continue;
    }
    if (!buckets_[params_[i].bucket].copied_back && needs_copy(i)) {
      copy_tensor(params_[i].parameter->grad(), slot_of(i));
    }
  }
}

ReducerStats Reducer::measure_locked(Clock::time_point finish_start) {
  ReducerStats stats;
  stats.backward_ms = ms_between(any_mark_ ? first_mark_ : finish_start, Clock::now());
  for (const Bucket& b : buckets_) {
    stats.reduce_ms += ms_between(b.job.start, b.job.end);
    auto exposed_from = std::max(b.job.start, finish_start);
    if (b.job.end > exposed_from) stats.exposed_ms += ms_between(exposed_from, b.job.end);
  }
  return stats;
}

// ---- the rest ----

void Reducer::set_requires_sync(bool requires_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finishing_) fail_finishing();
  if (any_mark_) {
    fail(StatusCode::kState,
         "a backward is in progress (parameters were marked ready); call it "
         "before the backward or after dp_ddp_finish_backward");
  }
  requires_sync_ = requires_sync;
}

size_t Reducer::num_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return buckets_.size();
}

std::vector<size_t> Reducer::bucket_parameters(size_t bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bucket >= buckets_.size()) {
    fail_invalid("argument 'bucket' is ", bucket, " but the dp_ddp has ", buckets_.size(), " buckets");
  }
  return buckets_[bucket].params;
}

ReducerStats Reducer::last_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ReducerStats stats = stats_;
  stats.num_buckets = buckets_.size();
  return stats;
}

}  // namespace dparallel::ddp
