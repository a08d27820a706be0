#include "distributed/backend_registry.h"

#include "distributed/backend.h"
#include "distributed/shm/shm_process_group.h"

namespace dparallel::dist {

namespace {

std::unique_ptr<Backend> make_gloo(CallSite& site, const ProcessGroupOptions& options, const BackendSetup& /*setup*/) {
  return create_gloo_backend(site, options);
}

std::unique_ptr<Backend> make_nccl(CallSite& site, const ProcessGroupOptions& options, const BackendSetup& /*setup*/) {
  return create_nccl_backend(site, options);
}

std::unique_ptr<Backend> make_mpi(CallSite& site, const ProcessGroupOptions& options, const BackendSetup& /*setup*/) {
  return create_mpi_backend(site, options);
}

std::unique_ptr<Backend> make_shm(CallSite& site, const ProcessGroupOptions& options, const BackendSetup& setup) {
  return create_shm_backend(site, options, setup.prefix, setup.pids);
}

}  // namespace

const std::vector<BackendEntry>& backend_registry() {
  static const std::vector<BackendEntry> rows = {
      {BackendChoice::kAuto, "DP_BACKEND_AUTO", "auto", "automatic", DeviceType::kCpu, false, nullptr, nullptr},
      {BackendChoice::kGloo, "DP_BACKEND_GLOO", "gloo", "Gloo", DeviceType::kCpu, true, make_gloo, nullptr},
      {BackendChoice::kNccl, "DP_BACKEND_NCCL", "nccl", "NCCL", DeviceType::kCuda, true, make_nccl, nccl_availability},
      {BackendChoice::kShm, "DP_BACKEND_SHM", "shm", "shared-memory", DeviceType::kCpu, false, make_shm, nullptr},
      // After Gloo: the cross-host leg is MPI only when asked for (DP_CROSS_HOST=mpi).
      {BackendChoice::kMpi, "DP_BACKEND_MPI", "mpi", "MPI", DeviceType::kCpu, true, make_mpi, mpi_availability},
  };
  return rows;
}

const BackendEntry* find_backend(BackendChoice choice) {
  for (const BackendEntry& entry : backend_registry()) {
    if (entry.choice == choice) return &entry;
  }
  return nullptr;
}

const BackendEntry* find_backend_named(std::string_view name) {
  for (const BackendEntry& entry : backend_registry()) {
    if (name == entry.name) return &entry;
  }
  return nullptr;
}

void check_available(const BackendEntry& entry, const Device& device) {
  if (entry.availability == nullptr) return;
  if (std::optional<Error> why = entry.availability(device)) throw Error(*why);
}

const BackendEntry& cross_host_backend(const Device& device) {
  const BackendEntry* first_fit = nullptr;
  for (const BackendEntry& entry : backend_registry()) {
    if (entry.make == nullptr || !entry.crosses_hosts || entry.device != device.type) continue;
    if (entry.availability == nullptr || !entry.availability(device)) return entry;
    if (first_fit == nullptr) first_fit = &entry;
  }
  // The first that fits says why it cannot run here.
  if (first_fit != nullptr) check_available(*first_fit, device);
  fail(StatusCode::kUnsupported, "no backend joins ranks across hosts on ", to_string(device));
}

}  // namespace dparallel::dist
