// Making a dp_fsdp: its parameters collected from the module and checked,
// the ranks' agreement on them, and this rank's shards cut (with init_sync,
// in memory every rank maps where the group has it).
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "core/error.h"
#include "fsdp/fully_shard.h"
#include "lane/agreement.h"
#include "lane/debug_level.h"
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
  if (why.empty() || lane::debug_level_from_env() == lane::DebugLevel::kOff) return;
  std::fprintf(stderr, "[dparallel fsdp rank %d] shards in private memory: %s\n", rank, why.c_str());
}

}  // namespace

std::shared_ptr<FullyShard> FullyShard::create(std::shared_ptr<Module> module,
                                               std::shared_ptr<dist::ProcessGroup> group,
                                               const ShardingOptions& options) {
  return create(std::move(module), std::move(group), nullptr, options);
}

std::shared_ptr<FullyShard> FullyShard::create(std::shared_ptr<Module> module,
                                               std::shared_ptr<dist::ProcessGroup> shard_group,
                                               std::shared_ptr<dist::ProcessGroup> replicate_group,
                                               const ShardingOptions& options) {
  std::shared_ptr<FullyShard> sharding(
      new FullyShard(std::move(module), std::move(shard_group), std::move(replicate_group), options));
  sharding->init();
  return sharding;
}

FullyShard::FullyShard(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group,
                       std::shared_ptr<dist::ProcessGroup> replicate, ShardingOptions options)
    : module_(std::move(module)),
      group_(std::move(group)),
      replicate_(std::move(replicate)),
      options_(std::move(options)) {}

std::string FullyShard::replicate_argument_error() const {
  if (!replicate_) return "";
  if (replicate_ == group_) {
    return "the replicate group is the shard group; a shard is replicated across another group (null: none)";
  }
  if (replicate_->device() != group_->device()) {
    return str_cat("the replicate group works on ", to_string(replicate_->device()), " but the shard group on ",
                   to_string(group_->device()), "; both must work on the parameters' device");
  }
  return "";
}

void FullyShard::make_full_params() {
  // Each full parameter at its own address (even one of no bytes: distinct
  // tensors never look tied), aligned as the device allocator aligns.
  constexpr size_t kAlign = 256;
  std::vector<size_t> offsets(layout_.size(), 0);
  size_t total = 0;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ShardedParam& m = layout_.at(i);
    if (layout_.views() && m.sharded) continue;
    size_t numel = 1;
    for (int64_t d : m.full_shape) numel *= static_cast<size_t>(d);
    offsets[i] = total;
    total += (std::max<size_t>(numel * dtype_size(m.compute), 1) + kAlign - 1) / kAlign * kAlign;
  }
  if (total > 0) full_memory_ = ReleasableMemory::reserve(group_->device(), total);
  const std::shared_ptr<Storage> storage = full_memory_ ? full_memory_->storage() : nullptr;
  full_.resize(layout_.size());
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ShardedParam& m = layout_.at(i);
    full_[i] = layout_.views() && m.sharded ? layout_.full_view(i)
                                            : Tensor::wrap(storage, offsets[i], m.compute, m.full_shape);
  }
  // Resharded: no pages until the first unshard.
  if (full_memory_) full_memory_->release();
}

void FullyShard::init() {
  // An argument error on one rank fails every rank's agreement check
  // (with init_sync) instead of leaving the others waiting.
  if (const std::string error = replicate_argument_error(); !error.empty()) {
    if (!options_.init_sync) fail_invalid(error);
    if (options_.argument_error.empty()) options_.argument_error = error;
  }
  std::string local_error = collect();
  lane_ = lane::CommLane::for_group(group_);
  lane_id_ = lane_->attach(this);
  if (replicate_) {
    replicate_lane_ = lane::CommLane::for_group(replicate_);
    replicate_lane_->attach(this);
  }
  try {
    if (options_.init_sync) agree_on_lanes(local_error);
    layout_.plan(group_->size(), group_->rank());
    // The one place where the shards' memory is decided: every later
    // choice between views and copies reads layout_.placement().
    std::shared_ptr<Storage> region;
    ShardPlacement placement = ShardPlacement::kPrivate;
    if (options_.init_sync && wants_shard_region()) {
      const ShardPlacement wanted = layout_.wanted_placement(true, options_.full_params_as_views);
      lane::JobSpec spec;
      spec.item = CallItem::kFsdpCreate;
      lane_->call(
          this, spec, [&] { placement = create_shard_region(wanted, &region); }, lane_bound());
    }
    layout_.cut_shards(std::move(region), placement, group_->device());
    make_full_params();
    for (const ShardedParam& m : layout_.params()) {
      m.parameter->set_grad(Tensor());
      m.parameter->set_value(m.shard);
    }
  } catch (...) {
    lane_->detach(this, lane_bound());
    if (replicate_lane_) replicate_lane_->detach(this, lane_bound());
    for (const ShardedParam& m : layout_.params()) m.parameter->release(this);
    throw;
  }
}

