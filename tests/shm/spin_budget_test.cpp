// The shared-memory barrier's spin budget (spin_budget.h): long while the
// recent waits' median is within the long spin, short once most were longer.
#include "distributed/shm/spin_budget.h"

#include <gtest/gtest.h>

#include <chrono>

namespace dparallel::dist::shm {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(ShmSpinBudget, StartsLong) { EXPECT_EQ(SpinBudget{}.budget(), SpinBudget::kLongSpin); }

TEST(ShmSpinBudget, StaysLongWhilePeersComeWithinIt) {
  SpinBudget b;
  for (int i = 0; i < 100; ++i) b.record(microseconds(i % 2 == 0 ? 1 : 150));
  EXPECT_EQ(b.budget(), SpinBudget::kLongSpin);
  // Exactly half of the window late: the median is still within the spin.
  for (size_t i = 0; i < SpinBudget::kWindow / 2; ++i) b.record(milliseconds(5));
  EXPECT_EQ(b.budget(), SpinBudget::kLongSpin);
}

TEST(ShmSpinBudget, ShortOnceMostWaitsOutlastTheSpin) {
  SpinBudget b;
  for (size_t i = 0; i < SpinBudget::kWindow / 2 + 1; ++i) b.record(milliseconds(3));
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);
  // A wait exactly as long as the spin counts as within it.
  b.record(SpinBudget::kLongSpin);
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);
}

TEST(ShmSpinBudget, ForgetsWaitsOlderThanTheWindow) {
  SpinBudget b;
  for (size_t i = 0; i < SpinBudget::kWindow; ++i) b.record(milliseconds(50));  // an idle spell
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);
  for (size_t i = 0; i < SpinBudget::kWindow / 2 - 1; ++i) b.record(microseconds(2));
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);  // 9 of 16 still long
  b.record(microseconds(2));
  EXPECT_EQ(b.budget(), SpinBudget::kLongSpin);  // 8 of 16
  for (size_t i = 0; i < SpinBudget::kWindow; ++i) b.record(microseconds(2));
  EXPECT_EQ(b.budget(), SpinBudget::kLongSpin);
}

TEST(ShmSpinBudget, NetworkPacedSpinsShortEvenWhilePeersComeWithinTheLongSpin) {
  SpinBudget b;
  b.set_network_paced();
  EXPECT_TRUE(b.network_paced());
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);
  for (size_t i = 0; i < 2 * SpinBudget::kWindow; ++i) b.record(microseconds(2));
  EXPECT_EQ(b.budget(), SpinBudget::kShortSpin);
}

}  // namespace
}  // namespace dparallel::dist::shm
