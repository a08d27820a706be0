// dp_ddp in one process, world size 1: argument checks, bucket plans,
// the one-live-owner rule, marks and their errors, gradient_as_bucket_view.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/ddp_test_util.h"
#include "group_util.h"
#include "module/module_test_util.h"

namespace {

using dptest::DdpPtr;
using dptest::linear_net;
using dptest::make;
using dptest::ModulePtr;
using dptest::TensorPtr;

const char* const kParams[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"};

// One 1-D parameter per entry: (name, dtype, elements).
struct Spec {
  const char* name;
  int32_t dtype;
  int64_t numel;
};
ModulePtr flat(const std::vector<Spec>& specs) {
  ModulePtr root = dptest::new_module();
  for (const Spec& s : specs) {
    dp_tensor* t = nullptr;
    EXPECT_EQ(dp_tensor_create(&t, s.dtype, 1, &s.numel, dptest::cpu(0)), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_module_register_parameter(root.get(), s.name, t, 1), DP_OK) << dp_last_error();
    dp_tensor_destroy(t);
  }
  return root;
}

TensorPtr grad(dp_module* m, const char* name) {
  dp_tensor* g = nullptr;
  EXPECT_EQ(dp_module_grad(m, name, &g), DP_OK) << dp_last_error();
  return TensorPtr(g);
}

double cap_mb(double bytes) { return bytes / 1048576.0; }

std::string plan(const dp_ddp* ddp) {
  std::string out;
  for (size_t b = 0; b < dp_ddp_num_buckets(ddp); ++b) {
    size_t count = 0;
    EXPECT_EQ(dp_ddp_bucket_parameters(ddp, b, nullptr, 0, &count), DP_OK) << dp_last_error();
    std::vector<size_t> idx(count);
    EXPECT_EQ(dp_ddp_bucket_parameters(ddp, b, idx.data(), idx.size(), &count), DP_OK) << dp_last_error();
    out += b == 0 ? "{" : ",{";
    for (size_t i = 0; i < idx.size(); ++i) out += (i == 0 ? "" : ",") + std::to_string(idx[i]);
    out += "}";
  }
  return out;
}

class DdpApi : public ::testing::Test {
 protected:
  void SetUp() override {
    pg_ = group_.get();
    ASSERT_NE(pg_, nullptr);
  }

  DdpPtr create(dp_module* m, const dp_ddp_options* opts = nullptr) {
    dp_ddp* d = nullptr;
    EXPECT_EQ(dp_ddp_create(&d, m, pg_, opts), DP_OK) << dp_last_error();
    return DdpPtr(d);
  }

  // The status of a create that must fail; its message in *message.
  dp_status refused(dp_module* m, const dp_ddp_options* opts, std::string* message) {
    dp_ddp* d = reinterpret_cast<dp_ddp*>(this);  // set to NULL on failure
    dp_status st = dp_ddp_create(&d, m, pg_, opts);
    *message = dp_last_error();
    EXPECT_EQ(d, nullptr);
    if (st == DP_OK) dp_ddp_destroy(d);
    return st;
  }

  dptest::SingleRankGroup group_;  // a one-rank group, gone after TearDown
  dp_process_group* pg_ = nullptr;
};

TEST_F(DdpApi, OptionsInitGivesTheMacrosDefaults) {
  dp_ddp_options macro = DP_DDP_OPTIONS_INIT, o;
  std::memset(&o, 0xA5, sizeof(o));
  DP_ASSERT_OK(dp_ddp_options_init(&o, sizeof(o)));
  EXPECT_EQ(o.struct_size, sizeof(dp_ddp_options));
  EXPECT_EQ(o.bucket_cap_mb, 25.0);
  EXPECT_EQ(o.first_bucket_cap_mb, 1.0);
  EXPECT_EQ(o.gradient_as_bucket_view, macro.gradient_as_bucket_view);
  EXPECT_EQ(o.broadcast_buffers, 1);
  EXPECT_EQ(o.find_unused_parameters, 0);
  EXPECT_EQ(o.init_sync, 1);
  EXPECT_EQ(o.ignored_modules, nullptr);
  EXPECT_EQ(o.num_ignored_modules, 0u);
  EXPECT_EQ(o.ignored_parameters, nullptr);
  EXPECT_EQ(o.num_ignored_parameters, 0u);
  EXPECT_EQ(o.comm_hook, DP_HOOK_ALLREDUCE);
  EXPECT_EQ(o.hook_fn, nullptr);
  EXPECT_EQ(o.hook_user_data, nullptr);
  EXPECT_EQ(dp_ddp_options_init(nullptr, sizeof(o)), DP_EINVAL);
}

// A host built against a header whose dp_ddp_options ended before comm_hook:
// init and create touch only its bytes, not what follows them in memory.
TEST_F(DdpApi, OptionsFromAnOlderHeaderAreWrittenAndReadOnlyUpToTheirSize) {
  const size_t older = offsetof(dp_ddp_options, comm_hook);
  dp_ddp_options buf;  // the host's struct, then its other data
  std::memset(&buf, 0xA5, sizeof(buf));
  DP_ASSERT_OK(dp_ddp_options_init(&buf, older));
  EXPECT_EQ(buf.struct_size, older);
  EXPECT_EQ(buf.bucket_cap_mb, 25.0);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&buf);
  for (size_t i = older; i < sizeof(buf); ++i) ASSERT_EQ(bytes[i], 0xA5) << "byte " << i;
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get(), &buf);  // 0xA5A5A5A5 as comm_hook would be refused
  ASSERT_NE(d, nullptr);
}

