// dp_ddp_rebind: in one process over one-rank groups (arguments, refusals
// that leave the dp_ddp on its group, a failed rebind, another thread's calls
// meanwhile), then across real processes (ddp_worker's rebind scenarios: a
// 4-rank job shrinks to 3 and trains on).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/ddp_test_util.h"
#include "group_util.h"
#include "module/module_test_util.h"
#include "worker_job.h"

namespace {

using dptest::contains;
using dptest::DdpPtr;
using dptest::linear_net;
using dptest::ModulePtr;
using dptest::plan_text;
using dptest::SingleRankGroup;
using dptest::TensorPtr;

const char* const kParams[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"};
constexpr size_t kNumParams = 6;

std::vector<float> grad_values(dp_module* m, const char* name) {
  TensorPtr g = dptest::grad(m, name);
  return g ? dptest::values<float>(g.get()) : std::vector<float>{};
}

// Parameter p's gradient in step `step`: distinct values everywhere.
float grad_value(size_t p, size_t e, int step) { return static_cast<float>(step * 100 + p * 10 + e) + 0.5f; }

// One synced iteration on a one-rank group: the average over one rank is
// the rank's own gradient, which the dp_ddp must leave as it is.
void train_step(dp_ddp* d, dp_module* m, int step) {
  DP_ASSERT_OK(dp_module_zero_grad(m));
  DP_ASSERT_OK(dp_ddp_pre_forward(d));
  // Marked first to last: the first iteration's rebuild reverses the plan.
  for (size_t p = 0; p < kNumParams; ++p) {
    TensorPtr g = dptest::grad(m, kParams[p]);
    ASSERT_NE(g, nullptr);
    auto* data = static_cast<float*>(dp_tensor_data(g.get()));
    for (int64_t e = 0; e < dp_tensor_numel(g.get()); ++e) data[e] = grad_value(p, static_cast<size_t>(e), step);
    DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d, p));
  }
  DP_ASSERT_OK(dp_ddp_finish_backward(d));
  for (size_t p = 0; p < kNumParams; ++p) {
    std::vector<float> got = grad_values(m, kParams[p]);
    for (size_t e = 0; e < got.size(); ++e) ASSERT_EQ(got[e], grad_value(p, e, step)) << kParams[p] << "[" << e << "]";
  }
}

class DdpRebind : public ::testing::Test {
 protected:
  DdpPtr create(dp_module* m, const dp_ddp_options* opts = nullptr) {
    dp_ddp* d = nullptr;
    EXPECT_EQ(dp_ddp_create(&d, m, first_.get(), opts), DP_OK) << dp_last_error();
    return DdpPtr(d);
  }

  SingleRankGroup first_;
  SingleRankGroup second_;
};

TEST_F(DdpRebind, NullOrForeignHandlesAreEinvalNamingTheArgumentAndTheDdpGoesOn) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(dp_ddp_rebind(nullptr, second_.get()), DP_EINVAL);
  EXPECT_TRUE(contains(dp_last_error(), "'ddp'")) << dp_last_error();
  EXPECT_EQ(dp_ddp_rebind(d.get(), nullptr), DP_EINVAL);
  EXPECT_TRUE(contains(dp_last_error(), "'pg'")) << dp_last_error();
  TensorPtr t = dptest::make<float>({2}, {1, 2});
  EXPECT_EQ(dp_ddp_rebind(reinterpret_cast<dp_ddp*>(t.get()), second_.get()), DP_EINVAL);
  EXPECT_TRUE(contains(dp_last_error(), "'ddp' is not a dp_ddp")) << dp_last_error();
  EXPECT_EQ(dp_ddp_rebind(d.get(), reinterpret_cast<dp_process_group*>(d.get())), DP_EINVAL);
  EXPECT_TRUE(contains(dp_last_error(), "'pg' is not a dp_process_group")) << dp_last_error();
  train_step(d.get(), m.get(), 1);
}