void FullyShard::agree_on_lanes(const std::string& local_error) {
  lane::JobSpec spec;
  spec.item = CallItem::kFsdpCreate;
  auto values = [&] {
    std::vector<Tensor> out;
    for (const ShardedParam& m : layout_.params()) out.push_back(m.parameter->value());
    return out;
  };
  // The shard group's check and broadcast; its failure is the same on every
  // rank of the group.
  std::string shard_error;
  try {
    lane_->call(
        this, spec,
        [&] {
          lane::check_agreement(*group_, describe_for_agreement(local_error, false));
          lane::broadcast_tensors(*group_, values(), 0);
        },
        lane_bound());
  } catch (const Error& e) {
    if (!replicate_ || e.code() != StatusCode::kInvalidArgument) throw;
    shard_error = e.what();
  }
  if (!replicate_) return;
  // The replicas' check, which a shard group's failure fails too, and their
  // broadcast; then each shard group learns every replicate group's
  // verdict: every rank of both fails alike.
  std::string verdict = shard_error;
  try {
    replicate_lane_->call(
        this, spec,
        [&] {
          try {
            lane::check_agreement(*replicate_,
                                  describe_for_agreement(shard_error.empty() ? local_error : shard_error, true));
          } catch (const Error& e) {
            if (e.code() != StatusCode::kInvalidArgument || !shard_error.empty()) throw;
            fail_invalid("across the replicate group (where this rank is rank ", replicate_->rank(), " of ",
                         replicate_->size(), "): ", e.what());
          }
          lane::broadcast_tensors(*replicate_, values(), 0);
        },
        lane_bound());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    if (verdict.empty()) verdict = e.what();
  }
  std::vector<std::string> verdicts;
  lane_->call(
      this, spec, [&] { verdicts = lane::all_gather_strings(*group_, verdict); }, lane_bound());
  if (!verdict.empty()) fail_invalid(verdict);
  for (size_t r = 0; r < verdicts.size(); ++r) {
    if (!verdicts[r].empty()) fail_invalid("rank ", r, " of the shard group failed: ", verdicts[r]);
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
      if (np.parameter->owner_kind() != nullptr) {
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
      if (const std::string holder = m.parameter->claim(self); !holder.empty()) {
        fail_invalid("parameter '", m.name, "' was taken by a ", holder, " created meanwhile");
      }
    }
  } catch (const Error& e) {
    for (const ShardedParam& m : params) m.parameter->release(this);
    if (e.code() != StatusCode::kInvalidArgument || !options_.init_sync) throw;
    params.clear();
    return e.what();
  }
  return "";
}

std::vector<std::string> FullyShard::describe_for_agreement(const std::string& local_error, bool for_replicas) const {
  if (!local_error.empty()) return {"error " + local_error};
  const std::vector<ShardedParam>& params = layout_.params();
  std::vector<std::string> lines;
  // The shard group's ranks are one rank of the mesh's replicas; the
  // replicas each hold the same shards.
  if (for_replicas) {
    lines.push_back(str_cat("shard rank ", group_->rank(), " of a shard group of ", group_->size()));
  } else if (replicate_) {
    lines.push_back(str_cat("replicate rank ", replicate_->rank(), " of a replicate group of ", replicate_->size()));
  }
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
         group_->capabilities().shared_regions;
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
