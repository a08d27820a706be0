// What is particular to shared memory across real processes of shm_worker on
// one host: the segment's privacy, the job token, the choice between shared
// memory, hierarchical and Gloo, and float sums in rank order. The
// collectives themselves, on every backend, are the conformance suite's
// (tests/conformance). Each run is bounded in time and every process started
// is reaped before the test ends.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "conformance/ranks.h"

namespace {

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

using dptest::expect_all_passed;
using Result = dptest::RankExit;

struct Ranks : dptest::Ranks {
  Ranks(const std::string& scenario, const std::string& argument = "") {
    program = DP_SHM_WORKER;
    arguments = scenario + " " + argument;
  }
};

std::vector<Result> run_ranks(const Ranks& run) { return dptest::run_ranks(run); }

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

// Rounded float sums: rank order fixes every rounding.
class ShmWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmWorld, FloatSumsAreTheRankOrderSumBitForBitEveryTime) {
  Ranks run{"rank_order_sums", "shm"};
  run.world = GetParam();
  expect_all_passed(run_ranks(run));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmWorld, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& world) {
                           return std::to_string(world.param) + "Ranks";
                         });

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

// A file-size limit (RLIMIT_FSIZE) below the shared memory: the kernel's
// SIGXFSZ would end rank 0, which grows the segment. Below the segment
// itself every rank takes Gloo; below only DDP's and FSDP's regions they
// stay in private memory. Either way every rank lives and computes right.
TEST(Shm, AFileSizeLimitBelowTheSegmentGivesGlooOnEveryRankAndKillsNone) {
  Ranks run{"past_file_limit", "gloo"};
  run.world = 2;
  run.env[0] = {"DP_TEST_FILE_SIZE_LIMIT=65536"};
  auto results = run_ranks(run);
  expect_all_passed(results);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_NE(results[0].output.find("using Gloo, not shared memory"), std::string::npos) << results[0].output;
  EXPECT_NE(results[0].output.find("file-size limit"), std::string::npos) << results[0].output;
}

TEST(Shm, AFileSizeLimitBelowTheRegionsKeepsBucketsAndShardsPrivateOnEveryRankAndKillsNone) {
  Ranks run{"past_file_limit", "shm"};
  run.world = 2;
  // 12 MiB on rank 0 alone: the segment fits, 2 x 16 MiB does not; the other
  // rank, unlimited, must fall back alike. DP_DEBUG: DDP and FSDP say where
  // their memory went.
  run.env[-1] = {"DP_DEBUG=INFO"};
  run.env[0] = {"DP_TEST_FILE_SIZE_LIMIT=12582912"};
  auto results = run_ranks(run);
  expect_all_passed(results);
  ASSERT_EQ(results.size(), 2u);
  for (const Result& r : results) {
    EXPECT_NE(r.output.find("shards in private memory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("buckets in private memory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("file-size limit"), std::string::npos) << r.output;
  }
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

// Each host's sum in rank order, then the hosts' in host order.
TEST(Hierarchical, FloatSumsAddEachHostInRankOrderThenTheHosts) {
  expect_all_passed(run_ranks(on_two_hosts("rank_order_sums", "shm+gloo 2", 2)));
}

// A small all_reduce crosses hosts inside the header exchange; a call that
// differs still fails every rank before any rank's tensor changes.
TEST(Hierarchical, SmallAllReducesThatDifferOnOneRankFailEveryRankAndChangeNoTensor) {
  expect_all_passed(run_ranks(on_two_hosts("small_mismatch", "shm+gloo", 2)));
}

TEST(Hierarchical, SmallAllReducesThatDifferOnOneRankFailEveryRankAndChangeNoTensorWithThreeRanksPerHost) {
  expect_all_passed(run_ranks(on_two_hosts("small_mismatch", "shm+gloo", 3)));
}

TEST(Shm, RanksThatShareAHostIdUseSharedMemory) {
  Ranks run{"backend", "shm"};
  run.world = 2;
  run.env[-1] = {"DP_HOST_ID=pretend"};
  expect_all_passed(run_ranks(run));
}

}  // namespace
