// The backends the multi-process and multi-rank suites run over, and the one
// place that says how a rank selects each and what each can run: a new
// backend is a row of kBackends (and a type in BackendTypes).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dparallel/dparallel.h"

namespace dptest {

enum class Backend { kGloo, kShm, kHierarchical, kNccl };

struct BackendInfo {
  const char* name;      // the suites': test names, DP_TEST_BACKEND
  const char* reported;  // what dp_process_group_backend answers
  Backend backend;
  dp_device_type device;  // where the tensors it carries live
  // Its group needs this many ranks on each host at least (hierarchical:
  // else every host's part is one rank and AUTO picks Gloo).
  int min_per_host;
  // Whether ranks that are threads of one process can run it (hierarchical
  // tells its hosts apart by each process's DP_HOST_ID).
  bool threads;
};

// In Backend's order.
inline const BackendInfo kBackends[] = {{"gloo", "gloo", Backend::kGloo, DP_DEVICE_CPU, 1, true},
                                        {"shm", "shm", Backend::kShm, DP_DEVICE_CPU, 1, true},
                                        {"hierarchical", "shm+gloo", Backend::kHierarchical, DP_DEVICE_CPU, 2, false},
                                        {"nccl", "nccl", Backend::kNccl, DP_DEVICE_CUDA, 1, true}};

// The same list as types, for typed suites.
template <Backend B>
struct On {
  static constexpr Backend kBackend = B;
};
using BackendTypes =
    ::testing::Types<On<Backend::kGloo>, On<Backend::kShm>, On<Backend::kHierarchical>, On<Backend::kNccl>>;
template <typename... T>
constexpr size_t type_count(::testing::Types<T...>*) {
  return sizeof...(T);
}
static_assert(type_count(static_cast<BackendTypes*>(nullptr)) == sizeof(kBackends) / sizeof(kBackends[0]),
              "BackendTypes lists every row of kBackends");

inline const BackendInfo& info_of(Backend b) { return kBackends[static_cast<int>(b)]; }
inline const char* backend_name(Backend b) { return info_of(b).name; }
inline const char* reported_backend(Backend b) { return info_of(b).reported; }

inline bool backend_from_name(const char* name, Backend* out) {
  for (const BackendInfo& b : kBackends) {
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

// What a group created to run over `b` asks for; hierarchical is AUTO over
// ranks on two pretend hosts.
inline dp_backend backend_option(Backend b) {
  switch (b) {
    case Backend::kGloo:
      return DP_BACKEND_GLOO;  // Gloo, also on one host
    case Backend::kShm:
      return DP_BACKEND_SHM;
    case Backend::kNccl:
      return DP_BACKEND_NCCL;
    case Backend::kHierarchical:
      break;
  }
  return DP_BACKEND_AUTO;
}

// The pretend host of rank r in a job of `world` over `b` (DP_HOST_ID), or
// "" for this host: rank r of a hierarchical job counts as on host r / (world / 2).
inline std::string host_id(Backend b, int rank, int world) {
  if (b != Backend::kHierarchical) return "";
  return rank < world / 2 ? "first" : "second";
}

// Makes this rank's group, created with `opts` next, run over `b`.
inline void select_backend(Backend b, int rank, int world, int local_rank, dp_process_group_options* opts) {
  ::unsetenv("DP_SHM");
  ::unsetenv("DP_HOST_ID");
  const std::string host = host_id(b, rank, world);
  if (!host.empty()) ::setenv("DP_HOST_ID", host.c_str(), 1);
  opts->backend = backend_option(b);
  if (b == Backend::kNccl) opts->device = dp_device{DP_DEVICE_CUDA, local_rank};
}

// What rank r's environment says for a worker that reads its backend from
// there (ddp_worker): the option its group asks for, what the group must
// then report, and its pretend host.
inline std::vector<std::string> rank_env(Backend b, int rank, int world) {
  std::vector<std::string> vars = {"DP_TEST_GROUP_BACKEND=" + std::to_string(static_cast<int>(backend_option(b))),
                                   std::string("DP_TEST_GROUP_REPORTS=") + reported_backend(b)};
  const std::string host = host_id(b, rank, world);
  if (!host.empty()) vars.push_back("DP_HOST_ID=" + host);
  return vars;
}

inline int gpus() {
  int32_t n = 0;
  return dp_device_count(DP_DEVICE_CUDA, &n) == DP_OK ? n : 0;
}

// How a job's ranks run.
enum class RankKind { kProcesses, kThreads };

// Whether `b` can run a job of `world` ranks as `kind` whose tensors are on
// `tensors` (none: wherever `b` carries them), on a machine that has what
// it needs.
inline bool fits(Backend b, int world, RankKind kind, std::optional<dp_device_type> tensors) {
  const BackendInfo& info = info_of(b);
  const int hosts = b == Backend::kHierarchical ? 2 : 1;
  return info.device == tensors.value_or(info.device) && (kind == RankKind::kProcesses || info.threads) &&
         world % hosts == 0 && world / hosts >= info.min_per_host;
}

// Why this machine cannot run `b` at `world` ranks, or "" when it can.
inline std::string unavailable(Backend b, int world) {
  if (info_of(b).device == DP_DEVICE_CUDA && gpus() < world) {
    return std::string(backend_name(b)) + " needs " + std::to_string(world) + " GPUs (one per rank), found " +
           std::to_string(gpus());
  }
  return "";
}

// A test parameter: a backend and a world size.
using BackendWorld = std::tuple<Backend, int>;

// Every backend at each of `worlds` where it fits a job as `kind` on
// `tensors`: a suite's ValuesIn, so that a new backend joins every suite
// it can run.
inline std::vector<BackendWorld> backend_worlds(RankKind kind, const std::vector<int>& worlds,
                                                std::optional<dp_device_type> tensors = std::nullopt) {
  std::vector<BackendWorld> out;
  for (const BackendInfo& b : kBackends) {
    for (int world : worlds) {
      if (fits(b.backend, world, kind, tensors)) out.emplace_back(b.backend, world);
    }
  }
  return out;
}

// Every backend once, at the first of `worlds` where it fits: for scenarios
// whose world size matters less than their cost.
inline std::vector<BackendWorld> smallest_backend_worlds(RankKind kind, const std::vector<int>& worlds,
                                                         std::optional<dp_device_type> tensors = std::nullopt) {
  std::vector<BackendWorld> out;
  for (const BackendInfo& b : kBackends) {
    for (int world : worlds) {
      if (fits(b.backend, world, kind, tensors)) {
        out.emplace_back(b.backend, world);
        break;
      }
    }
  }
  return out;
}

// "gloo_world2", for test names.
inline std::string backend_world_name(Backend b, int world) {
  return std::string(backend_name(b)) + "_world" + std::to_string(world);
}

struct BackendWorldName {
  std::string operator()(const ::testing::TestParamInfo<BackendWorld>& instance) const {
    return backend_world_name(std::get<0>(instance.param), std::get<1>(instance.param));
  }
};

}  // namespace dptest

// Skips the rest of a test where this machine cannot run `b` at `world`
// ranks (the reason named).
#define DP_SKIP_UNLESS_AVAILABLE(b, world)                            \
  do {                                                                \
    const std::string dp_unavailable = dptest::unavailable(b, world); \
    if (!dp_unavailable.empty()) GTEST_SKIP() << dp_unavailable;      \
  } while (0)
