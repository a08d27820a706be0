// How the in-process NCCL calls wait for their streams: poll each stream,
// watch each communicator's asynchronous error, give up at a deadline. The
// queries come in as callbacks and nothing here includes CUDA or NCCL, so a
// test drives every outcome without a GPU.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace dparallel::cuda {

using WaitClock = std::chrono::steady_clock;

// DP_NCCL_TIMEOUT_MS, else 300000 ms (the default timeout of a process group
// and of a store); anything but a positive number of milliseconds is ignored.
constexpr std::chrono::milliseconds kDefaultNcclTimeout{300000};
inline std::chrono::milliseconds nccl_timeout_from(const char* text) {
  if (text == nullptr || *text == '\0') return kDefaultNcclTimeout;
  char* end = nullptr;
  long long ms = std::strtoll(text, &end, 10);
  if (*end != '\0' || ms <= 0) return kDefaultNcclTimeout;
  return std::chrono::milliseconds(ms);
}

// Between polls: yield for the first millisecond, so a short collective
// returns at once, then sleep a little, so a long one leaves the core free.
inline std::chrono::microseconds poll_pause(WaitClock::duration waited) {
  return waited < std::chrono::milliseconds(1) ? std::chrono::microseconds(0) : std::chrono::microseconds(50);
}

// A stream query's answer: done, still busy, or an error code (> 0).
constexpr int kStreamDone = 0;
constexpr int kStreamBusy = -1;

struct NcclWaitResult {
  enum class Kind { kDone, kStreamError, kAsyncError, kTimeout };
  Kind kind = Kind::kDone;
  size_t index = 0;             // the stream or communicator that failed
  int code = 0;                 // its cudaError_t or ncclResult_t
  std::vector<size_t> pending;  // on a timeout: the streams not done
};

// Waits until each of `n` streams is done. query_stream(i) returns
// kStreamDone, kStreamBusy or a CUDA error; async_error(i) returns 0 or the
// communicator's NCCL error; now() and pause(duration) are the clock and the
// sleep. Stream errors come first, then asynchronous errors, then the deadline.
template <typename QueryStream, typename AsyncError, typename Now, typename Pause>
NcclWaitResult wait_streams(size_t n, WaitClock::time_point deadline, QueryStream&& query_stream,
                            AsyncError&& async_error, Now&& now, Pause&& pause) {
  std::vector<bool> done(n, false);
  size_t left = n;
  const WaitClock::time_point start = now();
  for (;;) {
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      int state = query_stream(i);
      if (state == kStreamDone) {
        done[i] = true;
        --left;
      } else if (state != kStreamBusy) {
        return {NcclWaitResult::Kind::kStreamError, i, state, {}};
      }
    }
    if (left == 0) return {};
    for (size_t i = 0; i < n; ++i) {
      int error = async_error(i);
      if (error != 0) return {NcclWaitResult::Kind::kAsyncError, i, error, {}};
    }
    const WaitClock::time_point t = now();
    if (t >= deadline) {
      NcclWaitResult result{NcclWaitResult::Kind::kTimeout, 0, 0, {}};
      for (size_t i = 0; i < n; ++i) {
        if (!done[i]) result.pending.push_back(i);
      }
      result.index = result.pending.front();
      return result;
    }
    pause(poll_pause(t - start));
  }
}

}  // namespace dparallel::cuda
