// Multi-process tests: real processes of mp_worker on loopback, each run
// bounded in time; every process started is reaped before the test ends.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"
#include "process_util.h"

namespace {

using Result = dptest::RankExit;

// Runs `world` ranks of mp_worker `scenario`; kills them all after `limit`.
// With `cuda`, rank r works on cuda:r through NCCL. `wrapper` (a program and
// its arguments) runs each rank when given.
std::vector<Result> run_ranks(const std::string& scenario, int world, bool file_store, std::chrono::seconds limit,
                              int stopped_rank = -1, const std::string& argument = "", bool cuda = false,
                              std::vector<std::string> wrapper = {}) {
  char dir_template[] = "/tmp/dp_mp_XXXXXX";
  dptest::RankJob job;
  job.name = scenario;
  job.dir = ::mkdtemp(dir_template);
  job.argv = std::move(wrapper);
  job.argv.push_back(DP_MP_WORKER);
  job.argv.push_back(scenario);
  if (!argument.empty()) job.argv.push_back(argument);
  job.world = world;
  job.env = [&](int) {
    std::vector<std::string> vars;
    if (file_store) vars.push_back("DP_TEST_STORE=" + job.dir + "/store");
    if (cuda) vars.push_back("DP_TEST_DEVICE=cuda");
    return vars;
  };
  job.limit = limit;
  job.stopped_rank = stopped_rank;
  std::vector<Result> results = dptest::run_rank_processes(job);
  ::unlink((job.dir + "/store").c_str());
  ::rmdir(job.dir.c_str());
  return results;
}

void expect_all_passed(const std::vector<Result>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << " output:\n" << results[r].output;
  }
}

TEST(MultiProcess, EveryCollectiveOpAndDtypeWithTwoRanksOverTcpStore) {
  expect_all_passed(run_ranks("collectives", 2, false, std::chrono::seconds(90)));
}

TEST(MultiProcess, EveryCollectiveOpAndDtypeWithThreeRanksOverFileStore) {
  expect_all_passed(run_ranks("collectives", 3, true, std::chrono::seconds(90)));
}

TEST(MultiProcess, LargeReduceScatterGivesEveryOpAndDtypeWithTwoRanks) {
  expect_all_passed(run_ranks("large_reduce_scatter", 2, false, std::chrono::seconds(120)));
}

TEST(MultiProcess, LargeReduceScatterGivesEveryOpAndDtypeWithThreeRanks) {
  expect_all_passed(run_ranks("large_reduce_scatter", 3, false, std::chrono::seconds(120)));
}

TEST(MultiProcess, MismatchedSizesAreAnErrorOnEveryRank) {
  expect_all_passed(run_ranks("mismatch", 3, false, std::chrono::seconds(60)));
}

// Without the refusal in the header exchange, the other ranks' call would
// pair with the refusing rank's next one, or wait for the whole timeout.
TEST(MultiProcess, RefusedCallsFailEveryRankAtOnceNamingTheRefusingRankWithTwoRanks) {
  expect_all_passed(run_ranks("refuse", 2, false, std::chrono::seconds(90)));
}

TEST(MultiProcess, RefusedCallsFailEveryRankAtOnceNamingTheRefusingRankWithThreeRanks) {
  expect_all_passed(run_ranks("refuse", 3, false, std::chrono::seconds(90), -1, "1"));
}

TEST(MultiProcess, RefusedCallsOfTheStoreServingRankFailEveryRankAtOnceWithThreeRanks) {
  expect_all_passed(run_ranks("refuse", 3, true, std::chrono::seconds(90), -1, "0"));
}

// Nothing uninitialised goes out over a socket: not Gloo's addresses through
// the store at setup, nor the bytes of its ring all-gathers.
TEST(MultiProcess, ForkedChildIsRefusedEveryCallOnTheInheritedGroupAndTheParentsStayRight) {
  expect_all_passed(run_ranks("fork", 2, false, std::chrono::seconds(90)));
}

TEST(MultiProcess, ThreadsTakingTurnsOnOneGroupAndAsyncThenSyncFromOneThreadAreAllowed) {
  expect_all_passed(run_ranks("thread_handover", 2, false, std::chrono::seconds(90)));
}

TEST(MultiProcess, CallFromASecondThreadWhileOneIsInFlightIsEstateAndEveryRankFailsAtOnce) {
  expect_all_passed(run_ranks("thread_overlap", 2, false, std::chrono::seconds(90)));
}

TEST(MultiProcess, FourThreadsHammeringOneGroupEndInErrorsThatSaySoNotAHang) {
  expect_all_passed(run_ranks("threads", 2, false, std::chrono::seconds(100)));
}

TEST(MultiProcess, NoUninitialisedBytesGoOutOverSocketsUnderValgrind) {
#if defined(__SANITIZE_ADDRESS__) || !defined(DP_VALGRIND)
  GTEST_SKIP() << "needs valgrind and a build without AddressSanitizer";
#else
  auto results = run_ranks("mismatch", 2, false, std::chrono::seconds(240), -1, "", false,
                           {DP_VALGRIND, "--error-exitcode=99", "--track-origins=yes", "-q"});
  expect_all_passed(results);
  for (const Result& r : results) EXPECT_EQ(r.output.find("uninitialised"), std::string::npos) << r.output;
#endif
}

