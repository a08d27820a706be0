#include "fsdp/fully_shard.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "comm/comm.h"
#include "core/device_runtime.h"
#include "core/error.h"
#include "ddp/agreement.h"
#include "ddp/comm_hooks.h"
#include "ddp/reducer.h"
#include "distributed/background_calls.h"
#include "module/memory_overlap.h"

namespace dparallel::fsdp {

namespace {

using dist::CallItem;

// Each parameter's rows start on a cache line of a segment.
constexpr size_t kSegmentAlign = 64;
size_t align_up(size_t n) { return (n + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign; }

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

bool is_16_bit(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

int64_t millis(FullyShard::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

// A flat view of `t`'s rows [start, start + count), each `row_numel` elements.
Tensor rows_of(const Tensor& t, int64_t start, int64_t count, int64_t row_numel) {
  return t.view_at(static_cast<size_t>(start * row_numel) * t.element_size(), t.dtype(), {count * row_numel});
}

// dst += src (src of any floating dtype).
void accumulate(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (src.dtype() == dst.dtype()) {
    comm::reduce_add_into(dst, {dst, src});
    return;
  }
  Tensor cast = Tensor::empty(dst.dtype(), dst.shape(), dst.device());
  ddp::cast_into(cast, src);
  comm::reduce_add_into(dst, {dst, cast});
}

std::string dtype_option(const std::optional<DType>& dtype) { return dtype ? dtype_name(*dtype) : "own"; }

}  // namespace

RowSplit split_rows(int64_t rows, int32_t world, int32_t rank) {
  RowSplit s;
  s.chunk = rows == 0 ? 0 : (rows + world - 1) / world;
  s.start = std::min(rows, s.chunk * rank);
  s.count = std::max<int64_t>(0, std::min(rows, s.start + s.chunk) - s.start);
  return s;
}

std::shared_ptr<FullyShard> FullyShard::create(std::shared_ptr<Module> module,
                                               std::shared_ptr<dist::ProcessGroup> group,
                                               const ShardingOptions& options) {
  std::shared_ptr<FullyShard> sharding(new FullyShard(std::move(module), std::move(group), options));
  sharding->init();
  return sharding;
}

FullyShard::FullyShard(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group,
                       ShardingOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {}

FullyShard::Clock::duration FullyShard::lane_bound() const { return group_->timeout() + std::chrono::seconds(3); }

void FullyShard::init() {
  // An argument error on one rank fails every rank's agreement check
  // (with init_sync) instead of leaving the others waiting.
  std::string local_error = collect();
  lane_ = ddp::CommLane::for_group(group_);
  lane_id_ = lane_->attach(this);
  try {
    if (options_.init_sync) {
      std::vector<std::string> description = describe_for_agreement(local_error);
      ddp::JobSpec spec;
      spec.item = CallItem::kFsdpCreate;
      lane_->call(
          this, spec,
          [&] {
            ddp::check_agreement(*group_, description);
            std::vector<Tensor> values;
            for (const Managed& m : params_) values.push_back(m.parameter->value());
            ddp::broadcast_tensors(*group_, values, 0);
          },
          lane_bound());
    }
    plan_layout();
    if (options_.init_sync && wants_shard_region()) {
      ddp::JobSpec spec;
      spec.item = CallItem::kFsdpCreate;
      lane_->call(
          this, spec, [&] { create_shard_region(); }, lane_bound());
    }
    shard_parameters();
  } catch (...) {
    lane_->detach(this, lane_bound());
    for (const Managed& m : params_) m.parameter->release_sharding(this);
    throw;
  }
}

std::string FullyShard::collect() {
  const Device device = group_->device();
  try {
    if (!options_.argument_error.empty()) fail_invalid(options_.argument_error);
    for (const NamedParameter& np : module_->named_parameters()) {
      // A parameter a child's dp_fsdp holds is the child's.
      if (!np.parameter || np.parameter->sharding()) continue;
      const std::string& name = *np.name;
      if (ddp::Reducer::is_managed(np.parameter.get())) {
        fail_invalid("parameter '", name,
                     "' is managed by a live dp_ddp; create every dp_fsdp before the dp_ddp over their parent, which "
                     "then leaves their parameters alone");
      }
      const Tensor& value = np.parameter->value();
      if (value.device() != device) {
        fail_invalid("parameter '", name, "' is ", value.describe(), " but the process group works on ",
                     to_string(device), "; move the module there first");
      }
      Managed m;
      m.name = name;
      m.parameter = np.parameter;
      m.dtype = value.dtype();
      m.full_shape = value.shape();
      m.sharded = value.ndim() > 0;
      m.reduced = np.parameter->requires_grad();
      if (!is_floating(m.dtype) && m.reduced) {
        fail_invalid("parameter '", name, "' is ", value.describe(),
                     "; gradients are reduced for floating-point parameters only (float32, float64, float16, "
                     "bfloat16): set requires_grad to 0 for it");
      }
      m.compute = is_floating(m.dtype) ? options_.param_dtype.value_or(m.dtype) : m.dtype;
      m.reduce = options_.reduce_dtype.value_or(m.compute);
      params_.push_back(std::move(m));
    }
    // Overlapping shards would be cut from memory two parameters share.
    std::vector<std::pair<std::string, const Parameter*>> values;
    values.reserve(params_.size());
    for (const Managed& m : params_) values.emplace_back(m.name, m.parameter.get());
    check_values_apart(values);
    auto self = shared_from_this();
    for (const Managed& m : params_) {
      if (!m.parameter->claim_sharding(self)) {
        fail_invalid("parameter '", m.name, "' was taken by another dp_fsdp created meanwhile");
      }
    }
  } catch (const Error& e) {
    for (const Managed& m : params_) m.parameter->release_sharding(this);
    if (e.code() != StatusCode::kInvalidArgument || !options_.init_sync) throw;
    params_.clear();
    return e.what();
  }
  return "";
}

std::vector<std::string> FullyShard::describe_for_agreement(const std::string& local_error) const {
  if (!local_error.empty()) return {"error " + local_error};
  std::vector<std::string> lines;
  lines.push_back(str_cat("options reshard_after_forward ", options_.reshard_after_forward, ", param_dtype ",
                          dtype_option(options_.param_dtype), ", reduce_dtype ", dtype_option(options_.reduce_dtype),
                          ", full_params_as_views ", options_.full_params_as_views));
  lines.push_back(str_cat(params_.size(), " managed parameters"));
  for (size_t i = 0; i < params_.size(); ++i) {
    const Managed& m = params_[i];
    lines.push_back(str_cat("managed parameter ", i, " is '", m.name, "' ", dtype_name(m.dtype), " ",
                            shape_string(m.full_shape), m.reduced ? "" : " (requires_grad 0)"));
  }
  return lines;
}

void FullyShard::plan_layout() {
  const int32_t world = group_->size();
  const int32_t rank = group_->rank();
  size_t segment = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Managed& m = params_[i];
    index_[m.parameter.get()] = i;
    if (!m.sharded) {
      m.split = RowSplit{1, 0, 1};
      continue;
    }
    m.row_numel = 1;
    for (size_t d = 1; d < m.full_shape.size(); ++d) m.row_numel *= m.full_shape[d];
    m.split = split_rows(m.full_shape[0], world, rank);
    const auto padded = static_cast<size_t>(m.split.chunk * m.row_numel);
    // The widest of the two layouts gather_shards makes (compute or own
    // dtype); each rank's padded rows are at most the parameter's own size.
    segment = align_up(segment + padded * std::max(dtype_size(m.compute), dtype_size(m.dtype)));
    if (!m.reduced) continue;
    m.reduce_offset = reduce_segment_[m.reduce];
    reduce_segment_[m.reduce] += padded;
  }
  if (segment > std::numeric_limits<size_t>::max() / static_cast<size_t>(world) ||
      segment * static_cast<size_t>(world) > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
    fail_invalid("argument 'module': the unsharded parameters of ", world, " ranks would take more than 2^63 bytes");
  }
}

std::vector<size_t> FullyShard::sharded_layout(const std::function<size_t(const Managed&)>& bytes_of,
                                               size_t* total) const {
  std::vector<size_t> offsets(params_.size(), 0);
  size_t at = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Managed& m = params_[i];
    if (!m.sharded) continue;
    offsets[i] = at;
    at = align_up(at + bytes_of(m));
  }
  *total = at;
  return offsets;
}

std::vector<size_t> FullyShard::segment_offsets(bool compute_dtype, size_t* segment) const {
  return sharded_layout(
      [&](const Managed& m) {
        return static_cast<size_t>(m.split.chunk * m.row_numel) * dtype_size(compute_dtype ? m.compute : m.dtype);
      },
      segment);
}

bool FullyShard::wants_shard_region() const {
  const bool any_sharded = std::any_of(params_.begin(), params_.end(), [](const Managed& m) { return m.sharded; });
  return any_sharded && group_->size() > 1 && group_->device().type == DeviceType::kCpu &&
         group_->capabilities().shared_regions;
}

bool FullyShard::wants_views() const {
  return options_.full_params_as_views && wants_shard_region() &&
         std::all_of(params_.begin(), params_.end(),
                     [](const Managed& m) { return !m.sharded || m.compute == m.dtype; });
}

namespace {

// DP_DEBUG=INFO or DETAIL: says why the shards stay in private memory.
void report_private_shards(int32_t rank, const std::string& why) {
  if (why.empty() || ddp::debug_level_from_env() == ddp::DebugLevel::kOff) return;
  std::fprintf(stderr, "[dparallel fsdp rank %d] shards in private memory: %s\n", rank, why.c_str());
}

}  // namespace

void FullyShard::create_shard_region() {
  std::string why;
  if (wants_views()) {
    size_t bytes = 0;
    std::vector<size_t> offsets = sharded_layout(
        [](const Managed& m) { return static_cast<size_t>(m.full_shape[0] * m.row_numel) * dtype_size(m.dtype); },
        &bytes);
    if (bytes == 0) return;
    const auto world = static_cast<size_t>(group_->size());
    // Out of memory, no views: the shards stay in private memory (every rank alike).
    shard_region_ = group_->create_region_storage((bytes + world - 1) / world, &why, true);
    report_private_shards(group_->rank(), why);
    views_ = shard_region_ != nullptr;
    if (views_) full_offsets_ = std::move(offsets);
    return;
  }
  size_t segment = 0;
  segment_offsets(false, &segment);
  if (segment == 0) return;
  // Out of memory, the shards stay in private memory; the all-gather stages them.
  shard_region_ = group_->create_region_storage(segment, &why);
  report_private_shards(group_->rank(), why);
}

void FullyShard::shard_parameters() {
  const Device device = group_->device();
  size_t region_bytes = 0;
  const std::vector<size_t> region_offsets = segment_offsets(false, &region_bytes);
  for (const auto& [dtype, segment] : reduce_segment_) {
    const bool same_dtype = std::all_of(params_.begin(), params_.end(), [&, dtype = dtype](const Managed& m) {
      return !(m.sharded && m.reduced && m.reduce == dtype) || m.dtype == dtype;
    });
    if (same_dtype) shard_grad_segment_[dtype] = Tensor::zeros(dtype, {static_cast<int64_t>(segment)}, device);
  }
  for (Managed& m : params_) {
    const Tensor full = m.parameter->value();
    Shape shape = m.full_shape;
    if (m.sharded) shape[0] = m.split.count;
    // Its own memory: the full parameter's goes back to the allocator. An
    // empty shard is never wrapped in the region, where it could share its
    // identity with another empty shard (tied parameters).
    const auto i = static_cast<size_t>(&m - params_.data());
    const bool in_region = shard_region_ != nullptr && m.sharded && m.split.count > 0;
    if (in_region && views_) {
      const size_t rows_before = static_cast<size_t>(m.split.start * m.row_numel) * dtype_size(m.dtype);
      m.shard = Tensor::wrap(shard_region_, full_offsets_[i] + rows_before, m.dtype, shape);
    } else if (in_region) {
      m.shard = Tensor::wrap(shard_region_, region_offsets[i], m.dtype, shape);
    } else {
      m.shard = Tensor::empty(m.dtype, shape, device);
    }
    if (!m.sharded) {
      copy_tensor(m.shard, full);
    } else if (m.split.count > 0) {
      copy_tensor(m.shard, full.narrow_rows(m.split.start, m.split.count));
    }
    auto segment = shard_grad_segment_.find(m.reduce);
    if (m.sharded && m.reduced && segment != shard_grad_segment_.end()) {
      m.shard_grad = segment->second.view_at(m.reduce_offset * dtype_size(m.dtype), m.dtype, shape);
    } else {
      m.shard_grad = Tensor::zeros(m.dtype, shape, device);
    }
    m.parameter->set_grad(Tensor());
    m.parameter->set_value(m.shard);
  }
}

FullyShard::~FullyShard() {
  if (closed_) return;
  // Not through close(): a destructor makes no collective.
  if (lane_) lane_->detach(this, lane_bound());
  settle_queued_work();
  for (const Managed& m : params_) m.parameter->release_sharding(this);
}

void FullyShard::close() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) return;
  std::exception_ptr error;
  std::vector<Tensor> full;
  try {
    // Whatever is in flight ends first (its error, if any, is the close's).
    if (state_ == State::kUnsharding) {
      try {
        wait_locked(lock, unshard_job_, "the unshard");
        install_full_locked();
      } catch (...) {
        state_ = State::kResharded;
        gathered_.clear();
        throw;
      }
    }
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    error = std::current_exception();
  }
  // The post-backward job ends first even when the unshard failed (unless a
  // wait already gave up on the lane).
  try {
    if (post_job_.issued && !broken_) wait_locked(lock, post_job_, "the post-backward reduce_scatter");
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  // A job that failed (a peer's refusal, say) leaves the lane and the group
  // usable: the other ranks' destroy gathers, so this one does too.
  try {
    if (!broken_ && !params_.empty()) {
      lock.unlock();
      ddp::JobSpec spec;
      spec.item = CallItem::kGatherValues;
      spec.iteration = iteration_;
      lane_->call(
          this, spec, [&] { full = gather_shards(false); }, lane_bound());
      lock.lock();
    }
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    if (!error) error = std::current_exception();
  }
  closed_ = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    Managed& m = params_[i];
    m.parameter->set_grad(Tensor());
    m.parameter->set_value(full.empty() ? m.shard : full[i]);
  }
  state_ = State::kResharded;
  lock.unlock();
  lane_->detach(this, lane_bound());
  settle_queued_work();
  for (const Managed& m : params_) m.parameter->release_sharding(this);
  if (error) std::rethrow_exception(error);
}

void FullyShard::settle_queued_work() noexcept {
  std::optional<Event> unshard, post;
  std::vector<Tensor> gathered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unshard = std::exchange(unshard_done_, std::nullopt);
    post = std::exchange(post_done_, std::nullopt);
    gathered = std::move(gathered_);
    gathered_.clear();
  }
  // A job that ended after its waiter gave up may still write memory the
  // shards' owners free next, and the full parameters it gathered (freed
  // below, once it is done); the watch's abort bounds these waits.
  for (std::optional<Event>* done : {&unshard, &post}) {
    if (!*done) continue;
    try {
      (*done)->synchronize();
    } catch (...) {
    }
  }
}

