// GPU paths. Compiled always; each test skips cleanly without a GPU.
#include <thread>

#include "test_util.h"

using namespace dptest;

// A macro, since GTEST_SKIP must return from the test body itself.
#define REQUIRE_GPUS(n) \
  if (cuda_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda_count()

TEST(CudaTensor, CreateIsZeroAndCopiesRoundTrip) {
  REQUIRE_GPUS(1);
  auto t = make<float>({1000}, iota<float>(1000), cuda(0));
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(same_device(dp_tensor_device(t.get()), cuda(0)));
  EXPECT_EQ(values<float>(t.get()), iota<float>(1000));
  auto z = make<double>({17}, {}, cuda(0));
  for (double v : values<double>(z.get())) EXPECT_EQ(v, 0.0);
}

TEST(CudaComm, BroadcastFromHostToGpuAndBack) {
  REQUIRE_GPUS(1);
  auto t = make<int32_t>({5}, {1, 2, 3, 4, 5}, cpu(0));
  dp_device devices[] = {cpu(0), cuda(0)};
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_broadcast(t.get(), devices, 2, out));
  TensorPtr a(out[0]), b(out[1]);
  EXPECT_EQ(values<int32_t>(b.get()), (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

TEST(CudaComm, ReduceAddOnOneGpuUsesTheSumKernel) {
  REQUIRE_GPUS(1);
  auto a = make<float>({4}, {1, 2, 3, 4}, cuda(0));
  auto b = make<float>({4}, {10, 20, 30, 40}, cpu(1));
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_reduce_add(inputs, 2, cuda(0), &out));
  TensorPtr owner(out);
  EXPECT_EQ(values<float>(out), (std::vector<float>{11, 22, 33, 44}));
}

TEST(CudaComm, BroadcastCoalescedAcrossTwoGpusUsesNccl) {
  REQUIRE_GPUS(2);
  auto x = make<float>({3}, {1, 2, 3}, cuda(0));
  auto y = make<int64_t>({2}, {7, 8}, cuda(0));
  const dp_tensor* tensors[] = {x.get(), y.get()};
  dp_device devices[] = {cuda(0), cuda(1)};
  dp_tensor* out[4] = {};
  DP_ASSERT_OK(dp_broadcast_coalesced(tensors, 2, devices, 2, 0, out));
  for (auto* t : out) ASSERT_NE(t, nullptr);
  EXPECT_EQ(values<float>(out[2]), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(values<int64_t>(out[3]), (std::vector<int64_t>{7, 8}));
  for (auto* t : out) dp_tensor_destroy(t);
}

TEST(CudaComm, ReduceAddCoalescedAcrossTwoGpus) {
  REQUIRE_GPUS(2);
  auto a0 = make<float>({2}, {1, 2}, cuda(0));
  auto b0 = make<float>({3}, {3, 4, 5}, cuda(0));
  auto a1 = make<float>({2}, {10, 20}, cuda(1));
  auto b1 = make<float>({3}, {30, 40, 50}, cuda(1));
  const dp_tensor* inputs[] = {a0.get(), b0.get(), a1.get(), b1.get()};
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_reduce_add_coalesced(inputs, 2, 2, cuda(0), 0, out));
  EXPECT_EQ(values<float>(out[0]), (std::vector<float>{11, 22}));
  EXPECT_EQ(values<float>(out[1]), (std::vector<float>{33, 44, 55}));
  for (auto* t : out) dp_tensor_destroy(t);
}

TEST(CudaComm, ScatterAndGatherThroughAGpuOnAnyDim) {
  REQUIRE_GPUS(1);
  auto t = make<int32_t>({2, 4}, iota<int32_t>(8), cpu(0));
  dp_device devices[] = {cuda(0), cpu(1)};
  dp_tensor* chunks[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, nullptr, 1, chunks, &count));
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(values<int32_t>(chunks[0]), (std::vector<int32_t>{0, 1, 4, 5}));
  dp_tensor* back = nullptr;
  DP_ASSERT_OK(dp_gather(chunks, 2, 1, cuda(0), &back));
  EXPECT_EQ(values<int32_t>(back), iota<int32_t>(8));
  dp_tensor_destroy(back);
  for (auto* c : chunks) dp_tensor_destroy(c);
}

// Two threads broadcast through NCCL in opposite device orders (two distinct
// communicator sets over the same GPUs and streams): launches that interleaved
// would queue the kernels in different orders on the two GPUs and deadlock.
TEST(CudaComm, ConcurrentNcclBroadcastsInOppositeOrdersFinishAndAreCorrect) {
  REQUIRE_GPUS(2);
  auto run = [](int first, int second, int32_t base, int* failures) {
    for (int i = 0; i < 100; ++i) {
      auto t = make<int32_t>({4096}, iota<int32_t>(4096, base + i), cuda(first));
      dp_device devices[] = {cuda(first), cuda(second)};
      dp_tensor* out[2] = {};
      if (dp_broadcast(t.get(), devices, 2, out) != DP_OK) {
        ++*failures;
        continue;
      }
      if (values<int32_t>(out[1]) != iota<int32_t>(4096, base + i)) ++*failures;
      dp_tensor_destroy(out[0]);
      dp_tensor_destroy(out[1]);
    }
  };
  int failures_a = 0, failures_b = 0;
  std::thread a(run, 0, 1, 0, &failures_a);
  std::thread b(run, 1, 0, 1000000, &failures_b);
  a.join();
  b.join();
  EXPECT_EQ(failures_a, 0);
  EXPECT_EQ(failures_b, 0);
}
