// The shared-memory backend across real processes of shm_worker on one host:
// world sizes 2, 3 and 4, failures, the segment's privacy, and the choice
// between shared memory and Gloo. Each run is bounded in time and every
// process started is reaped before the test ends. No test asserts on time
// beyond generous no-hang bounds.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "process_util.h"

namespace {

using dptest::read_file;

// The segments in /dev/shm (every job's: tests run side by side).
std::set<std::string> segments() {
  std::set<std::string> names;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* e = ::readdir(dir)) {
    std::string name = e->d_name;
    if (name.rfind("dparallel-", 0) == 0) names.insert(name);
  }
  ::closedir(dir);
  return names;
}

using Result = dptest::RankExit;

struct Ranks {
  std::string scenario;
  std::string argument;
  int world = 2;
  std::chrono::seconds limit{120};
  int stopped_rank = -1;                        // this rank may stop; killed once the others are done
  std::map<int, std::vector<std::string>> env;  // extra variables by rank (-1: every rank)
  // Called every few ms while ranks run, with their output so far; returns
  // true once it has acted (it runs until then).
  std::function<bool(const std::vector<pid_t>&, const std::vector<std::string>&)> watch;
};

std::vector<Result> run_ranks(const Ranks& run) {
  char dir_template[] = "/tmp/dp_shm_XXXXXX";
  dptest::RankJob job;
  job.name = run.scenario;
  job.dir = ::mkdtemp(dir_template);
  job.argv = {DP_SHM_WORKER, run.scenario};
  // The argument's words are arguments of their own.
  std::istringstream argument(run.argument);
  for (std::string word; argument >> word;) job.argv.push_back(word);
  job.world = run.world;
  job.drop_inherited = [](const std::string& entry) {
    return entry.rfind("DP_SHM=", 0) == 0 || entry.rfind("DP_HOST_ID=", 0) == 0 ||
           entry.rfind("DP_STORE_TOKEN=", 0) == 0;
  };
  job.env = [&](int r) {
    std::vector<std::string> vars;
    for (int key : {-1, r}) {
      auto it = run.env.find(key);
      if (it != run.env.end()) vars.insert(vars.end(), it->second.begin(), it->second.end());
    }
    return vars;
  };
  job.limit = run.limit;
  job.stopped_rank = run.stopped_rank;
  job.watch = run.watch;
  std::vector<Result> results = dptest::run_rank_processes(job);
  ::rmdir(job.dir.c_str());
  return results;
}

void expect_all_passed(const std::vector<Result>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << " output:\n" << results[r].output;
  }
}

// No segment that appeared since `before` stays: the ranks' own are unlinked
// once mapped; another test's may exist for a moment while it sets up.
void expect_no_segment_left(const std::set<std::string>& before) {
  std::set<std::string> left;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  do {
    left.clear();
    for (const auto& name : segments()) {
      if (before.count(name) == 0) left.insert(name);
    }
    if (left.empty()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < until);
  for (const auto& name : left) ADD_FAILURE() << "left in /dev/shm: " << name;
}

class ShmWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmWorld, EveryCollectiveOpAndDtypeMatchesTheExpectedValues) {
  Ranks run{"collectives"};
  run.world = GetParam();
  run.limit = std::chrono::seconds(240);
  expect_all_passed(run_ranks(run));
}

TEST_P(ShmWorld, SizesOpsAndRootsThatDifferFailEveryRankAlike) {
  Ranks run{"mismatch"};
  run.world = GetParam();
  expect_all_passed(run_ranks(run));
}

// The victim dies a moment into a 32 MiB all_reduce (the others are in it
// or the next): they fail with DP_EREMOTE naming it, long before their 60 s
// timeout, destroy the group and exit; nothing is left in /dev/shm.
TEST_P(ShmWorld, RankKilledMidAllReduceFailsTheOthersNamingIt) {
  auto before = segments();
  Ranks run{"die", std::to_string(GetParam() - 1)};
  run.world = GetParam();
  auto results = run_ranks(run);
  for (size_t r = 0; r + 1 < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
  }
  EXPECT_EQ(results.back().exit_code, 128 + SIGKILL) << results.back().output;
  expect_no_segment_left(before);
}