const std::string& FullyShard::parameter_name(size_t index) const {
  if (index >= params_.size()) {
    fail_invalid("argument 'index' is ", index, " but the dp_fsdp manages ", params_.size(), " parameters");
  }
  return params_[index].name;
}

Tensor FullyShard::shard(size_t index) const {
  parameter_name(index);
  return params_[index].shard;
}

Tensor FullyShard::shard_grad(size_t index) const {
  parameter_name(index);
  return params_[index].shard_grad;
}

bool FullyShard::resharded() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::kResharded;
}

size_t FullyShard::index_of(const Parameter* parameter) const {
  auto it = index_.find(parameter);
  return it == index_.end() ? npos : it->second;
}

RowSplit FullyShard::split_of(size_t index, int32_t rank) const {
  const Managed& m = params_.at(index);
  return m.sharded ? split_rows(m.full_shape[0], group_->size(), rank) : RowSplit{1, 0, 1};
}

// ---- the host's calls ----

void FullyShard::check_usable_locked() const {
  if (closed_) fail(StatusCode::kState, "the dp_fsdp is destroyed");
  if (lane_->on_worker()) {
    fail(StatusCode::kState, "called on the process group's comm lane (from a comm hook), which it would wait for");
  }
  if (broken_) fail(StatusCode::kState, broken_why_, "; the dp_fsdp is unusable");
}

