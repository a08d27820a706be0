// dp_fsdp.h: fully_shard.
#include <cstring>
#include <optional>
#include <vector>

#include "capi/dist_internal.h"
#include "capi/fsdp_internal.h"
#include "dparallel/dp_fsdp.h"
#include "fsdp/async_save.h"
#include "fsdp/fsdp_state_dict.h"
#include "fsdp/fully_shard.h"
#include "lane/lane_owner.h"

using namespace dparallel;

namespace {

// A group's own transfer stream (NCCL's) reads the host's tensors in the
// gathers and broadcasts of create, destroy and the saves: it waits for the
// host's streams too, as the library stream does.
void order_transfers(StreamOrder& order, const dist::ProcessGroup& group) {
  if (void* transfers = group.transfer_stream()) order.also_order(group.device(), transfers);
}

// Why a dp_fsdp call cannot run on this thread (a DDP comm hook or
// on_bucket_reduced, on the lane it would wait for), or "".
std::string refusal_inside_callback() {
  lane::RunningHook hook = lane::running_hook();
  if (hook.owner == nullptr) return "";
  return str_cat("called from inside the ", hook.what, " of a dp_ddp (bucket ", hook.bucket,
                 "): it runs on the process group's comm lane, which a dp_fsdp call would wait for");
}

fsdp::FullyShard& fsdp_arg(const dp_fsdp* handle) {
  if (handle == nullptr) capi::null_argument("fsdp");
  if (handle->tag != kFsdpTag) fail_invalid("argument 'fsdp' is not a dp_fsdp handle");
  capi::check_origin(handle->origin, "fsdp");
  return *handle->sharding;
}

fsdp::FullyShard& changing_fsdp_arg(const dp_fsdp* handle) {
  fsdp::FullyShard& sharding = fsdp_arg(handle);
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  return sharding;
}

std::optional<DType> floating_dtype_arg(int32_t code, const char* name) {
  if (code == -1) return std::nullopt;
  DType dtype = capi::dtype_arg(code, name);
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    fail_invalid("argument '", name, "' is ", dtype_name(dtype),
                 "; it must be -1 or a floating dtype (DP_FLOAT32, DP_FLOAT64, DP_FLOAT16, DP_BFLOAT16)");
  }
  return dtype;
}

// Fills `options`; init_sync (whether the creation makes collectives) is
// set first, so that it is known when a later field is bad.
void options_arg(const dp_fsdp_options* opts, fsdp::ShardingOptions& options) {
  static const dp_fsdp_options kDefaults = DP_FSDP_OPTIONS_INIT;
  const dp_fsdp_options o = capi::read_options(opts, kDefaults, "DP_FSDP_OPTIONS_INIT");
  options.init_sync = o.init_sync != 0;
  options.reshard_after_forward = o.reshard_after_forward != 0;
  options.param_dtype = floating_dtype_arg(o.param_dtype, "opts->param_dtype");
  options.reduce_dtype = floating_dtype_arg(o.reduce_dtype, "opts->reduce_dtype");
  options.full_params_as_views = o.full_params_as_views != 0;
}

// The dp_fsdp of dp_fsdp_create and dp_fsdp_create_on_mesh: sharded over
// `shard`, replicated across `replicate` (null: none). Any argument error
// past the groups is refused in the creation's place (see
// ShardingOptions::argument_error), over an empty module when it is the
// module that is bad.
void create_sharding(dp_fsdp** out, dp_module* module, const std::shared_ptr<dist::ProcessGroup>& shard,
                     const std::shared_ptr<dist::ProcessGroup>& replicate, const dp_fsdp_options* opts) {
  std::shared_ptr<Module> m;
  fsdp::ShardingOptions options;
  try {
    capi::require_arg(out, "out");
    m = capi::module_arg(module, "module");
    options_arg(opts, options);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    options.argument_error = e.what();
    if (!m) m = std::make_shared<Module>();
  }
  auto handle = std::make_unique<dp_fsdp>();
  // init_sync's broadcasts and checks run on both groups' transfer streams.
  StreamOrder order(capi::module_devices(*m, {shard->device()}));
  order_transfers(order, *shard);
  if (replicate) order_transfers(order, *replicate);
  handle->sharding = fsdp::FullyShard::create(m, shard, replicate, options);
  order.finish();
  if (out == nullptr) fail(StatusCode::kInternal, "a dp_fsdp was made for a NULL 'out'");
  *out = handle.release();
}

}  // namespace

