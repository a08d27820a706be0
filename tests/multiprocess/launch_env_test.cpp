// Ranks started the way clusters start them, with only Slurm's variables or
// only MPICH's (PMI_*), and by dp-run beside a host framework that has
// MASTER_PORT to itself; every run is bounded.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "process_util.h"

namespace {

// Inherited, a launcher's variables would be read instead of the test's.
bool launcher_variable(const std::string& entry) {
  for (const char* prefix : {"SLURM_", "PMI_", "OMPI_", "MPI_LOCALRANKID=", "DP_DEBUG="}) {
    if (entry.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// Whether `port` on loopback could be bound a moment ago.
bool port_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return bound;
}

// Runs a 2-rank job of the worker's "group" scenario with rank r's `env(r)` alone.
std::vector<dptest::RankExit> run_group(const std::string& name, std::function<std::vector<std::string>(int)> env) {
  char dir[] = "/tmp/dp_launch_env_XXXXXX";
  dptest::RankJob job;
  job.name = name;
  job.dir = ::mkdtemp(dir);
  job.argv = {DP_LAUNCH_ENV_WORKER, "group"};
  job.world = 2;
  job.torchrun_env = false;
  job.drop_inherited = launcher_variable;
  job.env = std::move(env);
  std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  ::rmdir(job.dir.c_str());
  return exits;
}

void expect_passed(const std::vector<dptest::RankExit>& exits, const std::string& scenario,
                   const std::vector<std::string>& mentions) {
  ASSERT_EQ(exits.size(), 2u);
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_EQ(exits[r].exit_code, 0) << "rank " << r << ":\n" << exits[r].output;
    const std::string passed = "rank " + std::to_string(r) + " of 2: " + scenario + " passed";
    EXPECT_NE(exits[r].output.find(passed), std::string::npos) << "rank " << r << ":\n" << exits[r].output;
    for (const std::string& text : mentions) {
      EXPECT_NE(exits[r].output.find(text), std::string::npos) << "no '" << text << "' in:\n" << exits[r].output;
    }
  }
}

TEST(ClusterLaunch, SlurmsVariablesAloneMakeAGroupWithItsStoreOnTheNodelistsFirstHost) {
  // A job id whose port (20000 + id % 10000) is free now.
  int port = 20000 + static_cast<int>(::getpid() % 10000);
  for (int tries = 0; tries < 10000 && !port_free(port); ++tries) port = 20000 + (port - 20000 + 1) % 10000;
  ASSERT_TRUE(port_free(port));
  const std::string job_id = std::to_string(70000 + port - 20000);
  auto exits = run_group("slurm", [&](int r) {
    return std::vector<std::string>{
        "SLURM_PROCID=" + std::to_string(r),           "SLURM_NTASKS=2",         "SLURM_LOCALID=" + std::to_string(r),
        "SLURM_JOB_NODELIST=127.0.0.[1-2],gpu[01-02]", "SLURM_JOB_ID=" + job_id, "DP_DEBUG=INFO"};
  });
  // DP_DEBUG says, on stderr, which launcher's variables were read.
  expect_passed(exits, "group",
                {"rank from SLURM_PROCID (Slurm), world size from SLURM_NTASKS (Slurm)",
                 "a TCP store at 127.0.0.1:" + std::to_string(port) +
                     " served by rank 0 (host from the first host of SLURM_JOB_NODELIST, port from SLURM_JOB_ID)"});
}

// MPICH's and Intel MPI's variables, MASTER_ADDR and MASTER_PORT, and DP_DEBUG when `debug`.
std::vector<dptest::RankExit> run_pmi_group(bool debug) {
  const std::string port = std::to_string(dptest::free_port());
  return run_group("pmi", [&](int r) {
    std::vector<std::string> env = {"PMI_RANK=" + std::to_string(r), "PMI_SIZE=2",
                                    "MPI_LOCALRANKID=" + std::to_string(r), "MASTER_ADDR=127.0.0.1",
                                    "MASTER_PORT=" + port};
    if (debug) env.push_back("DP_DEBUG=INFO");
    return env;
  });
}

TEST(ClusterLaunch, PmiVariablesAloneMakeAGroup) {
  expect_passed(run_pmi_group(true), "group", {"rank from PMI_RANK (MPICH or Intel MPI)", "port from MASTER_PORT"});
}

TEST(ClusterLaunch, SaysNothingOfTheLauncherWithoutDpDebug) {
  auto exits = run_pmi_group(false);
  expect_passed(exits, "group", {});
  for (const auto& exit : exits) EXPECT_EQ(exit.output.find("dparallel: rank"), std::string::npos) << exit.output;
}

struct Node {
  FILE* pipe = nullptr;
  std::string output;
  int exit_code = -1;
};

// dp-run with `args` running the worker's host-port scenario, its output
// read by finish(); killed after 90 s.
Node start_dp_run(const std::string& args) {
  const std::string command = "DP_STORE_TOKEN=host-port-test timeout -s KILL 90 " + std::string(DP_RUN) + " " + args +
                              " " + DP_LAUNCH_ENV_WORKER + " host-port 2>&1";
  Node node;
  node.pipe = ::popen(command.c_str(), "r");
  return node;
}

void finish(Node& node) {
  if (node.pipe == nullptr) return;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), node.pipe)) > 0;) node.output.append(buf, n);
  const int status = ::pclose(node.pipe);
  node.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The rank listens on MASTER_PORT before its group is made (a store there
// could not be served) and the other rank reaches it there.
TEST(DpRunHostFramework, RanksServeMasterPortThemselvesWhileTheirGroupUsesTheStorePort) {
  Node node = start_dp_run("-n 2");
  ASSERT_NE(node.pipe, nullptr);
  finish(node);
  EXPECT_EQ(node.exit_code, 0) << node.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string passed =
        "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) + " of 2: host-port passed";
    EXPECT_NE(node.output.find(passed), std::string::npos) << node.output;
  }
}