TEST_F(DdpRebind, GroupOnAnotherDeviceIsEinvalNamingPgAndTheDdpGoesOn) {
  dptest::GroupOptions on_cpu1;
  on_cpu1.device = dptest::cpu(1);
  SingleRankGroup other_device(on_cpu1);
  ASSERT_NE(other_device.get(), nullptr);
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(dp_ddp_rebind(d.get(), other_device.get()), DP_EINVAL);
  EXPECT_TRUE(contains(dp_last_error(), "'pg'") && contains(dp_last_error(), "cpu:1")) << dp_last_error();
  train_step(d.get(), m.get(), 1);
}

TEST_F(DdpRebind, MidIterationIsEstateAndTheDdpFinishesTheBackwardOnItsGroup) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  DP_ASSERT_OK(dp_ddp_pre_forward(d.get()));
  DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), 5));
  EXPECT_EQ(dp_ddp_rebind(d.get(), second_.get()), DP_ESTATE);
  EXPECT_TRUE(contains(dp_last_error(), "between iterations")) << dp_last_error();
  for (size_t p = 5; p-- > 0;) DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), p));
  DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
  train_step(d.get(), m.get(), 1);
  DP_ASSERT_OK(dp_ddp_rebind(d.get(), second_.get()));
  train_step(d.get(), m.get(), 2);
}

// What a callback on the lane got back from a rebind it tried.
struct InsideRebind {
  dp_ddp* ddp = nullptr;
  dp_process_group* other = nullptr;
  std::vector<dp_status> statuses;
  std::vector<std::string> messages;
  void attempt() {
    statuses.push_back(dp_ddp_rebind(ddp, other));
    messages.emplace_back(dp_last_error());
  }
};

int hook_that_rebinds(void* user_data, dp_process_group* pg, size_t /*bucket*/, dp_tensor* flat) {
  static_cast<InsideRebind*>(user_data)->attempt();
  return dp_pg_all_reduce(pg, flat, DP_AVG) == DP_OK ? 0 : 1;
}

int reported_that_rebinds(void* user_data, dp_ddp* /*ddp*/, size_t /*bucket*/, const size_t* /*params*/, size_t /*n*/) {
  static_cast<InsideRebind*>(user_data)->attempt();
  return 0;
}

TEST_F(DdpRebind, FromInsideACommHookOrOnBucketReducedIsEstateAndTheIterationCompletes) {
  for (bool hook : {true, false}) {
    SCOPED_TRACE(hook ? "comm hook" : "on_bucket_reduced");
    ModulePtr m = linear_net();
    InsideRebind inside;
    dp_ddp_options o = DP_DDP_OPTIONS_INIT;
    if (hook) {
      o.comm_hook = DP_HOOK_CUSTOM;
      o.hook_fn = hook_that_rebinds;
      o.hook_user_data = &inside;
    } else {
      o.on_bucket_reduced = reported_that_rebinds;
      o.on_bucket_reduced_data = &inside;
    }
    DdpPtr d = create(m.get(), &o);
    ASSERT_NE(d, nullptr);
    inside.ddp = d.get();
    inside.other = second_.get();
    train_step(d.get(), m.get(), 1);
    ASSERT_FALSE(inside.statuses.empty());
    for (size_t i = 0; i < inside.statuses.size(); ++i) {
      EXPECT_EQ(inside.statuses[i], DP_ESTATE) << inside.messages[i];
      EXPECT_TRUE(contains(inside.messages[i], "from inside")) << inside.messages[i];
    }
    train_step(d.get(), m.get(), 2);
  }
}

