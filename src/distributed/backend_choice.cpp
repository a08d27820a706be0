#include "distributed/backend_choice.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "distributed/backend.h"
#include "distributed/shm/shm_process_group.h"

namespace dparallel::dist {

namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The row that runs AUTO on a device other than cpu: the backend across
// hosts there (NCCL on cuda).
const BackendEntry& automatic_device_backend(const Device& device) {
  for (const BackendEntry& entry : backend_registry()) {
    if (entry.make != nullptr && entry.crosses_hosts && entry.device == device.type) return entry;
  }
  fail(StatusCode::kUnsupported, "no backend runs process groups on ", to_string(device));
}

// DP_CROSS_HOST: the backend an AUTO cpu group's ranks on several hosts
// join across them by ("mpi"), or "" for the registry's first.
std::string cross_host_request() {
  const char* asked = process_env()("DP_CROSS_HOST");
  return asked != nullptr ? asked : "";
}

// What a rank asks for, as it publishes it: AUTO on a cuda device is NCCL;
// AUTO on cpu names DP_CROSS_HOST where set, so that ranks that set it
// differently are refused like ranks that ask for different backends.
std::string request_name(const ProcessGroupOptions& options) {
  if (options.backend == BackendChoice::kAuto && options.device.type != DeviceType::kCpu) {
    return automatic_device_backend(options.device).request;
  }
  std::string request = find_backend(options.backend)->request;
  const std::string cross = cross_host_request();
  if (options.backend == BackendChoice::kAuto && !cross.empty()) request += "+DP_CROSS_HOST=" + cross;
  return request;
}

// The leg across hosts of a hierarchical group: DP_CROSS_HOST's backend
// where set, else the registry's first that fits.
const BackendEntry& cross_host_leg(const Device& device) {
  const std::string asked = cross_host_request();
  if (asked.empty()) return cross_host_backend(device);
  const BackendEntry* entry = find_backend_named(asked);
  if (entry == nullptr || entry->make == nullptr || !entry->crosses_hosts || entry->device != device.type) {
    std::string names;
    for (const BackendEntry& row : backend_registry()) {
      if (row.make != nullptr && row.crosses_hosts && row.device == device.type) {
        names += str_cat(names.empty() ? "" : ", ", "'", row.name, "'");
      }
    }
    fail_invalid("DP_CROSS_HOST is '", asked, "'; it must name a backend that joins ranks across hosts on ",
                 to_string(device), ": ", names);
  }
  check_available(*entry, device);
  return *entry;
}

// One rank's published entry: "<request> <shm allowed 0|1> <pid> <host key>".
struct HostEntry {
  std::string request;
  bool shm_allowed = true;
  int32_t pid = 0;
  std::string host;
};

HostEntry parse_entry(const std::string& text, int32_t r) {
  HostEntry entry;
  size_t allowed_at = text.find(' ');
  size_t pid_at = allowed_at == std::string::npos ? std::string::npos : text.find(' ', allowed_at + 1);
  size_t host_at = pid_at == std::string::npos ? std::string::npos : text.find(' ', pid_at + 1);
  if (host_at == std::string::npos) fail(StatusCode::kRemote, "rank ", r, " published a malformed host entry");
  entry.request = text.substr(0, allowed_at);
  entry.shm_allowed = text.compare(allowed_at + 1, pid_at - allowed_at - 1, "1") == 0;
  entry.pid = std::atoi(text.substr(pid_at + 1, host_at - pid_at - 1).c_str());
  entry.host = text.substr(host_at + 1);
  return entry;
}

// "rank(s) 1, 3 did not join": the ranks whose host entry is not in the
// store, each asked briefly (the group's time is spent).
std::string ranks_not_joined(const ProcessGroupOptions& options, const std::string& prefix) {
  ReplyDeadlineCap brief(kMissingKeysBound);
  std::string ranks;
  try {
    for (int32_t r = 0; r < options.world_size; ++r) {
      if (!options.store->check({str_cat(prefix, "host/", r)})) ranks += str_cat(ranks.empty() ? "" : ", ", r);
    }
  } catch (const Error& e) {
    return str_cat("the store did not say which rank(s) did not join: ", e.what());
  }
  if (ranks.empty()) return "every rank joined, some only after the timeout";
  return str_cat("rank(s) ", ranks, " did not join");
}

// Every rank's entry, this one's published under `prefix` first.
std::vector<HostEntry> exchange_entries(const ProcessGroupOptions& options, const std::string& prefix) {
  EnvLookup lookup = process_env();
  const char* shm = lookup("DP_SHM");
  const bool shm_allowed = shm == nullptr || std::strcmp(shm, "0") != 0;
  auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::string mine = str_cat(request_name(options), " ", shm_allowed ? 1 : 0, " ", ::getpid(), " ", host_key(lookup));
  options.store->set(str_cat(prefix, "host/", options.rank), Bytes(mine.begin(), mine.end()));
  std::vector<HostEntry> entries;
  for (int32_t r = 0; r < options.world_size; ++r) {
    std::string theirs = mine;
    if (r != options.rank) {
      Bytes value = options.store->get(str_cat(prefix, "host/", r), left_until(deadline));
      theirs.assign(value.begin(), value.end());
    }
    entries.push_back(parse_entry(theirs, r));
  }
  return entries;
}

// The hosts in the order of their lowest ranks, and their ranks.
struct Hosts {
  std::vector<std::string> keys;
  std::vector<std::vector<int32_t>> members;
};

Hosts group_by_host(const std::vector<HostEntry>& entries) {
  Hosts hosts;
  for (size_t r = 0; r < entries.size(); ++r) {
    auto it = std::find(hosts.keys.begin(), hosts.keys.end(), entries[r].host);
    if (it == hosts.keys.end()) {
      hosts.keys.push_back(entries[r].host);
      hosts.members.emplace_back();
      it = hosts.keys.end() - 1;
    }
    hosts.members[static_cast<size_t>(it - hosts.keys.begin())].push_back(static_cast<int32_t>(r));
  }
  return hosts;
}

std::string describe_hosts(const Hosts& hosts) {
  std::string text;
  for (size_t h = 0; h < hosts.keys.size(); ++h) {
    std::string ranks;
    for (int32_t r : hosts.members[h]) ranks += str_cat(ranks.empty() ? "" : ", ", r);
    text += str_cat(text.empty() ? "" : "; ", "host '", hosts.keys[h], "': rank(s) ", ranks);
  }
  return text;
}

// Why the ranks cannot make the group they ask for, or null; every rank
// reaches the same from the same entries.
std::unique_ptr<Error> refusal(const ProcessGroupOptions& options, const std::vector<HostEntry>& entries) {
  std::string differing;
  for (size_t r = 1; r < entries.size(); ++r) {
    if (entries[r].request != entries[0].request) {
      differing += str_cat(differing.empty() ? "" : ", ", "rank ", r, " asks for ", entries[r].request);
    }
  }
  if (!differing.empty()) {
    return std::make_unique<Error>(StatusCode::kInvalidArgument,
                                   str_cat("argument 'backend': the ranks ask for different backends: rank 0 asks for ",
                                           entries[0].request, ", ", differing, "; every rank must ask for the same"));
  }
  if (options.backend != BackendChoice::kShm) return nullptr;
  Hosts hosts = group_by_host(entries);
  if (hosts.keys.size() > 1) {
    return std::make_unique<Error>(
        StatusCode::kUnsupported,
        str_cat("DP_BACKEND_SHM: the ranks span ", hosts.keys.size(), " hosts (", describe_hosts(hosts),
                "); shared memory joins the ranks of one host: use DP_BACKEND_AUTO or DP_BACKEND_GLOO"));
  }
  if (options.world_size > kMaxShmRanks) {
    return std::make_unique<Error>(StatusCode::kUnsupported, str_cat("DP_BACKEND_SHM: ", options.world_size,
                                                                     " ranks, but shared memory joins at most ",
                                                                     kMaxShmRanks, "; use DP_BACKEND_GLOO"));
  }
  return nullptr;
}

// Counts this rank under `key` as done with the host entries; rank 0, which
// may serve the store, then waits (up to `deadline`) for every rank: leaving
// before the others read the entries would fail them another way.
void leave_after_every_rank(Store& store, const std::string& key, int32_t rank, int32_t world_size,
                            std::chrono::steady_clock::time_point deadline) noexcept {
  try {
    ReplyDeadlineCap cap(left_until(deadline));
    store.add(key, 1);
    if (rank != 0) return;
    poll_until([&] { return parse_counter(store.get(key, left_until(deadline)), key) >= world_size; },
               left_until(deadline));
  } catch (...) {
    // The store is gone or slow: the refusal stands.
  }
}

// A group over `entry`'s backend, where it can run here.
std::unique_ptr<ProcessGroup> group_of(const BackendEntry& entry, const ProcessGroupOptions& options,
                                       const BackendSetup& setup) {
  check_available(entry, options.device);
  return make_process_group(options, [&](CallSite& site) { return entry.make(site, options, setup); });
}

std::unique_ptr<ProcessGroup> gloo_group(const ProcessGroupOptions& options) {
  return group_of(*find_backend(BackendChoice::kGloo), options, {});
}

// Every rank's pid, by rank.
std::vector<int32_t> pids_of(const std::vector<HostEntry>& entries) {
  std::vector<int32_t> pids;
  pids.reserve(entries.size());
  for (const HostEntry& entry : entries) pids.push_back(entry.pid);
  return pids;
}

// Shared memory for ranks all on one host. Where rank 0 finds no room for
// the segment (memory, or its file-size limit), every rank hears it from
// rank 0 and all take Gloo instead.
std::unique_ptr<ProcessGroup> shm_or_gloo_group(const ProcessGroupOptions& options, const std::string& prefix,
                                                const std::vector<int32_t>& pids) {
  try {
    return group_of(*find_backend(BackendChoice::kShm), options, {prefix, pids});
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfMemory) throw;
    if (options.rank == 0) {
      std::fprintf(stderr, "[dparallel] cpu process group: using Gloo, not shared memory: %s\n", e.what());
    }
  }
  return gloo_group(options);
}

