// The callback contract and replica-set lifecycle: callback
// output ownership, one device per replica, gather before reduce, scalar
// outputs, nested calls, and replica sets' sync and gradients.
#include <atomic>
#include <chrono>
#include <thread>

#include "module/module_test_util.h"

using namespace dptest;

namespace {

int return_input(void*, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  *output = input;
  return 0;
}

int fail_with_input(void*, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  *output = input;
  return 3;
}

// Both replicas must be running at once; a replica that waits 2 s in vain fails.
int wait_for_peer(void* user_data, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  auto* arrived = static_cast<std::atomic<int>*>(user_data);
  arrived->fetch_add(1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (arrived->load() < 2) {
    if (std::chrono::steady_clock::now() > deadline) return 7;
    std::this_thread::yield();
  }
  *output = input;
  return 0;
}

// Adds 1 into the gradient of "bias", as an autograd engine accumulates.
int accumulate_bias_grad(void*, size_t, dp_module* replica, dp_tensor* input, dp_device, dp_tensor** output) {
  dp_tensor* g = nullptr;
  if (dp_module_grad(replica, "bias", &g) != DP_OK) return 1;
  static_cast<float*>(dp_tensor_data(g))[0] += 1.0f;
  dp_tensor_destroy(g);
  *output = input;
  return 0;
}

// Accumulates like accumulate_bias_grad, then returns outputs that cannot be
// gathered: replica i yields a 1 x (i + 1) tensor.
int accumulate_then_ragged(void*, size_t index, dp_module* replica, dp_tensor* input, dp_device device,
                           dp_tensor** output) {
  dp_tensor* scratch = nullptr;
  if (accumulate_bias_grad(nullptr, index, replica, input, device, &scratch) != 0) return 1;
  int64_t shape[2] = {1, static_cast<int64_t>(index) + 1};
  return dp_tensor_create(output, DP_FLOAT32, 2, shape, device) == DP_OK ? 0 : 2;
}

int scalar_of_index(void*, size_t index, dp_module*, dp_tensor*, dp_device device, dp_tensor** output) {
  if (dp_tensor_create(output, DP_FLOAT32, 0, nullptr, device) != DP_OK) return 1;
  static_cast<float*>(dp_tensor_data(*output))[0] = static_cast<float>(index) + 1.0f;
  return 0;
}

struct Nested {
  dp_module* module = nullptr;
  dp_replica_set* set = nullptr;
  dp_tensor* input = nullptr;
  dp_status status = DP_OK;
  std::string error;
};

int nested_single_device_data_parallel(void* user_data, size_t, dp_module*, dp_tensor* input, dp_device,
                                       dp_tensor** output) {
  auto* n = static_cast<Nested*>(user_data);
  dp_device device = cpu(0);
  dp_tensor* inner = nullptr;
  n->status = dp_data_parallel(n->module, n->input, &device, 1, cpu(0), 0, return_input, nullptr, &inner);
  n->error = dp_last_error();
  dp_tensor_destroy(inner);
  *output = input;
  return 0;
}

int nested_replica_set_apply(void* user_data, size_t, dp_module*, dp_tensor* input, dp_device, dp_tensor** output) {
  auto* n = static_cast<Nested*>(user_data);
  dp_tensor* inner = nullptr;
  n->status = dp_replica_set_apply(n->set, n->input, 0, cpu(0), return_input, nullptr, &inner);
  n->error = dp_last_error();
  dp_tensor_destroy(inner);
  *output = input;
  return 0;
}

// dp_parallel_apply of fn over one replica on cpu:3.
void run_on_one_replica(dp_forward_fn fn, void* user_data) {
  ModulePtr outer = linear(1, 1, 0.0f, cpu(3));
  auto outer_input = make<float>({1}, {1}, cpu(3));
  dp_module* replicas[] = {outer.get()};
  dp_tensor* inputs[] = {outer_input.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_parallel_apply(replicas, inputs, nullptr, 1, fn, user_data, &out));
  dp_tensor_destroy(out);
}

void set_bias_grads(dp_replica_set* set, float value) {
  for (size_t i = 0; i < dp_replica_set_size(set); ++i) {
    dp_module* r = nullptr;
    ASSERT_EQ(dp_replica_set_replica(set, i, &r), DP_OK) << dp_last_error();
    ModulePtr held(r);
    DP_ASSERT_OK(dp_tensor_copy_from_host(grad(r, "bias").get(), &value, sizeof value));
  }
}

}  // namespace

TEST(CallbackOutput, TheInputHandedBackAsOutputIsTakenOverOnce) {
  auto a = make<float>({2}, {1, 2}, cpu(0));
  auto b = make<float>({2}, {3, 4}, cpu(1));
  ModulePtr r0 = linear(1, 1, 0.0f, cpu(0)), r1 = linear(1, 1, 0.0f, cpu(1));
  dp_module* replicas[] = {r0.get(), r1.get()};
  dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out[2] = {nullptr, nullptr};
  DP_ASSERT_OK(dp_parallel_apply(replicas, inputs, nullptr, 2, return_input, nullptr, out));
  TensorPtr o0(out[0]), o1(out[1]);
  EXPECT_EQ(values<float>(out[0]), (std::vector<float>{1, 2}));
  EXPECT_EQ(values<float>(out[1]), (std::vector<float>{3, 4}));
  EXPECT_EQ(dp_parallel_apply(replicas, inputs, nullptr, 2, fail_with_input, nullptr, out), DP_EUSER);
  EXPECT_TRUE(contains(last_error(), "returned 3")) << last_error();
  EXPECT_EQ(out[0], nullptr);
}

TEST(OneDevicePerReplica, ReplicasThatWaitOnEachOtherRunAtOnce) {
  auto a = make<float>({1}, {1}, cpu(0));
  auto b = make<float>({1}, {2}, cpu(1));
  ModulePtr r0 = linear(1, 1, 0.0f, cpu(0)), r1 = linear(1, 1, 0.0f, cpu(1));
  dp_module* replicas[] = {r0.get(), r1.get()};
  dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out[2] = {nullptr, nullptr};
  std::atomic<int> arrived{0};
  DP_ASSERT_OK(dp_parallel_apply(replicas, inputs, nullptr, 2, wait_for_peer, &arrived, out));
  dp_tensor_destroy(out[0]);
  dp_tensor_destroy(out[1]);
}

TEST(OneDevicePerReplica, RepeatedDevicesAreRefusedNamingBothIndices) {
  auto a = make<float>({1}, {1}, cpu(0));
  auto b = make<float>({1}, {2}, cpu(0));
  ModulePtr r0 = linear(1, 1), r1 = linear(1, 1);
  dp_module* replicas[] = {r0.get(), r1.get()};
  dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out[2] = {nullptr, nullptr};
  std::atomic<int> arrived{0};
  EXPECT_EQ(dp_parallel_apply(replicas, inputs, nullptr, 2, wait_for_peer, &arrived, out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "inputs[0] and inputs[1] are both on cpu:0")) << last_error();
  EXPECT_EQ(arrived.load(), 0);
  dp_device same[] = {cpu(1), cpu(1)};
  EXPECT_EQ(dp_parallel_apply(replicas, inputs, same, 2, wait_for_peer, &arrived, out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "devices[0] and devices[1] are both cpu:1")) << last_error();

  ModulePtr m = linear(1, 1);
  auto x = make<float>({3, 1}, {1, 2, 3});
  dp_device twice[] = {cpu(2), cpu(1), cpu(2)};
  dp_tensor* y = nullptr;
  EXPECT_EQ(dp_data_parallel(m.get(), x.get(), twice, 3, cpu(0), 0, return_input, nullptr, &y), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "devices[0] and devices[2] are both cpu:2")) << last_error();
  dp_replica_set* set = nullptr;
  EXPECT_EQ(dp_replica_set_create(&set, m.get(), twice, 3), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "devices[0] and devices[2] are both cpu:2")) << last_error();
  EXPECT_EQ(set, nullptr);
}

