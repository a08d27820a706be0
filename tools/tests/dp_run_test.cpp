// dp-run against hostile ranks: endless output lines, processes that leave
// the rank's process group and ignore SIGTERM, and every way dp-run itself
// is stopped or killed. Every run is bounded.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

// The environment variable whose value (the job's folder) marks every
// process of a Job.
constexpr const char* kJobMarker = "DP_TEST_JOB_DIR";

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

// The pids written to `path`, one a line.
std::vector<int> read_pids(const std::string& path) {
  std::vector<int> pids;
  std::ifstream in(path);
  for (int pid = 0; in >> pid;) pids.push_back(pid);
  return pids;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The children of `parent` named `comm`.
std::vector<int> children_named(pid_t parent, const std::string& comm) {
  std::vector<int> children;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return children;
  while (dirent* entry = ::readdir(proc)) {
    int pid = std::atoi(entry->d_name);
    if (pid <= 0) continue;
    std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
    size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (stat.substr(open + 1, close - open - 1) == comm &&
        std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 && ppid == parent) {
      children.push_back(pid);
    }
  }
  ::closedir(proc);
  return children;
}

// Each rank starts a child in its process group and a grandchild that leaves
// the rank's session, orphaned at once, and ignores SIGTERM; all three write
// their pids to $1, then the rank waits.
constexpr const char* kRankScript = R"(pids=$1
sleep 300 &
echo $! >> "$pids"
sh -c 'setsid sh -c "trap \"\" TERM; echo \$\$ >> \"\$0\"; exec sleep 300" "$0" &' "$pids"
echo $$ >> "$pids"
wait
)";
constexpr size_t kRanks = 2;
constexpr size_t kPidsPerRank = 3;

// dp-run running a job in a directory of its own; whatever the test
// does, the job's processes are killed and the directory removed at the end.
class Job {
 public:
  struct Options {
    std::vector<int> ignored = {SIGINT, SIGQUIT};  // as a script's `dp-run &` starts it
    bool own_process_group = false;
    int stdout_fd = -1;            // else dp-run's output goes to the file output()
    bool separate_stderr = false;  // dp-run's stderr to the file error_output(), else with its stdout
  };

