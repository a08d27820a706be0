#include <atomic>
#include <thread>

#include "test_util.h"

using namespace dptest;

TEST(Broadcast, CopiesToOtherDevicesAndSharesOnTheSourceDevice) {
  auto t = make<float>({2, 3}, iota<float>(6), cpu(0));
  dp_device devices[] = {cpu(0), cpu(1), cpu(2)};
  dp_tensor* out[3] = {};
  DP_ASSERT_OK(dp_broadcast(t.get(), devices, 3, out));
  TensorPtr a(out[0]), b(out[1]), c(out[2]);
  EXPECT_EQ(dp_tensor_data(out[0]), dp_tensor_data(t.get()));
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(same_device(dp_tensor_device(out[i]), devices[i]));
    EXPECT_EQ(shape(out[i]), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(values<float>(out[i]), iota<float>(6));
  }
  EXPECT_NE(dp_tensor_data(out[1]), dp_tensor_data(out[2]));
}

TEST(Broadcast, LargeTensorIsCopiedExactly) {
  auto t = make<int64_t>({3 << 18}, iota<int64_t>(3 << 18, -5), cpu(1));
  dp_device devices[] = {cpu(1), cpu(2), cpu(3), cpu(4)};
  dp_tensor* out[4] = {};
  DP_ASSERT_OK(dp_broadcast(t.get(), devices, 4, out));
  for (auto* o : out) {
    EXPECT_EQ(values<int64_t>(o), iota<int64_t>(3 << 18, -5));
    dp_tensor_destroy(o);
  }
}

TEST(Broadcast, RejectsNoDevicesNullOutAndAbsentDevices) {
  auto t = make<float>({2}, {1, 2});
  dp_tensor* out[2] = {};
  dp_device devices[] = {cpu(0), cpu(70)};
  EXPECT_EQ(dp_broadcast(t.get(), devices, 0, out), DP_EINVAL);
  EXPECT_NE(last_error().find("'ndevices' is 0"), std::string::npos) << last_error();
  EXPECT_EQ(dp_broadcast(t.get(), devices, 2, nullptr), DP_EINVAL);
  EXPECT_EQ(dp_broadcast(t.get(), devices, 2, out), DP_EINVAL);
  EXPECT_NE(last_error().find("devices[1]"), std::string::npos) << last_error();
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(dp_broadcast(nullptr, devices, 1, out), DP_EINVAL);
  EXPECT_EQ(dp_broadcast(t.get(), nullptr, 1, out), DP_EINVAL);
}

// torch test_broadcast_coalesced: mixed dtypes, a buffer smaller than a tensor.
TEST(BroadcastCoalesced, MixedDtypesWithTinyBufferEqualPerTensorBroadcast) {
  std::vector<TensorPtr> owned;
  owned.push_back(make<int64_t>({5}, iota<int64_t>(5, 1)));
  owned.push_back(make<float>({5}, iota<float>(5, 0.5f)));
  owned.push_back(make<int64_t>({5}, iota<int64_t>(5, 10)));
  owned.push_back(make<int64_t>({5}, iota<int64_t>(5, 100)));
  owned.push_back(make<int32_t>({10}, iota<int32_t>(10, -3)));
  owned.push_back(make<float>({5}, iota<float>(5, 7.25f)));
  std::vector<const dp_tensor*> tensors;
  for (auto& t : owned) tensors.push_back(t.get());
  dp_device devices[] = {cpu(0), cpu(1), cpu(2)};
  std::vector<dp_tensor*> out(3 * tensors.size());
  DP_ASSERT_OK(dp_broadcast_coalesced(tensors.data(), tensors.size(), devices, 3, 100, out.data()));
  for (size_t d = 0; d < 3; ++d) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      dp_tensor* got = out[d * tensors.size() + t];
      dp_tensor* expected[3] = {};
      DP_ASSERT_OK(dp_broadcast(tensors[t], devices, 3, expected));
      ASSERT_EQ(dp_tensor_dtype(got), dp_tensor_dtype(tensors[t]));
      EXPECT_TRUE(same_device(dp_tensor_device(got), devices[d]));
      ASSERT_EQ(dp_tensor_nbytes(got), dp_tensor_nbytes(expected[d]));
      std::vector<uint8_t> a(dp_tensor_nbytes(got)), b(a.size());
      DP_ASSERT_OK(dp_tensor_copy_to_host(got, a.data(), a.size()));
      DP_ASSERT_OK(dp_tensor_copy_to_host(expected[d], b.data(), b.size()));
      EXPECT_EQ(a, b) << "device " << d << " tensor " << t;
      for (auto* e : expected) dp_tensor_destroy(e);
    }
  }
  // Device 0's outputs are the inputs themselves.
  for (size_t t = 0; t < tensors.size(); ++t) EXPECT_EQ(dp_tensor_data(out[t]), dp_tensor_data(tensors[t]));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(BroadcastCoalesced, InputsMustBeOnTheFirstDevice) {
  auto a = make<float>({2}, {1, 2}, cpu(0));
  auto b = make<float>({2}, {3, 4}, cpu(1));
  const dp_tensor* tensors[] = {a.get(), b.get()};
  dp_device devices[] = {cpu(0), cpu(2)};
  dp_tensor* out[4] = {};
  EXPECT_EQ(dp_broadcast_coalesced(tensors, 2, devices, 2, 0, out), DP_EINVAL);
  EXPECT_NE(last_error().find("tensors[1] is on cpu:1"), std::string::npos) << last_error();
  for (auto* o : out) EXPECT_EQ(o, nullptr);
}

