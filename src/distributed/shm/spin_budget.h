// How long a rank waiting at a shared-memory barrier spins before it sleeps
// (shm_collectives.cpp, arrive_and_wait).
//
// On a busy host a peer is often off its CPU for one of another task's time
// slices (about 1.4 ms on the 2-core reference machine), and a rank that
// sleeps meanwhile gets its own CPU back only after a slice too; the wake-up
// may also move it onto the peer's CPU, where the two then take turns
// (bench/RESULTS.md). So a rank spins for longer than a slice (kLongSpin) as
// long as its peers usually come within that: then the spin is what their
// lateness would have cost anyway. When most of the recent waits lasted
// longer, the peers are later than a spin can bridge, and it spins briefly
// (kShortSpin) before it sleeps, so that a group whose ranks do not meet
// soon burns no core. A spin of a multiple of the recent median wait would
// stay short there (the median is about 1 us): as short as the 4 us spins
// that left that host at 7 us to 1.4 ms per 4 KiB all_reduce.
// In a job that spans hosts the peers are late mostly because they wait on
// the network (the hierarchical group's cross-host leg, HSDP's replica
// all-reduce), and their network threads need the very cores a long spin
// takes: a 4 KiB hierarchical all_reduce took 0.8-1.0 ms with the long spin
// and 0.2-0.25 ms with the short one on the 2-core testbed (bench/RESULTS.md).
// There every spin is short (set_network_paced).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>

namespace dparallel::dist::shm {

class SpinBudget {
 public:
  static constexpr std::chrono::nanoseconds kShortSpin = std::chrono::microseconds(4);
  static constexpr std::chrono::nanoseconds kLongSpin = std::chrono::milliseconds(2);
  // Waits remembered; the budget follows whether their median is within kLongSpin.
  static constexpr size_t kWindow = 16;

  std::chrono::nanoseconds budget() const {
    return network_paced_ || 2 * long_waits_ > kWindow ? kShortSpin : kLongSpin;
  }
  // From now on, every spin is short.
  void set_network_paced() { network_paced_ = true; }
  bool network_paced() const { return network_paced_; }

  // One wait, from the arrival until every rank had arrived.
  void record(std::chrono::nanoseconds waited) {
    const bool was_long = waited > kLongSpin;
    long_waits_ += static_cast<size_t>(was_long) - static_cast<size_t>(long_[next_]);
    long_[next_] = was_long;
    next_ = (next_ + 1) % kWindow;
  }

 private:
  std::array<bool, kWindow> long_{};  // the last kWindow waits: longer than kLongSpin
  size_t next_ = 0;                   // the oldest of them, replaced next
  size_t long_waits_ = 0;
  bool network_paced_ = false;
};

}  // namespace dparallel::dist::shm