void FullyShard::issue_locked(ddp::JobSpec spec, Pending& pending) {
  pending = Pending{};
  pending.issued = true;
  spec.iteration = iteration_;
  if (!lane_->push(shared_from_this(), std::move(spec))) {
    pending.done = true;
    pending.code = lane_->stuck_code();
    pending.error = lane_->stuck_reason();
  }
}

void FullyShard::wait_locked(std::unique_lock<std::mutex>& lock, Pending& pending, const char* what) {
  dist::BackgroundCalls::Awaited awaited;
  const auto bound = lane_bound();
  if (!cv_.wait_for(lock, bound, [&] { return pending.done; })) {
    broken_ = true;
    lock.unlock();
    const std::string missing = lane_->ranks_missing_next_job(this);
    std::string why =
        str_cat(what, " of dp_fsdp #", lane_id_, " did not finish within ", millis(bound), " ms",
                missing.empty() ? std::string(" (a rank never issued it, or a job before it hung)")
                                : str_cat(": rank ", missing, " had not issued it (did ",
                                          missing.find(',') == std::string::npos ? "it" : "they", " skip this call?)"));
    lane_->give_up(why);
    lock.lock();
    broken_why_ = why;
    fail(StatusCode::kTimeout, why, "; the dp_fsdp is unusable");
  }
  Pending ended = pending;
  pending = Pending{};
  // Failed or not, the host's stream follows what the job queued: a failed
  // job may have queued writes to the shard gradients.
  const bool waited_on_host = follow_job_locked(lock, &pending == &unshard_job_ ? unshard_done_ : post_done_);
  if (ended.code != StatusCode::kOk)
    throw Error(ended.code, str_cat(what, " of dp_fsdp #", lane_id_, ": ", ended.error));
  // Waited for on the host: a queued collective that failed meanwhile is
  // this call's failure (with a stream, the next call reports it).
  if (waited_on_host) {
    const std::string broken = group_->broken_reason();
    if (!broken.empty()) fail(StatusCode::kState, what, " of dp_fsdp #", lane_id_, ": ", broken);
  }
}

