// dp_ddp.h: the DDP reducer.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>

#include "capi/dist_internal.h"
#include "ddp/reducer.h"
#include "dparallel/dp_ddp.h"

using namespace dparallel;

#define DP_CHECK_HOOK_CODE(id, code, name, c_name) static_assert((c_name) == static_cast<int32_t>(ddp::HookKind::id));
DP_COMM_HOOKS(DP_CHECK_HOOK_CODE)
#undef DP_CHECK_HOOK_CODE

constexpr uint64_t kDdpTag = 0x6470'6464'7021'2121ull;  // "dpddp!!!"

struct dp_ddp {
  uint64_t tag = kDdpTag;
  // Swapped by dp_ddp_rebind while another thread may call in: every call
  // takes its own reference under `mutex` (current()). A job of a reducer's
  // still running may keep it alive after destroy. Null after a failed rebind.
  std::shared_ptr<ddp::Reducer> reducer;
  std::string failed_rebind;  // why the last rebind failed, when it did
  mutable std::mutex mutex;
  // The custom hook as given, made again for each group the dp_ddp goes on over.
  dp_comm_hook_fn hook_fn = nullptr;
  void* hook_user_data = nullptr;
  ProcessOrigin origin;

  std::shared_ptr<ddp::Reducer> current() const {
    std::lock_guard<std::mutex> lock(mutex);
    return reducer;
  }
};

