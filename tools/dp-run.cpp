// dp-run: starts the local ranks of a job, like `torchrun --standalone`.
//
//   dp-run -n 4 [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
//          [--grace-ms G] prog args...
//   dp-run --help
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT and, on a single node without one, a fresh DP_STORE_TOKEN.
// Without a port on a single node, dp-run picks a free one and keeps it bound
// (not listening) while it runs, so no other program takes it before rank 0
// listens on it. When a rank fails, the others get SIGTERM (SIGKILL after
// the grace period) and dp-run exits with the failed rank's code (128 + signal
// for a signal). Usage errors exit with 2.
//
// Output (kOutputHelp, which --help prints): each rank's stdout and stderr
// come through pipes of their own, as whole lines, NUL bytes and all.
// dp-run holds at most 64 KiB of each (kBufferSize): a rank that writes
// faster than dp-run's output takes waits, and a longer line goes out in
// pieces kept together.
//
// Stopping: nothing a rank started outlives dp-run. Signals go to each rank's
// whole process group, so what a rank started is stopped with it, also after
// the rank itself has exited; what left the group (setsid) is stopped once
// the ranks are done. Every signal that would end dp-run and can be caught
// stops the job: SIGHUP (a closed terminal), SIGINT, SIGQUIT, SIGTERM,
// SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR,
// SIGSTKFLT, SIGXCPU, SIGXFSZ and SIGRTMIN..SIGRTMAX. Every rank's group gets
// the same signal, as torchrun does (SIGPIPE becomes SIGTERM: the ranks'
// own output still works), then SIGKILL after the grace period or at a second
// signal, and dp-run exits with 128 + the signal. Output that can no longer be
// written (EPIPE: its reader, a closed ssh session or `| head`, is gone)
// stops the job as SIGPIPE does. A signal dp-run was started with ignored
// stays ignored, for the ranks too, so `nohup dp-run` outlives its terminal;
// but SIGINT, SIGQUIT and SIGTERM always stop the job (a shell starts
// `dp-run &` with SIGINT and SIGQUIT ignored). The fault signals (SIGSEGV,
// SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP, SIGSYS) keep their default action:
// they mean dp-run itself failed, and are handled as SIGKILL is.
//
// Killed: dp-run is two processes, the one started, which passes signals on,
// and below it, in a process group of its own, the launcher (named
// dp-run-launcher): the ranks' parent and the subreaper of everything they
// start. It takes signals from the first one only (a signal sent to both, as
// by `pkill dp-run`, counts once). When either one dies (SIGKILL, also of
// dp-run's process group), the other kills the rest of the job at once. Only
// both killed together leaves what the ranks started running (the ranks
// themselves die with the launcher).
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

// The signals that stop the job (see the header): every one whose default
// action ends the process and that can be caught, except the fault signals.
std::vector<int> stop_signals() {
  std::vector<int> signals = {SIGHUP,    SIGINT,  SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2,   SIGPIPE, SIGALRM,
                              SIGVTALRM, SIGPROF, SIGIO,   SIGPWR,  SIGXCPU, SIGSTKFLT, SIGXFSZ};
  for (int sig = SIGRTMIN; sig <= SIGRTMAX; ++sig) signals.push_back(sig);
  return signals;
}

// The front's end of the control socket, and how many signals the front got.
int g_control_fd = -1;
volatile sig_atomic_t g_front_signals = 0;

