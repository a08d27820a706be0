// One rank driving several dp_ddp the way a host's own autograd engine does:
// marks from worker threads in an order of its own, finishes in an order of
// its own, gradients in memory it owns. Over the public C API only. Every
// rank checks its numbers against single-process training and prints
// "rank R: SCENARIO passed" when all held.
#include <dparallel/dp_base.h>
#include <dparallel/dp_ddp.h>
#include <dparallel/dp_dist.h>
#include <dparallel/dp_module.h>
#include <dparallel/dp_tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_rank = -1;
int g_world = 0;
std::atomic<int> g_failures{0};

#define CHECK(cond, ...)                                            \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::fprintf(stdout, "rank %d: line %d: ", g_rank, __LINE__); \
      std::fprintf(stdout, __VA_ARGS__);                            \
      std::fprintf(stdout, "\n");                                   \
      ++g_failures;                                                 \
    }                                                               \
  } while (0)
#define CHECK_OK(call)                                                                                        \
  do {                                                                                                        \
    dp_status s_ = (call);                                                                                    \
    CHECK(s_ == DP_OK, "%s: status %d: %s", #call, static_cast<int>(s_), s_ == DP_OK ? "" : dp_last_error()); \
  } while (0)

constexpr int kLayers = 3;
constexpr int kParams = 2;  // w [4,4] and b [16]: 64 bytes each, a bucket each
constexpr int kNumel = 16;
const char* const kParamNames[kParams] = {"w", "b"};
constexpr float kLr = 0.1f;

// The gradient rank `rank` computes for element `i` of a parameter.
float grad_value(int rank, int it, int layer, int param, int i) {
  return std::sin(0.01f * static_cast<float>(rank * 7919 + it * 131 + layer * 17 + param * 5 + i)) + 0.5f;
}

// L1 runs with find_unused_parameters; its bias goes unused on some ranks.
bool uses(int rank, int it, int layer, int param) { return !(layer == 1 && param == 1 && (it + rank) % 4 == 0); }

// The iteration where the last rank forgets to mark L0's weight: L0's finish
// fails on every rank and leaves every gradient local.
constexpr int kForgetIteration = 7;
bool forgets(int rank, int it, int layer, int param) {
  return it == kForgetIteration && rank == g_world - 1 && layer == 0 && param == 0;
}

int custom_hook(void* /*user_data*/, dp_process_group* pg, size_t /*bucket*/, dp_tensor* flat) {
  if (dp_pg_all_reduce(pg, flat, DP_SUM) != DP_OK) return 1;
  auto* v = static_cast<float*>(dp_tensor_data(flat));
  for (int64_t i = 0; i < dp_tensor_numel(flat); ++i) v[i] /= static_cast<float>(g_world);
  return 0;
}

struct Layer {
  dp_module* module = nullptr;
  dp_ddp* ddp = nullptr;
  std::array<dp_tensor*, kParams> value{};
  std::array<dp_tensor*, kParams> grad{};             // dp_module_grad handles (L0, L1) or the host's own (L2)
  std::array<std::vector<float>, kParams> host_grad;  // L2: the host's gradient memory
};

float* data_of(dp_tensor* t) { return static_cast<float*>(dp_tensor_data(t)); }

dp_tensor* new_tensor(const int64_t* shape, int ndim) {
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, ndim, shape, dp_device{DP_DEVICE_CPU, 0}));
  return t;
}

void build(dp_module* root, std::array<Layer, kLayers>& layers) {
  const int64_t w_shape[2] = {4, 4};
  const int64_t b_shape[1] = {kNumel};
  for (int l = 0; l < kLayers; ++l) {
    Layer& layer = layers[l];
    CHECK_OK(dp_module_create(&layer.module));
    dp_tensor* w = new_tensor(w_shape, 2);
    dp_tensor* b = new_tensor(b_shape, 1);
    for (int i = 0; i < kNumel; ++i) {
      // Different on every rank: init_sync gives every rank rank 0's.
      data_of(w)[i] = static_cast<float>(g_rank + 1) * 0.01f * static_cast<float>(i + l);
      data_of(b)[i] = static_cast<float>(g_rank + 1) * -0.02f * static_cast<float>(i + l);
    }
    CHECK_OK(dp_module_register_parameter(layer.module, "w", w, 1));
    CHECK_OK(dp_module_register_parameter(layer.module, "b", b, 1));
    dp_tensor_destroy(w);
    dp_tensor_destroy(b);
    if (l == 0) {
      const int64_t shape[1] = {4};
      dp_tensor* running = new_tensor(shape, 1);
      std::memset(dp_tensor_data(running), 0, 4 * sizeof(float));
      CHECK_OK(dp_module_register_buffer(layer.module, "running", running, 1));
      dp_tensor_destroy(running);
    }
    std::string name = "l" + std::to_string(l);
    CHECK_OK(dp_module_register_module(root, name.c_str(), layer.module));
  }
}