bool FullyShard::follow_job_locked(std::unique_lock<std::mutex>& lock, std::optional<Event>& done) {
  if (!done) return false;
  Event end = std::move(*done);
  done.reset();
  // The host's stream as StreamOrder::finish would order it: the job's
  // results (and its frees of what the host drops next) come after it.
  if (void* stream = current_stream(end.device())) {
    end.block(stream);
    return false;
  }
  lock.unlock();  // the lane takes mutex_ meanwhile
  try {
    end.synchronize();
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return true;
}

void FullyShard::install_full_locked() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].parameter->set_value(gathered_[i]);
  gathered_.clear();
  state_ = State::kUnsharded;
}

void FullyShard::reshard_locked() {
  for (const Managed& m : params_) m.parameter->set_value(m.shard);
  state_ = State::kResharded;
}

void FullyShard::unshard(bool async, std::vector<Event> host_ready) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (state_ == State::kResharded) {
    ddp::JobSpec spec;
    spec.item = CallItem::kUnshard;
    unshard_ready_ = std::move(host_ready);
    if (!params_.empty()) issue_locked(spec, unshard_job_);
    state_ = State::kUnsharding;
    unsharded_since_post_ = true;
  }
  if (!async) finish_unshard_locked(lock);
}

void FullyShard::finish_unshard_locked(std::unique_lock<std::mutex>& lock) {
  if (state_ != State::kUnsharding) return;
  try {
    if (!params_.empty()) wait_locked(lock, unshard_job_, "the unshard");
  } catch (...) {
    state_ = State::kResharded;
    gathered_.clear();
    throw;
  }
  install_full_locked();
}

void FullyShard::wait_unshard() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (state_ == State::kResharded) {
    fail(StatusCode::kState,
         "no unshard is in flight and the slots hold this rank's shards: call dp_fsdp_unshard first");
  }
  finish_unshard_locked(lock);
}