TEST(DataParallelGather, AFailedGatherLeavesTheModulesGradientsAlone) {
  ModulePtr m = linear(1, 1);
  auto x = make<float>({2, 1}, {1, 2});
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* y = nullptr;
  EXPECT_NE(dp_data_parallel(m.get(), x.get(), devices, 2, cpu(0), 0, accumulate_then_ragged, nullptr, &y), DP_OK);
  EXPECT_EQ(y, nullptr);
  EXPECT_EQ(values<float>(grad(m.get(), "bias").get()), (std::vector<float>{0.0f}));
}

TEST(DataParallelGather, ScalarOutputsBecomeOneElementPerReplica) {
  ModulePtr m = linear(1, 1);
  auto x = make<float>({3, 1}, {1, 2, 3});
  std::vector<dp_device> devices = {cpu(0), cpu(1), cpu(2)};
  dp_tensor* y = nullptr;
  DP_ASSERT_OK(dp_data_parallel(m.get(), x.get(), devices.data(), 3, cpu(0), 0, scalar_of_index, nullptr, &y));
  TensorPtr held(y);
  EXPECT_EQ(shape(y), (std::vector<int64_t>{3}));
  EXPECT_EQ(values<float>(y), (std::vector<float>{1, 2, 3}));
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  DP_ASSERT_OK(dp_replica_set_apply(set.get(), x.get(), 0, cpu(0), scalar_of_index, nullptr, &y));
  TensorPtr held_too(y);
  EXPECT_EQ(values<float>(y), (std::vector<float>{1, 2}));
}

