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

// HSDP: hsdp_worker's 4 ranks as 2 hosts of 2 (DP_HOST_ID), shard groups
// within a host (shared memory), replicate groups across them.
void expect_hsdp_passes(const std::string& scenario) {
  dptest::WorkerRun run = dptest::run_worker(DP_HSDP_WORKER, scenario, 4, {}, std::chrono::seconds(100), [](int r) {
    return std::vector<std::string>{"DP_HOST_ID=h" + std::to_string(r / 2)};
  });
  dptest::expect_passed(run, scenario, 4);
}

TEST(Hsdp, TwoHostsOfTwoTrainLikeOneProcessAndLikeFullyShardOverEveryRank) { expect_hsdp_passes("parity"); }

// Averaged once over the 4 ranks (no double division), also where 16-bit
// gradients are divided before each sum, and for a 0-d parameter.
TEST(Hsdp, ShardGradientsAreTheAverageOverEveryRankInEachReduceDtype) { expect_hsdp_passes("average"); }

TEST(Hsdp, ASaveUnder2x2IsWrittenByOneShardGroupAndLoadsUnder1x4And4x1AndTrainsOn) { expect_hsdp_passes("save_load"); }

// A refusal in the shard group stands in for the all-reduce across the
// replicas: every rank fails naming it, and the groups stay in step.
TEST(Hsdp, APostBackwardRefusedOnOneRankFailsEveryRankAndTheNextIterationReduces) {
  expect_hsdp_passes("refused_post");
}

TEST(Hsdp, ASaveRefusedOnAReplicaThatDoesNotWriteFailsEveryRankAndTheLastSaveLoads) {
  expect_hsdp_passes("save_refused");
}

// Every rank fails, none hangs (a rank left waiting would outlast the run's limit).
TEST(Hsdp, ReplicasThatNameAParameterOtherwiseFailEveryRanksCreateNamingIt) { expect_hsdp_passes("bad_names"); }

TEST(Hsdp, ReplicasInShardGroupsOfAnotherSizeFailEveryRanksCreateNamingTheSizes) { expect_hsdp_passes("bad_shards"); }

// Through the C ABI: dp_fsdp_create_on_mesh on the mesh by host (HSDP) and
// on a 1-D mesh, each against one process; a 3-D mesh is refused.
TEST(Hsdp, CreateOnMeshByHostAndOnA1DMeshTrainLikeOneProcess) { expect_hsdp_passes("mesh_parity"); }

}  // namespace