// The plan is kept (even one never rebuilt), the old group may go, and a
// gradient handle taken before follows the views into the new buckets.
TEST_F(DdpRebind, OntoAnotherGroupKeepsThePlanAndTrainingGoesOnAfterTheOldGroupIsGone) {
  for (int views : {0, 1}) {
    SCOPED_TRACE(views ? "gradient_as_bucket_view" : "copies");
    SingleRankGroup old_group;
    SingleRankGroup new_group;
    ModulePtr m = linear_net();
    dp_ddp_options o = DP_DDP_OPTIONS_INIT;
    o.gradient_as_bucket_view = views;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-12;  // a bucket per parameter
    dp_ddp* raw = nullptr;
    DP_ASSERT_OK(dp_ddp_create(&raw, m.get(), old_group.get(), &o));
    DdpPtr d(raw);
    train_step(d.get(), m.get(), 1);
    const std::string plan = plan_text(d.get());
    size_t first = kNumParams, count = 0;
    TensorPtr held = dptest::grad(m.get(), "fc2.weight");
    DP_ASSERT_OK(dp_ddp_rebind(d.get(), new_group.get()));
    ASSERT_EQ(dp_ddp_bucket_parameters(d.get(), 0, &first, 1, &count), DP_OK) << dp_last_error();
    EXPECT_EQ(first, 0u) << "the plan was not the one rebuilt in the ready order";
    EXPECT_EQ(plan_text(d.get()), plan);
    EXPECT_EQ(dp_ddp_num_buckets(d.get()), kNumParams);
    old_group = SingleRankGroup();  // the dp_ddp holds it no more
    for (int step = 2; step < 4; ++step) {
      train_step(d.get(), m.get(), step);
      if (views) {
        EXPECT_EQ(dptest::values<float>(held.get()), grad_values(m.get(), "fc2.weight"));
      }
    }
  }
}

TEST_F(DdpRebind, OntoItsOwnGroupIsAResyncAndTrainingGoesOn) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  train_step(d.get(), m.get(), 1);
  DP_ASSERT_OK(dp_ddp_rebind(d.get(), first_.get()));
  train_step(d.get(), m.get(), 2);
  DP_ASSERT_OK(dp_ddp_set_requires_gradient_sync(d.get(), 0));
  DP_ASSERT_OK(dp_ddp_rebind(d.get(), second_.get()));
  // The no_sync setting is kept: the finish returns at once, gradients accumulate.
  DP_ASSERT_OK(dp_ddp_pre_forward(d.get()));
  for (size_t p = 0; p < kNumParams; ++p) DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), p));
  DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
  dp_ddp_stats stats{};
  stats.struct_size = sizeof(stats);
  DP_ASSERT_OK(dp_ddp_last_stats(d.get(), &stats));
  EXPECT_EQ(stats.backward_ms, 0.0) << "an unsynced backward after the rebind ran reductions";
  int used = 0;
  EXPECT_EQ(dp_ddp_parameter_used(d.get(), 0, &used), DP_ESTATE) << "a synced iteration ran after the rebind";
  DP_ASSERT_OK(dp_ddp_set_requires_gradient_sync(d.get(), 1));
  train_step(d.get(), m.get(), 3);
}

// A group whose first collective fails (aborted): the rebind fails, every
// later call but destroy is DP_ESTATE naming it, and the parameters are free
// for a dp_ddp made anew.
TEST_F(DdpRebind, FailedRebindLeavesOnlyDestroyAndFreesTheParameters) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  train_step(d.get(), m.get(), 1);
  DP_ASSERT_OK(dp_process_group_abort(second_.get()));
  EXPECT_NE(dp_ddp_rebind(d.get(), second_.get()), DP_OK);
  EXPECT_TRUE(contains(dp_last_error(), "only dp_ddp_destroy is left")) << dp_last_error();
  EXPECT_EQ(dp_ddp_pre_forward(d.get()), DP_ESTATE);
  EXPECT_TRUE(contains(dp_last_error(), "failed dp_ddp_rebind")) << dp_last_error();
  EXPECT_EQ(dp_ddp_mark_grad_ready_index(d.get(), 0), DP_ESTATE);
  EXPECT_EQ(dp_ddp_finish_backward(d.get()), DP_ESTATE);
  EXPECT_EQ(dp_ddp_rebind(d.get(), first_.get()), DP_ESTATE);
  EXPECT_EQ(dp_ddp_num_buckets(d.get()), 0u);
  size_t len = 0;
  EXPECT_EQ(dp_ddp_bucket_plan(d.get(), nullptr, 0, &len), DP_ESTATE);
  d.reset();
  DdpPtr again = create(m.get());
  ASSERT_NE(again, nullptr);
  train_step(again.get(), m.get(), 2);
}

