// fully_shard across real processes: world-size copies of fsdp_worker on
// loopback, over every backend (backends.h), each run bounded in time. The
// worker trains the ToyModel and compares every parameter with training in
// one process on the whole batch; here every rank's exit and "passed" line
// are checked.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include "backends.h"
#include "worker_job.h"

namespace {

class FsdpProcessParity : public ::testing::TestWithParam<dptest::BackendWorld> {
 protected:
  void expect_matches(const std::string& scenario) {
    const auto [backend, world] = GetParam();
    DP_SKIP_UNLESS_AVAILABLE(backend, world);
    dptest::WorkerRun run =
        dptest::run_worker(DP_FSDP_WORKER, scenario, world, {}, std::chrono::seconds(100),
                           [backend = backend, world = world](int r) { return dptest::rank_env(backend, r, world); });
    dptest::expect_passed(run, scenario, world);
  }
};
class FsdpProcessParityViews : public FsdpProcessParity {};

// The tensors are on the device each backend carries (cuda:LOCAL_RANK for
// NCCL).
// Each backend at its smallest world size, and at three ranks where it fits
// (rows split unevenly).
INSTANTIATE_TEST_SUITE_P(Backends, FsdpProcessParity,
                         ::testing::ValuesIn(dptest::smallest_backend_worlds(dptest::RankKind::kProcesses, {2, 3, 4})),
                         dptest::BackendWorldName());
INSTANTIATE_TEST_SUITE_P(ThreeRanks, FsdpProcessParity,
                         ::testing::ValuesIn(dptest::backend_worlds(dptest::RankKind::kProcesses, {3})),
                         dptest::BackendWorldName());
INSTANTIATE_TEST_SUITE_P(Backends, FsdpProcessParityViews,
                         ::testing::ValuesIn(dptest::smallest_backend_worlds(dptest::RankKind::kProcesses, {2, 3, 4})),
                         dptest::BackendWorldName());

TEST_P(FsdpProcessParity, ToyModelTrainsLikeOneProcessAndItsFullStateDictLoadsOnEveryRank) { expect_matches("toy"); }

// The full parameters are views of the shards on shared memory, copies
// elsewhere; either way training matches.
TEST_P(FsdpProcessParityViews, FullParametersAsViewsOrCopiesTrainLikeOneProcess) { expect_matches("toy_views"); }

}  // namespace
