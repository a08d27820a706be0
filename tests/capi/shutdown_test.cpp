// dp_shutdown: the library's own threads (device workers, compute pool, async
// default streams) end, and the next use starts them again.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "test_util.h"

using namespace dptest;

namespace {

int doubled(void*, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  auto* v = static_cast<float*>(dp_tensor_data(input));
  for (int64_t i = 0; i < dp_tensor_numel(input); ++i) v[i] *= 2;
  *output = input;
  return 0;
}

std::vector<float> run_doubled(dp_module* m, dp_forward_fn fn = doubled, void* user_data = nullptr) {
  TensorPtr x = make<float>({4}, {1, 2, 3, 4});
  dp_device devices[2] = {cpu(0), cpu(1)};
  dp_tensor* y = nullptr;
  EXPECT_EQ(dp_data_parallel(m, x.get(), devices, 2, cpu(0), 0, fn, user_data, &y), DP_OK) << dp_last_error();
  TensorPtr out(y);
  return y == nullptr ? std::vector<float>{} : values<float>(y);
}

struct ModulePtr {
  dp_module* m = nullptr;
  ModulePtr() { EXPECT_EQ(dp_module_create(&m), DP_OK); }
  ~ModulePtr() { dp_module_destroy(m); }
};

}  // namespace

TEST(Shutdown, EndsTheWorkerThreadsAndTheNextForwardStartsThemAgain) {
  ModulePtr model;
  EXPECT_EQ(run_doubled(model.m), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(threads_named("dp-dev cpu:"), 2);

  DP_ASSERT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-dev"), 0);
  EXPECT_EQ(threads_named("dp-pool"), 0);
  EXPECT_EQ(threads_named("dp-stream"), 0);
  DP_EXPECT_OK(dp_shutdown());  // twice is fine

  EXPECT_EQ(run_doubled(model.m), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(threads_named("dp-dev cpu:"), 2);
  DP_EXPECT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-dev"), 0);
}

namespace {
struct InnerCall {
  std::atomic<int> calls{0};
  std::atomic<int> estate{0};
  std::string message;
  std::mutex mutex;
};

int forward_calling_shutdown(void* user_data, size_t i, dp_module* m, dp_tensor* input, dp_device d,
                             dp_tensor** output) {
  auto* inner = static_cast<InnerCall*>(user_data);
  inner->calls.fetch_add(1);
  if (dp_shutdown() == DP_ESTATE) {
    inner->estate.fetch_add(1);
    std::lock_guard<std::mutex> lock(inner->mutex);
    inner->message = dp_last_error();
  }
  return doubled(nullptr, i, m, input, d, output);
}

struct SlowForward {
  std::atomic<bool> started{false};
  std::atomic<bool> finished{false};
};

int slow_forward(void* user_data, size_t i, dp_module* m, dp_tensor* input, dp_device d, dp_tensor** output) {
  auto* state = static_cast<SlowForward*>(user_data);
  state->started = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int rc = doubled(nullptr, i, m, input, d, output);
  if (i == 1) state->finished = true;
  return rc;
}
}  // namespace

TEST(Shutdown, FromAForwardIsEstateNamingWhyAndTheForwardStillFinishes) {
  ModulePtr model;
  InnerCall inner;
  EXPECT_EQ(run_doubled(model.m, forward_calling_shutdown, &inner), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(inner.calls.load(), 2);
  EXPECT_EQ(inner.estate.load(), 2);
  EXPECT_NE(inner.message.find("dp_shutdown"), std::string::npos) << inner.message;
  EXPECT_NE(inner.message.find("host's own thread"), std::string::npos) << inner.message;
  DP_EXPECT_OK(dp_shutdown());
}

TEST(Shutdown, WaitsForAForwardInFlightOnAnotherThread) {
  ModulePtr model;
  SlowForward state;
  std::vector<float> result;
  std::thread host([&] { result = run_doubled(model.m, slow_forward, &state); });
  while (!state.started.load()) std::this_thread::yield();
  DP_EXPECT_OK(dp_shutdown());
  // Replica 1's forward ran to its end before the workers ended.
  EXPECT_TRUE(state.finished.load());
  host.join();
  EXPECT_EQ(result, (std::vector<float>{2, 4, 6, 8}));
  DP_EXPECT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-dev"), 0);
}

TEST(Shutdown, EndsTheComputePoolAfterALargeReduction) {
  // reduce_add over a large tensor fans out across the compute pool.
  const int64_t n = 1 << 20;
  TensorPtr a = make<float>({n}, std::vector<float>(n, 1.0F), cpu(0));
  TensorPtr b = make<float>({n}, std::vector<float>(n, 2.0F), cpu(1));
  const dp_tensor* inputs[2] = {a.get(), b.get()};
  dp_tensor* sum = nullptr;
  DP_ASSERT_OK(dp_reduce_add(inputs, 2, cpu(0), &sum));
  TensorPtr owned(sum);
  EXPECT_EQ(values<float>(sum)[n - 1], 3.0F);
  const char* fixed = std::getenv("DP_NUM_THREADS");
  if (std::thread::hardware_concurrency() > 1 && (fixed == nullptr || std::string(fixed) != "1")) {
    EXPECT_GE(threads_named("dp-pool"), 1);
  }
  DP_ASSERT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-pool"), 0);
  EXPECT_EQ(threads_named("dp-dev"), 0);
  dp_tensor* again = nullptr;
  DP_ASSERT_OK(dp_reduce_add(inputs, 2, cpu(0), &again));
  TensorPtr owned_again(again);
  EXPECT_EQ(values<float>(again)[0], 3.0F);
}

namespace {
void count_call(void* user_data) { static_cast<std::atomic<int>*>(user_data)->fetch_add(1); }
}  // namespace

TEST(Shutdown, EndsTheThreadOfAnIdleStreamAndItsNextHostFunctionStartsAnother) {
  void* stream = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &stream));
  std::atomic<int> calls{0};
  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), stream, count_call, &calls));
  DP_ASSERT_OK(dp_stream_synchronize(cpu(0), stream));
  EXPECT_GE(threads_named("dp-stream"), 1);  // with DP_CPU_ASYNC=1 the default stream's too

  DP_ASSERT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-stream"), 0);

  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), stream, count_call, &calls));
  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), stream, count_call, &calls));
  DP_ASSERT_OK(dp_stream_synchronize(cpu(0), stream));
  EXPECT_EQ(calls.load(), 3);
  EXPECT_GE(threads_named("dp-stream"), 1);
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), stream));
  DP_EXPECT_OK(dp_shutdown());
  EXPECT_EQ(threads_named("dp-stream"), 0);
}