// A comm hook that blocks until released.
struct BlockingHook {
  std::mutex mutex;
  std::condition_variable cv;
  bool released = false;
  void release() {
    std::lock_guard<std::mutex> lock(mutex);
    released = true;
    cv.notify_all();
  }
};

int blocking_hook(void* user_data, dp_process_group* pg, size_t /*bucket*/, dp_tensor* flat) {
  auto* hook = static_cast<BlockingHook*>(user_data);
  std::unique_lock<std::mutex> lock(hook->mutex);
  hook->cv.wait(lock, [&] { return hook->released; });
  return dp_pg_all_reduce(pg, flat, DP_AVG) == DP_OK ? 0 : 1;
}

// A finish_backward that timed out (a hook that never returns) leaves the
// dp_ddp broken with its marks standing and its group's lane stuck: a
// rebind is how it goes on, not a refusal mid-iteration, and it waits for
// nothing on the old lane.
TEST(DdpRebindTimedOut, AfterAFinishTimedOutTheDdpRebindsOntoAnotherGroupAndTrainsOn) {
  dptest::GroupOptions short_timeout;
  short_timeout.timeout_ms = 500;
  SingleRankGroup stuck(short_timeout);
  SingleRankGroup fresh;
  BlockingHook hook;
  ModulePtr m = linear_net();
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.comm_hook = DP_HOOK_CUSTOM;
  o.hook_fn = blocking_hook;
  o.hook_user_data = &hook;
  dp_ddp* raw = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&raw, m.get(), stuck.get(), &o));
  DdpPtr d(raw);
  DP_ASSERT_OK(dp_ddp_pre_forward(d.get()));
  for (size_t p = 0; p < kNumParams; ++p) DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), p));
  EXPECT_EQ(dp_ddp_finish_backward(d.get()), DP_ETIMEOUT);
  EXPECT_EQ(dp_ddp_rebind(d.get(), fresh.get()), DP_OK) << dp_last_error();
  hook.release();  // the old lane's job ends; the new reducer has its own lane
  train_step(d.get(), m.get(), 1);
}

// Another thread calls the dp_ddp throughout (as a hostile or careless host
// would, against the contract): each call runs on the old or the new reducer
// or is refused, never on a freed one (ASan), and nothing hangs.
TEST_F(DdpRebind, CallsFromAnotherThreadDuringRebindsSucceedOrAreEstate) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  std::atomic<bool> stop{false};
  std::atomic<int> unexpected{0};
  std::atomic<long> calls{0};
  std::string first_unexpected;
  std::thread hammer([&] {
    size_t indices[8];
    std::vector<char> text(4096);
    while (!stop.load()) {
      size_t count = 0;
      size_t len = 0;
      int used = 0;
      dp_ddp_stats stats{};
      stats.struct_size = sizeof(stats);
      const dp_status statuses[] = {
          dp_ddp_bucket_parameters(d.get(), 0, indices, 8, &count),
          dp_ddp_bucket_plan(d.get(), text.data(), text.size(), &len),
          dp_ddp_last_stats(d.get(), &stats),
          dp_ddp_parameter_used(d.get(), 0, &used),
          dp_ddp_set_requires_gradient_sync(d.get(), 1),
      };
      for (dp_status st : statuses) {
        // DP_ESTATE: a backward in progress, the call overlapping the
        // rebind, or parameter_used before the new reducer's first iteration.
        if (st != DP_OK && st != DP_ESTATE && unexpected.fetch_add(1) == 0) first_unexpected = dp_last_error();
      }
      if (dp_ddp_num_buckets(d.get()) == 0 && unexpected.fetch_add(1) == 0) first_unexpected = dp_last_error();
      calls.fetch_add(1);
    }
  });
  for (int round = 0; round < 40; ++round) {
    dp_process_group* target = round % 2 == 0 ? second_.get() : first_.get();
    ASSERT_EQ(dp_ddp_rebind(d.get(), target), DP_OK) << "round " << round << ": " << dp_last_error();
    train_step(d.get(), m.get(), round);
  }
  stop.store(true);
  hammer.join();
  EXPECT_EQ(unexpected.load(), 0) << first_unexpected;
  EXPECT_GT(calls.load(), 0);
}

