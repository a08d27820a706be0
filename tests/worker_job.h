// Runs one scenario of a C test worker (ddp_worker, fsdp_worker) as a job's
// ranks on this host (process_util.h), each with DP_TEST_DIR, a folder of
// the run's own, and reads what the ranks printed and left there.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "process_util.h"

namespace dptest {

struct WorkerRun {
  std::vector<int> exit_codes;  // 128 + signal when killed
  std::vector<std::string> outputs;
  std::map<std::string, std::string> files;  // what the ranks left in DP_TEST_DIR
};

// Runs `world` ranks of `worker` `scenario` with `env` added ("{dir}" in a
// value is the run's folder, DP_TEST_DIR), and rank r's `rank_env(r)`;
// kills them all after `limit`.
inline WorkerRun run_worker(const std::string& worker, const std::string& scenario, int world,
                            std::vector<std::string> env = {}, std::chrono::seconds limit = std::chrono::seconds(60),
                            const std::function<std::vector<std::string>(int)>& rank_env = nullptr) {
  char dir_template[] = "/tmp/dp_worker_XXXXXX";
  RankJob job;
  job.name = scenario;
  job.dir = ::mkdtemp(dir_template);
  for (auto& e : env) {
    for (size_t at = e.find("{dir}"); at != std::string::npos; at = e.find("{dir}")) e.replace(at, 5, job.dir);
  }
  job.argv = {worker, scenario};
  job.world = world;
  // Inherited, these would change a scenario.
  job.drop_inherited = [](const std::string& entry) {
    for (const char* name :
         {"DP_TEST_DIR=", "DP_DEBUG=", "DP_TIMELINE=", "DP_TEST_SEED=", "DP_TEST_GROUP_", "DP_SHM=", "DP_HOST_ID="}) {
      if (entry.rfind(name, 0) == 0) return true;
    }
    return false;
  };
  job.env = [&](int r) {
    std::vector<std::string> vars = {"DP_TEST_DIR=" + job.dir};
    vars.insert(vars.end(), env.begin(), env.end());
    if (rank_env) {
      std::vector<std::string> mine = rank_env(r);
      vars.insert(vars.end(), mine.begin(), mine.end());
    }
    return vars;
  };
  job.limit = limit;
  WorkerRun run;
  for (auto& exit : run_rank_processes(job)) {
    run.exit_codes.push_back(exit.exit_code);
    run.outputs.push_back(std::move(exit.output));
  }
  // What the ranks left besides their output.
  if (DIR* d = ::opendir(job.dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      run.files[name] = read_file(job.dir + "/" + name);
      ::unlink((job.dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(job.dir.c_str());
  return run;
}

// Every rank exited 0 having printed its "passed" line.
inline void expect_passed(const WorkerRun& run, const std::string& scenario, int world) {
  ASSERT_EQ(run.exit_codes.size(), static_cast<size_t>(world));
  for (size_t r = 0; r < run.exit_codes.size(); ++r) {
    EXPECT_EQ(run.exit_codes[r], 0) << "rank " << r << " output:\n" << run.outputs[r];
    std::string line = "rank " + std::to_string(r) + ": " + scenario + " passed";
    EXPECT_NE(run.outputs[r].find(line), std::string::npos) << "no '" << line << "' in:\n" << run.outputs[r];
  }
}

inline void expect_mentions(const WorkerRun& run, size_t rank, const std::vector<std::string>& texts) {
  ASSERT_LT(rank, run.outputs.size());
  for (const auto& t : texts) {
    EXPECT_NE(run.outputs[rank].find(t), std::string::npos)
        << "rank " << rank << "'s output does not mention '" << t << "':\n"
        << run.outputs[rank];
  }
}

}  // namespace dptest
