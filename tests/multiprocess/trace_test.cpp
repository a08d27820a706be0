// The flight recorder across real processes: a rank that stops or hangs
// leaves the others' dumps (on their timeout, or on SIGUSR1) from which
// dp-run --diagnose names it; and the diagnosis of dumps written by hand.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "process_util.h"

namespace {

struct Diagnosis {
  int exit_code = -1;
  std::string output;
};

Diagnosis diagnose(const std::string& dir) {
  const std::string command = "timeout -s KILL 60 " + std::string(DP_RUN) + " --diagnose " + dir + " 2>&1";
  Diagnosis d;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return d;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) d.output.append(buf, n);
  const int status = ::pclose(pipe);
  d.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return d;
}

std::string temp_dir() {
  char name[] = "/tmp/dp_trace_XXXXXX";
  return ::mkdtemp(name) != nullptr ? name : "";
}

void remove_dir(const std::string& dir) {
  const std::string command = "rm -rf '" + dir + "'";
  if (std::system(command.c_str()) != 0) ADD_FAILURE() << "could not remove " << dir;
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(FlightRecorder, RanksThatTimeOutDumpAndTheDiagnosisNamesTheStoppedRank) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  dptest::RankJob job;
  job.name = "a stopped rank";
  job.dir = dir;
  job.world = 3;
  job.argv = {DP_TRACE_WORKER, "stop", "12", "2", "6"};
  job.stopped_rank = 2;
  job.limit = std::chrono::seconds(200);
  job.env = [&](int) {
    return std::vector<std::string>{"DP_TRACE_DIR=" + dir, "DP_TRACE_BUFFER=4", "DP_TEST_TIMEOUT_MS=10000", "DP_SHM=0"};
  };
  const std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  ASSERT_EQ(exits.size(), 3u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(exits[r].exit_code, 1) << exits[r].output;
    EXPECT_NE(exits[r].output.find("call 6 failed"), std::string::npos) << exits[r].output;
    EXPECT_TRUE(exists(dir + "/rank" + std::to_string(r) + ".json")) << "rank " << r << " wrote no dump";
  }
  EXPECT_FALSE(exists(dir + "/rank2.json")) << "the stopped rank wrote a dump";
  // DP_TRACE_BUFFER=4: the last 4 calls, the one that timed out last.
  const std::string dump = dptest::read_file(dir + "/rank0.json");
  EXPECT_EQ(count(dump, "\"call\": \"all_reduce\""), 4u) << dump;
  EXPECT_NE(dump.find("\"state\": \"failed\""), std::string::npos) << dump;
  EXPECT_NE(dump.find("timed out"), std::string::npos) << dump;

  const Diagnosis d = diagnose(dir);
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("rank 2: no dump"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("behind: rank 2: ranks 0, 1 reached"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("rank 2 left no dump"), std::string::npos) << d.output;
  EXPECT_EQ(d.output.find("first call to differ"), std::string::npos) << d.output;
  remove_dir(dir);
}

// The dumps of every rank, asked for until the diagnosis of `dir` names
// rank 1 behind (the others may not have started their call at the first
// request) or `deadline` passes; `ask` sends the request.
Diagnosis dump_until_rank_one_is_behind(const std::string& dir, std::chrono::steady_clock::time_point deadline,
                                        const std::function<void()>& ask) {
  Diagnosis d;
  while (std::chrono::steady_clock::now() < deadline) {
    for (const char* file : {"/rank0.json", "/rank1.json", "/rank2.json"}) ::unlink((dir + file).c_str());
    ask();
    for (int i = 0;
         i < 500 && !(exists(dir + "/rank0.json") && exists(dir + "/rank1.json") && exists(dir + "/rank2.json")); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    d = diagnose(dir);
    if (d.output.find("behind: rank 1: ranks 0, 2 reached") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return d;
}

TEST(FlightRecorder, SigusrOneDumpsEveryRankAndTheDiagnosisNamesTheRankThatHasNotCalled) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  dptest::RankJob job;
  job.name = "a paused rank";
  job.dir = dir;
  job.world = 3;
  job.argv = {DP_TRACE_WORKER, "pause", "12", "1", "5"};
  job.limit = std::chrono::seconds(200);
  job.env = [&](int) { return std::vector<std::string>{"DP_TRACE_DIR=" + dir, "DP_SHM=0"}; };
  Diagnosis d;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  job.watch = [&](const std::vector<pid_t>& pids, const std::vector<std::string>& out) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "no diagnosis named rank 1 in time; the last:\n" << d.output;
    } else {
      if (out.size() < 3 || out[0].find("entering call 5") == std::string::npos ||
          out[1].find("pausing") == std::string::npos || out[2].find("entering call 5") == std::string::npos) {
        return false;
      }
      d = dump_until_rank_one_is_behind(dir, deadline, [&] {
        for (pid_t pid : pids) ::kill(pid, SIGUSR1);
      });
    }
    for (pid_t pid : pids) ::kill(pid, SIGKILL);
    return true;
  };
  const std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  ASSERT_EQ(exits.size(), 3u);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(exits[r].exit_code, 128 + SIGKILL) << "SIGUSR1 ended rank " << r;
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("3 dump(s)"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("behind: rank 1: ranks 0, 2 reached"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("rank 1 is at"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("dumped on SIGUSR1"), std::string::npos) << d.output;
  remove_dir(dir);
}

TEST(FlightRecorder, DpRunWithATraceDirPassesSigusrOneToItsRanksAndTheJobGoesOn) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string traces = dir + "/traces", out = dir + "/dp-run.txt";
  std::vector<std::string> words = {DP_RUN,     "--trace-dir",   traces,  "-n", "3", "env",
                                    "DP_SHM=0", DP_TRACE_WORKER, "pause", "12", "1", "5"};
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  auto output = [&] { return dptest::read_file(out); };
  while (std::chrono::steady_clock::now() < deadline &&
         !(output().find("rank 1 pausing") != std::string::npos && count(output(), "entering call 5") == 2)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const Diagnosis d = dump_until_rank_one_is_behind(traces, deadline, [&] { ::kill(pid, SIGUSR1); });
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, WNOHANG), 0) << "SIGUSR1 ended dp-run:\n" << output();
  ::kill(pid, SIGTERM);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << output();
  EXPECT_NE(d.output.find("3 dump(s)"), std::string::npos) << d.output << output();
  EXPECT_NE(d.output.find("behind: rank 1: ranks 0, 2 reached"), std::string::npos) << d.output << output();
  remove_dir(dir);
}

// dp_process_group_abort on rank 0 (running: from another thread while its
// all_reduce waits; between: between calls), on Gloo ("0") or shared
// memory ("": one host, DP_SHM unset).
void expect_abort_fails_this_rank_and_the_peer(const char* when, const char* shm) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  dptest::RankJob job;
  job.name = std::string("abort ") + when + ", DP_SHM=" + shm;
  job.dir = dir;
  job.world = 2;
  job.argv = {DP_TRACE_WORKER, "abort", when};
  job.limit = std::chrono::seconds(250);
  job.env = [&](int) {
    std::vector<std::string> env{"DP_TEST_DIR=" + dir, "DP_TRACE_DIR=" + dir};
    if (*shm != '\0') env.push_back(std::string("DP_SHM=") + shm);
    return env;
  };
  const std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  ASSERT_EQ(exits.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(exits[r].exit_code, 0) << exits[r].output;
    EXPECT_NE(exits[r].output.find("rank " + std::to_string(r) + ": abort passed"), std::string::npos)
        << exits[r].output;
  }
  // The aborting rank wrote its flight recorder, saying why.
  EXPECT_NE(dptest::read_file(dir + "/rank0.json").find("abort: aborted by dp_process_group_abort on rank 0"),
            std::string::npos);
  remove_dir(dir);
}

