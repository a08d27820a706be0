// Streams through the C ABI: current streams, the streams hosts make, and
// every call that touches tensors ordered after the host's queued work on the
// current stream. A producer here is a host function queued on a cpu stream
// that writes its tensor only after a pause, as a GPU kernel still running
// would; a call that reads without waiting reads the old (or poisoned) data.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "streams/stream_test_util.h"
#include "test_util.h"

using dptest::cpu;
using dptest::filled;
using dptest::make;
using dptest::producer_delay_ms;
using dptest::queue_write;
using dptest::TensorPtr;
using dptest::values;

namespace {

struct Read {
  const void* src;
  std::vector<float>* into;
  size_t count;
  int delay_ms;
};

void delayed_read(void* data) {
  std::unique_ptr<Read> r(static_cast<Read*>(data));
  std::this_thread::sleep_for(std::chrono::milliseconds(r->delay_ms));
  r->into->resize(r->count);
  std::memcpy(r->into->data(), r->src, r->count * sizeof(float));
}

// A cpu:0 stream, current on this thread for the test.
class StreamOrder : public ::testing::Test {
 protected:
  void SetUp() override {
    DP_ASSERT_OK(dp_stream_create(cpu(0), &stream_));
    DP_ASSERT_OK(dp_set_current_stream(cpu(0), stream_));
  }
  void TearDown() override {
    EXPECT_EQ(dp_set_current_stream(cpu(0), nullptr), DP_OK);
    EXPECT_EQ(dp_stream_destroy(cpu(0), stream_), DP_OK);
  }
  // A tensor of n floats that the stream fills with start, start+1, ... later.
  TensorPtr produced(size_t n, float start) {
    TensorPtr t = make<float>({static_cast<int64_t>(n)}, std::vector<float>(n, -7.0f));
    queue_write(stream_, t.get(), filled(n, start));
    return t;
  }
  void* stream_ = nullptr;
};

TEST(StreamApi, CurrentStreamIsPerThreadAndPerDeviceAndNullClearsIt) {
  void* a = nullptr;
  void* b = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &a));
  DP_ASSERT_OK(dp_stream_create(cpu(1), &b));
  void* got = reinterpret_cast<void*>(1);
  DP_ASSERT_OK(dp_get_current_stream(cpu(0), &got));
  EXPECT_EQ(got, nullptr);
  DP_ASSERT_OK(dp_set_current_stream(cpu(0), a));
  DP_ASSERT_OK(dp_set_current_stream(cpu(1), b));
  DP_ASSERT_OK(dp_get_current_stream(cpu(0), &got));
  EXPECT_EQ(got, a);
  DP_ASSERT_OK(dp_get_current_stream(cpu(1), &got));
  EXPECT_EQ(got, b);
  std::thread([] {
    void* other = reinterpret_cast<void*>(1);
    EXPECT_EQ(dp_get_current_stream(cpu(0), &other), DP_OK);
    EXPECT_EQ(other, nullptr) << "another thread has no current stream";
  }).join();
  DP_ASSERT_OK(dp_set_current_stream(cpu(0), nullptr));
  DP_ASSERT_OK(dp_get_current_stream(cpu(0), &got));
  EXPECT_EQ(got, nullptr);
  DP_ASSERT_OK(dp_stream_destroy(cpu(1), b));  // also clears it as this thread's current stream
  DP_ASSERT_OK(dp_get_current_stream(cpu(1), &got));
  EXPECT_EQ(got, nullptr);
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), a));
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), nullptr));
}