TEST_F(DdpApi, NullOutModuleOrGroupIsEinvalNamingTheArgument) {
  ModulePtr m = linear_net();
  EXPECT_EQ(dp_ddp_create(nullptr, m.get(), pg_, nullptr), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'out'"), std::string::npos) << dp_last_error();
  dp_ddp* d = nullptr;
  EXPECT_EQ(dp_ddp_create(&d, nullptr, pg_, nullptr), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'module'"), std::string::npos) << dp_last_error();
  EXPECT_EQ(d, nullptr);
  EXPECT_EQ(dp_ddp_create(&d, m.get(), nullptr, nullptr), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("'pg'"), std::string::npos) << dp_last_error();
  EXPECT_EQ(d, nullptr);
}

TEST_F(DdpApi, BadCapsHookOrStructSizeAreEinvalNamingTheOption) {
  ModulePtr m = linear_net();
  std::string message;
  const double bad[] = {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()};
  for (double v : bad) {
    dp_ddp_options o = DP_DDP_OPTIONS_INIT;
    o.bucket_cap_mb = v;
    EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL) << "bucket_cap_mb " << v;
    EXPECT_NE(message.find("bucket_cap_mb"), std::string::npos) << message;
    o = DP_DDP_OPTIONS_INIT;
    o.first_bucket_cap_mb = v;
    EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL) << "first_bucket_cap_mb " << v;
    EXPECT_NE(message.find("first_bucket_cap_mb"), std::string::npos) << message;
  }
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.comm_hook = 7;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
  EXPECT_NE(message.find("comm_hook"), std::string::npos) << message;
  o = DP_DDP_OPTIONS_INIT;
  o.comm_hook = DP_HOOK_CUSTOM;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
  EXPECT_NE(message.find("hook_fn"), std::string::npos) << message;
  o = DP_DDP_OPTIONS_INIT;
  o.struct_size = 0;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
  EXPECT_NE(message.find("struct_size"), std::string::npos) << message;
}

// A cap under a byte counts as one byte: each parameter alone.
TEST_F(DdpApi, TinyPositiveCapGivesEachParameterItsOwnBucket) {
  ModulePtr m = linear_net();
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-12;
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{5},{4},{3},{2},{1},{0}");
}

TEST_F(DdpApi, UnknownIgnoredModuleOrParameterIsEinvalNamingIt) {
  ModulePtr m = linear_net();
  std::string message;
  const char* const modules[] = {"fc9"};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.ignored_modules = modules;
  o.num_ignored_modules = 1;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
  EXPECT_NE(message.find("fc9"), std::string::npos) << message;
  const char* const params[] = {"fc1.nope"};
  o = DP_DDP_OPTIONS_INIT;
  o.ignored_parameters = params;
  o.num_ignored_parameters = 1;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
  EXPECT_NE(message.find("fc1.nope"), std::string::npos) << message;
  // A count without an array.
  o = DP_DDP_OPTIONS_INIT;
  o.num_ignored_modules = 1;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);
}

TEST_F(DdpApi, NothingToManageOrANonFloatOrMisplacedParameterIsEinval) {
  std::string message;
  ModulePtr m = linear_net();
  const char* const everything[] = {"fc1", "fc2", "fc3"};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.ignored_modules = everything;
  o.num_ignored_modules = 3;
  EXPECT_EQ(refused(m.get(), &o, &message), DP_EINVAL);

  ModulePtr ints = flat({{"w", DP_FLOAT32, 4}, {"steps", DP_INT64, 1}});
  EXPECT_EQ(refused(ints.get(), nullptr, &message), DP_EINVAL);
  EXPECT_NE(message.find("steps"), std::string::npos) << message;
  // Without requires_grad it is not managed, so it is fine.
  DP_ASSERT_OK(dp_module_set_requires_grad(ints.get(), "steps", 0));
  EXPECT_NE(create(ints.get()), nullptr);

  ModulePtr elsewhere = flat({{"w", DP_FLOAT32, 4}});
  auto far = make<float>({2}, {1.0f, 2.0f}, dptest::cpu(1));
  DP_ASSERT_OK(dp_module_register_parameter(elsewhere.get(), "far", far.get(), 1));
  EXPECT_EQ(refused(elsewhere.get(), nullptr, &message), DP_EINVAL);
  EXPECT_NE(message.find("far"), std::string::npos) << message;
}

TEST_F(DdpApi, ParameterManagedByTwoLiveDdpsIsEinvalAndAllowedAgainOnceTheFirstIsDestroyed) {
  ModulePtr m = linear_net();
  DdpPtr whole = create(m.get());
  ASSERT_NE(whole, nullptr);
  std::string message;
  EXPECT_EQ(refused(m.get(), nullptr, &message), DP_EINVAL);
  EXPECT_NE(message.find("fc1.weight"), std::string::npos) << message;
  dp_module* fc2 = nullptr;
  DP_ASSERT_OK(dp_module_get_module(m.get(), "fc2", &fc2));
  ModulePtr fc2_ptr(fc2);
  EXPECT_EQ(refused(fc2, nullptr, &message), DP_EINVAL);
  EXPECT_NE(message.find("weight"), std::string::npos) << message;
  whole.reset();
  DdpPtr layer = create(fc2);
  EXPECT_NE(layer, nullptr);
  EXPECT_EQ(refused(m.get(), nullptr, &message), DP_EINVAL);  // fc2 is still managed by `layer`
  EXPECT_NE(message.find("fc2.weight"), std::string::npos) << message;
  layer.reset();
  EXPECT_NE(create(m.get()), nullptr);
}