// ---- across processes: ddp_worker's rebind scenarios ----

using Ranks = dptest::WorkerRun;

Ranks passing(const std::string& scenario, int world, std::vector<std::string> env = {}) {
  Ranks run = dptest::run_worker(DP_DDP_WORKER, scenario, world, std::move(env), std::chrono::seconds(90));
  dptest::expect_passed(run, scenario, world);
  return run;
}

TEST(DdpRebindProcesses, FourRanksOnGlooShrinkToThreeAverageOverThreeAndTakeRankZerosParameters) {
  Ranks run = passing("rebind_shrink", 4, {"DP_SHM=0"});
  for (size_t r = 0; r < 3; ++r) dptest::expect_mentions(run, r, {"rebind onto a group of 3 over gloo"});
}

TEST(DdpRebindProcesses, FourRanksOnSharedMemoryShrinkToThreeAverageOverThreeAndTakeRankZerosParameters) {
  Ranks run = passing("rebind_shrink", 4);
  for (size_t r = 0; r < 3; ++r) dptest::expect_mentions(run, r, {"rebind onto a group of 3 over shm"});
}

TEST(DdpRebindProcesses, BucketViewsUsedMapAndStaticGraphGoOnOverTheShrunkGroup) {
  passing("rebind_shrink_view", 4);
  passing("rebind_shrink_view", 4, {"DP_SHM=0"});
}

TEST(DdpRebindProcesses, CustomHookIsGivenTheShrunkGroupAndARebindFromInsideItIsEstate) {
  Ranks run = passing("rebind_shrink_hook", 4);
  for (size_t r = 0; r < 3; ++r) dptest::expect_mentions(run, r, {"rebind inside the comm hook: status -8"});
}

// The old group is broken (a peer died); its timeout (120 s) is past the
// run's limit, so a rebind that waited for it would be killed.
TEST(DdpRebindProcesses, AfterAPeerDiedOnGlooTheSurvivorsShrinkTheGroupRebindOntoItAndTrainOn) {
  Ranks run = passing("rebind_after_peer_died", 3, {"DP_SHM=0"});
  for (size_t r = 0; r < 2; ++r) {
    dptest::expect_mentions(run, r, {"finish with rank 2 dead: status", "rebind onto the survivors over gloo"});
  }
}

TEST(DdpRebindProcesses, AfterAPeerDiedOnSharedMemoryTheSurvivorsShrinkTheGroupRebindOntoItAndTrainOn) {
  Ranks run = passing("rebind_after_peer_died", 3);
  for (size_t r = 0; r < 2; ++r) {
    dptest::expect_mentions(run, r, {"finish with rank 2 dead: status", "rebind onto the survivors over shm"});
  }
}

TEST(DdpRebindProcesses, RebindOntoAGroupOneRankAbortedFailsOnBothRanksAndLeavesOnlyDestroy) {
  Ranks run = passing("rebind_failed", 2);
  for (size_t r = 0; r < 2; ++r) dptest::expect_mentions(run, r, {"pre_forward after it: status -8"});
}

}  // namespace
