// Making a dp_fsdp: its parameters collected from the module and checked,
// the ranks' agreement on them, and this rank's shards cut (with init_sync,
// in memory every rank maps where the group has it).
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "core/error.h"
#include "ddp/agreement.h"
#include "ddp/comm_hooks.h"
#include "ddp/reducer.h"
#include "fsdp/fully_shard.h"
#include "module/memory_overlap.h"

namespace dparallel::fsdp {

namespace {

using dist::CallItem;

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

std::string dtype_option(const std::optional<DType>& dtype) { return dtype ? dtype_name(*dtype) : "own"; }

// DP_DEBUG=INFO or DETAIL: says why the shards stay in private memory.
void report_private_shards(int32_t rank, const std::string& why) {
  if (why.empty() || ddp::debug_level_from_env() == ddp::DebugLevel::kOff) return;
  std::fprintf(stderr, "[dparallel fsdp rank %d] shards in private memory: %s\n", rank, why.c_str());
}

}  // namespace

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
            for (const ShardedParam& m : layout_.params()) values.push_back(m.parameter->value());
            ddp::broadcast_tensors(*group_, values, 0);
          },
          lane_bound());
    }
    layout_.plan(group_->size(), group_->rank());
    // The one place where the shards' memory is decided: every later
    // choice between views and copies reads layout_.placement().
    std::shared_ptr<Storage> region;
    ShardPlacement placement = ShardPlacement::kPrivate;
    if (options_.init_sync && wants_shard_region()) {
      const ShardPlacement wanted = layout_.wanted_placement(true, options_.full_params_as_views);
      ddp::JobSpec spec;
      spec.item = CallItem::kFsdpCreate;
      lane_->call(
          this, spec, [&] { placement = create_shard_region(wanted, &region); }, lane_bound());
    }
    layout_.cut_shards(std::move(region), placement, group_->device());
    for (const ShardedParam& m : layout_.params()) {
      m.parameter->set_grad(Tensor());
      m.parameter->set_value(m.shard);
    }
  } catch (...) {
    lane_->detach(this, lane_bound());
    for (const ShardedParam& m : layout_.params()) m.parameter->release_sharding(this);
    throw;
  }
}

std::string FullyShard::collect() {
  const Device device = group_->device();
  std::vector<ShardedParam>& params = layout_.params();
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
      ShardedParam m;
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
      params.push_back(std::move(m));
    }
    // Overlapping shards would be cut from memory two parameters share.
    std::vector<std::pair<std::string, const Parameter*>> values;
    values.reserve(params.size());
    for (const ShardedParam& m : params) values.emplace_back(m.name, m.parameter.get());
    check_values_apart(values);
    auto self = shared_from_this();
    for (const ShardedParam& m : params) {
      if (!m.parameter->claim_sharding(self)) {
        fail_invalid("parameter '", m.name, "' was taken by another dp_fsdp created meanwhile");
      }
    }
  } catch (const Error& e) {
    for (const ShardedParam& m : params) m.parameter->release_sharding(this);
    if (e.code() != StatusCode::kInvalidArgument || !options_.init_sync) throw;
    params.clear();
    return e.what();
  }
  return "";
}

std::vector<std::string> FullyShard::describe_for_agreement(const std::string& local_error) const {
  if (!local_error.empty()) return {"error " + local_error};
  const std::vector<ShardedParam>& params = layout_.params();
  std::vector<std::string> lines;
  lines.push_back(str_cat("options reshard_after_forward ", options_.reshard_after_forward, ", param_dtype ",
                          dtype_option(options_.param_dtype), ", reduce_dtype ", dtype_option(options_.reduce_dtype),
                          ", full_params_as_views ", options_.full_params_as_views));
  lines.push_back(str_cat(params.size(), " managed parameters"));
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardedParam& m = params[i];
    lines.push_back(str_cat("managed parameter ", i, " is '", m.name, "' ", dtype_name(m.dtype), " ",
                            shape_string(m.full_shape), m.reduced ? "" : " (requires_grad 0)"));
  }
  return lines;
}

bool FullyShard::wants_shard_region() const {
  return layout_.any_sharded() && group_->size() > 1 && group_->device().type == DeviceType::kCpu &&
         std::string(group_->backend_name()) == "shm";
}

ShardPlacement FullyShard::create_shard_region(ShardPlacement wanted, std::shared_ptr<Storage>* region) {
  const size_t bytes = layout_.region_bytes(wanted);
  if (bytes == 0) return ShardPlacement::kPrivate;
  std::string why;
  // Out of memory, the shards stay in private memory (every rank alike):
  // no views, and the all-gather stages them.
  *region = group_->create_region_storage(bytes, &why, wanted == ShardPlacement::kFullViews);
  report_private_shards(group_->rank(), why);
  return *region ? wanted : ShardPlacement::kPrivate;
}

}  // namespace dparallel::fsdp
