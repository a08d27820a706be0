// Producers for the stream tests: host functions queued on a cpu stream that
// write their tensor only after a pause, as a GPU kernel still running would.
#pragma once

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "test_util.h"

namespace dptest {

// How long a producer pauses before it writes: long enough that a call that
// does not wait runs well before the write. The tests that must fail without
// the wait set DP_TEST_PRODUCER_DELAY_MS far higher, so that no load on the
// machine can delay the call past the write.
inline int producer_delay_ms() {
  static const int delay = [] {
    const char* text = std::getenv("DP_TEST_PRODUCER_DELAY_MS");
    int ms = text != nullptr ? std::atoi(text) : 0;
    return ms > 0 ? ms : 40;
  }();
  return delay;
}

struct DelayedWrite {
  void* dst;
  std::vector<float> values;
  int delay_ms;
};

inline void run_delayed_write(void* data) {
  std::unique_ptr<DelayedWrite> w(static_cast<DelayedWrite*>(data));
  std::this_thread::sleep_for(std::chrono::milliseconds(w->delay_ms));
  std::memcpy(w->dst, w->values.data(), w->values.size() * sizeof(float));
}

// Queues on `stream` of cpu:`device` a write of `v` into `t` after a pause.
inline void queue_write(void* stream, dp_tensor* t, const std::vector<float>& v, int device = 0,
                        int delay_ms = producer_delay_ms()) {
  ASSERT_EQ(dp_tensor_nbytes(t), v.size() * sizeof(float));
  ASSERT_EQ(dp_stream_launch_host_func(cpu(device), stream, run_delayed_write,
                                       new DelayedWrite{dp_tensor_data(t), v, delay_ms}),
            DP_OK)
      << dp_last_error();
}

// n floats: start, start + 1, ...
inline std::vector<float> filled(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

}  // namespace dptest
