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

TEST(Tensor, ShapeStringNamesScalar) {
  EXPECT_EQ(shape_string({2, 3}), "2x3");
  EXPECT_EQ(shape_string({}), "scalar");
}
