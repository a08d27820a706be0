// dp-run: the environment each rank gets, prefixed output, failure
// propagation; every run is bounded by coreutils' timeout.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "process_util.h"

using dptest::running;

namespace {

struct LaunchResult {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

LaunchResult launch(const std::string& args) {
  std::string command = "timeout -s KILL 60 " + std::string(DP_RUN) + " " + args + " 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = ::popen(command.c_str(), "r");
  LaunchResult r;
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

TEST(Launcher, GivesEachRankTorchrunsEnvironmentAndPrefixesItsOutput) {
  LaunchResult r = launch(
      "-n 3 sh -c 'echo r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE a=$MASTER_ADDR "
      "p=${MASTER_PORT:+set} t=${DP_STORE_TOKEN:+set} sa=$DP_STORE_ADDR sp=${DP_STORE_PORT:+set}'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    std::string line = "[rank " + std::to_string(rank) + "] r=" + std::to_string(rank) +
                       " w=3 l=" + std::to_string(rank) + " lw=3 a=127.0.0.1 p=set t=set sa=127.0.0.1 sp=set";
    EXPECT_NE(r.output.find(line), std::string::npos) << r.output;
  }
}

TEST(Launcher, NumbersRanksByNodeInMultiNodeJobs) {
  LaunchResult r = launch(
      "-n 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29999 "
      "sh -c 'echo r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK p=$MASTER_PORT sp=$DP_STORE_PORT'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // The store's port is derived from the master port, the same on every node.
  EXPECT_NE(r.output.find("[rank 2] r=2 w=4 l=0 p=29999 sp=30000"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 3] r=3 w=4 l=1 p=29999 sp=30000"), std::string::npos) << r.output;
  LaunchResult missing = launch("-n 2 --nnodes 2 --node-rank 1 true");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("--master-addr"), std::string::npos) << missing.output;
}

TEST(Launcher, StopsTheOtherRanksAndExitsWithTheFailedRanksCode) {
  LaunchResult r =
      launch("-n 3 --grace-ms 2000 sh -c 'if [ $RANK = 1 ]; then echo failing; exit 3; fi; exec sleep 30'");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(r.seconds, 10.0) << "the sleeping ranks were not stopped";
  EXPECT_NE(r.output.find("[rank 1] failing"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3"), std::string::npos) << r.output;
}

// A rank that fails in the first run: with --max-restarts the others are
// stopped (the first run's other rank would sleep past launch()'s 60 s
// bound, which kills the job) and the job runs again with
// DP_RESTART_COUNT counting the runs;
// a job that keeps failing gives up after K restarts with its rank's code;
// without the option nothing restarts, and across nodes it is refused.
TEST(Launcher, MaxRestartsStartsAFailedJobAgainWithItsRestartCount) {
  LaunchResult r = launch(
      "-n 2 --max-restarts 1 --grace-ms 2000 sh -c 'echo run=$DP_RESTART_COUNT; "
      "if [ $DP_RESTART_COUNT = 0 ]; then if [ $RANK = 1 ]; then exit 5; fi; exec sleep 600; fi'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // The first run's rank 0 may be stopped before it prints: rank 1 can fail first.
  for (const char* line :
       {"[rank 1] run=0", "[rank 0] run=1", "[rank 1] run=1", "restarting the job (restart 1 of 1)"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  LaunchResult exhausted = launch("-n 2 --max-restarts 2 sh -c 'echo run=$DP_RESTART_COUNT; exit 4'");
  EXPECT_EQ(exhausted.exit_code, 4) << exhausted.output;
  EXPECT_NE(exhausted.output.find("run=2"), std::string::npos) << exhausted.output;
  EXPECT_EQ(exhausted.output.find("run=3"), std::string::npos) << exhausted.output;
  LaunchResult once = launch("-n 2 sh -c 'echo run=$DP_RESTART_COUNT; exit 4'");
  EXPECT_EQ(once.exit_code, 4) << once.output;
  EXPECT_NE(once.output.find("run=0"), std::string::npos) << once.output;
  EXPECT_EQ(once.output.find("run=1"), std::string::npos) << once.output;
  LaunchResult nodes =
      launch("-n 1 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29999 --max-restarts 1 true");
  EXPECT_EQ(nodes.exit_code, 2) << nodes.output;
  EXPECT_NE(nodes.output.find("--max-restarts needs a job of one node"), std::string::npos) << nodes.output;
}

// The second run meets through a store on the same port as the first's,
// whose rank 0 was stopped while it waited for a rank that had failed.
TEST(Launcher, ARestartedJobMeetsAgainThroughTheStore) {
  LaunchResult r = launch(
      "-n 2 --max-restarts 1 --grace-ms 2000 sh -c 'if [ $DP_RESTART_COUNT = 0 ] && "
      "[ $RANK = 1 ]; then exit 3; fi; exec " +
      std::string(DP_MP_WORKER) + " async'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1: async passed"), std::string::npos) << r.output;
}

// Expects `count` pids in the file at `path`, none running; kills them and removes the file.
void expect_none_running(const char* path, int count, const char* what) {
  FILE* pids = std::fopen(path, "r");
  ASSERT_NE(pids, nullptr);
  int pid = 0, found = 0;
  while (std::fscanf(pids, "%d", &pid) == 1) {
    ++found;
    EXPECT_FALSE(running(pid)) << what << ": " << pid;
    ::kill(pid, SIGKILL);
  }
  std::fclose(pids);
  ::unlink(path);
  EXPECT_EQ(found, count);
}

TEST(Launcher, RanksDieWithAKilledLauncher) {
  char path[] = "/tmp/dp_run_pids_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  // The launcher is killed after 1 s; its ranks would sleep for 30.
  std::string command =
      std::string(DP_RUN) + " -n 2 sh -c 'echo $$ >> " + path + "; exec sleep 30' & sleep 1; kill -9 $!; wait";
  FILE* shell = ::popen(command.c_str(), "r");
  ASSERT_NE(shell, nullptr);
  ::pclose(shell);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  expect_none_running(path, 2, "rank process outlived the launcher");
}

TEST(Launcher, StopsWhatARankStartedEvenAfterThatRankExited) {
  char path[] = "/tmp/dp_run_pids_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  // Every rank starts a background sleep; rank 1 then fails (once both are
  // recorded, 5 s at most), rank 0 waits.
  std::string p = path;
  LaunchResult r = launch("-n 2 --grace-ms 500 sh -c 'sleep 30 >/dev/null 2>&1 & echo $! >> " + p +
                          "; if [ $RANK = 1 ]; then for i in $(seq 500); do [ $(wc -l < " + p +
                          ") -ge 2 ] && break; sleep 0.01; done; exit 3; fi; wait'");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  expect_none_running(path, 2, "process started by a rank outlived dp-run");
}

TEST(Launcher, ASecondInterruptDuringTheGracePeriodKillsAtOnce) {
  // The rank ignores SIGTERM and SIGINT; the grace period is 30 s.
  std::string command =
      std::string("echo $$; exec ") + DP_RUN +
      " -n 1 --grace-ms 30000 sh -c 'trap \"\" TERM INT; echo up; sleep 30 >/dev/null 2>&1 & wait' 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* shell = ::popen(command.c_str(), "r");
  ASSERT_NE(shell, nullptr);
  int pid = 0;
  ASSERT_EQ(std::fscanf(shell, "%d", &pid), 1);
  std::thread watchdog([pid, start] {
    while (std::chrono::steady_clock::now() - start < std::chrono::seconds(15)) {
      if (::kill(pid, 0) != 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid, SIGKILL);
  });
  char line[256];
  while (std::fgets(line, sizeof(line), shell) != nullptr && std::string(line).find("up") == std::string::npos) {
  }
  ::kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(pid, SIGINT);
  while (std::fgets(line, sizeof(line), shell) != nullptr) {
  }
  int status = ::pclose(shell);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  watchdog.join();
  EXPECT_LT(seconds, 5.0) << "the second SIGINT did not escalate to SIGKILL";
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT);
}

TEST(Launcher, HoldsTheStorePortItPicksUntilTheJobEnds) {
  // The rank prints its DP_STORE_PORT and lives 3 s; meanwhile no other socket may bind that port.
  std::string command =
      std::string("timeout -s KILL 30 ") + DP_RUN + " -n 1 sh -c 'echo port=$DP_STORE_PORT; sleep 3' 2>&1";
  FILE* shell = ::popen(command.c_str(), "r");
  ASSERT_NE(shell, nullptr);
  char line[256];
  int port = 0;
  while (port == 0 && std::fgets(line, sizeof(line), shell) != nullptr) {
    const char* at = std::strstr(line, "port=");
    if (at != nullptr) port = std::atoi(at + 5);
  }
  ASSERT_GT(port, 0);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(fd);
  while (std::fgets(line, sizeof(line), shell) != nullptr) {
  }
  ::pclose(shell);
  EXPECT_EQ(rc, -1) << "port " << port << " was free to anyone while the job ran";
  EXPECT_EQ(err, EADDRINUSE);
}

TEST(Launcher, RejectsBadUsage) {
  EXPECT_EQ(launch("true").exit_code, 2);
  EXPECT_EQ(launch("-n 0 true").exit_code, 2);
  EXPECT_EQ(launch("-n 2").exit_code, 2);
  LaunchResult r = launch("-n 1 /nonexistent/program");
  EXPECT_EQ(r.exit_code, 127) << r.output;
}

TEST(Launcher, RunsARealJobThroughTheStoreWithItsToken) {
  LaunchResult r = launch("-n 2 " + std::string(DP_MP_WORKER) + " async");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1: async passed"), std::string::npos) << r.output;
}

// A port that was free a moment ago.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

TEST(Launcher, TwoNodesFormOneJobThroughTheFirstNodesStore) {
  int port = free_port();
  ASSERT_GT(port, 0);
  // Both nodes share the job token, as a multi-node job must.
  std::string common = "DP_STORE_TOKEN=two-node-test timeout -s KILL 60 " + std::string(DP_RUN) +
                       " -n 1 --nnodes 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port);
  std::string worker = std::string(" ") + DP_MP_WORKER + " async 2>&1";
  FILE* node0 = ::popen((common + " --node-rank 0" + worker).c_str(), "r");
  FILE* node1 = ::popen((common + " --node-rank 1" + worker).c_str(), "r");
  ASSERT_NE(node0, nullptr);
  ASSERT_NE(node1, nullptr);
  std::string out[2];
  FILE* nodes[2] = {node0, node1};
  int status[2];
  for (int i = 0; i < 2; ++i) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), nodes[i])) > 0) out[i].append(buf, n);
    status[i] = ::pclose(nodes[i]);
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0) << "node " << i << ":\n" << out[i];
    std::string passed = "[rank " + std::to_string(i) + "] rank " + std::to_string(i) + ": async passed";
    EXPECT_NE(out[i].find(passed), std::string::npos) << "node " << i << ":\n" << out[i];
  }
}

TEST(Launcher, RunsDpPerfAcrossRanksWithACheckedResult) {
  for (const char* op : {"all_reduce", "broadcast", "all_gather", "reduce_scatter"}) {
    LaunchResult r = launch("-n 2 " + std::string(DP_PERF_DIST) + " " + op + " -b 4K -e 64K -f 16 -s 2 -n 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("out of bounds values: 0 OK"), std::string::npos) << r.output;
  }
}

}  // namespace