namespace {

// Why a call that changes a dp_ddp cannot run on this thread, or "" when it can.
std::string refusal_inside_comm_hook(const dp_ddp* handle) {
  lane::RunningHook hook = lane::running_hook();
  if (hook.owner == nullptr) return "";
  bool own = handle != nullptr && handle->tag == kDdpTag && hook.owner == handle->current().get();
  return str_cat("called from inside the ", hook.what, " of ", own ? "this dp_ddp" : "a dp_ddp", " (bucket ",
                 hook.bucket,
                 "): a hook may run collectives on the process group it is given and use dp_tensor functions, but "
                 "not call dp_ddp functions that change a dp_ddp (they wait for the hook's own bucket)");
}

// `changes_state`: the call waits for or alters the reductions, so that a
// comm hook may not make it. The reference keeps the reducer alive for the
// call, also when a rebind replaces it meanwhile.
std::shared_ptr<ddp::Reducer> ddp_arg(const dp_ddp* handle, bool changes_state = true) {
  if (handle == nullptr) capi::null_argument("ddp");
  if (handle->tag != kDdpTag) fail_invalid("argument 'ddp' is not a dp_ddp handle");
  capi::check_origin(handle->origin, "ddp");
  if (changes_state) {
    std::string refusal = refusal_inside_comm_hook(handle);
    if (!refusal.empty()) fail(StatusCode::kState, refusal);
  }
  std::lock_guard<std::mutex> lock(handle->mutex);
  if (!handle->reducer) {
    fail(StatusCode::kState, "the dp_ddp is unusable after a failed dp_ddp_rebind (", handle->failed_rebind,
         "); only dp_ddp_destroy is left");
  }
  return handle->reducer;
}

// Largest cap accepted: 1 TiB, far beyond any bucket worth having.
constexpr double kMaxCapMb = 1024.0 * 1024.0;

size_t cap_arg(double mb, const char* name) {
  if (!std::isfinite(mb) || mb <= 0 || mb > kMaxCapMb) {
    fail_invalid("argument '", name, "' is ", mb, "; it must be a number of MiB in (0, ", kMaxCapMb, "]");
  }
  double bytes = std::round(mb * 1024.0 * 1024.0);
  return bytes < 1 ? 1 : static_cast<size_t>(bytes);
}

std::vector<std::string> names_arg(const char* const* names, size_t count, const char* name) {
  if (count > 0 && names == nullptr) fail_invalid("argument '", name, "' is NULL but its count is ", count);
  std::vector<std::string> out;
  for (size_t i = 0; i < count; ++i) {
    if (names[i] == nullptr) fail_invalid("argument '", name, "[", i, "]' is NULL");
    out.emplace_back(names[i]);
  }
  return out;
}

ddp::HookKind hook_arg(int32_t code, const char* name) {
  const auto count = static_cast<int32_t>(std::size(ddp::kHookKinds));
  if (code < 0 || code >= count) {
    std::string names;
    for (int32_t i = 0; i < count; ++i)
      names += str_cat(i == 0 ? "" : i + 1 == count ? " or " : ", ", ddp::kHookKinds[i].c_name);
    fail_invalid("argument '", name, "' is ", code, "; it must be ", names, " (0..", count - 1, ")");
  }
  return static_cast<ddp::HookKind>(code);
}

// The host's hook over `group`, which it receives as `pg`.
ddp::CustomHook custom_hook(dp_comm_hook_fn fn, void* user_data, const std::shared_ptr<dist::ProcessGroup>& group) {
  std::weak_ptr<dist::ProcessGroup> weak_group = group;
  return [fn, user_data, weak_group](size_t bucket, const Tensor& flat) {
    auto locked = weak_group.lock();
    if (!locked) fail(StatusCode::kState, "the process group is gone");
    // Borrowed for the call (dp_ddp.h): the hook must not destroy them.
    dp_process_group group_handle;
    group_handle.group = std::move(locked);
    group_handle.borrowed = true;
    dp_tensor tensor_handle;
    tensor_handle.tensor = flat;
    tensor_handle.borrowed = true;
    int rc = fn(user_data, &group_handle, bucket, &tensor_handle);
    if (rc != 0) {
      fail(StatusCode::kUser, "the comm hook returned ", rc, " for bucket ", bucket, " (", flat.describe(), ")");
    }
  };
}

// Fills `options`; whether the creation makes collectives (init_sync, a
// bucket plan) is set first, so that it is known when a later field is bad.
void options_arg(const dp_ddp_options* opts, const std::shared_ptr<dist::ProcessGroup>& group,
                 ddp::ReducerOptions& options, dp_ddp& handle) {
  static const dp_ddp_options kDefaults = DP_DDP_OPTIONS_INIT;
  const dp_ddp_options o = capi::read_options(opts, kDefaults, "DP_DDP_OPTIONS_INIT");
  options.init_sync = o.init_sync != 0;
  if (o.bucket_plan != nullptr) {
    options.bucket_plan = o.bucket_plan;
    if (options.bucket_plan.empty()) fail_invalid("argument 'opts->bucket_plan' is empty; pass NULL for none");
  }
  options.bucket_cap_bytes = cap_arg(o.bucket_cap_mb, "opts->bucket_cap_mb");
  options.first_bucket_cap_bytes = cap_arg(o.first_bucket_cap_mb, "opts->first_bucket_cap_mb");
  options.gradient_as_bucket_view = o.gradient_as_bucket_view != 0;
  options.broadcast_buffers = o.broadcast_buffers != 0;
  options.find_unused_parameters = o.find_unused_parameters != 0;
  options.ignored_modules = names_arg(o.ignored_modules, o.num_ignored_modules, "opts->ignored_modules");
  options.ignored_parameters = names_arg(o.ignored_parameters, o.num_ignored_parameters, "opts->ignored_parameters");
  options.hook = hook_arg(o.comm_hook, "opts->comm_hook");
  options.static_graph = o.static_graph != 0;
  options.join_divide_by_initial_world_size = o.join_divide_by_initial_world_size != 0;
  if (options.hook == ddp::HookKind::kCustom) {
    if (o.hook_fn == nullptr) fail_invalid("argument 'opts->hook_fn' is NULL but 'opts->comm_hook' is DP_HOOK_CUSTOM");
    options.custom_hook = custom_hook(o.hook_fn, o.hook_user_data, group);
    handle.hook_fn = o.hook_fn;
    handle.hook_user_data = o.hook_user_data;
  }
}

// on_bucket_reduced as the reducer calls it, given the handle it reports.
void set_bucket_reduced(ddp::ReducerOptions& options, const dp_ddp_options* opts, dp_ddp* handle) {
  if (opts == nullptr || opts->struct_size < offsetof(dp_ddp_options, on_bucket_reduced_data) + sizeof(void*)) return;
  dp_bucket_reduced_fn fn = opts->on_bucket_reduced;
  if (fn == nullptr) return;
  void* user_data = opts->on_bucket_reduced_data;
  options.on_bucket_reduced = [fn, user_data, handle](size_t bucket, const std::vector<size_t>& params) {
    return fn(user_data, handle, bucket, params.data(), params.size());
  };
}

}  // namespace