TEST(StreamApi, RefusesAnotherDevicesStreamADestroyedOneAndNullArgumentsNamingThem) {
  void* a = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &a));
  EXPECT_EQ(dp_set_current_stream(cpu(1), a), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("argument 'stream' is a stream of cpu:0, not of cpu:1"), std::string::npos)
      << dptest::last_error();
  int local = 0;
  EXPECT_EQ(dp_set_current_stream(cpu(0), &local), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("argument 'stream' is not a live cpu stream"), std::string::npos)
      << dptest::last_error();
  EXPECT_EQ(dp_get_current_stream(cpu(0), nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'out'"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_stream_create(cpu(0), nullptr), DP_EINVAL);
  EXPECT_EQ(dp_stream_launch_host_func(cpu(0), a, nullptr, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'fn'"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_set_current_stream(dp_device{DP_DEVICE_CPU, -1}, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'device'"), std::string::npos) << dptest::last_error();
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), a));
  EXPECT_EQ(dp_stream_synchronize(cpu(0), a), DP_EINVAL) << "a destroyed stream";
  EXPECT_EQ(dp_set_current_stream(cpu(0), a), DP_EINVAL) << "a destroyed stream";
  EXPECT_EQ(dp_stream_destroy(cpu(0), a), DP_EINVAL) << "destroyed twice";
}

TEST(StreamApi, ACudaStreamWithoutAGpuIsEdeviceNamingTheDevice) {
  if (dptest::cuda_count() > 0) GTEST_SKIP() << "a GPU is present";
  void* s = reinterpret_cast<void*>(1);
  EXPECT_EQ(dp_stream_create(dptest::cuda(0), &s), DP_EDEVICE);
  EXPECT_EQ(s, nullptr);
  EXPECT_NE(dptest::last_error().find("cuda:0"), std::string::npos) << dptest::last_error();
  int fake = 0;
  EXPECT_EQ(dp_set_current_stream(dptest::cuda(0), &fake), DP_EDEVICE);
  void* current = reinterpret_cast<void*>(1);
  EXPECT_EQ(dp_get_current_stream(dptest::cuda(0), &current), DP_EDEVICE);
}

void append(void* data) {
  auto* p = static_cast<std::pair<std::vector<int>*, int>*>(data);
  p->first->push_back(p->second);
  delete p;
}

TEST(StreamApi, HostFuncsRunInQueueOrderAndSynchronizeWaitsForThem) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  std::vector<int> order;
  for (int i = 0; i < 50; ++i) {
    DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), s, append, new std::pair<std::vector<int>*, int>(&order, i)));
  }
  DP_ASSERT_OK(dp_stream_synchronize(cpu(0), s));
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), s));
}

TEST(StreamApi, DestroyRunsWhatWasQueuedFirst) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  std::vector<int> order;
  for (int i = 0; i < 5; ++i) {
    DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), s, append, new std::pair<std::vector<int>*, int>(&order, i)));
  }
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), s));
  EXPECT_EQ(order.size(), 5u);
}

TEST(StreamApi, AStreamDestroyedWhileCurrentOnAnotherThreadIsEinvalThereNotACrash) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  TensorPtr x = make<float>({4}, filled(4, 1.0f));
  std::vector<float> host(4);
  std::mutex mutex;
  std::condition_variable changed;
  int step = 0;
  std::thread user([&] {
    EXPECT_EQ(dp_set_current_stream(cpu(0), s), DP_OK);
    {
      std::unique_lock<std::mutex> lock(mutex);
      step = 1;
      changed.notify_all();
      changed.wait(lock, [&] { return step == 2; });
    }
    EXPECT_EQ(dp_tensor_copy_to_host(x.get(), host.data(), sizeof(float) * host.size()), DP_EINVAL);
    EXPECT_NE(dptest::last_error().find("a cpu stream that was destroyed"), std::string::npos) << dptest::last_error();
    EXPECT_EQ(dp_set_current_stream(cpu(0), nullptr), DP_OK);
    EXPECT_EQ(dp_tensor_copy_to_host(x.get(), host.data(), sizeof(float) * host.size()), DP_OK);
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return step == 1; });
  }
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), s));
  {
    std::lock_guard<std::mutex> lock(mutex);
    step = 2;
  }
  changed.notify_all();
  user.join();
  EXPECT_EQ(host, filled(4, 1.0f));
}

