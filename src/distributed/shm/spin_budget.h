// How long a rank waiting at a shared-memory barrier spins before it yields
// and then sleeps (shm_collectives.cpp, arrive_and_wait).
//
// A rank that gives its core away on a busy host gets it back only after
// whatever took it has used its time slice (milliseconds), so a rank spins a
// long while (kLongSpin) as long as its peers usually come within that time:
// then the spin is what they would have cost anyway. When most of the recent
// waits lasted longer, the peers are late by more than any spin could bridge,
// and it spins briefly only (kShortSpin) before it sleeps, so that a group
// whose ranks do not meet soon burns no core.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>

namespace dparallel::dist::shm {

class SpinBudget {
 public:
  static constexpr std::chrono::nanoseconds kShortSpin = std::chrono::microseconds(4);
  static constexpr std::chrono::nanoseconds kLongSpin = std::chrono::microseconds(200);
  // Waits remembered; the budget follows whether their median is within kLongSpin.
  static constexpr size_t kWindow = 16;

  std::chrono::nanoseconds budget() const { return 2 * long_waits_ > kWindow ? kShortSpin : kLongSpin; }

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
};

}  // namespace dparallel::dist::shm
