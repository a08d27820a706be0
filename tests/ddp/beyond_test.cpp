// DDP beyond PyTorch's: the optimizer inside backward (on_bucket_reduced),
// dp_ddp_parameter_used, a plan that persists (dp_ddp_bucket_plan and the
// bucket_plan option) and static_graph. Ranks are threads of this process,
// each with its own group over one file store: real collectives, and the
// test sees every rank's results.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ddp/ddp_test_util.h"
#include "module/module_test_util.h"
#include "test_util.h"
#include "thread_ranks.h"

using dptest::cpu;
using dptest::DdpPtr;
using dptest::make;
using dptest::plan_text;
using dptest::TensorPtr;
using dptest::values;

namespace {

void run_ranks(int world, const std::function<void(int, dp_process_group*)>& body, int32_t backend = DP_BACKEND_AUTO) {
  dptest::RankOptions options;
  options.backend = backend;
  dptest::run_thread_ranks("ddp_beyond_", world, options, body);
}

// Three layers' weights "a", "b", "c" of 4, 3 and 2 floats, values start+i.
dptest::ModulePtr three_params(float start) {
  dptest::ModulePtr m = dptest::new_module();
  const int64_t sizes[] = {4, 3, 2};
  const char* names[] = {"a", "b", "c"};
  for (int i = 0; i < 3; ++i) {
    std::vector<float> v(static_cast<size_t>(sizes[i]));
    for (size_t k = 0; k < v.size(); ++k) v[k] = start + static_cast<float>(k);
    TensorPtr t = make<float>({sizes[i]}, v);
    EXPECT_EQ(dp_module_register_parameter(m.get(), names[i], t.get(), 1), DP_OK) << dp_last_error();
  }
  return m;
}

std::vector<float> grad_of(dp_module* m, const char* name) {
  dp_tensor* g = nullptr;
  EXPECT_EQ(dp_module_grad(m, name, &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  return values<float>(g);
}

void set_grad(dp_module* m, const char* name, float value) {
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_module_grad(m, name, &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  std::vector<float> v(static_cast<size_t>(dp_tensor_numel(g)), value);
  ASSERT_EQ(dp_tensor_copy_from_host(g, v.data(), v.size() * sizeof(float)), DP_OK);
}

std::vector<float> param_of(dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << dp_last_error();
  TensorPtr owned(p);
  return values<float>(p);
}

// One bucket per parameter.
dp_ddp_options small_buckets() {
  dp_ddp_options o;
  dp_ddp_options_init(&o, sizeof o);
  o.bucket_cap_mb = 4.0 * sizeof(float) / 1048576.0;
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  return o;
}

// ---- the optimizer inside backward ----

// SGD, or Adam with its moments per parameter, written here.
struct Sgd {
  dp_module* module = nullptr;
  bool adam = false;
  float lr = 0.5f;
  std::mutex mutex;
  std::vector<int> reported = std::vector<int>(3, 0);
  std::vector<std::vector<float>> first = std::vector<std::vector<float>>(3), second = first;
  std::vector<int> steps = std::vector<int>(3, 0);
  int fail_bucket = -1;
};

const char* const kNames[] = {"a", "b", "c"};

// SGD on the reported parameters, in place, from the averaged gradients.
int sgd_step(void* user_data, dp_ddp* ddp, size_t bucket, const size_t* params, size_t n) {
  auto* sgd = static_cast<Sgd*>(user_data);
  if (static_cast<int>(bucket) == sgd->fail_bucket) return 7;
  for (size_t i = 0; i < n; ++i) {
    int used = 0;
    if (dp_ddp_parameter_used(ddp, params[i], &used) != DP_OK) return 1;
    {
      std::lock_guard<std::mutex> lock(sgd->mutex);
      ++sgd->reported[params[i]];
    }
    dp_tensor* p = nullptr;
    dp_tensor* g = nullptr;
    if (dp_module_get_parameter(sgd->module, kNames[params[i]], &p) != DP_OK) return 2;
    if (dp_module_grad(sgd->module, kNames[params[i]], &g) != DP_OK) return 3;
    auto* pv = static_cast<float*>(dp_tensor_data(p));
    const auto* gv = static_cast<const float*>(dp_tensor_data(g));
    const auto n_elems = static_cast<size_t>(dp_tensor_numel(p));
    if (!sgd->adam) {
      for (size_t k = 0; k < n_elems; ++k) pv[k] -= sgd->lr * gv[k];
    } else if (used != 0) {  // Adam skips what no rank used
      const size_t at = params[i];
      std::vector<float>& m = sgd->first[at];
      std::vector<float>& v = sgd->second[at];
      m.resize(n_elems, 0.0f);
      v.resize(n_elems, 0.0f);
      const int t = ++sgd->steps[at];
      for (size_t k = 0; k < n_elems; ++k) {
        m[k] = 0.9f * m[k] + 0.1f * gv[k];
        v[k] = 0.999f * v[k] + 0.001f * gv[k] * gv[k];
        float m_hat = m[k] / (1.0f - std::pow(0.9f, static_cast<float>(t)));
        float v_hat = v[k] / (1.0f - std::pow(0.999f, static_cast<float>(t)));
        pv[k] -= 0.01f * m_hat / (std::sqrt(v_hat) + 1e-8f);
      }
    }
    dp_tensor_destroy(p);
    dp_tensor_destroy(g);
  }
  return 0;
}

class DdpOptimizerInBackwardParity : public ::testing::TestWithParam<bool> {};

TEST_P(DdpOptimizerInBackwardParity,
       StepsInsideBackwardMatchStepsAfterFinishAndReportEachParameterOncePerSyncedIteration) {
  std::vector<std::vector<float>> inside(2), after(2);
  for (int mode = 0; mode < 2; ++mode) {
    run_ranks(2, [&](int rank, dp_process_group* pg) {
      dptest::ModulePtr m = three_params(1.0f);
      Sgd sgd;
      sgd.module = m.get();
      sgd.adam = GetParam();
      dp_ddp_options o = small_buckets();
      if (mode == 0) {
        o.on_bucket_reduced = sgd_step;
        o.on_bucket_reduced_data = &sgd;
      }
      dp_ddp* raw = nullptr;
      ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
      DdpPtr ddp(raw);
      for (int it = 0; it < 4; ++it) {
        const bool synced = it != 1;  // iteration 1 accumulates without sync
        ASSERT_EQ(dp_ddp_set_requires_gradient_sync(ddp.get(), synced ? 1 : 0), DP_OK);
        for (const char* name : kNames) set_grad(m.get(), name, static_cast<float>((rank + 1) * (it + 1)));
        for (const char* name : {"c", "b", "a"})
          ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
        if (mode == 1 && synced) {
          int out[3] = {};
          for (size_t i = 0; i < 3; ++i) ASSERT_EQ(dp_ddp_parameter_used(ddp.get(), i, &out[i]), DP_OK);
          sgd.module = m.get();
          for (size_t i = 0; i < 3; ++i) sgd_step(&sgd, ddp.get(), 0, &i, 1);
        }
        if (mode == 0) {
          int expected = it == 0 ? 1 : it == 1 ? 1 : it == 2 ? 2 : 3;
          for (int p = 0; p < 3; ++p) EXPECT_EQ(sgd.reported[p], expected) << "parameter " << p << " iteration " << it;
        }
      }
      std::vector<float>& out = mode == 0 ? inside[rank] : after[rank];
      for (const char* name : kNames) {
        std::vector<float> v = param_of(m.get(), name);
        out.insert(out.end(), v.begin(), v.end());
      }
    });
  }
  EXPECT_EQ(inside[0], after[0]);
  EXPECT_EQ(inside[1], after[1]);
  EXPECT_EQ(inside[0], inside[1]) << "every rank stepped with the same averages";
  EXPECT_NE(inside[0], std::vector<float>({1, 2, 3, 4, 1, 2, 3, 1, 2})) << "the steps moved the parameters";
}

INSTANTIATE_TEST_SUITE_P(SgdAndAdam, DdpOptimizerInBackwardParity, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Adam" : "Sgd"; });

TEST(DdpOptimizerInBackward, ANonZeroReturnIsEuserNamingTheBucketAndTheGradientsStayAveraged) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    Sgd sgd;
    sgd.module = m.get();
    sgd.fail_bucket = rank == 1 ? 1 : -1;
    dp_ddp_options o = small_buckets();
    o.on_bucket_reduced = sgd_step;
    o.on_bucket_reduced_data = &sgd;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    for (const char* name : kNames) set_grad(m.get(), name, static_cast<float>(rank * 2));
    for (const char* name : {"c", "b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
    dp_status st = dp_ddp_finish_backward(ddp.get());
    if (rank == 1) {
      EXPECT_EQ(st, DP_EUSER);
      EXPECT_NE(dptest::last_error().find("on_bucket_reduced returned 7 for bucket 1"), std::string::npos)
          << dptest::last_error();
    } else {
      EXPECT_EQ(st, DP_OK) << dp_last_error();
    }
    EXPECT_EQ(grad_of(m.get(), "b"), std::vector<float>(3, 1.0f)) << "averaged all the same";
    // The next iteration runs normally.
    sgd.fail_bucket = -1;
    for (const char* name : {"c", "b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
    EXPECT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
  });
}

TEST(DdpShutdown, EndsIdleCommLanesAndTheNextStepStartsThemAgain) {
  std::atomic<int> finished_first{0};
  std::atomic<bool> shut_down{false};
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    for (int step = 0; step < 2; ++step) {
      ASSERT_EQ(dp_ddp_pre_forward(ddp.get()), DP_OK) << dp_last_error();
      for (const char* name : kNames) set_grad(m.get(), name, static_cast<float>(rank + 1 + step));
      for (const char* name : {"c", "b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
      ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
      EXPECT_EQ(grad_of(m.get(), "a"), std::vector<float>(4, 1.5f + static_cast<float>(step))) << "step " << step;
      if (step > 0) break;
      // Both ranks idle between steps: rank 0's dp_shutdown ends both lanes.
      finished_first.fetch_add(1);
      if (rank == 0) {
        while (finished_first.load() < 2) std::this_thread::yield();
        EXPECT_EQ(dptest::threads_named("dp-lane"), 2);
        EXPECT_EQ(dp_shutdown(), DP_OK) << dp_last_error();
        EXPECT_EQ(dptest::threads_named("dp-lane"), 0);
        shut_down = true;
      }
      while (!shut_down.load()) std::this_thread::yield();
    }
    EXPECT_GE(dptest::threads_named("dp-lane"), 1) << "the second step started this rank's lane again";
  });
}

int calls_finish(void* user_data, dp_ddp* ddp, size_t, const size_t*, size_t) {
  auto* status = static_cast<std::atomic<int>*>(user_data);
  status->store(dp_ddp_finish_backward(ddp));
  return 0;
}

TEST(DdpOptimizerInBackward, TheCallbackMayReadTheDdpButOtherDdpCallsAreEstate) {
  run_ranks(1, [&](int, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    std::atomic<int> status{-100};
    dp_ddp_options o = small_buckets();
    o.on_bucket_reduced = calls_finish;
    o.on_bucket_reduced_data = &status;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    for (const char* name : {"c", "b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
    EXPECT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(status.load(), DP_ESTATE);
  });
}

struct Reports {
  std::mutex mutex;
  std::vector<int> count = std::vector<int>(3, 0);
  std::vector<int> used = std::vector<int>(3, -1);
  std::vector<std::vector<float>> grads = std::vector<std::vector<float>>(3);
  dp_module* module = nullptr;
};

int record_report(void* user_data, dp_ddp* ddp, size_t, const size_t* params, size_t n) {
  auto* r = static_cast<Reports*>(user_data);
  std::lock_guard<std::mutex> lock(r->mutex);
  for (size_t i = 0; i < n; ++i) {
    ++r->count[params[i]];
    if (dp_ddp_parameter_used(ddp, params[i], &r->used[params[i]]) != DP_OK) return 1;
    r->grads[params[i]] = grad_of(r->module, kNames[params[i]]);
  }
  return 0;
}

TEST(DdpOptimizerInBackward, ComposesWithFindUnusedParametersBucketViewsAndTheFp16Hook) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    Reports reports;
    reports.module = m.get();
    dp_ddp_options o = small_buckets();
    o.find_unused_parameters = 1;
    o.gradient_as_bucket_view = 1;
    o.comm_hook = DP_HOOK_FP16;
    o.on_bucket_reduced = record_report;
    o.on_bucket_reduced_data = &reports;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    // Rank 0 uses "a", rank 1 uses "b"; nobody uses "c".
    const char* mine = rank == 0 ? "a" : "b";
    set_grad(m.get(), mine, 4.0f);
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), mine), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(reports.count, std::vector<int>({1, 1, 1}));
    EXPECT_EQ(reports.used, std::vector<int>({1, 1, 0}));
    EXPECT_EQ(reports.grads[0], std::vector<float>(4, 2.0f)) << "rank 0's 4 and rank 1's zeros, averaged";
    EXPECT_EQ(reports.grads[1], std::vector<float>(3, 2.0f));
  });
}

// ---- parameter_used ----

TEST(DdpParameterUsed, SaysWhetherAnyRankUsedEachParameterInTheLastSyncedIteration) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    o.find_unused_parameters = 1;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    int used = -1;
    EXPECT_EQ(dp_ddp_parameter_used(ddp.get(), 0, &used), DP_ESTATE);
    // Rank 0 uses "a" (index 0), rank 1 uses "b"; nobody uses "c".
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), rank == 0 ? "a" : "b"), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_EQ(dp_ddp_parameter_used(ddp.get(), i, &used), DP_OK) << dp_last_error();
      EXPECT_EQ(used, i < 2 ? 1 : 0) << "parameter " << i;
    }
    EXPECT_EQ(dp_ddp_parameter_used(ddp.get(), 3, &used), DP_EINVAL);
    EXPECT_EQ(dp_ddp_parameter_used(ddp.get(), 0, nullptr), DP_EINVAL);
  });
}

