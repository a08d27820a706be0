#include "core/tensor.h"

#include <gtest/gtest.h>

#include "core/error.h"

using namespace dparallel;

TEST(Tensor, NarrowRowsSharesStorage) {
  Tensor t = Tensor::zeros(DType::kInt32, {4, 3}, Device{});
  Tensor rows = t.narrow_rows(1, 2);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.data(), static_cast<char*>(t.data()) + 12);
  EXPECT_EQ(rows.storage(), t.storage());
}

TEST(Tensor, CheckedNumelRejectsNegativeAndOverflow) {
  EXPECT_THROW(checked_numel({2, -1}, "shape"), Error);
  EXPECT_THROW(checked_numel({int64_t{1} << 40, int64_t{1} << 40}, "shape"), Error);
  EXPECT_EQ(checked_numel({0, int64_t{1} << 62}, "shape"), 0);
  EXPECT_EQ(checked_numel({}, "shape"), 1);
}

TEST(Tensor, CheckedNbytesRejectsByteCountsThatWrapSizeT) {
  const Shape wraps{(int64_t{1} << 61) + 1};
  EXPECT_THROW(checked_nbytes(DType::kFloat64, wraps, "shape"), Error);
  EXPECT_EQ(checked_nbytes(DType::kUInt8, wraps, "shape"), (size_t{1} << 61) + 1);
  EXPECT_EQ(checked_nbytes(DType::kFloat64, {int64_t{1} << 62, 0}, "shape"), 0u);
  // Every constructor goes through it: a storage view cannot wrap either.
  auto storage = Storage::wrap(Device{}, nullptr, 8, nullptr);
  EXPECT_THROW(Tensor::wrap(storage, 0, DType::kFloat64, wraps), Error);
  EXPECT_THROW(Tensor::wrap(storage, SIZE_MAX, DType::kUInt8, {1}), Error);
  Tensor tail = Tensor::zeros(DType::kUInt8, {4}, Device{}).narrow_rows(1, 3);
  EXPECT_THROW(tail.view_at(SIZE_MAX, DType::kUInt8, {1}), Error);  // 1 + SIZE_MAX wraps to 0
}

TEST(Tensor, ShapeStringNamesScalar) {
  EXPECT_EQ(shape_string({2, 3}), "2x3");
  EXPECT_EQ(shape_string({}), "scalar");
}
