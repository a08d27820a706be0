// dp_dist.h: stores, process groups and their work.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "capi/dist_internal.h"
#include "distributed/rendezvous.h"
#include "distributed/store/file_store.h"
#include "distributed/store/tcp_store.h"
#include "lane/debug_level.h"

using namespace dparallel;

static_assert(DP_BACKEND_NCCL == static_cast<int32_t>(dist::BackendChoice::kNccl) &&
              DP_BACKEND_SHM == static_cast<int32_t>(dist::BackendChoice::kShm) &&
              DP_BACKEND_MPI == static_cast<int32_t>(dist::BackendChoice::kMpi));
#define DP_CHECK_REDUCE_OP_CODE(id, code, name, c_name) \
  static_assert((c_name) == static_cast<int32_t>(dist::ReduceOp::id));
DP_REDUCE_OPS(DP_CHECK_REDUCE_OP_CODE)
#undef DP_CHECK_REDUCE_OP_CODE

namespace dparallel::capi {

void check_origin(const ProcessOrigin& origin, const char* name) {
  if (!origin.is_current()) origin.check(str_cat("argument '", name, "'").c_str());
}

dist::Store& store_arg(const dp_store* handle, const char* name) {
  if (handle == nullptr) null_argument(name);
  if (handle->tag != kStoreTag) fail_invalid("argument '", name, "' is not a dp_store handle");
  check_origin(handle->origin, name);
  return *handle->store;
}

dist::ProcessGroup& group_arg(const dp_process_group* handle, const char* name) {
  if (handle == nullptr) null_argument(name);
  if (handle->tag != kGroupTag) {
    fail_invalid("argument '", name, "' is not a dp_process_group handle");
  }
  check_origin(handle->origin, name);
  return *handle->group;
}

}  // namespace dparallel::capi

