// The DDP bucket plan against plans computed by hand (PyTorch's
// compute_bucket_assignment_by_size rule, visited in the given order).
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "ddp/bucket_plan.h"

namespace dparallel::ddp {
namespace {

using Plan = std::vector<std::vector<size_t>>;

std::vector<PlanItem> floats(const std::vector<size_t>& numels) {
  std::vector<PlanItem> items;
  for (size_t n : numels) items.push_back(PlanItem{DType::kFloat32, n * 4});
  return items;
}

std::vector<size_t> reversed(size_t n) {
  std::vector<size_t> order;
  for (size_t i = n; i-- > 0;) order.push_back(i);
  return order;
}

TEST(BucketPlan, ReverseOrderClosesABucketOnceItReachesTheCap) {
  // 400, 800, 400, 200 bytes visited 3,2,1,0: 200+400 reaches 400, then 800, then 400.
  EXPECT_EQ(compute_bucket_plan(floats({100, 200, 100, 50}), reversed(4), 400, 400), (Plan{{3, 2}, {1}, {0}}));
}

TEST(BucketPlan, ForwardOrderMatchesPyTorchSingleLimitCase) {
  EXPECT_EQ(compute_bucket_plan(floats({100, 200, 100, 50}), {0, 1, 2, 3}, 400, 400), (Plan{{0}, {1}, {2}, {3}}));
}

TEST(BucketPlan, FirstBucketHasItsOwnCap) {
  // PyTorch's multi-limit case: limits 40 then 80 over four 40-byte tensors.
  EXPECT_EQ(compute_bucket_plan(floats({10, 10, 10, 10}), {0, 1, 2, 3}, 40, 80), (Plan{{0}, {1, 2}, {3}}));
}

TEST(BucketPlan, DtypesFillSeparateBucketsOrderedByFirstItem) {
  std::vector<PlanItem> items;
  for (int i = 0; i < 3; ++i) {
    items.push_back(PlanItem{DType::kFloat32, 200});
    items.push_back(PlanItem{DType::kFloat64, 200});
  }
  EXPECT_EQ(compute_bucket_plan(items, {0, 1, 2, 3, 4, 5}, 400, 400), (Plan{{0, 2}, {1, 3}, {4}, {5}}));
}

TEST(BucketPlan, ALargeItemIsNeverSplit) {
  EXPECT_EQ(compute_bucket_plan(floats({1000, 1, 1}), reversed(3), 16, 16), (Plan{{2, 1, 0}}));
  EXPECT_EQ(compute_bucket_plan(floats({1000, 8}), reversed(2), 16, 16), (Plan{{1}, {0}}));
}

TEST(BucketPlan, EverythingFitsInOneBucketUnderALargeCap) {
  EXPECT_EQ(compute_bucket_plan(floats({5, 6, 7}), reversed(3), 1 << 20, 25 << 20), (Plan{{2, 1, 0}}));
}

TEST(BucketPlan, ReadyOrderDrivesTheRebuiltPlan) {
  // Gradients became ready 1, 3, 0, 2 (each 400 bytes, cap 800).
  EXPECT_EQ(compute_bucket_plan(floats({100, 100, 100, 100}), {1, 3, 0, 2}, 800, 800), (Plan{{1, 3}, {0, 2}}));
}

TEST(BucketPlan, AnOrderThatIsNotAPermutationIsAnInternalError) {
  try {
    compute_bucket_plan(floats({1, 1}), {0, 0}, 4, 4);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInternal);
  }
  EXPECT_THROW(compute_bucket_plan(floats({1, 1}), {0}, 4, 4), Error);
}

}  // namespace
}  // namespace dparallel::ddp
