#include "ddp/reducer.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "backend/cuda/cuda_backend.h"
#include "comm/comm.h"
#include "core/error.h"
#include "core/half.h"
#include "ddp/bucket_plan.h"
#include "distributed/call_header.h"
#include "distributed/reduce_ops.h"

namespace dparallel::ddp {

namespace {

using dist::ReduceOp;

// Parameters managed by a live reducer: one reducer per parameter.
std::mutex& managed_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::set<const Parameter*>& managed_set() {
  static std::set<const Parameter*> managed;
  return managed;
}

// Tensors exchanged for agreement checks are this big at most per chunk.
constexpr size_t kStateBroadcastChunk = 64u << 20;

[[noreturn]] void fail_finishing() {
  fail(StatusCode::kState,
       "dp_ddp_finish_backward is running on another thread; calls on one dp_ddp must not overlap it");
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

const Device kHost{DeviceType::kCpu, 0};

double ms_between(Reducer::Clock::time_point a, Reducer::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

Tensor host_int64(const std::vector<int64_t>& values) {
  Tensor t = Tensor::empty(DType::kInt64, {static_cast<int64_t>(values.size())}, kHost);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

std::vector<int64_t> read_int64(const Tensor& t) {
  Tensor host = t.device() == kHost ? t : t.to(kHost);
  std::vector<int64_t> values(static_cast<size_t>(host.numel()));
  if (!values.empty()) std::memcpy(values.data(), host.data(), values.size() * sizeof(int64_t));
  return values;
}

Tensor to_device(const Tensor& t, const Device& device) { return t.device() == device ? t : t.to(device); }

// One output per rank for an all_gather.
std::vector<Tensor> gather_outputs(int32_t world, DType dtype, int64_t numel, const Device& device) {
  std::vector<Tensor> outputs;
  outputs.reserve(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) outputs.push_back(Tensor::empty(dtype, {numel}, device));
  return outputs;
}

// Host loops for the 16-bit hooks' casts (cpu tensors): the dtypes are
// dispatched once per call, not per element.
template <typename Load>
void store_floats(DType dtype, void* out, size_t n, Load load) {
  switch (dtype) {
    case DType::kFloat32:
      for (size_t i = 0; i < n; ++i) static_cast<float*>(out)[i] = load(i);
      return;
    case DType::kFloat64:
      for (size_t i = 0; i < n; ++i) static_cast<double*>(out)[i] = load(i);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = float_to_half(load(i));
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = float_to_bfloat16(load(i));
      return;
    default:
      fail(StatusCode::kInternal, "cast to ", dtype_name(dtype));
  }
}

// dst = src converted (same element count, floating dtypes, same device).
void cast_into(const Tensor& dst, const Tensor& src) {
  size_t n = static_cast<size_t>(src.numel());
  if (dst.device().type == DeviceType::kCuda) {
    cuda::cast(dst.device().index, dst.dtype(), dst.data(), src.dtype(), src.data(), n);
    return;
  }
  const void* in = src.data();
  void* out = dst.data();
  switch (src.dtype()) {
    case DType::kFloat32:
      return store_floats(dst.dtype(), out, n, [in](size_t i) { return static_cast<const float*>(in)[i]; });
    case DType::kFloat64:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return static_cast<float>(static_cast<const double*>(in)[i]); });
    case DType::kFloat16:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return half_to_float(static_cast<const uint16_t*>(in)[i]); });
    case DType::kBFloat16:
      return store_floats(dst.dtype(), out, n,
                          [in](size_t i) { return bfloat16_to_float(static_cast<const uint16_t*>(in)[i]); });
    default:
      fail(StatusCode::kInternal, "cast from ", dtype_name(src.dtype()));
  }
}

void divide(const Tensor& t, int64_t divisor) {
  if (divisor == 1) return;
  if (t.device().type == DeviceType::kCuda) {
    cuda::divide(t.device().index, t.dtype(), t.data(), static_cast<size_t>(t.numel()), divisor);
    return;
  }
  dist::divide_in_place(t.dtype(), t.data(), static_cast<size_t>(t.numel()), divisor);
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

thread_local RunningHook t_running_hook;

}  // namespace

RunningHook running_hook() noexcept { return t_running_hook; }

const char* hook_name(HookKind hook) {
  switch (hook) {
    case HookKind::kAllReduce:
      return "allreduce";
    case HookKind::kFp16:
      return "fp16";
    case HookKind::kBf16:
      return "bf16";
    case HookKind::kCustom:
      return "custom";
  }
  return "unknown";
}

DebugLevel debug_level_from_env() {
  const char* text = std::getenv("DP_DEBUG");
  if (text == nullptr) return DebugLevel::kOff;
  std::string level(text);
  for (char& c : level) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (level == "DETAIL") return DebugLevel::kDetail;
  if (level == "INFO") return DebugLevel::kInfo;
  return DebugLevel::kOff;
}

Reducer::Reducer(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {
  debug_ = debug_level_from_env();
  if (const char* path = std::getenv("DP_TIMELINE"); path != nullptr && *path != '\0') timeline_path_ = path;
  const Device device = group_->device();

  // Checks that could fail on one rank only are collected, so that with
  // init_sync every rank fails naming them instead of waiting for this one.
  std::string local_error;
  std::vector<std::pair<std::string, Tensor>> state;  // broadcast from rank 0 with init_sync
  std::vector<std::string> description;
  try {
    if (options_.bucket_cap_bytes == 0) fail_invalid("argument 'opts->bucket_cap_mb' must be > 0");
    if (options_.first_bucket_cap_bytes == 0) fail_invalid("argument 'opts->first_bucket_cap_mb' must be > 0");
    if (options_.hook == HookKind::kCustom && !options_.custom_hook) {
      fail_invalid("argument 'opts->hook_fn' is NULL but 'opts->comm_hook' is DP_HOOK_CUSTOM");
    }
    std::vector<std::string> ignored_prefixes;
    for (size_t i = 0; i < options_.ignored_modules.size(); ++i) {
      const std::string& name = options_.ignored_modules[i];
      try {
        module_->get_module(name);
      } catch (const Error& e) {
        fail_invalid("argument 'opts->ignored_modules[", i, "]' is '", name, "': ", e.what());
      }
      ignored_prefixes.push_back(name.empty() ? "" : name + ".");
    }
    std::set<std::string> ignored_params;
    for (size_t i = 0; i < options_.ignored_parameters.size(); ++i) {
      const std::string& name = options_.ignored_parameters[i];
      try {
        module_->get_parameter(name);
      } catch (const Error& e) {
        fail_invalid("argument 'opts->ignored_parameters[", i, "]' is '", name, "': ", e.what());
      }
      ignored_params.insert(name);
    }
    auto ignored = [&](const std::string& name) {
      for (const auto& prefix : ignored_prefixes) {
        if (starts_with(name, prefix)) return true;
      }
      return false;
    };
    for (const NamedParameter& np : module_->named_parameters()) {
      const std::string& name = *np.name;
      if (!np.parameter || ignored(name) || ignored_params.count(name) != 0) continue;
      const Tensor& value = np.parameter->value();
      state.emplace_back(name, value);
      if (!np.parameter->requires_grad()) continue;
      if (value.device() != device) {
        fail_invalid("parameter '", name, "' is ", value.describe(), " but the process group works on ",
                     to_string(device), "; move the module there first");
      }
      if (!is_floating(value.dtype())) {
        fail_invalid("parameter '", name, "' is ", value.describe(),
                     "; gradients are reduced for floating-point parameters only (float32, float64, float16, "
                     "bfloat16): set requires_grad to 0 for it or ignore it");
      }
      params_.push_back(Managed{name, np.parameter, value.nbytes(), 0, 0});
    }
    for (const NamedBuffer& nb : module_->named_buffers()) {
      const std::string& name = *nb.name;
      if (!nb.slot->value.defined() || ignored(name)) continue;
      if (nb.slot->value.device() != device) {
        fail_invalid("buffer '", name, "' is ", nb.slot->value.describe(), " but the process group works on ",
                     to_string(device));
      }
      buffers_.emplace_back(name, nb.slot->value);
      state.emplace_back(name, nb.slot->value);
    }
    if (params_.empty()) {
      fail_invalid(
          "argument 'module' has no parameter that requires grad and is not ignored: the dp_ddp would have nothing "
          "to reduce");
    }
    std::lock_guard<std::mutex> lock(managed_mutex());
    for (const Managed& m : params_) {
      if (managed_set().count(m.parameter.get()) != 0) {
        fail_invalid("parameter '", m.name,
                     "' is already managed by another live dp_ddp; wrap disjoint submodules, or destroy the other "
                     "dp_ddp first");
      }
    }
    for (const Managed& m : params_) managed_set().insert(m.parameter.get());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument || !options_.init_sync) throw;
    local_error = e.what();
    params_.clear();
  }
  auto unregister = [&] {
    std::lock_guard<std::mutex> lock(managed_mutex());
    for (const Managed& m : params_) managed_set().erase(m.parameter.get());
  };

  try {
    queue_ = CommQueue::for_group(group_.get());
    if (options_.init_sync) {
      if (!local_error.empty()) {
        description.push_back("error " + local_error);
      } else {
        description.push_back(str_cat("options bucket_cap ", options_.bucket_cap_bytes, " B, first_bucket_cap ",
                                      options_.first_bucket_cap_bytes, " B, comm_hook ", hook_name(options_.hook),
                                      ", gradient_as_bucket_view ", options_.gradient_as_bucket_view,
                                      ", find_unused_parameters ", options_.find_unused_parameters));
        description.push_back(str_cat(params_.size(), " managed parameters"));
        for (size_t i = 0; i < params_.size(); ++i) {
          const Tensor& v = params_[i].parameter->value();
          description.push_back(str_cat("managed parameter ", i, " is '", params_[i].name, "' ", dtype_name(v.dtype()),
                                        " ", shape_string(v.shape())));
        }
        description.push_back(str_cat(state.size(), " parameters and buffers to broadcast"));
        for (size_t i = 0; i < state.size(); ++i) {
          description.push_back(str_cat("state tensor ", i, " is '", state[i].first, "' ",
                                        dtype_name(state[i].second.dtype()), " ",
                                        shape_string(state[i].second.shape())));
        }
      }
      on_queue("dp_ddp_create's agreement check and broadcast", [&] {
        check_agreement(description);
        broadcast_state(state);
      });
    }
    in_place_ = device.type == DeviceType::kCpu && options_.hook == HookKind::kAllReduce &&
                !options_.gradient_as_bucket_view && !options_.find_unused_parameters;
    std::vector<size_t> order(params_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = params_.size() - 1 - i;
    build_buckets(plan_for(order));
  } catch (...) {
    unregister();
    throw;
  }
  for (size_t i = 0; i < params_.size(); ++i) index_by_name_.emplace(params_[i].name, i);
  marked_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  reset_iteration_locked();
  stats_.num_buckets = buckets_.size();
  log_plan(str_cat(params_.size(), " managed parameters in ", buckets_.size(), " buckets (comm hook ",
                   hook_name(options_.hook), ")"));
  if (!timeline_path_.empty() && group_->rank() == 0) {
    int fd = ::open(timeline_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) ::close(fd);
  }
}

Reducer::Clock::duration Reducer::lane_bound() const { return group_->timeout() + std::chrono::seconds(3); }

void Reducer::close() {
  if (closed_) return;
  closed_ = true;
  if (queue_) queue_->cancel(this, lane_bound());
  flush_trace();
  std::lock_guard<std::mutex> lock(managed_mutex());
  for (const Managed& m : params_) managed_set().erase(m.parameter.get());
}

Reducer::~Reducer() {
  close();
  queue_.reset();
  for (Bucket& b : buckets_) {
    for (void* e : b.events) cuda::destroy_event(e);
  }
}

std::vector<std::vector<size_t>> Reducer::plan_for(const std::vector<size_t>& order) const {
  std::vector<PlanItem> items;
  items.reserve(params_.size());
  for (const Managed& m : params_) items.push_back(PlanItem{m.parameter->value().dtype(), m.nbytes});
  return compute_bucket_plan(items, order, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes);
}

void Reducer::build_buckets(const std::vector<std::vector<size_t>>& plan) {
  std::vector<Bucket> buckets(plan.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.params = plan[b];
    bucket.dtype = params_[plan[b].front()].parameter->value().dtype();
    int64_t numel = 0;
    for (size_t p : plan[b]) numel += params_[p].parameter->value().numel();
    bucket.numel = numel;
    if (!in_place_) bucket.flat = Tensor::zeros(bucket.dtype, {numel}, group_->device());
    bucket.local = Tensor::empty(bucket.dtype, {numel}, group_->device());
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
  if (options_.gradient_as_bucket_view) {
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

// Every rank all-gathers every rank's description and reports the same first
// difference from rank 0 (or the lowest rank's own error).
void Reducer::check_agreement(const std::vector<std::string>& description) {
  const Device device = group_->device();
  const int32_t world = group_->size();
  std::string mine;
  for (const auto& line : description) mine += line + "\n";
  std::vector<Tensor> lengths = gather_outputs(world, DType::kInt64, 1, device);
  group_->all_gather(to_device(host_int64({static_cast<int64_t>(mine.size())}), device), lengths, false);
  size_t longest = 0;
  std::vector<size_t> sizes;
  for (const Tensor& t : lengths) {
    int64_t n = read_int64(t).at(0);
    if (n < 0 || n > (int64_t(1) << 31)) fail(StatusCode::kRemote, "a rank sent a malformed description");
    sizes.push_back(static_cast<size_t>(n));
    longest = std::max(longest, static_cast<size_t>(n));
  }
  Tensor padded = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(longest)}, kHost);
  std::memcpy(padded.data(), mine.data(), mine.size());
  std::vector<Tensor> all = gather_outputs(world, DType::kUInt8, static_cast<int64_t>(longest), device);
  group_->all_gather(to_device(padded, device), all, false);
  std::vector<std::vector<std::string>> lines;
  for (int32_t r = 0; r < world; ++r) {
    Tensor host = to_device(all[r], kHost);
    lines.push_back(split_lines(std::string(static_cast<const char*>(host.data()), sizes[r])));
  }
  for (int32_t r = 0; r < world; ++r) {
    if (!lines[r].empty() && starts_with(lines[r][0], "error ")) {
      fail_invalid("rank ", r, " refused: ", lines[r][0].substr(6));
    }
  }
  for (int32_t r = 1; r < world; ++r) {
    size_t n = std::max(lines[r].size(), lines[0].size());
    for (size_t i = 0; i < n; ++i) {
      std::string theirs = i < lines[r].size() ? lines[r][i] : "(nothing more)";
      std::string first = i < lines[0].size() ? lines[0][i] : "(nothing more)";
      if (theirs == first) continue;
      fail_invalid("rank ", r, " disagrees with rank 0: rank ", r, " has ", theirs, " but rank 0 has ", first);
    }
  }
}

// Broadcasts `tensors` from rank 0, coalesced per dtype.
void Reducer::broadcast_state(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  if (tensors.empty() || group_->size() == 1) return;
  std::vector<Tensor> list;
  list.reserve(tensors.size());
  for (const auto& t : tensors) list.push_back(t.second);
  const Device device = group_->device();
  for (const auto& chunk : comm::take_tensors(list, kStateBroadcastChunk)) {
    std::vector<Tensor> pieces;
    pieces.reserve(chunk.size());
    for (size_t i : chunk) pieces.push_back(list[i]);
    int64_t numel = comm::total_numel(pieces);
    if (numel == 0) continue;
    Tensor flat = Tensor::empty(pieces.front().dtype(), {numel}, device);
    comm::flatten_into(flat, pieces);
    group_->broadcast(flat, 0, false);
    if (group_->rank() != 0) comm::unflatten_into(pieces, flat);
  }
}

void Reducer::on_queue(const char* what, const std::function<void()>& fn) {
  queue_->call(this, what, fn, lane_bound());
}

void Reducer::pre_forward() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) fail(StatusCode::kState, "the dp_ddp is unusable after an earlier failure");
    if (finishing_) fail_finishing();
    if (any_mark_) {
      fail(StatusCode::kState,
           "a backward is in progress (parameters were marked ready); call "
           "dp_ddp_finish_backward first");
    }
  }
  if (options_.broadcast_buffers) on_queue("the buffers' broadcast", [&] { broadcast_state(buffers_); });
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
  if (broken_) fail(StatusCode::kState, "the dp_ddp is unusable after an earlier failure");
  if (finishing_) fail_finishing();
  if (index >= params_.size()) {
    fail_invalid("argument 'param_index' is ", index, " but this dp_ddp manages ", params_.size(),
                 " parameters (indices 0..", params_.size() - 1, ")");
  }
  if (marked_[index] != 0) {
    fail(StatusCode::kState, "parameter '", params_[index].name, "' (index ", index,
         ") was already marked ready in this backward; mark each parameter once per backward");
  }
  marked_[index] = 1;
  used_since_sync_[index] = 1;
  auto now = Clock::now();
  if (!any_mark_) {
    any_mark_ = true;
    first_mark_ = now;
  }
  if (!timeline_path_.empty()) {
    trace(str_cat("{\"name\":\"ready ", json_escape(params_[index].name),
                  "\",\"ph\":\"i\",\"s\":\"t\",\"tid\":0,\"ts\":",
                  std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count(), "}"));
  }
  if (!requires_sync_) return;
  if (!rebuilt_) ready_order_.push_back(index);
  Managed& m = params_[index];
  Bucket& bucket = buckets_[m.bucket];
  if (m.parameter->value().device().type == DeviceType::kCuda) {
    // The gradient is final once the host's stream gets there: the worker
    // waits on this event, then copies.
    bucket.events.push_back(cuda::record_event(m.parameter->value().device().index, has_stream ? stream : nullptr));
    if (!options_.gradient_as_bucket_view) bucket.deferred.push_back(index);
  } else if (!options_.gradient_as_bucket_view && !in_place_) {
    Tensor slot = slot_of(index);
    lock.unlock();
    copy_tensor(slot, m.parameter->grad());
    lock.lock();
  }
  --bucket.pending;
  queue_ready_buckets_locked();
}