  Job() {
    char dir[] = "/tmp/dp_run_job_XXXXXX";
    if (::mkdtemp(dir) != nullptr) dir_ = dir;
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job() {
    if (pid_ > 0 && !exited_) kill_dp_run();
    // Only processes of this job: a pid that exited may already name
    // another test's process (pids are reused, and a test here rewinds them).
    for (int pid : read_pids(pids_path())) {
      if (of_job(pid)) ::kill(pid, SIGKILL);
    }
    for (const char* name : {"/pids", "/out", "/err", "/rank.sh", "/go", "/rank0", "/started", "/done"})
      ::unlink((dir_ + name).c_str());
    ::rmdir(dir_.c_str());
  }

  const std::string& dir() const { return dir_; }
  // Whether `pid` is a process this job started (its environment carries
  // the job's marker, which dp-run and the ranks pass on).
  bool of_job(int pid) const {
    std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    const std::string environ((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string marker = std::string(kJobMarker) + "=" + dir_;
    return environ.find(marker + '\0') != std::string::npos;
  }
  std::string pids_path() const { return dir_ + "/pids"; }
  std::string output() const { return read_text(dir_ + "/out"); }
  std::string error_output() const { return read_text(dir_ + "/err"); }
  pid_t pid() const { return pid_; }

  // Starts `dp-run args` with the signals in options.ignored ignored, every
  // other one at its default and none blocked, and no core files (the ranks
  // may get SIGQUIT).
  bool start(const std::vector<std::string>& args, const Options& options) {
    if (dir_.empty()) return false;
    std::vector<std::string> words = {DP_RUN};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    argv.reserve(words.size() + 1);
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const std::string out_path = dir_ + "/out", err_path = dir_ + "/err";
    pid_ = ::fork();
    if (pid_ != 0) return pid_ > 0;
    for (int sig = 1; sig < NSIG; ++sig) ::signal(sig, SIG_DFL);
    for (int sig : options.ignored) ::signal(sig, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    rlimit core{};
    ::getrlimit(RLIMIT_CORE, &core);
    core.rlim_cur = 0;
    ::setrlimit(RLIMIT_CORE, &core);
    if (options.own_process_group) ::setpgid(0, 0);
    ::dup2(::open("/dev/null", O_RDONLY), 0);
    ::dup2(options.stdout_fd >= 0 ? options.stdout_fd : ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600),
           1);
    if (options.separate_stderr) {
      ::dup2(::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), 2);
    } else {
      ::dup2(1, 2);
    }
    ::setenv(kJobMarker, dir_.c_str(), 1);
    ::execv(DP_RUN, argv.data());
    ::_exit(127);
  }

  // dp-run with kRanks ranks running kRankScript.
  bool start_ranks_with_children(const Options& options) {
    std::ofstream(dir_ + "/rank.sh") << kRankScript;
    return start({"-n", std::to_string(kRanks), "--grace-ms", "300", "sh", dir_ + "/rank.sh", pids_path()}, options);
  }

  // Waits up to 30 s until `count` pids were written; false if dp-run exited first.
  bool wait_for_pids(size_t count) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      if (read_pids(pids_path()).size() >= count) return true;
      if (!exited_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
      if (exited_) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Waits up to 30 s until output() holds `text`; false if dp-run exited first.
  bool wait_for_output(const std::string& text) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      if (output().find(text) != std::string::npos) return true;
      if (!exited_ && ::waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
      if (exited_) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // dp-run's wait status; it is killed after `limit`.
  int wait(std::chrono::seconds limit = std::chrono::seconds(60)) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (!exited_) {
      pid_t got = ::waitpid(pid_, &status_, WNOHANG);
      if (got == pid_ || got < 0) {
        exited_ = true;
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        kill_dp_run();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }

 private:
  // Both processes: a launcher left alone could hang on.
  void kill_dp_run() {
    for (int launcher : children_named(pid_, "dp-run-launcher")) ::kill(launcher, SIGKILL);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
    exited_ = true;
  }

  std::string dir_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

// The pids among `pids` still running 10 s from now (a process outliving dp-run sleeps for 300 s).
std::vector<int> still_running(const std::vector<int>& pids) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::vector<int> left;
  do {
    left.clear();
    for (int pid : pids) {
      if (running(pid)) left.push_back(pid);
    }
    if (left.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < deadline);
  return left;
}

std::string describe(const std::vector<int>& pids) {
  std::string text;
  for (int pid : pids) {
    text += " " + std::to_string(pid) + ":";
    std::string cmdline = read_text("/proc/" + std::to_string(pid) + "/cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    text += cmdline;
  }
  return text;
}

std::string exit_text(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
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

// The lines of `text` without their newlines; an unfinished last one too.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

TEST(DpRunOutput, ForwardsALineWithANulByteWhole) {
  using namespace std::string_literals;
  Job job;
  ASSERT_TRUE(job.start({"-n", "1", "sh", "-c", "printf 'before\\000after\\n'"}, {}));
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  EXPECT_EQ(job.output(), "[rank 0] before\0after\n"s);
}

// What dp_run_test_rank's `interleave` writes to `stream` ("out" or "err"),
// checked line by line: each whole, prefixed with its rank, in its order.
void expect_interleaved_lines(const std::string& text, const std::string& stream, int ranks, long count) {
  std::vector<long> next(static_cast<size_t>(ranks), 0);
  std::vector<std::string> wrong;
  for (const std::string& line : lines_of(text)) {
    int rank = -1;
    long index = -1;
    bool expected = std::sscanf(line.c_str(), "[rank %d] %*s %*d %ld", &rank, &index) == 2 && rank >= 0 &&
                    rank < ranks && index == next[static_cast<size_t>(rank)];
    if (expected) {
      const long dots = stream == "out" ? index % 97 : 96 - index % 97;
      expected = line == "[rank " + std::to_string(rank) + "] " + stream + " " + std::to_string(rank) + " " +
                             std::to_string(index) + " " + std::string(static_cast<size_t>(dots), '.') + "|";
    }
    if (expected) {
      ++next[static_cast<size_t>(rank)];
    } else if (wrong.size() < 5) {
      wrong.push_back(line.substr(0, 300));
    }
  }
  std::string shown;
  for (const std::string& line : wrong) shown += "  " + line + "\n";
  EXPECT_TRUE(wrong.empty()) << "lines on dp-run's std" << stream << " that are not whole, in order, or its own:\n"
                             << shown;
  for (int rank = 0; rank < ranks; ++rank) {
    EXPECT_EQ(next[static_cast<size_t>(rank)], count) << "rank " << rank << "'s std" << stream << " lines";
  }
}

// Each rank writes its stdout through stdio's buffer and its stderr
// unbuffered, alternating, as fast as it can.
TEST(DpRunOutput, KeepsEveryStdoutAndStderrLineWholeOnItsOwnStream) {
  constexpr long kLines = 20000;
  Job job;
  Job::Options options;
  options.separate_stderr = true;
  ASSERT_TRUE(job.start({"-n", "2", DP_RUN_TEST_RANK, "interleave", std::to_string(kLines)}, options));
  int status = job.wait();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  expect_interleaved_lines(job.output(), "out", 2, kLines);
  expect_interleaved_lines(job.error_output(), "err", 2, kLines);
}

// A program linked against the library writes each stdout line as it ends,
// not once stdio's buffer fills.
TEST(DpRunOutput, ShowsARanksStdoutLineBeforeItsProgramFlushes) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "1", DP_RUN_TEST_RANK, "line-then-wait", go}, {}));
  const bool shown = job.wait_for_output("[rank 0] step 1 of 2 on rank 0\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(shown) << "the line came only once the rank was released";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  EXPECT_EQ(job.output(), "[rank 0] step 1 of 2 on rank 0\n[rank 0] step 2 of 2 on rank 0\n");
}

// Rank 0 shows progress without a newline and waits; once released, it ends
// that line and rank 1 writes a line and an unfinished one, then both exit.
TEST(DpRunOutput, ShowsAnUnfinishedLineWhileTheRankWaitsAndNeverMergesItWithAnotherRanks) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(
      job.start({"-n", "2", "sh", "-c",
                 "[ $RANK = 0 ] && printf 'progress 50%%'; for i in $(seq 3000); do [ -e " + go +
                     " ] && break; sleep 0.02; done; if [ $RANK = 0 ]; then printf ' done'; else printf 'rank 1 "
                     "line\\nrank 1 tail'; fi"},
                {}));
  const bool shown = job.wait_for_output("[rank 0] progress 50%");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(shown) << "the unfinished line came only once the rank was released";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  std::vector<std::string> rank1_lines;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_TRUE(starts_with(line, "[rank 1] ")) << "a line without a rank's prefix: " << line;
      rank1_lines.push_back(line);
    }
  }
  EXPECT_EQ(rank0_text, "progress 50% done") << output;
  EXPECT_EQ(rank1_lines, (std::vector<std::string>{"[rank 1] rank 1 line", "[rank 1] rank 1 tail"})) << output;
  EXPECT_EQ(output.back(), '\n') << output;
}

// dp-run's stdout and stderr are one file here: rank 0 shows progress on
// stdout and waits; rank 1 then writes a line to stderr.
TEST(DpRunOutput, EndsAnUnfinishedStdoutLineBeforeAStderrLineOnTheSameFile) {
  Job job;
  const std::string go = job.dir() + "/go", started = job.dir() + "/started";
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c",
                         "if [ $RANK = 0 ]; then printf 'progress 50%%'; f=" + go + "; else f=" + started +
                             "; fi; for i in $(seq 3000); do [ -e $f ] && break; sleep 0.02; done; if [ $RANK = 0 "
                             "]; then echo ' done'; else echo 'rank 1 warning' >&2; fi"},
                        {}));
  const bool progress_shown = job.wait_for_output("[rank 0] progress 50%");
  std::ofstream(started) << "go\n";
  const bool warning_shown = job.wait_for_output("rank 1 warning\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(progress_shown && warning_shown) << job.output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_EQ(line, "[rank 1] rank 1 warning") << output;
    }
  }
  EXPECT_EQ(rank0_text, "progress 50% done") << output;
}