struct SelfDestroy {
  void* stream;
  std::atomic<bool> second_queued{false};
  std::atomic<int> status{-1};
  std::atomic<bool> second_ran{false};
};

// Waits until the test has queued the work behind it, so the destroy always
// races queued work (without the gate it could run before the second launch).
void destroy_own_stream(void* data) {
  auto* d = static_cast<SelfDestroy*>(data);
  for (int i = 0; i < 6000 && !d->second_queued.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  d->status = dp_stream_destroy(cpu(0), d->stream);
}

void mark_ran(void* data) { static_cast<SelfDestroy*>(data)->second_ran = true; }

TEST(StreamApi, AHostFunctionMayDestroyItsOwnStreamAndWorkQueuedBehindItStillRuns) {
  SelfDestroy d;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &d.stream));
  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), d.stream, destroy_own_stream, &d));
  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), d.stream, mark_ran, &d));
  d.second_queued = true;
  for (int i = 0; i < 6000 && !(d.status.load() >= 0 && d.second_ran.load()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(d.status.load(), DP_OK);
  EXPECT_TRUE(d.second_ran.load()) << "work queued before the destroy runs, as on a CUDA stream";
  EXPECT_EQ(dp_stream_synchronize(cpu(0), d.stream), DP_EINVAL) << "destroyed";
}

TEST_F(StreamOrder, BroadcastReadsWhatTheCurrentStreamWroteBeforeIt) {
  TensorPtr x = produced(1000, 1.0f);
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_broadcast(x.get(), devices, 2, out));
  TensorPtr a(out[0]), b(out[1]);
  EXPECT_EQ(values<float>(b.get()), filled(1000, 1.0f));
}

TEST_F(StreamOrder, BroadcastCoalescedReadsWhatTheCurrentStreamWrote) {
  TensorPtr x = produced(300, 1.0f), y = produced(5, 50.0f);
  const dp_tensor* in[] = {x.get(), y.get()};
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out[4] = {};
  DP_ASSERT_OK(dp_broadcast_coalesced(in, 2, devices, 2, 1 << 20, out));
  std::vector<TensorPtr> owned;
  for (dp_tensor* t : out) owned.emplace_back(t);
  EXPECT_EQ(values<float>(out[2]), filled(300, 1.0f));
  EXPECT_EQ(values<float>(out[3]), filled(5, 50.0f));
}

TEST_F(StreamOrder, ReduceAddAndReduceAddCoalescedSumWhatTheCurrentStreamWrote) {
  TensorPtr x = produced(64, 1.0f), y = make<float>({64}, std::vector<float>(64, 1.0f), cpu(1));
  const dp_tensor* in[] = {x.get(), y.get()};
  dp_tensor* sum = nullptr;
  DP_ASSERT_OK(dp_reduce_add(in, 2, cpu(1), &sum));
  TensorPtr owned(sum);
  EXPECT_EQ(values<float>(sum), filled(64, 2.0f));

  TensorPtr z = produced(64, 10.0f);
  const dp_tensor* lists[] = {z.get(), y.get()};
  dp_tensor* sums[1] = {};
  DP_ASSERT_OK(dp_reduce_add_coalesced(lists, 2, 1, cpu(1), 1 << 20, sums));
  TensorPtr owned_sum(sums[0]);
  EXPECT_EQ(values<float>(sums[0]), filled(64, 11.0f));
}