void Reducer::queue_ready_buckets_locked() {
  while (next_queue_ < buckets_.size() && buckets_[next_queue_].pending == 0) {
    if (!queue_->push(shared_from_this(), next_queue_, "")) fail_bucket_locked(next_queue_, queue_->stuck_reason());
    ++next_queue_;
  }
}

std::shared_ptr<CommQueue> CommQueue::for_group(const dist::ProcessGroup* group) {
  static std::mutex mutex;
  static std::map<const dist::ProcessGroup*, std::weak_ptr<CommQueue>> queues;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = queues.begin(); it != queues.end();) it = it->second.expired() ? queues.erase(it) : std::next(it);
  auto& slot = queues[group];
  if (auto existing = slot.lock()) return existing;
  auto created = std::make_shared<CommQueue>();
  slot = created;
  return created;
}

CommQueue::CommQueue() : lane_(std::make_shared<Lane>()) {
  thread_ = std::thread([lane = lane_] { loop(lane); });
  worker_id_ = thread_.get_id();
}

CommQueue::~CommQueue() {
  bool stuck = false;
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    lane_->stopping = true;
    stuck = !lane_->stuck.empty();
    lane_->cv.notify_all();
  }
  // A worker stuck in a job (or this very thread, when the job's reducer
  // was the last owner) ends on its own; the lane lives as long as it.
  if (stuck || on_worker()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

std::string CommQueue::stuck_reason() {
  std::lock_guard<std::mutex> lock(lane_->mutex);
  return lane_->stuck;
}

void CommQueue::Job::execute() {
  if (run) {
    run();
  } else {
    reducer->run_job(bucket, refusal);
  }
}

void CommQueue::Job::drop_unrun(const std::string& why) {
  if (drop) {
    drop(why);
  } else if (reducer) {
    reducer->drop_job(bucket, why);
  }
}

std::string CommQueue::JobName::text() const {
  if (what != nullptr) return what;
  return str_cat("bucket ", bucket, refusal ? "'s refusal" : "'s reduction");
}

bool CommQueue::push(const std::shared_ptr<Reducer>& owner, size_t bucket, std::string refusal) {
  std::lock_guard<std::mutex> lock(lane_->mutex);
  if (!lane_->stuck.empty()) return false;
  Job job;
  job.owner = owner.get();
  job.reducer = owner;
  job.bucket = bucket;
  job.refusal = std::move(refusal);
  job.id = ++lane_->next_id;
  lane_->jobs.push_back(std::move(job));
  lane_->cv.notify_all();
  return true;
}

void CommQueue::call(const Reducer* owner, const char* what, const std::function<void()>& fn, Clock::duration bound) {
  if (on_worker()) return fn();
  struct Outcome {
    bool started = false;
    bool done = false;
    std::exception_ptr error;
  };
  auto outcome = std::make_shared<Outcome>();
  Lane& lane = *lane_;
  std::unique_lock<std::mutex> lock(lane.mutex);
  if (!lane.stuck.empty()) fail(StatusCode::kState, what, ": ", lane.stuck);
  // `fn` is the caller's, alive until this returns: the job runs it only
  // if it starts before the caller gives up, and the caller then waits.
  Job job;
  job.owner = owner;
  job.what = what;
  job.run = [&lane, outcome, &fn] {
    {
      std::lock_guard<std::mutex> guard(lane.mutex);
      outcome->started = true;
      lane.cv.notify_all();
    }
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> guard(lane.mutex);
    outcome->error = error;
    outcome->done = true;
  };
  job.drop = [&lane, outcome, what = std::string(what)](const std::string& why) {
    std::lock_guard<std::mutex> guard(lane.mutex);
    outcome->error = std::make_exception_ptr(Error(StatusCode::kState, str_cat(what, ": ", why)));
    outcome->done = true;
    lane.cv.notify_all();
  };
  job.id = ++lane.next_id;
  const uint64_t id = job.id;
  lane.jobs.push_back(std::move(job));
  lane.cv.notify_all();
  if (!lane.cv.wait_for(lock, bound, [&] { return outcome->started || outcome->done; })) {
    for (auto it = lane.jobs.begin(); it != lane.jobs.end(); ++it) {
      if (it->id != id) continue;
      lane.jobs.erase(it);
      fail(StatusCode::kTimeout, what, " did not start within ",
           std::chrono::duration_cast<std::chrono::milliseconds>(bound).count(), " ms: ", lane.running_name.text(),
           " (before it on this process group's comm lane) did not finish (a comm hook that does not return?)");
    }
  }
  // Once started, its collectives end by the group's timeout.
  lane.cv.wait(lock, [&] { return outcome->done; });
  if (outcome->error) std::rethrow_exception(outcome->error);
}

std::deque<CommQueue::Job> CommQueue::stick_locked(const std::string& why) {
  if (lane_->stuck.empty()) {
    lane_->stuck =
        str_cat("the process group's comm lane is stuck for good: ", lane_->running_name.text(), " has run for ",
                std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - lane_->running_since).count(),
                " ms (", why, "); destroy the dp_ddp on it and make a new group");
  }
  std::deque<Job> dropped;
  dropped.swap(lane_->jobs);
  lane_->cv.notify_all();
  return dropped;
}

