#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace dparallel;

TEST(ParallelFor, RunsEveryTaskExactlyOnce) {
  std::vector<std::atomic<int>> hits(1000);
  parallel_for(hits.size(), [&](size_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST(ParallelFor, RethrowsTheFirstTaskException) {
  EXPECT_THROW(parallel_for(8,
                            [](size_t i) {
                              if (i == 3) throw std::runtime_error("task 3");
                            }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int> count{0};
  parallel_for(16, [&](size_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 16);
}

TEST(ParallelFor, NestedCallsRunInline) {
  std::atomic<int> count{0};
  parallel_for(4, [&](size_t) { parallel_for(4, [&](size_t) { count.fetch_add(1); }); });
  EXPECT_EQ(count.load(), 16);
}

TEST(ParallelFor, ConcurrentCallersEachCompleteTheirOwnTasks) {
  std::vector<std::thread> callers;
  std::atomic<int> total{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) parallel_for(7, [&](size_t) { total.fetch_add(1); });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 7);
}

TEST(ParallelRange, CoversTheRangeWithoutOverlap) {
  std::vector<std::atomic<int>> hits(100003);
  parallel_range(hits.size(), 1000, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) hits[i].fetch_add(1);
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}
