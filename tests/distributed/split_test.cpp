// Subgroups (dp_process_group_split) and device meshes across real processes
// of split_worker on this host (DP_HOST_ID makes ranks count as on other
// hosts); each run is bounded in time, and no test asserts on time.
#include <gtest/gtest.h>
#include <signal.h>

#include <functional>
#include <string>
#include <vector>

#include "group_util.h"
#include "worker_job.h"

namespace {

dptest::WorkerRun run_split(const std::string& scenario, int world,
                            const std::function<std::vector<std::string>(int)>& rank_env = nullptr) {
  return dptest::run_worker(DP_SPLIT_WORKER, scenario, world, {}, std::chrono::seconds(90), rank_env);
}

void expect_passes(const std::string& scenario, int world,
                   const std::function<std::vector<std::string>(int)>& rank_env = nullptr) {
  dptest::expect_passed(run_split(scenario, world, rank_env), scenario, world);
}

TEST(ProcessGroupSplit, ColorsAndReversedKeysFormGroupsWhoseSumsAndOrderProveTheirMembers) {
  expect_passes("split", 4);
}

TEST(ProcessGroupSplit, RankSplittingWhilePeerAllReducesFailsOnBothWithoutHanging) {
  dptest::WorkerRun run = run_split("split_vs_all_reduce", 2);
  dptest::expect_passed(run, "split_vs_all_reduce", 2);
  // The split runs as an all_gather of pg: each rank names the other's call.
  dptest::expect_mentions(run, 0, {"dp_process_group_split", "rank 1 called all_reduce"});
  dptest::expect_mentions(run, 1, {"dp_pg_all_reduce", "rank 0 called all_gather"});
}

// Rank r's exit: 0 with its line printed, or (the killed rank) SIGKILL's.
void expect_survivors_passed(const dptest::WorkerRun& run, const std::string& scenario, int killed) {
  for (size_t r = 0; r < run.exit_codes.size(); ++r) {
    if (static_cast<int>(r) == killed) {
      EXPECT_EQ(run.exit_codes[r], 128 + SIGKILL) << "rank " << r << " output:\n" << run.outputs[r];
      continue;
    }
    EXPECT_EQ(run.exit_codes[r], 0) << "rank " << r << " output:\n" << run.outputs[r];
    dptest::expect_mentions(run, r, {"rank " + std::to_string(r) + ": " + scenario + " passed"});
  }
}

TEST(ProcessGroupShrink, AfterARankDiesOverGlooTheOthersFormAGroupOfThreeInTheirOldOrder) {
  dptest::WorkerRun run =
      dptest::run_worker(DP_SPLIT_WORKER, "shrink_after_kill", 4, {"DP_TEST_BACKEND=gloo"}, std::chrono::seconds(120));
  expect_survivors_passed(run, "shrink_after_kill", 2);
}

TEST(ProcessGroupShrink, AfterARankDiesOverSharedMemoryTheOthersFormAGroupOfThree) {
  dptest::WorkerRun run = dptest::run_worker(DP_SPLIT_WORKER, "shrink_after_kill", 4, {}, std::chrono::seconds(120));
  expect_survivors_passed(run, "shrink_after_kill", 2);
}

TEST(ProcessGroupShrink, WithNoRankLostEveryRankFormsTheNewGroup) { expect_passes("shrink_none_lost", 2); }

TEST(ProcessGroupShrink, ARankThatCallsShrinkAfterTheOthersDecidedIsLeftOutWithAClearError) {
  // The others decide at the group's timeout (10 s): the late rank was not seen.
  dptest::WorkerRun run = dptest::run_worker(DP_SPLIT_WORKER, "shrink_late_rank", 3, {"DP_TEST_TIMEOUT_MS=10000"},
                                             std::chrono::seconds(120));
  dptest::expect_passed(run, "shrink_late_rank", 3);
}

TEST(ProcessGroupShrink, ARankAloneInItsShrinkFormsNoGroupOfOneAndTheGroupIsUntouched) {
  dptest::WorkerRun run =
      dptest::run_worker(DP_SPLIT_WORKER, "shrink_alone", 3, {"DP_TEST_TIMEOUT_MS=10000"}, std::chrono::seconds(120));
  dptest::expect_passed(run, "shrink_alone", 3);
}

TEST(ProcessGroupShrink, LosingTheRankThatHoldsTheStoreFailsTheShrinkNamingTheStore) {
  dptest::WorkerRun run = dptest::run_worker(DP_SPLIT_WORKER, "shrink_store_lost", 3, {"DP_TEST_TIMEOUT_MS=10000"},
                                             std::chrono::seconds(120));
  expect_survivors_passed(run, "shrink_store_lost", 0);
}

TEST(ProcessGroupHosts, FourRanksOnTwoHostsGiveLocalRanksAndAByHostMeshOfShmInsideAndGlooAcross) {
  expect_passes("hosts", 4, [](int r) { return std::vector<std::string>{"DP_HOST_ID=split" + std::to_string(r / 2)}; });
}

TEST(ProcessGroupHosts, ByHostMeshOfUnevenHostsIsRefusedNamingTheCounts) {
  expect_passes("uneven_hosts", 4,
                [](int r) { return std::vector<std::string>{std::string("DP_HOST_ID=") + (r < 3 ? "a" : "b")}; });
}

TEST(DeviceMesh, TwoByTwoAndTwoByOneByTwoMeshesGroupTheRanksOfEachDimension) { expect_passes("mesh", 4); }

TEST(DeviceMesh, BadShapesNamesAndDifferingMeshesFailNamingTheArgumentAndLeaveTheGroupUsable) {
  expect_passes("bad_mesh", 4);
}

// In this process, over a one-rank group: the checks that need no peers.
TEST(ProcessGroupSplit, OneRankGroupSplitsIntoItselfAndKnowsItsOneHost) {
  dptest::SingleRankGroup group;
  dp_process_group* pg = group.get();
  ASSERT_NE(pg, nullptr);
  EXPECT_EQ(dp_process_group_local_rank(pg), 0);
  EXPECT_EQ(dp_process_group_local_size(pg), 1);
  EXPECT_EQ(dp_process_group_num_hosts(pg), 1);
  dp_process_group* child = nullptr;
  ASSERT_EQ(dp_process_group_split(pg, 5, -3, nullptr, &child), DP_OK) << dp_last_error();
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(dp_process_group_rank(child), 0);
  EXPECT_EQ(dp_process_group_size(child), 1);
  EXPECT_STREQ(dp_process_group_backend(child), "shm");
  EXPECT_EQ(dp_process_group_local_size(child), 1);
  dp_process_group_destroy(child);
  child = reinterpret_cast<dp_process_group*>(pg);
  EXPECT_EQ(dp_process_group_split(pg, -1, 0, nullptr, &child), DP_OK) << dp_last_error();
  EXPECT_EQ(child, nullptr);
}

TEST(ProcessGroupSplit, BadOptionsAndHandlesAreRefusedNamingTheArgument) {
  dptest::SingleRankGroup group;
  dp_process_group* pg = group.get();
  ASSERT_NE(pg, nullptr);
  dp_process_group* child = nullptr;
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.struct_size = 3;
  EXPECT_EQ(dp_process_group_split(pg, 0, 0, &opts, &child), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("struct_size"), std::string::npos) << dp_last_error();
  opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.backend = 99;
  EXPECT_EQ(dp_process_group_split(pg, 0, 0, &opts, &child), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'backend'"), std::string::npos) << dp_last_error();
  opts.backend = DP_BACKEND_GLOO;
  opts.device = dp_device{DP_DEVICE_CUDA, 0};
  EXPECT_EQ(dp_process_group_split(pg, 0, 0, &opts, &child), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("device"), std::string::npos) << dp_last_error();
  EXPECT_EQ(child, nullptr);
  EXPECT_EQ(dp_process_group_split(nullptr, 0, 0, nullptr, &child), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'pg'"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_process_group_local_rank(nullptr), -1);
  EXPECT_EQ(dp_process_group_local_size(nullptr), -1);
  EXPECT_EQ(dp_process_group_num_hosts(nullptr), -1);
  // Still usable: every refusal took its place in the sequence.
  ASSERT_EQ(dp_process_group_split(pg, 0, 0, nullptr, &child), DP_OK) << dp_last_error();
  dp_process_group_destroy(child);
}

TEST(DeviceMesh, OneDimensionalMeshOfOneRankAnswersShapeCoordinateAndNamesAndRefusesBadHandles) {
  dptest::SingleRankGroup group;
  dp_process_group* pg = group.get();
  ASSERT_NE(pg, nullptr);
  const int32_t shape[1] = {1};
  const char* const names[1] = {"data"};
  dp_device_mesh* mesh = nullptr;
  ASSERT_EQ(dp_device_mesh_create(&mesh, pg, shape, 1, names), DP_OK) << dp_last_error();
  EXPECT_EQ(dp_device_mesh_ndim(mesh), 1u);
  int32_t got[2] = {-1, -1};
  EXPECT_EQ(dp_device_mesh_shape(mesh, got, 2), DP_OK);
  EXPECT_EQ(got[0], 1);
  EXPECT_EQ(dp_device_mesh_coordinate(mesh, got, 1), DP_OK);
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(dp_device_mesh_coordinate(mesh, nullptr, 1), DP_EINVAL);
  const char* name = nullptr;
  EXPECT_EQ(dp_device_mesh_dim_name(mesh, 0, &name), DP_OK);
  EXPECT_STREQ(name, "data");
  dp_process_group* data = nullptr;
  EXPECT_EQ(dp_device_mesh_group(mesh, nullptr, &data), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'dim_name'"), std::string::npos) << dp_last_error();
  ASSERT_EQ(dp_device_mesh_group(mesh, "data", &data), DP_OK);
  EXPECT_NE(data, pg);  // a group of its own
  EXPECT_EQ(dp_process_group_size(data), 1);
  // A handle of another type is refused, not read as a mesh.
  EXPECT_EQ(dp_device_mesh_ndim(reinterpret_cast<dp_device_mesh*>(pg)), 0u);
  EXPECT_NE(std::string(dp_last_error()).find("not a dp_device_mesh"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_device_mesh_ndim(nullptr), 0u);
  dp_device_mesh_destroy(reinterpret_cast<dp_device_mesh*>(pg));  // ignored
  dp_device_mesh_destroy(nullptr);
  dp_device_mesh_destroy(mesh);
  EXPECT_EQ(dp_process_group_size(pg), 1);  // the mesh did not take its group
}

}  // namespace