void expect_survivors_failed_cleanly(const std::vector<Result>& results, int dead_exit_code, size_t victim) {
  ASSERT_GT(results.size(), victim);
  for (size_t r = 0; r < results.size(); ++r) {
    if (r == victim) continue;
    EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
    EXPECT_NE(results[r].output.find("status"), std::string::npos) << results[r].output;
  }
  EXPECT_EQ(results[victim].exit_code, dead_exit_code) << results[victim].output;
}

TEST(MultiProcess, RankKilledMidCollectiveFailsTheOthersWithinTheTimeout) {
  expect_survivors_failed_cleanly(run_ranks("die", 2, false, std::chrono::seconds(60)), 128 + SIGKILL, 1);
}

TEST(MultiProcess, StoreServingRankKilledMidCollectiveFailsTheOthers) {
  expect_survivors_failed_cleanly(run_ranks("die", 3, false, std::chrono::seconds(60), -1, "0"), 128 + SIGKILL, 0);
}

TEST(MultiProcess, RankKilledMidCollectiveFailsTheOthersWithThreeRanks) {
  expect_survivors_failed_cleanly(run_ranks("die", 3, false, std::chrono::seconds(60)), 128 + SIGKILL, 2);
}

TEST(MultiProcess, StoppedRankTimesTheOthersOut) {
  expect_survivors_failed_cleanly(run_ranks("stop", 3, false, std::chrono::seconds(60), 2), 128 + SIGKILL, 2);
}

TEST(MultiProcess, RankKilledMidReduceScatterFailsTheOthersWithinTheTimeout) {
  expect_survivors_failed_cleanly(run_ranks("die_reduce_scatter", 2, false, std::chrono::seconds(60)), 128 + SIGKILL,
                                  1);
}

TEST(MultiProcess, RankStoppedMidReduceScatterTimesTheOthersOutWithThreeRanks) {
  expect_survivors_failed_cleanly(run_ranks("stop_reduce_scatter", 3, false, std::chrono::seconds(60), 2),
                                  128 + SIGKILL, 2);
}

TEST(MultiProcess, OutOfMemoryBeforeTheTransferLeavesTheGroupInStep) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer aborts on an impossible allocation instead of throwing";
#else
  expect_all_passed(run_ranks("oom", 2, false, std::chrono::seconds(60)));
#endif
}

// The same scenarios through NCCL, one GPU per rank: NCCL refuses two ranks
// on one GPU ("duplicate GPU"), so these need two GPUs. Two ranks only: with
// NCCL, a float AVG pre-multiplies by 1/size, exact for a power of two.
int gpus() {
  int32_t n = 0;
  return dp_device_count(DP_DEVICE_CUDA, &n) == DP_OK ? n : 0;
}

#define REQUIRE_TWO_GPUS() \
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs (one per rank), found " << gpus()

TEST(MultiProcessNccl, EveryCollectiveOpAndDtypeWithTwoRanksOnTwoGpus) {
  REQUIRE_TWO_GPUS();
  expect_all_passed(run_ranks("collectives", 2, false, std::chrono::seconds(120), -1, "", true));
}

TEST(MultiProcessNccl, MismatchedSizesAreAnErrorOnEveryRank) {
  REQUIRE_TWO_GPUS();
  expect_all_passed(run_ranks("mismatch", 2, true, std::chrono::seconds(90), -1, "", true));
}

TEST(MultiProcessNccl, RankKilledFailsTheOtherWithinTheTimeout) {
  REQUIRE_TWO_GPUS();
  expect_survivors_failed_cleanly(run_ranks("die", 2, false, std::chrono::seconds(60), -1, "", true), 128 + SIGKILL, 1);
}

TEST(MultiProcessNccl, StoreServingRankKilledFailsTheOther) {
  REQUIRE_TWO_GPUS();
  expect_survivors_failed_cleanly(run_ranks("die", 2, false, std::chrono::seconds(60), -1, "0", true), 128 + SIGKILL,
                                  0);
}

TEST(MultiProcessNccl, StoppedRankTimesTheOtherOut) {
  REQUIRE_TWO_GPUS();
  expect_survivors_failed_cleanly(run_ranks("stop", 2, false, std::chrono::seconds(60), 1, "", true), 128 + SIGKILL, 1);
}

TEST(MultiProcessNccl, RefusedCallsFailEveryRankAtOnceNamingTheRefusingRank) {
  REQUIRE_TWO_GPUS();
  expect_all_passed(run_ranks("refuse", 2, false, std::chrono::seconds(120), -1, "", true));
}

TEST(MultiProcessNccl, OutOfScratchMemoryBeforeTheTransferLeavesTheGroupInStep) {
  REQUIRE_TWO_GPUS();
  expect_all_passed(run_ranks("oom", 2, false, std::chrono::seconds(60), -1, "", true));
}

}  // namespace
