// Peer access between GPUs: enabled once per directed pair, whichever
// threads ask, without a GPU.
#include "device/cuda/peer_access.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dparallel::cuda {
namespace {

using std::chrono::milliseconds;

TEST(CudaPeerAccess, EnablesEachDirectedPairOnceAcrossThreads) {
  PeerAccessTable table;
  std::atomic<int> calls{0};
  auto enable = [&](int32_t, int32_t) {
    ++calls;
    std::this_thread::sleep_for(milliseconds(2));  // widen the window for a second enable
    return true;
  };
  std::vector<std::thread> threads;
  std::atomic<int> granted{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      if (table.ensure(0, 1, enable)) ++granted;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(granted.load(), 8);
  EXPECT_TRUE(table.ensure(1, 0, enable));  // the other direction is its own pair
  EXPECT_EQ(calls.load(), 2);
}

TEST(CudaPeerAccess, SameDeviceNeedsNothingAndARefusalIsRemembered) {
  PeerAccessTable table;
  int calls = 0;
  EXPECT_TRUE(table.ensure(3, 3, [&](int32_t, int32_t) { return ++calls, false; }));
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(table.ensure(0, 2, [&](int32_t, int32_t) { return ++calls, false; }));
  EXPECT_FALSE(table.ensure(0, 2, [&](int32_t, int32_t) { return ++calls, true; }));
  EXPECT_EQ(calls, 1);
}

TEST(CudaPeerAccess, AFailedEnableIsTriedAgain) {
  PeerAccessTable table;
  EXPECT_THROW(table.ensure(0, 1, [](int32_t, int32_t) -> bool { throw std::runtime_error("driver"); }),
               std::runtime_error);
  EXPECT_TRUE(table.ensure(0, 1, [](int32_t, int32_t) { return true; }));
}

}  // namespace
}  // namespace dparallel::cuda
