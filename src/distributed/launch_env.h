// The launcher's environment: which launcher started this process (torchrun
// or dp-run, Open MPI, MPICH or Intel MPI, Slurm), this rank's place in the
// job, and where the default store is.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dparallel::dist {

using EnvLookup = std::function<const char*(const char*)>;

// A launcher's variables for the rank, the world size and the local rank.
struct Launcher {
  const char* name;  // "torchrun", "Open MPI", "MPICH or Intel MPI", "Slurm"
  const char* rank_var;
  const char* size_var;
  const char* local_var;
  bool local_required;  // MPI_LOCALRANKID only comes from some PMI launchers
  const char* hint;     // who sets what, for messages
};

// The first launcher, in the order torchrun (and dp-run), Open MPI,
// MPICH or Intel MPI, Slurm, whose rank or world-size variable is set and
// not empty; nullptr when none is.
const Launcher* find_launcher(const EnvLookup& lookup);
// torchrun's variables, with a hint that names every launcher's: what a
// message names when no launcher is found.
const Launcher& no_launcher();

// Where the default TCP store is, and which variables said so.
struct StoreAddress {
  std::string host;
  uint16_t port = 0;
  std::string host_from;  // "DP_STORE_ADDR", "MASTER_ADDR", "the first host of SLURM_JOB_NODELIST"
  std::string port_from;
};

// First of: DP_STORE_ADDR, MASTER_ADDR, and under Slurm (`launcher` is
// Slurm, or its rank and world-size variables hold what SLURM_PROCID and
// SLURM_NTASKS do, as srun's PMI plugin sets them) the first host of
// SLURM_STEP_NODELIST, else of SLURM_JOB_NODELIST. First of:
// DP_STORE_PORT, MASTER_PORT, and under Slurm kSlurmPortBase +
// (SLURM_JOB_ID + SLURM_STEP_ID) % kSlurmPorts. Empty counts as unset. A
// missing or malformed variable is kInvalidArgument naming it (and `hint`).
StoreAddress read_store_address(const EnvLookup& lookup, const Launcher* launcher, const char* hint);
constexpr int64_t kSlurmPortBase = 20000;
constexpr int64_t kSlurmPorts = 10000;  // 20000..29999: unprivileged, below Linux's ephemeral ports (32768..)

struct LaunchEnv {
  int32_t rank = -1;
  int32_t world_size = -1;
  int32_t local_rank = -1;  // -1 when the launcher does not say (MPI_LOCALRANKID unset)
  const Launcher* launcher = nullptr;
  StoreAddress store;  // with need_store only
};

// The rank, world size and local rank from find_launcher's launcher (every
// variable required, but MPI_LOCALRANKID), and with `need_store` the
// store's address (read_store_address). No launcher found, a missing,
// empty or malformed variable, or a rank past the world size is
// kInvalidArgument naming the variable.
LaunchEnv read_launch_env(const EnvLookup& lookup, bool need_store = true);
// The process's environment (getenv).
EnvLookup process_env();
// The integer in variable `name`, in min..max; kInvalidArgument naming it
// (and `hint`, when it is not set or empty) otherwise.
int64_t integer_var(const EnvLookup& lookup, const char* name, int64_t min, int64_t max, const char* hint);
// Whether `name` is set and not empty.
bool is_set(const EnvLookup& lookup, const char* name);

}  // namespace dparallel::dist
