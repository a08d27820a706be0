// Process-group collectives and DDP marks ordered after the host's queued
// work on its current streams (world size 1, in one process). Producers are
// host functions queued on cpu streams that write after a pause.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "group_util.h"
#include "module/module_test_util.h"
#include "streams/stream_test_util.h"
#include "test_util.h"

using dptest::cpu;
using dptest::filled;
using dptest::make;
using dptest::queue_write;
using dptest::TensorPtr;
using dptest::values;

namespace {

class StreamOrderDist : public ::testing::Test {
 protected:
  void SetUp() override {
    pg_ = group_.get();
    ASSERT_NE(pg_, nullptr);
  }
  dptest::SingleRankGroup group_;  // a one-rank group, gone after TearDown
  dp_process_group* pg_ = nullptr;
};

TEST_F(StreamOrderDist, AllGatherAndAsyncAllGatherSendWhatTheCurrentStreamWrote) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  DP_ASSERT_OK(dp_set_current_stream(cpu(0), s));
  for (int async = 0; async < 2; ++async) {
    TensorPtr x = make<float>({256}, std::vector<float>(256, -7.0f));
    queue_write(s, x.get(), filled(256, 1.0f));
    TensorPtr out = make<float>({256}, std::vector<float>(256, 0.0f));
    dp_tensor* outs[] = {out.get()};
    if (async != 0) {
      dp_work* work = nullptr;
      DP_ASSERT_OK(dp_pg_all_gather_async(pg_, x.get(), outs, 1, &work));
      DP_EXPECT_OK(dp_work_wait(work));
      dp_work_destroy(work);
    } else {
      DP_ASSERT_OK(dp_pg_all_gather(pg_, x.get(), outs, 1));
    }
    EXPECT_EQ(values<float>(out.get()), filled(256, 1.0f)) << (async != 0 ? "async" : "sync");
  }
  DP_ASSERT_OK(dp_set_current_stream(cpu(0), nullptr));
  DP_ASSERT_OK(dp_stream_destroy(cpu(0), s));
}

// What the custom hook saw in each bucket before reducing it (in place, a
// no-op with one rank).
struct HookSeen {
  std::mutex mutex;
  std::vector<std::vector<float>> buckets;
};

int record_bucket(void* user_data, dp_process_group*, size_t bucket_index, dp_tensor* flat) {
  auto* seen = static_cast<HookSeen*>(user_data);
  std::vector<float> v(dp_tensor_numel(flat));
  if (dp_tensor_copy_to_host(flat, v.data(), v.size() * sizeof(float)) != DP_OK) return 1;
  std::lock_guard<std::mutex> lock(seen->mutex);
  if (seen->buckets.size() <= bucket_index) seen->buckets.resize(bucket_index + 1);
  seen->buckets[bucket_index] = std::move(v);
  return 0;
}

TEST_F(StreamOrderDist, DdpMarksFromThreadsWaitForEachMarkingThreadsCurrentStream) {
  // Two layers, one bucket each; each layer's gradient is produced on the
  // stream of the thread that marks it, as an autograd engine's workers do.
  for (int views = 0; views < 2; ++views) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr w0 = make<float>({64}, std::vector<float>(64, 0.0f));
    TensorPtr w1 = make<float>({64}, std::vector<float>(64, 0.0f));
    DP_ASSERT_OK(dp_module_register_parameter(m.get(), "w0", w0.get(), 1));
    DP_ASSERT_OK(dp_module_register_parameter(m.get(), "w1", w1.get(), 1));
    HookSeen seen;
    dp_ddp_options o;
    DP_ASSERT_OK(dp_ddp_options_init(&o, sizeof o));
    o.bucket_cap_mb = 64.0 * sizeof(float) / 1048576.0;
    o.first_bucket_cap_mb = o.bucket_cap_mb;
    o.gradient_as_bucket_view = views;
    o.comm_hook = DP_HOOK_CUSTOM;
    o.hook_fn = record_bucket;
    o.hook_user_data = &seen;
    dp_ddp* ddp = nullptr;
    DP_ASSERT_OK(dp_ddp_create(&ddp, m.get(), pg_, &o));
    ASSERT_EQ(dp_ddp_num_buckets(ddp), 2u);
    for (int iteration = 0; iteration < 2; ++iteration) {
      DP_ASSERT_OK(dp_ddp_pre_forward(ddp));
      std::vector<std::thread> workers;
      for (int p = 0; p < 2; ++p) {
        workers.emplace_back([&, p] {
          void* s = nullptr;
          ASSERT_EQ(dp_stream_create(cpu(0), &s), DP_OK) << dp_last_error();
          ASSERT_EQ(dp_set_current_stream(cpu(0), s), DP_OK) << dp_last_error();
          const char* name = p == 0 ? "w0" : "w1";
          dp_tensor* g = nullptr;
          ASSERT_EQ(dp_module_grad(m.get(), name, &g), DP_OK) << dp_last_error();
          float start = static_cast<float>(100 * (p + 1) + 1000 * iteration);
          queue_write(s, g, filled(64, start));
          EXPECT_EQ(dp_ddp_mark_grad_ready(ddp, name), DP_OK) << dp_last_error();
          dp_tensor_destroy(g);
          EXPECT_EQ(dp_set_current_stream(cpu(0), nullptr), DP_OK);
          EXPECT_EQ(dp_stream_destroy(cpu(0), s), DP_OK);
        });
      }
      for (auto& t : workers) t.join();
      DP_ASSERT_OK(dp_ddp_finish_backward(ddp));
      ASSERT_EQ(seen.buckets.size(), 2u);
      // One bucket per layer; the rebuild after the first iteration follows
      // the marks' order, so compare them by layer.
      std::sort(seen.buckets.begin(), seen.buckets.end());
      std::vector<std::vector<float>> expected = {filled(64, static_cast<float>(100 + 1000 * iteration)),
                                                  filled(64, static_cast<float>(200 + 1000 * iteration))};
      for (size_t b = 0; b < 2; ++b) {
        EXPECT_EQ(seen.buckets[b], expected[b])
            << "bucket " << b << ", iteration " << iteration << ", views " << views
            << ": the reduction read the gradient before the marking thread's stream wrote it";
      }
    }
    dp_ddp_destroy(ddp);
  }
}

}  // namespace

namespace {

TEST_F(StreamOrderDist, MarkOnAStreamThatIsNotOneOfTheParametersDeviceIsEinvalAndMarksNothing) {
  dptest::ModulePtr m = dptest::new_module();
  TensorPtr w = make<float>({8}, std::vector<float>(8, 0.0f));
  DP_ASSERT_OK(dp_module_register_parameter(m.get(), "w", w.get(), 1));
  dp_ddp* ddp = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&ddp, m.get(), pg_, nullptr));
  void* other_device = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(1), &other_device));
  int not_a_stream = 0;
  EXPECT_EQ(dp_ddp_mark_grad_ready_stream(ddp, 0, &not_a_stream), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("argument 'cuda_stream'"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_ddp_mark_grad_ready_stream(ddp, 0, other_device), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("a stream of cpu:1, not of cpu:0"), std::string::npos) << dptest::last_error();
  void* mine = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &mine));
  DP_EXPECT_OK(dp_ddp_mark_grad_ready_stream(ddp, 0, mine));  // the refused marks marked nothing
  DP_EXPECT_OK(dp_ddp_finish_backward(ddp));
  dp_ddp_destroy(ddp);
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), mine));
  DP_EXPECT_OK(dp_stream_destroy(cpu(1), other_device));
}

}  // namespace