void CommQueue::drop_all(std::deque<Job>& jobs, const std::string& why) {
  for (Job& job : jobs) {
    job.drop_unrun(why);
  }
  jobs.clear();
}

void CommQueue::give_up(const std::string& why) {
  std::deque<Job> dropped;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(lane_->mutex);
    if (lane_->running == nullptr && lane_->stuck.empty()) return;
    dropped = stick_locked(why);
    reason = lane_->stuck;
  }
  drop_all(dropped, reason);
}

bool CommQueue::cancel(const Reducer* owner, Clock::duration bound) {
  std::deque<Job> dropped;
  std::string reason;
  {
    std::unique_lock<std::mutex> lock(lane_->mutex);
    auto& jobs = lane_->jobs;
    jobs.erase(std::remove_if(jobs.begin(), jobs.end(), [&](const Job& j) { return j.owner == owner; }), jobs.end());
    if (on_worker() || lane_->running != owner) return true;
    if (lane_->stuck.empty() && lane_->cv.wait_for(lock, bound, [&] { return lane_->running != owner; })) {
      return true;
    }
    if (lane_->running != owner) return true;
    dropped = stick_locked("its dp_ddp was destroyed meanwhile");
    reason = lane_->stuck;
  }
  drop_all(dropped, reason);
  return false;
}