TEST_F(StreamOrder, ScatterAndGatherMoveWhatTheCurrentStreamWrote) {
  TensorPtr x = produced(8, 1.0f);
  dp_device devices[] = {cpu(1), cpu(2)};
  dp_tensor* chunks[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(x.get(), devices, 2, nullptr, 0, chunks, &count));
  TensorPtr c0(chunks[0]), c1(chunks[1]);
  EXPECT_EQ(values<float>(c0.get()), filled(4, 1.0f));
  EXPECT_EQ(values<float>(c1.get()), filled(4, 5.0f));

  TensorPtr y = produced(4, 100.0f), z = produced(4, 200.0f);
  const dp_tensor* parts[] = {y.get(), z.get()};
  dp_tensor* whole = nullptr;
  DP_ASSERT_OK(dp_gather(parts, 2, 0, cpu(3), &whole));
  TensorPtr owned(whole);
  std::vector<float> expected = filled(4, 100.0f), tail = filled(4, 200.0f);
  expected.insert(expected.end(), tail.begin(), tail.end());
  EXPECT_EQ(values<float>(whole), expected);
}

TEST_F(StreamOrder, CopiesToTheHostAndToAnotherDeviceWaitForTheCurrentStream) {
  TensorPtr x = produced(16, 3.0f);
  std::vector<float> host(16, 0.0f);
  DP_ASSERT_OK(dp_tensor_copy_to_host(x.get(), host.data(), host.size() * sizeof(float)));
  EXPECT_EQ(host, filled(16, 3.0f));

  TensorPtr y = produced(16, 30.0f);
  dp_tensor* moved = nullptr;
  DP_ASSERT_OK(dp_tensor_to_device(&moved, y.get(), cpu(1)));
  TensorPtr owned(moved);
  EXPECT_EQ(values<float>(moved), filled(16, 30.0f));
}

TEST_F(StreamOrder, CopyFromTheHostLandsAfterTheReadsQueuedBeforeIt) {
  TensorPtr x = make<float>({32}, filled(32, 1.0f));
  std::vector<float> seen;
  DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), stream_, delayed_read,
                                          new Read{dp_tensor_data(x.get()), &seen, 32, producer_delay_ms()}));
  std::vector<float> replacement(32, -1.0f);
  DP_ASSERT_OK(dp_tensor_copy_from_host(x.get(), replacement.data(), replacement.size() * sizeof(float)));
  DP_ASSERT_OK(dp_stream_synchronize(cpu(0), stream_));
  EXPECT_EQ(seen, filled(32, 1.0f)) << "the queued read saw the copy that came after it";
  EXPECT_EQ(values<float>(x.get()), replacement);
}

TEST_F(StreamOrder, FreedMemoryIsNotReusedBeforeTheStreamHasPassedTheFree) {
  // Large enough for the allocator's block cache, and small enough for malloc.
  for (size_t n : {size_t{1} << 16, size_t{32}}) {
    std::vector<float> seen;
    {
      TensorPtr x = make<float>({static_cast<int64_t>(n)}, filled(n, 1.0f));
      DP_ASSERT_OK(dp_stream_launch_host_func(cpu(0), stream_, delayed_read,
                                              new Read{dp_tensor_data(x.get()), &seen, n, producer_delay_ms()}));
    }  // freed while the queued read still has to run
    std::vector<TensorPtr> reused;
    for (int i = 0; i < 4; ++i) {
      dp_tensor* t = nullptr;
      int64_t shape = static_cast<int64_t>(n);
      DP_ASSERT_OK(dp_tensor_create(&t, DP_FLOAT32, 1, &shape, cpu(0)));  // zero-filled
      reused.emplace_back(t);
    }
    DP_ASSERT_OK(dp_stream_synchronize(cpu(0), stream_));
    EXPECT_EQ(seen, filled(n, 1.0f)) << n << " floats: the freed block was handed out again before the read";
  }
}