// ---- gradients in shared memory ----

// On a shared-memory group, gradients the library allocates for a dp_ddp
// live in a region every rank maps, and the averaging reads the other
// ranks' values there; a rank whose host gave a gradient memory of its own
// before create keeps it, and every rank then averages through the slots.
// Either way every rank ends with the exact average, in the memory its
// gradient handles name, over several steps and 2 or 3 ranks. The
// gradients (about 200 KB) are past the size reduced whole through the slots.
class DdpSharedGradients : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(DdpSharedGradients, AreAveragedExactlyWhereverEachRanksGradientsLie) {
  const auto [world, host_grad_on_rank_0] = GetParam();
  dptest::RankOptions options;
  options.backend = DP_BACKEND_SHM;
  dptest::run_thread_ranks(
      "ddp_shared_grads_", world, options,
      [&, world = world, host = host_grad_on_rank_0](int rank, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        const int64_t sizes[] = {30000, 20001, 7};
        const char* names[] = {"a", "b", "c"};
        for (int i = 0; i < 3; ++i) {
          TensorPtr t = make<float>({sizes[i]}, std::vector<float>(static_cast<size_t>(sizes[i]), 1.0f));
          ASSERT_EQ(dp_module_register_parameter(m.get(), names[i], t.get(), 1), DP_OK) << dp_last_error();
        }
        std::vector<float> own(static_cast<size_t>(sizes[1]), 0.0f);
        if (host && rank == 0) {
          dp_tensor* g = nullptr;
          ASSERT_EQ(dp_tensor_from_blob(&g, own.data(), DP_FLOAT32, 1, &sizes[1], cpu(0), nullptr, nullptr), DP_OK);
          TensorPtr owned(g);
          ASSERT_EQ(dp_module_set_grad(m.get(), "b", g), DP_OK) << dp_last_error();
        }
        dp_ddp* raw = nullptr;
        ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        DdpPtr ddp(raw);
        auto value = [](int r, int step, size_t k) { return static_cast<float>((r + 1) * (step + 2)) + k % 5 * 0.25f; };
        for (int step = 0; step < 3; ++step) {
          for (int i = 0; i < 3; ++i) {
            dp_tensor* g = nullptr;
            ASSERT_EQ(dp_module_grad(m.get(), names[i], &g), DP_OK) << dp_last_error();
            TensorPtr owned(g);
            std::vector<float> v(static_cast<size_t>(sizes[i]));
            for (size_t k = 0; k < v.size(); ++k) v[k] = value(rank, step, k);
            ASSERT_EQ(dp_tensor_copy_from_host(g, v.data(), v.size() * sizeof(float)), DP_OK);
          }
          for (int i = 2; i >= 0; --i) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), names[i]), DP_OK) << dp_last_error();
          ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
          for (int i = 0; i < 3; ++i) {
            std::vector<float> got = grad_of(m.get(), names[i]);
            for (size_t k = 0; k < got.size(); ++k) {
              float sum = 0.0f;
              for (int r = 0; r < world; ++r) sum += value(r, step, k);
              ASSERT_EQ(got[k], sum / static_cast<float>(world)) << names[i] << "[" << k << "] at step " << step;
            }
          }
          if (host && rank == 0) {
            EXPECT_EQ(own, grad_of(m.get(), "b")) << "the host's own memory holds the average";
          }
        }
      });
}

