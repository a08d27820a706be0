#include <cstring>

#include "test_util.h"

using namespace dptest;

TEST(TensorCreate, IsZeroFilledWithTheGivenMetadata) {
  const int64_t dims[] = {2, 3, 4};
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&t, DP_FLOAT64, 3, dims, cpu(2)));
  TensorPtr owner(t);
  EXPECT_EQ(dp_tensor_dtype(t), DP_FLOAT64);
  EXPECT_EQ(dp_tensor_ndim(t), 3);
  EXPECT_EQ(shape(t), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(dp_tensor_numel(t), 24);
  EXPECT_EQ(dp_tensor_nbytes(t), 192u);
  EXPECT_TRUE(same_device(dp_tensor_device(t), cpu(2)));
  for (double v : values<double>(t)) EXPECT_EQ(v, 0.0);
}

TEST(TensorCreate, LargeTensorsAreZeroEvenWhenMemoryIsReused) {
  const int64_t dims[] = {1 << 20};
  for (int round = 0; round < 3; ++round) {
    auto t = make<int32_t>({1 << 20}, {});
    for (int32_t v : values<int32_t>(t.get())) ASSERT_EQ(v, 0);
    std::vector<int32_t> ones(1 << 20, 1);
    DP_ASSERT_OK(dp_tensor_copy_from_host(t.get(), ones.data(), ones.size() * 4));
  }
  (void)dims;
}

TEST(TensorCreate, ScalarAndEmptyTensors) {
  dp_tensor* scalar = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&scalar, DP_INT64, 0, nullptr, cpu(0)));
  TensorPtr s(scalar);
  EXPECT_EQ(dp_tensor_numel(scalar), 1);
  EXPECT_EQ(dp_tensor_nbytes(scalar), 8u);
  const int64_t empty_dims[] = {3, 0};
  dp_tensor* empty = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&empty, DP_FLOAT32, 2, empty_dims, cpu(0)));
  TensorPtr e(empty);
  EXPECT_EQ(dp_tensor_numel(empty), 0);
  DP_EXPECT_OK(dp_tensor_copy_to_host(empty, nullptr, 0));
}

TEST(TensorCreate, RejectsBadArgumentsNamingThem) {
  dp_tensor* t = nullptr;
  const int64_t ok[] = {2, 2};
  const int64_t negative[] = {2, -3};
  const int64_t huge[] = {int64_t{1} << 40, int64_t{1} << 40};
  struct Case {
    dp_status status;
    dp_status expected;
    const char* needle;
  } cases[] = {
      {dp_tensor_create(nullptr, DP_FLOAT32, 2, ok, cpu(0)), DP_EINVAL, "'out'"},
      {dp_tensor_create(&t, 42, 2, ok, cpu(0)), DP_EINVAL, "'dtype' is 42"},
      {dp_tensor_create(&t, DP_FLOAT32, -1, ok, cpu(0)), DP_EINVAL, "'ndim' is -1"},
      {dp_tensor_create(&t, DP_FLOAT32, 17, ok, cpu(0)), DP_EINVAL, "'ndim' is 17"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, nullptr, cpu(0)), DP_EINVAL, "'shape' is NULL"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, negative, cpu(0)), DP_EINVAL, "'shape[1]' is -3"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, huge, cpu(0)), DP_EINVAL, "int64"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, ok, dp_device{9, 0}), DP_EINVAL, "device type 9"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, ok, cpu(-1)), DP_EINVAL, "index -1"},
      {dp_tensor_create(&t, DP_FLOAT32, 2, ok, cpu(64)), DP_EINVAL, "cpu:64"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status, c.expected);
    EXPECT_EQ(t, nullptr);
  }
  // Messages are checked one at a time, since each call overwrites the last.
  EXPECT_EQ(dp_tensor_create(&t, 42, 2, ok, cpu(0)), DP_EINVAL);
  EXPECT_NE(last_error().find("'dtype' is 42"), std::string::npos) << last_error();
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 2, negative, cpu(0)), DP_EINVAL);
  EXPECT_NE(last_error().find("'shape[1]' is -3"), std::string::npos) << last_error();
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 2, ok, cpu(64)), DP_EINVAL);
  EXPECT_NE(last_error().find("cpu:64"), std::string::npos) << last_error();
}

