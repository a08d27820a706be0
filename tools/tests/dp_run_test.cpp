// dp-run against hostile ranks: endless output lines, processes that leave
// the rank's process group and ignore SIGTERM, and every way dp-run itself
// is stopped or killed. Every run is bounded.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dp_run_job.h"

namespace {

using namespace dp_run_test;

TEST(DpRun, ForwardsAnEndlessOutputLineWithoutHoldingItInMemory) {
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

struct StopSignal {
  int number;
  std::string name;
};

void PrintTo(const StopSignal& sig, std::ostream* out) { *out << "SIG" << sig.name; }

// Every signal dp-run's header lists as stopping the job.
std::vector<StopSignal> stop_signals() {
  return {{SIGHUP, "HUP"},           {SIGINT, "INT"},    {SIGQUIT, "QUIT"}, {SIGTERM, "TERM"},
          {SIGUSR1, "USR1"},         {SIGUSR2, "USR2"},  {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"},
          {SIGVTALRM, "VTALRM"},     {SIGPROF, "PROF"},  {SIGIO, "IO"},     {SIGPWR, "PWR"},
          {SIGSTKFLT, "STKFLT"},     {SIGXCPU, "XCPU"},  {SIGXFSZ, "XFSZ"}, {SIGRTMIN, "RTMIN"},
          {SIGRTMIN + 1, "RTMIN_1"}, {SIGRTMAX, "RTMAX"}};
}

class DpRunStopSignal : public ::testing::TestWithParam<StopSignal> {};

// Also SIGINT and SIGQUIT, which the job is started with ignored, as a
// script's `dp-run &` is.
TEST_P(DpRunStopSignal, StopsEveryProcessOfTheJobAndExitsWith128PlusTheSignal) {
  const int sig = GetParam().number;
  Job job;
  ASSERT_TRUE(job.start_ranks_with_children({}));
  ASSERT_TRUE(job.wait_for_pids(kRanks * kPidsPerRank)) << job.output();
  ::kill(job.pid(), sig);
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + sig)
      << "dp-run ended with " << exit_text(status) << "\n"
      << job.output();
  std::vector<int> left = still_running(read_pids(job.pids_path()));
  EXPECT_TRUE(left.empty()) << "outlived dp-run:" << describe(left);
}

INSTANTIATE_TEST_SUITE_P(Signals, DpRunStopSignal, ::testing::ValuesIn(stop_signals()),
                         [](const ::testing::TestParamInfo<StopSignal>& param) { return param.param.name; });

TEST(DpRun, KillingItKillsEveryProcessOfTheJob) {
  Job job;
  ASSERT_TRUE(job.start_ranks_with_children({}));
  ASSERT_TRUE(job.wait_for_pids(kRanks * kPidsPerRank)) << job.output();
  ::kill(job.pid(), SIGKILL);
  job.wait();
  std::vector<int> left = still_running(read_pids(job.pids_path()));
  EXPECT_TRUE(left.empty()) << "outlived dp-run:" << describe(left);
}

// As `timeout -s KILL` and `kill -9 -PGID` do.
TEST(DpRun, KillingItsProcessGroupKillsEveryProcessOfTheJob) {
  Job job;
  Job::Options options;
  options.own_process_group = true;
  ASSERT_TRUE(job.start_ranks_with_children(options));
  ASSERT_TRUE(job.wait_for_pids(kRanks * kPidsPerRank)) << job.output();
  ::kill(-job.pid(), SIGKILL);
  job.wait();
  std::vector<int> left = still_running(read_pids(job.pids_path()));
  EXPECT_TRUE(left.empty()) << "outlived dp-run:" << describe(left);
}

// dp-run is two processes: the one started, and the launcher below it.
TEST(DpRun, KillingItsLauncherProcessStopsTheJob) {
  Job job;
  ASSERT_TRUE(job.start_ranks_with_children({}));
  ASSERT_TRUE(job.wait_for_pids(kRanks * kPidsPerRank)) << job.output();
  std::vector<int> launcher = children_named(job.pid(), "dp-run-launcher");
  ASSERT_EQ(launcher.size(), 1u) << "no launcher process below dp-run";
  ::kill(launcher[0], SIGKILL);
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL) << "dp-run ended with " << exit_text(status);
  std::vector<int> left = still_running(read_pids(job.pids_path()));
  EXPECT_TRUE(left.empty()) << "outlived dp-run:" << describe(left);
}

// As `pkill dp-run` does: the ranks still get their grace period.
TEST(DpRun, ASignalSentToBothOfItsProcessesCountsOnce) {
  Job job;
  ASSERT_TRUE(job.start(
      {"-n", "2", "--grace-ms", "30000", "sh", "-c",
       "trap 'sleep 1; echo cleaned up; exit 0' TERM; echo $$ >> " + job.pids_path() + "; while :; do sleep 0.1; done"},
      {}));
  ASSERT_TRUE(job.wait_for_pids(2)) << job.output();
  std::vector<int> launcher = children_named(job.pid(), "dp-run-launcher");
  ASSERT_EQ(launcher.size(), 1u) << "no launcher process below dp-run";
  ::kill(job.pid(), SIGTERM);
  ::kill(launcher[0], SIGTERM);
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << "dp-run ended with " << exit_text(status);
  EXPECT_NE(job.output().find("[rank 0] cleaned up"), std::string::npos) << job.output();
  EXPECT_NE(job.output().find("[rank 1] cleaned up"), std::string::npos) << job.output();
}

// As under nohup: the job goes on, and the ranks ignore SIGHUP too.
TEST(DpRun, KeepsRunningThroughASignalItWasStartedWithIgnored) {
  Job job;
  Job::Options options;
  options.ignored = {SIGHUP};
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c",
                         "echo $$ >> " + job.pids_path() + "; for i in $(seq 600); do [ -e " + go +
                             " ] && break; sleep 0.05; done; kill -HUP $$; echo survived"},
                        options));
  ASSERT_TRUE(job.wait_for_pids(2)) << job.output();
  ::kill(job.pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status) << "\n"
                                                             << job.output();
  EXPECT_NE(job.output().find("[rank 0] survived"), std::string::npos) << job.output();
  EXPECT_NE(job.output().find("[rank 1] survived"), std::string::npos) << job.output();
}

