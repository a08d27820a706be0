// The launcher's environment: torchrun's variables or mpirun's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dparallel::dist {

struct LaunchEnv {
  int32_t rank = -1;
  int32_t world_size = -1;
  int32_t local_rank = -1;
  std::string master_addr;
  uint16_t master_port = 0;
  const char* source = "";  // "torchrun" or "mpirun"
};

using EnvLookup = std::function<const char*(const char*)>;

// torchrun's RANK, WORLD_SIZE, LOCAL_RANK when RANK is set, otherwise
// OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK; both need MASTER_ADDR and
// MASTER_PORT. A missing or malformed variable is kInvalidArgument naming it.
LaunchEnv read_launch_env(const EnvLookup& lookup, bool need_master = true);
LaunchEnv read_launch_env(bool need_master = true);
// The process's environment (getenv).
EnvLookup process_env();
// The integer in variable `name`, in min..max; kInvalidArgument naming it
// (and `hint`, when it is not set) otherwise.
int64_t integer_var(const EnvLookup& lookup, const char* name, int64_t min, int64_t max, const char* hint);
// MASTER_ADDR and MASTER_PORT into `env`.
void read_master(const EnvLookup& lookup, LaunchEnv& env, const char* hint);

}  // namespace dparallel::dist
