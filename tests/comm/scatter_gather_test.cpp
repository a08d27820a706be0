#include <limits>

#include "test_util.h"

using namespace dptest;

// torch test_scatter with chunk_sizes=(2, 4) on a 6x4 tensor.
TEST(Scatter, ExplicitChunkSizesAlongDimZero) {
  auto t = make<float>({6, 4}, iota<float>(24), cpu(0));
  dp_device devices[] = {cpu(0), cpu(1)};
  const int64_t sizes[] = {2, 4};
  dp_tensor* out[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, sizes, 0, out, &count));
  ASSERT_EQ(count, 2u);
  TensorPtr a(out[0]), b(out[1]);
  EXPECT_EQ(shape(out[0]), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(shape(out[1]), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(values<float>(out[0]), iota<float>(8));
  EXPECT_EQ(values<float>(out[1]), iota<float>(16, 8.0f));
  EXPECT_EQ(dp_tensor_data(out[0]), dp_tensor_data(t.get()));  // a view on its own device
  EXPECT_TRUE(same_device(dp_tensor_device(out[1]), cpu(1)));
}

// torch test_scatter with dim=-2 on a 4x4 tensor.
TEST(Scatter, NegativeDimWraps) {
  auto t = make<int32_t>({4, 4}, iota<int32_t>(16), cpu(0));
  dp_device devices[] = {cpu(1), cpu(2)};
  dp_tensor* out[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, nullptr, -2, out, &count));
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(values<int32_t>(out[0]), iota<int32_t>(8));
  EXPECT_EQ(values<int32_t>(out[1]), iota<int32_t>(8, 8));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(Scatter, AlongAnInnerDimCopiesColumns) {
  auto t = make<int32_t>({2, 5}, iota<int32_t>(10), cpu(0));
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, nullptr, 1, out, &count));
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(shape(out[0]), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(values<int32_t>(out[0]), (std::vector<int32_t>{0, 1, 2, 5, 6, 7}));
  EXPECT_EQ(values<int32_t>(out[1]), (std::vector<int32_t>{3, 4, 8, 9}));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(Scatter, EvenChunksCanBeFewerThanDevices) {
  auto t = make<float>({2, 3}, iota<float>(6));
  dp_device devices[] = {cpu(0), cpu(1), cpu(2), cpu(3)};
  dp_tensor* out[4] = {};
  size_t count = 99;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 4, nullptr, 0, out, &count));
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(out[2], nullptr);
  EXPECT_EQ(out[3], nullptr);
  // 5 rows over 3 devices: ceil(5/3) = 2 -> 2, 2, 1.
  auto five = make<float>({5}, iota<float>(5));
  dp_tensor* parts[3] = {};
  DP_ASSERT_OK(dp_scatter(five.get(), devices, 3, nullptr, 0, parts, &count));
  EXPECT_EQ(count, 3u);
  EXPECT_EQ(dp_tensor_numel(parts[2]), 1);
  for (auto* o : out) dp_tensor_destroy(o);
  for (auto* p : parts) dp_tensor_destroy(p);
}

TEST(Scatter, ChunkSizesMustSumToTheDimension) {
  auto t = make<float>({6, 4}, {});
  dp_device devices[] = {cpu(0), cpu(1)};
  const int64_t short_sizes[] = {2, 3};
  const int64_t zero_sizes[] = {0, 6};
  dp_tensor* out[2] = {};
  size_t count = 0;
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, short_sizes, 0, out, &count), DP_EINVAL);
  EXPECT_NE(last_error().find("chunk sizes must sum to the size of dimension 0 (6), but sum(chunk_sizes) is 5"),
            std::string::npos)
      << last_error();
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, zero_sizes, 0, out, &count), DP_EINVAL);
  EXPECT_NE(last_error().find("'chunk_sizes[0]' is 0"), std::string::npos) << last_error();
  EXPECT_EQ(out[0], nullptr);
}

TEST(Scatter, DimOutOfRangeAndNoDevices) {
  auto t = make<float>({6, 4}, {});
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[2] = {};
  size_t count = 0;
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, nullptr, 2, out, &count), DP_EINVAL);
  EXPECT_NE(last_error().find("'dim' is 2, out of range for a tensor of 2 dimensions (expected -2..1)"),
            std::string::npos)
      << last_error();
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, nullptr, -3, out, &count), DP_EINVAL);
  EXPECT_EQ(dp_scatter(t.get(), devices, 0, nullptr, 0, out, &count), DP_EINVAL);
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, nullptr, 0, out, nullptr), DP_EINVAL);
}

