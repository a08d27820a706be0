#include <dlpack/dlpack.h>

#include <cstddef>
#include <memory>

#include "test_util.h"

using namespace dptest;

TEST(DLPackExport, SharesMemoryAndOutlivesTheTensor) {
  auto t = make<float>({2, 2}, {1, 2, 3, 4});
  DLManagedTensor* managed = nullptr;
  DP_ASSERT_OK(dp_tensor_to_dlpack(t.get(), &managed));
  EXPECT_EQ(managed->dl_tensor.data, dp_tensor_data(t.get()));
  EXPECT_EQ(managed->dl_tensor.ndim, 2);
  EXPECT_EQ(managed->dl_tensor.shape[0], 2);
  EXPECT_EQ(managed->dl_tensor.dtype.code, kDLFloat);
  EXPECT_EQ(managed->dl_tensor.dtype.bits, 32);
  EXPECT_EQ(managed->dl_tensor.device.device_type, kDLCPU);
  EXPECT_EQ(managed->dl_tensor.strides, nullptr);
  t.reset();
  EXPECT_EQ(static_cast<float*>(managed->dl_tensor.data)[3], 4.0f);  // still alive
  managed->deleter(managed);
}

TEST(DLPackImport, RoundTripTakesOwnershipAndCallsTheProducerDeleterOnce) {
  auto t = make<int32_t>({3}, {9, 8, 7});
  DLManagedTensor* managed = nullptr;
  DP_ASSERT_OK(dp_tensor_to_dlpack(t.get(), &managed));
  dp_tensor* back = nullptr;
  DP_ASSERT_OK(dp_tensor_from_dlpack(&back, managed));
  EXPECT_EQ(dp_tensor_data(back), dp_tensor_data(t.get()));
  EXPECT_EQ(values<int32_t>(back), (std::vector<int32_t>{9, 8, 7}));
  dp_tensor_destroy(back);  // runs managed->deleter; ASan would flag a double free
}

namespace {
struct Producer {
  int deletes = 0;
  int64_t shape[2] = {2, 3};
  int64_t strides[2] = {3, 1};
  float data[6] = {0, 1, 2, 3, 4, 5};
  DLManagedTensor managed{};
};
void producer_delete(DLManagedTensor* m) { static_cast<Producer*>(m->manager_ctx)->deletes++; }
Producer* make_producer() {
  auto* p = new Producer();
  p->managed.dl_tensor.data = p->data;
  p->managed.dl_tensor.device = DLDevice{kDLCPU, 0};
  p->managed.dl_tensor.ndim = 2;
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 1};
  p->managed.dl_tensor.shape = p->shape;
  p->managed.dl_tensor.strides = p->strides;
  p->managed.manager_ctx = p;
  p->managed.deleter = producer_delete;
  return p;
}
}  // namespace

TEST(DLPackImport, AcceptsCompactStridesAndByteOffset) {
  std::unique_ptr<Producer> p(make_producer());
  p->managed.dl_tensor.byte_offset = 4;
  p->shape[1] = 2;
  p->strides[0] = 2;
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_dlpack(&t, &p->managed));
  EXPECT_EQ(values<float>(t), (std::vector<float>{1, 2, 3, 4}));
  dp_tensor_destroy(t);
  EXPECT_EQ(p->deletes, 1);
}

TEST(DLPackImport, RejectsWhatItCannotRepresentAndLeavesOwnership) {
  std::unique_ptr<Producer> p(make_producer());
  dp_tensor* t = nullptr;
  p->strides[0] = 1;  // transposed
  p->strides[1] = 2;
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EINVAL);
  EXPECT_NE(last_error().find("not compact"), std::string::npos) << last_error();
  p->strides[0] = 3;
  p->strides[1] = 1;
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 4};
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EINVAL);
  p->managed.dl_tensor.dtype = DLDataType{kDLComplex, 64, 1};
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EUNSUPPORTED);
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 1};
  p->managed.dl_tensor.device = DLDevice{kDLVulkan, 0};
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EUNSUPPORTED);
  p->managed.dl_tensor.device = DLDevice{kDLCPU, 0};
  p->managed.dl_tensor.ndim = 40;
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EINVAL);
  EXPECT_EQ(dp_tensor_from_dlpack(&t, nullptr), DP_EINVAL);
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(p->deletes, 0);
}

