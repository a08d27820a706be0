// The reducer at work: the forward, marks, and the jobs they issue on the lane.
#include "ddp/reducer.h"

#include "core/device_runtime.h"
#include "core/error.h"
#include "ddp/reducer_internal.h"

namespace dparallel::ddp {

using detail::fail_broken;
using detail::fail_finishing;
using detail::fail_retired;
using detail::kStaticDeparture;
using dist::CallItem;

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
    if (retired_) fail_retired();
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
  if (retired_) fail_retired();
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

// ---- the rest ----

void Reducer::set_requires_sync(bool requires_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (retired_) fail_retired();
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