TEST(TensorCreate, AbsentGpuIsDeviceErrorNotACrash) {
  if (cuda_count() > 0) GTEST_SKIP() << "a GPU is present";
  dp_tensor* t = nullptr;
  const int64_t dims[] = {4};
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 1, dims, cuda(0)), DP_EDEVICE);
  EXPECT_EQ(t, nullptr);
  EXPECT_NE(last_error().find("cuda:0"), std::string::npos) << last_error();
}

namespace {
struct DeleterProbe {
  int calls = 0;
};
void count_delete(void* ctx) { static_cast<DeleterProbe*>(ctx)->calls++; }
}  // namespace

TEST(TensorFromBlob, UsesCallerMemoryInPlaceAndCallsDeleterOnceAtLastRelease) {
  std::vector<float> host{1, 2, 3, 4, 5, 6};
  DeleterProbe probe;
  const int64_t dims[] = {2, 3};
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_blob(&t, host.data(), DP_FLOAT32, 2, dims, cpu(0), count_delete, &probe));
  EXPECT_EQ(dp_tensor_data(t), host.data());
  host[4] = 50;
  EXPECT_EQ(values<float>(t)[4], 50.0f);
  // A same-device broadcast output shares the memory: the deleter waits for both.
  dp_tensor* copies[1] = {nullptr};
  dp_device dev = cpu(0);
  DP_ASSERT_OK(dp_broadcast(t, &dev, 1, copies));
  dp_tensor_destroy(t);
  EXPECT_EQ(probe.calls, 0);
  dp_tensor_destroy(copies[0]);
  EXPECT_EQ(probe.calls, 1);
}

TEST(TensorFromBlob, NullDeleterLeavesOwnershipWithTheCaller) {
  std::vector<int32_t> host{7, 8};
  const int64_t dims[] = {2};
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_blob(&t, host.data(), DP_INT32, 1, dims, cpu(1), nullptr, nullptr));
  EXPECT_EQ(values<int32_t>(t), host);
  dp_tensor_destroy(t);
  EXPECT_EQ(host[1], 8);
}

TEST(TensorFromBlob, FailureDoesNotCallTheDeleter) {
  DeleterProbe probe;
  const int64_t dims[] = {2};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_blob(&t, nullptr, DP_INT32, 1, dims, cpu(0), count_delete, &probe), DP_EINVAL);
  EXPECT_NE(last_error().find("'data' is NULL"), std::string::npos) << last_error();
  int32_t x = 0;
  EXPECT_EQ(dp_tensor_from_blob(&t, &x, 99, 1, dims, cpu(0), count_delete, &probe), DP_EINVAL);
  EXPECT_EQ(probe.calls, 0);
  EXPECT_EQ(t, nullptr);
}

TEST(TensorFromBlob, ShapeWhoseByteCountWrapsSizeTIsRefusedLikeCreate) {
  // 2^61 + 1 float64 elements are 2^64 + 8 bytes: 8 once wrapped.
  const int64_t dims[] = {(int64_t{1} << 61) + 1};
  double blob = 0;
  DeleterProbe probe;
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_blob(&t, &blob, DP_FLOAT64, 1, dims, cpu(0), count_delete, &probe), DP_EINVAL);
  EXPECT_NE(last_error().find("argument 'shape'"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(probe.calls, 0);
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT64, 1, dims, cpu(0)), DP_EINVAL);
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
  // Zero elements stay fine however large the other extents.
  const int64_t empty[] = {int64_t{1} << 62, 0};
  DP_ASSERT_OK(dp_tensor_from_blob(&t, nullptr, DP_FLOAT64, 2, empty, cpu(0), nullptr, nullptr));
  EXPECT_EQ(dp_tensor_nbytes(t), 0u);
  dp_tensor_destroy(t);
}

