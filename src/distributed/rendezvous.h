// Rendezvous: how the ranks of a job find each other. Fills in what a process
// group's options leave to the launcher's environment, and builds the default
// store: a TCP store at MASTER_ADDR:MASTER_PORT that rank 0 serves, guarded by
// the job token. The token guards the rendezvous only: Gloo's and NCCL's own
// traffic is not authenticated.
#pragma once

#include <string>

#include "distributed/group_options.h"
#include "distributed/launch_env.h"

namespace dparallel::dist {

enum class RankSource {
  kOptions,    // the options' rank and world size; the launcher's fill those left unset (-1)
  kLaunchEnv,  // the launcher's (read_launch_env: every variable it names is required)
};

// Sets `options.rank` and `.world_size` from `source`. With kLaunchEnv and no
// store, MASTER_ADDR and MASTER_PORT must be set too. A missing or malformed
// variable is kInvalidArgument naming it; the values are not range-checked
// against each other when both come from the options.
void resolve_rank(ProcessGroupOptions& options, RankSource source, const EnvLookup& lookup);

// Without a store in `options`: connects the default store (MASTER_ADDR and
// MASTER_PORT must be set; nothing else is needed). Sets `master_addr` from
// MASTER_ADDR when it is unset, so that Gloo picks the right interface.
void connect_default_store(ProcessGroupOptions& options, const EnvLookup& lookup);

// The address this host's transports bind to and give their peers when
// DP_SOCKET_IFNAME is unset: with a TCP store, this end's address of its
// connection to the store; else loopback when the store is on this host.
std::string advertised_host(const ProcessGroupOptions& options);

// DP_STORE_TOKEN, or "" when unset.
std::string job_token(const EnvLookup& lookup);

}  // namespace dparallel::dist
