// A persistent pool of compute threads shared by every CPU kernel. The
// calling thread takes part, so a pool of N-1 helpers keeps N cores busy.
#pragma once

#include <cstddef>
#include <functional>

namespace dparallel {

// Threads that run a parallel_for, caller included (DP_NUM_THREADS, default
// the number of cores).
size_t compute_concurrency();

// Runs task(i) for every i in [0, ntasks) across the pool and returns when all
// are done; the first exception thrown by a task is rethrown. Called from a
// pool thread, it runs the tasks inline.
void parallel_for(size_t ntasks, const std::function<void(size_t)>& task);

// Splits [0, n) into at most compute_concurrency() ranges of at least
// `min_grain` items and runs body(begin, end) on each.
void parallel_range(size_t n, size_t min_grain, const std::function<void(size_t, size_t)>& body);

// Ends the pool's helper threads once the parallel_for calls in flight are
// done; the next parallel_for starts new ones. Any thread but a helper.
void stop_compute_threads();

// While alive, parallel_for and parallel_range on this thread run inline.
// For threads whose work overlaps the host's own computation (a process
// group's comm lane): fanning out there takes cores from the host.
class SerialScope {
 public:
  SerialScope();
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  bool was_serial_;
};

}  // namespace dparallel