void CommQueue::loop(const std::shared_ptr<Lane>& lane) {
  std::unique_lock<std::mutex> lock(lane->mutex);
  for (;;) {
    lane->cv.wait(lock, [&] { return lane->stopping || !lane->jobs.empty(); });
    if (lane->jobs.empty()) return;  // stopping: every owner is gone
    Job job = std::move(lane->jobs.front());
    lane->jobs.pop_front();
    lane->running = job.owner;
    lane->running_name = JobName{job.what, job.bucket, !job.refusal.empty()};
    lane->running_since = Clock::now();
    lock.unlock();
    job.execute();
    job = Job{};  // releases what the job kept alive, before the lock
    lock.lock();
    lane->running = nullptr;
    lane->cv.notify_all();
    if (!lane->stuck.empty() && lane->stopping) return;
  }
}

void Reducer::run_job(size_t index, const std::string& refusal) {
  Bucket& bucket = buckets_[index];
  bucket.start = Clock::now();
  StatusCode code = StatusCode::kOk;
  std::string error;
  try {
    if (!refusal.empty()) {
      // Stands in for this bucket's first collective, so that the other
      // ranks' matching call fails at once naming this rank's reason.
      try {
        group_->refuse(debug_ == DebugLevel::kDetail ? dist::CallKind::kAllGather : dist::CallKind::kAllReduce, refusal,
                       false);
      } catch (const Error& e) {
        if (e.code() != StatusCode::kInvalidArgument) throw;
      }
      code = StatusCode::kState;
      error = refusal;
    } else {
      copy_into_bucket(index);
      if (debug_ == DebugLevel::kDetail) check_fingerprint(index);
      save_local(index);
      reduce_bucket(index);
      // The results go back into the gradients here, while the host's
      // backward goes on, unless the used map must decide it first.
      if (in_place_) {
        bucket.copied_back = true;
      } else if (!options_.gradient_as_bucket_view && !options_.find_unused_parameters) {
        for (size_t p : bucket.params) copy_tensor(params_[p].parameter->grad(), slot_of(p));
        bucket.copied_back = true;
      }
    }
  } catch (const Error& e) {
    code = e.code();
    error = e.what();
  } catch (const std::bad_alloc&) {
    code = StatusCode::kOutOfMemory;
    error = "out of memory";
  } catch (const std::exception& e) {
    code = StatusCode::kInternal;
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  bucket.end = Clock::now();
  bucket.code = code;
  bucket.error = std::move(error);
  bucket.done = true;
  cv_.notify_all();
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
    if (options_.gradient_as_bucket_view) {
      copy_tensor(bucket.flat, bucket.local);  // the gradients are views into it
    } else if (in_place_ || bucket.copied_back) {
      comm::unflatten_into(bucket_grads(bucket), bucket.local);
    }
  }
  for (const auto& [index, values] : saved_views) copy_tensor(slot_of(index), values);
}

