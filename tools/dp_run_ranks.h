// dp-run's ranks as processes: starting them, signalling their process
// groups, reaping them, and stopping what they leave running.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <functional>
#include <vector>

#include "dp_run_options.h"
#include "dp_run_output.h"

namespace dprun {

// One rank's process; `running` until it is reaped.
struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int exit_code = 0;
  bool group_gone = false;  // seen empty once the rank was reaped
  bool exit_seen = false;   // its exit was looked at (--survive-failures)
};

// The signals the front catches, and what the ranks get back of how dp-run
// was started.
struct Signals {
  std::vector<int> caught;
  sigset_t caught_set;
  struct sigaction started_sigchld;
  sigset_t started_mask;
};

// Starts this node's ranks (`ranks` and `outputs` sized -n), their output
// through `outputs`' pipes; false (with the ranks started so far killed) if
// one cannot be.
bool spawn_ranks(const Options& o, const Signals& signals, std::vector<Rank>& ranks, std::vector<RankOutput>& outputs);
// Each rank leads its own process group; it is signalled even after the rank
// exited, for what the rank left running in it, but not once seen empty.
void signal_all(std::vector<Rank>& ranks, int sig);
bool any_group_alive(const std::vector<Rank>& ranks);
// Reaps every exited child: ranks, and (as the subreaper) what they left.
void reap(std::vector<Rank>& ranks);
// Stops what the ranks left outside their process groups: SIGTERM, SIGKILL
// after the grace period or once `hurry` says so, until this process has no
// children. `meanwhile` runs between rounds.
void stop_escaped(long grace_ms, const std::function<bool()>& hurry, const std::function<void()>& meanwhile);

}  // namespace dprun