TEST_F(DdpApi, DisjointSubmodulesWorkSideBySideIncludingAnIgnoredOne) {
  ModulePtr m = linear_net();
  const char* const fc1[] = {"fc1"};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.ignored_modules = fc1;
  o.num_ignored_modules = 1;
  DdpPtr rest = create(m.get(), &o);
  dp_module* sub = nullptr;
  DP_ASSERT_OK(dp_module_get_module(m.get(), "fc1", &sub));
  ModulePtr sub_ptr(sub);
  DdpPtr first = create(sub);
  ASSERT_NE(rest, nullptr);
  ASSERT_NE(first, nullptr);
  for (size_t i = 0; i < 4; ++i) DP_EXPECT_OK(dp_ddp_mark_grad_ready_index(rest.get(), i));
  DP_EXPECT_OK(dp_ddp_mark_grad_ready(first.get(), "weight"));
  DP_EXPECT_OK(dp_ddp_mark_grad_ready(first.get(), "bias"));
  DP_EXPECT_OK(dp_ddp_finish_backward(rest.get()));
  DP_EXPECT_OK(dp_ddp_finish_backward(first.get()));
  // Ignored: fc1's names are not the first dp_ddp's.
  EXPECT_EQ(dp_ddp_mark_grad_ready(rest.get(), "fc1.weight"), DP_EINVAL);
}

TEST_F(DdpApi, MarkingAnUnknownNameOrAnOutOfRangeIndexIsEinval) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(dp_ddp_mark_grad_ready(d.get(), "fc4.weight"), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("fc4.weight"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_ddp_mark_grad_ready(d.get(), nullptr), DP_EINVAL);
  EXPECT_EQ(dp_ddp_mark_grad_ready_index(d.get(), 6), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("6"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_ddp_mark_grad_ready_index(d.get(), static_cast<size_t>(-1)), DP_EINVAL);
  EXPECT_EQ(dp_ddp_mark_grad_ready(nullptr, "fc1.weight"), DP_EINVAL);
  EXPECT_EQ(dp_ddp_mark_grad_ready_index(nullptr, 0), DP_EINVAL);
  EXPECT_EQ(dp_ddp_finish_backward(nullptr), DP_EINVAL);
  EXPECT_EQ(dp_ddp_pre_forward(nullptr), DP_EINVAL);
  EXPECT_EQ(dp_ddp_set_requires_gradient_sync(nullptr, 1), DP_EINVAL);
  // The refused marks left nothing behind: a full backward works.
  for (const char* name : kParams) DP_EXPECT_OK(dp_ddp_mark_grad_ready(d.get(), name));
  DP_EXPECT_OK(dp_ddp_finish_backward(d.get()));
}

TEST_F(DdpApi, NullHandlesAreAcceptedByDestroyAndCountZeroBuckets) {
  dp_ddp_destroy(nullptr);
  EXPECT_EQ(dp_ddp_num_buckets(nullptr), 0u);
  EXPECT_STRNE(dp_last_error(), "");
  size_t count = 7;
  EXPECT_EQ(dp_ddp_bucket_parameters(nullptr, 0, nullptr, 0, &count), DP_EINVAL);
  EXPECT_EQ(count, 7u);
  dp_ddp_stats stats{sizeof(dp_ddp_stats), 0, 0, 0, 0, 0};
  EXPECT_EQ(dp_ddp_last_stats(nullptr, &stats), DP_EINVAL);
}

TEST_F(DdpApi, BucketParametersChecksItsArguments) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  ASSERT_EQ(dp_ddp_num_buckets(d.get()), 1u);
  size_t count = 0;
  EXPECT_EQ(dp_ddp_bucket_parameters(d.get(), 1, nullptr, 0, &count), DP_EINVAL);
  EXPECT_EQ(dp_ddp_bucket_parameters(d.get(), 0, nullptr, 0, nullptr), DP_EINVAL);
  EXPECT_EQ(dp_ddp_bucket_parameters(d.get(), 0, nullptr, 3, &count), DP_EINVAL);
  // A short array gets the first `cap` indices and the full count.
  size_t two[2] = {99, 99};
  DP_EXPECT_OK(dp_ddp_bucket_parameters(d.get(), 0, two, 2, &count));
  EXPECT_EQ(count, 6u);
  EXPECT_EQ(two[0], 5u);
  EXPECT_EQ(two[1], 4u);
}

// The example of SEMANTICS.md: 400, 800, 400, 200 bytes, both caps 400 bytes.
TEST_F(DdpApi, PlanFillsBucketsInReverseOrderClosingEachOnceItReachesItsCap) {
  ModulePtr m = flat({{"a", DP_FLOAT32, 100}, {"b", DP_FLOAT32, 200}, {"c", DP_FLOAT32, 100}, {"d", DP_FLOAT32, 50}});
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(400);
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{3,2},{1},{0}");
}

TEST_F(DdpApi, PlanUsesTheFirstCapForTheFirstBucketOnly) {
  ModulePtr m = flat({{"a", DP_FLOAT32, 100}, {"b", DP_FLOAT32, 200}, {"c", DP_FLOAT32, 100}, {"d", DP_FLOAT32, 50}});
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.first_bucket_cap_mb = cap_mb(400);
  o.bucket_cap_mb = cap_mb(1000);
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{3,2},{1,0}");
  d.reset();
  o.first_bucket_cap_mb = cap_mb(1);  // every parameter passes it alone
  o.bucket_cap_mb = 25;
  d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{3},{2,1,0}");
}