void Reducer::fail_bucket_locked(size_t index, const std::string& why) {
  Bucket& bucket = buckets_[index];
  bucket.start = bucket.end = Clock::now();
  bucket.code = StatusCode::kState;
  bucket.error = why;
  bucket.done = true;
  cv_.notify_all();
}

void Reducer::drop_job(size_t index, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (index < buckets_.size() && !buckets_[index].done) fail_bucket_locked(index, why);
}

// CUDA: waits for the host's streams, then copies the gradients in.
void Reducer::copy_into_bucket(size_t index) {
  std::vector<void*> events;
  std::vector<size_t> deferred;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(buckets_[index].events);
    deferred.swap(buckets_[index].deferred);
  }
  std::exception_ptr failure;
  for (void* e : events) {
    try {
      if (!failure) cuda::wait_event(e);
    } catch (...) {
      failure = std::current_exception();
    }
    cuda::destroy_event(e);
  }
  if (failure) std::rethrow_exception(failure);
  for (size_t p : deferred) copy_tensor(slot_of(p), params_[p].parameter->grad());
}

void Reducer::check_fingerprint(size_t index) {
  const Bucket& bucket = buckets_[index];
  const Device device = group_->device();
  const int32_t world = group_->size();
  std::vector<Tensor> all = gather_outputs(world, DType::kInt64, 3, device);
  Tensor mine = host_int64({static_cast<int64_t>(index), bucket.numel, static_cast<int64_t>(bucket.dtype)});
  group_->all_gather(to_device(mine, device), all, false);
  std::vector<int64_t> first = read_int64(all[0]);
  auto describe = [](const std::vector<int64_t>& f) {
    const char* dtype = f[2] >= 0 && f[2] <= static_cast<int64_t>(DType::kBool) ? dtype_name(static_cast<DType>(f[2]))
                                                                                : "unknown-dtype";
    return str_cat("bucket ", f[0], " (", f[1], " ", dtype, " elements)");
  };
  for (int32_t r = 1; r < world; ++r) {
    std::vector<int64_t> theirs = read_int64(all[r]);
    if (theirs != first) {
      fail_invalid("DP_DEBUG=DETAIL: the ranks' graphs diverge: rank ", r, " reduces ", describe(theirs),
                   " where rank 0 reduces ", describe(first),
                   "; every rank must manage the same parameters and mark the same ones");
    }
  }
}