extern "C" {

dp_status dp_fsdp_options_init(dp_fsdp_options* opts, size_t struct_size) {
  DP_API_BEGIN
  static const dp_fsdp_options kDefaults = DP_FSDP_OPTIONS_INIT;
  capi::options_init(opts, struct_size, kDefaults);
  DP_API_END
}

dp_status dp_fsdp_create(dp_fsdp** out, dp_module* module, dp_process_group* pg, const dp_fsdp_options* opts) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  capi::group_arg(pg, "pg");
  create_sharding(out, module, pg->group, nullptr, opts);
  DP_API_END
}

dp_status dp_fsdp_create_on_mesh(dp_fsdp** out, dp_module* module, const dp_device_mesh* mesh,
                                 const dp_fsdp_options* opts) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  const dist::DeviceMesh& m = *capi::mesh_arg(mesh, "mesh").mesh;
  // Every rank's mesh has the same shape (its creation agreed on it), so
  // every rank refuses alike, before any collective.
  if (m.ndim() > 2) {
    fail_invalid("argument 'mesh' has ", m.ndim(),
                 " dimensions; fully_shard takes a 1-D mesh (its group) or a 2-D one (HSDP: replicas over "
                 "dimension 0, shards over dimension 1)");
  }
  create_sharding(out, module, m.group(m.ndim() - 1), m.ndim() == 2 ? m.group(0) : nullptr, opts);
  DP_API_END
}

dp_status dp_fsdp_unshard(dp_fsdp* fsdp, int async) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  // The job's work follows the host's stream when it starts; the library
  // stream does not wait for it meanwhile (StreamOrder::kDeferred), and the
  // host's stream follows the job's work once the host takes the results
  // (FullyShard::follow_job_locked), so no finish() here.
  StreamOrder order({f.group()->device()}, StreamOrder::HostWait::kDeferred);
  f.unshard(async != 0, order.take_deferred());
  DP_API_END
}

dp_status dp_fsdp_wait_unshard(dp_fsdp* fsdp) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  // No work of its own on the host's tensors; the host's stream follows
  // the job's work inside (FullyShard::follow_job_locked).
  f.wait_unshard();
  DP_API_END
}

dp_status dp_fsdp_reshard(dp_fsdp* fsdp) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  // No work of its own on the host's tensors; the host's stream follows
  // the job's work inside (FullyShard::follow_job_locked).
  f.reshard();
  DP_API_END
}

dp_status dp_fsdp_post_backward(dp_fsdp* fsdp) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  StreamOrder order({f.group()->device()}, StreamOrder::HostWait::kDeferred);  // as in dp_fsdp_unshard
  f.post_backward(order.take_deferred());
  DP_API_END
}

dp_status dp_fsdp_mark_grad_ready(dp_fsdp* fsdp, const char* name) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  std::string parameter = capi::string_arg(name, "name");
  // Each marking thread's stream: the post_backward the last mark runs
  // follows all of them (as in dp_fsdp_unshard).
  StreamOrder order({f.group()->device()}, StreamOrder::HostWait::kDeferred);
  f.mark_grad_ready(parameter, order.take_deferred());
  DP_API_END
}

dp_status dp_fsdp_finish_backward(dp_fsdp* fsdp) {
  DP_API_BEGIN
  fsdp::FullyShard& f = changing_fsdp_arg(fsdp);
  // No work of its own on the host's tensors; the host's stream follows
  // the job's work inside (FullyShard::follow_job_locked).
  f.finish_backward();
  DP_API_END
}

dp_status dp_fsdp_set_requires_gradient_sync(dp_fsdp* fsdp, int requires_sync) {
  DP_API_BEGIN
  changing_fsdp_arg(fsdp).set_requires_gradient_sync(requires_sync != 0);
  DP_API_END
}

size_t dp_fsdp_num_parameters(const dp_fsdp* fsdp) {
  DP_API_BEGIN
  return fsdp_arg(fsdp).num_parameters();
  DP_API_END_VALUE(0)
}

dp_status dp_fsdp_parameter_name(const dp_fsdp* fsdp, size_t index, const char** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = fsdp_arg(fsdp).parameter_name(index).c_str();
  DP_API_END
}

dp_status dp_fsdp_shard(const dp_fsdp* fsdp, size_t index, dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = capi::new_tensor_handle(fsdp_arg(fsdp).shard(index));
  DP_API_END
}

dp_status dp_fsdp_shard_grad(const dp_fsdp* fsdp, size_t index, dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = capi::new_tensor_handle(fsdp_arg(fsdp).shard_grad(index));
  DP_API_END
}

dp_status dp_fsdp_save_full_state_dict(dp_module* module, dp_process_group* pg, const char* path) {
  DP_API_BEGIN
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  Module& m = *capi::module_arg(module, "module");
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  std::string file;
  try {
    file = capi::string_arg(path, "path");
  } catch (const Error& e) {
    fsdp::refuse_full_state_dict_save(m, group, e.what());
  }
  capi::in_stream_order(
      capi::module_devices(m, {group.device()}), [&] { fsdp::save_full_state_dict(m, group, file); },
      capi::transfer_stream_of(group));
  DP_API_END
}

