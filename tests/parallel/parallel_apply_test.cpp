#include "parallel/parallel_apply.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "core/device_worker.h"
#include "core/error.h"
#include "module/module_test_util.h"

using namespace dptest;

namespace {

struct Seen {
  std::mutex mutex;
  std::vector<std::thread::id> threads = std::vector<std::thread::id>(4);
  std::vector<bool> device_was_current = std::vector<bool>(4, false);
  std::vector<bool> saw_the_other_running = std::vector<bool>(4, false);
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
};

// Records where it runs, waits (bounded) until every replica has started, and
// returns its input times two.
int doubling(void* user_data, size_t index, dp_module*, dp_tensor* input, dp_device device, dp_tensor** output) {
  auto* seen = static_cast<Seen*>(user_data);
  dparallel::Device current = dparallel::current_device();
  {
    std::lock_guard<std::mutex> lock(seen->mutex);
    seen->threads[index] = std::this_thread::get_id();
    seen->device_was_current[index] =
        static_cast<int32_t>(current.type) == device.type && current.index == device.index;
  }
  seen->started++;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (seen->started.load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  {
    std::lock_guard<std::mutex> lock(seen->mutex);
    seen->saw_the_other_running[index] = seen->started.load() >= 2;
  }
  std::vector<float> v = values<float>(input);
  for (float& x : v) x *= 2;
  dp_tensor* out = nullptr;
  int64_t n = static_cast<int64_t>(v.size());
  if (dp_tensor_create(&out, DP_FLOAT32, 1, &n, device) != DP_OK) return 1;
  dp_tensor_copy_from_host(out, v.data(), v.size() * sizeof(float));
  *output = out;
  seen->finished++;
  return 0;
}

std::atomic<int> g_released{0};
void count_release(void*) { g_released++; }

// Replica 0 succeeds with a tracked output; replicas 1 and 2 fail with 7 and 9
// (replica 2 after leaving a last error on its thread).
int fail_from(size_t first_failing, void* user_data, size_t index, dp_device device, dp_tensor** output) {
  static_cast<std::atomic<int>*>(user_data)->fetch_add(1);
  if (index == 1 && first_failing <= 1) return 7;
  if (index == 2) {
    dp_tensor* t = nullptr;
    dp_module_get_parameter(nullptr, "x", &t);
    return 9;
  }
  static float storage[2] = {1, 2};
  int64_t n = 2;
  return dp_tensor_from_blob(output, storage, DP_FLOAT32, 1, &n, device, count_release, nullptr) == DP_OK ? 0 : 1;
}

int fails_on_one_and_two(void* user_data, size_t index, dp_module*, dp_tensor*, dp_device device, dp_tensor** output) {
  return fail_from(1, user_data, index, device, output);
}

int fails_on_two(void* user_data, size_t index, dp_module*, dp_tensor*, dp_device device, dp_tensor** output) {
  return fail_from(2, user_data, index, device, output);
}

int no_output(void*, size_t, dp_module*, dp_tensor*, dp_device, dp_tensor**) { return 0; }

int nested(void* user_data, size_t, dp_module* replica, dp_tensor* input, dp_device device, dp_tensor** output) {
  dp_module* replicas[] = {replica};
  dp_tensor* inputs[] = {input};
  dp_tensor* out[1] = {};
  *static_cast<dp_status*>(user_data) = dp_parallel_apply(replicas, inputs, &device, 1, no_output, nullptr, out);
  return dp_tensor_to_device(output, input, device);
}

struct Fixture {
  std::vector<ModulePtr> replicas;
  std::vector<TensorPtr> inputs;
  std::vector<dp_module*> replica_ptrs;
  std::vector<dp_tensor*> input_ptrs;
  explicit Fixture(const std::vector<dp_device>& devices) {
    for (size_t i = 0; i < devices.size(); ++i) {
      replicas.push_back(linear(1, 1, 0.0f, devices[i]));
      inputs.push_back(make<float>({2}, {float(i), float(i) + 0.5f}, devices[i]));
      replica_ptrs.push_back(replicas.back().get());
      input_ptrs.push_back(inputs.back().get());
    }
  }
};

}  // namespace

TEST(ParallelApply, EveryReplicaRunsConcurrentlyOnItsPersistentDeviceWorker) {
  std::vector<dp_device> devices = {cpu(1), cpu(2)};
  Fixture f(devices);
  std::vector<std::thread::id> first;
  for (int round = 0; round < 2; ++round) {
    Seen seen;
    dp_tensor* out[2] = {};
    DP_ASSERT_OK(
        dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 2, doubling, &seen, out));
    TensorPtr a(out[0]), b(out[1]);
    EXPECT_EQ(values<float>(out[0]), (std::vector<float>{0, 1}));
    EXPECT_EQ(values<float>(out[1]), (std::vector<float>{2, 3}));
    EXPECT_TRUE(same_device(dp_tensor_device(out[1]), cpu(2)));
    EXPECT_TRUE(seen.device_was_current[0] && seen.device_was_current[1]);
    EXPECT_TRUE(seen.saw_the_other_running[0] && seen.saw_the_other_running[1]);  // they overlapped
    EXPECT_EQ(seen.finished.load(), 2);
    EXPECT_NE(seen.threads[0], std::this_thread::get_id());
    EXPECT_NE(seen.threads[0], seen.threads[1]);
    std::vector<std::thread::id> threads = {seen.threads[0], seen.threads[1]};
    if (round == 0) first = threads;
    EXPECT_EQ(first, threads);  // the same workers every call
  }
}