void FullyShard::reshard() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  // ZeRO-2: the parameters stay unsharded from the forward to post_backward.
  if (!options_.reshard_after_forward && unsharded_since_post_) {
    finish_unshard_locked(lock);
    return;
  }
  finish_unshard_locked(lock);
  if (state_ == State::kUnsharded) reshard_locked();
}

void FullyShard::post_backward(std::vector<Event> host_ready) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (!unsharded_since_post_) {
    fail(StatusCode::kState, "dp_fsdp #", lane_id_,
         " was not unsharded since its last post_backward, so no full gradient can have been computed: call "
         "dp_fsdp_unshard before the module's forward and backward");
  }
  // The last reduce_scatter's shard gradients are final before this one adds
  // to them. Its failure (a peer's refusal, say), not yet reported by a
  // finish_backward, fails this call, in its job's place: the other ranks
  // issue theirs.
  std::string previous;
  if (post_job_.issued) {
    try {
      wait_locked(lock, post_job_, "the post-backward reduce_scatter");
    } catch (const Error& e) {
      if (broken_) throw;
      previous = str_cat("the previous post_backward failed, and no dp_fsdp_finish_backward reported it: ", e.what());
    }
  }
  finish_unshard_locked(lock);
  std::vector<Tensor> grads(params_.size());
  std::string refusal;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Managed& m = params_[i];
    if (!m.reduced) continue;
    grads[i] = m.parameter->grad_if_allocated();
    if (grads[i].defined() && (grads[i].shape() != m.full_shape || grads[i].dtype() != m.compute)) {
      if (refusal.empty()) {
        refusal = str_cat("parameter '", m.name, "' has the gradient ", grads[i].describe(),
                          " but its full gradient is ", dtype_name(m.compute), " ", shape_string(m.full_shape),
                          ": set a gradient while the parameter is unsharded");
      }
      // Never reduced nor kept: the next backward starts it afresh.
      m.parameter->set_grad(Tensor());
      grads[i] = Tensor();
    }
  }
  if (!refusal.empty()) refusal += " (the gradient was dropped)";
  if (refusal.empty()) refusal = previous;
  // Refused or not, the call reshards as on every rank, so that the ranks'
  // next unshards still pair.
  unsharded_since_post_ = false;
  reshard_locked();
  // Without sync the full gradients stay and the next backward adds to them.
  if (!requires_sync_ || params_.empty() || (!refusal.empty() && !post_backward_communicates())) {
    // No collective for anyone to pair a refusal with.
    if (!refusal.empty()) fail_invalid(refusal);
    return;
  }
  for (const Managed& m : params_) {
    if (m.reduced) m.parameter->set_grad(Tensor());
  }
  post_ready_ = std::move(host_ready);
  ddp::JobSpec spec;
  spec.item = CallItem::kPostBackward;
  if (refusal.empty()) {
    post_grads_ = std::move(grads);
  } else {
    // In the reduce-scatter's place: the other ranks' post_backward fails
    // naming this rank, and every rank stays in step.
    spec.refusal = refusal;
  }
  issue_locked(spec, post_job_);
  ++iteration_;
  if (!refusal.empty()) {
    wait_locked(lock, post_job_, "the post-backward reduce_scatter");
    fail(StatusCode::kInternal, "dp_fsdp #", lane_id_, ": a refused post_backward passed");
  }
}

void FullyShard::finish_backward() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (post_job_.issued) wait_locked(lock, post_job_, "the post-backward reduce_scatter");
}

void FullyShard::set_requires_gradient_sync(bool requires_sync) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable_locked();
  requires_sync_ = requires_sync;
}

std::vector<Tensor> FullyShard::gather_full_values() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  finish_unshard_locked(lock);
  if (params_.empty()) return {};
  lock.unlock();
  std::vector<Tensor> full;
  ddp::JobSpec spec;
  spec.item = CallItem::kGatherValues;
  spec.iteration = iteration_;
  lane_->call(
      this, spec, [&] { full = gather_shards(false); }, lane_bound());
  return full;
}

void FullyShard::refuse_gather(const std::string& reason) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  finish_unshard_locked(lock);
  // As gather_full_values: a job (the lane numbers them) when there is a
  // parameter, and a collective in it as gather_shards makes one.
  if (params_.empty()) return;
  size_t segment = 0;
  segment_offsets(false, &segment);
  const bool communicates = views_ || (segment > 0 && group_->size() > 1);
  ddp::JobSpec spec;
  spec.item = CallItem::kGatherValues;
  spec.iteration = iteration_;
  lock.unlock();
  lane_->call(
      this, spec,
      [&] {
        if (communicates) group_->refuse(dist::CallKind::kAllGather, reason, false);
      },
      lane_bound());
  if (communicates) fail(StatusCode::kInternal, "dp_fsdp #", lane_id_, ": a refused gather passed");
}

void FullyShard::call_on_lane(CallItem item, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> host(host_mutex_);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable_locked();
  }
  ddp::JobSpec spec;
  spec.item = item;
  spec.iteration = iteration_;
  lane_->call(this, spec, fn, lane_bound());
}

