// The backends the conformance suite runs its scenarios over, and the one
// place that says how a rank selects each.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "dparallel/dparallel.h"

namespace dptest {

enum class Backend { kGloo, kShm, kHierarchical, kNccl };

struct BackendNames {
  Backend backend;
  const char* name;      // the suite's: ctest names, DP_TEST_BACKEND
  const char* reported;  // what dp_process_group_backend answers
};

inline const BackendNames kBackendNames[] = {{Backend::kGloo, "gloo", "gloo"},
                                             {Backend::kShm, "shm", "shm"},
                                             {Backend::kHierarchical, "hierarchical", "shm+gloo"},
                                             {Backend::kNccl, "nccl", "nccl"}};

inline const BackendNames& names_of(Backend b) { return kBackendNames[static_cast<int>(b)]; }
inline const char* backend_name(Backend b) { return names_of(b).name; }
inline const char* reported_backend(Backend b) { return names_of(b).reported; }

inline bool backend_from_name(const char* name, Backend* out) {
  for (const BackendNames& b : kBackendNames) {
    if (name != nullptr && std::strcmp(name, b.name) == 0) {
      *out = b.backend;
      return true;
    }
  }
  return false;
}

// Ranks in a job with `per_host` ranks on each host: hierarchical runs on two
// pretend hosts, the others on one.
inline int world_size(Backend b, int per_host) { return b == Backend::kHierarchical ? 2 * per_host : per_host; }

// Makes this rank's group, created with `opts` next, run over `b`. Rank r of
// a hierarchical job counts as on host r / (world / 2).
inline void select_backend(Backend b, int rank, int world, int local_rank, dp_process_group_options* opts) {
  ::unsetenv("DP_SHM");
  ::unsetenv("DP_HOST_ID");
  opts->backend = DP_BACKEND_AUTO;
  switch (b) {
    case Backend::kGloo:
      opts->backend = DP_BACKEND_GLOO;  // Gloo, also on one host
      break;
    case Backend::kShm:
      opts->backend = DP_BACKEND_SHM;
      break;
    case Backend::kHierarchical:
      ::setenv("DP_HOST_ID", rank < world / 2 ? "first" : "second", 1);
      break;
    case Backend::kNccl:
      opts->backend = DP_BACKEND_NCCL;
      opts->device = dp_device{DP_DEVICE_CUDA, local_rank};
      break;
  }
}

}  // namespace dptest