TEST(DpRunHostFramework, TwoNodesRendezvousAtTheStorePortDerivedFromTheMasterPort) {
  // P and P + 1 both free a moment ago.
  int port = 0;
  for (int tries = 0; tries < 100 && port == 0; ++tries) {
    const int p = dptest::free_port();
    if (p < 65535 && port_free(p + 1)) port = p;
  }
  ASSERT_NE(port, 0);
  const std::string common = "-n 1 --nnodes 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port);
  Node nodes[2] = {start_dp_run(common + " --node-rank 0"), start_dp_run(common + " --node-rank 1")};
  for (Node& node : nodes) finish(node);
  const std::string ports =
      "host-port passed (store port " + std::to_string(port + 1) + ", master port " + std::to_string(port) + ")";
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(nodes[i].exit_code, 0) << "node " << i << ":\n" << nodes[i].output;
    const std::string passed = "[rank " + std::to_string(i) + "] rank " + std::to_string(i) + " of 2: " + ports;
    EXPECT_NE(nodes[i].output.find(passed), std::string::npos) << "node " << i << ":\n" << nodes[i].output;
  }
}

TEST(DpRunHostFramework, AGivenStorePortIsUsedOnEveryNode) {
  int port = dptest::free_port(), store_port = dptest::free_port();
  for (int tries = 0; tries < 100 && store_port == port; ++tries) store_port = dptest::free_port();
  ASSERT_NE(port, store_port);
  const std::string common = "-n 1 --nnodes 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port) +
                             " --store-port " + std::to_string(store_port);
  Node nodes[2] = {start_dp_run(common + " --node-rank 0"), start_dp_run(common + " --node-rank 1")};
  for (Node& node : nodes) finish(node);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(nodes[i].exit_code, 0) << "node " << i << ":\n" << nodes[i].output;
    EXPECT_NE(nodes[i].output.find("(store port " + std::to_string(store_port) + ", master port " +
                                   std::to_string(port) + ")"),
              std::string::npos)
        << "node " << i << ":\n"
        << nodes[i].output;
  }
}

}  // namespace