void FullyShard::load_shard_from_full(size_t index, const Tensor& full) {
  const Managed& m = params_.at(index);
  if (!m.sharded) {
    ddp::cast_into(m.shard, full);
    return;
  }
  if (m.split.count == 0) return;
  ddp::cast_into(m.shard.view({m.split.count * m.row_numel}), rows_of(full, m.split.start, m.split.count, m.row_numel));
}

// ---- on the lane ----

ddp::JobResult FullyShard::run_job(const ddp::JobSpec& spec) {
  ddp::JobResult result;
  result.start = Clock::now();
  try {
    // On NCCL the job's work all goes on the group's stream, after the
    // host's stream as it was at the call, and the job returns once it is
    // queued; an end event recorded however the job ends (its own frees
    // follow that stream already) is what the host follows
    // (follow_job_locked).
    if (!spec.refusal.empty()) {
      // Stands in for the job's first collective: the verdict names this rank.
      group_->refuse(spec.item == CallItem::kUnshard ? dist::CallKind::kAllGather : dist::CallKind::kReduceScatter,
                     spec.refusal, false);
    }
    const Device device = group_->device();
    dist::QueuedTransfers queued(device, group_->transfer_stream());
    const bool unshard = spec.item == CallItem::kUnshard;
    std::vector<Event> host_ready;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      host_ready = std::move(unshard ? unshard_ready_ : post_ready_);
    }
    library_streams_wait(host_ready);
    struct KeepEndEvent {
      FullyShard& self;
      const Device& device;
      std::optional<Event>& slot;
      ~KeepEndEvent() {
        if (!dist::QueuedTransfers::active()) return;
        std::optional<Event> done;
        try {
          done.emplace(device);
          done->record(device_runtime(device.type).library_stream(device.index));
        } catch (const std::exception&) {
          done.reset();  // the device failed: nothing left to follow
        }
        std::lock_guard<std::mutex> lock(self.mutex_);
        slot = std::move(done);
      }
    } keep{*this, device, unshard ? unshard_done_ : post_done_};
    if (unshard) {
      std::vector<Tensor> full = gather_shards(true);
      std::lock_guard<std::mutex> lock(mutex_);
      gathered_ = std::move(full);
    } else if (spec.item == CallItem::kPostBackward) {
      run_post_backward();
    } else {
      fail(StatusCode::kInternal, "a dp_fsdp job of ", dist::call_item_name(spec.item, 0));
    }
  } catch (const Error& e) {
    result.code = e.code();
    result.error = e.what();
  } catch (const std::exception& e) {
    result.code = StatusCode::kInternal;
    result.error = e.what();
  }
  result.end = Clock::now();
  return result;
}

void FullyShard::complete_job(const ddp::JobSpec& spec, ddp::JobResult result) {
  std::lock_guard<std::mutex> lock(mutex_);
  Pending& pending = spec.item == CallItem::kUnshard ? unshard_job_ : post_job_;
  pending.done = true;
  pending.code = result.code;
  pending.error = std::move(result.error);
  cv_.notify_all();
}

void FullyShard::drop_job(const ddp::JobSpec& spec, StatusCode code, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  Pending& pending = spec.item == CallItem::kUnshard ? unshard_job_ : post_job_;
  pending.done = true;
  pending.code = code;
  pending.error = why;
  cv_.notify_all();
}

std::vector<Tensor> FullyShard::full_from_views(bool as_views) {
  group_->barrier(false);
  const Device device = group_->device();
  std::vector<Tensor> full(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Managed& m = params_[i];
    const Tensor held = m.sharded ? Tensor::wrap(shard_region_, full_offsets_[i], m.dtype, m.full_shape) : m.shard;
    if (m.sharded && as_views) {
      full[i] = held;
      continue;
    }
    full[i] = Tensor::empty(as_views ? m.compute : m.dtype, m.full_shape, device);
    ddp::cast_into(full[i], held);
  }
  if (!as_views) group_->barrier(false);
  return full;
}

std::vector<Tensor> FullyShard::gather_shards(bool compute_dtype) {
  if (views_) return full_from_views(compute_dtype);
  const int32_t world = group_->size();
  const Device device = group_->device();
  auto dtype_of = [&](const Managed& m) { return compute_dtype ? m.compute : m.dtype; };
  size_t segment = 0;
  const std::vector<size_t> offsets = segment_offsets(compute_dtype, &segment);
  // Each rank's rows go straight into the full tensors: this rank's cast
  // from its shard, the others' from the all-gather (its runs name where
  // each rank's rows of each parameter land). The padding is never read.
  const int32_t rank = group_->rank();
  std::vector<Tensor> full(params_.size());
  std::vector<dist::SegmentRun> sources;
  std::vector<std::vector<dist::SegmentRun>> places(static_cast<size_t>(world));
  auto bytes_of = [](const Tensor& t) { return t.view_at(0, DType::kUInt8, {static_cast<int64_t>(t.nbytes())}); };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Managed& m = params_[i];
    full[i] = Tensor::empty(dtype_of(m), m.full_shape, device);
    if (!m.sharded) {
      ddp::cast_into(full[i], m.shard);
      continue;
    }
    for (int32_t r = 0; r < world; ++r) {
      const RowSplit s = split_rows(m.full_shape[0], world, r);
      if (s.count == 0) continue;
      const Tensor rows = rows_of(full[i], s.start, s.count, m.row_numel);
      if (r == rank) {
        const Tensor shard = m.shard.view({s.count * m.row_numel});
        ddp::cast_into(rows, shard);
        // Sent from the shard itself where no cast is needed: in a region,
        // the other ranks read it there.
        sources.push_back(dist::SegmentRun{offsets[i], bytes_of(dtype_of(m) == m.dtype ? shard : rows)});
      } else {
        places[static_cast<size_t>(r)].push_back(dist::SegmentRun{offsets[i], bytes_of(rows)});
      }
    }
  }
  if (segment > 0 && world > 1) group_->all_gather_runs(segment, std::move(sources), std::move(places), false);
  return full;
}

