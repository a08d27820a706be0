// The backends a host can ask for, in one table: each DP_BACKEND_* value
// with its names, the factory of its backend, where it runs and whether it
// can run in this process. The front's option checks, the choice of a new
// group's backend (backend_choice.h) and the hierarchical group's leg
// across hosts all read it; nothing else names a backend.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/error.h"

namespace dparallel::dist {

// The backend a host asks for (DP_BACKEND_*); what runs is the group's backend_name().
enum class BackendChoice : int32_t { kAuto = 0, kGloo = 1, kNccl = 2, kShm = 3, kMpi = 4 };

class Backend;
class CallSite;
struct ProcessGroupOptions;

// What a factory may need beyond the options.
struct BackendSetup {
  std::string prefix;         // the group's own namespace in the store
  std::vector<int32_t> pids;  // every rank's pid by rank, where known beforehand
};

using BackendMaker = std::unique_ptr<Backend> (*)(CallSite& site, const ProcessGroupOptions& options,
                                                  const BackendSetup& setup);
// Why the backend cannot run a group on `device` in this process (the error
// to throw), or nullopt.
using BackendAvailability = std::optional<Error> (*)(const Device& device);

struct BackendEntry {
  BackendChoice choice;
  const char* request;  // "DP_BACKEND_GLOO": the value's name in the C API
  const char* name;     // "gloo": its groups' backend_name()
  const char* title;    // "Gloo": in messages
  // Where its tensors live; AUTO's rows choose per device.
  DeviceType device;
  // Joins ranks on several hosts (shared memory joins one host's).
  bool crosses_hosts;
  BackendMaker make;                 // null for AUTO, which picks another row
  BackendAvailability availability;  // null: always available
};

// Every row, in DP_BACKEND_* order: a cross-host leg is the first that fits.
const std::vector<BackendEntry>& backend_registry();
// The row of `choice`, or null for a value no row has.
const BackendEntry* find_backend(BackendChoice choice);
// The row whose name (backend_name()) is `name`, or null.
const BackendEntry* find_backend_named(std::string_view name);
// Throws `entry`'s availability error for `device`, if any.
void check_available(const BackendEntry& entry, const Device& device);
// The leg across hosts of a hierarchical group on `device`: the first row
// that crosses hosts, runs there and is available; kUnsupported naming the
// rows tried when none is.
const BackendEntry& cross_host_backend(const Device& device);

// The NCCL row's availability: kUnsupported in a build without NCCL,
// kDevice when `device` is no GPU of this process.
std::optional<Error> nccl_availability(const Device& device);
// The MPI row's availability: loads the site's MPI library (only then, so a
// process that never asks for MPI never maps it); kUnsupported saying why
// when none can run here.
std::optional<Error> mpi_availability(const Device& device);

}  // namespace dparallel::dist
