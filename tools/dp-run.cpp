// dp-run: starts the local ranks of a job, like `torchrun --standalone`.
//
//   dp-run -n 4 [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
//          [--grace-ms G] prog args...
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT and, on a single node without one, a fresh DP_STORE_TOKEN.
// Without a port on a single node, dp-run picks a free one and keeps it bound
// (not listening) while it runs, so no other program takes it before rank 0
// listens on it. Their output is prefixed with "[rank R] " (a line longer
// than 64 KiB is split, so a rank's output never piles up in dp-run's
// memory). When a rank fails, the others get SIGTERM (SIGKILL after
// the grace period) and dp-run exits with the failed rank's code (128 + signal
// for a signal). SIGINT and SIGTERM to dp-run are passed on to every rank; a
// second one during the grace period sends SIGKILL. Signals go to each rank's
// whole process group, so what a rank started is stopped with it, also after
// the rank itself has exited; what left the group (setsid) is stopped once
// the ranks are done: nothing a rank started outlives dp-run. If dp-run
// itself is killed, the ranks are killed too. Usage errors exit with 2.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr,
               "dp-run: %s\n"
               "usage: dp-run -n N [--nnodes M --node-rank K] [--master-addr A] [--master-port P] [--grace-ms G] "
               "prog [args...]\n",
               message);
  std::exit(2);
}

long parse_int(const char* text, const char* flag, long min, long max) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < min || v > max) {
    std::string msg = std::string(flag) + " takes an integer in " + std::to_string(min) + ".." + std::to_string(max) +
                      ", not '" + text + "'";
    usage(msg.c_str());
  }
  return v;
}

// A free port on `addr`, held by the returned socket (bound, not listening,
// SO_REUSEADDR) for dp-run's whole life: rank 0 can still listen on it, but
// no other program gets it meanwhile. -1 when none.
int hold_free_port(const std::string& addr, long* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  if (getaddrinfo(addr.c_str(), "0", &hints, &info) != 0) return -1;
  int held = -1;
  for (addrinfo* ai = info; ai != nullptr && held < 0; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      held = fd;
    } else {
      ::close(fd);
    }
  }
  freeaddrinfo(info);
  return held;
}

std::string random_token() {
  std::random_device rd;
  char buf[33];
  for (int i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", rd());
  return buf;
}

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;      // the read end of the rank's stdout+stderr pipe
  std::string pending;  // a partial line
  bool running = false;
  int exit_code = 0;
};

// A partial line this long is printed as a line of its own.
constexpr size_t kMaxLine = 64 * 1024;

void emit(Rank& r, const char* data, size_t size) {
  r.pending.append(data, size);
  size_t start = 0;
  for (size_t nl; (nl = r.pending.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::fprintf(stdout, "[rank %d] %.*s\n", r.rank, static_cast<int>(nl - start), r.pending.data() + start);
  }
  for (; r.pending.size() - start >= kMaxLine; start += kMaxLine) {
    std::fprintf(stdout, "[rank %d] %.*s\n", r.rank, static_cast<int>(kMaxLine), r.pending.data() + start);
  }
  r.pending.erase(0, start);
  std::fflush(stdout);
}

void drain(Rank& r) {
  if (r.out_fd < 0) return;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(r.out_fd, buf, sizeof(buf));
    if (n > 0) {
      emit(r, buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (!r.pending.empty()) emit(r, "\n", 1);
    ::close(r.out_fd);
    r.out_fd = -1;
    return;
  }
}

// Each rank leads its own process group; it is signalled even after the rank
// exited, for what the rank left running in it.
void signal_all(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks) {
    if (r.pid > 0) ::kill(-r.pid, sig);
  }
}

bool any_group_alive(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks) {
    if (r.pid > 0 && ::kill(-r.pid, 0) == 0) return true;
  }
  return false;
}

