// Which backend a new group runs. Every rank publishes through the store the
// backend it asks for, whether it allows shared memory (DP_SHM), its pid and
// its host; all read the same entries, so all choose alike or fail alike:
//   ranks that ask for different backends: kInvalidArgument naming them;
//   NCCL (or AUTO on a cuda device): NCCL;
//   GLOO: Gloo, even when every rank runs on one host;
//   SHM: shared memory; kUnsupported naming the hosts when the ranks span several;
//   AUTO on cpu, unless DP_SHM is "0" on any rank: shared memory when every
//   rank runs on one host; hierarchical (shared memory inside each host,
//   Gloo across) when the ranks span hosts with the same number of ranks,
//   at least 2, on each (its leg across hosts the registry's first row that
//   crosses hosts on the device, backend_registry.h, or the one DP_CROSS_HOST
//   names: "mpi"); else Gloo. Ranks whose DP_CROSS_HOST differs ask for
//   different backends.
#pragma once

#include <memory>
#include <string>

#include "distributed/launch_env.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

// The group `options` ask for, after check_process_group_options.
std::unique_ptr<ProcessGroup> create_chosen_process_group(const ProcessGroupOptions& options);

// The backend a group asking for `backend` on `device` runs where that
// needs no knowledge of the hosts: `backend` itself, or the device's row for
// AUTO on a device other than cpu; kAuto for AUTO on cpu.
BackendChoice device_backend_choice(BackendChoice backend, const Device& device);

// This host as the ranks compare it: DP_HOST_ID when set (tests pretend to be
// several hosts with it), else the kernel's boot id and the host name; and
// the network and pid namespaces this process is in (containers on one
// machine may have their own).
std::string host_key(const EnvLookup& lookup);

}  // namespace dparallel::dist