// A dp_ddp made again over a module whose gradients all exist (the first
// one's, in its region) makes no second region, which no rank would place a
// gradient in: with DP_DEBUG each rank reports one region, the first
// dp_ddp's, and training stays exact.
TEST(DdpSharedGradients, ASecondDdpOverGradientsThatAllExistMakesNoRegion) {
  dptest::RankOptions options;
  options.backend = DP_BACKEND_SHM;
  const int64_t n = 100000;  // 400 KB of gradients per rank
  ::setenv("DP_DEBUG", "INFO", 1);
  testing::internal::CaptureStderr();
  dptest::run_thread_ranks("ddp_second_", 2, options, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr t = make<float>({n}, std::vector<float>(static_cast<size_t>(n), 1.0f));
    ASSERT_EQ(dp_module_register_parameter(m.get(), "w", t.get(), 1), DP_OK) << dp_last_error();
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
    dp_ddp_destroy(raw);
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    set_grad(m.get(), "w", static_cast<float>(rank + 1));
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), "w"), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(grad_of(m.get(), "w"), std::vector<float>(static_cast<size_t>(n), 1.5f));
  });
  const std::string log = testing::internal::GetCapturedStderr();
  ::unsetenv("DP_DEBUG");
  size_t regions = 0;
  for (size_t at = log.find("in a shared region"); at != std::string::npos;
       at = log.find("in a shared region", at + 1)) {
    ++regions;
  }
  EXPECT_EQ(regions, 2u) << log;
}