// A cpu group for AUTO (see backend_choice.h).
std::unique_ptr<ProcessGroup> choose_automatically(const ProcessGroupOptions& options, const std::string& prefix,
                                                   const std::vector<HostEntry>& entries, const Hosts& hosts) {
  bool shm_allowed = true;
  for (const HostEntry& entry : entries) shm_allowed = shm_allowed && entry.shm_allowed;
  if (!shm_allowed) return gloo_group(options);
  const std::vector<int32_t> pids = pids_of(entries);
  if (hosts.keys.size() == 1) {
    if (options.world_size <= kMaxShmRanks) return shm_or_gloo_group(options, prefix, pids);
    return gloo_group(options);
  }
  bool even = true;
  std::string counts;
  for (const auto& m : hosts.members) {
    even = even && m.size() == hosts.members[0].size();
    counts += str_cat(counts.empty() ? "" : ", ", m.size());
  }
  const auto local_size = static_cast<int32_t>(hosts.members[0].size());
  if (even && local_size >= 2 && local_size <= kMaxShmRanks) {
    HostLayout layout;
    layout.hosts = static_cast<int32_t>(hosts.keys.size());
    layout.local_size = local_size;
    for (size_t h = 0; h < hosts.members.size(); ++h) {
      for (size_t i = 0; i < hosts.members[h].size(); ++i) {
        if (hosts.members[h][i] == options.rank) {
          layout.host = static_cast<int32_t>(h);
          layout.local_rank = static_cast<int32_t>(i);
          for (int32_t member : hosts.members[h]) layout.local_pids.push_back(pids[static_cast<size_t>(member)]);
        }
      }
    }
    const BackendEntry& local = *find_backend(BackendChoice::kShm);
    const BackendEntry& cross = cross_host_leg(options.device);
    return make_process_group(options, [&](CallSite& site) {
      return create_hierarchical_backend(site, options, prefix, layout, local, cross);
    });
  }
  // One rank per host has nothing to share; uneven hosts would leave some
  // local ranks without peers across hosts.
  if (!even && options.rank == 0) {
    std::fprintf(stderr,
                 "[dparallel] cpu process group: using Gloo for everything, not shared memory inside each host: "
                 "its %zu hosts run different numbers of ranks (%s), and the hierarchical path needs the same "
                 "number on every host\n",
                 hosts.keys.size(), counts.c_str());
  }
  return gloo_group(options);
}