namespace {

dist::Work& work_arg(const dp_work* handle) {
  if (handle == nullptr) capi::null_argument("work");
  if (handle->tag != kWorkTag) fail_invalid("argument 'work' is not a dp_work handle");
  capi::check_origin(handle->origin, "work");
  return *handle->work;
}

std::string key_arg(const char* key, const char* name) {
  capi::require_arg(key, name);
  if (*key == '\0') fail_invalid("argument '", name, "' is empty");
  return key;
}

dist::Millis timeout_arg(int32_t timeout_ms, const char* name) {
  if (timeout_ms <= 0) fail_invalid("argument '", name, "' is ", timeout_ms, "; it must be > 0");
  return dist::Millis(timeout_ms);
}

std::string env_token() { return dist::job_token(dist::process_env()); }

dp_process_group_options options_arg(const dp_process_group_options* opts) {
  static const dp_process_group_options kDefaults = DP_PROCESS_GROUP_OPTIONS_INIT;
  dp_process_group_options o = capi::read_options(opts, kDefaults, "DP_PROCESS_GROUP_OPTIONS_INIT");
  o.struct_size = sizeof(o);
  return o;
}

dp_process_group* new_group(dp_process_group_options o, dist::RankSource source) {
  dist::ProcessGroupOptions options;
  options.backend = static_cast<dist::BackendChoice>(o.backend);
  options.timeout = dist::Millis(o.timeout_ms);
  // Which device type a backend works on is checked below, before whether
  // the device is present (device_arg).
  bool known_type = o.device.type == DP_DEVICE_CPU || o.device.type == DP_DEVICE_CUDA;
  options.device = known_type ? Device{static_cast<DeviceType>(o.device.type), o.device.index}
                              : capi::device_arg(o.device, "opts->device");
  if (o.store != nullptr) {
    capi::store_arg(o.store, "opts->store");  // checks its tag and process
    options.store = o.store->store;
  }
  options.rank = o.rank;
  options.world_size = o.world_size;
  dist::EnvLookup env = dist::process_env();
  std::string ranks_from;
  dist::resolve_rank(options, source, env, &ranks_from);
  // Before the default store connects: a bad argument fails at once.
  dist::check_process_group_options(options);
  options.device = capi::device_arg(o.device, "opts->device");
  // Before connecting, so that a rank that waits for its store has said where.
  if (lane::debug_level_from_env() != lane::DebugLevel::kOff) {
    std::fprintf(stderr, "%s\n", dist::rendezvous_line(options, ranks_from, env).c_str());
  }
  dist::connect_default_store(options, env);
  auto* handle = new dp_process_group();
  try {
    handle->group = dist::create_process_group(options);
  } catch (...) {
    delete handle;
    throw;
  }
  return handle;
}

dp_status export_work(std::shared_ptr<dist::Work> work, dp_work** out) {
  auto* handle = new dp_work();
  handle->work = std::move(work);
  *out = handle;
  return DP_OK;
}

// Runs one collective on `pg`, blocking or (with `async`) into *out.
// Past the group handle, every argument error refuses the call on this rank
// (ProcessGroup::refuse), so that the other ranks' matching calls fail too:
// `resolve` turns the call's handles into what `start` gives the group.
// The call's device work starts after the host's current stream has passed
// it (core/stream.h); `tensors` are what `resolve` filled in.
template <typename Resolve, typename Start>
dp_status run_collective(dp_process_group* pg, dist::CallKind kind, bool async, dp_work** out,
                         const std::vector<const Tensor*>& tensors, Resolve&& resolve, Start&& start) {
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  try {
    if (async) capi::require_arg(out, "out");
    resolve();
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    group.refuse(kind, e.what(), async);
  }
  std::vector<Device> touched{group.device()};
  for (const Tensor* t : tensors) {
    if (t->defined() && std::find(touched.begin(), touched.end(), t->device()) == touched.end()) {
      touched.push_back(t->device());
    }
  }
  StreamOrder order(touched);
  if (void* transfers = group.transfer_stream()) order.also_order(group.device(), transfers);
  std::shared_ptr<dist::Work> work = start(group);
  if (!async) order.finish();
  return async ? export_work(std::move(work), out) : DP_OK;
}

dp_status all_reduce(dp_process_group* pg, dp_tensor* tensor, int32_t op, bool async, dp_work** out) {
  Tensor t;
  dist::ReduceOp reduce{};
  return run_collective(
      pg, dist::CallKind::kAllReduce, async, out, {&t},
      [&] {
        t = capi::tensor_arg(tensor, "tensor");
        reduce = dist::reduce_op_arg(op, "op");
      },
      [&](dist::ProcessGroup& group) { return group.all_reduce(t, reduce, async); });
}

dp_status broadcast(dp_process_group* pg, dp_tensor* tensor, int32_t root, bool async, dp_work** out) {
  Tensor t;
  return run_collective(
      pg, dist::CallKind::kBroadcast, async, out, {&t}, [&] { t = capi::tensor_arg(tensor, "tensor"); },
      [&](dist::ProcessGroup& group) { return group.broadcast(t, root, async); });
}

dp_status all_gather(dp_process_group* pg, const dp_tensor* input, dp_tensor* const* outputs, size_t noutputs,
                     bool async, dp_work** out) {
  Tensor in;
  std::vector<Tensor> outs;
  std::vector<const Tensor*> touched{&in};
  return run_collective(
      pg, dist::CallKind::kAllGather, async, out, touched,
      [&] {
        in = capi::tensor_arg(input, "input");
        outs = capi::tensors_arg(outputs, noutputs, "outputs");
        for (const Tensor& o : outs) touched.push_back(&o);
      },
      [&](dist::ProcessGroup& group) { return group.all_gather(in, outs, async); });
}

dp_status reduce_scatter(dp_process_group* pg, const dp_tensor* const* inputs, size_t ninputs, dp_tensor* output,
                         int32_t op, bool async, dp_work** out) {
  std::vector<Tensor> ins;
  Tensor o;
  dist::ReduceOp reduce{};
  std::vector<const Tensor*> touched{&o};
  return run_collective(
      pg, dist::CallKind::kReduceScatter, async, out, touched,
      [&] {
        ins = capi::tensors_arg(inputs, ninputs, "inputs");
        for (const Tensor& i : ins) touched.push_back(&i);
        o = capi::tensor_arg(output, "output");
        reduce = dist::reduce_op_arg(op, "op");
      },
      [&](dist::ProcessGroup& group) { return group.reduce_scatter(ins, o, reduce, async); });
}

dp_status barrier(dp_process_group* pg, bool async, dp_work** out) {
  return run_collective(
      pg, dist::CallKind::kBarrier, async, out, {}, [] {},
      [&](dist::ProcessGroup& group) { return group.barrier(async); });
}

}  // namespace