// float64 [2^59 + 3, 2]: 2^63 + 48 bytes fit size_t but not ptrdiff_t (what
// C++ pointer arithmetic and PyTorch can address), so they are refused.
TEST(TensorCreate, ByteCountOverPtrdiffMaxIsRefusedNamingTheShape) {
  const int64_t dims[] = {(int64_t{1} << 59) + 3, 2};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT64, 2, dims, cpu(0)), DP_EINVAL);
  EXPECT_NE(last_error().find("argument 'shape'"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
}

TEST(TensorFromBlob, ByteCountOverPtrdiffMaxIsRefusedAndLeavesTheMemory) {
  const int64_t dims[] = {(int64_t{1} << 59) + 3, 2};
  double blob = 0;
  DeleterProbe probe;
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_blob(&t, &blob, DP_FLOAT64, 2, dims, cpu(0), count_delete, &probe), DP_EINVAL);
  EXPECT_NE(last_error().find("argument 'shape'"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(probe.calls, 0);
  // Just under the limit is a size, not an error: from_blob trusts the caller.
  const int64_t largest[] = {INT64_MAX / 8};
  DP_ASSERT_OK(dp_tensor_from_blob(&t, &blob, DP_FLOAT64, 1, largest, cpu(0), nullptr, nullptr));
  EXPECT_EQ(dp_tensor_nbytes(t), static_cast<size_t>(INT64_MAX / 8) * 8);
  dp_tensor_destroy(t);
}

TEST(TensorCopy, RoundTripsAndRejectsWrongByteCounts) {
  auto t = make<int64_t>({3}, {5, -6, 7});
  EXPECT_EQ(values<int64_t>(t.get()), (std::vector<int64_t>{5, -6, 7}));
  int64_t buf[4];
  EXPECT_EQ(dp_tensor_copy_to_host(t.get(), buf, sizeof(buf)), DP_EINVAL);
  EXPECT_NE(last_error().find("'nbytes' is 32 but the tensor (int64 3 on cpu:0) holds 24 bytes"), std::string::npos)
      << last_error();
  EXPECT_EQ(dp_tensor_copy_from_host(t.get(), buf, 8), DP_EINVAL);
  EXPECT_EQ(dp_tensor_copy_from_host(t.get(), nullptr, 24), DP_EINVAL);
  EXPECT_NE(last_error().find("'src' is NULL"), std::string::npos) << last_error();
  EXPECT_EQ(dp_tensor_copy_to_host(nullptr, buf, 24), DP_EINVAL);
}

TEST(TensorAccessors, NullHandleGivesSentinelsAndAMessage) {
  EXPECT_EQ(dp_tensor_dtype(nullptr), -1);
  EXPECT_NE(last_error().find("dp_tensor_dtype: argument 'tensor' is NULL"), std::string::npos) << last_error();
  EXPECT_EQ(dp_tensor_ndim(nullptr), -1);
  EXPECT_EQ(dp_tensor_numel(nullptr), -1);
  EXPECT_EQ(dp_tensor_nbytes(nullptr), 0u);
  EXPECT_EQ(dp_tensor_data(nullptr), nullptr);
  dp_device d = dp_tensor_device(nullptr);
  EXPECT_EQ(d.type, 0);
  EXPECT_EQ(d.index, -1);
  int64_t s[2];
  EXPECT_EQ(dp_tensor_shape(nullptr, s, 2), DP_EINVAL);
  dp_tensor_destroy(nullptr);  // accepted
}

TEST(TensorShape, CapacityMustHoldEveryDimension) {
  auto t = make<float>({2, 3, 4}, {});
  int64_t s[2];
  EXPECT_EQ(dp_tensor_shape(t.get(), s, 2), DP_EINVAL);
  EXPECT_NE(last_error().find("'cap' is 2 but the tensor has 3 dimensions"), std::string::npos) << last_error();
}

TEST(TensorToDevice, CopiesToAnotherLogicalDevice) {
  auto t = make<float>({4}, {1, 2, 3, 4}, cpu(0));
  dp_tensor* moved = nullptr;
  DP_ASSERT_OK(dp_tensor_to_device(&moved, t.get(), cpu(3)));
  TensorPtr owner(moved);
  EXPECT_TRUE(same_device(dp_tensor_device(moved), cpu(3)));
  EXPECT_NE(dp_tensor_data(moved), dp_tensor_data(t.get()));
  EXPECT_EQ(values<float>(moved), (std::vector<float>{1, 2, 3, 4}));
}