void Reducer::reduce_bucket(size_t index) {
  const Bucket& bucket = buckets_[index];
  if (bucket.numel == 0) return;  // only empty parameters: the same on every rank
  if (in_place_) {
    group_->all_reduce_coalesced(bucket_grads(bucket), ReduceOp::kAvg, false);
    return;
  }
  const Tensor& flat = bucket.flat;
  switch (options_.hook) {
    case HookKind::kAllReduce:
      group_->all_reduce(flat, ReduceOp::kAvg, false);
      return;
    case HookKind::kFp16:
    case HookKind::kBf16: {
      // As PyTorch's fp16/bf16_compress_hook: cast, divide by the world
      // size, then sum, so that large gradients do not overflow the sum.
      DType wire = options_.hook == HookKind::kFp16 ? DType::kFloat16 : DType::kBFloat16;
      Tensor compressed = flat.dtype() == wire ? flat : Tensor::empty(wire, flat.shape(), flat.device());
      if (compressed.data() != flat.data()) cast_into(compressed, flat);
      divide(compressed, group_->size());
      group_->all_reduce(compressed, ReduceOp::kSum, false);
      if (compressed.data() != flat.data()) cast_into(flat, compressed);
      return;
    }
    case HookKind::kCustom: {
      struct Running {
        explicit Running(RunningHook hook) { t_running_hook = hook; }
        ~Running() { t_running_hook = RunningHook{}; }
        Running(const Running&) = delete;
        Running& operator=(const Running&) = delete;
      } running(RunningHook{this, index});
      options_.custom_hook(index, flat);
      return;
    }
  }
}