extern "C" {

dp_status dp_ddp_options_init(dp_ddp_options* opts, size_t struct_size) {
  DP_API_BEGIN
  static const dp_ddp_options kDefaults = DP_DDP_OPTIONS_INIT;
  capi::options_init(opts, struct_size, kDefaults);
  DP_API_END
}

dp_status dp_ddp_create(dp_ddp** out, dp_module* module, dp_process_group* pg, const dp_ddp_options* opts) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  std::string refusal = refusal_inside_comm_hook(nullptr);
  if (!refusal.empty()) fail(StatusCode::kState, refusal);
  capi::group_arg(pg, "pg");
  // Any other argument error is refused in the creation's place (see
  // ReducerOptions::argument_error), over an empty module when it is the
  // module that is bad.
  std::shared_ptr<Module> m;
  ddp::ReducerOptions options;
  auto handle = std::make_unique<dp_ddp>();
  try {
    capi::require_arg(out, "out");
    m = capi::module_arg(module, "module");
    options_arg(opts, pg->group, options, *handle);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    options.argument_error = e.what();
    if (!m) m = std::make_shared<Module>();
  }
  set_bucket_reduced(options, opts, handle.get());
  handle->reducer = capi::in_stream_order(capi::module_devices(*m, {pg->group->device()}), [&] {
    return std::make_shared<ddp::Reducer>(m, pg->group, std::move(options));
  });
  if (out == nullptr) fail(StatusCode::kInternal, "a dp_ddp was made for a NULL 'out'");
  *out = handle.release();
  DP_API_END
}

dp_status dp_ddp_pre_forward(dp_ddp* ddp) {
  DP_API_BEGIN
  // Every tensor a dp_ddp touches after create is on its group's device.
  std::shared_ptr<ddp::Reducer> reducer = ddp_arg(ddp);
  capi::in_stream_order({reducer->device()}, [&] { reducer->pre_forward(); });
  DP_API_END
}

dp_status dp_ddp_mark_grad_ready(dp_ddp* ddp, const char* param_name) {
  DP_API_BEGIN
  std::shared_ptr<ddp::Reducer> reducer = ddp_arg(ddp);
  capi::require_arg(param_name, "param_name");
  reducer->mark_ready(reducer->index_of(param_name), false, nullptr);
  DP_API_END
}

dp_status dp_ddp_mark_grad_ready_index(dp_ddp* ddp, size_t param_index) {
  DP_API_BEGIN
  ddp_arg(ddp)->mark_ready(param_index, false, nullptr);
  DP_API_END
}

dp_status dp_ddp_mark_grad_ready_stream(dp_ddp* ddp, size_t param_index, void* cuda_stream) {
  DP_API_BEGIN
  ddp_arg(ddp)->mark_ready(param_index, true, cuda_stream);
  DP_API_END
}

dp_status dp_ddp_finish_backward(dp_ddp* ddp) {
  DP_API_BEGIN
  // Gradients accumulated by unsynced backwards, or left unmarked, are read
  // here: after the finishing thread's stream has written them.
  std::shared_ptr<ddp::Reducer> reducer = ddp_arg(ddp);
  capi::in_stream_order({reducer->device()}, [&] { reducer->finish_backward(); });
  DP_API_END
}

dp_status dp_ddp_join(dp_ddp* const* ddps, size_t n) {
  DP_API_BEGIN
  if (n == 0) fail_invalid("argument 'n' is 0: pass every dp_ddp this rank drives");
  if (ddps == nullptr) capi::null_argument("ddps");
  std::vector<std::shared_ptr<ddp::Reducer>> reducers;
  for (size_t i = 0; i < n; ++i) {
    std::shared_ptr<ddp::Reducer> reducer = ddp_arg(ddps[i]);
    for (size_t j = 0; j < i; ++j) {
      if (ddps[j] == ddps[i]) fail_invalid("argument 'ddps' holds the same dp_ddp at [", j, "] and [", i, "]");
    }
    reducers.push_back(std::move(reducer));
  }
  ddp::Reducer::join(reducers);
  DP_API_END
}

dp_status dp_ddp_parameter_used(const dp_ddp* ddp, size_t param_index, int* out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  *out = ddp_arg(ddp, false)->parameter_used(param_index) ? 1 : 0;
  DP_API_END
}

dp_status dp_ddp_bucket_plan(const dp_ddp* ddp, char* buf, size_t cap, size_t* len) {
  DP_API_BEGIN
  capi::require_arg(len, "len");
  if (buf == nullptr && cap > 0) fail_invalid("argument 'buf' is NULL but 'cap' is ", cap);
  std::string text = ddp_arg(ddp, false)->plan_text();
  *len = text.size();
  if (buf == nullptr) return DP_OK;
  if (cap <= text.size()) {
    fail_invalid("the plan is ", text.size(), " bytes (", text.size() + 1, " with its NUL) but 'cap' is ", cap);
  }
  std::memcpy(buf, text.c_str(), text.size() + 1);
  DP_API_END
}