// Each dtype fills its own buckets; buckets come in the order of their first
// parameter: d (float64) and c (float32) open them.
TEST_F(DdpApi, PlanKeepsEachDtypeInItsOwnBuckets) {
  ModulePtr m = flat({{"a", DP_FLOAT32, 100}, {"b", DP_FLOAT64, 50}, {"c", DP_FLOAT32, 100}, {"d", DP_FLOAT64, 50}});
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(800);
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{3,1},{2,0}");
}

TEST_F(DdpApi, DefaultCapsPutTheNetInOneBucketAndTheStatsCountIt) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(plan(d.get()), "{5,4,3,2,1,0}");
  for (size_t i = 6; i-- > 0;) DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), i));
  DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
  dp_ddp_stats stats{sizeof(dp_ddp_stats), -1, -1, -1, 0, 0};
  DP_ASSERT_OK(dp_ddp_last_stats(d.get(), &stats));
  EXPECT_EQ(stats.num_buckets, 1u);
  EXPECT_EQ(stats.buckets_rebuilt, 0) << "one bucket in any order: the rebuild keeps the plan";
  EXPECT_GE(stats.backward_ms, 0.0);
  EXPECT_GE(stats.reduce_ms, 0.0);
  EXPECT_GE(stats.exposed_ms, 0.0);
}

// The stats mean what the header says: backward covers the time from the
// first mark to the end of finish, exposed is part of reduce, the bucket
// count is the plan's, and a rebuild that moved storage shows once.
TEST_F(DdpApi, StatsCoverTheMarksCountThePlansBucketsAndShowARebuildOnlyWhenItHappened) {
  ModulePtr m = linear_net();
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(24);  // a bucket per layer
  o.gradient_as_bucket_view = 1;
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  const size_t order[2][6] = {{0, 1, 2, 3, 4, 5}, {5, 4, 3, 2, 1, 0}};  // the plan is in reverse order
  for (int step = 0; step < 3; ++step) {
    const size_t* marks = order[step == 0 ? 0 : 1];
    DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), marks[0]));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int k = 1; k < 6; ++k) DP_ASSERT_OK(dp_ddp_mark_grad_ready_index(d.get(), marks[k]));
    DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
    dp_ddp_stats stats{sizeof(dp_ddp_stats), -1, -1, -1, 0, -1};
    DP_ASSERT_OK(dp_ddp_last_stats(d.get(), &stats));
    EXPECT_GE(stats.backward_ms, 20.0) << "step " << step;
    EXPECT_GE(stats.reduce_ms, 0.0) << "step " << step;
    EXPECT_LE(stats.exposed_ms, stats.reduce_ms) << "step " << step;
    EXPECT_EQ(stats.num_buckets, dp_ddp_num_buckets(d.get())) << "step " << step;
    EXPECT_EQ(stats.buckets_rebuilt, step == 0 ? 1 : 0) << "step " << step;
  }
  EXPECT_EQ(plan(d.get()), "{0,1},{2,3},{4,5}");
}

TEST_F(DdpApi, AtWorldSizeOneTheAveragedGradientIsTheLocalOne) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  for (int step = 0; step < 2; ++step) {
    DP_ASSERT_OK(dp_module_zero_grad(m.get()));
    for (int p = 5; p >= 0; --p) {
      TensorPtr g = grad(m.get(), kParams[p]);
      float* v = static_cast<float*>(dp_tensor_data(g.get()));
      for (int64_t i = 0; i < dp_tensor_numel(g.get()); ++i)
        v[i] = 0.37f * static_cast<float>(p + 1) + 0.01f * i - step;
      DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), kParams[p]));
    }
    DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
    for (int p = 0; p < 6; ++p) {
      std::vector<float> got = dptest::values<float>(grad(m.get(), kParams[p]).get());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i], 0.37f * static_cast<float>(p + 1) + 0.01f * static_cast<float>(i) - step)
            << kParams[p] << "[" << i << "] step " << step;
      }
    }
  }
}

TEST_F(DdpApi, MarkingTwiceIsEstateAndAnUnmarkedParameterFailsFinishNamingIt) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), "fc3.bias"));
  EXPECT_EQ(dp_ddp_mark_grad_ready(d.get(), "fc3.bias"), DP_ESTATE);
  EXPECT_NE(std::string(dp_last_error()).find("fc3.bias"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_ddp_mark_grad_ready_index(d.get(), 5), DP_ESTATE);
  for (int p = 4; p >= 1; --p) DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), kParams[p]));
  EXPECT_EQ(dp_ddp_finish_backward(d.get()), DP_ESTATE);
  std::string message = dp_last_error();
  EXPECT_NE(message.find("fc1.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("find_unused_parameters"), std::string::npos) << message;
  // The next backward starts afresh.
  for (int p = 5; p >= 0; --p) DP_EXPECT_OK(dp_ddp_mark_grad_ready(d.get(), kParams[p]));
  DP_EXPECT_OK(dp_ddp_finish_backward(d.get()));
}

TEST_F(DdpApi, GradientAsBucketViewMakesEachBucketsGradientsOneContiguousBlockKeepingTheirValues) {
  ModulePtr m = linear_net();
  for (int p = 0; p < 6; ++p) {
    TensorPtr g = grad(m.get(), kParams[p]);
    float* v = static_cast<float*>(dp_tensor_data(g.get()));
    for (int64_t i = 0; i < dp_tensor_numel(g.get()); ++i) v[i] = static_cast<float>(10 * p + i);
  }
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.gradient_as_bucket_view = 1;
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  ASSERT_EQ(dp_ddp_num_buckets(d.get()), 1u);
  // In the bucket's order the gradients follow one another in memory.
  size_t idx[6], count = 0;
  DP_ASSERT_OK(dp_ddp_bucket_parameters(d.get(), 0, idx, 6, &count));
  ASSERT_EQ(count, 6u);
  const char* expected_next = nullptr;
  for (size_t k = 0; k < 6; ++k) {
    TensorPtr g = grad(m.get(), kParams[idx[k]]);
    const char* data = static_cast<const char*>(dp_tensor_data(g.get()));
    if (expected_next != nullptr) {
      EXPECT_EQ(data, expected_next) << kParams[idx[k]] << " is not next in the bucket";
    }
    expected_next = data + dp_tensor_nbytes(g.get());
    std::vector<float> got = dptest::values<float>(g.get());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], static_cast<float>(10 * idx[k] + i));
  }
}