extern "C" {

dp_status dp_store_create_file(dp_store** out, const char* path, int32_t world_size) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  capi::require_arg(path, "path");
  auto store = std::make_shared<dist::FileStore>(path, world_size);
  *out = new dp_store{kStoreTag, store};
  DP_API_END
}

dp_status dp_store_create_tcp(dp_store** out, const char* host, uint16_t port, int32_t world_size, int is_server,
                              int32_t timeout_ms) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  capi::require_arg(host, "host");
  if (world_size <= 0) fail_invalid("argument 'world_size' is ", world_size, "; it must be >= 1");
  dist::TcpStoreOptions options;
  options.host = host;
  options.port = port;
  options.is_server = is_server != 0;
  options.timeout = timeout_arg(timeout_ms, "timeout_ms");
  options.token = env_token();
  options.world_size = world_size;
  auto store = std::make_shared<dist::TcpStore>(options);
  *out = new dp_store{kStoreTag, store};
  DP_API_END
}

dp_status dp_store_set(dp_store* store, const char* key, const void* value, size_t len) {
  DP_API_BEGIN
  dist::Store& s = capi::store_arg(store, "store");
  std::string k = key_arg(key, "key");
  if (len > 0 && value == nullptr) fail_invalid("argument 'value' is NULL but 'len' is ", len);
  const auto* bytes = static_cast<const uint8_t*>(value);
  s.set(k, len == 0 ? dist::Bytes() : dist::Bytes(bytes, bytes + len));
  DP_API_END
}

dp_status dp_store_get(dp_store* store, const char* key, void* buf, size_t cap, size_t* len_out) {
  DP_API_BEGIN
  dist::Store& s = capi::store_arg(store, "store");
  std::string k = key_arg(key, "key");
  capi::require_arg(len_out, "len_out");
  if (buf == nullptr && cap > 0) fail_invalid("argument 'buf' is NULL but 'cap' is ", cap);
  dist::Bytes value = s.get(k, s.default_timeout());
  if (buf != nullptr || cap > 0) {
    if (cap < value.size()) {
      fail_invalid("the value of key '", k, "' is ", value.size(), " bytes but 'cap' is ", cap);
    }
    if (!value.empty()) std::memcpy(buf, value.data(), value.size());
  }
  *len_out = value.size();
  DP_API_END
}

dp_status dp_store_add(dp_store* store, const char* key, int64_t delta, int64_t* out) {
  DP_API_BEGIN
  dist::Store& s = capi::store_arg(store, "store");
  std::string k = key_arg(key, "key");
  int64_t value = s.add(k, delta);
  if (out != nullptr) *out = value;
  DP_API_END
}

dp_status dp_store_wait(dp_store* store, const char* const* keys, size_t nkeys, int32_t timeout_ms) {
  DP_API_BEGIN
  dist::Store& s = capi::store_arg(store, "store");
  if (nkeys > 0 && keys == nullptr) fail_invalid("argument 'keys' is NULL but 'nkeys' is ", nkeys);
  std::vector<std::string> list;
  for (size_t i = 0; i < nkeys; ++i) list.push_back(key_arg(keys[i], str_cat("keys[", i, "]").c_str()));
  s.wait(list, timeout_ms < 0 ? s.default_timeout() : dist::Millis(timeout_ms));
  DP_API_END
}

void dp_store_destroy(dp_store* store) {
  if (store == nullptr || store->tag != kStoreTag || !store->origin.is_current()) return;
  store->tag = 0;
  delete store;
}