TEST(DLPackImport, ShapeWhoseByteCountWrapsSizeTIsRefused) {
  std::unique_ptr<Producer> p(make_producer());
  // 2^61 + 1 float64 elements are 2^64 + 8 bytes: 8 once wrapped.
  p->shape[0] = (int64_t{1} << 61) + 1;
  p->shape[1] = 1;
  p->managed.dl_tensor.strides = nullptr;
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 64, 1};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EINVAL);
  EXPECT_NE(last_error().find("managed->dl_tensor.shape"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(p->deletes, 0);
}

TEST(DLPackImport, ByteCountOverPtrdiffMaxIsRefused) {
  std::unique_ptr<Producer> p(make_producer());
  // float64 [2^59 + 3, 2]: 2^63 + 48 bytes, within size_t, past ptrdiff_t.
  p->shape[0] = (int64_t{1} << 59) + 3;
  p->shape[1] = 2;
  p->managed.dl_tensor.strides = nullptr;
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 64, 1};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_dlpack(&t, &p->managed), DP_EINVAL);
  EXPECT_NE(last_error().find("managed->dl_tensor.shape"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("PTRDIFF_MAX"), std::string::npos) << last_error();
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(p->deletes, 0);
}

TEST(DLPackExport, BoolAndBfloat16UseTheirDLPackCodes) {
  const int64_t dims[] = {2};
  dp_tensor* b = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&b, DP_BOOL, 1, dims, cpu(0)));
  DLManagedTensor* m = nullptr;
  DP_ASSERT_OK(dp_tensor_to_dlpack(b, &m));
  EXPECT_EQ(m->dl_tensor.dtype.code, 6);
  EXPECT_EQ(m->dl_tensor.dtype.bits, 8);
  dp_tensor* back = nullptr;
  DP_ASSERT_OK(dp_tensor_from_dlpack(&back, m));
  EXPECT_EQ(dp_tensor_dtype(back), DP_BOOL);
  dp_tensor_destroy(back);
  dp_tensor_destroy(b);
  dp_tensor* bf = nullptr;
  DP_ASSERT_OK(dp_tensor_create(&bf, DP_BFLOAT16, 1, dims, cpu(0)));
  DP_ASSERT_OK(dp_tensor_to_dlpack(bf, &m));
  EXPECT_EQ(m->dl_tensor.dtype.code, kDLBfloat);
  m->deleter(m);
  dp_tensor_destroy(bf);
}

// ---- DLPack 1.x: DLManagedTensorVersioned ----

TEST(DLPackVersionedExport, IsVersionOneOneZeroCopyAndFlagsReadOnlyOnlyWhenAsked) {
  auto t = make<float>({2, 2}, {1, 2, 3, 4});
  for (int read_only : {0, 1}) {
    DLManagedTensorVersioned* managed = nullptr;
    DP_ASSERT_OK(dp_tensor_to_dlpack_versioned(t.get(), read_only, &managed));
    EXPECT_EQ(managed->version.major, 1u);
    EXPECT_EQ(managed->version.minor, 1u);
    EXPECT_EQ(managed->flags, read_only != 0 ? DLPACK_FLAG_BITMASK_READ_ONLY : uint64_t{0});
    EXPECT_EQ(managed->dl_tensor.data, dp_tensor_data(t.get()));
    EXPECT_EQ(managed->dl_tensor.ndim, 2);
    EXPECT_EQ(managed->dl_tensor.shape[1], 2);
    EXPECT_EQ(managed->dl_tensor.dtype.code, kDLFloat);
    EXPECT_EQ(managed->dl_tensor.device.device_type, kDLCPU);
    EXPECT_EQ(managed->dl_tensor.strides, nullptr);
    managed->deleter(managed);
  }
  DLManagedTensorVersioned* managed = nullptr;
  DP_ASSERT_OK(dp_tensor_to_dlpack_versioned(t.get(), 0, &managed));
  t.reset();
  EXPECT_EQ(static_cast<float*>(managed->dl_tensor.data)[3], 4.0f);  // still alive
  managed->deleter(managed);
  EXPECT_EQ(dp_tensor_to_dlpack_versioned(nullptr, 0, &managed), DP_EINVAL);
  EXPECT_EQ(managed, nullptr);
}

TEST(DLPackVersionedExport, TheStructHasDLPackOneLayout) {
  // version, manager_ctx, deleter, flags, then the DLTensor.
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, version), 0u);
  EXPECT_EQ(sizeof(DLPackVersion), 8u);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, manager_ctx), 8u);
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, deleter), 8u + sizeof(void*));
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, flags), 8u + 2 * sizeof(void*));
  EXPECT_EQ(offsetof(DLManagedTensorVersioned, dl_tensor), 16u + 2 * sizeof(void*));
}