TEST(ParallelApply, NullDevicesMeansEachInputsDevice) {
  std::vector<dp_device> devices = {cpu(3), cpu(0)};
  Fixture f(devices);
  Seen seen;
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), nullptr, 2, doubling, &seen, out));
  EXPECT_TRUE(same_device(dp_tensor_device(out[0]), cpu(3)));
  EXPECT_TRUE(seen.device_was_current[0] && seen.device_was_current[1]);
  for (dp_tensor* t : out) dp_tensor_destroy(t);
}

TEST(ParallelApply, FirstFailureInReplicaOrderAfterAllRanAndOtherOutputsReleased) {
  std::vector<dp_device> devices = {cpu(1), cpu(2), cpu(3)};
  Fixture f(devices);
  std::atomic<int> calls{0};
  g_released = 0;
  dp_tensor* out[3] = {reinterpret_cast<dp_tensor*>(1), reinterpret_cast<dp_tensor*>(1),
                       reinterpret_cast<dp_tensor*>(1)};
  EXPECT_EQ(dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 3, fails_on_one_and_two,
                              &calls, out),
            DP_EUSER);
  EXPECT_TRUE(contains(last_error(), "replica 1: the callback returned 7")) << last_error();
  EXPECT_EQ(calls.load(), 3);
  EXPECT_EQ(g_released.load(), 1);  // replica 0's output
  for (dp_tensor* t : out) EXPECT_EQ(t, nullptr);
}

TEST(ParallelApply, FailureMessageCarriesTheCallbacksLastError) {
  std::vector<dp_device> devices = {cpu(1), cpu(2), cpu(3)};
  Fixture f(devices);
  std::atomic<int> calls{0};
  dp_module* replicas[] = {f.replica_ptrs[0], f.replica_ptrs[1], f.replica_ptrs[2]};
  dp_tensor* inputs[] = {f.input_ptrs[0], f.input_ptrs[1], f.input_ptrs[2]};
  dp_tensor* out[3] = {};
  // Replica 1 passes here, so replica 2's failure is the first.
  EXPECT_EQ(dp_parallel_apply(replicas, inputs, devices.data(), 3, fails_on_two, &calls, out), DP_EUSER);
  EXPECT_TRUE(contains(last_error(), "replica 2: the callback returned 9 (its last error: ")) << last_error();
  EXPECT_TRUE(contains(last_error(), "'module' is NULL")) << last_error();
  for (dp_tensor* t : out) EXPECT_EQ(t, nullptr);
}