// A stopped rank is alive: the others wait for it until their timeout.
TEST_P(ShmWorld, RankStoppedMidAllReduceTimesTheOthersOut) {
  auto before = segments();
  Ranks run{"stop", std::to_string(GetParam() - 1)};
  run.world = GetParam();
  run.stopped_rank = GetParam() - 1;
  run.env[-1] = {"DP_TEST_TIMEOUT_MS=5000"};
  auto results = run_ranks(run);
  for (size_t r = 0; r + 1 < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
  }
  EXPECT_EQ(results.back().exit_code, 128 + SIGKILL) << results.back().output;
  expect_no_segment_left(before);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmWorld, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& world) {
                           return std::to_string(world.param) + "Ranks";
                         });

TEST(Shm, StoreServingRankKilledMidAllReduceFailsTheOthersNamingIt) {
  auto before = segments();
  Ranks run{"die", "0"};
  run.world = 3;
  auto results = run_ranks(run);
  EXPECT_EQ(results[0].exit_code, 128 + SIGKILL) << results[0].output;
  for (size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
  }
  expect_no_segment_left(before);
}

// The segment has no name at any time, so no moment of a kill can leave one.
TEST(Shm, AllRanksKilledMidAllReduceLeaveNothingInDevShm) {
  auto before = segments();
  std::set<std::string> while_running;
  Ranks run{"loop"};
  run.world = 3;
  run.watch = [&](const std::vector<pid_t>& pids, const std::vector<std::string>& outputs) {
    for (const auto& out : outputs) {
      if (out.find("looping") == std::string::npos) return false;
    }
    while_running = segments();
    for (pid_t pid : pids) ::kill(pid, SIGKILL);
    return true;
  };
  auto results = run_ranks(run);
  for (const Result& r : results) EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  for (const auto& name : while_running) {
    if (before.count(name) == 0) ADD_FAILURE() << "a running group named its segment in /dev/shm: " << name;
  }
  expect_no_segment_left(before);
}

TEST(Shm, ProcessWithoutTheJobTokenCannotJoin) {
  auto before = segments();
  Ranks run{"backend", "shm"};
  run.world = 2;
  run.env[0] = {"DP_STORE_TOKEN=the-job-token", "DP_TEST_TIMEOUT_MS=3000"};
  run.env[1] = {"DP_STORE_TOKEN=another-token", "DP_TEST_TIMEOUT_MS=3000"};
  auto results = run_ranks(run);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].exit_code, 3) << results[1].output;
  EXPECT_NE(results[1].output.find("create failed"), std::string::npos) << results[1].output;
  EXPECT_EQ(results[0].exit_code, 3) << results[0].output;
  expect_no_segment_left(before);
}

TEST(Shm, RanksWithTheJobTokenUseSharedMemory) {
  Ranks run{"backend", "shm"};
  run.world = 2;
  run.env[-1] = {"DP_STORE_TOKEN=the-job-token"};
  expect_all_passed(run_ranks(run));
}

TEST(Shm, DpShmZeroGivesGloo) {
  Ranks run{"backend", "gloo"};
  run.world = 3;
  run.env[-1] = {"DP_SHM=0"};
  expect_all_passed(run_ranks(run));
}

// The same collectives through Gloo, as uneven hosts get them (two ranks:
// Gloo's float sums then equal the rank-order sum too).
TEST(Shm, DpShmZeroPassesEveryCollectiveThroughGloo) {
  Ranks run{"collectives", "gloo"};
  run.world = 2;
  run.limit = std::chrono::seconds(240);
  run.env[-1] = {"DP_SHM=0"};
  expect_all_passed(run_ranks(run));
}

TEST(Shm, OneRankWithDpShmZeroGivesGlooOnEveryRank) {
  Ranks run{"backend", "gloo"};
  run.world = 2;
  run.env[1] = {"DP_SHM=0"};
  expect_all_passed(run_ranks(run));
}

// Ranks on several hosts with the same number on each: shared memory inside
// each host, Gloo across.
TEST(Shm, RanksOnSeveralHostsUseSharedMemoryAndGloo) {
  Ranks run{"backend", "shm+gloo"};
  run.world = 4;
  run.env[0] = {"DP_HOST_ID=a"};
  run.env[1] = {"DP_HOST_ID=a"};
  run.env[2] = {"DP_HOST_ID=b"};
  run.env[3] = {"DP_HOST_ID=b"};
  expect_all_passed(run_ranks(run));
}