// The group for `options`, the entries published under `prefix` agreeing.
std::unique_ptr<ProcessGroup> choose(const ProcessGroupOptions& options, const std::string& prefix,
                                     const std::vector<HostEntry>& entries) {
  const BackendSetup setup{prefix, pids_of(entries)};
  if (options.backend != BackendChoice::kAuto) return group_of(*find_backend(options.backend), options, setup);
  if (options.device.type != DeviceType::kCpu) {
    return group_of(automatic_device_backend(options.device), options, setup);
  }
  return choose_automatically(options, prefix, entries, group_by_host(entries));
}

}  // namespace

BackendChoice device_backend_choice(BackendChoice backend, const Device& device) {
  if (backend != BackendChoice::kAuto || device.type == DeviceType::kCpu) return backend;
  return automatic_device_backend(device).choice;
}

std::string host_key(const EnvLookup& lookup) {
  std::string host;
  const char* id = lookup("DP_HOST_ID");
  if (id != nullptr && *id != '\0') {
    host = str_cat("id:", id);
  } else {
    char name[256] = {0};
    if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
    host = str_cat("boot:", read_first_line("/proc/sys/kernel/random/boot_id"), "/host:", name);
  }
  // Ranks reach rank 0's door (an abstract socket) only in the same network
  // namespace, and see each other's pids only in the same pid namespace.
  char net_ns[64] = {0};
  if (::readlink("/proc/self/ns/net", net_ns, sizeof(net_ns) - 1) < 0) net_ns[0] = '\0';
  char pid_ns[64] = {0};
  if (::readlink("/proc/self/ns/pid", pid_ns, sizeof(pid_ns) - 1) < 0) pid_ns[0] = '\0';
  return str_cat(host, "/", net_ns, "/", pid_ns);
}

