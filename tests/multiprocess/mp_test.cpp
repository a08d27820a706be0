// Multi-process tests: real processes of mp_worker on loopback, each run
// bounded in time; every process started is reaped before the test ends.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dparallel/dparallel.h"
#include "process_util.h"

extern char** environ;

namespace {

using dptest::free_port;
using dptest::read_file;

struct Result {
  int exit_code = -1;  // 128 + signal when killed
  std::string output;
};

// Runs `world` ranks of mp_worker `scenario`; kills them all after `limit`.
// With `cuda`, rank r works on cuda:r through NCCL. `wrapper` (a program and
// its arguments) runs each rank when given.
std::vector<Result> run_ranks(const std::string& scenario, int world, bool file_store, std::chrono::seconds limit,
                              int stopped_rank = -1, const std::string& argument = "", bool cuda = false,
                              std::vector<std::string> wrapper = {}) {
  char dir_template[] = "/tmp/dp_mp_XXXXXX";
  std::string dir = ::mkdtemp(dir_template);
  int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    if (file_store) env.push_back("DP_TEST_STORE=" + dir + "/store");
    if (cuda) env.push_back("DP_TEST_DEVICE=cuda");
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string out = dir + "/rank" + std::to_string(r) + ".txt";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::string worker = DP_MP_WORKER;
    std::string program = wrapper.empty() ? worker : wrapper[0];
    std::vector<char*> argv;
    for (auto& w : wrapper) argv.push_back(w.data());
    argv.push_back(worker.data());
    argv.push_back(const_cast<char*>(scenario.c_str()));
    if (!argument.empty()) argv.push_back(const_cast<char*>(argument.c_str()));
    argv.push_back(nullptr);
    pid_t pid = -1;
    int rc = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << "posix_spawn " << program;
    if (rc == 0) pids.push_back(pid);
  }
  std::vector<Result> results(pids.size());
  std::vector<bool> reaped(pids.size(), false);
  auto deadline = std::chrono::steady_clock::now() + limit;
  size_t left = pids.size();
  while (left > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (reaped[r]) continue;
      int status = 0;
      pid_t got = ::waitpid(pids[r], &status, WNOHANG | WUNTRACED);
      if (got != pids[r]) continue;
      if (WIFSTOPPED(status)) {
        EXPECT_EQ(static_cast<int>(r), stopped_rank) << "rank " << r << " stopped unexpectedly";
        continue;
      }
      results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      reaped[r] = true;
      --left;
    }
    // A stopped rank is killed once the others are done with it.
    if (stopped_rank >= 0 && left == 1 && !reaped[static_cast<size_t>(stopped_rank)]) {
      ::kill(pids[static_cast<size_t>(stopped_rank)], SIGKILL);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << scenario << ": ranks still running after " << limit.count() << " s; killing them";
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!reaped[r]) ::kill(pids[r], SIGKILL);
      }
      deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    std::string path = dir + "/rank" + std::to_string(r) + ".txt";
    results[r].output = read_file(path);
    ::unlink(path.c_str());
  }
  ::unlink((dir + "/store").c_str());
  ::rmdir(dir.c_str());
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