// A host that swaps two gradients through dp_module_grad handles (each
// handle follows its parameter, so the swap leaves both on one memory), or
// sets a gradient over another parameter's value, would have that memory
// reduced twice on its rank alone: the iteration fails on every rank, this
// one naming both parameters, and the next one, apart again, is exact.
TEST(DdpGradientsApart, OverlappingGradientsFailTheIterationOnEveryRankNamingBoth) {
  dptest::RankOptions options;
  options.backend = DP_BACKEND_SHM;
  dptest::run_thread_ranks("ddp_apart_", 2, options, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    const char* names[] = {"a", "b", "c"};
    const int64_t n = 40000;  // past the size reduced whole through the slots
    for (const char* name : names) {
      TensorPtr t = make<float>({n}, std::vector<float>(static_cast<size_t>(n), 1.0f));
      ASSERT_EQ(dp_module_register_parameter(m.get(), name, t.get(), 1), DP_OK) << dp_last_error();
    }
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    auto step = [&](float base) {
      for (int i = 0; i < 3; ++i)
        set_grad(m.get(), names[i], base * static_cast<float>(rank + 1) + static_cast<float>(i));
      for (int i = 2; i >= 0; --i) EXPECT_EQ(dp_ddp_mark_grad_ready(ddp.get(), names[i]), DP_OK) << dp_last_error();
      return dp_ddp_finish_backward(ddp.get());
    };
    auto expect_averaged = [&](float base) {
      for (int i = 0; i < 3; ++i) {
        const float want = base * 1.5f + static_cast<float>(i);  // ranks 1 and 2 times base, averaged
        EXPECT_EQ(grad_of(m.get(), names[i]), std::vector<float>(static_cast<size_t>(n), want)) << names[i];
      }
    };
    ASSERT_EQ(step(2.0f), DP_OK) << dp_last_error();
    expect_averaged(2.0f);

    std::vector<float> own(static_cast<size_t>(n), 0.0f);
    if (rank == 1) {
      dp_tensor* ga = nullptr;
      dp_tensor* gb = nullptr;
      ASSERT_EQ(dp_module_grad(m.get(), "a", &ga), DP_OK);
      ASSERT_EQ(dp_module_grad(m.get(), "b", &gb), DP_OK);
      TensorPtr owned_a(ga), owned_b(gb);
      ASSERT_EQ(dp_module_set_grad(m.get(), "a", gb), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_module_set_grad(m.get(), "b", ga), DP_OK) << dp_last_error();
    }
    dp_status s = step(4.0f);
    const std::string error = dp_last_error();
    if (rank == 1) {
      EXPECT_EQ(s, DP_ESTATE) << error;
      EXPECT_NE(error.find("parameter 'a'"), std::string::npos) << error;
      EXPECT_NE(error.find("parameter 'b'"), std::string::npos) << error;
      EXPECT_NE(error.find("share memory"), std::string::npos) << error;
      // Apart again: b in memory of the host's own.
      dp_tensor* g = nullptr;
      ASSERT_EQ(dp_tensor_from_blob(&g, own.data(), DP_FLOAT32, 1, &n, cpu(0), nullptr, nullptr), DP_OK);
      TensorPtr owned(g);
      ASSERT_EQ(dp_module_set_grad(m.get(), "b", g), DP_OK) << dp_last_error();
    } else {
      EXPECT_EQ(s, DP_EINVAL) << error;
      EXPECT_NE(error.find("rank 1"), std::string::npos) << error;
    }
    ASSERT_EQ(step(6.0f), DP_OK) << dp_last_error();
    expect_averaged(6.0f);
    if (rank == 1) {
      EXPECT_EQ(own, std::vector<float>(static_cast<size_t>(n), 6.0f * 1.5f + 1.0f));
    }

    // A gradient over another parameter's value.
    if (rank == 0) {
      dp_tensor* value = nullptr;
      ASSERT_EQ(dp_module_get_parameter(m.get(), "a", &value), DP_OK);
      TensorPtr owned_value(value);
      dp_tensor* over = nullptr;
      ASSERT_EQ(dp_tensor_from_blob(&over, dp_tensor_data(value), DP_FLOAT32, 1, &n, cpu(0), nullptr, nullptr), DP_OK);
      TensorPtr owned(over);
      ASSERT_EQ(dp_module_set_grad(m.get(), "c", over), DP_OK) << dp_last_error();
    }
    s = step(8.0f);
    const std::string second = dp_last_error();
    if (rank == 0) {
      EXPECT_EQ(s, DP_ESTATE) << second;
      EXPECT_NE(second.find("the value of parameter 'a'"), std::string::npos) << second;
      EXPECT_NE(second.find("the gradient of parameter 'c'"), std::string::npos) << second;
      EXPECT_EQ(param_of(m.get(), "a"), std::vector<float>(static_cast<size_t>(n), 1.0f * 8.0f + 2.0f))
          << "the value holds this rank's own gradient of c, not an average";
    } else {
      EXPECT_EQ(s, DP_EINVAL) << second;
    }
  });
}

