// The shared-memory backend: the ranks of a cpu group that all run on one
// host reduce through a segment they map (segment.h) instead of sockets.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/backend.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

// Beyond this many ranks a round's piece per rank would not fill a cache line.
constexpr int32_t kMaxShmRanks = 1024;

// The backend of the ranks in `options`, all on this host, through shared
// memory; `prefix` is the group's own namespace in the store. `pids`, each
// rank's process id when known beforehand, lets a rank that dies before it
// maps the segment fail the others at once rather than at their timeout.
std::unique_ptr<Backend> create_shm_backend(CallSite& site, const ProcessGroupOptions& options,
                                            const std::string& prefix, const std::vector<int32_t>& pids = {});
// A group over that backend.
std::unique_ptr<ProcessGroup> create_shm_process_group(const ProcessGroupOptions& options, const std::string& prefix,
                                                       const std::vector<int32_t>& pids = {});

// Where a rank sits when the ranks span several hosts with the same number on each.
struct HostLayout {
  int32_t host = 0;  // this rank's host, 0..hosts-1 in the order of the hosts' lowest ranks
  int32_t hosts = 1;
  int32_t local_rank = 0;           // its index among its host's ranks, in rank order
  int32_t local_size = 1;           // ranks on every host
  std::vector<int32_t> local_pids;  // this host's ranks' pids, by local rank
};

// The backend of ranks on several hosts: `local`'s backend inside each,
// `cross`'s across (rows of backend_registry.h; hierarchical_backend.cpp);
// `prefix` is the group's own namespace in the store.
std::unique_ptr<Backend> create_hierarchical_backend(CallSite& site, const ProcessGroupOptions& options,
                                                     const std::string& prefix, const HostLayout& layout,
                                                     const BackendEntry& local, const BackendEntry& cross);

}  // namespace dparallel::dist