// torch test_gather: two 2x5 inputs on dim 1 give 2x10, input 0 in columns 0..4.
TEST(Gather, AlongDimOnePutsTheFirstInputInTheLeadingColumns) {
  auto a = make<float>({2, 5}, iota<float>(10), cpu(0));
  auto b = make<float>({2, 5}, iota<float>(10, 100.0f), cpu(1));
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_gather(inputs, 2, 1, cpu(2), &out));
  TensorPtr owner(out);
  EXPECT_EQ(shape(out), (std::vector<int64_t>{2, 10}));
  EXPECT_TRUE(same_device(dp_tensor_device(out), cpu(2)));
  std::vector<float> got = values<float>(out);
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 5; ++c) {
      EXPECT_EQ(got[r * 10 + c], static_cast<float>(r * 5 + c));
      EXPECT_EQ(got[r * 10 + 5 + c], static_cast<float>(100 + r * 5 + c));
    }
  }
}

TEST(Gather, DimZeroConcatenatesUnevenRows) {
  auto a = make<int64_t>({1, 2}, {1, 2}, cpu(0));
  auto b = make<int64_t>({3, 2}, {3, 4, 5, 6, 7, 8}, cpu(1));
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_gather(inputs, 2, -2, cpu(0), &out));
  EXPECT_EQ(values<int64_t>(out), iota<int64_t>(8, 1));
  dp_tensor_destroy(out);
}

TEST(Gather, ShapesMustMatchOutsideDim) {
  auto a = make<float>({2, 5}, {});
  auto b = make<float>({3, 5}, {});
  const dp_tensor* inputs[] = {a.get(), b.get()};
  dp_tensor* out = nullptr;
  EXPECT_EQ(dp_gather(inputs, 2, 1, cpu(0), &out), DP_EINVAL);
  EXPECT_NE(last_error().find("input 1 has invalid shape 3x5"), std::string::npos) << last_error();
  EXPECT_EQ(dp_gather(inputs, 0, 1, cpu(0), &out), DP_EINVAL);
  EXPECT_EQ(dp_gather(inputs, 2, 5, cpu(0), &out), DP_EINVAL);
  EXPECT_EQ(out, nullptr);
}

TEST(ScatterGather, RoundTripRestoresTheTensorOnEveryDim) {
  auto t = make<int32_t>({3, 4, 5}, iota<int32_t>(60));
  dp_device devices[] = {cpu(0), cpu(1), cpu(2)};
  for (int dim = -3; dim < 3; ++dim) {
    dp_tensor* chunks[3] = {};
    size_t count = 0;
    DP_ASSERT_OK(dp_scatter(t.get(), devices, 3, nullptr, dim, chunks, &count));
    dp_tensor* back = nullptr;
    DP_ASSERT_OK(dp_gather(chunks, count, dim, cpu(0), &back));
    EXPECT_EQ(values<int32_t>(back), iota<int32_t>(60)) << "dim " << dim;
    dp_tensor_destroy(back);
    for (auto* c : chunks) dp_tensor_destroy(c);
  }
}

namespace {
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// A zero-byte float32 tensor of `dims` on cpu:0.
TensorPtr empty_tensor(const std::vector<int64_t>& dims) {
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, static_cast<int32_t>(dims.size()), dims.data(), cpu(0)), DP_OK)
      << dp_last_error();
  return TensorPtr(t);
}
}  // namespace

TEST(Gather, ExtentsThatSumPastInt64AreRefusedNotWrapped) {
  // 4 x 2^62 rows would wrap to 0 rows.
  std::vector<TensorPtr> owned;
  std::vector<const dp_tensor*> inputs;
  for (int i = 0; i < 4; ++i) {
    owned.push_back(empty_tensor({int64_t{1} << 62, 0}));
    inputs.push_back(owned.back().get());
  }
  dp_tensor* out = nullptr;
  EXPECT_EQ(dp_gather(inputs.data(), 4, 0, cpu(0), &out), DP_EINVAL);
  EXPECT_NE(last_error().find("sum to more than int64 holds"), std::string::npos) << last_error();
  EXPECT_EQ(out, nullptr);
  // Along the zero dim the same inputs gather to 2^62 x 0.
  DP_ASSERT_OK(dp_gather(inputs.data(), 4, 1, cpu(1), &out));
  EXPECT_EQ(shape(out), (std::vector<int64_t>{int64_t{1} << 62, 0}));
  dp_tensor_destroy(out);
}