// Hosts with different numbers of ranks fall back to Gloo and say why.
TEST(Shm, UnevenHostsUseGlooAndSayWhy) {
  Ranks run{"backend", "gloo"};
  run.world = 3;
  run.env[0] = {"DP_HOST_ID=a"};
  run.env[1] = {"DP_HOST_ID=a"};
  run.env[2] = {"DP_HOST_ID=b"};
  auto results = run_ranks(run);
  expect_all_passed(results);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_NE(results[0].output.find("different numbers of ranks (2, 1)"), std::string::npos) << results[0].output;
}

TEST(Shm, OneRankPerHostUsesGloo) {
  Ranks run{"backend", "gloo"};
  run.world = 2;
  run.env[0] = {"DP_HOST_ID=a"};
  run.env[1] = {"DP_HOST_ID=b"};
  expect_all_passed(run_ranks(run));
}

TEST(Shm, DpShmZeroOnSeveralHostsGivesGloo) {
  Ranks run{"backend", "gloo"};
  run.world = 4;
  run.env[0] = {"DP_HOST_ID=a"};
  run.env[1] = {"DP_HOST_ID=a", "DP_SHM=0"};
  run.env[2] = {"DP_HOST_ID=b"};
  run.env[3] = {"DP_HOST_ID=b"};
  expect_all_passed(run_ranks(run));
}

// Two pretend hosts of `per_host` ranks each (ranks 0..per_host-1 on the first).
Ranks on_two_hosts(const std::string& scenario, const std::string& argument, int per_host) {
  Ranks run{scenario, argument};
  run.world = 2 * per_host;
  for (int r = 0; r < run.world; ++r) run.env[r] = {r < per_host ? "DP_HOST_ID=first" : "DP_HOST_ID=second"};
  return run;
}

TEST(Hierarchical, EveryCollectiveOpAndDtypeMatchesTheExpectedValues) {
  Ranks run = on_two_hosts("collectives", "shm+gloo 2", 2);
  run.limit = std::chrono::seconds(240);
  expect_all_passed(run_ranks(run));
}

TEST(Hierarchical, SizesOpsAndRootsThatDifferFailEveryRankAlike) {
  expect_all_passed(run_ranks(on_two_hosts("mismatch", "", 2)));
}

// A rank killed a moment into a 32 MiB all_reduce: the survivors on both
// hosts fail with DP_EREMOTE naming it, destroy the group and exit, long
// before their timeout; nothing is left in /dev/shm. Rank 3 shares a host
// with rank 2; rank 1 with rank 0, which serves the store.
class HierarchicalKilled : public ::testing::TestWithParam<int> {};

TEST_P(HierarchicalKilled, RankKilledMidAllReduceFailsTheOthersNamingIt) {
  auto before = segments();
  const int victim = GetParam();
  auto results = run_ranks(on_two_hosts("die", std::to_string(victim), 2));
  for (size_t r = 0; r < results.size(); ++r) {
    if (static_cast<int>(r) == victim) {
      EXPECT_EQ(results[r].exit_code, 128 + SIGKILL) << results[r].output;
    } else {
      EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
    }
  }
  expect_no_segment_left(before);
}

// A stopped rank is alive: its local peer times out, and the failure spreads
// to the other host through the parts the survivors abort.
TEST(Hierarchical, RankStoppedMidAllReduceTimesTheOthersOut) {
  auto before = segments();
  Ranks run = on_two_hosts("stop", "3", 2);
  run.stopped_rank = 3;
  for (auto& entry : run.env) entry.second.push_back("DP_TEST_TIMEOUT_MS=5000");
  auto results = run_ranks(run);
  for (size_t r = 0; r + 1 < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
  }
  EXPECT_EQ(results.back().exit_code, 128 + SIGKILL) << results.back().output;
  expect_no_segment_left(before);
}

INSTANTIATE_TEST_SUITE_P(Victims, HierarchicalKilled, ::testing::Values(1, 3),
                         [](const ::testing::TestParamInfo<int>& victim) {
                           return "Rank" + std::to_string(victim.param);
                         });

TEST(Shm, RanksThatShareAHostIdUseSharedMemory) {
  Ranks run{"backend", "shm"};
  run.world = 2;
  run.env[-1] = {"DP_HOST_ID=pretend"};
  expect_all_passed(run_ranks(run));
}

}  // namespace
