// finish_backward: waits for the iteration's jobs, puts in the parameters no
// rank marked, refuses an iteration that departs from what the ranks agreed,
// and resets for the next.
#include <algorithm>
#include <cstdio>
#include <map>

#include "core/error.h"
#include "core/thread_pool.h"
#include "ddp/reducer.h"
#include "ddp/reducer_internal.h"
#include "distributed/background_calls.h"
#include "distributed/reduce_ops.h"

namespace dparallel::ddp {

using detail::fail_broken;
using detail::fail_finishing;
using detail::kStaticDeparture;
using detail::ms_between;
using dist::CallItem;

namespace {

// dst = src / divisor on the host, in ranges across the compute pool as a
// copy would be.
void divide_into(const Tensor& dst, const Tensor& src, int64_t divisor) {
  constexpr size_t kGrain = 64 << 10;  // elements
  const size_t size = dst.element_size();
  auto* out = static_cast<char*>(dst.data());
  const auto* in = static_cast<const char*>(src.data());
  parallel_range(static_cast<size_t>(dst.numel()), kGrain, [&](size_t begin, size_t end) {
    dist::divide_into(dst.dtype(), out + begin * size, in + begin * size, end - begin, divisor);
  });
}

}  // namespace

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

void Reducer::finish_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (retired_) detail::fail_retired();
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
    const Bucket& bucket = buckets_[params_[i].bucket];
    if (bucket.copied_back || !needs_copy(i)) continue;
    if (hold_results_ && bucket.divide_by != 1) {
      divide_into(params_[i].parameter->grad(), slot_of(i), bucket.divide_by);
    } else {
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

}  // namespace dparallel::ddp