// A forked child that drops its copy of a dp_ddp's shared gradients only
// unmaps them: the region stays the parent's, so a second dp_ddp's region
// is other memory and the first one's gradients keep their values. Rank 1
// gives its gradients its own memory first, so that rank 0's are the last
// hold on the region.
TEST(DdpSharedGradientsFork, AChildDroppingItsGradientsLeavesTheParentsRegionAlone) {
  dptest::RankOptions options;
  options.backend = DP_BACKEND_SHM;
  const int64_t n = 50000;
  dptest::run_thread_ranks("ddp_shared_fork_", 2, options, [&](int rank, dp_process_group* pg) {
    auto make_module = [&] {
      dptest::ModulePtr m = dptest::new_module();
      TensorPtr t = make<float>({n}, std::vector<float>(static_cast<size_t>(n), 1.0f));
      EXPECT_EQ(dp_module_register_parameter(m.get(), "w", t.get(), 1), DP_OK) << dp_last_error();
      return m;
    };
    auto fill_grad = [&](dp_module* m, float v) {
      dp_tensor* g = nullptr;
      ASSERT_EQ(dp_module_grad(m, "w", &g), DP_OK) << dp_last_error();
      TensorPtr owned(g);
      std::vector<float> values(static_cast<size_t>(n), v);
      ASSERT_EQ(dp_tensor_copy_from_host(g, values.data(), values.size() * sizeof(float)), DP_OK);
    };
    dptest::ModulePtr a = make_module();
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, a.get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr first(raw);
    if (rank == 1) {
      TensorPtr own = make<float>({n}, std::vector<float>(static_cast<size_t>(n), 0.0f));
      ASSERT_EQ(dp_module_set_grad(a.get(), "w", own.get()), DP_OK) << dp_last_error();
    }
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK) << dp_last_error();
    if (rank == 0) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::_exit(dp_module_set_grad(a.get(), "w", nullptr) == DP_OK ? 0 : 1);
      }
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    }
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK) << dp_last_error();
    dptest::ModulePtr b = make_module();
    ASSERT_EQ(dp_ddp_create(&raw, b.get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr second(raw);
    fill_grad(a.get(), static_cast<float>(rank + 1));
    fill_grad(b.get(), 10.0f);
    EXPECT_EQ(grad_of(a.get(), "w"), std::vector<float>(static_cast<size_t>(n), static_cast<float>(rank + 1)))
        << "the second dp_ddp's gradients are the first's memory";
    ASSERT_EQ(dp_ddp_mark_grad_ready(first.get(), "w"), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_ddp_finish_backward(first.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(grad_of(a.get(), "w"), std::vector<float>(static_cast<size_t>(n), 1.5f));
    EXPECT_EQ(grad_of(b.get(), "w"), std::vector<float>(static_cast<size_t>(n), 10.0f));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DdpSharedGradients, ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& param) {
                           return std::to_string(std::get<0>(param.param)) + "Ranks" +
                                  (std::get<1>(param.param) ? "HostGradientOnRank0" : "LibraryGradients");
                         });

// ---- a plan that persists ----

TEST(DdpBucketPlan, TheTextStartsANewDdpWithTheSamePlanWhichStaysFinal) {
  std::string first_plan;
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    // The first iteration's ready order (b, a, c) becomes the plan; b (12 bytes) is below the
    // 16-byte cap, so a joins its bucket.
    for (const char* name : {"b", "a", "c"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    std::string text = plan_text(ddp.get());
    EXPECT_NE(text.find("bucket float32 b a\nbucket float32 c\n"), std::string::npos) << text;
    if (rank == 0) first_plan = text;
  });
  run_ranks(2, [&](int, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    o.bucket_plan = first_plan.c_str();
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    EXPECT_EQ(plan_text(ddp.get()), first_plan);
    for (const char* name : {"c", "a", "b"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(plan_text(ddp.get()), first_plan) << "a given plan is final";
    char small[8];
    size_t len = 0;
    EXPECT_EQ(dp_ddp_bucket_plan(ddp.get(), small, sizeof small, &len), DP_EINVAL);
    EXPECT_EQ(len, first_plan.size());
  });
}

TEST(DdpBucketPlan, APlanThatDoesNotFitTheModuleIsEinvalNamingTheDifference) {
  run_ranks(1, [&](int, dp_process_group* pg) {
    const std::pair<const char*, const char*> cases[] = {
        {"bucket float32 a b\nbucket float32 c x\n", "'x' is not a parameter this dp_ddp manages"},
        {"bucket float32 a b\n", "leaves out 1 managed parameter(s): 'c'"},
        {"bucket float32 a b\nbucket float32 c a\n", "'a' is already in bucket 0"},
        {"bucket float16 a b c\n", "'a' is float32 but its bucket is float16"},
        {"bucket\n", "expected 'bucket <dtype> <names...>'"},
        {"bucket float32 a%2 b c\n", "a '%' not followed by two hex digits"},
        {"bucket int9 a b c\n", "unknown dtype 'int9'"},
    };
    for (const auto& [plan, expected] : cases) {
      dptest::ModulePtr m = three_params(0.0f);
      dp_ddp_options o = small_buckets();
      o.init_sync = 0;
      o.bucket_plan = plan;
      dp_ddp* raw = nullptr;
      EXPECT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_EINVAL) << plan;
      EXPECT_EQ(raw, nullptr);
      EXPECT_NE(dptest::last_error().find(expected), std::string::npos) << dptest::last_error();
      EXPECT_NE(dptest::last_error().find("opts->bucket_plan"), std::string::npos) << dptest::last_error();
    }
  });
}

TEST(DdpBucketPlan, RanksGivenDifferentPlansFailOnEveryRankAtCreate) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    o.bucket_plan = rank == 0 ? "bucket float32 a b c\n" : "bucket float32 c b a\n";
    dp_ddp* raw = nullptr;
    EXPECT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_EINVAL);
    EXPECT_NE(dptest::last_error().find("rank 1 disagrees with rank 0"), std::string::npos) << dptest::last_error();
  });
}

