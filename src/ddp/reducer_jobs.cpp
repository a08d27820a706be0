// The reducer's jobs on the lane: a bucket's reduction, the used map, the
// ready order, and what a job that fails or is dropped leaves behind.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "comm/comm.h"
#include "core/device_runtime.h"
#include "core/error.h"
#include "ddp/reducer.h"
#include "distributed/reduce_ops.h"
#include "lane/float_math.h"
#include "lane/host_values.h"

namespace dparallel::ddp {

using dist::CallItem;
using dist::ReduceOp;

lane::JobResult Reducer::run_job(const lane::JobSpec& spec) {
  return lane::timed_job([&](lane::JobResult& result) {
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
  });
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
  if (final_now && !hold_results_) copy_back(index);
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
  if (hold_results_) return false;  // the gradients are untouched until finish_backward
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
  if (hold_results_ && options_.hook == HookKind::kAllReduce) {
    // A joined rank's stand-in makes the same call (reduce_zeros).
    group_->all_reduce(flat, ReduceOp::kSum, false);
    buckets_[index].divide_by = divisor();
    return;
  }
  if (options_.hook != HookKind::kCustom) return reduce_with_builtin_hook(options_.hook, *group_, flat, divisor());
  lane::RunningHookScope running(lane::RunningHook{this, index, "comm hook"});
  options_.custom_hook(index, flat);
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

}  // namespace dparallel::ddp