// Reaps every exited child: ranks, and (as the subreaper) what they left.
void reap(std::vector<Rank>& ranks) {
  int status = 0;
  for (pid_t got; (got = ::waitpid(-1, &status, WNOHANG)) > 0;) {
    for (Rank& r : ranks) {
      if (r.pid != got || !r.running) continue;
      r.running = false;
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
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

// Stops what the ranks left outside their process groups: SIGTERM, SIGKILL
// after the grace period or a further signal, until dp-run has no children.
void stop_escaped(std::vector<Rank>& ranks, long grace_ms, sig_atomic_t signals_seen) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  for (;;) {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    std::vector<pid_t> children = own_children();
    if (children.empty()) return;
    bool kill_now = std::chrono::steady_clock::now() >= deadline || g_signal_count > signals_seen;
    for (pid_t pid : children) ::kill(pid, kill_now ? SIGKILL : SIGTERM);
    for (Rank& r : ranks) drain(r);
    ::usleep(10000);
  }
}

}  // namespace

int main(int argc, char** argv) {
  long nproc = -1, nnodes = 1, node_rank = 0, grace_ms = 5000;
  std::string master_addr;
  long master_port = -1;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) usage((std::string(flag) + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-n" || a == "--nproc-per-node")
      nproc = parse_int(value("-n"), "-n", 1, 4096);
    else if (a == "--nnodes")
      nnodes = parse_int(value("--nnodes"), "--nnodes", 1, 100000);
    else if (a == "--node-rank")
      node_rank = parse_int(value("--node-rank"), "--node-rank", 0, 99999);
    else if (a == "--master-addr")
      master_addr = value("--master-addr");
    else if (a == "--master-port")
      master_port = parse_int(value("--master-port"), "--master-port", 1, 65535);
    else if (a == "--grace-ms")
      grace_ms = parse_int(value("--grace-ms"), "--grace-ms", 0, 3600000);
    else if (a == "--") {
      ++i;
      break;
    } else if (!a.empty() && a[0] == '-')
      usage(("unknown option " + a).c_str());
    else
      break;
  }
  if (nproc < 0) usage("-n is required");
  if (i >= argc) usage("no program given");
  // One pipe per rank stays open: past the open-file limit, ranks would start and then be killed.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const rlim_t needed = static_cast<rlim_t>(nproc) + 16;
    if (files.rlim_cur < needed && files.rlim_max >= needed) {
      files.rlim_cur = needed;
      ::setrlimit(RLIMIT_NOFILE, &files);
    }
    if (files.rlim_cur < needed) {
      usage(("-n " + std::to_string(nproc) + " needs " + std::to_string(needed) + " open files; the limit is " +
             std::to_string(files.rlim_cur))
                .c_str());
    }
  }
  if (node_rank >= nnodes) usage("--node-rank must be below --nnodes");
  if (nnodes > 1 && (master_addr.empty() || master_port < 0)) {
    usage("with --nnodes > 1, --master-addr and --master-port are required (node 0 serves the store there)");
  }
  if (master_addr.empty()) master_addr = "127.0.0.1";
  if (master_port < 0 && hold_free_port(master_addr, &master_port) < 0) {
    usage(("cannot find a free port on " + master_addr).c_str());
  }
  if (nnodes == 1 && std::getenv("DP_STORE_TOKEN") == nullptr) setenv("DP_STORE_TOKEN", random_token().c_str(), 1);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Orphans of the ranks come to dp-run, so they can be reaped and counted as gone.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);

  const long world = nnodes * nproc;
  const pid_t launcher = ::getpid();
  std::vector<Rank> ranks(static_cast<size_t>(nproc));
  for (long local = 0; local < nproc; ++local) {
    Rank& r = ranks[static_cast<size_t>(local)];
    r.rank = static_cast<int>(node_rank * nproc + local);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      std::perror("dp-run: pipe");
      signal_all(ranks, SIGKILL);
      return 1;
    }
    // A signal that comes between fork and exec must not reach dp-run's handler in the child.
    sigset_t stop_signals, previous;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &stop_signals, &previous);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &previous, nullptr);
      ::setpgid(0, 0);
      // Ranks do not outlive a launcher that was killed.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(128 + SIGKILL);
      ::signal(SIGPIPE, SIG_DFL);  // an ignored signal would stay ignored across exec
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      setenv("RANK", std::to_string(r.rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(node_rank).c_str(), 1);
      setenv("MASTER_ADDR", master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
      ::execvp(argv[i], argv + i);
      std::fprintf(stderr, "dp-run: cannot run '%s': %s\n", argv[i], std::strerror(errno));
      ::_exit(127);
    }
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::close(fds[1]);
    if (pid < 0) {
      std::perror("dp-run: fork");
      ::close(fds[0]);
      signal_all(ranks, SIGKILL);
      return 1;
    }
    ::setpgid(pid, pid);  // also here, so that a kill before the child's own call reaches it
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    r.pid = pid;
    r.out_fd = fds[0];
    r.running = true;
  }

  int result = 0;
  bool stopping = false;
  sig_atomic_t signals_at_stop = 0;  // a signal after stopping began escalates to SIGKILL
  auto kill_at = std::chrono::steady_clock::time_point::max();
  for (;;) {
    std::vector<pollfd> fds;
    for (Rank& r : ranks) {
      if (r.out_fd >= 0) fds.push_back({r.out_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), fds.empty() ? 10 : 20);
    for (Rank& r : ranks) drain(r);
    reap(ranks);
    bool any_running = false;
    for (Rank& r : ranks) {
      if (r.running) {
        any_running = true;
        continue;
      }
      if (r.exit_code != 0 && !stopping) {
        std::fprintf(stderr, "dp-run: rank %d exited with code %d; stopping the other ranks\n", r.rank, r.exit_code);
        result = r.exit_code;
        stopping = true;
        signals_at_stop = g_signal_count;
        signal_all(ranks, SIGTERM);
        kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
      }
    }
    if (g_signal != 0 && !stopping) {
      stopping = true;
      signals_at_stop = g_signal_count;
      result = 128 + g_signal;
      signal_all(ranks, g_signal);
      kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    }
    if (stopping && g_signal_count > signals_at_stop) kill_at = std::chrono::steady_clock::now();
    if (stopping && std::chrono::steady_clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
      kill_at = std::chrono::steady_clock::time_point::max();
    }
    if (!any_running) break;
  }
  // What the ranks left running in their groups: SIGTERM, SIGKILL after the grace period.
  if (any_group_alive(ranks)) {
    signal_all(ranks, SIGTERM);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    while (any_group_alive(ranks)) {
      if (std::chrono::steady_clock::now() >= deadline || g_signal_count > signals_at_stop) {
        signal_all(ranks, SIGKILL);
        deadline = std::chrono::steady_clock::time_point::max();
      }
      for (Rank& r : ranks) drain(r);
      ::usleep(10000);
      reap(ranks);
    }
  }
  stop_escaped(ranks, grace_ms, signals_at_stop);
  // The ranks are gone; read what they left, but do not wait on a leftover
  // child of theirs that still holds the pipe.
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (Rank& r : ranks) {
    while (r.out_fd >= 0 && std::chrono::steady_clock::now() < give_up) {
      pollfd p{r.out_fd, POLLIN, 0};
      ::poll(&p, 1, 50);
      drain(r);
    }
    if (r.out_fd >= 0) {
      if (!r.pending.empty()) emit(r, "\n", 1);
      ::close(r.out_fd);
    }
  }
  return result;
}