bool FullyShard::reduces() const {
  return std::any_of(params_.begin(), params_.end(), [](const Managed& m) { return !m.sharded && m.reduced; }) ||
         std::any_of(reduce_segment_.begin(), reduce_segment_.end(),
                     [](const auto& entry) { return entry.second > 0; });
}

void FullyShard::run_post_backward() {
  std::vector<Tensor> grads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    grads = std::move(post_grads_);
    post_grads_.clear();
  }
  const int32_t world = group_->size();
  const Device device = group_->device();
  // The job's reference to a full gradient goes once its reads are queued.
  // The host may hold another and free it later on its own stream: on a
  // device that queues, that free must also wait for the reads queued here.
  auto drop_grad = [&](Tensor& grad) {
    if (grad.defined() && dist::QueuedTransfers::active()) {
      auto used = std::make_shared<Event>(device);
      used->record(device_runtime(device.type).library_stream(device.index));
      grad.storage()->record_use(std::move(used));
    }
    grad = Tensor();
  };
  // Sharded parameters: one reduce_scatter per reduce dtype.
  for (const auto& entry : reduce_segment_) {
    const DType dtype = entry.first;  // a variable, not a binding: lambdas below capture it
    const size_t segment = entry.second;
    if (segment == 0) continue;
    const size_t esize = dtype_size(dtype);
    const auto seg = static_cast<int64_t>(segment);
    auto member = [&](const Managed& m) { return m.sharded && m.reduced && m.reduce == dtype; };
    // Straight from the full gradients when they are in the reduce dtype
    // (no cast) and need no division first (not 16-bit): each rank's part
    // is made of its rows of each gradient; padding and gradients never
    // taken count as zeros.
    bool direct = !is_16_bit(dtype);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (member(params_[i]) && grads[i].defined() && grads[i].dtype() != dtype) direct = false;
    }
    Tensor output;
    if (direct) {
      std::vector<std::vector<dist::SegmentRun>> parts(static_cast<size_t>(world));
      for (int32_t r = 0; r < world; ++r) {
        for (size_t i = 0; i < params_.size(); ++i) {
          const Managed& m = params_[i];
          if (!member(m) || !grads[i].defined()) continue;
          const RowSplit s = split_rows(m.full_shape[0], world, r);
          if (s.count == 0) continue;
          parts[static_cast<size_t>(r)].push_back(
              dist::SegmentRun{m.reduce_offset * esize, rows_of(grads[i], s.start, s.count, m.row_numel)});
        }
      }
      auto grads_segment = shard_grad_segment_.find(dtype);
      if (grads_segment != shard_grad_segment_.end()) {
        // Added straight into the shard gradients: no result to add below.
        group_->reduce_scatter_runs(std::move(parts), grads_segment->second, dist::ReduceOp::kAvg, false, true);
      } else {
        output = Tensor::empty(dtype, {seg}, device);
        group_->reduce_scatter_runs(std::move(parts), output, dist::ReduceOp::kAvg, false);
      }
    } else {
      // Rank r's segment holds its rows of each parameter, padded to the
      // chunk; the padding and the gradients never taken are zeros.
      Tensor input = Tensor::empty(dtype, {seg * world}, device);
      auto* bytes = static_cast<uint8_t*>(input.data());
      for (int32_t r = 0; r < world; ++r) {
        size_t written = static_cast<size_t>(r) * segment;  // elements
        for (size_t i = 0; i < params_.size(); ++i) {
          const Managed& m = params_[i];
          if (!m.sharded || !m.reduced || m.reduce != dtype) continue;
          const size_t at = static_cast<size_t>(r) * segment + m.reduce_offset;
          const RowSplit s = split_rows(m.full_shape[0], world, r);
          if (at > written) fill_zero(bytes + written * esize, device, (at - written) * esize);
          written = at;
          if (s.count == 0) continue;
          const int64_t n = s.count * m.row_numel;
          if (grads[i].defined()) {
            ddp::cast_into(input.view_at(at * esize, dtype, {n}), rows_of(grads[i], s.start, s.count, m.row_numel));
          } else {
            fill_zero(bytes + at * esize, device, static_cast<size_t>(n) * esize);
          }
          written = at + static_cast<size_t>(n);
        }
        const size_t end = static_cast<size_t>(r + 1) * segment;
        if (end > written) fill_zero(bytes + written * esize, device, (end - written) * esize);
      }
      // Copied in: the full gradients' memory can go now.
      for (size_t i = 0; i < params_.size(); ++i) {
        if (member(params_[i])) drop_grad(grads[i]);
      }
      std::vector<Tensor> inputs;
      inputs.reserve(static_cast<size_t>(world));
      for (int32_t r = 0; r < world; ++r) {
        inputs.push_back(input.view_at(static_cast<size_t>(r) * segment * esize, dtype, {seg}));
      }
      // In place: the result lands in this rank's own segment.
      output = inputs[static_cast<size_t>(group_->rank())];
      if (is_16_bit(dtype)) {
        // As the 16-bit comm hooks: divide first, so that the sum cannot overflow.
        ddp::divide_tensor(input, world);
        group_->reduce_scatter(inputs, output, dist::ReduceOp::kSum, false);
      } else {
        group_->reduce_scatter(inputs, output, dist::ReduceOp::kAvg, false);
      }
    }
    for (const Managed& m : params_) {
      if (!output.defined() || !member(m) || m.split.count == 0) continue;
      const int64_t n = m.split.count * m.row_numel;
      accumulate(m.shard_grad.view({n}), output.view_at(m.reduce_offset * esize, dtype, {n}));
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (member(params_[i])) drop_grad(grads[i]);
    }
  }
  // 0-d parameters: every rank holds them whole, so their gradients are all-reduced.
  std::map<DType, std::vector<size_t>> whole;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].sharded && params_[i].reduced) whole[params_[i].reduce].push_back(i);
  }
  // With views, finish_backward promises that every rank has reached its
  // post_backward (its shards may be written then): with nothing to reduce,
  // a barrier says so.
  if (views_ && !reduces()) group_->barrier(false);
  for (const auto& [dtype, members] : whole) {
    std::vector<Tensor> values;
    for (size_t i : members) {
      Tensor v = Tensor::zeros(dtype, params_[i].full_shape, device);
      if (grads[i].defined()) ddp::cast_into(v, grads[i]);
      if (is_16_bit(dtype)) ddp::divide_tensor(v, world);
      values.push_back(v);
    }
    for (size_t i : members) drop_grad(grads[i]);
    group_->all_reduce_coalesced(values, is_16_bit(dtype) ? dist::ReduceOp::kSum : dist::ReduceOp::kAvg, false);
    for (size_t k = 0; k < members.size(); ++k) accumulate(params_[members[k]].shard_grad, values[k]);
  }
  for (Tensor& grad : grads) drop_grad(grad);
}

