// How in-process NCCL calls wait: polls, asynchronous errors and the
// deadline, driven by fake queries and a fake clock.
#include "device/cuda/nccl_wait.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace dparallel::cuda {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(NcclWait, TimeoutComesFromTheEnvironmentOrDefaultsTo300s) {
  EXPECT_EQ(nccl_timeout_from(nullptr), milliseconds(300000));
  EXPECT_EQ(nccl_timeout_from(""), milliseconds(300000));
  EXPECT_EQ(nccl_timeout_from("1500"), milliseconds(1500));
  EXPECT_EQ(nccl_timeout_from("0"), milliseconds(300000));
  EXPECT_EQ(nccl_timeout_from("-5"), milliseconds(300000));
  EXPECT_EQ(nccl_timeout_from("10s"), milliseconds(300000));
}

TEST(NcclWait, YieldsAtFirstThenSleeps) {
  EXPECT_EQ(poll_pause(microseconds(0)), microseconds(0));
  EXPECT_EQ(poll_pause(microseconds(999)), microseconds(0));
  EXPECT_GT(poll_pause(milliseconds(1)), microseconds(0));
  EXPECT_EQ(poll_pause(std::chrono::seconds(100)), microseconds(50));
}

// A fake clock that each pause moves forward.
struct FakeTime {
  WaitClock::time_point now{};
  int pauses = 0;
  WaitClock::time_point operator()() const { return now; }
  void advance(microseconds d) {
    ++pauses;
    now += d + microseconds(100);
  }
};

TEST(NcclWait, ReturnsWhenEveryStreamIsDone) {
  FakeTime time;
  std::vector<int> busy_polls{0, 3, 1};
  std::vector<int> queries(3, 0);
  auto result = wait_streams(
      3, time.now + milliseconds(100),
      [&](size_t i) { return queries[i]++ < busy_polls[i] ? kStreamBusy : kStreamDone; }, [](size_t) { return 0; },
      [&] { return time(); }, [&](microseconds d) { time.advance(d); });
  EXPECT_EQ(result.kind, NcclWaitResult::Kind::kDone);
  EXPECT_EQ(time.pauses, 3);
  EXPECT_EQ(queries, (std::vector<int>{1, 4, 2}));  // a done stream is not asked again
}

TEST(NcclWait, AStreamErrorNamesItsStream) {
  FakeTime time;
  auto result = wait_streams(
      2, time.now + milliseconds(100), [](size_t i) { return i == 1 ? 700 : kStreamBusy; }, [](size_t) { return 0; },
      [&] { return time(); }, [&](microseconds d) { time.advance(d); });
  EXPECT_EQ(result.kind, NcclWaitResult::Kind::kStreamError);
  EXPECT_EQ(result.index, 1u);
  EXPECT_EQ(result.code, 700);
}

TEST(NcclWait, AnAsynchronousErrorEndsTheWaitBeforeTheDeadline) {
  FakeTime time;
  int polls = 0;
  auto result = wait_streams(
      2, time.now + std::chrono::hours(1), [](size_t) { return kStreamBusy; },
      [&](size_t i) { return i == 1 && ++polls > 4 ? 6 : 0; }, [&] { return time(); },
      [&](microseconds d) { time.advance(d); });
  EXPECT_EQ(result.kind, NcclWaitResult::Kind::kAsyncError);
  EXPECT_EQ(result.index, 1u);
  EXPECT_EQ(result.code, 6);
  EXPECT_EQ(time.pauses, 4);
}

TEST(NcclWait, TheDeadlineNamesTheStreamsNotDone) {
  FakeTime time;
  auto deadline = time.now + milliseconds(5);
  auto result = wait_streams(
      4, deadline, [](size_t i) { return i % 2 == 0 ? kStreamDone : kStreamBusy; }, [](size_t) { return 0; },
      [&] { return time(); }, [&](microseconds d) { time.advance(d); });
  EXPECT_EQ(result.kind, NcclWaitResult::Kind::kTimeout);
  EXPECT_EQ(result.pending, (std::vector<size_t>{1, 3}));
  EXPECT_EQ(result.index, 1u);
  // The clock is the fake one: it gives up at the first look past the
  // deadline, one pause (50 us) and one step (100 us) at most beyond it.
  EXPECT_GE(time.now, deadline);
  EXPECT_LE(time.now, deadline + microseconds(150));
}

TEST(NcclWait, DoneStreamsWinOverAnExpiredDeadline) {
  FakeTime time;
  auto result = wait_streams(
      2, time.now - milliseconds(1), [](size_t) { return kStreamDone; }, [](size_t) { return 6; },
      [&] { return time(); }, [&](microseconds d) { time.advance(d); });
  EXPECT_EQ(result.kind, NcclWaitResult::Kind::kDone);
}

}  // namespace
}  // namespace dparallel::cuda