TEST(Gather, ZeroByteInputsGiveTheSummedShape) {
  TensorPtr a = empty_tensor({int64_t{1} << 61, 0}), b = empty_tensor({int64_t{1} << 61, 0}),
            c = empty_tensor({int64_t{1} << 61, 0});
  const dp_tensor* inputs[] = {a.get(), b.get(), c.get()};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_gather(inputs, 3, 0, cpu(0), &out));
  EXPECT_EQ(shape(out), (std::vector<int64_t>{3 * (int64_t{1} << 61), 0}));
  EXPECT_EQ(dp_tensor_nbytes(out), 0u);
  dp_tensor_destroy(out);
  // Large extents around a zero one: their products overflow, and nothing is copied.
  TensorPtr wide = empty_tensor({int64_t{1} << 40, 0, int64_t{1} << 40});
  const dp_tensor* pair[] = {wide.get(), wide.get()};
  DP_ASSERT_OK(dp_gather(pair, 2, 2, cpu(0), &out));
  EXPECT_EQ(shape(out), (std::vector<int64_t>{int64_t{1} << 40, 0, int64_t{1} << 41}));
  dp_tensor_destroy(out);
}

TEST(Scatter, EvenChunksOfTheLargestExtentDoNotOverflow) {
  // ceil(INT64_MAX / 2) computed as (extent + n - 1) / n overflows.
  TensorPtr t = empty_tensor({kInt64Max, 0});
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, nullptr, 0, out, &count));
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(shape(out[0]), (std::vector<int64_t>{int64_t{1} << 62, 0}));
  EXPECT_EQ(shape(out[1]), (std::vector<int64_t>{(int64_t{1} << 62) - 1, 0}));
  for (auto* o : out) dp_tensor_destroy(o);
}

TEST(Scatter, ZeroByteTensorsScatterAlongAnyDim) {
  TensorPtr t = empty_tensor({int64_t{1} << 40, 6, 0, int64_t{1} << 40});
  dp_device devices[] = {cpu(0), cpu(1)};
  for (int32_t dim = 0; dim < 4; ++dim) {
    dp_tensor* out[2] = {};
    size_t count = 0;
    DP_ASSERT_OK(dp_scatter(t.get(), devices, 2, nullptr, dim, out, &count)) << "dim " << dim;
    std::vector<int64_t> expected = shape(t.get());
    if (dim != 2) expected[static_cast<size_t>(dim)] /= 2;
    EXPECT_EQ(count, 2u);
    EXPECT_EQ(shape(out[0]), expected) << "dim " << dim;
    EXPECT_EQ(shape(out[1]), expected) << "dim " << dim;
    for (auto* o : out) dp_tensor_destroy(o);
  }
}

TEST(Scatter, ChunkSizesThatSumPastInt64AreRefusedNotWrapped) {
  // INT64_MAX * 3 + 2 wraps to INT64_MAX, the extent.
  TensorPtr t = empty_tensor({kInt64Max, 0});
  dp_device devices[] = {cpu(0), cpu(1), cpu(2), cpu(3), cpu(4)};
  const int64_t sizes[] = {kInt64Max, kInt64Max, 1, 1, kInt64Max};
  dp_tensor* out[5] = {};
  size_t count = 77;
  EXPECT_EQ(dp_scatter(t.get(), devices, 5, sizes, 0, out, &count), DP_EINVAL);
  EXPECT_NE(last_error().find("overflows int64"), std::string::npos) << last_error();
  for (auto* o : out) EXPECT_EQ(o, nullptr);
  EXPECT_EQ(count, 77u);
}

TEST(Scatter, FailureLeavesOutCountUntouched) {
  auto t = make<float>({6, 4}, {});
  dp_device devices[] = {cpu(0), cpu(1)};
  const int64_t short_sizes[] = {2, 3};
  dp_tensor* out[2] = {};
  size_t count = 42;
  EXPECT_EQ(dp_scatter(t.get(), devices, 2, short_sizes, 0, out, &count), DP_EINVAL);
  EXPECT_EQ(count, 42u);
  EXPECT_EQ(dp_scatter(nullptr, devices, 2, nullptr, 0, out, &count), DP_EINVAL);
  EXPECT_EQ(count, 42u);
}
