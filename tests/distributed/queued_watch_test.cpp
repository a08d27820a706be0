// The watch over collectives queued on a device (NCCL inside
// QueuedTransfers), driven by fake end events: retiring in queue order,
// failures reported once, every event released once.
#include "distributed/nccl/queued_watch.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace dparallel::dist {
namespace {

using namespace std::chrono_literals;

// End events as integers: their state, what was released, what failed.
struct FakeDevice {
  std::mutex mutex;
  std::map<intptr_t, int> state;  // QueuedWatch::kDone, kBusy or an error
  std::map<intptr_t, int> released;
  std::atomic<int> async_error{0};
  std::vector<QueuedWatch::Failure> failures;
  std::thread::id watch_thread;

  void* event(intptr_t id, int initial = QueuedWatch::kBusy) {
    std::lock_guard<std::mutex> lock(mutex);
    state[id] = initial;
    return reinterpret_cast<void*>(id);
  }
  void set(intptr_t id, int value) {
    std::lock_guard<std::mutex> lock(mutex);
    state[id] = value;
  }
  int released_count(intptr_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    return released.count(id) != 0 ? released[id] : 0;
  }
  size_t failure_count() {
    std::lock_guard<std::mutex> lock(mutex);
    return failures.size();
  }

  QueuedWatch::Hooks hooks() {
    QueuedWatch::Hooks h;
    h.on_start = [this] {
      std::lock_guard<std::mutex> lock(mutex);
      watch_thread = std::this_thread::get_id();
    };
    h.query = [this](void* e) {
      std::lock_guard<std::mutex> lock(mutex);
      return state.at(reinterpret_cast<intptr_t>(e));
    };
    h.async_error = [this] { return async_error.load(); };
    h.on_failure = [this](const QueuedWatch::Failure& f) {
      std::lock_guard<std::mutex> lock(mutex);
      failures.push_back(f);
    };
    h.release = [this](void* e) {
      std::lock_guard<std::mutex> lock(mutex);
      ++released[reinterpret_cast<intptr_t>(e)];
    };
    return h;
  }
};

// Polls `done` for up to 60 s: a bound for a loaded machine, not a timing.
template <typename Done>
bool eventually(Done&& done) {
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

const auto kFar = std::chrono::hours(1);

TEST(QueuedWatch, RetiresFinishedCollectivesInQueueOrderOnItsOwnThread) {
  FakeDevice device;
  QueuedWatch watch(device.hooks(), 1ms);
  const auto deadline = QueuedWatch::Clock::now() + kFar;
  watch.add(device.event(1), deadline, "first");
  watch.add(device.event(2), deadline, "second");
  watch.add(device.event(3), deadline, "third");
  // The second is done but waits behind the first, as on one stream.
  device.set(2, QueuedWatch::kDone);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(watch.pending(), 3u);
  EXPECT_EQ(device.released_count(2), 0);
  device.set(1, QueuedWatch::kDone);
  ASSERT_TRUE(eventually([&] { return watch.pending() == 1; }));
  EXPECT_EQ(device.released_count(1), 1);
  EXPECT_EQ(device.released_count(2), 1);
  device.set(3, QueuedWatch::kDone);
  ASSERT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_EQ(device.released_count(3), 1);
  EXPECT_FALSE(watch.failed());
  EXPECT_EQ(device.failure_count(), 0u);
  std::lock_guard<std::mutex> lock(device.mutex);
  EXPECT_NE(device.watch_thread, std::thread::id());
  EXPECT_NE(device.watch_thread, std::this_thread::get_id());
}

TEST(QueuedWatch, APassedDeadlineReportsTheOldestCollectiveOnceAndReleasesEveryEvent) {
  FakeDevice device;
  QueuedWatch watch(device.hooks(), 1ms);
  watch.add(device.event(1), QueuedWatch::Clock::now() + 30ms, "all_gather #7");
  watch.add(device.event(2), QueuedWatch::Clock::now() + kFar, "reduce_scatter #8");
  // failed() turns true first; the failure is reported and the events
  // released after it, on the watch's thread: wait for the last of those.
  ASSERT_TRUE(eventually([&] { return watch.failed() && device.released_count(2) == 1; }));
  ASSERT_EQ(device.failure_count(), 1u);
  {
    std::lock_guard<std::mutex> lock(device.mutex);
    EXPECT_EQ(device.failures[0].kind, QueuedWatch::Failure::Kind::kTimeout);
    EXPECT_EQ(device.failures[0].what, "all_gather #7");
  }
  EXPECT_EQ(device.released_count(1), 1);
  EXPECT_EQ(device.released_count(2), 1);
  EXPECT_EQ(watch.pending(), 0u);
  // After the failure a new collective's event goes back at once.
  watch.add(device.event(3), QueuedWatch::Clock::now() + kFar, "all_gather #9");
  EXPECT_EQ(device.released_count(3), 1);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(device.failure_count(), 1u);
}

TEST(QueuedWatch, AnAsynchronousErrorFailsLongBeforeTheDeadline) {
  FakeDevice device;
  QueuedWatch watch(device.hooks(), 1ms);
  watch.add(device.event(1), QueuedWatch::Clock::now() + kFar, "all_gather #1");
  std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(watch.failed());
  device.async_error = 6;                                                                    // ncclRemoteError
  ASSERT_TRUE(eventually([&] { return watch.failed() && device.released_count(1) == 1; }));  // as above
  std::lock_guard<std::mutex> lock(device.mutex);
  ASSERT_EQ(device.failures.size(), 1u);
  EXPECT_EQ(device.failures[0].kind, QueuedWatch::Failure::Kind::kAsyncError);
  EXPECT_EQ(device.failures[0].code, 6);
  EXPECT_EQ(device.released[1], 1);
}

TEST(QueuedWatch, AnEventThatFailsOnTheDeviceIsReportedWithItsCode) {
  FakeDevice device;
  QueuedWatch watch(device.hooks(), 1ms);
  watch.add(device.event(1, QueuedWatch::kDone), QueuedWatch::Clock::now() + kFar, "broadcast #1");
  watch.add(device.event(2, 700), QueuedWatch::Clock::now() + kFar, "all_reduce #2");
  ASSERT_TRUE(eventually([&] { return watch.failed() && device.released_count(2) == 1; }));  // as above
  std::lock_guard<std::mutex> lock(device.mutex);
  ASSERT_EQ(device.failures.size(), 1u);
  EXPECT_EQ(device.failures[0].kind, QueuedWatch::Failure::Kind::kEventError);
  EXPECT_EQ(device.failures[0].code, 700);
  EXPECT_EQ(device.failures[0].what, "all_reduce #2");
  EXPECT_EQ(device.released[1], 1);
  EXPECT_EQ(device.released[2], 1);
}

TEST(QueuedWatch, DestroyingItReleasesThePendingEventsWithoutAFailure) {
  FakeDevice device;
  {
    QueuedWatch watch(device.hooks(), 1ms);
    watch.add(device.event(1), QueuedWatch::Clock::now() + kFar, "all_gather #1");
    watch.add(device.event(2), QueuedWatch::Clock::now() + kFar, "all_gather #2");
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(device.released_count(1), 1);
  EXPECT_EQ(device.released_count(2), 1);
  EXPECT_EQ(device.failure_count(), 0u);
}

TEST(QueuedWatch, NoThreadStartsUntilACollectiveIsQueued) {
  FakeDevice device;
  { QueuedWatch watch(device.hooks(), 1ms); }
  std::lock_guard<std::mutex> lock(device.mutex);
  EXPECT_EQ(device.watch_thread, std::thread::id());
}

}  // namespace
}  // namespace dparallel::dist