dp_status dp_store_tcp_port(const dp_store* store, uint16_t* out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  const auto* tcp = dynamic_cast<const dist::TcpStore*>(&capi::store_arg(store, "store"));
  if (tcp == nullptr) fail_invalid("argument 'store' is a file store; only TCP stores have a port");
  *out = tcp->port();
  DP_API_END
}

dp_status dp_store_set_timeout(dp_store* store, int32_t timeout_ms) {
  DP_API_BEGIN
  capi::store_arg(store, "store").set_default_timeout(timeout_arg(timeout_ms, "timeout_ms"));
  DP_API_END
}

dp_status dp_process_group_options_init(dp_process_group_options* opts, size_t struct_size) {
  DP_API_BEGIN
  static const dp_process_group_options kDefaults = DP_PROCESS_GROUP_OPTIONS_INIT;
  capi::options_init(opts, struct_size, kDefaults);
  DP_API_END
}

dp_status dp_process_group_create(dp_process_group** out, const dp_process_group_options* opts) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  capi::require_arg(opts, "opts");
  *out = new_group(options_arg(opts), dist::RankSource::kOptions);
  DP_API_END
}

dp_status dp_process_group_create_from_env(dp_process_group** out, const dp_process_group_options* opts) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = new_group(options_arg(opts), dist::RankSource::kLaunchEnv);
  DP_API_END
}

int32_t dp_process_group_rank(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").rank();
  DP_API_END_VALUE(-1)
}

int32_t dp_process_group_size(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").size();
  DP_API_END_VALUE(-1)
}

const char* dp_process_group_backend(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").backend_name();
  DP_API_END_VALUE(nullptr)
}

dp_status dp_process_group_split(dp_process_group* pg, int32_t color, int32_t key, const dp_process_group_options* opts,
                                 dp_process_group** out) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  dist::SplitOptions options;
  options.timeout = group.timeout();
  options.device = group.device();
  try {
    capi::require_arg(out, "out");
    if (opts != nullptr) {
      dp_process_group_options o = options_arg(opts);
      options.backend = static_cast<dist::BackendChoice>(o.backend);
      options.timeout = timeout_arg(o.timeout_ms, "opts->timeout_ms");
      options.device = capi::device_arg(o.device, "opts->device");
    }
  } catch (const Error& e) {
    // Refused in the exchange's place, so that the other ranks fail now too.
    group.refuse(dist::CallKind::kAllGather, e.what(), false);
  }
  std::unique_ptr<dist::ProcessGroup> child = group.split(color, key, options);
  if (child) {
    auto* handle = new dp_process_group();
    handle->group = std::move(child);
    *out = handle;
  }
  DP_API_END
}

int32_t dp_process_group_local_rank(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").local_rank();
  DP_API_END_VALUE(-1)
}

int32_t dp_process_group_local_size(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").local_size();
  DP_API_END_VALUE(-1)
}

int32_t dp_process_group_num_hosts(const dp_process_group* pg) {
  DP_API_BEGIN
  return capi::group_arg(pg, "pg").num_hosts();
  DP_API_END_VALUE(-1)
}

dp_status dp_process_group_abort(dp_process_group* pg) {
  DP_API_BEGIN
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  group.abort_calls(str_cat("aborted by dp_process_group_abort on rank ", group.rank()));
  DP_API_END
}

dp_status dp_process_group_shrink(dp_process_group* pg, dp_process_group** out) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  capi::require_arg(out, "out");
  std::unique_ptr<dist::ProcessGroup> shrunk = group.shrink();
  std::string lost;
  for (int32_t r : shrunk->lost_ranks()) lost += str_cat(lost.empty() ? "" : ", ", r);
  const std::string now = str_cat("rank ", group.rank(), " of ", group.size(), " is rank ", shrunk->rank(), " of ",
                                  shrunk->size(), " in the new group");
  auto* handle = new dp_process_group();
  handle->group = std::move(shrunk);
  *out = handle;
  capi::set_last_error(lost.empty() ? str_cat("dp_process_group_shrink: no rank was lost; ", now)
                                    : str_cat("dp_process_group_shrink: rank(s) ", lost, " lost; ", now));
  DP_API_END
}

