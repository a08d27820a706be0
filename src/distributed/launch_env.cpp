#include "distributed/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "distributed/nodelist.h"

namespace dparallel::dist {

namespace {

// In the order they are looked for: a launcher started inside another's
// job (torchrun or mpirun in a Slurm allocation) sets its own variables
// beside the outer one's.
const Launcher kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", true,
     "torchrun and dp-run set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", true,
     "Open MPI's mpirun sets OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK; MASTER_ADDR and MASTER_PORT are yours to "
     "set"},
    {"MPICH or Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", false,
     "MPICH's and Intel MPI's mpiexec set PMI_RANK and PMI_SIZE; MASTER_ADDR and MASTER_PORT are yours to set"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", true,
     "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST and SLURM_JOB_ID for each task"},
};
const Launcher* const kSlurm = &kLaunchers[3];

const Launcher kNoLauncher = {
    "torchrun",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    true,
    "no launcher's variables are set: torchrun and dp-run set RANK and WORLD_SIZE, Open MPI's mpirun "
    "OMPI_COMM_WORLD_RANK and _SIZE, MPICH's and Intel MPI's mpiexec PMI_RANK and PMI_SIZE, Slurm's srun "
    "SLURM_PROCID and SLURM_NTASKS"};

constexpr const char* kDefaultHost = "MASTER_ADDR";
constexpr const char* kDefaultPort = "MASTER_PORT";

bool same_text(const EnvLookup& lookup, const char* a, const char* b) {
  return is_set(lookup, a) && is_set(lookup, b) && std::strcmp(lookup(a), lookup(b)) == 0;
}

// Whether srun started these ranks: its variables were found, or the
// launcher's agree with them (srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE
// too). mpirun in an allocation starts its ranks from daemons that srun
// started one per node: theirs do not agree (but for one rank a node, when
// the daemons' step places rank 0 alike).
bool is_slurm(const EnvLookup& lookup, const Launcher* launcher) {
  if (launcher == nullptr) return false;
  if (launcher == kSlurm) return true;
  return same_text(lookup, launcher->rank_var, "SLURM_PROCID") && same_text(lookup, launcher->size_var, "SLURM_NTASKS");
}

const char* unset_or_empty(const EnvLookup& lookup, const char* name) {
  return lookup(name) == nullptr ? "is not set" : "is empty";
}

void read_store_host(const EnvLookup& lookup, const Launcher* launcher, const char* hint, StoreAddress& address) {
  for (const char* name : {"DP_STORE_ADDR", kDefaultHost}) {
    if (is_set(lookup, name)) {
      address.host = lookup(name);
      address.host_from = name;
      return;
    }
  }
  if (is_slurm(lookup, launcher)) {
    // The step's nodes, where its task 0 runs; the job's outside a step.
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
      if (is_set(lookup, name)) {
        address.host = first_host(lookup(name), name);
        address.host_from = std::string("the first host of ") + name;
        return;
      }
    }
    fail_invalid("environment variable ", kDefaultHost, " ", unset_or_empty(lookup, kDefaultHost),
                 ", and environment variable SLURM_JOB_NODELIST ", unset_or_empty(lookup, "SLURM_JOB_NODELIST"), " (",
                 hint, ")");
  }
  fail_invalid("environment variable ", kDefaultHost, " ", unset_or_empty(lookup, kDefaultHost), " (", hint, ")");
}

void read_store_port(const EnvLookup& lookup, const Launcher* launcher, const char* hint, StoreAddress& address) {
  for (const char* name : {"DP_STORE_PORT", kDefaultPort}) {
    if (is_set(lookup, name)) {
      address.port = static_cast<uint16_t>(integer_var(lookup, name, 1, 65535, hint));
      address.port_from = name;
      return;
    }
  }
  if (is_slurm(lookup, launcher) && is_set(lookup, "SLURM_JOB_ID")) {
    // Steps of one job that run at once on one host get ports of their own.
    int64_t key = integer_var(lookup, "SLURM_JOB_ID", 0, INT64_MAX, hint) % kSlurmPorts;
    if (is_set(lookup, "SLURM_STEP_ID")) key += integer_var(lookup, "SLURM_STEP_ID", 0, INT64_MAX, hint) % kSlurmPorts;
    address.port = static_cast<uint16_t>(kSlurmPortBase + key % kSlurmPorts);
    address.port_from = is_set(lookup, "SLURM_STEP_ID") ? "SLURM_JOB_ID and SLURM_STEP_ID" : "SLURM_JOB_ID";
    return;
  }
  if (is_slurm(lookup, launcher)) {
    fail_invalid("environment variable ", kDefaultPort, " ", unset_or_empty(lookup, kDefaultPort),
                 ", and environment variable SLURM_JOB_ID ", unset_or_empty(lookup, "SLURM_JOB_ID"), " (", hint, ")");
  }
  fail_invalid("environment variable ", kDefaultPort, " ", unset_or_empty(lookup, kDefaultPort), " (", hint, ")");
}

}  // namespace

bool is_set(const EnvLookup& lookup, const char* name) {
  const char* value = lookup(name);
  return value != nullptr && *value != '\0';
}

int64_t integer_var(const EnvLookup& lookup, const char* name, int64_t min, int64_t max, const char* hint) {
  const char* text = lookup(name);
  if (text == nullptr) fail_invalid("environment variable ", name, " is not set (", hint, ")");
  if (*text == '\0') fail_invalid("environment variable ", name, " is empty (", hint, ")");
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text, &end, 10);
  // Digits only, an optional '-' first: no spaces, no '+'.
  const bool digits = (text[0] >= '0' && text[0] <= '9') || (text[0] == '-' && text[1] >= '0' && text[1] <= '9');
  if (!digits || errno != 0 || *end != '\0' || value < min || value > max) {
    fail_invalid("environment variable ", name, " is ", quoted_value(text), "; it must be an integer in ", min, "..",
                 max);
  }
  return value;
}

const Launcher* find_launcher(const EnvLookup& lookup) {
  for (const Launcher& launcher : kLaunchers) {
    if (is_set(lookup, launcher.rank_var) || is_set(lookup, launcher.size_var)) return &launcher;
  }
  return nullptr;
}

const Launcher& no_launcher() { return kNoLauncher; }

StoreAddress read_store_address(const EnvLookup& lookup, const Launcher* launcher, const char* hint) {
  StoreAddress address;
  read_store_host(lookup, launcher, hint, address);
  read_store_port(lookup, launcher, hint, address);
  return address;
}

LaunchEnv read_launch_env(const EnvLookup& lookup, bool need_store) {
  LaunchEnv env;
  env.launcher = find_launcher(lookup);
  const Launcher& launcher = env.launcher != nullptr ? *env.launcher : no_launcher();
  env.world_size = static_cast<int32_t>(integer_var(lookup, launcher.size_var, 1, INT32_MAX, launcher.hint));
  env.rank = static_cast<int32_t>(integer_var(lookup, launcher.rank_var, 0, env.world_size - 1, launcher.hint));
  if (launcher.local_required || lookup(launcher.local_var) != nullptr) {
    env.local_rank =
        static_cast<int32_t>(integer_var(lookup, launcher.local_var, 0, env.world_size - 1, launcher.hint));
  }
  if (need_store) env.store = read_store_address(lookup, env.launcher, launcher.hint);
  return env;
}

EnvLookup process_env() {
  return [](const char* name) { return static_cast<const char*>(std::getenv(name)); };
}

}  // namespace dparallel::dist