// Rank 0 grows a line of dots, never pausing long, until released; rank 1
// writes a line meanwhile, which must not wait for rank 0's to end.
TEST(DpRunOutput, ShowsAGrowingUnfinishedLineWithoutHoldingBackAnotherRanksLines) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c",
                         "if [ $RANK = 0 ]; then for i in $(seq 3000); do [ -e " + go +
                             " ] && break; printf .; sleep 0.02; done; echo end; else echo 'rank 1 line'; for i in "
                             "$(seq 3000); do [ -e " +
                             go + " ] && break; sleep 0.02; done; fi"},
                        {}));
  const bool dots_shown = job.wait_for_output("[rank 0] .");
  const bool line_shown = job.wait_for_output("[rank 1] rank 1 line\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(dots_shown) << "rank 0's unfinished line came only once the rank was released";
  EXPECT_TRUE(line_shown) << "rank 1's line waited for rank 0's to end";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_EQ(line, "[rank 1] rank 1 line") << output;
    }
  }
  ASSERT_GE(rank0_text.size(), 4u) << output;
  EXPECT_EQ(rank0_text.substr(rank0_text.size() - 3), "end") << output;
  EXPECT_EQ(rank0_text.find_first_not_of('.'), rank0_text.size() - 3) << output;
}

// Rank 0 writes a 1 MiB line, far more than dp-run buffers, while rank 1
// writes short lines all along.
TEST(DpRunOutput, KeepsALineLongerThanItsBuffersWholeWhileAnotherRankWrites) {
  constexpr size_t kLong = size_t{1} << 20;
  Job job;
  const std::string started = job.dir() + "/started", done = job.dir() + "/done";
  ASSERT_TRUE(job.start(
      {"-n", "2", "sh", "-c",
       "if [ $RANK = 0 ]; then for i in $(seq 3000); do [ -e " + started + " ] && break; sleep 0.02; done; head -c " +
           std::to_string(kLong) + " /dev/zero | tr '\\000' x; echo; : > " + done + "; else : > " + started +
           "; i=0; until [ -e " + done + " ]; do echo \"rank 1 line $i\"; i=$((i + 1)); done; fi"},
      {}));
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  std::vector<std::string> rank0_lines;
  long next = 0;
  std::vector<std::string> wrong;
  for (const std::string& line : lines_of(job.output())) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_lines.push_back(line);
    } else if (line == "[rank 1] rank 1 line " + std::to_string(next)) {
      ++next;
    } else if (wrong.size() < 5) {
      wrong.push_back(line.substr(0, 200));
    }
  }
  ASSERT_EQ(rank0_lines.size(), 1u) << "rank 0's line came in pieces";
  EXPECT_EQ(rank0_lines[0], "[rank 0] " + std::string(kLong, 'x'));
  EXPECT_TRUE(wrong.empty()) << "first bad line: " << (wrong.empty() ? "" : wrong[0]);
  EXPECT_GT(next, 0) << "rank 1 wrote nothing";
}

}  // namespace
