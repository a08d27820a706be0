#include "distributed/rendezvous.h"

#include <netdb.h>
#include <unistd.h>

#include <memory>

#include "core/error.h"
#include "distributed/store/tcp_store.h"

namespace dparallel::dist {

namespace {

// The launcher's value of `name` for a field the options left unset.
int32_t unset_field(const EnvLookup& lookup, const char* field, const char* name, int64_t min, int64_t max,
                    const char* hint) {
  if (!is_set(lookup, name)) {
    fail_invalid("the ", field, " is unset (-1) in the options and environment variable ", name,
                 lookup(name) == nullptr ? " is not set (" : " is empty (", hint, ")");
  }
  return static_cast<int32_t>(integer_var(lookup, name, min, max, hint));
}

std::string variable_of(const char* name, const Launcher* launcher) {
  return str_cat(name, " (", launcher != nullptr ? launcher->name : "no launcher", ")");
}

}  // namespace

void resolve_rank(ProcessGroupOptions& options, RankSource source, const EnvLookup& lookup, std::string* from) {
  const Launcher* found = find_launcher(lookup);
  const Launcher& launcher = found != nullptr ? *found : no_launcher();
  std::string rank_from = "the options", size_from = "the options";
  if (source == RankSource::kLaunchEnv) {
    LaunchEnv env = read_launch_env(lookup, options.store == nullptr);
    options.rank = env.rank;
    options.world_size = env.world_size;
    rank_from = variable_of(launcher.rank_var, found);
    size_from = variable_of(launcher.size_var, found);
  } else if (options.rank == -1 || options.world_size == -1) {
    const char* hint = found != nullptr ? launcher.hint
                                        : "set the options' rank and world_size, or start the ranks with torchrun, "
                                          "dp-run, mpirun, mpiexec or srun";
    if (options.world_size == -1) {
      options.world_size = unset_field(lookup, "world size", launcher.size_var, 1, INT32_MAX, hint);
      size_from = variable_of(launcher.size_var, found);
    }
    if (options.rank == -1 && options.world_size > 0) {
      options.rank = unset_field(lookup, "rank", launcher.rank_var, 0, options.world_size - 1, hint);
      rank_from = variable_of(launcher.rank_var, found);
    }
  }
  if (from != nullptr) *from = str_cat("rank from ", rank_from, ", world size from ", size_from);
}

StoreAddress default_store_address(const EnvLookup& lookup) {
  const Launcher* launcher = find_launcher(lookup);
  const char* hint = launcher != nullptr ? launcher->hint
                                         : "the default store is a TCP store at DP_STORE_ADDR:DP_STORE_PORT, else "
                                           "MASTER_ADDR:MASTER_PORT; or pass a store in the options";
  return read_store_address(lookup, launcher, hint);
}

void connect_default_store(ProcessGroupOptions& options, const EnvLookup& lookup) {
  if (options.store == nullptr) {
    StoreAddress address = default_store_address(lookup);
    TcpStoreOptions store_options;
    store_options.host = address.host;
    store_options.port = address.port;
    store_options.is_server = options.rank == 0;
    store_options.timeout = options.timeout;
    store_options.token = job_token(lookup);
    options.store = std::make_shared<TcpStore>(store_options);
    if (options.master_addr.empty()) options.master_addr = address.host;
  }
  for (const char* name : {"DP_STORE_ADDR", "MASTER_ADDR"}) {
    if (options.master_addr.empty() && is_set(lookup, name)) options.master_addr = lookup(name);
  }
}

std::string rendezvous_line(const ProcessGroupOptions& options, const std::string& ranks_from,
                            const EnvLookup& lookup) {
  std::string store = "the options' store";
  if (options.store == nullptr) {
    StoreAddress address = default_store_address(lookup);
    store = str_cat("a TCP store at ", address.host, ":", address.port, " served by rank 0 (host from ",
                    address.host_from, ", port from ", address.port_from, ")");
  }
  return str_cat("dparallel: rank ", options.rank, " of ", options.world_size, ": ", ranks_from, "; store: ", store);
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
