#include "test_util.h"

using namespace dptest;

TEST(ReduceAdd, SumsInputsFromSeveralDevicesOntoTheDestination) {
  auto a = make<float>({2, 2}, {1, 2, 3, 4}, cpu(0));
  auto b = make<float>({2, 2}, {10, 20, 30, 40}, cpu(1));
  auto c = make<float>({2, 2}, {100, 200, 300, 400}, cpu(2));
  const dp_tensor* inputs[] = {a.get(), b.get(), c.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_reduce_add(inputs, 3, cpu(3), &out));
  TensorPtr owner(out);
  EXPECT_TRUE(same_device(dp_tensor_device(out), cpu(3)));
  EXPECT_EQ(values<float>(out), (std::vector<float>{111, 222, 333, 444}));
}

TEST(ReduceAdd, LargeInt64InputsSumExactly) {
  const size_t n = 1 << 20;
  auto a = make<int64_t>({static_cast<int64_t>(n)}, iota<int64_t>(n, 0), cpu(0));
  auto b = make<int64_t>({static_cast<int64_t>(n)}, iota<int64_t>(n, 1000), cpu(1));
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_reduce_add(inputs, 2, cpu(0), &out));
  std::vector<int64_t> got = values<int64_t>(out);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], static_cast<int64_t>(2 * i + 1000)) << i;
  dp_tensor_destroy(out);
}

TEST(ReduceAdd, ShapeMismatchNamesTheInputAndBothSizes) {
  auto a = make<float>({3, 2}, {});
  auto b = make<float>({2, 3}, {}, cpu(1));
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  EXPECT_EQ(dp_reduce_add(inputs, 2, cpu(0), &out), DP_EINVAL);
  EXPECT_NE(last_error().find("input 1 has invalid size: got 2x3, but expected 3x2"), std::string::npos)
      << last_error();
  EXPECT_EQ(out, nullptr);
}

TEST(ReduceAdd, DtypeMismatchIsAnError) {
  auto a = make<float>({2}, {});
  auto b = make<double>({2}, {});
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  EXPECT_EQ(dp_reduce_add(inputs, 2, cpu(0), &out), DP_EINVAL);
  EXPECT_NE(last_error().find("input 1 has dtype float64, but expected float32"), std::string::npos) << last_error();
}

TEST(ReduceAdd, RejectsNoInputsAndNullEntries) {
  auto a = make<float>({2}, {});
  const dp_tensor* inputs[] = {a.get(), nullptr};
  dp_tensor* out = nullptr;
  EXPECT_EQ(dp_reduce_add(inputs, 0, cpu(0), &out), DP_EINVAL);
  EXPECT_EQ(dp_reduce_add(inputs, 2, cpu(0), &out), DP_EINVAL);
  EXPECT_NE(last_error().find("'inputs[1]' is NULL"), std::string::npos) << last_error();
}

// torch test_reduce_add_coalesced: one list on two devices sums to 2x.
TEST(ReduceAddCoalesced, SameListOnTwoDevicesGivesTwiceEachTensor) {
  std::vector<TensorPtr> owned;
  owned.push_back(make<float>({3, 2}, iota<float>(6, 1.0f)));
  owned.push_back(make<int64_t>({4}, iota<int64_t>(4, -2)));
  owned.push_back(make<float>({5}, iota<float>(5, 0.25f)));
  owned.push_back(make<int32_t>({2, 2}, iota<int32_t>(4, 7)));
  size_t nt = owned.size();
  dp_device devices[] = {cpu(0), cpu(1)};
  std::vector<const dp_tensor*> inputs(2 * nt);
  std::vector<dp_tensor*> copies;
  for (size_t t = 0; t < nt; ++t) {
    dp_tensor* pair[2] = {};
    DP_ASSERT_OK(dp_broadcast(owned[t].get(), devices, 2, pair));
    inputs[t] = pair[0];
    inputs[nt + t] = pair[1];
    copies.push_back(pair[0]);
    copies.push_back(pair[1]);
  }
  std::vector<dp_tensor*> out(nt);
  DP_ASSERT_OK(dp_reduce_add_coalesced(inputs.data(), 2, nt, cpu(0), 24, out.data()));
  EXPECT_EQ(values<float>(out[0]), (std::vector<float>{2, 4, 6, 8, 10, 12}));
  EXPECT_EQ(values<int64_t>(out[1]), (std::vector<int64_t>{-4, -2, 0, 2}));
  EXPECT_EQ(values<float>(out[2]), (std::vector<float>{0.5f, 2.5f, 4.5f, 6.5f, 8.5f}));
  EXPECT_EQ(values<int32_t>(out[3]), (std::vector<int32_t>{14, 16, 18, 20}));
  EXPECT_EQ(shape(out[0]), (std::vector<int64_t>{3, 2}));
  for (auto* o : out) dp_tensor_destroy(o);
  for (auto* c : copies) dp_tensor_destroy(c);
}