TEST_F(StreamOrder, ReplicateAndReplicaSetSyncCopyWhatTheCurrentStreamWrote) {
  dp_module* m = nullptr;
  DP_ASSERT_OK(dp_module_create(&m));
  TensorPtr w = produced(100, 1.0f);
  DP_ASSERT_OK(dp_module_register_parameter(m, "w", w.get(), 1));
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_module* replicas[2] = {};
  DP_ASSERT_OK(dp_replicate(m, devices, 2, 1, replicas));
  dp_tensor* rw = nullptr;
  DP_ASSERT_OK(dp_module_get_parameter(replicas[1], "w", &rw));
  EXPECT_EQ(values<float>(rw), filled(100, 1.0f));
  dp_tensor_destroy(rw);
  for (dp_module* r : replicas) dp_module_destroy(r);

  dp_replica_set* set = nullptr;
  DP_ASSERT_OK(dp_replica_set_create(&set, m, devices, 2));
  queue_write(stream_, w.get(), filled(100, 500.0f));
  DP_ASSERT_OK(dp_replica_set_sync(set));
  dp_module* replica = nullptr;
  DP_ASSERT_OK(dp_replica_set_replica(set, 1, &replica));
  DP_ASSERT_OK(dp_module_get_parameter(replica, "w", &rw));
  EXPECT_EQ(values<float>(rw), filled(100, 500.0f));
  dp_tensor_destroy(rw);
  dp_module_destroy(replica);
  dp_replica_set_destroy(set);
  dp_module_destroy(m);
}

struct ApplySeen {
  std::atomic<int> calls{0};
  void* expected[2] = {};
  std::atomic<int> matched{0};
};

int report_stream(void* user_data, size_t index, dp_module*, dp_tensor* input, dp_device device, dp_tensor** output) {
  auto* seen = static_cast<ApplySeen*>(user_data);
  void* current = nullptr;
  if (dp_get_current_stream(device, &current) != DP_OK) return 1;
  if (current == seen->expected[index]) seen->matched.fetch_add(1);
  seen->calls.fetch_add(1);
  *output = input;
  return 0;
}

TEST_F(StreamOrder, ParallelApplyRunsEachCallbackWithTheCallersCurrentStreams) {
  void* other = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(1), &other));
  DP_ASSERT_OK(dp_set_current_stream(cpu(1), other));
  dp_module* m = nullptr;
  DP_ASSERT_OK(dp_module_create(&m));
  TensorPtr x0 = produced(4, 1.0f), x1 = make<float>({4}, filled(4, 1.0f), cpu(1));
  dp_module* replicas[] = {m, m};
  dp_tensor* inputs[] = {x0.get(), x1.get()};
  dp_device devices[] = {cpu(0), cpu(1)};
  ApplySeen seen;
  seen.expected[0] = stream_;
  seen.expected[1] = other;
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_parallel_apply(replicas, inputs, devices, 2, report_stream, &seen, out));
  for (dp_tensor* t : out) dp_tensor_destroy(t);
  EXPECT_EQ(seen.calls.load(), 2);
  EXPECT_EQ(seen.matched.load(), 2) << "a callback did not see the caller's current stream for its device";
  void* current = nullptr;
  DP_ASSERT_OK(dp_get_current_stream(cpu(1), &current));
  EXPECT_EQ(current, other);
  DP_ASSERT_OK(dp_set_current_stream(cpu(1), nullptr));
  DP_ASSERT_OK(dp_stream_destroy(cpu(1), other));
  dp_module_destroy(m);
}

TEST(StreamOrderDefault, WithoutACurrentStreamCallsWaitForTheDefaultStream) {
  // Outside DP_CPU_ASYNC=1 the host function runs at once; inside it, it is
  // queued on cpu:0's default stream and the broadcast must wait for it.
  TensorPtr x = make<float>({64}, std::vector<float>(64, -7.0f));
  queue_write(nullptr, x.get(), filled(64, 1.0f));
  dp_device devices[] = {cpu(1)};
  dp_tensor* out[1] = {};
  DP_ASSERT_OK(dp_broadcast(x.get(), devices, 1, out));
  TensorPtr owned(out[0]);
  EXPECT_EQ(values<float>(out[0]), filled(64, 1.0f));
}

}  // namespace