// Marks may come from several threads at once.
TEST_F(DdpApi, MarksFromSeveralThreadsAtOnce) {
  ModulePtr m = linear_net();
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(24);
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  for (int step = 0; step < 20; ++step) {
    std::vector<std::thread> threads;
    std::vector<dp_status> status(6, DP_EINTERNAL);
    for (size_t i = 0; i < 6; ++i) {
      threads.emplace_back([&, i] { status[i] = dp_ddp_mark_grad_ready_index(d.get(), i); });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(status[i], DP_OK) << "step " << step << " index " << i;
    ASSERT_EQ(dp_ddp_finish_backward(d.get()), DP_OK) << "step " << step << ": " << dp_last_error();
  }
}

// Many parameters: marks by name stay cheap (no scan per mark) and error
// messages list a bounded number of names.
TEST_F(DdpApi, TwentyThousandParametersMarkedByNameAndAnUnmarkedListIsBounded) {
  std::vector<std::string> names;
  std::vector<Spec> specs;
  for (int i = 0; i < 20000; ++i) names.push_back("p" + std::to_string(i));
  for (const auto& n : names) specs.push_back(Spec{n.c_str(), DP_FLOAT32, 3});
  ModulePtr m = flat(specs);
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(4096);
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(dp_ddp_num_buckets(d.get()), 20000u * 12 / 4096 + 1);
  for (size_t i = names.size(); i-- > 0;) DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), names[i].c_str()));
  DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
  // All but the first 100 unmarked: the message names some and counts the rest.
  for (size_t i = 0; i < 100; ++i) DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), names[i].c_str()));
  ASSERT_EQ(dp_ddp_finish_backward(d.get()), DP_ESTATE);
  std::string message = dp_last_error();
  EXPECT_NE(message.find("19900 parameter(s) were not marked"), std::string::npos) << message;
  EXPECT_NE(message.find("more"), std::string::npos) << message;
  EXPECT_LT(message.size(), 4096u) << message;
}