// The front passes each signal on to the launcher as one byte (MSG_NOSIGNAL:
// a launcher that is gone must not raise SIGPIPE in the handler).
void pass_on(int sig) {
  const int saved_errno = errno;
  g_front_signals = g_front_signals + 1;
  const auto byte = static_cast<unsigned char>(sig);
  ::send(g_control_fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  errno = saved_errno;
}

// What the launcher was asked through the control socket.
struct Requests {
  int fd = -1;           // the launcher's end; -1 once the front is gone
  int first_signal = 0;  // the signal that stops the job
  int signals = 0;       // how many came
  bool front_gone = false;
};

void read_requests(Requests& requests) {
  unsigned char buf[64];
  while (requests.fd >= 0) {
    ssize_t n = ::recv(requests.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      requests.front_gone = true;
      ::close(requests.fd);
      requests.fd = -1;
      return;
    }
    if (requests.first_signal == 0) requests.first_signal = buf[0];
    requests.signals += static_cast<int>(n);
  }
}

// Set once writing to stdout or stderr failed with EPIPE: its reader is gone.
bool g_output_lost = false;

constexpr const char* kUsage =
    "usage: dp-run -n N [--nnodes M --node-rank K] [--master-addr A] [--master-port P] [--grace-ms G] prog "
    "[args...]\n";

constexpr const char* kOutputHelp =
    "Each rank's stdout lines go to dp-run's stdout and its stderr lines to dp-run's stderr, whole and\n"
    "prefixed with \"[rank R] \". A line without its newline yet shows after 0.1 s (progress); once\n"
    "the rank pauses for 0.1 s, or after 1 s, another line may end it (another rank's, or one for\n"
    "dp-run's other stream when both are one file, as a terminal is), and it ends when the rank\n"
    "exits. A line longer than 64 KiB goes out in pieces that nothing comes between while the rank\n"
    "writes it; paused for 1 s, another line may end it.\n"
    "\n"
    "Ranks get DP_LINE_BUFFERED_STDOUT=1, on which libdparallel makes their stdout line-buffered.\n"
    "A program not linked against libdparallel must do that itself (C: setvbuf(stdout, NULL, _IOLBF, 0)\n"
    "first thing in main; Python: python -u) or flush its stdout, or its lines come 4 KiB at a time.\n"
    "Text without a newline shows only once the program has written it (flushed it, in C).\n";

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr, "dp-run: %s\n%s", message, kUsage);
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
  for (size_t i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", rd());
  return buf;
}

using Clock = std::chrono::steady_clock;

// What dp-run holds of one rank's stream: a rank's endless line never piles
// up in dp-run's memory, and a rank that outwrites dp-run's output waits.
constexpr size_t kBufferSize = size_t{64} * 1024;
// An unfinished line that waited this long is shown as it is (progress);
// once its rank pauses this long, another rank's output may end it.
constexpr auto kShowUnfinishedAfter = std::chrono::milliseconds(100);
// A shown line shorter than the buffer may be ended for another rank's
// output after this long, so that a growing progress line does not hold the
// other ranks back. A longer one goes out in pieces that nothing else comes
// between while its rank writes it: it may be ended once the rank paused
// this long.
constexpr auto kLongLinePause = std::chrono::seconds(1);

// One of a rank's output streams, read through a pipe of its own.
struct RankStream {
  int fd = -1;           // the read end; -1 once at its end
  std::string buffered;  // read, not yet written: at most kBufferSize bytes
  Clock::time_point last_read{};
  Clock::time_point unfinished_since{};  // when (at the latest) the unfinished line in `buffered` began
};

enum Stream { kStdout = 0, kStderr = 1 };

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  RankStream streams[2];  // its stdout and stderr, by Stream
  bool running = false;
  int exit_code = 0;
  bool group_gone = false;  // seen empty once the rank was reaped
};

// dp-run's stdout or stderr, where the ranks' stdout or stderr lines go.
struct Sink {
  int fd;
  int open_rank = -1;  // the index of the rank whose line is started here but not ended; -1 if none
  size_t open_length = 0;
  Clock::time_point open_since{};
  std::string out;  // what goes out next; kept, so that its memory is reused
};
Sink g_sinks[2] = {{STDOUT_FILENO}, {STDERR_FILENO}};
// Whether dp-run's stdout and stderr are one file (a terminal, `2>&1`): then
// a line started on one is ended before anything goes to the other.
bool g_sinks_shared = false;

bool same_file(int a, int b) {
  struct stat sa {
  }, sb{};
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// Writes all of `data` as it is (bytes, NULs too).
void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
    } else if (n < 0 && errno == EAGAIN) {  // a non-blocking file description shared with another program
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else {
      if (n < 0 && errno == EPIPE) g_output_lost = true;
      return;
    }
  }
}