int32_t dp_process_group_lost_ranks(const dp_process_group* pg, int32_t* ranks, size_t cap) {
  DP_API_BEGIN
  // const: the handle is only read; the group's list is guarded inside.
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  if (ranks == nullptr && cap > 0) capi::null_argument("ranks");
  std::vector<int32_t> lost = group.lost_ranks();
  std::copy_n(lost.begin(), std::min(cap, lost.size()), ranks);
  return static_cast<int32_t>(lost.size());
  DP_API_END_VALUE(-1)
}

void dp_process_group_destroy(dp_process_group* pg) {
  if (pg == nullptr || pg->tag != kGroupTag || !pg->origin.is_current() || !capi::destroy_allowed(pg, __func__)) {
    return;
  }
  pg->tag = 0;
  try {
    pg->group.reset();
  } catch (...) {
    // Leaving the group cannot fail in a way the caller could act on.
  }
  delete pg;
}

dp_status dp_pg_all_reduce(dp_process_group* pg, dp_tensor* tensor, int32_t op) {
  DP_API_BEGIN
  return all_reduce(pg, tensor, op, false, nullptr);
  DP_API_END
}

dp_status dp_pg_all_reduce_async(dp_process_group* pg, dp_tensor* tensor, int32_t op, dp_work** out) {
  DP_API_BEGIN
  return all_reduce(pg, tensor, op, true, out);
  DP_API_END
}

dp_status dp_pg_broadcast(dp_process_group* pg, dp_tensor* tensor, int32_t root) {
  DP_API_BEGIN
  return broadcast(pg, tensor, root, false, nullptr);
  DP_API_END
}

dp_status dp_pg_broadcast_async(dp_process_group* pg, dp_tensor* tensor, int32_t root, dp_work** out) {
  DP_API_BEGIN
  return broadcast(pg, tensor, root, true, out);
  DP_API_END
}

dp_status dp_pg_all_gather(dp_process_group* pg, const dp_tensor* input, dp_tensor* const* outputs, size_t noutputs) {
  DP_API_BEGIN
  return all_gather(pg, input, outputs, noutputs, false, nullptr);
  DP_API_END
}

dp_status dp_pg_all_gather_async(dp_process_group* pg, const dp_tensor* input, dp_tensor* const* outputs,
                                 size_t noutputs, dp_work** out) {
  DP_API_BEGIN
  return all_gather(pg, input, outputs, noutputs, true, out);
  DP_API_END
}

dp_status dp_pg_reduce_scatter(dp_process_group* pg, const dp_tensor* const* inputs, size_t ninputs, dp_tensor* output,
                               int32_t op) {
  DP_API_BEGIN
  return reduce_scatter(pg, inputs, ninputs, output, op, false, nullptr);
  DP_API_END
}

dp_status dp_pg_reduce_scatter_async(dp_process_group* pg, const dp_tensor* const* inputs, size_t ninputs,
                                     dp_tensor* output, int32_t op, dp_work** out) {
  DP_API_BEGIN
  return reduce_scatter(pg, inputs, ninputs, output, op, true, out);
  DP_API_END
}

dp_status dp_pg_barrier(dp_process_group* pg) {
  DP_API_BEGIN
  return barrier(pg, false, nullptr);
  DP_API_END
}

dp_status dp_pg_barrier_async(dp_process_group* pg, dp_work** out) {
  DP_API_BEGIN
  return barrier(pg, true, out);
  DP_API_END
}

dp_status dp_work_wait(dp_work* work) {
  DP_API_BEGIN
  work_arg(work).wait();
  DP_API_END
}

dp_status dp_work_test(dp_work* work, int* done) {
  DP_API_BEGIN
  capi::require_arg(done, "done");
  *done = work_arg(work).done() ? 1 : 0;
  DP_API_END
}

void dp_work_destroy(dp_work* work) {
  if (work == nullptr || work->tag != kWorkTag || !work->origin.is_current()) return;
  work->tag = 0;
  delete work;
}

}  // extern "C"