// Names that are not managed parameters: empty, a module, a path past a
// parameter, a buffer.
TEST_F(DdpApi, MarkingByANameThatIsNotAManagedParameterIsEinvalNamingIt) {
  ModulePtr m = linear_net();
  TensorPtr buf = make<float>({2}, {1, 2});
  DP_ASSERT_OK(dp_module_register_buffer(m.get(), "running", buf.get(), 1));
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  for (const char* name : {"", "fc1", "fc1.weight.x", "running", "fc9.bias", ".", "fc1..weight"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(dp_ddp_mark_grad_ready(d.get(), name), DP_EINVAL);
    if (*name != '\0') {
      EXPECT_NE(std::string(dp_last_error()).find(name), std::string::npos) << dp_last_error();
    }
  }
  // The failed marks left no trace: a full backward still works.
  for (const char* p : kParams) DP_EXPECT_OK(dp_ddp_mark_grad_ready(d.get(), p));
  DP_EXPECT_OK(dp_ddp_finish_backward(d.get()));
}

// For a CPU parameter the _stream form is the _index form.
TEST_F(DdpApi, MarkWithAStreamOnACpuParameterIsAPlainMark) {
  ModulePtr m = linear_net();
  DdpPtr d = create(m.get());
  ASSERT_NE(d, nullptr);
  for (size_t i = 0; i < 6; ++i) DP_ASSERT_OK(dp_ddp_mark_grad_ready_stream(d.get(), i, nullptr));
  EXPECT_EQ(dp_ddp_mark_grad_ready_stream(d.get(), 0, nullptr), DP_ESTATE);
  EXPECT_EQ(dp_ddp_mark_grad_ready_stream(d.get(), 6, nullptr), DP_EINVAL);
  DP_EXPECT_OK(dp_ddp_finish_backward(d.get()));
  EXPECT_EQ(dp_ddp_mark_grad_ready_stream(nullptr, 0, nullptr), DP_EINVAL);
}

// What a comm hook saw when it called back into the library.
struct ReentrantHook {
  dp_ddp* self = nullptr;
  dp_ddp* other = nullptr;  // another live dp_ddp on the same group
  int calls = 0;
  std::vector<std::pair<std::string, dp_status>> statuses;
  std::vector<std::string> messages;
  size_t buckets_seen = 0;
  int32_t rank_after_destroy = -2;
  int64_t numel_after_destroy = -2;
};

int reentrant_hook(void* user_data, dp_process_group* pg, size_t /*bucket*/, dp_tensor* flat) {
  auto* h = static_cast<ReentrantHook*>(user_data);
  ++h->calls;
  auto note = [&](const char* what, dp_status s) {
    h->statuses.emplace_back(what, s);
    h->messages.emplace_back(dp_last_error());
  };
  note("finish_backward", dp_ddp_finish_backward(h->self));
  note("mark_grad_ready_index", dp_ddp_mark_grad_ready_index(h->self, 0));
  note("pre_forward", dp_ddp_pre_forward(h->self));
  note("set_requires_gradient_sync", dp_ddp_set_requires_gradient_sync(h->self, 0));
  note("finish_backward of another dp_ddp", dp_ddp_finish_backward(h->other));
  dp_ddp_destroy(h->self);
  h->messages.emplace_back(dp_last_error());
  h->buckets_seen = dp_ddp_num_buckets(h->self);  // reads are allowed, and it is still alive
  dp_process_group_destroy(pg);                   // lent: not destroyed
  h->rank_after_destroy = dp_process_group_rank(pg);
  dp_tensor_destroy(flat);  // lent: not destroyed
  h->numel_after_destroy = dp_tensor_numel(flat);
  return dp_pg_all_reduce(pg, flat, DP_AVG) == DP_OK ? 0 : 1;
}

// A host's hook that calls into the dp_ddp it serves would wait for its own
// bucket (for good, or until the timeout): such calls are refused at once,
// destroy included, and the handles lent to it cannot be destroyed; the
// backward then completes as if the hook had only reduced.
TEST_F(DdpApi, CommHookCallingIntoItsOwnDdpIsRefusedAtOnceAndItsLentHandlesCannotBeDestroyed) {
  ModulePtr m = linear_net();
  ReentrantHook hook;
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.comm_hook = DP_HOOK_CUSTOM;
  o.hook_fn = reentrant_hook;
  o.hook_user_data = &hook;
  const char* ignored[] = {"fc3"};
  o.ignored_modules = ignored;
  o.num_ignored_modules = 1;
  DdpPtr d = create(m.get(), &o);
  ASSERT_NE(d, nullptr);
  dp_ddp_options other_options = DP_DDP_OPTIONS_INIT;
  const char* others[] = {"fc1", "fc2"};
  other_options.ignored_modules = others;
  other_options.num_ignored_modules = 2;
  DdpPtr other = create(m.get(), &other_options);
  ASSERT_NE(other, nullptr);
  hook.self = d.get();
  hook.other = other.get();
  for (int step = 0; step < 2; ++step) {
    hook.statuses.clear();
    hook.messages.clear();
    DP_ASSERT_OK(dp_module_zero_grad(m.get()));
    for (int p = 3; p >= 0; --p) {
      TensorPtr g = grad(m.get(), kParams[p]);
      float* v = static_cast<float*>(dp_tensor_data(g.get()));
      for (int64_t i = 0; i < dp_tensor_numel(g.get()); ++i) v[i] = 0.5f * static_cast<float>(p + 1) + step;
      DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), kParams[p]));
    }
    ASSERT_EQ(dp_ddp_finish_backward(d.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(hook.statuses.size(), 5u);
    for (size_t i = 0; i < hook.statuses.size(); ++i) {
      EXPECT_EQ(hook.statuses[i].second, DP_ESTATE) << hook.statuses[i].first << ": " << hook.messages[i];
      EXPECT_NE(hook.messages[i].find("inside the comm hook"), std::string::npos) << hook.messages[i];
    }
    EXPECT_NE(hook.messages[0].find("this dp_ddp"), std::string::npos) << hook.messages[0];
    EXPECT_NE(hook.messages[5].find("nothing was destroyed"), std::string::npos) << hook.messages[5];
    EXPECT_GE(hook.buckets_seen, 1u);
    EXPECT_EQ(hook.rank_after_destroy, 0);
    EXPECT_GT(hook.numel_after_destroy, 0);
    for (int p = 0; p < 4; ++p) {
      std::vector<float> got = dptest::values<float>(grad(m.get(), kParams[p]).get());
      for (float v : got) EXPECT_EQ(v, 0.5f * static_cast<float>(p + 1) + step) << kParams[p] << " step " << step;
    }
  }
  EXPECT_GE(hook.calls, 2);
  // The other dp_ddp, whose finish the hook tried, still works.
  for (int p = 5; p >= 4; --p) DP_ASSERT_OK(dp_ddp_mark_grad_ready(other.get(), kParams[p]));
  DP_EXPECT_OK(dp_ddp_finish_backward(other.get()));
}

// A comm hook that blocks until the test lets it go.
struct HungHook {
  std::mutex mutex;
  std::condition_variable cv;
  bool entered = false;
  bool released = false;
};

int hung_hook(void* user_data, dp_process_group* pg, size_t /*bucket*/, dp_tensor* flat) {
  auto* h = static_cast<HungHook*>(user_data);
  std::unique_lock<std::mutex> lock(h->mutex);
  h->entered = true;
  h->cv.notify_all();
  h->cv.wait(lock, [&] { return h->released; });
  lock.unlock();
  return dp_pg_all_reduce(pg, flat, DP_AVG) == DP_OK ? 0 : 1;
}

