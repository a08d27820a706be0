// dp-run: starts the local ranks of a job, like `torchrun --standalone`.
//
//   dp-run -n 4 [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
//          [--store-port S] [--grace-ms G] prog args...
//   dp-run --diagnose DIR    reads the ranks' flight recorder dumps (DP_TRACE_DIR)
//
// With --trace-dir D, the ranks get DP_TRACE_DIR=D (made if missing) and
// SIGUSR1 to dp-run no longer stops the job: each running rank gets it, and
// dparallel writes its flight recorder's dump there (a rank whose program
// has not made a process group yet, or does not use dparallel, dies of it as
// of any SIGUSR1); `dp-run --diagnose D` reads the dumps.
//   dp-run --help
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, DP_STORE_ADDR, DP_STORE_PORT and, on a single node without
// one, a fresh DP_STORE_TOKEN (kRendezvousHelp). dparallel's store is at
// DP_STORE_PORT, and MASTER_PORT, another port, is the program's own
// framework's. Without --master-port, dp-run picks both; it keeps the
// store's bound (not listening) while it runs, so no other program takes it
// before rank 0 listens on it. With --master-port P, the store is at
// --store-port or P + 1: each node of a job derives the same. When a rank fails, the others get SIGTERM (SIGKILL after
// the grace period) and dp-run exits with the failed rank's code (128 + signal
// for a signal); with --max-restarts K it then starts the job again, up to K
// times, each run's ranks with DP_RESTART_COUNT (0, 1, ...; one node only).
// With --survive-failures the others go on (they may shrink their groups):
// dp-run exits 0 when a rank outlived the first failure and every one that
// did exited 0, else with the first failure's code.
// Usage errors exit with 2.
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
//
// Files: dp_run_options (the command line and the rendezvous), dp_run_ranks
// (starting, signalling and reaping the ranks), dp_run_output (the pump of
// the ranks' output); here, the two processes and the job's life.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dp_run_diagnose.h"
#include "dp_run_options.h"
#include "dp_run_output.h"
#include "dp_run_ranks.h"