void Reducer::wait_all_done(std::unique_lock<std::mutex>& lock) {
  // Each collective ends by the group's timeout; the margin covers the
  // failure reports. A bucket finishing restarts the bound.
  const auto bound = lane_bound();
  size_t done_before = 0;
  auto deadline = Clock::now() + bound;
  for (;;) {
    size_t done = 0;
    size_t stuck = buckets_.size();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (buckets_[b].done) {
        ++done;
      } else if (stuck == buckets_.size()) {
        stuck = b;
      }
    }
    if (done == buckets_.size()) return;
    if (done != done_before) {
      done_before = done;
      deadline = Clock::now() + bound;
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
      bool all_done = std::all_of(buckets_.begin(), buckets_.end(), [](const Bucket& b) { return b.done; });
      if (all_done) return;
      broken_ = true;
      std::string why =
          str_cat("bucket ", stuck, " (", describe_params(buckets_[stuck].params), ") did not finish within ",
                  std::chrono::duration_cast<std::chrono::milliseconds>(bound).count(),
                  " ms (its comm hook or the device never returned)");
      // The other reducers on the group fail now rather than at their own bound.
      lock.unlock();
      queue_->give_up(why);
      lock.lock();
      fail(StatusCode::kTimeout, why, "; the dp_ddp is unusable");
    }
  }
}

void Reducer::reset_iteration_locked() {
  std::fill(marked_.begin(), marked_.end(), 0);
  any_mark_ = false;
  next_queue_ = 0;
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.done = false;
    b.copied_back = false;
    b.reduced = false;
    b.code = StatusCode::kOk;
    b.error.clear();
    for (void* e : b.events) cuda::destroy_event(e);
    b.events.clear();
    b.deferred.clear();
  }
}

void Reducer::finish_backward() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (broken_) fail(StatusCode::kState, "the dp_ddp is unusable after an earlier failure");
  if (finishing_) fail_finishing();
  finishing_ = true;
  // Cleared however this ends; the lock is held or retaken by then.
  struct ClearFinishing {
    std::unique_lock<std::mutex>& lock;
    bool& flag;
    ~ClearFinishing() {
      if (!lock.owns_lock()) lock.lock();
      flag = false;
    }
  } clear_finishing{lock, finishing_};
  const auto finish_start = Clock::now();
  if (!requires_sync_) {
    // No communication: the gradients stay as accumulated; the next synced
    // backward reduces them.
    std::fill(marked_.begin(), marked_.end(), 0);
    any_mark_ = false;
    lock.unlock();
    flush_trace();
    return;
  }
  std::vector<size_t> unmarked;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (marked_[i] == 0) unmarked.push_back(i);
  }
  const int32_t rank = group_->rank();
  if (!unmarked.empty() && !options_.find_unused_parameters) {
    std::string names = describe_params(unmarked);
    std::string message = str_cat(
        unmarked.size(), " parameter(s) were not marked ready in this backward: ", names,
        ". Mark every managed parameter once per backward, or create the dp_ddp with find_unused_parameters = 1 if "
        "some parameters are unused in some iterations");
    // The buckets that cannot start are refused, so that the other ranks fail
    // at once instead of waiting for them until the timeout.
    std::string refusal = str_cat("rank ", rank, " did not mark parameter(s) ", names, " ready");
    for (size_t b = next_queue_; b < buckets_.size(); ++b) {
      if (!queue_->push(shared_from_this(), b, refusal)) fail_bucket_locked(b, queue_->stuck_reason());
    }
    next_queue_ = buckets_.size();
    wait_all_done(lock);
    restore_local_locked({});
    std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
    ready_order_.clear();
    reset_iteration_locked();
    fail(StatusCode::kState, message);
  }
  // find_unused_parameters: what this rank did not use goes in as zeros (or
  // as what earlier unsynced backwards accumulated).
  std::map<size_t, Tensor> saved_views;
  for (size_t i : unmarked) {
    Tensor slot = slot_of(i);
    if (used_since_sync_[i] != 0) {
      if (!options_.gradient_as_bucket_view) copy_tensor(slot, params_[i].parameter->grad());
    } else {
      if (options_.gradient_as_bucket_view) saved_views[i] = slot.to(slot.device());
      fill_zero(slot.data(), slot.device(), slot.nbytes());
    }
    --buckets_[params_[i].bucket].pending;
  }
  queue_ready_buckets_locked();
  wait_all_done(lock);
  const auto reduced = Clock::now();

  std::vector<uint8_t> used(params_.size(), 1);
  size_t failed = buckets_.size();
  for (size_t b = 0; b < buckets_.size() && failed == buckets_.size(); ++b) {
    if (buckets_[b].code != StatusCode::kOk) failed = b;
  }
  if (failed == buckets_.size() && options_.find_unused_parameters) {
    // Which parameters any rank used: after the buckets, so that every rank
    // issues it at the same place in the group's sequence.
    lock.unlock();
    try {
      Tensor map = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(params_.size())}, kHost);
      std::memcpy(map.data(), used_since_sync_.data(), used_since_sync_.size());
      Tensor on_device = to_device(map, group_->device());
      on_queue("the used parameters' all_reduce", [&] { group_->all_reduce(on_device, ReduceOp::kMax, false); });
      Tensor back = to_device(on_device, kHost);
      std::memcpy(used.data(), back.data(), used.size());
    } catch (...) {
      lock.lock();
      restore_local_locked(saved_views);
      std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
      reset_iteration_locked();
      throw;
    }
    lock.lock();
  }
  if (failed != buckets_.size()) {
    const Bucket& bucket = buckets_[failed];
    std::vector<size_t> not_ready;
    for (size_t p : bucket.params) {
      if (marked_[p] == 0) not_ready.push_back(p);
    }
    StatusCode code = bucket.code;
    std::string message =
        str_cat("the reduction of bucket ", failed, " (", describe_params(bucket.params), ") failed; ",
                not_ready.empty() ? std::string("this rank marked all of them ready")
                                  : "this rank has not seen ready: " + describe_params(not_ready),
                ": ", bucket.error);
    restore_local_locked(saved_views);
    std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
    ready_order_.clear();
    reset_iteration_locked();
    throw Error(code, message);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (used[i] == 0) {
      auto it = saved_views.find(i);
      if (it != saved_views.end()) copy_tensor(slot_of(i), it->second);
      continue;
    }
    if (!options_.gradient_as_bucket_view && !buckets_[params_[i].bucket].copied_back) {
      copy_tensor(params_[i].parameter->grad(), slot_of(i));
    }
  }
  const auto end = Clock::now();

  ReducerStats stats;
  stats.backward_ms = ms_between(any_mark_ ? first_mark_ : finish_start, end);
  for (const Bucket& b : buckets_) {
    stats.reduce_ms += ms_between(b.start, b.end);
    auto exposed_from = std::max(b.start, finish_start);
    if (b.end > exposed_from) stats.exposed_ms += ms_between(exposed_from, b.end);
  }
  if (!timeline_path_.empty()) {
    auto us = [](Clock::time_point t) {
      return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
    };
    for (size_t b = 0; b < buckets_.size(); ++b) {
      trace(str_cat("{\"name\":\"reduce bucket ", b, "\",\"ph\":\"X\",\"tid\":1,\"ts\":", us(buckets_[b].start),
                    ",\"dur\":", us(buckets_[b].end) - us(buckets_[b].start), "}"));
    }
    trace(str_cat("{\"name\":\"finish_backward wait\",\"ph\":\"X\",\"tid\":0,\"ts\":", us(finish_start),
                  ",\"dur\":", us(reduced) - us(finish_start), "}"));
  }
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
  std::vector<size_t> order = std::move(ready_order_);
  ready_order_.clear();
  reset_iteration_locked();
  if (!rebuilt_) {
    lock.unlock();
    std::vector<size_t> rank0_order;
    {
      // Rank 0's ready order, then what it never marked, latest registered first.
      std::vector<int64_t> values;
      std::vector<bool> seen(params_.size(), false);
      for (size_t i : order) {
        values.push_back(static_cast<int64_t>(i));
        seen[i] = true;
      }
      for (size_t i = params_.size(); i-- > 0;) {
        if (!seen[i]) values.push_back(static_cast<int64_t>(i));
      }
      Tensor t = to_device(host_int64(values), group_->device());
      on_queue("the ready order's broadcast", [&] { group_->broadcast(t, 0, false); });
      for (int64_t v : read_int64(t)) {
        if (v < 0 || static_cast<size_t>(v) >= params_.size()) {
          fail_invalid("rank 0's ready order names parameter ", v, " but this rank manages ", params_.size());
        }
        rank0_order.push_back(static_cast<size_t>(v));
      }
    }
    lock.lock();  // on failure the finishing guard retakes it
    stats.buckets_rebuilt = rebuild(rank0_order);
  }
  stats.num_buckets = buckets_.size();
  stats_ = stats;
  if (debug_ != DebugLevel::kOff) {
    std::fprintf(stderr, "[dparallel ddp rank %d] backward %.3f ms, reductions %.3f ms, exposed %.3f ms\n", rank,
                 stats.backward_ms, stats.reduce_ms, stats.exposed_ms);
  }
  lock.unlock();
  flush_trace();
}