// A hook that never returns: its finish_backward is DP_ETIMEOUT by the
// group's timeout (plus the reports' margin), another dp_ddp on the group
// fails at once naming the stuck hook instead of waiting for its own
// bound, both destroys return, and once the hook returns everything is
// freed (the sanitized build checks for leaks).
TEST(DdpHungHook, FinishTimesOutDestroyReturnsAndTheOtherDdpFailsAtOnceNamingIt) {
  std::string path = dptest::temp_path("ddp_hung_", "store");
  ::unlink(path.c_str());
  dp_store* store = nullptr;
  DP_ASSERT_OK(dp_store_create_file(&store, path.c_str(), 1));
  const int32_t timeout_ms = 2000;
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.store = store;
  o.timeout_ms = timeout_ms;
  dp_process_group* pg = nullptr;
  DP_ASSERT_OK(dp_process_group_create(&pg, &o));
  dp_store_destroy(store);
  ModulePtr m = linear_net();
  HungHook hook;
  dp_ddp_options hung = DP_DDP_OPTIONS_INIT;
  const char* not_fc1[] = {"fc2", "fc3"};
  hung.ignored_modules = not_fc1;
  hung.num_ignored_modules = 2;
  hung.comm_hook = DP_HOOK_CUSTOM;
  hung.hook_fn = hung_hook;
  hung.hook_user_data = &hook;
  dp_ddp* a = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&a, m.get(), pg, &hung));
  dp_ddp_options other = DP_DDP_OPTIONS_INIT;
  const char* fc1[] = {"fc1"};
  other.ignored_modules = fc1;
  other.num_ignored_modules = 1;
  dp_ddp* b = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&b, m.get(), pg, &other));

  DP_ASSERT_OK(dp_ddp_mark_grad_ready(a, "fc1.weight"));
  DP_ASSERT_OK(dp_ddp_mark_grad_ready(a, "fc1.bias"));
  {
    std::unique_lock<std::mutex> lock(hook.mutex);
    ASSERT_TRUE(hook.cv.wait_for(lock, std::chrono::seconds(60), [&] { return hook.entered; }));
  }
  for (int p = 5; p >= 2; --p) DP_ASSERT_OK(dp_ddp_mark_grad_ready(b, kParams[p]));

  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  EXPECT_EQ(dp_ddp_finish_backward(a), DP_ETIMEOUT);
  std::string message = dp_last_error();
  double a_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  EXPECT_NE(message.find("comm hook"), std::string::npos) << message;
  EXPECT_NE(message.find("fc1.weight"), std::string::npos) << message;
  EXPECT_LT(a_ms, 10.0 * timeout_ms) << message;

  start = Clock::now();
  EXPECT_EQ(dp_ddp_finish_backward(b), DP_ESTATE);
  message = dp_last_error();
  double b_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  EXPECT_NE(message.find("stuck"), std::string::npos) << message;
  EXPECT_NE(message.find("bucket 0's reduction"), std::string::npos) << message;
  EXPECT_LT(b_ms, timeout_ms) << "the other dp_ddp waited for its own bound: " << message;
  // Later marks on the stuck lane fail at once too, and say why.
  DP_EXPECT_OK(dp_ddp_mark_grad_ready(b, "fc3.bias"));
  EXPECT_NE(dp_ddp_finish_backward(b), DP_OK);

  start = Clock::now();
  dp_ddp_destroy(a);
  dp_ddp_destroy(b);
  double destroy_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  EXPECT_LT(destroy_ms, 10.0 * timeout_ms);
  {
    std::lock_guard<std::mutex> lock(hook.mutex);
    hook.released = true;
    hook.cv.notify_all();
  }
  // Once the hook returns, the lane's worker frees the reducer; the module
  // and group are the test's to free.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  dp_process_group_destroy(pg);
  ::unlink(path.c_str());
}

}  // namespace

namespace {

// A host-owned gradient over `memory` (2 floats), as from the host's autograd.
TensorPtr host_blob(float* memory) {
  const int64_t shape[1] = {2};
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_tensor_from_blob(&t, memory, DP_FLOAT32, 1, shape, dptest::cpu(0), nullptr, nullptr), DP_OK)
      << dp_last_error();
  return TensorPtr(t);
}

float* floats(dp_tensor* t) { return static_cast<float*>(dp_tensor_data(t)); }

}  // namespace

TEST_F(DdpApi, SetGradHandsOverHostMemoryThatIsReducedInPlaceWithAndWithoutBucketViews) {
  for (int views = 0; views <= 1; ++views) {
    SCOPED_TRACE(views ? "gradient_as_bucket_view" : "copies");
    ModulePtr m = flat({{"a", DP_FLOAT32, 2}, {"b", DP_FLOAT32, 2}});
    dp_ddp_options o = DP_DDP_OPTIONS_INIT;
    o.gradient_as_bucket_view = views;
    DdpPtr d = create(m.get(), &o);
    float host_a[2] = {1.5f, -2.5f};
    TensorPtr blob = host_blob(host_a);
    DP_ASSERT_OK(dp_module_set_grad(m.get(), "a", blob.get()));
    TensorPtr a = grad(m.get(), "a");
    EXPECT_EQ(dp_tensor_data(a.get()), static_cast<void*>(host_a)) << "dp_module_grad gives the host's memory";
    for (int it = 0; it < 3; ++it) {  // the first finish rebuilds the buckets
      host_a[0] = static_cast<float>(it);
      floats(grad(m.get(), "b").get())[1] = static_cast<float>(10 + it);
      DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), "b"));
      DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), "a"));
      DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
      // World size 1: the average is the local value, in the host's memory.
      EXPECT_EQ(host_a[0], static_cast<float>(it));
      EXPECT_EQ(host_a[1], -2.5f);
      EXPECT_EQ(floats(grad(m.get(), "b").get())[1], static_cast<float>(10 + it));
      EXPECT_EQ(dp_tensor_data(grad(m.get(), "a").get()), static_cast<void*>(host_a)) << "iteration " << it;
    }
  }
}