// Reads what the stream has, as far as its buffer has room.
void read_stream(RankStream& stream, Clock::time_point now) {
  char buf[kBufferSize];
  while (stream.fd >= 0 && stream.buffered.size() < kBufferSize) {
    ssize_t n = ::read(stream.fd, buf, kBufferSize - stream.buffered.size());
    if (n > 0) {
      if (stream.buffered.empty()) stream.unfinished_since = now;
      stream.buffered.append(buf, static_cast<size_t>(n));
      stream.last_read = now;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    ::close(stream.fd);
    stream.fd = -1;
  }
}

// Drops the first `count` bytes written; what is left began with the last read, at the latest.
void consume(RankStream& stream, size_t count) {
  stream.buffered.erase(0, count);
  stream.unfinished_since = stream.last_read;
}

bool unfinished_waited(const RankStream& stream, Clock::time_point now) {
  return now - stream.unfinished_since >= kShowUnfinishedAfter;
}

// Whether the stream has output that would be written to a free sink now.
bool has_output_ready(const RankStream& stream, Clock::time_point now) {
  return !stream.buffered.empty() &&
         (stream.buffered.size() >= kBufferSize || stream.fd < 0 || unfinished_waited(stream, now) ||
          stream.buffered.find('\n') != std::string::npos);
}

// Whether a rank other than `except` has output for the sink `which`.
bool others_waiting(const std::vector<Rank>& ranks, Stream which, Clock::time_point now, int except) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (static_cast<int>(i) != except && has_output_ready(ranks[i].streams[which], now)) return true;
  }
  return false;
}

// Whether the sink's started line may be ended for other output (see
// kLongLinePause); always once its stream is at its end.
bool open_line_may_end(const Sink& sink, const RankStream& owner, Clock::time_point now) {
  if (owner.fd < 0) return true;
  const auto paused = now - owner.last_read;
  return sink.open_length >= kBufferSize ? paused >= kLongLinePause
                                         : paused >= kShowUnfinishedAfter || now - sink.open_since >= kLongLinePause;
}

// Ends the line started on `sink`, if any.
void end_open_line(Sink& sink) {
  if (sink.open_rank < 0) return;
  sink.open_rank = -1;
  write_all(sink.fd, "\n");
}

