#include "distributed/rendezvous.h"

#include <netdb.h>
#include <unistd.h>

#include <memory>

#include "core/error.h"
#include "distributed/store/tcp_store.h"

namespace dparallel::dist {

namespace {

bool is_set(const EnvLookup& lookup, const char* name) {
  const char* value = lookup(name);
  return value != nullptr && *value != '\0';
}

// The launcher's value of `name` for a field the options left unset.
int32_t unset_field(const EnvLookup& lookup, const char* field, const char* name, int64_t min, int64_t max,
                    const char* hint) {
  if (!is_set(lookup, name)) {
    fail_invalid("the ", field, " is unset (-1) in the options and environment variable ", name, " is not set (", hint,
                 ")");
  }
  return static_cast<int32_t>(integer_var(lookup, name, min, max, hint));
}

}  // namespace

void resolve_rank(ProcessGroupOptions& options, RankSource source, const EnvLookup& lookup) {
  if (source == RankSource::kLaunchEnv) {
    LaunchEnv env = read_launch_env(lookup, options.store == nullptr);
    options.rank = env.rank;
    options.world_size = env.world_size;
    return;
  }
  if (options.rank != -1 && options.world_size != -1) return;
  // mpirun's variables only when torchrun's are absent, as read_launch_env.
  bool mpirun = !is_set(lookup, "RANK") && !is_set(lookup, "WORLD_SIZE") &&
                (is_set(lookup, "OMPI_COMM_WORLD_RANK") || is_set(lookup, "OMPI_COMM_WORLD_SIZE"));
  const char* rank_var = mpirun ? "OMPI_COMM_WORLD_RANK" : "RANK";
  const char* size_var = mpirun ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE";
  const char* hint = mpirun ? "mpirun sets OMPI_COMM_WORLD_RANK and _SIZE"
                            : "set the options' rank and world_size, or run under torchrun or dp-run";
  if (options.world_size == -1) options.world_size = unset_field(lookup, "world size", size_var, 1, INT32_MAX, hint);
  if (options.rank == -1 && options.world_size > 0) {
    options.rank = unset_field(lookup, "rank", rank_var, 0, options.world_size - 1, hint);
  }
}

void connect_default_store(ProcessGroupOptions& options, const EnvLookup& lookup) {
  if (options.store == nullptr) {
    LaunchEnv master;
    read_master(lookup, master,
                "the default store is a TCP store at MASTER_ADDR:MASTER_PORT; or pass a store in the options");
    TcpStoreOptions store_options;
    store_options.host = master.master_addr;
    store_options.port = master.master_port;
    store_options.is_server = options.rank == 0;
    store_options.timeout = options.timeout;
    store_options.token = job_token(lookup);
    options.store = std::make_shared<TcpStore>(store_options);
    options.master_addr = master.master_addr;
  }
  if (options.master_addr.empty() && is_set(lookup, "MASTER_ADDR")) options.master_addr = lookup("MASTER_ADDR");
}

std::string advertised_host(const ProcessGroupOptions& options) {
  // The address this host reaches the store from is one the other ranks can
  // reach it on too; the host name may resolve to a loopback address.
  if (auto* tcp = dynamic_cast<TcpStore*>(PrefixStore::innermost(options.store.get()))) {
    sockaddr_storage local = tcp->local_address();
    char host[NI_MAXHOST] = {0};
    if (local.ss_family != AF_UNSPEC && ::getnameinfo(reinterpret_cast<sockaddr*>(&local), sizeof(local), host,
                                                      sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0) {
      return host;
    }
  }
  if (options.master_addr.empty() || net::is_loopback_host(options.master_addr)) return "127.0.0.1";
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) fail(StatusCode::kIo, "gethostname failed");
  return host;
}

std::string job_token(const EnvLookup& lookup) {
  const char* token = lookup("DP_STORE_TOKEN");
  return token == nullptr ? std::string() : std::string(token);
}

}  // namespace dparallel::dist