TEST(DdpBucketPlan, NamesWithSpacesAndPercentSignsRoundTrip) {
  run_ranks(1, [&](int, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr x = make<float>({2}, {1, 2}), y = make<float>({2}, {1, 2});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "my weight", x.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "100%", y.get(), 1), DP_OK);
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
    std::string text = plan_text(raw);
    dp_ddp_destroy(raw);
    EXPECT_NE(text.find("my%20weight"), std::string::npos) << text;
    EXPECT_NE(text.find("100%25"), std::string::npos) << text;
    dp_ddp_options o = small_buckets();
    o.bucket_plan = text.c_str();
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    EXPECT_EQ(plan_text(raw), text);
    dp_ddp_destroy(raw);
  });
}

// ---- static graph ----

// Two ranks, find_unused_parameters and static_graph; "c" unused everywhere.
void static_graph_iterations(const std::function<void(int rank, dp_ddp*, dptest::ModulePtr&)>& third) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    o.find_unused_parameters = 1;
    o.static_graph = 1;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    for (int it = 0; it < 2; ++it) {
      set_grad(m.get(), "c", 5.0f);
      for (const char* name : {"a", "b"}) set_grad(m.get(), name, static_cast<float>(rank * 2 + it));
      for (const char* name : {"b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
      EXPECT_EQ(grad_of(m.get(), "a"), std::vector<float>(4, 1.0f + static_cast<float>(it)));
      int used = -1;
      ASSERT_EQ(dp_ddp_parameter_used(ddp.get(), 2, &used), DP_OK);
      EXPECT_EQ(used, 0);
    }
    third(rank, ddp.get(), m);
  });
}

TEST(DdpStaticGraph, IterationsThatKeepTheRecordedGraphReduceWithoutTheUsedMap) {
  static_graph_iterations([](int rank, dp_ddp* ddp, dptest::ModulePtr& m) {
    for (const char* name : {"a", "b"}) set_grad(m.get(), name, static_cast<float>(rank * 4));
    for (const char* name : {"a", "b"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, name), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(ddp), DP_OK) << dp_last_error();
    EXPECT_EQ(grad_of(m.get(), "b"), std::vector<float>(3, 2.0f));
  });
}