// Left ignored, SIGCHLD would have the kernel reap the ranks unseen.
TEST(DpRun, TellsHowTheRanksExitedWhenStartedWithSigchldIgnored) {
  Job job;
  Job::Options options;
  options.ignored = {SIGCHLD};
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c", "[ $RANK = 1 ] && exit 3; exit 0"}, options));
  int status = job.wait(std::chrono::seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "dp-run ended with " << exit_text(status) << "\n"
                                                             << job.output();
}

// A closed ssh session or `dp-run ... | head`: the job stops as for SIGPIPE.
TEST(DpRun, StopsTheJobWhenTheReaderOfItsOutputGoesAway) {
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  Job job;
  Job::Options options;
  options.stdout_fd = out[1];
  bool started = job.start({"-n", "2", "--grace-ms", "300", "sh", "-c",
                            "sleep 300 & echo $! >> " + job.pids_path() + "; echo $$ >> " + job.pids_path() +
                                "; while :; do echo line; sleep 0.05; done"},
                           options);
  ::close(out[1]);
  ASSERT_TRUE(started);
  ASSERT_TRUE(job.wait_for_pids(4));
  char buf[256];
  EXPECT_GT(::read(out[0], buf, sizeof(buf)), 0) << "no output came";
  ::close(out[0]);
  int status = job.wait(std::chrono::seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGPIPE) << "dp-run ended with " << exit_text(status);
  std::vector<int> left = still_running(read_pids(job.pids_path()));
  EXPECT_TRUE(left.empty()) << "outlived dp-run:" << describe(left);
}

// Once a rank's process group is empty, its id may become another group's;
// dp-run must not signal that one. The test hands the id of rank 0's group,
// which exits at once, to a new group through ns_last_pid, then has rank 1
// fail, which stops the job.
TEST(DpRun, LeavesAloneANewProcessGroupWithTheIdOfAnEmptyRankGroup) {
  const char* last_pid_path = "/proc/sys/kernel/ns_last_pid";
  if (::access(last_pid_path, W_OK) != 0) GTEST_SKIP() << "cannot choose the next pid through " << last_pid_path;
  Job job;
  const std::string rank0 = job.dir() + "/rank0", go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "2", "--grace-ms", "300", "sh", "-c",
                         "if [ $RANK = 0 ]; then echo $$ > " + rank0 + "; exit 0; fi; echo $$ >> " + job.pids_path() +
                             "; for i in $(seq 600); do [ -e " + go + " ] && exit 3; sleep 0.05; done"},
                        {}));
  ASSERT_TRUE(job.wait_for_pids(1)) << job.output();
  // Rank 0 may write its pid after rank 1 wrote its own.
  std::vector<int> rank0_pid = read_pids(rank0);
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
       rank0_pid.size() != 1 && std::chrono::steady_clock::now() < until; rank0_pid = read_pids(rank0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(rank0_pid.size(), 1u) << job.output();
  const int group = rank0_pid[0];
  // Rank 0 is reaped (not a zombie) once its /proc entry is gone.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (::access(("/proc/" + std::to_string(group)).c_str(), F_OK) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // A process that leads a new group: the next pid is `group`, unless another process takes it first.
  pid_t impostor = -1;
  for (int attempt = 0; attempt < 50 && impostor != group; ++attempt) {
    if (impostor > 0) {
      ::kill(impostor, SIGKILL);
      ::waitpid(impostor, nullptr, 0);
    }
    std::ofstream(last_pid_path) << group - 1;
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    const char* argv[] = {"sleep", "60", nullptr};
    if (::posix_spawn(&impostor, "/bin/sleep", nullptr, &attr, const_cast<char**>(argv), environ) != 0) impostor = -1;
    posix_spawnattr_destroy(&attr);
  }
  if (impostor != group) {
    if (impostor > 0) ::kill(impostor, SIGKILL);
    GTEST_SKIP() << "pid " << group << " went to another process";
  }
  std::ofstream(go) << "go\n";
  int status = job.wait();
  int impostor_status = 0;
  bool impostor_running = ::waitpid(impostor, &impostor_status, WNOHANG) == 0;
  ::kill(impostor, SIGKILL);
  ::waitpid(impostor, nullptr, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "dp-run ended with " << exit_text(status);
  EXPECT_TRUE(impostor_running) << "dp-run signalled process group " << group
                                << ", no longer a rank's: " << exit_text(impostor_status);
}

}  // namespace