// Writes what the ranks' `which` streams hold to its sink: whole lines, each
// with its rank's prefix; an unfinished line once it waited, its stream is
// at its end, or it fills the buffer. While a rank's line is started on the
// sink, only that rank's bytes go there, until it ends the line or another
// rank has output waiting and the line may be ended (kShowUnfinishedAfter,
// kLongLinePause); then dp-run ends it.
void forward(std::vector<Rank>& ranks, Stream which, Clock::time_point now) {
  Sink& sink = g_sinks[which];
  if (g_output_lost) {
    for (Rank& r : ranks) r.streams[which].buffered.clear();
    sink.open_rank = -1;
    return;
  }
  // On a shared file, the other sink's started line ends first, or this sink waits.
  Sink& other = g_sinks[1 - which];
  if (g_sinks_shared && other.open_rank >= 0 && others_waiting(ranks, which, now, -1)) {
    const RankStream& owner = ranks[static_cast<size_t>(other.open_rank)].streams[1 - which];
    if (!open_line_may_end(other, owner, now)) return;
    end_open_line(other);
  }
  std::string& out = sink.out;
  out.clear();
  if (sink.open_rank >= 0) {
    const auto owner = static_cast<size_t>(sink.open_rank);
    RankStream& stream = ranks[owner].streams[which];
    const size_t nl = stream.buffered.find('\n');
    if (nl != std::string::npos) {
      out.append(stream.buffered, 0, nl + 1);
      consume(stream, nl + 1);
      sink.open_rank = -1;
    } else {
      sink.open_length += stream.buffered.size();
      out += stream.buffered;
      stream.buffered.clear();
      if (stream.fd < 0 ||
          (others_waiting(ranks, which, now, sink.open_rank) && open_line_may_end(sink, stream, now))) {
        out += '\n';
        sink.open_rank = -1;
      }
    }
  }
  for (size_t i = 0; i < ranks.size() && sink.open_rank < 0; ++i) {
    RankStream& stream = ranks[i].streams[which];
    if (stream.buffered.empty()) continue;
    const std::string prefix = "[rank " + std::to_string(ranks[i].rank) + "] ";
    size_t start = 0;
    for (size_t nl; (nl = stream.buffered.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix;
      out.append(stream.buffered, start, nl + 1 - start);
    }
    if (start > 0) consume(stream, start);
    if (stream.buffered.empty()) continue;
    if (stream.fd >= 0 && stream.buffered.size() < kBufferSize && !unfinished_waited(stream, now)) continue;
    out += prefix;
    out += stream.buffered;
    if (stream.fd < 0) {
      out += '\n';
    } else {
      sink.open_rank = static_cast<int>(i);
      sink.open_length = stream.buffered.size();
      sink.open_since = now;
    }
    stream.buffered.clear();
  }
  write_all(sink.fd, out);
}

// Moves what the ranks wrote to dp-run's stdout and stderr.
void pump(std::vector<Rank>& ranks) {
  const auto now = Clock::now();
  for (Rank& r : ranks) {
    for (RankStream& stream : r.streams) read_stream(stream, now);
  }
  forward(ranks, kStdout, now);
  forward(ranks, kStderr, now);
}

// The streams with room in their buffers, to poll.
void add_readable(const std::vector<Rank>& ranks, std::vector<pollfd>& fds) {
  for (const Rank& r : ranks) {
    for (const RankStream& stream : r.streams) {
      if (stream.fd >= 0 && stream.buffered.size() < kBufferSize) fds.push_back({stream.fd, POLLIN, 0});
    }
  }
}

// dp-run's own message on its stderr, on a line of its own.
void say(const std::string& text) {
  end_open_line(g_sinks[kStderr]);
  if (g_sinks_shared) end_open_line(g_sinks[kStdout]);
  write_all(STDERR_FILENO, "dp-run: " + text + "\n");
}

// Each rank leads its own process group; it is signalled even after the rank
// exited, for what the rank left running in it, but not once seen empty.
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

// A group's id is free for reuse once its last member is reaped (while the
// rank itself is unreaped, its pid holds it): an empty group is forgotten, so
// that a new group with the same id is never signalled.
void forget_empty_groups(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) {
    if (r.pid > 0 && !r.running && !r.group_gone && ::kill(-r.pid, 0) != 0 && errno == ESRCH) r.group_gone = true;
  }
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
  forget_empty_groups(ranks);
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
// after the grace period or once `hurry` says so, until this process has no
// children. `meanwhile` runs between rounds.
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

// The process dp-run was started as: it passes the stop signals on to the
// launcher and exits as the launcher does. A launcher that died of a signal
// took its ranks along (PR_SET_PDEATHSIG); what they started comes here, to
// the next subreaper up, and is killed.
int front(pid_t launcher, const sigset_t& caught, long grace_ms) {
  if (launcher < 0) {
    std::perror("dp-run: fork");
    return 1;
  }
  ::setpgid(launcher, launcher);  // also here, as in the launcher: whichever runs first
  ::sigprocmask(SIG_UNBLOCK, &caught, nullptr);
  int status = 0;
  while (::waitpid(launcher, &status, 0) < 0 && errno == EINTR) {
  }
  const bool killed = WIFSIGNALED(status);
  const sig_atomic_t signals_seen = g_front_signals;
  stop_escaped(
      grace_ms, [&] { return killed || g_front_signals > signals_seen; }, [] {});
  return killed ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// What the command line asks for.
struct Options {
  long nproc = -1, nnodes = 1, node_rank = 0, grace_ms = 5000;
  std::string master_addr;
  long master_port = -1;
  char** program = nullptr;  // the ranks' program and its arguments, null-terminated
};

Options parse_args(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) usage((std::string(flag) + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::printf("%s\n%s", kUsage, kOutputHelp);
      std::exit(0);
    }
    if (a == "-n" || a == "--nproc-per-node")
      o.nproc = parse_int(value("-n"), "-n", 1, 4096);
    else if (a == "--nnodes")
      o.nnodes = parse_int(value("--nnodes"), "--nnodes", 1, 100000);
    else if (a == "--node-rank")
      o.node_rank = parse_int(value("--node-rank"), "--node-rank", 0, 99999);
    else if (a == "--master-addr")
      o.master_addr = value("--master-addr");
    else if (a == "--master-port")
      o.master_port = parse_int(value("--master-port"), "--master-port", 1, 65535);
    else if (a == "--grace-ms")
      o.grace_ms = parse_int(value("--grace-ms"), "--grace-ms", 0, 3600000);
    else if (a == "--") {
      ++i;
      break;
    } else if (!a.empty() && a[0] == '-')
      usage(("unknown option " + a).c_str());
    else
      break;
  }
  if (o.nproc < 0) usage("-n is required");
  if (i >= argc) usage("no program given");
  o.program = argv + i;
  return o;
}

// Two pipes per rank stay open: past the open-file limit, ranks would start and then be killed.
void raise_open_file_limit(long nproc) {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return;
  const rlim_t needed = 2 * static_cast<rlim_t>(nproc) + 16;
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

// Where the ranks meet (the master's address and port, the store's token),
// and the environment every rank shares.
void set_up_rendezvous(Options& o) {
  if (o.node_rank >= o.nnodes) usage("--node-rank must be below --nnodes");
  if (o.nnodes > 1 && (o.master_addr.empty() || o.master_port < 0)) {
    usage("with --nnodes > 1, --master-addr and --master-port are required (node 0 serves the store there)");
  }
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
  if (o.master_port < 0 && hold_free_port(o.master_addr, &o.master_port) < 0) {
    usage(("cannot find a free port on " + o.master_addr).c_str());
  }
  if (o.nnodes == 1 && std::getenv("DP_STORE_TOKEN") == nullptr) setenv("DP_STORE_TOKEN", random_token().c_str(), 1);
  // Line-buffered stdout for programs linked against libdparallel, which
  // honours this. Not stdbuf's LD_PRELOAD: that breaks sanitized programs
  // (their runtime must load first), static ones and programs that run
  // others; nor a pseudo-terminal, which changes more than buffering.
  setenv("DP_LINE_BUFFERED_STDOUT", "1", 0);
}

// The signals the front catches, and what the ranks get back of how dp-run
// was started.
struct Signals {
  std::vector<int> caught;
  sigset_t caught_set;
  struct sigaction started_sigchld;
  sigset_t started_mask;
};

// The stop signals, but those dp-run was started with ignored (nohup),
// except SIGINT, SIGQUIT and SIGTERM; blocked until the front unblocks them
// (the launcher keeps them blocked).
Signals take_signals() {
  Signals s{};
  sigemptyset(&s.caught_set);
  for (int sig : stop_signals()) {
    struct sigaction started {};
    ::sigaction(sig, nullptr, &started);
    if (started.sa_handler == SIG_IGN && sig != SIGINT && sig != SIGQUIT && sig != SIGTERM) continue;
    s.caught.push_back(sig);
    sigaddset(&s.caught_set, sig);
  }
  // Inherited, a SIGCHLD ignore would have the kernel reap the ranks before
  // dp-run learns how they exited; the ranks get it back.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigaction(SIGCHLD, &default_action, &s.started_sigchld);
  ::sigprocmask(SIG_BLOCK, &s.caught_set, &s.started_mask);
  return s;
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
  ::execvp(o.program[0], o.program);
  std::fprintf(stderr, "dp-run: cannot run '%s': %s\n", o.program[0], std::strerror(errno));
  ::_exit(127);
}

// Starts this node's ranks; false (with the ranks started so far killed) if one cannot be.
bool spawn_ranks(const Options& o, const Signals& signals, std::vector<Rank>& ranks) {
  const pid_t launcher_pid = ::getpid();
  for (long local = 0; local < o.nproc; ++local) {
    Rank& r = ranks[static_cast<size_t>(local)];
    r.rank = static_cast<int>(o.node_rank * o.nproc + local);
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
    r.streams[kStdout].fd = out[0];
    r.streams[kStderr].fd = err[0];
    r.running = true;
  }
  return true;
}

// The launcher's view of the running job.
struct Job {
  std::vector<Rank> ranks;
  Requests requests;
  long grace_ms = 0;
  int result = 0;
  bool stopping = false;
  int signals_at_stop = 0;  // a signal after stopping began escalates to SIGKILL
  Clock::time_point kill_at = Clock::time_point::max();

  void stop(int exit_code, int sig) {
    stopping = true;
    signals_at_stop = requests.signals;
    result = exit_code;
    signal_all(ranks, sig);
    kill_at = Clock::now() + std::chrono::milliseconds(grace_ms);
  }

  // With the front gone (killed), the rest of the job is killed at once.
  bool hurry() const { return requests.front_gone || requests.signals > signals_at_stop; }
};

// Forwards the ranks' output and stops the job when a rank fails, a signal
// comes or the output is lost, until every rank has exited.
void supervise(Job& job) {
  for (;;) {
    std::vector<pollfd> fds;
    add_readable(job.ranks, fds);
    if (job.requests.fd >= 0) fds.push_back({job.requests.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 20);
    pump(job.ranks);
    read_requests(job.requests);
    reap(job.ranks);
    bool any_running = false;
    for (Rank& r : job.ranks) {
      if (r.running) {
        any_running = true;
        continue;
      }
      if (r.exit_code != 0 && !job.stopping) {
        say("rank " + std::to_string(r.rank) + " exited with code " + std::to_string(r.exit_code) +
            "; stopping the other ranks");
        job.stop(r.exit_code, SIGTERM);
      }
    }
    // The ranks get the signal dp-run got, but SIGPIPE: their own output still works.
    const int first_signal = job.requests.first_signal;
    if (!job.stopping && first_signal != 0)
      job.stop(128 + first_signal, first_signal == SIGPIPE ? SIGTERM : first_signal);
    if (!job.stopping && g_output_lost) job.stop(128 + SIGPIPE, SIGTERM);
    if (!job.stopping && job.requests.front_gone) job.stop(128 + SIGKILL, SIGKILL);
    if (job.stopping && job.hurry()) job.kill_at = Clock::now();
    if (job.stopping && Clock::now() >= job.kill_at) {
      signal_all(job.ranks, SIGKILL);
      job.kill_at = Clock::time_point::max();
    }
    if (!any_running) return;
  }
}

// Stops what the ranks left running: in their groups, then what escaped them.
void stop_what_the_ranks_left(Job& job) {
  // In their groups: SIGTERM, SIGKILL after the grace period.
  if (any_group_alive(job.ranks)) {
    signal_all(job.ranks, SIGTERM);
    auto deadline = Clock::now() + std::chrono::milliseconds(job.grace_ms);
    while (any_group_alive(job.ranks)) {
      if (Clock::now() >= deadline || job.hurry()) {
        signal_all(job.ranks, SIGKILL);
        deadline = Clock::time_point::max();
      }
      pump(job.ranks);
      read_requests(job.requests);
      ::usleep(10000);
      reap(job.ranks);
    }
  }
  stop_escaped(
      job.grace_ms, [&] { return job.hurry(); },
      [&] {
        pump(job.ranks);
        read_requests(job.requests);
      });
}

// The ranks are gone; writes what they left, but does not wait on a leftover
// child of theirs that still holds a pipe.
void finish_output(std::vector<Rank>& ranks) {
  auto give_up = Clock::now() + std::chrono::seconds(1);
  auto any_stream_open = [&] {
    for (const Rank& r : ranks) {
      if (r.streams[kStdout].fd >= 0 || r.streams[kStderr].fd >= 0) return true;
    }
    return false;
  };
  while (any_stream_open() && Clock::now() < give_up) {
    std::vector<pollfd> fds;
    add_readable(ranks, fds);
    ::poll(fds.data(), fds.size(), 50);
    pump(ranks);
  }
  for (Rank& r : ranks) {
    for (RankStream& stream : r.streams) {
      read_stream(stream, Clock::now());
      if (stream.fd >= 0) ::close(stream.fd);
      stream.fd = -1;
    }
  }
  pump(ranks);  // with every stream at its end, this writes all that is left
}

// The launcher. Its own process group keeps it alive when dp-run's group is
// killed. The stop signals reach it only through the control socket, so one
// sent to both processes counts once; SIGTTOU is blocked too, for writing to
// a terminal (with `stty tostop`) from a background group.
int launcher(const Options& o, const Signals& signals, int control_fd) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_NAME, "dp-run-launcher");  // for ps and pkill -x
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);       // not inherited across fork
  sigset_t ttou;
  sigemptyset(&ttou);
  sigaddset(&ttou, SIGTTOU);
  ::sigprocmask(SIG_BLOCK, &ttou, nullptr);
  g_sinks_shared = same_file(STDOUT_FILENO, STDERR_FILENO);
  Job job;
  job.requests.fd = control_fd;
  job.grace_ms = o.grace_ms;
  job.ranks.resize(static_cast<size_t>(o.nproc));
  if (!spawn_ranks(o, signals, job.ranks)) return 1;
  supervise(job);
  stop_what_the_ranks_left(job);
  finish_output(job.ranks);
  return job.result;
}

}  // namespace

int main(int argc, char** argv) {
  Options options = parse_args(argc, argv);
  raise_open_file_limit(options.nproc);
  set_up_rendezvous(options);
  const Signals signals = take_signals();
  int control[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
    std::perror("dp-run: socketpair");
    return 1;
  }
  g_control_fd = control[0];
  struct sigaction pass {};
  pass.sa_handler = pass_on;
  pass.sa_mask = signals.caught_set;
  for (int sig : signals.caught) ::sigaction(sig, &pass, nullptr);
  // Orphans come to the launcher (and, if it dies, to the front), so they can be reaped and counted as gone.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  const pid_t launcher_pid = ::fork();
  if (launcher_pid != 0) {
    ::close(control[1]);
    return front(launcher_pid, signals.caught_set, options.grace_ms);
  }
  ::close(control[0]);
  g_control_fd = -1;
  return launcher(options, signals, control[1]);
}
