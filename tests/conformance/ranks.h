// Runs one worker program as a job's ranks on this host (process_util.h),
// with a scratch directory, per-rank variables, and nothing inherited that
// picks a backend, a host or a token.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "process_util.h"

namespace dptest {

struct Ranks {
  std::string program;
  std::string arguments;  // split at spaces into arguments of their own
  int world = 2;
  std::chrono::seconds limit{120};
  int stopped_rank = -1;                        // this rank may stop; killed once the others are done
  std::map<int, std::vector<std::string>> env;  // extra variables by rank (-1: every rank)
  bool file_store = false;                      // DP_TEST_STORE names a file store in the scratch directory
  std::vector<std::string> wrapper;             // a program and its arguments that runs each rank
  // Called every few ms while ranks run, with their output so far; returns
  // true once it has acted (it runs until then).
  std::function<bool(const std::vector<pid_t>&, const std::vector<std::string>&)> watch;
};

inline std::vector<RankExit> run_ranks(const Ranks& run) {
  char dir_template[] = "/tmp/dp_ranks_XXXXXX";
  RankJob job;
  job.name = run.arguments;
  job.dir = ::mkdtemp(dir_template);
  job.argv = run.wrapper;
  job.argv.push_back(run.program);
  std::istringstream words(run.arguments);
  for (std::string word; words >> word;) job.argv.push_back(word);
  job.world = run.world;
  job.drop_inherited = [](const std::string& entry) {
    for (const char* name : {"DP_SHM=", "DP_HOST_ID=", "DP_STORE_TOKEN=", "DP_TEST_"}) {
      if (entry.rfind(name, 0) == 0) return true;
    }
    return false;
  };
  const std::string store = job.dir + "/store";
  job.env = [&](int r) {
    std::vector<std::string> vars;
    if (run.file_store) vars.push_back("DP_TEST_STORE=" + store);
    for (int key : {-1, r}) {
      auto it = run.env.find(key);
      if (it != run.env.end()) vars.insert(vars.end(), it->second.begin(), it->second.end());
    }
    return vars;
  };
  job.limit = run.limit;
  job.stopped_rank = run.stopped_rank;
  job.watch = run.watch;
  std::vector<RankExit> results = run_rank_processes(job);
  ::unlink(store.c_str());
  ::rmdir(job.dir.c_str());
  return results;
}

inline void expect_all_passed(const std::vector<RankExit>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << " output:\n" << results[r].output;
  }
}

}  // namespace dptest
