// What the dp-run tests share: running dp-run bounded, reading the pids and
// files ranks leave, and a Job that starts dp-run and stops every process
// it made however the test ends.
#pragma once

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

namespace dp_run_test {

// The environment variable whose value (the job's folder) marks every
// process of a Job.
constexpr const char* kJobMarker = "DP_TEST_JOB_DIR";

struct Finished {
  int exit_code = -1;
  long max_rss_kib = 0;
  double seconds = 0;
};

// dp-run with `args` (through sh), its output to /dev/null; killed after 60 s.
inline Finished run_dp_run(const std::string& args) {
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
inline bool running(int pid) {
  FILE* stat = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (stat == nullptr) return false;
  char state = 0;
  int scanned = std::fscanf(stat, "%*d %*s %c", &state);
  std::fclose(stat);
  return scanned == 1 && state != 'Z' && state != 'X';
}

inline int read_pid(const std::string& path) {
  int pid = 0;
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%d", &pid) != 1) pid = 0;
  std::fclose(f);
  return pid;
}

// The pids written to `path`, one a line.
inline std::vector<int> read_pids(const std::string& path) {
  std::vector<int> pids;
  std::ifstream in(path);
  for (int pid = 0; in >> pid;) pids.push_back(pid);
  return pids;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The children of `parent` named `comm`.
inline std::vector<int> children_named(pid_t parent, const std::string& comm) {
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
inline std::vector<int> still_running(const std::vector<int>& pids) {
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

inline std::string describe(const std::vector<int>& pids) {
  std::string text;
  for (int pid : pids) {
    text += " " + std::to_string(pid) + ":";
    std::string cmdline = read_text("/proc/" + std::to_string(pid) + "/cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    text += cmdline;
  }
  return text;
}

inline std::string exit_text(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

}  // namespace dp_run_test
