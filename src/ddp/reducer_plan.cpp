// The reducer's buckets: the plan, the bucket memory and gradient views,
// and the local copies a failed iteration restores.
#include <cstdio>
#include <cstring>

#include "comm/comm.h"
#include "core/error.h"
#include "ddp/bucket_plan.h"
#include "ddp/reducer.h"

namespace dparallel::ddp {

std::vector<std::vector<size_t>> Reducer::plan_for(const std::vector<size_t>& order) const {
  std::vector<PlanItem> items;
  items.reserve(params_.size());
  for (const Managed& m : params_) items.push_back(PlanItem{m.parameter->value().dtype(), m.nbytes});
  return compute_bucket_plan(items, order, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes);
}

std::vector<PlanParam> Reducer::plan_params() const {
  std::vector<PlanParam> out;
  out.reserve(params_.size());
  for (const Managed& m : params_) out.push_back(PlanParam{m.name, m.parameter->value().dtype()});
  return out;
}

std::string Reducer::plan_text() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<size_t>> plan;
  plan.reserve(buckets_.size());
  for (const Bucket& b : buckets_) plan.push_back(b.params);
  return format_plan(plan_params(), plan);
}

bool Reducer::parameter_used(size_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index >= params_.size()) {
    fail_invalid("argument 'param_index' is ", index, " but this dp_ddp manages ", params_.size(), " parameters");
  }
  if (used_flags_.empty()) fail(StatusCode::kState, "no synced iteration of this dp_ddp has reduced gradients yet");
  return used_flags_[index] != 0;
}

size_t Reducer::bucket_region_bytes() const {
  size_t bytes = kBucketAlign;
  for (const Managed& m : params_) bytes += align_bucket(m.nbytes) + kBucketAlign;
  return bytes;
}

void Reducer::build_buckets(const std::vector<std::vector<size_t>>& plan, const std::shared_ptr<Storage>& region) {
  std::vector<Bucket> buckets(plan.size());
  size_t region_used = 0;
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.params = plan[b];
    bucket.dtype = params_[plan[b].front()].parameter->value().dtype();
    int64_t numel = 0;
    for (size_t p : plan[b]) numel += params_[p].parameter->value().numel();
    bucket.numel = numel;
    if (!in_place_ && region != nullptr) {
      bucket.flat = Tensor::wrap(region, region_used, bucket.dtype, {numel});
      region_used += align_bucket(bucket.flat.nbytes());
    } else if (!in_place_) {
      bucket.flat = Tensor::zeros(bucket.dtype, {numel}, group_->device());
    }
    // Deferred reductions save only in the first iteration (save_local);
    // held results never.
    if (!defer_ && !hold_results_) bucket.local = Tensor::empty(bucket.dtype, {numel}, group_->device());
  }
  // Offsets are assigned only once every allocation succeeded.
  for (size_t b = 0; b < plan.size(); ++b) {
    size_t offset = 0;
    for (size_t p : plan[b]) {
      params_[p].bucket = b;
      params_[p].offset = offset;
      offset += params_[p].nbytes;
    }
  }
  if (region != nullptr) {
    for (Bucket& bucket : buckets) {
      if (bucket.flat.nbytes() > 0) std::memset(bucket.flat.data(), 0, bucket.flat.nbytes());
    }
  }
  if (options_.gradient_as_bucket_view) {
    // The gradients' storage moves into the buckets, keeping their values:
    // whatever gradient a parameter had, the host's own included. The old
    // memory is left as it is, to whoever still holds it.
    for (Managed& m : params_) {
      const Tensor& value = m.parameter->value();
      Tensor view = buckets[m.bucket].flat.view_at(m.offset, value.dtype(), value.shape());
      Tensor current = m.parameter->grad_if_allocated();
      if (current.defined()) copy_tensor(view, current);
      m.parameter->set_grad(view);
    }
  }
  buckets_ = std::move(buckets);
}

Tensor Reducer::slot_of(size_t index) const {
  const Managed& m = params_[index];
  const Tensor& value = m.parameter->value();
  return buckets_[m.bucket].flat.view_at(m.offset, value.dtype(), value.shape());
}

Tensor Reducer::local_slot(size_t index) const {
  const Managed& m = params_[index];
  const Tensor& value = m.parameter->value();
  return buckets_[m.bucket].local.view_at(m.offset, value.dtype(), value.shape());
}

