// Whether a rank that waits inside a collective may spin for its peers.
//
// A thread that runs collectives in the background (a comm lane, a group's
// async worker) shares the cores with a host that computes meanwhile: a
// spin there takes the CPU from the host's own work (on 2 cores with 2
// ranks, a prefetched all-gather spinning for a peer whose lane waits for
// its host's time slice). Such a thread spins only while some thread is
// blocked waiting for background work, when spinning is what ends that
// wait soonest; otherwise it sleeps at once. The count is process-wide: a
// host waiting for one group's work lets every group's background waits
// spin.
#pragma once

namespace dparallel::dist {

class BackgroundCalls {
 public:
  // The calling thread runs collectives in the background from now on.
  static void mark_this_thread();
  // False on a background thread while no thread waits for background work.
  static bool may_spin();

  // While it lives, the thread that made it is blocked waiting for
  // background work.
  class Awaited {
   public:
    Awaited();
    ~Awaited();
    Awaited(const Awaited&) = delete;
    Awaited& operator=(const Awaited&) = delete;
  };
};

}  // namespace dparallel::dist