dp_status dp_fsdp_full_state_dict(dp_module* module, dp_process_group* pg, int32_t root, dp_module** out) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  Module& m = *capi::module_arg(module, "module");
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  // A bad `root` or `out` on one rank fails every rank's call, naming it.
  if (out == nullptr) fsdp::refuse_full_state_dict_save(m, group, "argument 'out' is NULL");
  if (root < -1 || root >= group.size()) {
    fsdp::refuse_full_state_dict_save(
        m, group,
        str_cat("argument 'root' is ", root, "; it must be -1 (every rank) or a rank of the group, 0..",
                group.size() - 1));
  }
  std::shared_ptr<Module> full;
  capi::in_stream_order(
      capi::module_devices(m, {group.device()}), [&] { full = fsdp::full_state_dict(m, group, root); },
      capi::transfer_stream_of(group));
  if (full) *out = capi::new_module_handle(std::move(full));
  DP_API_END
}

dp_status dp_fsdp_load_full_state_dict(dp_module* module, const char* path, int strict) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  std::string file = capi::string_arg(path, "path");
  capi::in_stream_order(capi::module_devices(m), [&] { fsdp::load_full_state_dict(m, file, strict != 0); });
  DP_API_END
}

dp_status dp_fsdp_save_sharded_state_dict(dp_module* module, dp_process_group* pg, const char* folder) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  // A bad folder on one rank fails every rank's save in its report's place.
  std::string dir, refusal;
  try {
    dir = capi::string_arg(folder, "folder");
  } catch (const Error& e) {
    refusal = e.what();
  }
  capi::in_stream_order(
      capi::module_devices(m, {group.device()}), [&] { fsdp::save_sharded_state_dict(m, group, dir, refusal); },
      capi::transfer_stream_of(group));
  DP_API_END
}

dp_status dp_fsdp_save_sharded_state_dict_async(dp_module* module, dp_process_group* pg, const char* folder,
                                                dp_work** out) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  // Past the group, a bad argument on one rank is posted as its outcome:
  // the other ranks' saves fail naming it.
  Module* m = nullptr;
  std::string dir, refusal;
  try {
    m = capi::module_arg(module, "module").get();
    dir = capi::string_arg(folder, "folder");
    capi::require_arg(out, "out");
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    refusal = e.what();
  }
  auto handle = std::make_unique<dp_work>();
  // The copy aside reads the shards after the host's stream, as the save does.
  handle->work = capi::in_stream_order(
      m != nullptr ? capi::module_devices(*m, {group.device()}) : std::vector<Device>{group.device()},
      [&] { return fsdp::save_sharded_state_dict_async(m, pg->group, dir, refusal); }, capi::transfer_stream_of(group));
  *out = handle.release();
  DP_API_END
}

dp_status dp_fsdp_load_sharded_state_dict(dp_module* module, const char* folder) {
  DP_API_BEGIN
  Module& m = *capi::module_arg(module, "module");
  // A bad folder on one rank fails every rank's load in its plan's place.
  std::string dir, refusal;
  try {
    dir = capi::string_arg(folder, "folder");
  } catch (const Error& e) {
    refusal = e.what();
  }
  capi::in_stream_order(capi::module_devices(m), [&] { fsdp::load_sharded_state_dict(m, dir, refusal); });
  DP_API_END
}

void dp_fsdp_destroy(dp_fsdp* fsdp) {
  if (fsdp == nullptr || fsdp->tag != kFsdpTag || !fsdp->origin.is_current()) return;
  std::string refusal = refusal_inside_callback();
  if (!refusal.empty()) {
    capi::set_last_error(str_cat(__func__, ": ", refusal, "; nothing was destroyed"));
    return;
  }
  fsdp->tag = 0;
  // The gather reads the shards after the host's stream (its optimizer's
  // last writes), and the host's stream reads the full parameters after it.
  // Without that order (a failing stream) the teardown still happens.
  std::optional<StreamOrder> order;
  try {
    const dist::ProcessGroup& group = *fsdp->sharding->group();
    order.emplace(std::vector<Device>{group.device()});
    order_transfers(*order, group);
  } catch (...) {
    capi::handle_exception(__func__);  // whatever order was made is kept
  }
  try {
    fsdp->sharding->close();
    if (order) order->finish();
  } catch (...) {
    capi::handle_exception(__func__);
  }
  fsdp->sharding.reset();
  delete fsdp;
}

}  // extern "C"