bool Reducer::grad_is_view(size_t index) const {
  if (!options_.gradient_as_bucket_view) return false;
  const Managed& m = params_[index];
  Tensor grad = m.parameter->grad_if_allocated();
  return grad.defined() && grad.nbytes() == m.nbytes &&
         (m.nbytes == 0 || grad.data() == static_cast<const char*>(buckets_[m.bucket].flat.data()) + m.offset);
}

bool Reducer::needs_copy(size_t index) const { return !in_place_ && !grad_is_view(index); }

std::string Reducer::describe_params(const std::vector<size_t>& indices) const {
  // Messages stay readable (and small) for buckets of thousands of parameters.
  constexpr size_t kMaxListed = 32;
  std::string out;
  for (size_t k = 0; k < indices.size() && k < kMaxListed; ++k) {
    if (!out.empty()) out += ", ";
    out += str_cat("'", params_[indices[k]].name, "' (index ", indices[k], ")");
  }
  if (indices.size() > kMaxListed) out += str_cat(" and ", indices.size() - kMaxListed, " more");
  return out;
}

std::vector<Tensor> Reducer::bucket_grads(const Bucket& bucket) const {
  std::vector<Tensor> grads;
  grads.reserve(bucket.params.size());
  for (size_t p : bucket.params) grads.push_back(params_[p].parameter->grad());
  return grads;
}

void Reducer::save_local(size_t index) {
  Bucket& bucket = buckets_[index];
  if (bucket.numel == 0) return;
  if (!bucket.local.defined()) bucket.local = Tensor::empty(bucket.dtype, {bucket.numel}, group_->device());
  if (in_place_) {
    comm::flatten_into(bucket.local, bucket_grads(bucket));
  } else {
    copy_tensor(bucket.local, bucket.flat);
  }
  bucket.reduced = true;
}

void Reducer::restore_local_locked(const std::map<size_t, Tensor>& saved_views) {
  for (Bucket& bucket : buckets_) {
    if (!bucket.reduced) continue;
    bucket.reduced = false;
    if (in_place_) {
      comm::unflatten_into(bucket_grads(bucket), bucket.local);
      continue;
    }
    if (options_.gradient_as_bucket_view) copy_tensor(bucket.flat, bucket.local);  // restores the views
    if (!bucket.copied_back) continue;
    for (size_t p : bucket.params) {
      if (needs_copy(p)) copy_tensor(params_[p].parameter->grad(), local_slot(p));
    }
  }
  for (const auto& [index, values] : saved_views) copy_tensor(slot_of(index), values);
}

bool Reducer::rebuild(const std::vector<size_t>& rank0_order, std::shared_ptr<Storage> region) {
  std::vector<bool> seen(params_.size(), false);
  for (size_t i : rank0_order) {
    if (seen[i]) fail_invalid("rank 0's ready order lists parameter ", i, " twice");
    seen[i] = true;
  }
  if (rank0_order.size() != params_.size()) {
    fail_invalid("rank 0's ready order lists ", rank0_order.size(), " parameters but this rank manages ",
                 params_.size());
  }
  auto plan = plan_for(rank0_order);
  std::vector<std::vector<size_t>> current;
  for (const Bucket& b : buckets_) current.push_back(b.params);
  const bool changed = plan != current;
  if (changed) {
    // Never in place: the host may still hold the old buckets' memory (a
    // DLPack export of a gradient view) and must go on reading what it
    // held, not another parameter's gradient.
    if (region_storage_ != nullptr && region == nullptr && debug_ != lane::DebugLevel::kOff) {
      std::fprintf(stderr, "[dparallel ddp rank %d] rebuilt buckets in private memory: no shared region for them\n",
                   group_->rank());
    }
    build_buckets(plan, region);
    region_storage_ = std::move(region);
    reset_iteration_locked();
  }
  rebuilt_ = true;
  // From now on deferred reductions need no save (reduce_deferred).
  if (defer_) {
    for (Bucket& bucket : buckets_) bucket.local = Tensor();
  }
  log_plan(str_cat("buckets rebuilt in rank 0's ready order: ", buckets_.size(), " buckets"));
  return changed;
}

}  // namespace dparallel::ddp
