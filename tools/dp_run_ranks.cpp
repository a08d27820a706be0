#include "dp_run_ranks.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dprun {

namespace {

// A group's id is free for reuse once its last member is reaped (while the
// rank itself is unreaped, its pid holds it): an empty group is forgotten, so
// that a new group with the same id is never signalled.
void forget_empty_groups(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    if (r.pid > 0 && !r.running && !r.group_gone && ::kill(-r.pid, 0) != 0 && errno == ESRCH) r.group_gone = true;
  }
}

// dp-run's own living children: as the subreaper, what escaped a rank's
// process group comes to dp-run once its parent is gone.
std::vector<pid_t> own_children() {
  std::vector<pid_t> children;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return children;
  const pid_t self = ::getpid();
  while (dirent* entry = ::readdir(proc)) {
    char* end = nullptr;
    long pid = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    FILE* stat = std::fopen(("/proc/" + std::string(entry->d_name) + "/stat").c_str(), "r");
    if (stat == nullptr) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ')'.
    char buf[512];
    size_t n = std::fread(buf, 1, sizeof(buf) - 1, stat);
    std::fclose(stat);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');
    char state = 0;
    int ppid = 0;
    if (close != nullptr && std::sscanf(close + 1, " %c %d", &state, &ppid) == 2 && ppid == self && state != 'Z') {
      children.push_back(static_cast<pid_t>(pid));
    }
  }
  ::closedir(proc);
  return children;
}

// The rank's side of the fork: it becomes the program, in a process group of
// its own, its stdout and stderr the write ends of its pipes.
[[noreturn]] void exec_rank(const Options& o, const Signals& signals, pid_t launcher_pid, int rank, long local,
                            int out_fd, int err_fd) {
  // The rank starts with the dispositions and mask dp-run was started
  // with; a signal sent to its group before this stays pending until then.
  for (int sig : signals.caught) ::signal(sig, SIG_DFL);
  ::sigaction(SIGCHLD, &signals.started_sigchld, nullptr);
  ::sigprocmask(SIG_SETMASK, &signals.started_mask, nullptr);
  ::setpgid(0, 0);
  // Ranks do not outlive a launcher that was killed.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher_pid) ::_exit(128 + SIGKILL);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(o.nnodes * o.nproc).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
  setenv("DP_STORE_ADDR", o.master_addr.c_str(), 1);
  setenv("DP_STORE_PORT", std::to_string(o.store_port).c_str(), 1);
  ::execvp(o.program[0], o.program);
  std::fprintf(stderr, "dp-run: cannot run '%s': %s\n", o.program[0], std::strerror(errno));
  ::_exit(127);
}

}  // namespace

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks) {
    if (r.pid > 0 && !r.group_gone) ::kill(-r.pid, sig);
  }
}

bool any_group_alive(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks) {
    if (r.pid > 0 && !r.group_gone && ::kill(-r.pid, 0) == 0) return true;
  }
  return false;
}

void reap(std::vector<Rank>& ranks) {
  int status = 0;
  for (pid_t got; (got = ::waitpid(-1, &status, WNOHANG)) > 0;) {
    for (Rank& r : ranks) {
      if (r.pid != got || !r.running) continue;
      r.running = false;
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
  }
  forget_empty_groups(ranks);
}

void stop_escaped(long grace_ms, const std::function<bool()>& hurry, const std::function<void()>& meanwhile) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  for (;;) {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    std::vector<pid_t> children = own_children();
    if (children.empty()) return;
    bool kill_now = std::chrono::steady_clock::now() >= deadline || hurry();
    for (pid_t pid : children) ::kill(pid, kill_now ? SIGKILL : SIGTERM);
    meanwhile();
    ::usleep(10000);
  }
}

bool spawn_ranks(const Options& o, const Signals& signals, std::vector<Rank>& ranks, std::vector<RankOutput>& outputs) {
  const pid_t launcher_pid = ::getpid();
  for (long local = 0; local < o.nproc; ++local) {
    Rank& r = ranks[static_cast<size_t>(local)];
    r.rank = static_cast<int>(o.node_rank * o.nproc + local);
    RankOutput& output = outputs[static_cast<size_t>(local)];
    output.rank = r.rank;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      std::perror("dp-run: pipe");
      signal_all(ranks, SIGKILL);
      return false;
    }
    pid_t pid = ::fork();
    if (pid == 0) exec_rank(o, signals, launcher_pid, r.rank, local, out[1], err[1]);
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      std::perror("dp-run: fork");
      ::close(out[0]);
      ::close(err[0]);
      signal_all(ranks, SIGKILL);
      return false;
    }
    ::setpgid(pid, pid);  // also here, so that a kill before the child's own call reaches it
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
    r.pid = pid;
    output.streams[kStdout].fd = out[0];
    output.streams[kStderr].fd = err[0];
    r.running = true;
  }
  return true;
}

}  // namespace dprun