TEST(ReduceAddCoalesced, ListsMustMatchListZero) {
  auto a = make<float>({2}, {});
  auto b = make<float>({3}, {});
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out[1] = {};
  EXPECT_EQ(dp_reduce_add_coalesced(inputs, 2, 1, cpu(0), 0, out), DP_EINVAL);
  EXPECT_NE(last_error().find("list 1, tensor 0) has invalid size: got 3, but expected 2"), std::string::npos)
      << last_error();
  EXPECT_EQ(dp_reduce_add_coalesced(inputs, 0, 1, cpu(0), 0, out), DP_EINVAL);
}

TEST(ReduceAdd, HalfAndBfloat16AndBoolFollowTheirSumRules) {
  const int64_t dims[] = {2};
  dp_tensor* h[2] = {};
  dp_tensor* bf[2] = {};
  dp_tensor* bo[2] = {};
  uint16_t one_half = 0x3c00, two_half = 0x4000;  // 1.0, 2.0
  uint16_t one_bf = 0x3f80, two_bf = 0x4000;      // 1.0, 2.0
  uint16_t half_vals[2] = {one_half, two_half}, bf_vals[2] = {one_bf, two_bf};
  uint8_t bool_a[2] = {0, 1}, bool_b[2] = {0, 1};
  for (int i = 0; i < 2; ++i) {
    DP_ASSERT_OK(dp_tensor_create(&h[i], DP_FLOAT16, 1, dims, cpu(i)));
    DP_ASSERT_OK(dp_tensor_copy_from_host(h[i], half_vals, 4));
    DP_ASSERT_OK(dp_tensor_create(&bf[i], DP_BFLOAT16, 1, dims, cpu(i)));
    DP_ASSERT_OK(dp_tensor_copy_from_host(bf[i], bf_vals, 4));
    DP_ASSERT_OK(dp_tensor_create(&bo[i], DP_BOOL, 1, dims, cpu(i)));
    DP_ASSERT_OK(dp_tensor_copy_from_host(bo[i], i == 0 ? bool_a : bool_b, 2));
  }
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_reduce_add(h, 2, cpu(0), &out));
  uint16_t got[2];
  DP_ASSERT_OK(dp_tensor_copy_to_host(out, got, 4));
  EXPECT_EQ(got[0], 0x4000);  // 2.0
  EXPECT_EQ(got[1], 0x4400);  // 4.0
  dp_tensor_destroy(out);
  DP_ASSERT_OK(dp_reduce_add(bf, 2, cpu(0), &out));
  DP_ASSERT_OK(dp_tensor_copy_to_host(out, got, 4));
  EXPECT_EQ(got[0], 0x4000);
  EXPECT_EQ(got[1], 0x4080);
  dp_tensor_destroy(out);
  DP_ASSERT_OK(dp_reduce_add(bo, 2, cpu(0), &out));
  uint8_t b[2];
  DP_ASSERT_OK(dp_tensor_copy_to_host(out, b, 2));
  EXPECT_EQ(b[0], 0);
  EXPECT_EQ(b[1], 1);
  dp_tensor_destroy(out);
  for (int i = 0; i < 2; ++i) {
    dp_tensor_destroy(h[i]);
    dp_tensor_destroy(bf[i]);
    dp_tensor_destroy(bo[i]);
  }
}