// ---- ParameterSharding ----

std::string FullyShard::grad_refusal(const Parameter& parameter) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kUnsharded || closed_) return "";
  const size_t index = index_of(&parameter);
  if (index == npos) return "";
  const Managed& m = params_[index];
  std::string held = m.sharded ? str_cat("rows [", m.split.start, ", ", m.split.start + m.split.count, ") of ",
                                         shape_string(m.full_shape))
                               : std::string("a copy of the 0-d parameter");
  return str_cat("parameter '", m.name, "' is sharded by dp_fsdp #", lane_id_, " and its slot holds this rank's ", held,
                 state_ == State::kUnsharding ? " (an unshard is in flight: dp_fsdp_wait_unshard)"
                                              : " (call dp_fsdp_unshard first)",
                 "; its full gradient, ", dtype_name(m.compute), " ", shape_string(m.full_shape),
                 ", is taken or set while it is unsharded; the shard's gradient is dp_fsdp_shard_grad");
}

void FullyShard::zero_shard_grad(const Parameter& parameter) {
  const size_t index = index_of(&parameter);
  if (index == npos) return;
  std::exception_ptr failed;
  bool waited = false;
  {
    // A post_backward in flight adds into the shard gradients: it ends
    // first (as in dp_fsdp_finish_backward, whose error this call then
    // reports), so that the zeros are not added to, nor raced with.
    std::lock_guard<std::mutex> host(host_mutex_);
    std::unique_lock<std::mutex> lock(mutex_);
    if (post_job_.issued && !broken_ && !closed_) {
      if (ddp::running_hook().reducer != nullptr) {
        fail(StatusCode::kState, "zeroing the gradient of parameter '", params_[index].name, "': dp_fsdp #", lane_id_,
             "'s post_backward is in flight, and this call runs inside a dp_ddp callback (which may run on the "
             "comm lane the post_backward needs); zero the gradients after dp_fsdp_finish_backward");
      }
      waited = true;
      try {
        wait_locked(lock, post_job_, "the post-backward reduce_scatter");
      } catch (...) {
        // Ended with an error: its writes were followed all the same, so
        // zero, then report. Not ended (this wait gave up, the dp_fsdp is
        // broken): it may still write, so the gradients stay as they are.
        if (broken_) throw;
        failed = std::current_exception();
      }
    }
  }
  const Tensor& g = params_[index].shard_grad;
  {
    // The host's stream now follows the job's writes; the fill, on the
    // library stream, follows the host's stream again.
    std::optional<StreamOrder> after_job;
    if (waited) after_job.emplace(std::vector<Device>{g.device()});
    fill_zero(g.data(), g.device(), g.nbytes());
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace dparallel::fsdp