bool Reducer::rebuild(const std::vector<size_t>& rank0_order) {
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
    build_buckets(plan);
    reset_iteration_locked();
  }
  rebuilt_ = true;
  log_plan(str_cat("buckets rebuilt in rank 0's ready order: ", buckets_.size(), " buckets"));
  return changed;
}

void Reducer::log_plan(const std::string& title) const {
  if (debug_ == DebugLevel::kOff) return;
  std::fprintf(stderr, "[dparallel ddp rank %d] %s:\n", group_->rank(), title.c_str());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::fprintf(stderr, "[dparallel ddp rank %d]   bucket %zu: %s, %zu bytes: %s\n", group_->rank(), b,
                 dtype_name(buckets_[b].dtype), static_cast<size_t>(buckets_[b].numel) * dtype_size(buckets_[b].dtype),
                 describe_params(buckets_[b].params).c_str());
  }
}

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

void Reducer::trace(const std::string& event) { trace_events_.push_back(event); }

// Appends this rank's events to the shared trace file; ranks take turns
// under an advisory lock. The file is a JSON array left open at the end,
// which trace viewers accept.
void Reducer::flush_trace() {
  std::vector<std::string> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(trace_events_);
  }
  if (timeline_path_.empty() || events.empty()) return;
  const int32_t rank = group_->rank();
  // Steady-clock stamps are per boot; the ranks of one host share them.
  std::string text;
  auto add = [&](const std::string& event) {
    std::string with_pid = event;
    with_pid.insert(1, str_cat("\"pid\":", rank, ","));
    text += ",\n" + with_pid;
  };
  add(str_cat("{\"name\":\"process_name\",\"ph\":\"M\",\"args\":{\"name\":\"rank ", rank, "\"}}"));
  for (const auto& e : events) add(e);
  int fd = ::open(timeline_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (::flock(fd, LOCK_EX) == 0) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size == 0) text.replace(0, 1, "[");
    const char* p = text.data();
    size_t left = text.size();
    while (left > 0) {
      ssize_t n = ::write(fd, p, left);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
    ::flock(fd, LOCK_UN);
  }
  ::close(fd);
}

}  // namespace dparallel::ddp
