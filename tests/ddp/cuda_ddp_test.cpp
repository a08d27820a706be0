// The DDP reducer on a GPU: an NCCL group of world size 1 on cuda:0 runs
// every GPU step (ready events on the host's stream, copies into buckets,
// the 16-bit casts, the division). Compiled always; skips without a GPU.
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "test_util.h"

using namespace dptest;

#define REQUIRE_GPUS(n) \
  if (cuda_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda_count()

namespace {

struct Cleanup {
  dp_store* store = nullptr;
  dp_process_group* pg = nullptr;
  dp_module* module = nullptr;
  dp_ddp* ddp = nullptr;
  ~Cleanup() {
    dp_ddp_destroy(ddp);
    dp_module_destroy(module);
    dp_process_group_destroy(pg);
    dp_store_destroy(store);
  }
};

// A module of two float32 parameters on cuda:0 under an NCCL group of one rank.
void setup(Cleanup& c, const dp_ddp_options& opts) {
  char path[] = "/tmp/dp_cuda_ddp_store_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  ::unlink(path);
  DP_ASSERT_OK(dp_store_create_file(&c.store, path, 1));
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.backend = DP_BACKEND_NCCL;
  o.rank = 0;
  o.world_size = 1;
  o.store = c.store;
  o.timeout_ms = 60000;
  o.device = cuda(0);
  DP_ASSERT_OK(dp_process_group_create(&c.pg, &o));
  DP_ASSERT_OK(dp_module_create(&c.module));
  auto w = make<float>({3, 2}, iota<float>(6), cuda(0));
  auto b = make<float>({2}, {1, 2}, cuda(0));
  DP_ASSERT_OK(dp_module_register_parameter(c.module, "weight", w.get(), 1));
  DP_ASSERT_OK(dp_module_register_parameter(c.module, "bias", b.get(), 1));
  DP_ASSERT_OK(dp_ddp_create(&c.ddp, c.module, c.pg, &opts));
}

std::vector<float> grad_values(dp_module* module, const char* name) {
  dp_tensor* g = nullptr;
  EXPECT_EQ(dp_module_grad(module, name, &g), DP_OK) << dp_last_error();
  TensorPtr owner(g);
  return values<float>(g);
}

void set_grad(dp_module* module, const char* name, const std::vector<float>& v) {
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_module_grad(module, name, &g), DP_OK) << dp_last_error();
  TensorPtr owner(g);
  DP_ASSERT_OK(dp_tensor_copy_from_host(g, v.data(), v.size() * sizeof(float)));
}

// One backward with the given gradients; returns what the module holds after.
void step(Cleanup& c, const std::vector<float>& gw, const std::vector<float>& gb) {
  set_grad(c.module, "weight", gw);
  set_grad(c.module, "bias", gb);
  DP_ASSERT_OK(dp_ddp_mark_grad_ready_stream(c.ddp, 1, nullptr));
  DP_ASSERT_OK(dp_ddp_mark_grad_ready_stream(c.ddp, 0, nullptr));
  DP_ASSERT_OK(dp_ddp_finish_backward(c.ddp));
}

const std::vector<float> kWeightGrad = {0.5f, -1.25f, 3, 4, 1e-3f, -7};
const std::vector<float> kBiasGrad = {2, -0.75f};

}  // namespace

TEST(CudaDdp, WorldSizeOneAverageLeavesGradientsAsMarkedOnTheStream) {
  REQUIRE_GPUS(1);
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  Cleanup c;
  setup(c, opts);
  for (int i = 0; i < 3; ++i) {  // the second iteration runs on the rebuilt plan
    step(c, kWeightGrad, kBiasGrad);
    EXPECT_EQ(grad_values(c.module, "weight"), kWeightGrad);
    EXPECT_EQ(grad_values(c.module, "bias"), kBiasGrad);
  }
}

TEST(CudaDdp, GradientAsBucketViewOnTheGpu) {
  REQUIRE_GPUS(1);
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  opts.gradient_as_bucket_view = 1;
  Cleanup c;
  setup(c, opts);
  for (int i = 0; i < 2; ++i) {
    step(c, kWeightGrad, kBiasGrad);
    EXPECT_EQ(grad_values(c.module, "weight"), kWeightGrad);
  }
}

TEST(CudaDdp, Fp16AndBf16HooksCastOnTheGpu) {
  REQUIRE_GPUS(1);
  for (int32_t hook : {DP_HOOK_FP16, DP_HOOK_BF16}) {
    SCOPED_TRACE(hook == DP_HOOK_FP16 ? "fp16" : "bf16");
    dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
    opts.comm_hook = hook;
    Cleanup c;
    setup(c, opts);
    // 1 + 2^-15 survives neither cast; 3 and -0.75 survive both.
    step(c, {1.0f + 1.0f / 32768, 3, 3, 3, 3, 3}, {-0.75f, 3});
    std::vector<float> w = grad_values(c.module, "weight");
    EXPECT_EQ(w[0], 1.0f);
    EXPECT_EQ(w[1], 3.0f);
    EXPECT_EQ(grad_values(c.module, "bias"), (std::vector<float>{-0.75f, 3}));
  }
}