TEST(ParallelApply, MissingOutputIsAUserError) {
  std::vector<dp_device> devices = {cpu(1)};
  Fixture f(devices);
  dp_tensor* out[1] = {};
  EXPECT_EQ(dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 1, no_output, nullptr, out),
            DP_EUSER);
  EXPECT_TRUE(contains(last_error(), "replica 0: the callback returned 0 but stored no output")) << last_error();
}

TEST(ParallelApply, MismatchedCountsAreInvalid) {
  auto replica = std::make_shared<dparallel::Module>();
  std::vector<std::shared_ptr<dparallel::Module>> replicas(3, replica);
  std::vector<dparallel::Tensor> inputs(2, dparallel::Tensor::zeros(dparallel::DType::kFloat32, {1}, {}));
  auto fn = [](size_t, const std::shared_ptr<dparallel::Module>&, const dparallel::Tensor& x,
               const dparallel::Device&) { return x; };
  try {
    dparallel::parallel_apply(replicas, inputs, {}, fn);
    FAIL() << "no error";
  } catch (const dparallel::Error& e) {
    EXPECT_EQ(e.code(), dparallel::StatusCode::kInvalidArgument);
    EXPECT_STREQ(e.what(), "3 replicas but 2 inputs");
  }
  std::vector<dparallel::Device> two_devices(2);
  std::vector<dparallel::Tensor> three_inputs(3, inputs[0]);
  EXPECT_THROW(dparallel::parallel_apply(replicas, three_inputs, two_devices, fn), dparallel::Error);
}

TEST(ParallelApply, CallingItFromACallbackIsAStateError) {
  std::vector<dp_device> devices = {cpu(1)};
  Fixture f(devices);
  dp_status inner = DP_OK;
  dp_tensor* out[1] = {};
  DP_ASSERT_OK(dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 1, nested, &inner, out));
  dp_tensor_destroy(out[0]);
  EXPECT_EQ(inner, DP_ESTATE);
}

TEST(ParallelApply, ArgumentsAreChecked) {
  std::vector<dp_device> devices = {cpu(1), cpu(2)};
  Fixture f(devices);
  dp_tensor* out[2] = {};
  EXPECT_EQ(dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 2, nullptr, nullptr, out),
            DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'fn' is NULL")) << last_error();
  EXPECT_EQ(
      dp_parallel_apply(f.replica_ptrs.data(), f.input_ptrs.data(), devices.data(), 2, no_output, nullptr, nullptr),
      DP_EINVAL);
  dp_tensor* inputs[] = {f.input_ptrs[0], nullptr};
  EXPECT_EQ(dp_parallel_apply(f.replica_ptrs.data(), inputs, devices.data(), 2, no_output, nullptr, out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'inputs[1]' is NULL")) << last_error();
  DP_EXPECT_OK(dp_parallel_apply(nullptr, nullptr, nullptr, 0, no_output, nullptr, nullptr));
}

// Before, the worker's failure to make the device current was dropped: the
// call returned an empty output for a replica that never ran.
TEST(ParallelApply, ADeviceThatCannotBeMadeCurrentFailsItsReplica) {
  std::vector<std::shared_ptr<dparallel::Module>> replicas(1, std::make_shared<dparallel::Module>());
  std::vector<dparallel::Tensor> inputs(1, dparallel::Tensor::zeros(dparallel::DType::kFloat32, {1}, {}));
  std::vector<dparallel::Device> absent = {dparallel::Device{dparallel::DeviceType::kCuda, 9999}};
  std::atomic<int> calls{0};
  auto fn = [&](size_t, const std::shared_ptr<dparallel::Module>&, const dparallel::Tensor& x,
                const dparallel::Device&) {
    calls++;
    return x;
  };
  try {
    dparallel::parallel_apply(replicas, inputs, absent, fn);
    FAIL() << "no error";
  } catch (const dparallel::Error& e) {
    EXPECT_EQ(e.code(), dparallel::StatusCode::kDevice);
    EXPECT_TRUE(contains(e.what(), "replica 0: ")) << e.what();
  }
  EXPECT_EQ(calls.load(), 0);
}
