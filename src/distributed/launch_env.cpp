#include "distributed/launch_env.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace dparallel::dist {

int64_t integer_var(const EnvLookup& lookup, const char* name, int64_t min, int64_t max, const char* hint) {
  const char* text = lookup(name);
  if (text == nullptr || *text == '\0') fail_invalid("environment variable ", name, " is not set (", hint, ")");
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < min || value > max) {
    fail_invalid("environment variable ", name, " is '", text, "'; it must be an integer in ", min, "..", max);
  }
  return value;
}

void read_master(const EnvLookup& lookup, LaunchEnv& env, const char* hint) {
  const char* addr = lookup("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') fail_invalid("environment variable MASTER_ADDR is not set (", hint, ")");
  env.master_addr = addr;
  env.master_port = static_cast<uint16_t>(integer_var(lookup, "MASTER_PORT", 1, 65535, hint));
}

LaunchEnv read_launch_env(const EnvLookup& lookup, bool need_master) {
  LaunchEnv env;
  const char* rank_var = "RANK";
  const char* size_var = "WORLD_SIZE";
  const char* local_var = "LOCAL_RANK";
  const char* hint = "torchrun and dp-run set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT";
  env.source = "torchrun";
  const char* torch_rank = lookup("RANK");
  if ((torch_rank == nullptr || *torch_rank == '\0') && lookup("OMPI_COMM_WORLD_RANK") != nullptr) {
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    local_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    hint = "mpirun sets OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK; MASTER_ADDR and MASTER_PORT are yours to set";
    env.source = "mpirun";
  }
  env.world_size = static_cast<int32_t>(integer_var(lookup, size_var, 1, INT32_MAX, hint));
  env.rank = static_cast<int32_t>(integer_var(lookup, rank_var, 0, env.world_size - 1, hint));
  env.local_rank = static_cast<int32_t>(integer_var(lookup, local_var, 0, env.world_size - 1, hint));
  if (need_master) read_master(lookup, env, hint);
  return env;
}

EnvLookup process_env() {
  return [](const char* name) { return static_cast<const char*>(std::getenv(name)); };
}

LaunchEnv read_launch_env(bool need_master) { return read_launch_env(process_env(), need_master); }

}  // namespace dparallel::dist