// The reference: every rank's gradients averaged in one process.
struct Reference {
  float value[kLayers][kParams][kNumel];
};

void run_random(dp_process_group* pg, int iterations, unsigned seed) {
  dp_module* root = nullptr;
  CHECK_OK(dp_module_create(&root));
  std::array<Layer, kLayers> layers;
  build(root, layers);
  for (int l = 0; l < kLayers; ++l) {
    dp_ddp_options o;
    CHECK_OK(dp_ddp_options_init(&o, sizeof o));
    o.bucket_cap_mb = o.first_bucket_cap_mb = 64.0 / (1024.0 * 1024.0);  // a bucket per parameter, all equal
    if (l == 1) {
      o.gradient_as_bucket_view = 1;
      o.find_unused_parameters = 1;
    }
    if (l == 2) {
      o.comm_hook = DP_HOOK_CUSTOM;
      o.hook_fn = custom_hook;
    }
    CHECK_OK(dp_ddp_create(&layers[l].ddp, layers[l].module, pg, &o));
    CHECK(dp_ddp_num_buckets(layers[l].ddp) == 2, "L%d has %zu buckets, want 2", l, dp_ddp_num_buckets(layers[l].ddp));
    for (int p = 0; p < kParams; ++p) {
      CHECK_OK(dp_module_get_parameter(layers[l].module, kParamNames[p], &layers[l].value[p]));
      if (l == 2) {
        // The host's own gradient memory, handed over once.
        layers[l].host_grad[p].assign(kNumel, 0.0f);
        const int64_t shape_w[2] = {4, 4};
        const int64_t shape_b[1] = {kNumel};
        dp_tensor* blob = nullptr;
        CHECK_OK(dp_tensor_from_blob(&blob, layers[l].host_grad[p].data(), DP_FLOAT32, p == 0 ? 2 : 1,
                                     p == 0 ? shape_w : shape_b, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr));
        CHECK_OK(dp_module_set_grad(layers[l].module, kParamNames[p], blob));
        layers[l].grad[p] = blob;
      } else {
        CHECK_OK(dp_module_grad(layers[l].module, kParamNames[p], &layers[l].grad[p]));
      }
    }
  }
  if (g_failures > 0) return;
  Reference ref;
  for (int l = 0; l < kLayers; ++l) {
    for (int p = 0; p < kParams; ++p) {
      for (int i = 0; i < kNumel; ++i) {
        ref.value[l][p][i] = static_cast<float>(1) * (p == 0 ? 0.01f : -0.02f) * static_cast<float>(i + l);
        CHECK(data_of(layers[l].value[p])[i] == ref.value[l][p][i], "init_sync: L%d.%s[%d] is %g, want rank 0's %g", l,
              kParamNames[p], i, data_of(layers[l].value[p])[i], ref.value[l][p][i]);
      }
    }
  }
  std::mt19937 rng(seed * 1000003u + static_cast<unsigned>(g_rank));
  for (int it = 0; it < iterations && g_failures == 0; ++it) {
    // Forward: the buffers' broadcast, in one order on every rank.
    if (g_rank == 0) {
      for (int k = 0; k < 4; ++k) {
        dp_tensor* running = nullptr;
        CHECK_OK(dp_module_get_buffer(layers[0].module, "running", &running));
        data_of(running)[k] = static_cast<float>(it + k);
        dp_tensor_destroy(running);
      }
    }
    for (int l = 0; l < kLayers; ++l) CHECK_OK(dp_ddp_pre_forward(layers[l].ddp));
    dp_tensor* running = nullptr;
    CHECK_OK(dp_module_get_buffer(layers[0].module, "running", &running));
    CHECK(data_of(running)[3] == static_cast<float>(it + 3),
          "iteration %d: the buffer is %g after pre_forward, want %d", it, data_of(running)[3], it + 3);
    dp_tensor_destroy(running);

    // Backward: this rank's own mark order, spread over 3 threads.
    std::vector<std::pair<int, int>> items;
    for (int l = 0; l < kLayers; ++l) {
      for (int p = 0; p < kParams; ++p) items.emplace_back(l, p);
    }
    std::shuffle(items.begin(), items.end(), rng);
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        for (size_t k = static_cast<size_t>(t); k < items.size(); k += 3) {
          auto [l, p] = items[k];
          if (!uses(g_rank, it, l, p)) continue;
          float* g = data_of(layers[l].grad[p]);
          if (l != 2) {
            // The handle taken once follows the live gradient (bucket views move it).
            dp_tensor* fresh = nullptr;
            CHECK_OK(dp_module_grad(layers[l].module, kParamNames[p], &fresh));
            CHECK(data_of(fresh) == g, "iteration %d: L%d.%s's gradient handle points at %p, the gradient is at %p", it,
                  l, kParamNames[p], static_cast<void*>(g), dp_tensor_data(fresh));
            dp_tensor_destroy(fresh);
          }
          for (int i = 0; i < kNumel; ++i) g[i] = grad_value(g_rank, it, l, p, i);
          if (forgets(g_rank, it, l, p)) continue;
          CHECK_OK(dp_ddp_mark_grad_ready(layers[l].ddp, kParamNames[p]));
        }
      });
    }
    for (auto& t : threads) t.join();

    // This rank's own finish order; except where two dp_ddp have jobs that
    // wait for some rank's finish (L0's refusal on the rank that forgot a
    // mark, L1's unused bias): those finish in one order on every rank.
    std::array<int, kLayers> order = {0, 1, 2};
    if (it != kForgetIteration) std::shuffle(order.begin(), order.end(), rng);
    for (int l : order) {
      dp_status s = dp_ddp_finish_backward(layers[l].ddp);
      const bool fails = it == kForgetIteration && l == 0;
      if (fails) {
        CHECK(s != DP_OK, "iteration %d: L0's finish passed though rank %d did not mark L0.w", it, g_world - 1);
        // Every gradient of L0 is this rank's own.
        for (int p = 0; p < kParams; ++p) {
          float* g = data_of(layers[l].grad[p]);
          for (int i = 0; i < kNumel; ++i) {
            float want = grad_value(g_rank, it, l, p, i);
            CHECK(g[i] == want, "iteration %d: after the failed finish L0.%s[%d] is %g, want the local %g", it,
                  kParamNames[p], i, g[i], want);
          }
        }
        continue;  // the step is skipped for L0, as in the reference
      }
      CHECK(s == DP_OK, "iteration %d: L%d's finish: %s", it, l, s == DP_OK ? "" : dp_last_error());
      for (int p = 0; p < kParams; ++p) {
        float* g = data_of(layers[l].grad[p]);
        float* v = data_of(layers[l].value[p]);
        for (int i = 0; i < kNumel; ++i) {
          float sum = 0;
          for (int r = 0; r < g_world; ++r) sum += uses(r, it, l, p) ? grad_value(r, it, l, p, i) : 0.0f;
          const float want = sum / static_cast<float>(g_world);
          CHECK(std::fabs(g[i] - want) <= 1e-5f * (1 + std::fabs(want)), "iteration %d: L%d.%s[%d] is %g, want %g", it,
                l, kParamNames[p], i, g[i], want);
          v[i] -= kLr * g[i];
          ref.value[l][p][i] -= kLr * want;
          CHECK(std::fabs(v[i] - ref.value[l][p][i]) <= 1e-4f * (1 + std::fabs(ref.value[l][p][i])),
                "iteration %d: L%d.%s[%d] is %g after the step, single-process training has %g", it, l, kParamNames[p],
                i, v[i], ref.value[l][p][i]);
        }
      }
    }
  }
  for (Layer& layer : layers) {
    for (int p = 0; p < kParams; ++p) {
      dp_tensor_destroy(layer.value[p]);
      dp_tensor_destroy(layer.grad[p]);
    }
    dp_ddp_destroy(layer.ddp);
    dp_module_destroy(layer.module);
  }
  dp_module_destroy(root);
}

