// Rendezvous: how the ranks of a job find each other. Fills in what a process
// group's options leave to the launcher's environment, and builds the default
// store: a TCP store that rank 0 serves (at DP_STORE_ADDR:DP_STORE_PORT, else
// MASTER_ADDR:MASTER_PORT; read_store_address), guarded by the job token. The token guards the rendezvous only: Gloo's
// and NCCL's own traffic is not authenticated.
#pragma once

#include <string>

#include "distributed/group_options.h"
#include "distributed/launch_env.h"

namespace dparallel::dist {

enum class RankSource {
  kOptions,    // the options' rank and world size; the launcher's fill those left unset (-1)
  kLaunchEnv,  // the launcher's (read_launch_env: every variable it names is required)
};

// Sets `options.rank` and `.world_size` from `source`, the launcher's
// variables being find_launcher's. With kLaunchEnv and no store, the store's
// address must be there too (read_store_address). A missing or malformed
// variable is kInvalidArgument naming it; the values are not range-checked
// against each other when both come from the options. `from`, when not
// null, receives where they came from ("rank from SLURM_PROCID (Slurm),
// ..."), for DP_DEBUG.
void resolve_rank(ProcessGroupOptions& options, RankSource source, const EnvLookup& lookup,
                  std::string* from = nullptr);

// Where the default store is: read_store_address under find_launcher's launcher.
StoreAddress default_store_address(const EnvLookup& lookup);

// Without a store in `options`: connects the default store at
// default_store_address (nothing else is needed). Sets `master_addr` to the
// store's host (with a store in `options`: DP_STORE_ADDR, else MASTER_ADDR,
// when set) unless set, so that Gloo picks the right interface.
void connect_default_store(ProcessGroupOptions& options, const EnvLookup& lookup);

// What DP_DEBUG says when a group is created: this rank, the world size,
// `ranks_from` (resolve_rank's) and the store ("dparallel: rank 1 of 4 ...").
std::string rendezvous_line(const ProcessGroupOptions& options, const std::string& ranks_from, const EnvLookup& lookup);

// The address this host's transports bind to and give their peers when
// DP_SOCKET_IFNAME is unset: with a TCP store, this end's address of its
// connection to the store; else loopback when the store is on this host.
std::string advertised_host(const ProcessGroupOptions& options);

// DP_STORE_TOKEN, or "" when unset.
std::string job_token(const EnvLookup& lookup);

}  // namespace dparallel::dist
