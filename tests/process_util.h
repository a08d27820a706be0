// What the multi-process tests share: a free loopback port, whether a
// process still runs, reading a rank's output file, and running a job's
// ranks as processes.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dptest {

// A port that was free a moment ago (the kernel hands out ephemeral ports in
// sequence, so a parallel test rarely gets the same one).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Alive and not a zombie (an orphan's zombie may wait long for a reaper).
inline bool running(int pid) {
  FILE* stat = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (stat == nullptr) return false;
  char state = 0;
  const int scanned = std::fscanf(stat, "%*d %*s %c", &state);
  std::fclose(stat);
  return scanned == 1 && state != 'Z' && state != 'X';
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A job's ranks as processes on this host, the way dp-run starts them.
struct RankJob {
  std::string name;               // for messages
  std::string dir;                // where rank r's output goes (rank<r>.txt)
  std::vector<std::string> argv;  // the program and its arguments, the same for every rank
  int world = 2;
  // Inherited variables a rank does not get (the launcher's own never pass).
  std::function<bool(const std::string& entry)> drop_inherited;
  std::function<std::vector<std::string>(int rank)> env;  // added for rank r, last
  bool torchrun_env = true;        // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; else only `env`'s
  std::chrono::seconds limit{60};  // then every rank still running is killed
  int stopped_rank = -1;           // this rank may stop; it is killed once the others are done
  // Called every few ms while the ranks run, with their output so far, until
  // it returns true (it has acted).
  std::function<bool(const std::vector<pid_t>&, const std::vector<std::string>&)> watch;
};

struct RankExit {
  int exit_code = -1;  // 128 + signal when killed
  std::string output;
};

// Starts every rank of `job` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
// (loopback) and a free MASTER_PORT (unless !torchrun_env), reaps them within its limit, and
// returns their exit codes and output (the output files are removed).
inline std::vector<RankExit> run_rank_processes(const RankJob& job) {
  static const char* const kLauncher[] = {
      "RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "DP_STORE_ADDR=", "DP_STORE_PORT="};
  const int port = free_port();
  std::vector<pid_t> pids;
  std::vector<std::string> outputs;
  for (int r = 0; r < job.world; ++r) {
    std::vector<std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry = *e;
      bool launcher = false;
      for (const char* name : kLauncher) launcher = launcher || entry.rfind(name, 0) == 0;
      if (!launcher && !(job.drop_inherited && job.drop_inherited(entry))) vars.push_back(entry);
    }
    if (job.torchrun_env) {
      vars.push_back("RANK=" + std::to_string(r));
      vars.push_back("WORLD_SIZE=" + std::to_string(job.world));
      vars.push_back("LOCAL_RANK=" + std::to_string(r));
      vars.push_back("MASTER_ADDR=127.0.0.1");
      vars.push_back("MASTER_PORT=" + std::to_string(port));
    }
    if (job.env) {
      for (auto& v : job.env(r)) vars.push_back(v);
    }
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::vector<std::string> words = job.argv;
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    std::string out = job.dir + "/rank" + std::to_string(r) + ".txt";
    outputs.push_back(out);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << "posix_spawn " << job.argv[0];
    if (rc == 0) pids.push_back(pid);
  }
  std::vector<RankExit> exits(pids.size());
  std::vector<bool> reaped(pids.size(), false);
  auto deadline = std::chrono::steady_clock::now() + job.limit;
  size_t left = pids.size();
  bool watched = !job.watch;
  while (left > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (reaped[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG | WUNTRACED) != pids[r]) continue;
      if (WIFSTOPPED(status)) {
        EXPECT_EQ(static_cast<int>(r), job.stopped_rank) << "rank " << r << " stopped unexpectedly";
        continue;
      }
      exits[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      reaped[r] = true;
      --left;
    }
    if (!watched) {
      std::vector<std::string> so_far;
      for (const auto& path : outputs) so_far.push_back(read_file(path));
      watched = job.watch(pids, so_far);
    }
    if (job.stopped_rank >= 0 && left == 1 && !reaped[static_cast<size_t>(job.stopped_rank)]) {
      ::kill(pids[static_cast<size_t>(job.stopped_rank)], SIGKILL);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << job.name << ": ranks still running after " << job.limit.count() << " s; killing them";
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!reaped[r]) ::kill(pids[r], SIGKILL);
      }
      deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    exits[r].output = read_file(outputs[r]);
    ::unlink(outputs[r].c_str());
  }
  return exits;
}

}  // namespace dptest
