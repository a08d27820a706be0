// The backend a group runs for the backend its ranks ask for, across real
// processes of backend_choice_worker on this host (DP_HOST_ID makes a rank
// count as on another host). Each run is bounded in time; no test asserts
// on time.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "dparallel/dp_dist.h"
#include "process_util.h"

namespace {

// Extra variables by rank (-1: every rank).
using RankEnv = std::map<int, std::vector<std::string>>;

std::vector<dptest::RankExit> run_ranks(int world, const RankEnv& env) {
  char dir_template[] = "/tmp/dp_choice_XXXXXX";
  dptest::RankJob job;
  job.name = "backend choice";
  job.dir = ::mkdtemp(dir_template);
  job.argv = {DP_BACKEND_CHOICE_WORKER};
  job.world = world;
  job.drop_inherited = [](const std::string& entry) {
    return entry.rfind("DP_SHM=", 0) == 0 || entry.rfind("DP_HOST_ID=", 0) == 0 ||
           entry.rfind("DP_TEST_BACKEND=", 0) == 0 || entry.rfind("DP_STORE_TOKEN=", 0) == 0;
  };
  job.env = [&](int r) {
    std::vector<std::string> vars;
    for (int key : {-1, r}) {
      auto it = env.find(key);
      if (it != env.end()) vars.insert(vars.end(), it->second.begin(), it->second.end());
    }
    return vars;
  };
  std::vector<dptest::RankExit> results = dptest::run_rank_processes(job);
  ::rmdir(job.dir.c_str());
  return results;
}

std::string asking(dp_backend backend) { return "DP_TEST_BACKEND=" + std::to_string(static_cast<int>(backend)); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Every rank made a group of `backend` and all-reduced over it.
void expect_every_rank_ran(const std::vector<dptest::RankExit>& results, const std::string& backend) {
  int world = static_cast<int>(results.size());
  std::string sum = "sum " + std::to_string(world * (world + 1) / 2);
  for (size_t r = 0; r < results.size(); ++r) {
    const std::string& out = results[r].output;
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << out;
    EXPECT_TRUE(contains(out, "backend " + backend + "\n")) << "rank " << r << ":\n" << out;
    EXPECT_TRUE(contains(out, sum)) << "rank " << r << ":\n" << out;
  }
}

// Every rank failed with `status`, its message holding each of `parts`.
void expect_every_rank_failed(const std::vector<dptest::RankExit>& results, dp_status status,
                              const std::vector<std::string>& parts) {
  for (size_t r = 0; r < results.size(); ++r) {
    const std::string& out = results[r].output;
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << out;
    EXPECT_TRUE(contains(out, "status " + std::to_string(static_cast<int>(status)) + "\n")) << "rank " << r << ":\n"
                                                                                            << out;
    for (const auto& part : parts)
      EXPECT_TRUE(contains(out, part)) << "rank " << r << ": no '" << part << "' in\n" << out;
  }
}

TEST(BackendChoice, GlooOnOneHostRunsGloo) {
  expect_every_rank_ran(run_ranks(2, {{-1, {asking(DP_BACKEND_GLOO)}}}), "gloo");
}

TEST(BackendChoice, ShmOnOneHostRunsShmEvenWithDpShmZero) {
  expect_every_rank_ran(run_ranks(3, {{-1, {asking(DP_BACKEND_SHM)}}}), "shm");
  expect_every_rank_ran(run_ranks(2, {{-1, {asking(DP_BACKEND_SHM), "DP_SHM=0"}}}), "shm");
}

TEST(BackendChoice, ShmAcrossHostsIsUnsupportedOnEveryRankNamingTheHosts) {
  auto results = run_ranks(3, {{-1, {asking(DP_BACKEND_SHM)}},
                               {0, {"DP_HOST_ID=choice-a"}},
                               {1, {"DP_HOST_ID=choice-b"}},
                               {2, {"DP_HOST_ID=choice-a"}}});
  expect_every_rank_failed(results, DP_EUNSUPPORTED,
                           {"DP_BACKEND_SHM", "2 hosts", "id:choice-a", "rank(s) 0, 2", "id:choice-b", "rank(s) 1"});
}

TEST(BackendChoice, AutoKeepsSharedMemoryOnOneHostAndGlooWhenARankSaysDpShmZero) {
  expect_every_rank_ran(run_ranks(2, {}), "shm");
  expect_every_rank_ran(run_ranks(2, {{1, {"DP_SHM=0"}}}), "gloo");
}

TEST(BackendChoice, AutoAcrossEvenHostsIsHierarchicalAndAcrossUnevenHostsGloo) {
  expect_every_rank_ran(run_ranks(4, {{0, {"DP_HOST_ID=even-a"}},
                                      {1, {"DP_HOST_ID=even-a"}},
                                      {2, {"DP_HOST_ID=even-b"}},
                                      {3, {"DP_HOST_ID=even-b"}}}),
                        "shm+gloo");
  expect_every_rank_ran(
      run_ranks(3, {{0, {"DP_HOST_ID=uneven-a"}}, {1, {"DP_HOST_ID=uneven-a"}}, {2, {"DP_HOST_ID=uneven-b"}}}), "gloo");
}

TEST(BackendChoice, RanksAskingForDifferentBackendsFailOnEveryRankNamingThem) {
  auto results =
      run_ranks(3, {{0, {asking(DP_BACKEND_GLOO)}}, {1, {asking(DP_BACKEND_SHM)}}, {2, {asking(DP_BACKEND_GLOO)}}});
  expect_every_rank_failed(results, DP_EINVAL,
                           {"different backends", "rank 0 asks for DP_BACKEND_GLOO", "rank 1 asks for DP_BACKEND_SHM"});
  results = run_ranks(2, {{1, {asking(DP_BACKEND_GLOO)}}});
  expect_every_rank_failed(results, DP_EINVAL, {"rank 0 asks for DP_BACKEND_AUTO", "rank 1 asks for DP_BACKEND_GLOO"});
}

}  // namespace