dp_status dp_ddp_set_requires_gradient_sync(dp_ddp* ddp, int requires_sync) {
  DP_API_BEGIN
  ddp_arg(ddp)->set_requires_sync(requires_sync != 0);
  DP_API_END
}

size_t dp_ddp_num_buckets(const dp_ddp* ddp) {
  DP_API_BEGIN
  return ddp_arg(ddp, false)->num_buckets();
  DP_API_END_VALUE(0)
}

dp_status dp_ddp_bucket_parameters(const dp_ddp* ddp, size_t bucket, size_t* indices, size_t cap, size_t* count) {
  DP_API_BEGIN
  std::shared_ptr<const ddp::Reducer> reducer = ddp_arg(ddp, false);
  capi::require_arg(count, "count");
  if (indices == nullptr && cap > 0) fail_invalid("argument 'indices' is NULL but 'cap' is ", cap);
  std::vector<size_t> params = reducer->bucket_parameters(bucket);
  for (size_t i = 0; i < params.size() && i < cap; ++i) indices[i] = params[i];
  *count = params.size();
  DP_API_END
}

dp_status dp_ddp_last_stats(const dp_ddp* ddp, dp_ddp_stats* out) {
  DP_API_BEGIN
  ddp::ReducerStats s = ddp_arg(ddp, false)->last_stats();
  dp_ddp_stats full{};
  full.backward_ms = s.backward_ms;
  full.reduce_ms = s.reduce_ms;
  full.exposed_ms = s.exposed_ms;
  full.num_buckets = s.num_buckets;
  full.buckets_rebuilt = s.buckets_rebuilt ? 1 : 0;
  capi::write_stats(out, full);
  DP_API_END
}

dp_status dp_ddp_rebind(dp_ddp* ddp, dp_process_group* pg) {
  DP_API_BEGIN
  std::shared_ptr<ddp::Reducer> old = ddp_arg(ddp);
  const Device device = capi::group_arg(pg, "pg").device();
  if (device != old->device()) {
    fail_invalid("argument 'pg' works on ", to_string(device), " but the dp_ddp's parameters are on ",
                 to_string(old->device()), "; pass a group of their device");
  }
  ddp::ReducerOptions options = old->options_for_rebind();
  if (options.hook == ddp::HookKind::kCustom)
    options.custom_hook = custom_hook(ddp->hook_fn, ddp->hook_user_data, pg->group);
  const bool requires_sync = old->requires_sync();
  std::shared_ptr<Module> module = old->module();
  // Refused mid-iteration, the dp_ddp unchanged; from here on it leaves
  // the old group, which is sent nothing (it may be broken).
  old->retire();
  // Any failure from here leaves the handle without a reducer.
  auto give_up = [ddp](const std::string& why) {
    std::lock_guard<std::mutex> lock(ddp->mutex);
    ddp->reducer.reset();
    ddp->failed_rebind = why;
  };
  try {
    old->close();  // frees its parameters for the new reducer
    std::shared_ptr<ddp::Reducer> fresh = capi::in_stream_order(capi::module_devices(*module, {device}), [&] {
      return std::make_shared<ddp::Reducer>(module, pg->group, std::move(options));
    });
    fresh->set_requires_sync(requires_sync);
    std::lock_guard<std::mutex> lock(ddp->mutex);
    ddp->reducer = std::move(fresh);
  } catch (const Error& e) {
    give_up(e.what());
    fail(e.code(), e.what(), "; the dp_ddp is unusable: only dp_ddp_destroy is left");
  } catch (...) {
    give_up("the new reducer could not be made");
    throw;
  }
  DP_API_END
}

void dp_ddp_destroy(dp_ddp* ddp) {
  if (ddp == nullptr || ddp->tag != kDdpTag || !ddp->origin.is_current()) return;
  std::string refusal = refusal_inside_comm_hook(ddp);
  if (!refusal.empty()) {
    capi::set_last_error(str_cat(__func__, ": ", refusal, "; nothing was destroyed"));
    return;
  }
  ddp->tag = 0;
  try {
    if (ddp->reducer) ddp->reducer->close();
    ddp->reducer.reset();
  } catch (...) {
    // Tearing down cannot fail in a way the caller could act on.
  }
  delete ddp;
}

}  // extern "C"