TEST(ProcessGroupAbort, FromAnotherThreadFailsTheSharedMemoryCallInFlightTheNextOneAndThePeersNext) {
  expect_abort_fails_this_rank_and_the_peer("running", "");
}

TEST(ProcessGroupAbort, BetweenCallsFailsTheNextGlooCallAndThePeersAtOnce) {
  expect_abort_fails_this_rank_and_the_peer("between", "0");
}

TEST(ProcessGroupAbort, BetweenCallsFailsTheNextSharedMemoryCallAndThePeersAtOnce) {
  expect_abort_fails_this_rank_and_the_peer("between", "");
}

// A dump as a rank writes it: `calls` are (seq, call, dtype, numel, state).
void write_dump(const std::string& path, int rank, const std::string& calls) {
  std::ofstream(path)
      << R"({"format": "dparallel-trace-1", "rank": )" << rank
      << R"(, "pid": 1, "reason": "SIGUSR1", "time_us": 5000000, "groups": [{"group": "group0/", "rank": )" << rank
      << R"(, "size": 2, "backend": "gloo", "calls": [)" << calls << "]}]}";
}

std::string call(int seq, const char* kind, const char* dtype, int numel, const char* state) {
  return "{\"seq\": " + std::to_string(seq) + ", \"call\": \"" + kind + "\", \"state\": \"" + state +
         "\", \"dtype\": \"" + dtype + "\", \"numel\": " + std::to_string(numel) +
         ", \"op\": \"sum\", \"root\": -1, \"caller\": \"the host's own call\", \"started_us\": 1000000}";
}

TEST(FlightRecorder, TheDiagnosisNamesTheFirstCollectiveTheRanksCalledDifferently) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  write_dump(dir + "/rank0.json", 0,
             call(1, "all_reduce", "float32", 10, "done") + "," + call(2, "all_reduce", "float32", 10, "done") + "," +
                 call(3, "all_reduce", "float32", 10, "started"));
  write_dump(dir + "/rank1.json", 1,
             call(1, "all_reduce", "float32", 10, "done") + "," + call(2, "all_reduce", "float32", 12, "done") + "," +
                 call(3, "broadcast", "float32", 10, "started"));
  std::ofstream(dir + "/garbage.json") << "{\"format\": ";
  const Diagnosis d = diagnose(dir);
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("skipped " + dir + "/garbage.json"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("2 dump(s)"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("no rank behind"), std::string::npos) << d.output;
  EXPECT_NE(d.output.find("first call to differ: collective #2: rank 0 called #2 all_reduce float32 x 10"),
            std::string::npos)
      << d.output;
  EXPECT_NE(d.output.find("rank 1 called #2 all_reduce float32 x 12"), std::string::npos) << d.output;
  remove_dir(dir);

  const std::string empty = temp_dir();
  const Diagnosis none = diagnose(empty);
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_NE(none.output.find("no trace in"), std::string::npos) << none.output;
  remove_dir(empty);
  EXPECT_EQ(diagnose("/nonexistent/dp_trace").exit_code, 2);
}

}  // namespace