TEST(DdpStaticGraph, MarkingARecordedUnusedParameterFailsEveryRankNamingIt) {
  static_graph_iterations([](int rank, dp_ddp* ddp, dptest::ModulePtr& m) {
    for (const char* name : {"a", "b"}) set_grad(m.get(), name, 3.0f);
    for (const char* name : {"b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, name), DP_OK);
    if (rank == 1) {
      EXPECT_EQ(dp_ddp_mark_grad_ready(ddp, "c"), DP_ESTATE);
      EXPECT_NE(dptest::last_error().find("'c'"), std::string::npos) << dptest::last_error();
    }
    EXPECT_EQ(dp_ddp_finish_backward(ddp), DP_ESTATE);
    EXPECT_NE(dptest::last_error().find("rank 1 marked parameter 'c'"), std::string::npos) << dptest::last_error();
    EXPECT_NE(dptest::last_error().find("departs from the static graph"), std::string::npos) << dptest::last_error();
    EXPECT_EQ(grad_of(m.get(), "a"), std::vector<float>(4, 3.0f)) << "left local";
  });
}

TEST(DdpStaticGraph, LeavingARecordedUsedParameterUnmarkedFailsEveryRankNamingIt) {
  static_graph_iterations([](int rank, dp_ddp* ddp, dptest::ModulePtr&) {
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, "a"), DP_OK);
    if (rank == 0) {
      ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, "b"), DP_OK);
    }
    EXPECT_EQ(dp_ddp_finish_backward(ddp), DP_ESTATE);
    EXPECT_NE(dptest::last_error().find("rank 1 did not mark parameter(s) 'b'"), std::string::npos)
        << dptest::last_error();
    // The next iteration, back on the graph, works.
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, "a"), DP_OK);
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp, "b"), DP_OK);
    EXPECT_EQ(dp_ddp_finish_backward(ddp), DP_OK) << dp_last_error();
  });
}

}  // namespace

namespace {

TEST(DdpStaticGraph, WithoutFindUnusedParametersEveryIterationAveragesAllAndTheLastBucketWaitsForFinish) {
  run_ranks(2, [&](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp_options o = small_buckets();
    o.static_graph = 1;
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    for (int it = 0; it < 4; ++it) {
      for (const char* name : kNames) set_grad(m.get(), name, static_cast<float>(rank * 2 + it));
      for (const char* name : {"c", "b", "a"}) ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), name), DP_OK);
      ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
      for (const char* name : kNames) {
        EXPECT_EQ(grad_of(m.get(), name)[0], 1.0f + static_cast<float>(it)) << name << " iteration " << it;
      }
    }
  });
}

}  // namespace

// ---- uneven inputs: dp_ddp_join ----

namespace {

struct JoinCase {
  std::vector<int> batches;  // per rank
  int divide_by_initial = 1;
  int modules = 1;      // dp_ddp per rank, one module each, on one group
  bool extras = false;  // find_unused_parameters, bucket views and the fp16 hook
  const char* name;
  bool static_graph = false;
};

// The gradient rank r produces for parameter p, element k, in iteration i.
float join_grad(int r, int i, int p, int k) { return static_cast<float>((r + 1) * (i + 2) + p + k); }

constexpr float kJoinLr = 0.25f;

// Each iteration i averages the gradients of the ranks with more than i
// batches; the active ranks step; in the end every rank holds what the rank
// with the most batches holds.
std::vector<float> join_reference(const JoinCase& c) {
  const int world = static_cast<int>(c.batches.size());
  int most = 0;
  for (int b : c.batches) most = std::max(most, b);
  const int64_t sizes[] = {4, 3, 2};
  std::vector<float> out;
  for (int p = 0; p < 3; ++p) {
    for (int64_t k = 0; k < sizes[p]; ++k) {
      double value = static_cast<double>(k);  // three_params(0): values 0, 1, ...
      for (int i = 0; i < most; ++i) {
        double sum = 0;
        int active = 0;
        for (int r = 0; r < world; ++r) {
          if (c.batches[static_cast<size_t>(r)] > i) {
            sum += join_grad(r, i, p, static_cast<int>(k));
            ++active;
          }
        }
        value -= kJoinLr * sum / (c.divide_by_initial != 0 ? world : active);
      }
      out.push_back(static_cast<float>(value));
    }
  }
  return out;
}

class DdpJoin : public ::testing::TestWithParam<JoinCase> {};

void expect_join_matches_reference(const JoinCase& c, int32_t backend) {
  const int world = static_cast<int>(c.batches.size());
  std::vector<std::vector<std::vector<float>>> finals(static_cast<size_t>(world));
  const auto rank_body = [&](int rank, dp_process_group* pg) {
    std::vector<dptest::ModulePtr> modules;
    std::vector<DdpPtr> ddps;
    for (int mi = 0; mi < c.modules; ++mi) {
      modules.push_back(three_params(0.0f));
      dp_ddp_options o = small_buckets();
      o.join_divide_by_initial_world_size = c.divide_by_initial;
      o.static_graph = c.static_graph ? 1 : 0;
      if (c.extras) {
        o.find_unused_parameters = 1;
        o.gradient_as_bucket_view = 1;
        o.comm_hook = DP_HOOK_FP16;
      }
      dp_ddp* raw = nullptr;
      ASSERT_EQ(dp_ddp_create(&raw, modules.back().get(), pg, &o), DP_OK) << dp_last_error();
      ddps.emplace_back(raw);
    }
    for (int i = 0; i < c.batches[static_cast<size_t>(rank)]; ++i) {
      for (int mi = 0; mi < c.modules; ++mi) {
        dp_module* m = modules[static_cast<size_t>(mi)].get();
        ASSERT_EQ(dp_ddp_pre_forward(ddps[static_cast<size_t>(mi)].get()), DP_OK) << dp_last_error();
        for (int p = 0; p < 3; ++p) {
          dp_tensor* g = nullptr;
          ASSERT_EQ(dp_module_grad(m, kNames[p], &g), DP_OK);
          TensorPtr owned(g);
          auto* gv = static_cast<float*>(dp_tensor_data(g));
          for (int64_t k = 0; k < dp_tensor_numel(g); ++k) gv[k] = join_grad(rank, i, p, static_cast<int>(k));
        }
        for (const char* name : {"c", "b", "a"}) {
          ASSERT_EQ(dp_ddp_mark_grad_ready(ddps[static_cast<size_t>(mi)].get(), name), DP_OK) << dp_last_error();
        }
        ASSERT_EQ(dp_ddp_finish_backward(ddps[static_cast<size_t>(mi)].get()), DP_OK) << dp_last_error();
        for (int p = 0; p < 3; ++p) {
          dp_tensor* w = nullptr;
          dp_tensor* g = nullptr;
          ASSERT_EQ(dp_module_get_parameter(m, kNames[p], &w), DP_OK);
          ASSERT_EQ(dp_module_grad(m, kNames[p], &g), DP_OK);
          TensorPtr ow(w), og(g);
          auto* wv = static_cast<float*>(dp_tensor_data(w));
          const auto* gv = static_cast<const float*>(dp_tensor_data(g));
          for (int64_t k = 0; k < dp_tensor_numel(w); ++k) wv[k] -= kJoinLr * gv[k];
        }
      }
    }
    std::vector<dp_ddp*> handles;
    for (auto& d : ddps) handles.push_back(d.get());
    ASSERT_EQ(dp_ddp_join(handles.data(), handles.size()), DP_OK) << dp_last_error();
    for (auto& m : modules) {
      std::vector<float> all;
      for (const char* name : kNames) {
        std::vector<float> v = param_of(m.get(), name);
        all.insert(all.end(), v.begin(), v.end());
      }
      finals[static_cast<size_t>(rank)].push_back(all);
    }
    // Every rank goes on together after the join.
    for (int mi = 0; mi < c.modules; ++mi) {
      for (const char* name : {"c", "b", "a"})
        ASSERT_EQ(dp_ddp_mark_grad_ready(ddps[static_cast<size_t>(mi)].get(), name), DP_OK);
      ASSERT_EQ(dp_ddp_finish_backward(ddps[static_cast<size_t>(mi)].get()), DP_OK) << dp_last_error();
    }
  };
  run_ranks(world, rank_body, backend);
  std::vector<float> expected = join_reference(c);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(finals[static_cast<size_t>(r)].size(), static_cast<size_t>(c.modules));
    for (const auto& got : finals[static_cast<size_t>(r)]) {
      ASSERT_EQ(got.size(), expected.size());
      const float tolerance = c.extras ? 0.05f : 1e-4f;  // fp16 on the wire
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_NEAR(got[k], expected[k], tolerance * (1.0f + std::fabs(expected[k]))) << "rank " << r << " value " << k;
      }
    }
  }
}

