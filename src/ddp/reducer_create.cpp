// Creating a reducer: the managed parameters, the checks every rank agrees
// on, the broadcast from rank 0.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "comm/comm.h"
#include "core/error.h"
#include "ddp/reducer.h"
#include "lane/agreement.h"
#include "lane/host_values.h"

namespace dparallel::ddp {

namespace {

using dist::CallItem;

// What holds a dp_ddp's parameters (Parameter::claim): made with the
// reducer, which is not shared yet when it claims them.
class DdpParameterOwner final : public ParameterOwner {
 public:
  const char* owner_kind() const override { return "dp_ddp"; }
};

size_t align_to(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

}  // namespace

Reducer::Reducer(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {
  debug_ = lane::debug_level_from_env();
  if (const char* path = std::getenv("DP_TIMELINE"); path != nullptr && *path != '\0') timeline_path_ = path;
  // Checks that could fail on one rank only are collected, so that with
  // init_sync every rank fails naming them instead of waiting for this one.
  Setup setup = collect_managed();
  lane_ = lane::CommLane::for_group(group_);
  lane_id_ = lane_->attach(this);
  try {
    if (options_.init_sync) {
      std::vector<std::string> description = describe_for_agreement(setup);
      on_lane(CallItem::kCreate, [&] {
        lane::check_agreement(*group_, description);
        broadcast_state(setup.state);
        create_bucket_region();
        create_gradient_region();
      });
    } else if (!options_.bucket_plan.empty()) {
      // Ranks given different plans would pair unlike buckets.
      std::vector<std::string> description = !setup.local_error.empty()
                                                 ? std::vector<std::string>{"error " + setup.local_error}
                                                 : lane::split_lines(format_plan(plan_params(), given_plan_));
      on_lane(CallItem::kCreate, [&] { lane::check_agreement(*group_, description); });
    }
    const bool cpu = group_->device().type == DeviceType::kCpu;
    in_place_ = cpu && options_.hook == HookKind::kAllReduce && !options_.gradient_as_bucket_view &&
                !options_.find_unused_parameters && group_->capabilities().shared_regions;
    defer_ = cpu && group_->capabilities().transfers_on_host_cores && options_.hook != HookKind::kCustom &&
             !options_.find_unused_parameters;
    hold_results_ = cpu && !in_place_ && !defer_ && !options_.gradient_as_bucket_view &&
                    !options_.find_unused_parameters && options_.on_bucket_reduced == nullptr;
    if (!given_plan_.empty()) {
      build_buckets(given_plan_, region_storage_);
      rebuilt_ = true;  // a given plan is final
    } else {
      std::vector<size_t> order(params_.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = params_.size() - 1 - i;
      build_buckets(plan_for(order), region_storage_);
    }
  } catch (...) {
    lane_->detach(this, lane_bound());
    release_parameters();
    throw;
  }
  for (size_t i = 0; i < params_.size(); ++i) index_by_name_.emplace(params_[i].name, i);
  sync_state_ = std::move(setup.state);
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

// The managed parameters and the buffers, checked; claimed (Parameter::claim).
// With init_sync or a bucket plan an argument error is returned instead of
// thrown.
Reducer::Setup Reducer::collect_managed() {
  Setup setup;
  const Device device = group_->device();
  try {
    if (!options_.argument_error.empty()) fail_invalid(options_.argument_error);
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
      // A dp_fsdp's parameters are its own (replicate over fully_shard).
      if (!np.parameter || ignored(name) || ignored_params.count(name) != 0 || np.parameter->sharding()) continue;
      const Tensor& value = np.parameter->value();
      setup.state.emplace_back(name, value);
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
      setup.state.emplace_back(name, nb.slot->value);
    }
    if (params_.empty()) {
      fail_invalid(
          "argument 'module' has no parameter that requires grad and is not ignored: the dp_ddp would have nothing "
          "to reduce");
    }
    check_no_overlap();
    if (!options_.bucket_plan.empty())
      given_plan_ = parse_plan(options_.bucket_plan, plan_params(), "opts->bucket_plan");
    claim_parameters();
  } catch (const Error& e) {
    // A creation without collectives fails on this rank alone.
    if (e.code() != StatusCode::kInvalidArgument || (!options_.init_sync && options_.bucket_plan.empty())) throw;
    setup.local_error = e.what();
    params_.clear();
  }
  return setup;
}

void Reducer::check_no_overlap() const {
  std::vector<std::pair<std::string, const Parameter*>> values;
  values.reserve(params_.size());
  for (const Managed& m : params_) values.emplace_back(m.name, m.parameter.get());
  check_values_apart(values);
}

void Reducer::claim_parameters() {
  if (!parameter_owner_) parameter_owner_ = std::make_shared<DdpParameterOwner>();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string holder = params_[i].parameter->claim(parameter_owner_);
    if (holder.empty()) continue;
    for (size_t j = 0; j < i; ++j) params_[j].parameter->release(parameter_owner_.get());
    fail_invalid("parameter '", params_[i].name, "' is already managed by another live ", holder,
                 "; wrap disjoint submodules, or destroy the other ", holder, " first");
  }
}

void Reducer::release_parameters() {
  for (const Managed& m : params_) m.parameter->release(parameter_owner_.get());
}

std::vector<std::string> Reducer::describe_for_agreement(const Setup& setup) const {
  if (!setup.local_error.empty()) return {"error " + setup.local_error};
  std::vector<std::string> description;
  description.push_back(str_cat(
      "options bucket_cap ", options_.bucket_cap_bytes, " B, first_bucket_cap ", options_.first_bucket_cap_bytes,
      " B, comm_hook ", hook_name(options_.hook), ", gradient_as_bucket_view ", options_.gradient_as_bucket_view,
      ", find_unused_parameters ", options_.find_unused_parameters, ", broadcast_buffers ", options_.broadcast_buffers,
      ", static_graph ", options_.static_graph, ", on_bucket_reduced ", options_.on_bucket_reduced ? "set" : "unset"));
  if (!given_plan_.empty()) {
    for (const std::string& line : lane::split_lines(format_plan(plan_params(), given_plan_))) {
      description.push_back("bucket plan: " + line);
    }
  }
  description.push_back(str_cat(params_.size(), " managed parameters"));
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& v = params_[i].parameter->value();
    description.push_back(str_cat("managed parameter ", i, " is '", params_[i].name, "' ", dtype_name(v.dtype()), " ",
                                  shape_string(v.shape())));
  }
  description.push_back(str_cat(setup.state.size(), " parameters and buffers to broadcast"));
  for (size_t i = 0; i < setup.state.size(); ++i) {
    description.push_back(str_cat("state tensor ", i, " is '", setup.state[i].first, "' ",
                                  dtype_name(setup.state[i].second.dtype()), " ",
                                  shape_string(setup.state[i].second.shape())));
  }
  return description;
}

void Reducer::create_bucket_region() {
  if (!options_.gradient_as_bucket_view || group_->device().type != DeviceType::kCpu || group_->size() == 1 ||
      !group_->capabilities().shared_regions) {
    return;
  }
  std::string why;
  region_storage_ = group_->create_region_storage(bucket_region_bytes(), &why);
  if (debug_ != lane::DebugLevel::kOff && !why.empty()) {
    std::fprintf(stderr, "[dparallel ddp rank %d] buckets in private memory: %s\n", group_->rank(), why.c_str());
  }
  if (region_storage_ == nullptr) return;
  if (debug_ != lane::DebugLevel::kOff) {
    std::fprintf(stderr, "[dparallel ddp rank %d] buckets in a shared region of %zu bytes: the other ranks read them\n",
                 group_->rank(), region_storage_->nbytes());
  }
}

void Reducer::create_gradient_region() {
  // Where gradients are reduced in place as one coalesced all_reduce
  // (in_place_) on shared memory: the same on every rank.
  if (options_.gradient_as_bucket_view || options_.hook != HookKind::kAllReduce || options_.find_unused_parameters ||
      group_->device().type != DeviceType::kCpu || group_->size() == 1 || !group_->capabilities().shared_regions) {
    return;
  }
  size_t bytes = 0;
  for (const Managed& m : params_) bytes = align_to(bytes, m.parameter->value().element_size()) + m.nbytes;
  if (bytes == 0) return;
  // Only where some rank has a gradient to place: a dp_ddp made again over
  // a module whose gradients all exist would make a region and free it at
  // once (a collective, and a peak of the gradients' size).
  Tensor wanted = Tensor::empty(DType::kUInt8, {1}, group_->device());
  *static_cast<uint8_t*>(wanted.data()) = std::any_of(params_.begin(), params_.end(), [](const Managed& m) {
    return m.nbytes > 0 && !m.parameter->grad_if_allocated().defined();
  });
  group_->all_reduce(wanted, dist::ReduceOp::kMax, false);
  if (*static_cast<const uint8_t*>(wanted.data()) == 0) return;
  // Held by the gradients' views alone: what no rank places here goes with
  // the region once the last view does.
  std::string why;
  std::shared_ptr<Storage> storage = group_->create_region_storage(bytes, &why);
  if (debug_ != lane::DebugLevel::kOff && !why.empty()) {
    std::fprintf(stderr, "[dparallel ddp rank %d] gradients in private memory: %s\n", group_->rank(), why.c_str());
  }
  if (storage == nullptr) return;
  // A gradient the host already has (its own memory, or one it may hold a
  // handle to) stays where it is; that rank's reductions then go through
  // the slots, the others' too.
  size_t offset = 0;
  size_t placed = 0;
  for (Managed& m : params_) {
    const Tensor& value = m.parameter->value();
    offset = align_to(offset, value.element_size());
    if (!m.parameter->grad_if_allocated().defined()) {
      Tensor view = Tensor::wrap(storage, offset, value.dtype(), value.shape());
      if (m.nbytes > 0) std::memset(view.data(), 0, m.nbytes);
      m.parameter->set_grad(view);
      ++placed;
    }
    offset += m.nbytes;
  }
  if (debug_ != lane::DebugLevel::kOff) {
    std::fprintf(stderr,
                 "[dparallel ddp rank %d] %zu of %zu gradients in a shared region of %zu bytes: the other ranks "
                 "read them\n",
                 group_->rank(), placed, params_.size(), bytes);
  }
}

void Reducer::broadcast_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int32_t root) {
  std::vector<Tensor> list;
  list.reserve(tensors.size());
  for (const auto& t : tensors) list.push_back(t.second);
  lane::broadcast_tensors(*group_, list, root);
}

}  // namespace dparallel::ddp