TEST_F(DdpApi, SetGradRefusesAnotherDtypeShapeOrDeviceAndTheParameterItselfNamingTheArgument) {
  ModulePtr m = flat({{"a", DP_FLOAT32, 2}});
  double wrong_dtype[2] = {0, 0};
  const int64_t two[1] = {2};
  const int64_t three[1] = {3};
  float memory[3] = {0, 0, 0};
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_blob(&t, wrong_dtype, DP_FLOAT64, 1, two, dptest::cpu(0), nullptr, nullptr));
  TensorPtr f64(t);
  DP_ASSERT_OK(dp_tensor_from_blob(&t, memory, DP_FLOAT32, 1, three, dptest::cpu(0), nullptr, nullptr));
  TensorPtr longer(t);
  for (dp_tensor* bad : {f64.get(), longer.get()}) {
    EXPECT_EQ(dp_module_set_grad(m.get(), "a", bad), DP_EINVAL);
    EXPECT_NE(std::string(dp_last_error()).find("argument 'grad'"), std::string::npos) << dp_last_error();
  }
  dp_tensor* value = nullptr;
  DP_ASSERT_OK(dp_module_get_parameter(m.get(), "a", &value));
  TensorPtr value_handle(value);
  EXPECT_EQ(dp_module_set_grad(m.get(), "a", value), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("itself"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_module_set_grad(m.get(), "nope", nullptr), DP_EINVAL);
  EXPECT_NE(std::string(dp_last_error()).find("nope"), std::string::npos) << dp_last_error();
  EXPECT_EQ(dp_module_set_grad(nullptr, "a", nullptr), DP_EINVAL);
  // NULL drops it: the next dp_module_grad allocates zeros.
  float host[2] = {4, 5};
  TensorPtr blob = host_blob(host);
  DP_ASSERT_OK(dp_module_set_grad(m.get(), "a", blob.get()));
  DP_ASSERT_OK(dp_module_set_grad(m.get(), "a", nullptr));
  TensorPtr fresh = grad(m.get(), "a");
  EXPECT_NE(dp_tensor_data(fresh.get()), static_cast<void*>(host));
  EXPECT_EQ(floats(fresh.get())[0], 0.0f);
}

TEST_F(DdpApi, GradientHandlesTakenBeforeBucketViewsMoveTheStorageFollowTheLiveGradient) {
  ModulePtr m = flat({{"a", DP_FLOAT32, 2}, {"b", DP_FLOAT32, 2}});
  TensorPtr a_before = grad(m.get(), "a");
  floats(a_before.get())[1] = 7.0f;
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.gradient_as_bucket_view = 1;
  o.bucket_cap_mb = o.first_bucket_cap_mb = cap_mb(8);  // a bucket each: marking a first changes the plan
  DdpPtr d = create(m.get(), &o);
  // Moved into its bucket at create, values kept; the old handle follows.
  TensorPtr a_now = grad(m.get(), "a");
  EXPECT_EQ(dp_tensor_data(a_before.get()), dp_tensor_data(a_now.get()));
  EXPECT_EQ(floats(a_before.get())[1], 7.0f);
  DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), "a"));
  DP_ASSERT_OK(dp_ddp_mark_grad_ready(d.get(), "b"));
  DP_ASSERT_OK(dp_ddp_finish_backward(d.get()));
  dp_ddp_stats stats{};
  stats.struct_size = sizeof stats;
  DP_ASSERT_OK(dp_ddp_last_stats(d.get(), &stats));
  ASSERT_EQ(stats.buckets_rebuilt, 1) << "the rebuild moved the storage again";
  TensorPtr a_after = grad(m.get(), "a");
  EXPECT_NE(dp_tensor_data(a_now.get()), nullptr);
  EXPECT_EQ(dp_tensor_data(a_before.get()), dp_tensor_data(a_after.get()));
  EXPECT_EQ(dp_tensor_data(a_now.get()), dp_tensor_data(a_after.get()));
  floats(a_before.get())[0] = 3.0f;  // writes land in the live gradient
  EXPECT_EQ(floats(a_after.get())[0], 3.0f);
}

TEST_F(DdpApi, TwoHandlesOverOneParametersMemoryAreOneTiedParameterAndAPartialOverlapIsEinvalNamingBoth) {
  float memory[4] = {1, 2, 3, 4};
  const int64_t two[1] = {2};
  const int64_t three[1] = {3};
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_tensor_from_blob(&t, memory, DP_FLOAT32, 1, two, dptest::cpu(0), nullptr, nullptr));
  TensorPtr first(t);
  DP_ASSERT_OK(dp_tensor_from_blob(&t, memory, DP_FLOAT32, 1, two, dptest::cpu(0), nullptr, nullptr));
  TensorPtr second(t);
  ModulePtr tied = dptest::new_module();
  DP_ASSERT_OK(dp_module_register_parameter(tied.get(), "embed", first.get(), 1));
  DP_ASSERT_OK(dp_module_register_parameter(tied.get(), "unembed", second.get(), 1));
  EXPECT_EQ(dp_module_num_parameters(tied.get()), 1u) << "a tied weight is counted once, as torch does";
  {
    DdpPtr d = create(tied.get());
    DP_EXPECT_OK(dp_ddp_mark_grad_ready(d.get(), "embed"));
    DP_EXPECT_OK(dp_ddp_finish_backward(d.get()));
  }
  DP_ASSERT_OK(dp_tensor_from_blob(&t, memory + 1, DP_FLOAT32, 1, three, dptest::cpu(0), nullptr, nullptr));
  TensorPtr shifted(t);
  ModulePtr overlapping = dptest::new_module();
  DP_ASSERT_OK(dp_module_register_parameter(overlapping.get(), "x", first.get(), 1));
  DP_ASSERT_OK(dp_module_register_parameter(overlapping.get(), "y", shifted.get(), 1));
  std::string message;
  EXPECT_EQ(refused(overlapping.get(), nullptr, &message), DP_EINVAL);
  EXPECT_NE(message.find("'x'"), std::string::npos) << message;
  EXPECT_NE(message.find("'y'"), std::string::npos) << message;
  EXPECT_NE(message.find("overlap"), std::string::npos) << message;
}