namespace dprun {
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
  int fd = -1;              // the launcher's end; -1 once the front is gone
  int first_signal = 0;     // the signal that stops the job
  int signals = 0;          // how many came (but dump requests)
  bool usr1_dumps = false;  // --trace-dir: SIGUSR1 asks the ranks for their flight recorder dumps
  int dumps = 0;            // dump requests not yet passed on
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
    for (ssize_t i = 0; i < n; ++i) {
      if (requests.usr1_dumps && buf[i] == SIGUSR1) {
        ++requests.dumps;
        continue;
      }
      if (requests.first_signal == 0) requests.first_signal = buf[i];
      ++requests.signals;
    }
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

// The launcher's view of the running job.
struct Job {
  std::vector<Rank> ranks;
  std::vector<RankOutput> outputs;  // by the index of `ranks`
  Requests requests;
  long grace_ms = 0;
  int result = 0;
  bool stopping = false;
  bool rank_failed = false;  // what stopped it: a rank's failure (a restart may follow)
  bool survive_failures = false;
  int first_failure = 0;           // with survive_failures: the first failed rank's code
  bool survivor_failed = false;    // a rank that outlived the first failure failed too
  bool survivor_finished = false;  // one exited 0 after it
  int signals_at_stop = 0;         // a signal after stopping began escalates to SIGKILL
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
    add_readable(job.outputs, fds);
    if (job.requests.fd >= 0) fds.push_back({job.requests.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 20);
    pump(job.outputs);
    read_requests(job.requests);
    reap(job.ranks);
    // A dump request goes to each running rank itself, not to what it
    // started: only dparallel's SIGUSR1 handler turns it into a dump.
    for (; job.requests.dumps > 0; --job.requests.dumps) {
      for (const Rank& r : job.ranks) {
        if (r.running) ::kill(r.pid, SIGUSR1);
      }
    }
    bool any_running = false;
    for (Rank& r : job.ranks) {
      if (r.running) {
        any_running = true;
        continue;
      }
      if (job.survive_failures && !job.stopping) {
        if (r.exit_seen) continue;
        r.exit_seen = true;
        if (r.exit_code == 0) {
          job.survivor_finished = job.survivor_finished || job.first_failure != 0;
          continue;
        }
        // What the failed rank started goes with it: a child holding its
        // sockets would hide its death from the others.
        if (!r.group_gone) ::killpg(r.pid, SIGKILL);
        if (job.first_failure != 0) {
          job.survivor_failed = true;
          say("rank " + std::to_string(r.rank) + " exited with code " + std::to_string(r.exit_code));
          continue;
        }
        job.first_failure = r.exit_code;
        say("rank " + std::to_string(r.rank) + " exited with code " + std::to_string(r.exit_code) +
            "; the other ranks go on (--survive-failures)");
        continue;
      }
      if (r.exit_code != 0 && !job.stopping) {
        say("rank " + std::to_string(r.rank) + " exited with code " + std::to_string(r.exit_code) +
            "; stopping the other ranks");
        job.stop(r.exit_code, SIGTERM);
        job.rank_failed = true;
      }
    }
    // The ranks get the signal dp-run got, but SIGPIPE: their own output still works.
    const int first_signal = job.requests.first_signal;
    if (!job.stopping && first_signal != 0)
      job.stop(128 + first_signal, first_signal == SIGPIPE ? SIGTERM : first_signal);
    if (!job.stopping && output_lost()) job.stop(128 + SIGPIPE, SIGTERM);
    if (!job.stopping && job.requests.front_gone) job.stop(128 + SIGKILL, SIGKILL);
    if (job.stopping && job.hurry()) job.kill_at = Clock::now();
    if (job.stopping && Clock::now() >= job.kill_at) {
      signal_all(job.ranks, SIGKILL);
      job.kill_at = Clock::time_point::max();
    }
    if (!any_running) {
      if (!job.stopping && job.first_failure != 0 && (job.survivor_failed || !job.survivor_finished)) {
        job.result = job.first_failure;
      }
      return;
    }
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
      pump(job.outputs);
      read_requests(job.requests);
      ::usleep(10000);
      reap(job.ranks);
    }
  }
  stop_escaped(
      job.grace_ms, [&] { return job.hurry(); },
      [&] {
        pump(job.outputs);
        read_requests(job.requests);
      });
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
  init_sinks();
  Requests requests;
  requests.fd = control_fd;
  requests.usr1_dumps = !o.trace_dir.empty();
  for (long restart = 0;; ++restart) {
    // As torchrun's TORCHELASTIC_RESTART_COUNT: a program resumes from its
    // checkpoint when it is not 0.
    ::setenv("DP_RESTART_COUNT", std::to_string(restart).c_str(), 1);
    Job job;
    job.requests = requests;
    job.grace_ms = o.grace_ms;
    job.survive_failures = o.survive_failures;
    job.ranks.resize(static_cast<size_t>(o.nproc));
    job.outputs.resize(static_cast<size_t>(o.nproc));
    if (!spawn_ranks(o, signals, job.ranks, job.outputs)) return 1;
    supervise(job);
    stop_what_the_ranks_left(job);
    finish_output(job.outputs);
    requests = job.requests;
    // Only a rank's failure starts the job again: not a signal to dp-run,
    // its lost output, or its front gone, even during the stop.
    const bool restartable = job.result != 0 && job.rank_failed && requests.first_signal == 0 && !requests.front_gone &&
                             !output_lost() && restart < o.max_restarts;
    if (!restartable) return job.result;
    say("restarting the job (restart " + std::to_string(restart + 1) + " of " + std::to_string(o.max_restarts) + ")");
  }
}

}  // namespace
}  // namespace dprun

int main(int argc, char** argv) {
  using namespace dprun;
  if (argc >= 2 && std::string(argv[1]) == "--diagnose") return diagnose_main(argc, argv);
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
