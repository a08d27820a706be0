// dp-run against hostile ranks: endless output lines, processes that leave
// the rank's process group and ignore SIGTERM. Every run is bounded.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

extern char** environ;

namespace {

struct Finished {
  int exit_code = -1;
  long max_rss_kib = 0;
  double seconds = 0;
};

// dp-run with `args` (through sh), its output to /dev/null; killed after 60 s.
Finished run_dp_run(const std::string& args) {
  std::string command = std::string("exec ") + DP_RUN + " " + args + " >/dev/null 2>&1";
  const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
  auto start = std::chrono::steady_clock::now();
  pid_t pid = -1;
  Finished r;
  if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0) return r;
  int status = 0;
  rusage usage{};
  pid_t got = 0;
  while ((got = ::wait4(pid, &status, WNOHANG, &usage)) == 0) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.exit_code = got == pid && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.max_rss_kib = usage.ru_maxrss;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

// Alive and not a zombie.
bool running(int pid) {
  FILE* stat = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (stat == nullptr) return false;
  char state = 0;
  int scanned = std::fscanf(stat, "%*d %*s %c", &state);
  std::fclose(stat);
  return scanned == 1 && state != 'Z' && state != 'X';
}

int read_pid(const std::string& path) {
  int pid = 0;
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%d", &pid) != 1) pid = 0;
  std::fclose(f);
  return pid;
}

TEST(DpRun, SplitsAnEndlessOutputLineInsteadOfHoldingItInMemory) {
  // 128 MiB without a newline; held whole, it would be dp-run's resident size.
  Finished r = run_dp_run("-n 1 sh -c 'head -c 134217728 /dev/zero | tr \"\\\\0\" x'");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_GT(r.max_rss_kib, 0);
  EXPECT_LT(r.max_rss_kib, 64 * 1024) << "dp-run held the rank's unfinished line";
}

TEST(DpRun, StopsAProcessThatLeftTheRanksSessionAndIgnoresSigterm) {
  char dir[] = "/tmp/dp_run_escape_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  std::string pid_file = std::string(dir) + "/pid";
  // The escaped process writes its pid once it runs in its own session; the
  // rank exits 0 right after, leaving it behind.
  Finished r = run_dp_run("-n 1 --grace-ms 500 sh -c 'setsid sh -c \"trap \\\"\\\" TERM; echo \\$\\$ > " + pid_file +
                          "; while :; do sleep 1; done\" & for i in $(seq 500); do [ -s " + pid_file +
                          " ] && exit 0; sleep 0.01; done; exit 1'");
  int pid = read_pid(pid_file);
  bool left_running = pid > 0 && running(pid);
  if (pid > 0) ::kill(pid, SIGKILL);
  ::unlink(pid_file.c_str());
  ::rmdir(dir);
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_GT(pid, 0) << "the escaped process never started";
  EXPECT_FALSE(left_running) << "process " << pid << " outlived dp-run";
  EXPECT_LT(r.seconds, 30.0);
}

}  // namespace