TEST(NestedCalls, SingleDeviceDataParallelInsideACallbackIsAStateError) {
  ModulePtr m = linear(1, 1);
  auto x = make<float>({1, 1}, {1});
  Nested n{m.get(), nullptr, x.get()};
  run_on_one_replica(nested_single_device_data_parallel, &n);
  dp_tensor* out = nullptr;
  EXPECT_EQ(n.status, DP_ESTATE) << n.error;
  // The single-device path calls fn on this thread; a nested call there is refused too.
  dp_device device = cpu(0);
  DP_ASSERT_OK(dp_data_parallel(m.get(), x.get(), &device, 1, cpu(0), 0, nested_single_device_data_parallel, &n, &out));
  dp_tensor_destroy(out);
  EXPECT_EQ(n.status, DP_ESTATE) << n.error;
}

TEST(NestedCalls, ARefusedReplicaSetApplyLeavesTheSetUnchanged) {
  ModulePtr m = linear(1, 1);
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1), cpu(2)});
  set_bias_grads(set.get(), 1.0f);
  auto one_row = make<float>({1, 1}, {1});  // would make only replica 0 active
  Nested n{nullptr, set.get(), one_row.get()};
  run_on_one_replica(nested_replica_set_apply, &n);
  EXPECT_EQ(n.status, DP_ESTATE) << n.error;
  DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "bias").get()), (std::vector<float>{3.0f}));  // all three still active
}

TEST(ReplicaSetGradients, EachStepStartsFromFreshReplicaGradients) {
  ModulePtr m = linear(1, 1);
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  auto x = make<float>({2, 1}, {1, 2});
  for (int step = 0; step < 3; ++step) {
    DP_ASSERT_OK(dp_module_zero_grad(m.get()));
    dp_tensor* y = nullptr;
    DP_ASSERT_OK(dp_replica_set_apply(set.get(), x.get(), 0, cpu(0), accumulate_bias_grad, nullptr, &y));
    dp_tensor_destroy(y);
    DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
    EXPECT_EQ(values<float>(grad(m.get(), "bias").get()), (std::vector<float>{2.0f})) << "step " << step;
  }
}

TEST(ReplicaSetSync, DistinctZeroByteBuffersStayDistinctInEveryReplica) {
  ModulePtr m = linear(1, 1);
  auto empty_a = make<float>({0}, {});
  auto empty_b = make<float>({0}, {});
  DP_ASSERT_OK(dp_module_register_buffer(m.get(), "a", empty_a.get(), 1));
  DP_ASSERT_OK(dp_module_register_buffer(m.get(), "b", empty_b.get(), 1));
  auto running = make<float>({1}, {5});
  DP_ASSERT_OK(dp_module_register_buffer(m.get(), "running", running.get(), 1));
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  dp_module* r = nullptr;
  DP_ASSERT_OK(dp_replica_set_replica(set.get(), 1, &r));
  ModulePtr replica(r);
  EXPECT_EQ(dp_module_num_buffers(r), 3u);
  float seven = 7.0f;
  DP_ASSERT_OK(dp_tensor_copy_from_host(running.get(), &seven, sizeof seven));
  DP_ASSERT_OK(dp_replica_set_sync(set.get()));
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_module_get_buffer(r, "running", &t));
  TensorPtr copied(t);
  EXPECT_EQ(values<float>(t), (std::vector<float>{7.0f}));
}

TEST(ReplicaSetSync, ARegistrationIntoAReplicaIsAStateError) {
  ModulePtr m = linear(1, 1);
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  dp_module* r = nullptr;
  DP_ASSERT_OK(dp_replica_set_replica(set.get(), 1, &r));
  ModulePtr replica(r);
  auto extra = make<float>({1}, {9}, cpu(1));
  DP_ASSERT_OK(dp_module_register_buffer(r, "extra", extra.get(), 1));
  EXPECT_EQ(dp_replica_set_sync(set.get()), DP_ESTATE);
  EXPECT_TRUE(contains(last_error(), "replica 1")) << last_error();
  EXPECT_EQ(values<float>(extra.get()), (std::vector<float>{9.0f}));
}

TEST(ReplicaSetSync, UnfreezingAParameterReachesTheReplicas) {
  auto w = make<float>({1}, {1});
  ModulePtr m = new_module();
  DP_ASSERT_OK(dp_module_register_parameter(m.get(), "bias", w.get(), 0));
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  DP_ASSERT_OK(dp_module_set_requires_grad(m.get(), "bias", 1));
  DP_ASSERT_OK(dp_replica_set_sync(set.get()));
  auto x = make<float>({2, 1}, {1, 2});
  dp_tensor* y = nullptr;
  DP_ASSERT_OK(dp_replica_set_apply(set.get(), x.get(), 0, cpu(0), accumulate_bias_grad, nullptr, &y));
  dp_tensor_destroy(y);
  DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "bias").get()), (std::vector<float>{2.0f}));
}