namespace {
struct VersionedProducer {
  int deletes = 0;
  int64_t shape[2] = {2, 3};
  float data[6] = {0, 1, 2, 3, 4, 5};
  DLManagedTensorVersioned managed{};
};
void versioned_producer_delete(DLManagedTensorVersioned* m) {
  static_cast<VersionedProducer*>(m->manager_ctx)->deletes++;
}
std::unique_ptr<VersionedProducer> make_versioned_producer(uint64_t flags) {
  auto p = std::make_unique<VersionedProducer>();
  p->managed.version = DLPackVersion{1, 0};
  p->managed.flags = flags;
  p->managed.dl_tensor.data = p->data;
  p->managed.dl_tensor.device = DLDevice{kDLCPU, 0};
  p->managed.dl_tensor.ndim = 2;
  p->managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 1};
  p->managed.dl_tensor.shape = p->shape;
  p->managed.manager_ctx = p.get();
  p->managed.deleter = versioned_producer_delete;
  return p;
}
}  // namespace

TEST(DLPackVersionedImport, AWritableTensorIsTakenInPlaceAndReleasedOnceWithItsLastTensor) {
  auto p = make_versioned_producer(0);
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_dlpack_versioned(&t, &p->managed));
  EXPECT_EQ(dp_tensor_data(t), static_cast<void*>(p->data));
  EXPECT_EQ(values<float>(t), (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(p->deletes, 0);
  dp_tensor_destroy(t);
  EXPECT_EQ(p->deletes, 1);
}

TEST(DLPackVersionedImport, AReadOnlyTensorIsCopiedAndReleasedBeforeTheCallReturns) {
  auto p = make_versioned_producer(DLPACK_FLAG_BITMASK_READ_ONLY);
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_dlpack_versioned(&t, &p->managed));
  EXPECT_EQ(p->deletes, 1);
  EXPECT_NE(dp_tensor_data(t), static_cast<void*>(p->data));
  EXPECT_EQ(values<float>(t), (std::vector<float>{0, 1, 2, 3, 4, 5}));
  const float nines[6] = {9, 9, 9, 9, 9, 9};
  DP_ASSERT_OK(dp_tensor_copy_from_host(t, nines, sizeof nines));
  EXPECT_EQ(p->data[5], 5.0f);  // the producer's memory is never written
  dp_tensor_destroy(t);
  EXPECT_EQ(p->deletes, 1);
}

TEST(DLPackVersionedImport, ARoundTripKeepsMemoryUnlessExportedReadOnly) {
  auto t = make<int32_t>({3}, {9, 8, 7});
  for (int read_only : {0, 1}) {
    DLManagedTensorVersioned* managed = nullptr;
    DP_ASSERT_OK(dp_tensor_to_dlpack_versioned(t.get(), read_only, &managed));
    dp_tensor* back = nullptr;
    DP_ASSERT_OK(dp_tensor_from_dlpack_versioned(&back, managed));
    EXPECT_EQ(dp_tensor_data(back) == dp_tensor_data(t.get()), read_only == 0);
    EXPECT_EQ(values<int32_t>(back), (std::vector<int32_t>{9, 8, 7}));
    dp_tensor_destroy(back);  // ASan would flag a second free of the export
  }
}

TEST(DLPackVersionedImport, AnotherMajorVersionIsEinvalNamingItAndLeavesOwnership) {
  auto p = make_versioned_producer(0);
  p->managed.version = DLPackVersion{2, 3};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_dlpack_versioned(&t, &p->managed), DP_EINVAL);
  EXPECT_NE(last_error().find("version 2.3"), std::string::npos) << last_error();
  p->managed.version = DLPackVersion{0, 8};
  EXPECT_EQ(dp_tensor_from_dlpack_versioned(&t, &p->managed), DP_EINVAL);
  EXPECT_NE(last_error().find("version 0.8"), std::string::npos) << last_error();
  // A later minor of major 1 is accepted.
  p->managed.version = DLPackVersion{1, 7};
  p->managed.dl_tensor.dtype = DLDataType{kDLComplex, 64, 1};
  EXPECT_EQ(dp_tensor_from_dlpack_versioned(&t, &p->managed), DP_EUNSUPPORTED);
  p->managed.flags = DLPACK_FLAG_BITMASK_READ_ONLY;  // refused before any copy
  EXPECT_EQ(dp_tensor_from_dlpack_versioned(&t, &p->managed), DP_EUNSUPPORTED);
  EXPECT_EQ(dp_tensor_from_dlpack_versioned(&t, nullptr), DP_EINVAL);
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(p->deletes, 0);
}