std::unique_ptr<ProcessGroup> create_chosen_process_group(const ProcessGroupOptions& options) {
  auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::string prefix;
  std::vector<HostEntry> entries;
  bool timed_out = false;
  std::string cause;
  {
    ReplyDeadlineCap cap(options.timeout);
    prefix = next_group_prefix(*options.store, "group", options.rank);
    try {
      entries = exchange_entries(options, prefix);
    } catch (const Error& e) {
      if (e.code() != StatusCode::kTimeout) throw;
      timed_out = true;
      cause = e.what();
    }
  }
  if (timed_out) {
    fail(StatusCode::kTimeout, "creating the process group on rank ", options.rank, " of ", options.world_size,
         " timed out after ", options.timeout.count(), " ms: ", ranks_not_joined(options, prefix), " (", cause, ")");
  }
  if (std::unique_ptr<Error> error = refusal(options, entries)) {
    leave_after_every_rank(*options.store, prefix + "refused", options.rank, options.world_size, deadline);
    throw Error(*error);
  }
  std::unique_ptr<ProcessGroup> group = choose(options, prefix, entries);
  GroupLineage lineage{options.store, prefix, options.master_addr, options.backend, {}};
  const Hosts hosts = group_by_host(entries);
  lineage.host_of_rank.resize(entries.size());
  for (size_t h = 0; h < hosts.members.size(); ++h) {
    for (int32_t r : hosts.members[h]) lineage.host_of_rank[static_cast<size_t>(r)] = static_cast<int32_t>(h);
  }
  group->set_lineage(std::move(lineage));
  // Every rank read the host entries before it could take part in creating
  // the group; a refused group leaves them (they cost memory only).
  forget_keys(*options.store, {str_cat(prefix, "host/", options.rank)});
  return group;
}

}  // namespace dparallel::dist
