// Concurrent calls over the same devices: threads call parallel_apply,
// data_parallel and replica_set_apply at once, each in its own device order,
// with replicas that wait for every other replica of their call (as the
// callback contract allows). Every call must finish.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/device_worker.h"
#include "module/module_test_util.h"

using namespace dptest;

namespace {

constexpr int kRounds = 150;
// How long a replica waits for the other replicas of its call. They only need
// to be scheduled; a replica that waits this long was queued behind another
// call on some device.
constexpr auto kBarrierWait = std::chrono::seconds(10);
// The whole test: far beyond what every call needs, below ctest's timeout.
constexpr auto kTestDeadline = std::chrono::seconds(60);

// Runs `body` on a thread; if it has not finished by `deadline`, the process
// exits failing, since the threads stuck inside it cannot be joined.
void run_within(std::chrono::seconds deadline, const std::function<void()>& body) {
  std::packaged_task<void()> task(body);
  std::future<void> done = task.get_future();
  std::thread runner(std::move(task));
  if (done.wait_for(deadline) != std::future_status::ready) {
    std::fprintf(stderr, "concurrent calls did not finish within %lld s: deadlock\n",
                 static_cast<long long>(deadline.count()));
    std::fflush(stderr);
    std::_Exit(EXIT_FAILURE);
  }
  runner.join();
  done.get();
}

// A barrier across the replicas of one call.
struct CallBarrier {
  explicit CallBarrier(int n) : expected(n) {}
  const int expected;
  std::mutex mutex;
  std::condition_variable all_arrived;
  int arrived = 0;
};

// Waits until every replica of its call has arrived; returns its input.
int wait_for_every_replica(void* user_data, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  auto* barrier = static_cast<CallBarrier*>(user_data);
  std::unique_lock<std::mutex> lock(barrier->mutex);
  if (++barrier->arrived == barrier->expected) barrier->all_arrived.notify_all();
  if (!barrier->all_arrived.wait_for(lock, kBarrierWait, [&] { return barrier->arrived == barrier->expected; })) {
    return 7;
  }
  *output = input;
  return 0;
}

// One replica and one input per device, for dp_parallel_apply.
struct Replicas {
  std::vector<ModulePtr> modules;
  std::vector<TensorPtr> inputs;
  std::vector<dp_module*> module_ptrs;
  std::vector<dp_tensor*> input_ptrs;
  std::vector<dp_device> devices;
  explicit Replicas(const std::vector<dp_device>& on) : devices(on) {
    for (const dp_device& d : on) {
      modules.push_back(linear(1, 1, 0.0f, d));
      inputs.push_back(make<float>({1}, {1}, d));
      module_ptrs.push_back(modules.back().get());
      input_ptrs.push_back(inputs.back().get());
    }
  }
};

// Collects the first failure of any caller thread.
struct Failures {
  std::mutex mutex;
  std::string first;
  void record(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (first.empty()) first = what;
  }
};

void parallel_apply_rounds(const std::vector<dp_device>& devices, Failures& failures) {
  Replicas r(devices);
  const size_t n = devices.size();
  for (int round = 0; round < kRounds; ++round) {
    CallBarrier barrier(static_cast<int>(n));
    std::vector<dp_tensor*> out(n, nullptr);
    dp_status s = dp_parallel_apply(r.module_ptrs.data(), r.input_ptrs.data(), r.devices.data(), n,
                                    wait_for_every_replica, &barrier, out.data());
    for (dp_tensor* t : out) dp_tensor_destroy(t);
    if (s != DP_OK) return failures.record("dp_parallel_apply round " + std::to_string(round) + ": " + last_error());
  }
}

void data_parallel_rounds(const std::vector<dp_device>& devices, Failures& failures) {
  ModulePtr module = linear(1, 1);
  const int64_t rows = static_cast<int64_t>(devices.size());
  auto input = make<float>({rows, 1}, iota<float>(static_cast<size_t>(rows)));
  for (int round = 0; round < kRounds; ++round) {
    CallBarrier barrier(static_cast<int>(devices.size()));
    dp_tensor* out = nullptr;
    dp_status s = dp_data_parallel(module.get(), input.get(), devices.data(), devices.size(), cpu(0), 0,
                                   wait_for_every_replica, &barrier, &out);
    dp_tensor_destroy(out);
    if (s != DP_OK) return failures.record("dp_data_parallel round " + std::to_string(round) + ": " + last_error());
  }
}

void replica_set_apply_rounds(const std::vector<dp_device>& devices, Failures& failures) {
  ModulePtr module = linear(1, 1);
  ReplicaSetPtr set = replica_set(module.get(), devices);
  const int64_t rows = static_cast<int64_t>(devices.size());
  auto input = make<float>({rows, 1}, iota<float>(static_cast<size_t>(rows)));
  for (int round = 0; round < kRounds; ++round) {
    CallBarrier barrier(static_cast<int>(devices.size()));
    dp_tensor* out = nullptr;
    dp_status s = dp_replica_set_apply(set.get(), input.get(), 0, cpu(0), wait_for_every_replica, &barrier, &out);
    dp_tensor_destroy(out);
    if (s != DP_OK) {
      return failures.record("dp_replica_set_apply round " + std::to_string(round) + ": " + last_error());
    }
  }
}

// Runs every caller on its own thread at once and reports the first failure.
void run_callers(const std::vector<std::function<void(Failures&)>>& callers) {
  Failures failures;
  run_within(kTestDeadline, [&] {
    std::vector<std::thread> threads;
    for (const auto& caller : callers) threads.emplace_back([&] { caller(failures); });
    for (std::thread& t : threads) t.join();
  });
  EXPECT_EQ(failures.first, "");
}

}  // namespace