TEST_P(DdpJoin, RanksWithUnevenBatchesEndWithTheParametersOfTheHandComputedReference) {
  expect_join_matches_reference(GetParam(), DP_BACKEND_AUTO);
}

// On Gloo the buckets hold their sums until finish_backward divides them;
// a joined rank's stand-ins make the same calls.
TEST_P(DdpJoin, OnGlooRanksWithUnevenBatchesEndWithTheParametersOfTheHandComputedReference) {
  expect_join_matches_reference(GetParam(), DP_BACKEND_GLOO);
}

INSTANTIATE_TEST_SUITE_P(Cases, DdpJoin,
                         ::testing::Values(JoinCase{{3, 5, 4}, 1, 1, false, "ThreeRanksDividingByTheInitialWorldSize"},
                                           JoinCase{{3, 5, 4}, 0, 1, false, "ThreeRanksDividingByTheActiveRanks"},
                                           JoinCase{{3, 5, 4}, 1, 2, false, "TwoDdpPerRankJoinTogether"},
                                           JoinCase{{0, 2, 3}, 1, 1, false, "ARankThatJoinsBeforeAnyIteration"},
                                           JoinCase{{2, 4}, 0, 1, true, "FindUnusedBucketViewsAndTheFp16Hook"},
                                           JoinCase{
                                               {0, 3, 2}, 1, 1, true, "AStaticGraphRecordedWhileARankStoodIn", true}),
                         [](const ::testing::TestParamInfo<JoinCase>& p) { return std::string(p.param.name); });

TEST(DdpJoinArguments, AreCheckedNamingTheArgument) {
  run_ranks(1, [&](int, dp_process_group* pg) {
    dptest::ModulePtr m = three_params(0.0f);
    dp_ddp* raw = nullptr;
    ASSERT_EQ(dp_ddp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr ddp(raw);
    EXPECT_EQ(dp_ddp_join(nullptr, 1), DP_EINVAL);
    dp_ddp* twice[] = {raw, raw};
    EXPECT_EQ(dp_ddp_join(twice, 2), DP_EINVAL);
    EXPECT_NE(dptest::last_error().find("the same dp_ddp at [0] and [1]"), std::string::npos) << dptest::last_error();
    EXPECT_EQ(dp_ddp_join(twice, 0), DP_EINVAL);
    ASSERT_EQ(dp_ddp_mark_grad_ready(raw, "a"), DP_OK);
    EXPECT_EQ(dp_ddp_join(twice, 1), DP_ESTATE) << "during a backward";
    for (const char* name : {"b", "c"}) ASSERT_EQ(dp_ddp_mark_grad_ready(raw, name), DP_OK);
    ASSERT_EQ(dp_ddp_finish_backward(raw), DP_OK);
    EXPECT_EQ(dp_ddp_join(twice, 1), DP_OK) << dp_last_error() << " (alone, it returns at once)";
  });
}

}  // namespace