TEST(BroadcastCoalesced, OutputsOfOneChunkShareAFlatBuffer) {
  auto a = make<float>({3}, {1, 2, 3});
  auto b = make<float>({2}, {4, 5});
  const dp_tensor* tensors[] = {a.get(), b.get()};
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[4] = {};
  DP_ASSERT_OK(dp_broadcast_coalesced(tensors, 2, devices, 2, DP_DEFAULT_BUFFER_SIZE, out));
  EXPECT_EQ(static_cast<char*>(dp_tensor_data(out[3])), static_cast<char*>(dp_tensor_data(out[2])) + 12);
  EXPECT_EQ(values<float>(out[3]), (std::vector<float>{4, 5}));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(BroadcastCoalesced, HalfTensorsLargerThanTheBufferTravelAloneAndArrive) {
  const int64_t dims[] = {3000};
  std::vector<uint16_t> bits(3000);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(0x3c00 + (i % 1000));
  dp_tensor* big = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&big, DP_FLOAT16, 1, dims, cpu(0)));
  TensorPtr owner(big);
  DP_ASSERT_OK(dp_tensor_copy_from_host(big, bits.data(), bits.size() * 2));
  auto small = make<float>({4}, {1, 2, 3, 4});
  const dp_tensor* tensors[] = {small.get(), big, small.get()};
  dp_device devices[] = {cpu(0), cpu(5)};
  dp_tensor* out[6] = {};
  DP_ASSERT_OK(dp_broadcast_coalesced(tensors, 3, devices, 2, 1024, out));
  std::vector<uint16_t> got(3000);
  DP_ASSERT_OK(dp_tensor_copy_to_host(out[4], got.data(), got.size() * 2));
  EXPECT_EQ(got, bits);
  EXPECT_EQ(values<float>(out[5]), (std::vector<float>{1, 2, 3, 4}));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(BroadcastCoalesced, RejectsNoDevicesAndNullTensors) {
  auto a = make<float>({2}, {1, 2});
  const dp_tensor* tensors[] = {a.get(), nullptr};
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[4] = {};
  EXPECT_EQ(dp_broadcast_coalesced(tensors, 1, devices, 0, 0, out), DP_EINVAL);
  EXPECT_NE(last_error().find("'ndevices' is 0"), std::string::npos) << last_error();
  EXPECT_EQ(dp_broadcast_coalesced(tensors, 2, devices, 2, 0, out), DP_EINVAL);
  EXPECT_NE(last_error().find("'tensors[1]' is NULL"), std::string::npos) << last_error();
  EXPECT_EQ(dp_broadcast_coalesced(tensors, 1, devices, 2, 0, nullptr), DP_EINVAL);
}

TEST(Broadcast, ConcurrentCallersFromManyThreadsGetTheirOwnResults) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &failures] {
      auto src = make<int32_t>({1 << 16}, iota<int32_t>(1 << 16, t * 1000), cpu(t));
      dp_device devices[] = {cpu(t), cpu(t + 4)};
      for (int round = 0; round < 20; ++round) {
        dp_tensor* out[2] = {};
        if (dp_broadcast(src.get(), devices, 2, out) != DP_OK) failures++;
        if (values<int32_t>(out[1]) != iota<int32_t>(1 << 16, t * 1000)) failures++;
        for (auto* o : out) dp_tensor_destroy(o);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}