// The host's own collectives on the group while a backward is in flight
// are refused on the calling rank (DP_ESTATE, nothing sent) and the group
// stays usable: the same call after the finishes works, and so does the
// next iteration.
void run_host_collective(dp_process_group* pg) {
  dp_module* root = nullptr;
  CHECK_OK(dp_module_create(&root));
  std::array<Layer, kLayers> layers;
  build(root, layers);
  for (int l = 0; l < 2; ++l) CHECK_OK(dp_ddp_create(&layers[l].ddp, layers[l].module, pg, nullptr));
  const int64_t one[1] = {1};
  dp_tensor* t = new_tensor(one, 1);
  for (int it = 0; it < 3 && g_failures == 0; ++it) {
    for (int l = 0; l < 2; ++l) CHECK_OK(dp_ddp_pre_forward(layers[l].ddp));
    CHECK_OK(dp_ddp_mark_grad_ready(layers[1].ddp, "b"));
    data_of(t)[0] = 1.0f;
    dp_status s = dp_pg_all_reduce(pg, t, DP_SUM);
    CHECK(s == DP_ESTATE, "iteration %d: the host's all_reduce during a backward gave status %d, want DP_ESTATE", it,
          static_cast<int>(s));
    std::string message = s == DP_OK ? "" : dp_last_error();
    CHECK(message.find("refused") != std::string::npos && message.find("backward") != std::string::npos,
          "iteration %d: the refusal does not say why: %s", it, message.c_str());
    CHECK(data_of(t)[0] == 1.0f, "iteration %d: the refused all_reduce changed its tensor", it);
    CHECK_OK(dp_ddp_mark_grad_ready(layers[1].ddp, "w"));
    for (int p = 0; p < kParams; ++p) CHECK_OK(dp_ddp_mark_grad_ready(layers[0].ddp, kParamNames[p]));
    dp_work* work = nullptr;
    s = dp_pg_barrier_async(pg, &work);
    CHECK(s == DP_ESTATE, "iteration %d: the host's async barrier during a backward gave status %d", it,
          static_cast<int>(s));
    if (work != nullptr) dp_work_destroy(work);
    CHECK_OK(dp_ddp_finish_backward(layers[g_rank % 2].ddp));
    CHECK_OK(dp_ddp_finish_backward(layers[1 - g_rank % 2].ddp));
    CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
    CHECK(data_of(t)[0] == static_cast<float>(g_world),
          "iteration %d: the host's all_reduce after the finishes gave %g", it, data_of(t)[0]);
  }
  dp_tensor_destroy(t);
  for (int l = 0; l < 2; ++l) dp_ddp_destroy(layers[l].ddp);
  for (Layer& layer : layers) dp_module_destroy(layer.module);
  dp_module_destroy(root);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const char* rank_text = std::getenv("RANK");
  const char* world_text = std::getenv("WORLD_SIZE");
  g_rank = rank_text != nullptr ? std::atoi(rank_text) : -1;
  g_world = world_text != nullptr ? std::atoi(world_text) : 0;
  std::string scenario = argc >= 2 ? argv[1] : "";
  if (scenario != "random" && scenario != "host_collective") {
    std::fprintf(stderr, "usage: ddp_host_worker random|host_collective; unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  const char* iterations_text = std::getenv("DP_TEST_ITERATIONS");
  const char* seed_text = std::getenv("DP_TEST_SEED");
  const int iterations = iterations_text != nullptr ? std::atoi(iterations_text) : 200;
  const unsigned seed = seed_text != nullptr ? static_cast<unsigned>(std::strtoul(seed_text, nullptr, 10)) : 1u;
  dp_process_group_options opts;
  dp_process_group_options_init(&opts, sizeof opts);
  opts.timeout_ms = 60000;
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    std::fprintf(stderr, "rank %d: group create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  if (scenario == "random") {
    run_random(pg, iterations, seed);
  } else {
    run_host_collective(pg);
  }
  dp_process_group_destroy(pg);
  if (g_failures == 0)
    std::printf("rank %d: %s passed (seed %u, %d iterations)\n", g_rank, scenario.c_str(), seed, iterations);
  return g_failures == 0 ? 0 : 1;
}
