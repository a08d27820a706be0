// dp_replicate.h: replicas, gradient reduction and kept replica sets.
#include "capi/capi_internal.h"
#include "dparallel/dp_replicate.h"

using namespace dparallel;

extern "C" {

dp_status dp_replicate(const dp_module* module, const dp_device* devices, size_t ndevices, int detach,
                       dp_module** out) {
  DP_API_BEGIN
  if (ndevices > 0 && out == nullptr) fail_invalid("argument 'out' is NULL but ", ndevices, " replicas are due");
  for (size_t i = 0; i < ndevices; ++i) out[i] = nullptr;
  Module& m = *capi::module_arg(module, "module");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  std::vector<ModulePtr> replicas =
      capi::in_stream_order(capi::module_devices(m, targets), [&] { return replicate(m, targets, detach != 0); });
  capi::export_modules(replicas, out);
  DP_API_END
}

dp_status dp_reduce_gradients(dp_module* const* replicas, size_t nreplicas, dp_module* target) {
  DP_API_BEGIN
  std::vector<ModulePtr> sources = capi::modules_arg(replicas, nreplicas, "replicas");
  Module& destination = *capi::module_arg(target, "target");
  std::vector<Device> devices = capi::module_devices(destination);
  for (const ModulePtr& source : sources) devices = capi::module_devices(*source, devices);
  capi::in_stream_order(devices, [&] { reduce_gradients(sources, destination); });
  DP_API_END
}

dp_status dp_replica_set_create(dp_replica_set** out, dp_module* module, const dp_device* devices, size_t ndevices) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const ModulePtr& m = capi::module_arg(module, "module");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  auto handle = std::make_unique<dp_replica_set>();
  capi::in_stream_order(capi::module_devices(*m, targets),
                        [&] { handle->set = std::make_unique<ReplicaSet>(m, targets); });
  *out = handle.release();
  DP_API_END
}

dp_status dp_replica_set_sync(dp_replica_set* set) {
  DP_API_BEGIN
  ReplicaSet& s = capi::replica_set_arg(set, "set");
  capi::in_stream_order(capi::module_devices(*s.module(), s.devices()), [&] { s.sync(); });
  DP_API_END
}

dp_status dp_replica_set_replica(const dp_replica_set* set, size_t index, dp_module** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  *out = capi::new_module_handle(capi::replica_set_arg(set, "set").replica(index));
  DP_API_END
}

dp_status dp_replica_set_reduce_gradients(dp_replica_set* set) {
  DP_API_BEGIN
  ReplicaSet& s = capi::replica_set_arg(set, "set");
  capi::in_stream_order(capi::module_devices(*s.module(), s.devices()), [&] { s.reduce_gradients(); });
  DP_API_END
}

void dp_replica_set_destroy(dp_replica_set* set) {
  if (set == nullptr || set->tag != kReplicaSetTag) return;
  set->tag = 0;
  delete set;
}

size_t dp_replica_set_size(const dp_replica_set* set) {
  DP_API_BEGIN
  return capi::replica_set_arg(set, "set").size();
  DP_API_END_VALUE(0)
}

}  // extern "C"