TEST(ConcurrentCalls, ParallelApplyInOppositeDeviceOrdersAllFinish) {
  run_callers({
      [](Failures& f) {
        parallel_apply_rounds({cpu(1), cpu(2), cpu(3)}, f);
      },
      [](Failures& f) {
        parallel_apply_rounds({cpu(3), cpu(2), cpu(1)}, f);
      },
      [](Failures& f) {
        parallel_apply_rounds({cpu(2), cpu(1)}, f);
      },
  });
}

TEST(ConcurrentCalls, DataParallelAndReplicaSetApplyBesideParallelApplyAllFinish) {
  run_callers({
      [](Failures& f) {
        data_parallel_rounds({cpu(1), cpu(2), cpu(3)}, f);
      },
      [](Failures& f) {
        replica_set_apply_rounds({cpu(3), cpu(1), cpu(2)}, f);
      },
      [](Failures& f) {
        parallel_apply_rounds({cpu(2), cpu(3), cpu(1)}, f);
      },
  });
}

// Single tasks on the device workers and in-process collectives, while
// parallel_apply calls with waiting replicas hold those workers.
TEST(ConcurrentCalls, DeviceWorkAndCollectivesBesideParallelApplyAllFinish) {
  run_callers({
      [](Failures& f) {
        parallel_apply_rounds({cpu(1), cpu(2)}, f);
      },
      [](Failures& f) {
        parallel_apply_rounds({cpu(2), cpu(1)}, f);
      },
      [](Failures& f) {
        try {
          for (int round = 0; round < kRounds; ++round) {
            for (int d : {2, 1}) {
              dparallel::run_on_device(dparallel::Device{dparallel::DeviceType::kCpu, d}, [] {}).get();
            }
          }
        } catch (const std::exception& e) {
          f.record(std::string("run_on_device: ") + e.what());
        }
      },
      [](Failures& f) {
        auto source = make<float>({4}, {1, 2, 3, 4}, cpu(1));
        dp_device devices[] = {cpu(2), cpu(1)};
        for (int round = 0; round < kRounds; ++round) {
          dp_tensor* copies[2] = {};
          dp_status s = dp_broadcast(source.get(), devices, 2, copies);
          dp_tensor* sum = nullptr;
          if (s == DP_OK) {
            const dp_tensor* inputs[] = {copies[0], copies[1]};
            s = dp_reduce_add(inputs, 2, cpu(1), &sum);
          }
          dp_tensor_destroy(sum);
          for (dp_tensor* t : copies) dp_tensor_destroy(t);
          if (s != DP_OK) return f.record("broadcast/reduce round " + std::to_string(round) + ": " + last_error());
        }
      },
  });
}
