// fully_shard through the C ABI, driven as a host with its own autograd
// drives it: the seed test's ToyModel (3 x Linear(3, 3) in `linears`, then
// `proj`), fully_shard on each linear and on `linears`, a dp_ddp on the
// root, and a forward and backward written here. Ranks are threads of this
// process, each with its own group over one file store: real collectives,
// and the test sees every rank's results.
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backends.h"
#include "module/module_test_util.h"
#include "streams/stream_test_util.h"
#include "test_util.h"
#include "thread_ranks.h"

using dptest::DdpPtr;
using dptest::FsdpPtr;
using dptest::make;
using dptest::TensorPtr;

namespace {

// dp_fsdp_create, owned; null (the failure reported) when it fails.
FsdpPtr fully_shard(dp_module* m, dp_process_group* pg, const dp_fsdp_options* o = nullptr) {
  dp_fsdp* f = nullptr;
  EXPECT_EQ(dp_fsdp_create(&f, m, pg, o), DP_OK) << dp_last_error();
  return FsdpPtr(f);
}

void run_ranks(int world, int32_t backend, const std::function<void(int, dp_process_group*)>& body,
               int timeout_ms = 60000, bool cuda = false) {
  dptest::run_thread_ranks("fsdp_", world, dptest::RankOptions{backend, timeout_ms, cuda}, body);
}

float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t word;
  std::memcpy(&word, &f, sizeof word);
  word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(word >> 16);
}

// IEEE half precision, normal numbers and zero (what the tests hold).
float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t word = sign;
  if (exponent != 0) word |= ((exponent + 112u) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

uint16_t float_to_fp16(float f) {
  uint32_t word;
  std::memcpy(&word, &f, sizeof word);
  const auto sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  const int exponent = static_cast<int>((word >> 23) & 0xffu) - 112;
  if (exponent <= 0) return sign;  // below half's normal range: zero
  uint32_t rest = word & 0x7fffffu;
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (rest >> 13);
  rest &= 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u) != 0)) ++half;  // round to nearest even
  return static_cast<uint16_t>(sign | half);
}

// A float32, bfloat16 or float16 tensor's values as floats.
std::vector<float> read(const dp_tensor* t) {
  const auto n = static_cast<size_t>(dp_tensor_numel(t));
  std::vector<float> out(n);
  if (dp_tensor_dtype(t) == DP_BFLOAT16 || dp_tensor_dtype(t) == DP_FLOAT16) {
    std::vector<uint16_t> bits(n);
    EXPECT_EQ(dp_tensor_copy_to_host(t, bits.data(), n * 2), DP_OK) << dp_last_error();
    const bool bf16 = dp_tensor_dtype(t) == DP_BFLOAT16;
    for (size_t i = 0; i < n; ++i) out[i] = bf16 ? bf16_to_float(bits[i]) : fp16_to_float(bits[i]);
  } else {
    EXPECT_EQ(dp_tensor_copy_to_host(t, out.data(), n * 4), DP_OK) << dp_last_error();
  }
  return out;
}

void write(dp_tensor* t, const std::vector<float>& v) {
  ASSERT_EQ(static_cast<size_t>(dp_tensor_numel(t)), v.size());
  if (dp_tensor_dtype(t) == DP_BFLOAT16 || dp_tensor_dtype(t) == DP_FLOAT16) {
    const bool bf16 = dp_tensor_dtype(t) == DP_BFLOAT16;
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = bf16 ? float_to_bf16(v[i]) : float_to_fp16(v[i]);
    ASSERT_EQ(dp_tensor_copy_from_host(t, bits.data(), bits.size() * 2), DP_OK) << dp_last_error();
  } else {
    ASSERT_EQ(dp_tensor_copy_from_host(t, v.data(), v.size() * 4), DP_OK) << dp_last_error();
  }
}

std::vector<float> parameter(dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << dp_last_error();
  TensorPtr owned(p);
  return p == nullptr ? std::vector<float>{} : read(p);
}

std::vector<float> parameter_grad(dp_module* m, const char* name) {
  dp_tensor* g = nullptr;
  EXPECT_EQ(dp_module_grad(m, name, &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  return g == nullptr ? std::vector<float>{} : read(g);
}

std::vector<int64_t> parameter_shape(dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << dp_last_error();
  TensorPtr owned(p);
  return dptest::shape(p);
}

// grad += delta (the host's backward accumulates).
void add_grad(dp_module* m, const char* name, const std::vector<float>& delta) {
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_module_grad(m, name, &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  std::vector<float> v = read(g);
  for (size_t i = 0; i < v.size(); ++i) v[i] += delta[i];
  write(g, v);
}

// ---- the model's math: rows of 3, weights 3x3 (out x in) ----

constexpr int kDim = 3;
using Matrix = std::vector<double>;  // row-major

// y = x W^T for rows of x.
Matrix linear(const Matrix& x, const std::vector<float>& w) {
  const size_t rows = x.size() / kDim;
  Matrix y(rows * kDim, 0.0);
  for (size_t b = 0; b < rows; ++b) {
    for (int o = 0; o < kDim; ++o) {
      for (int i = 0; i < kDim; ++i) y[b * kDim + o] += x[b * kDim + i] * w[o * kDim + i];
    }
  }
  return y;
}

// dW = dy^T x; dx = dy W.
std::vector<float> weight_grad(const Matrix& dy, const Matrix& x) {
  const size_t rows = x.size() / kDim;
  std::vector<float> g(kDim * kDim, 0.0f);
  for (size_t b = 0; b < rows; ++b) {
    for (int o = 0; o < kDim; ++o) {
      for (int i = 0; i < kDim; ++i) g[o * kDim + i] += static_cast<float>(dy[b * kDim + o] * x[b * kDim + i]);
    }
  }
  return g;
}

Matrix input_grad(const Matrix& dy, const std::vector<float>& w) {
  const size_t rows = dy.size() / kDim;
  Matrix dx(rows * kDim, 0.0);
  for (size_t b = 0; b < rows; ++b) {
    for (int i = 0; i < kDim; ++i) {
      for (int o = 0; o < kDim; ++o) dx[b * kDim + i] += dy[b * kDim + o] * w[o * kDim + i];
    }
  }
  return dx;
}

const char* const kWeights[] = {"linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight"};

// Layer l's initial weights; `skew` differs per rank so that init_sync shows.
std::vector<float> initial_weights(int layer, float skew) {
  std::vector<float> w(kDim * kDim);
  for (int k = 0; k < kDim * kDim; ++k) {
    w[k] = 0.3f * std::sin(1.7f * static_cast<float>(layer * 9 + k) + 0.4f) + skew;
  }
  return w;
}

// Global batch `step`: rows of x and target, `rows` of them.
void batch(int step, int rows, Matrix& x, Matrix& t) {
  x.assign(static_cast<size_t>(rows) * kDim, 0.0);
  t.assign(x.size(), 0.0);
  for (size_t k = 0; k < x.size(); ++k) {
    x[k] = std::cos(0.37 * static_cast<double>(k) + 0.91 * step);
    t[k] = 0.5 * std::sin(0.53 * static_cast<double>(k) - 0.29 * step);
  }
}

Matrix rows_of(const Matrix& m, int first, int count) {
  return Matrix(m.begin() + first * kDim, m.begin() + (first + count) * kDim);
}

struct Config {
  int world = 2;
  dptest::Backend backend = dptest::Backend::kGloo;  // cuda tensors, rank r on cuda:r, where it carries them
  int reshard_after_forward = 1;
  int32_t param_dtype = -1;
  int32_t reduce_dtype = -1;
  int micro_batches = 1;  // > 1: the first ones without gradient sync
  int steps = 4;
  int rows_per_rank = 4;
  float lr = 0.2f;
  int views = 0;  // full_params_as_views on the linears
  bool cuda() const { return dptest::info_of(backend).device == DP_DEVICE_CUDA; }
};

// Single-process training on the whole batch: the reference.
std::vector<std::vector<float>> reference(const Config& c) {
  std::vector<std::vector<float>> w;
  for (int l = 0; l < 4; ++l) w.push_back(initial_weights(l, 0.0f));
  const int rows = c.rows_per_rank * c.world;
  for (int s = 0; s < c.steps; ++s) {
    std::vector<std::vector<double>> g(4, std::vector<double>(kDim * kDim, 0.0));
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      Matrix x, t;
      batch(s * c.micro_batches + mb, rows, x, t);
      std::vector<Matrix> h{x};
      for (int l = 0; l < 4; ++l) h.push_back(linear(h.back(), w[l]));
      Matrix dy(h[4].size());
      for (size_t k = 0; k < dy.size(); ++k) dy[k] = (h[4][k] - t[k]) / rows;
      for (int l = 3; l >= 0; --l) {
        std::vector<float> gl = weight_grad(dy, h[l]);
        for (int k = 0; k < kDim * kDim; ++k) g[l][k] += gl[k];
        dy = input_grad(dy, w[l]);
      }
    }
    for (int l = 0; l < 4; ++l) {
      for (int k = 0; k < kDim * kDim; ++k) w[l][k] -= static_cast<float>(c.lr * g[l][k]);
    }
  }
  return w;
}

// One rank's ToyModel: root { linears { 0, 1, 2 }, proj }.
struct Toy {
  dptest::ModulePtr root = dptest::new_module();
  dptest::ModulePtr linears = dptest::new_module();
  dptest::ModulePtr layer[4];
  explicit Toy(float skew, dp_device device = dptest::cpu(0)) {
    for (int l = 0; l < 4; ++l) {
      layer[l] = dptest::new_module();
      TensorPtr w = make<float>({kDim, kDim}, initial_weights(l, skew), device);
      EXPECT_EQ(dp_module_register_parameter(layer[l].get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
      if (l < 3) {
        EXPECT_EQ(dp_module_register_module(linears.get(), std::to_string(l).c_str(), layer[l].get()), DP_OK);
      }
    }
    EXPECT_EQ(dp_module_register_module(root.get(), "linears", linears.get()), DP_OK);
    EXPECT_EQ(dp_module_register_module(root.get(), "proj", layer[3].get()), DP_OK);
  }
};

// fully_shard on each linear, then on `linears`, then a dp_ddp on the root.
struct Sharded {
  FsdpPtr layer[3];
  FsdpPtr linears;
  DdpPtr ddp;
};

Sharded shard_toy(Toy& toy, dp_process_group* pg, const Config& c) {
  Sharded s;
  dp_fsdp_options o;
  EXPECT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
  o.reshard_after_forward = c.reshard_after_forward;
  o.param_dtype = c.param_dtype;
  o.reduce_dtype = c.reduce_dtype;
  o.full_params_as_views = c.views;
  for (int l = 0; l < 3; ++l) {
    s.layer[l] = fully_shard(toy.layer[l].get(), pg, &o);
  }
  s.linears = fully_shard(toy.linears.get(), pg, &o);
  dp_ddp* d = nullptr;
  EXPECT_EQ(dp_ddp_create(&d, toy.root.get(), pg, nullptr), DP_OK) << dp_last_error();
  s.ddp.reset(d);
  return s;
}

// One micro-batch's forward and backward, as a host drives it: unshard
// with the next module prefetched, reshard after each forward, post_backward
// as each module's gradients are final.
void forward_backward(Toy& toy, Sharded& s, const Matrix& x, const Matrix& t) {
  dp_module* root = toy.root.get();
  std::vector<Matrix> h{x};
  std::vector<std::vector<float>> w(4);
  ASSERT_EQ(dp_fsdp_unshard(s.linears.get(), 0), DP_OK) << dp_last_error();  // manages nothing
  ASSERT_EQ(dp_fsdp_unshard(s.layer[0].get(), 0), DP_OK) << dp_last_error();
  for (int l = 0; l < 3; ++l) {
    if (l + 1 < 3) {
      ASSERT_EQ(dp_fsdp_unshard(s.layer[l + 1].get(), 1), DP_OK) << dp_last_error();
    }
    ASSERT_EQ(dp_fsdp_wait_unshard(s.layer[l].get()), DP_OK) << dp_last_error();
    w[l] = parameter(root, kWeights[l]);
    h.push_back(linear(h.back(), w[l]));
    ASSERT_EQ(dp_fsdp_reshard(s.layer[l].get()), DP_OK) << dp_last_error();
  }
  ASSERT_EQ(dp_ddp_pre_forward(s.ddp.get()), DP_OK) << dp_last_error();
  w[3] = parameter(root, kWeights[3]);
  h.push_back(linear(h.back(), w[3]));
  // Each rank's loss is the mean over its rows; the ranks' average is then
  // the mean over the whole batch.
  Matrix dy(h[4].size());
  const auto rows = static_cast<double>(x.size() / kDim);
  for (size_t k = 0; k < dy.size(); ++k) dy[k] = (h[4][k] - t[k]) / rows;
  add_grad(root, kWeights[3], weight_grad(dy, h[3]));
  ASSERT_EQ(dp_ddp_mark_grad_ready(s.ddp.get(), kWeights[3]), DP_OK) << dp_last_error();
  dy = input_grad(dy, w[3]);
  ASSERT_EQ(dp_fsdp_unshard(s.layer[2].get(), 1), DP_OK) << dp_last_error();
  for (int l = 2; l >= 0; --l) {
    if (l > 0) {
      ASSERT_EQ(dp_fsdp_unshard(s.layer[l - 1].get(), 1), DP_OK) << dp_last_error();
    }
    ASSERT_EQ(dp_fsdp_wait_unshard(s.layer[l].get()), DP_OK) << dp_last_error();
    std::vector<float> full = parameter(root, kWeights[l]);
    add_grad(root, kWeights[l], weight_grad(dy, h[l]));
    dy = input_grad(dy, full);
    ASSERT_EQ(dp_fsdp_post_backward(s.layer[l].get()), DP_OK) << dp_last_error();
  }
  ASSERT_EQ(dp_fsdp_post_backward(s.linears.get()), DP_OK) << dp_last_error();
  for (int l = 0; l < 3; ++l) ASSERT_EQ(dp_fsdp_finish_backward(s.layer[l].get()), DP_OK) << dp_last_error();
  ASSERT_EQ(dp_fsdp_finish_backward(s.linears.get()), DP_OK) << dp_last_error();
  ASSERT_EQ(dp_ddp_finish_backward(s.ddp.get()), DP_OK) << dp_last_error();
}

// SGD on the shards and on proj, then every gradient zeroed.
void sgd(Toy& toy, Sharded& s, float lr) {
  for (int l = 0; l < 3; ++l) {
    dp_tensor* shard = nullptr;
    dp_tensor* grad = nullptr;
    ASSERT_EQ(dp_fsdp_shard(s.layer[l].get(), 0, &shard), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_shard_grad(s.layer[l].get(), 0, &grad), DP_OK) << dp_last_error();
    TensorPtr owned_shard(shard), owned_grad(grad);
    std::vector<float> v = read(shard), g = read(grad);
    for (size_t k = 0; k < v.size(); ++k) v[k] -= lr * g[k];
    write(shard, v);
  }
  dp_tensor* p = nullptr;
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_module_get_parameter(toy.root.get(), kWeights[3], &p), DP_OK);
  ASSERT_EQ(dp_module_grad(toy.root.get(), kWeights[3], &g), DP_OK);
  TensorPtr owned_p(p), owned_g(g);
  std::vector<float> v = read(p), gv = read(g);
  for (size_t k = 0; k < v.size(); ++k) v[k] -= lr * gv[k];
  write(p, v);
  ASSERT_EQ(dp_module_zero_grad(toy.root.get()), DP_OK) << dp_last_error();
}

// Whether parameter `name`'s full value (unsharded by `f`) is a view whose
// rows `rank` keeps are its shard itself; its split of 3 rows must not be empty.
bool full_is_view_of_shard(dp_module* root, const char* name, dp_fsdp* f, int rank, int world) {
  dp_tensor* full = nullptr;
  dp_tensor* shard = nullptr;
  EXPECT_EQ(dp_module_get_parameter(root, name, &full), DP_OK);
  EXPECT_EQ(dp_fsdp_shard(f, 0, &shard), DP_OK);
  TensorPtr owned_full(full), owned_shard(shard);
  if (full == nullptr || shard == nullptr) return false;
  const int chunk = (kDim + world - 1) / world;
  const auto row_bytes = static_cast<ptrdiff_t>(kDim * sizeof(float));
  return static_cast<const char*>(dp_tensor_data(full)) + chunk * rank * row_bytes ==
         static_cast<const char*>(dp_tensor_data(shard));
}

// Trains on every rank and compares each rank's full parameters with the reference.
void expect_parity(const Config& c, double tolerance) {
  const std::vector<std::vector<float>> expected = reference(c);
  run_ranks(
      c.world, dptest::backend_option(c.backend),
      [&](int rank, dp_process_group* pg) {
        EXPECT_STREQ(dp_process_group_backend(pg), dptest::reported_backend(c.backend));
        Toy toy(0.05f * static_cast<float>(rank),  // init_sync makes rank 0's values everyone's
                c.cuda() ? dptest::cuda(rank) : dptest::cpu(0));
        Sharded s = shard_toy(toy, pg, c);
        const int global_rows = c.rows_per_rank * c.world;
        for (int step = 0; step < c.steps; ++step) {
          for (int mb = 0; mb < c.micro_batches; ++mb) {
            const int sync = mb + 1 == c.micro_batches ? 1 : 0;
            for (auto& f : s.layer) ASSERT_EQ(dp_fsdp_set_requires_gradient_sync(f.get(), sync), DP_OK);
            ASSERT_EQ(dp_ddp_set_requires_gradient_sync(s.ddp.get(), sync), DP_OK);
            Matrix x, t;
            batch(step * c.micro_batches + mb, global_rows, x, t);
            forward_backward(toy, s, rows_of(x, rank * c.rows_per_rank, c.rows_per_rank),
                             rows_of(t, rank * c.rows_per_rank, c.rows_per_rank));
          }
          sgd(toy, s, c.lr);
        }
        // Views where they can be: shared memory, no cast.
        const bool views = c.views != 0 && c.backend == dptest::Backend::kShm && c.world > 1 && c.param_dtype == -1;
        for (int l = 0; l < 4; ++l) {
          if (l < 3) {
            ASSERT_EQ(dp_fsdp_unshard(s.layer[l].get(), 0), DP_OK) << dp_last_error();
            if (c.views != 0) {
              EXPECT_EQ(full_is_view_of_shard(toy.root.get(), kWeights[l], s.layer[l].get(), rank, c.world), views);
            }
          }
          std::vector<float> got = parameter(toy.root.get(), kWeights[l]);
          ASSERT_EQ(got.size(), expected[l].size());
          for (size_t k = 0; k < got.size(); ++k) {
            EXPECT_NEAR(got[k], expected[l][k], tolerance * (1.0 + std::fabs(expected[l][k])))
                << "rank " << rank << " " << kWeights[l] << "[" << k << "]";
          }
          if (l < 3) {
            ASSERT_EQ(dp_fsdp_reshard(s.layer[l].get()), DP_OK) << dp_last_error();
          }
        }
      },
      60000, c.cuda());
}

}  // namespace

TEST(Fsdp, ToyModelShardsRowsLikeTorchChunkAndDdpManagesOnlyProj) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    Config c;
    Sharded s = shard_toy(toy, pg, c);
    for (int l = 0; l < 3; ++l) {
      EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[l]), (std::vector<int64_t>{rank == 0 ? 2 : 1, 3}));
      ASSERT_EQ(dp_fsdp_num_parameters(s.layer[l].get()), 1u);
      const char* name = nullptr;
      ASSERT_EQ(dp_fsdp_parameter_name(s.layer[l].get(), 0, &name), DP_OK);
      EXPECT_STREQ(name, "weight");
      // The shard holds this rank's rows of the initial weight.
      std::vector<float> all = initial_weights(l, 0.0f);
      std::vector<float> mine(all.begin() + (rank == 0 ? 0 : 6), all.begin() + (rank == 0 ? 6 : 9));
      EXPECT_EQ(parameter(toy.root.get(), kWeights[l]), mine);
    }
    EXPECT_EQ(dp_fsdp_num_parameters(s.linears.get()), 0u);
    ASSERT_EQ(dp_ddp_num_buckets(s.ddp.get()), 1u);
    size_t indices[4] = {};
    size_t count = 0;
    ASSERT_EQ(dp_ddp_bucket_parameters(s.ddp.get(), 0, indices, 4, &count), DP_OK);
    EXPECT_EQ(count, 1u);
    char plan[512];
    size_t len = 0;
    ASSERT_EQ(dp_ddp_bucket_plan(s.ddp.get(), plan, sizeof plan, &len), DP_OK) << dp_last_error();
    EXPECT_NE(std::string(plan).find("proj.weight"), std::string::npos) << plan;
    EXPECT_EQ(std::string(plan).find("linears"), std::string::npos) << plan;
    // Unsharded, the slot holds the full parameter.
    ASSERT_EQ(dp_fsdp_unshard(s.layer[1].get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter(toy.root.get(), kWeights[1]), initial_weights(1, 0.0f));
    ASSERT_EQ(dp_fsdp_reshard(s.layer[1].get()), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[1]), (std::vector<int64_t>{rank == 0 ? 2 : 1, 3}));
  });
}

// fully_shard training against single-process training on the whole batch,
// over every backend whose ranks can be threads (backends.h), on the tensors
// each carries: FsdpParity at world sizes 1 to 3 in float32, bfloat16 and
// float16 compute (reduced in the compute dtype, float16 divided by the
// world size first); FsdpParityFloat32's variants at 1 and 2.
class FsdpParityFloat32 : public ::testing::TestWithParam<dptest::BackendWorld> {
 protected:
  // Skipped where this machine cannot run the backend.
  void SetUp() override {
    c_.backend = std::get<0>(GetParam());
    c_.world = std::get<1>(GetParam());
    DP_SKIP_UNLESS_AVAILABLE(c_.backend, c_.world);
  }
  Config c_;
};

class FsdpParity : public ::testing::TestWithParam<std::tuple<dptest::BackendWorld, int32_t>> {
 protected:
  void SetUp() override {
    c_.backend = std::get<0>(std::get<0>(GetParam()));
    c_.world = std::get<1>(std::get<0>(GetParam()));
    c_.param_dtype = std::get<1>(GetParam());
    DP_SKIP_UNLESS_AVAILABLE(c_.backend, c_.world);
  }
  // Within the compute dtype's precision.
  double tolerance() const {
    if (c_.param_dtype == DP_BFLOAT16) return 3e-2;
    return c_.param_dtype == DP_FLOAT16 ? 1e-2 : 2e-5;
  }
  Config c_;
};

// "gloo_world2_bfloat16", for test names.
std::string backend_world_dtype_name(const ::testing::TestParamInfo<FsdpParity::ParamType>& instance) {
  const int32_t dtype = std::get<1>(instance.param);
  const char* compute = dtype == DP_BFLOAT16 ? "bfloat16" : dtype == DP_FLOAT16 ? "float16" : "float32";
  const dptest::BackendWorld& run = std::get<0>(instance.param);
  return dptest::backend_world_name(std::get<0>(run), std::get<1>(run)) + "_" + compute;
}

INSTANTIATE_TEST_SUITE_P(Backends, FsdpParity,
                         ::testing::Combine(::testing::ValuesIn(dptest::backend_worlds(dptest::RankKind::kThreads,
                                                                                       {1, 2, 3})),
                                            ::testing::Values(-1, DP_BFLOAT16, DP_FLOAT16)),
                         backend_world_dtype_name);
INSTANTIATE_TEST_SUITE_P(Backends, FsdpParityFloat32,
                         ::testing::ValuesIn(dptest::backend_worlds(dptest::RankKind::kThreads, {1, 2})),
                         dptest::BackendWorldName());

TEST_P(FsdpParity, TrainingMatchesSingleProcessOnTheWholeBatchWithPrefetch) { expect_parity(c_, tolerance()); }

// Views where they can be (shared memory, world > 1, no cast); copies that
// match elsewhere, and with a param_dtype, as views cannot hold a cast.
TEST_P(FsdpParity, TrainingMatchesWithFullParametersAsViewsOrTheirCopies) {
  c_.views = 1;
  expect_parity(c_, tolerance());
}

TEST_P(FsdpParityFloat32, TrainingMatchesWithParametersKeptUnshardedFromForwardToBackward) {
  c_.reshard_after_forward = 0;
  expect_parity(c_, 2e-5);
}

TEST_P(FsdpParityFloat32, TrainingMatchesWithGradientsAccumulatedUnsyncedOverMicroBatches) {
  c_.micro_batches = 3;
  expect_parity(c_, 2e-5);
}

TEST_P(FsdpParityFloat32, TrainingMatchesWithViewsAndZero2OverUnsyncedMicroBatches) {
  c_.views = 1;
  c_.reshard_after_forward = 0;
  c_.micro_batches = 3;
  expect_parity(c_, 2e-5);
}

TEST_P(FsdpParityFloat32, TrainingInFloat16ReducedInFloat32MatchesWithinFloat16Tolerance) {
  c_.param_dtype = DP_FLOAT16;
  c_.reduce_dtype = DP_FLOAT32;
  expect_parity(c_, 1e-2);
}

// Four ranks for three rows: the last rank's shards are empty, and it
// still takes part in every all-gather and reduce-scatter.
class FsdpParityFourRanks : public FsdpParityFloat32 {};
INSTANTIATE_TEST_SUITE_P(Backends, FsdpParityFourRanks,
                         ::testing::ValuesIn(dptest::backend_worlds(dptest::RankKind::kThreads, {4})),
                         dptest::BackendWorldName());

TEST_P(FsdpParityFourRanks, TrainingMatchesWithMoreRanksThanRows) { expect_parity(c_, 2e-5); }

// ---- one address per full parameter ----

// Whether the page holding `p` is in memory (mincore): a full parameter's
// pages go at reshard and come back at the next unshard.
bool page_resident(const void* p) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char in_core = 0;
  if (mincore(reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1)), page, &in_core) != 0) {
    ADD_FAILURE() << "mincore: " << std::strerror(errno);
    return false;
  }
  return (in_core & 1) != 0;
}

// Whether the page holding `p` goes out of memory within a generous bound:
// a release waits for the work queued before it (with DP_CPU_ASYNC=1 the
// cpu streams queue), from a library thread.
bool page_goes(const void* p) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (page_resident(p)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Whether `p`'s page is mapped at all.
bool page_mapped(const void* p) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char in_core = 0;
  return mincore(reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1)), page, &in_core) == 0 ||
         errno != ENOMEM;
}

void expect_values(const dp_tensor* t, const std::vector<float>& expected, double tolerance, const std::string& what) {
  const std::vector<float> got = read(t);
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_NEAR(got[k], expected[k], tolerance * (1.0 + std::fabs(expected[k]))) << what << "[" << k << "]";
  }
}

// Many cycles of forward (async unshards prefetching the next layer,
// reshard after each) and backward (unshard, post_backward), the shards
// stepped between cycles: each full parameter keeps the address of the
// first unshard, a handle taken in one cycle's forward reads the values the
// next unshards refill, and while resharded (after post_backward; after the
// forward's reshard too with ZeRO-3) its page is out of memory and reads
// zeros. Views stay resident: they are the shards.
void expect_one_address_per_full_parameter(const Config& c) {
  const double tolerance = c.param_dtype == -1 ? 1e-6 : 1e-2;
  const bool views = c.views != 0 && c.backend == dptest::Backend::kShm && c.world > 1 && c.param_dtype == -1;
  run_ranks(c.world, dptest::backend_option(c.backend), [&](int rank, dp_process_group* pg) {
    Toy toy(0.05f * static_cast<float>(rank));
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.reshard_after_forward = c.reshard_after_forward;
    o.param_dtype = c.param_dtype;
    o.full_params_as_views = c.views;
    FsdpPtr f[3];
    for (int l = 0; l < 3; ++l) {
      f[l] = fully_shard(toy.layer[l].get(), pg, &o);
      ASSERT_TRUE(f[l]);
    }
    dp_module* root = toy.root.get();
    const void* address[3] = {};
    TensorPtr kept[3];  // each layer's full parameter as the last forward took it
    const float step = 0.5f;
    constexpr int kCycles = 16;
    for (int cycle = 0; cycle < kCycles; ++cycle) {
      SCOPED_TRACE("rank " + std::to_string(rank) + " cycle " + std::to_string(cycle));
      std::vector<float> expected[3];
      for (int l = 0; l < 3; ++l) {
        expected[l] = initial_weights(l, 0.0f);
        for (float& v : expected[l]) v += step * static_cast<float>(cycle);
      }
      ASSERT_EQ(dp_fsdp_unshard(f[0].get(), 0), DP_OK) << dp_last_error();
      for (int l = 0; l < 3; ++l) {
        if (l + 1 < 3) {
          ASSERT_EQ(dp_fsdp_unshard(f[l + 1].get(), 1), DP_OK) << dp_last_error();
        }
        ASSERT_EQ(dp_fsdp_wait_unshard(f[l].get()), DP_OK) << dp_last_error();
        if (kept[l]) {
          // Taken in the last cycle's forward: refilled at its address.
          EXPECT_EQ(dp_tensor_data(kept[l].get()), address[l]);
          expect_values(kept[l].get(), expected[l], tolerance, "a handle from the last forward");
        }
        dp_tensor* full = nullptr;
        ASSERT_EQ(dp_module_get_parameter(root, kWeights[l], &full), DP_OK) << dp_last_error();
        kept[l].reset(full);
        if (cycle == 0) address[l] = dp_tensor_data(full);
        EXPECT_EQ(dp_tensor_data(full), address[l]) << kWeights[l];
        EXPECT_TRUE(page_resident(address[l])) << kWeights[l];
        expect_values(full, expected[l], tolerance, kWeights[l]);
        ASSERT_EQ(dp_fsdp_reshard(f[l].get()), DP_OK) << dp_last_error();
        if (!views) {
          const bool kept_resident = c.reshard_after_forward == 0;
          EXPECT_TRUE(kept_resident ? page_resident(address[l]) : page_goes(address[l])) << kWeights[l];
        }
      }
      for (int l = 2; l >= 0; --l) {
        ASSERT_EQ(dp_fsdp_unshard(f[l].get(), 0), DP_OK) << dp_last_error();
        // The forward's handle sees what the backward's unshard refilled.
        EXPECT_EQ(dp_tensor_data(kept[l].get()), address[l]);
        expect_values(kept[l].get(), expected[l], tolerance, "the forward's handle in the backward");
        add_grad(root, kWeights[l], std::vector<float>(kDim * kDim, 1.0f));
        ASSERT_EQ(dp_fsdp_post_backward(f[l].get()), DP_OK) << dp_last_error();
      }
      for (int l = 0; l < 3; ++l) {
        ASSERT_EQ(dp_fsdp_finish_backward(f[l].get()), DP_OK) << dp_last_error();
        if (views) continue;
        EXPECT_TRUE(page_goes(address[l])) << kWeights[l] << " after post_backward";
        expect_values(kept[l].get(), std::vector<float>(kDim * kDim, 0.0f), 0.0, "a handle while resharded");
      }
      // The optimizer's step, on every rank's shards.
      for (int l = 0; l < 3; ++l) {
        dp_tensor* shard = nullptr;
        ASSERT_EQ(dp_fsdp_shard(f[l].get(), 0, &shard), DP_OK) << dp_last_error();
        TensorPtr owned(shard);
        std::vector<float> v = read(shard);
        for (float& x : v) x += step;
        write(shard, v);
      }
    }
  });
}

class FsdpFullAddress : public FsdpParityFloat32 {};
INSTANTIATE_TEST_SUITE_P(Backends, FsdpFullAddress,
                         ::testing::ValuesIn(dptest::backend_worlds(dptest::RankKind::kThreads, {1, 2}, DP_DEVICE_CPU)),
                         dptest::BackendWorldName());

TEST_P(FsdpFullAddress, FullParametersKeepOneAddressAndReleaseTheirPagesAtReshard) {
  expect_one_address_per_full_parameter(c_);
}

TEST_P(FsdpFullAddress, FullParametersInBfloat16KeepOneAddressAndReleaseTheirPagesAtReshard) {
  c_.param_dtype = DP_BFLOAT16;
  expect_one_address_per_full_parameter(c_);
}

TEST_P(FsdpFullAddress, FullParametersKeptFromForwardToBackwardKeepOneAddressAndGoAtPostBackward) {
  c_.reshard_after_forward = 0;
  expect_one_address_per_full_parameter(c_);
}

TEST_P(FsdpFullAddress, FullParametersAsViewsKeepOneAddress) {
  c_.views = 1;
  expect_one_address_per_full_parameter(c_);
}

// Destroy gives the slots new full parameters; a handle the host kept on
// the old one reads zeros, and once it goes the address range is unmapped.
TEST(Fsdp, AFullParameterHandleKeptPastDestroyReadsZerosAndItsRangeGoesWithIt) {
  run_ranks(1, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    dp_tensor* full = nullptr;
    ASSERT_EQ(dp_module_get_parameter(toy.root.get(), kWeights[0], &full), DP_OK) << dp_last_error();
    TensorPtr kept(full);
    const void* address = dp_tensor_data(full);
    f.reset();
    EXPECT_EQ(parameter(toy.root.get(), kWeights[0]), initial_weights(0, 0.0f));
    dp_tensor* after = nullptr;
    ASSERT_EQ(dp_module_get_parameter(toy.root.get(), kWeights[0], &after), DP_OK) << dp_last_error();
    TensorPtr owned_after(after);
    EXPECT_NE(dp_tensor_data(after), address);
    EXPECT_FALSE(page_resident(address));
    EXPECT_EQ(read(full), std::vector<float>(kDim * kDim, 0.0f));
    kept.reset();
    EXPECT_FALSE(page_mapped(address));
  });
}

// An unshard still in flight when the dp_fsdp is destroyed completes first;
// the module then holds its full parameters, in their own dtype.
TEST(Fsdp, DestroyWithAnUnshardInFlightGivesTheFullParametersBack) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.param_dtype = DP_BFLOAT16;
    dp_fsdp* f = nullptr;
    ASSERT_EQ(dp_fsdp_create(&f, toy.layer[1].get(), pg, &o), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[1]), (std::vector<int64_t>{rank == 0 ? 2 : 1, 3}));
    ASSERT_EQ(dp_fsdp_unshard(f, 1), DP_OK) << dp_last_error();
    dp_fsdp_destroy(f);
    dp_tensor* p = nullptr;
    ASSERT_EQ(dp_module_get_parameter(toy.root.get(), kWeights[1], &p), DP_OK);
    TensorPtr owned(p);
    EXPECT_EQ(dp_tensor_dtype(p), DP_FLOAT32);
    EXPECT_EQ(read(p), initial_weights(1, 0.0f));
    // The parameter is free again: a dp_ddp takes it.
    dp_ddp* d = nullptr;
    ASSERT_EQ(dp_ddp_create(&d, toy.layer[1].get(), pg, nullptr), DP_OK) << dp_last_error();
    dp_ddp_destroy(d);
  });
}

namespace {

// A parameter with fewer rows than ranks (ranks past them keep none), an
// empty one and a 0-d one: unshard gives them back whole, post_backward
// averages their gradients into the shards' gradients. With views (on
// shared memory) the full parameter's rows are the shards themselves.
void expect_narrow_empty_and_scalar_parameters(int32_t backend, int views) {
  run_ranks(3, backend, [views](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr narrow = make<float>({1, 4}, {1, 2, 3, 4});
    TensorPtr empty = make<float>({0, 2}, {});
    TensorPtr scalar = make<float>({}, {7});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "narrow", narrow.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "empty", empty.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "scalar", scalar.get(), 1), DP_OK);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = views;
    FsdpPtr f = fully_shard(m.get(), pg, &o);
    ASSERT_TRUE(f);
    EXPECT_EQ(parameter_shape(m.get(), "narrow"), (std::vector<int64_t>{rank == 0 ? 1 : 0, 4}));
    EXPECT_EQ(parameter_shape(m.get(), "empty"), (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(parameter_shape(m.get(), "scalar"), std::vector<int64_t>{});
    dp_tensor* shard = nullptr;
    ASSERT_EQ(dp_fsdp_shard(f.get(), 0, &shard), DP_OK);
    TensorPtr narrow_shard(shard);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter(m.get(), "narrow"), (std::vector<float>{1, 2, 3, 4}));
    EXPECT_EQ(parameter(m.get(), "scalar"), std::vector<float>{7});
    dp_tensor* full = nullptr;
    ASSERT_EQ(dp_module_get_parameter(m.get(), "narrow", &full), DP_OK);
    TensorPtr narrow_full(full);
    if (rank == 0) {
      EXPECT_EQ(dp_tensor_data(full) == dp_tensor_data(shard), views != 0);
    }
    const auto r = static_cast<float>(rank);
    add_grad(m.get(), "narrow", {r, r, r, 3 * r});
    add_grad(m.get(), "scalar", {6 * r});
    ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    dp_tensor* g = nullptr;
    ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 0, &g), DP_OK);
    TensorPtr narrow_grad(g);
    EXPECT_EQ(read(g), rank == 0 ? (std::vector<float>{1, 1, 1, 3}) : std::vector<float>{});
    ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 2, &g), DP_OK);
    TensorPtr scalar_grad(g);
    EXPECT_EQ(read(g), std::vector<float>{6});
    // Destroying gives the module its full parameters back, in memory of its own.
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
    f.reset();
    EXPECT_EQ(parameter(m.get(), "narrow"), (std::vector<float>{1, 2, 3, 4}));
    EXPECT_EQ(parameter_shape(m.get(), "empty"), (std::vector<int64_t>{0, 2}));
    ASSERT_EQ(dp_module_get_parameter(m.get(), "narrow", &full), DP_OK);
    TensorPtr given_back(full);
    EXPECT_NE(dp_tensor_data(full), dp_tensor_data(shard));
  });
}

}  // namespace

TEST(Fsdp, FewerRowsThanRanksEmptyAndZeroDimParametersGatherAndReduce) {
  expect_narrow_empty_and_scalar_parameters(DP_BACKEND_GLOO, 0);
}

TEST(Fsdp, FewerRowsThanRanksEmptyAndZeroDimParametersAsViewsOfTheShards) {
  expect_narrow_empty_and_scalar_parameters(DP_BACKEND_SHM, 1);
}

// An unshard with views runs once every rank has issued it (the lane's
// round, then the job's barrier): it sees what every rank wrote to its
// shard before its own unshard, however late that rank comes.
TEST(Fsdp, AViewUnshardSeesTheShardWritesALatePeerMadeBeforeItsUnshard) {
  run_ranks(2, DP_BACKEND_SHM, [](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = 1;
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg, &o);
    ASSERT_TRUE(f);
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    dp_tensor* shard = nullptr;
    ASSERT_EQ(dp_fsdp_shard(f.get(), 0, &shard), DP_OK);
    TensorPtr owned(shard);
    const std::vector<float> mine(static_cast<size_t>(dp_tensor_numel(shard)), rank == 0 ? -1.0f : 100.0f);
    write(shard, mine);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    // Rows 0-1 are rank 0's, row 2 rank 1's.
    EXPECT_EQ(parameter(toy.root.get(), kWeights[0]), (std::vector<float>{-1, -1, -1, -1, -1, -1, 100, 100, 100}));
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
  });
}

// float32 and float64 parameters (and a 0-d one, a copy) share one region of
// views; destroying while unsharded gives the module copies of them.
TEST(Fsdp, ViewsOfParametersOfTwoDtypesAreGivenBackAsCopiesOnDestroy) {
  run_ranks(2, DP_BACKEND_SHM, [](int rank, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr w32 = make<float>({3, 2}, {1, 2, 3, 4, 5, 6});
    TensorPtr w64 = make<double>({5}, {0.5, 1.5, 2.5, 3.5, 4.5});
    TensorPtr scalar = make<float>({}, {7});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "w32", w32.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "w64", w64.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "scalar", scalar.get(), 1), DP_OK);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = 1;
    FsdpPtr f = fully_shard(m.get(), pg, &o);
    ASSERT_TRUE(f);
    std::vector<const void*> shards;
    for (size_t i = 0; i < 2; ++i) {
      dp_tensor* shard = nullptr;
      ASSERT_EQ(dp_fsdp_shard(f.get(), i, &shard), DP_OK);
      shards.push_back(dp_tensor_data(shard));
      dp_tensor_destroy(shard);
    }
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    dp_tensor* full = nullptr;
    ASSERT_EQ(dp_module_get_parameter(m.get(), "w64", &full), DP_OK);
    TensorPtr w64_full(full);
    EXPECT_EQ(dptest::values<double>(full), (std::vector<double>{0.5, 1.5, 2.5, 3.5, 4.5}));
    // Rank 1 keeps rows 3-4 of w64 (chunk 3).
    EXPECT_EQ(static_cast<const char*>(dp_tensor_data(full)) + (rank == 0 ? 0 : 3 * sizeof(double)), shards[1]);
    EXPECT_EQ(parameter(m.get(), "w32"), (std::vector<float>{1, 2, 3, 4, 5, 6}));
    EXPECT_EQ(parameter(m.get(), "scalar"), std::vector<float>{7});
    f.reset();
    ASSERT_EQ(dp_module_get_parameter(m.get(), "w64", &full), DP_OK);
    TensorPtr w64_back(full);
    EXPECT_EQ(dptest::values<double>(full), (std::vector<double>{0.5, 1.5, 2.5, 3.5, 4.5}));
    for (const void* shard : shards) EXPECT_NE(dp_tensor_data(full), shard);
    EXPECT_EQ(parameter(m.get(), "w32"), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  });
}

// Ranks may finish their modules in different orders (an autograd engine
// on several threads): post_backward never waits for another dp_fsdp's
// reduce-scatter, which here would need this rank's next call first.
TEST(Fsdp, PostBackwardsInAnotherOrderOnEachRankAllComplete) {
  run_ranks(
      2, DP_BACKEND_GLOO,
      [&](int rank, dp_process_group* pg) {
        Toy toy(0.0f);
        FsdpPtr first = fully_shard(toy.layer[0].get(), pg);
        FsdpPtr second = fully_shard(toy.layer[1].get(), pg);
        ASSERT_TRUE(first && second);
        ASSERT_EQ(dp_fsdp_unshard(first.get(), 0), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_unshard(second.get(), 0), DP_OK) << dp_last_error();
        add_grad(toy.root.get(), kWeights[0], std::vector<float>(9, 1.0f + static_cast<float>(rank)));
        add_grad(toy.root.get(), kWeights[1], std::vector<float>(9, 3.0f + static_cast<float>(rank)));
        dp_fsdp* order[2] = {first.get(), second.get()};
        if (rank == 1) std::swap(order[0], order[1]);
        for (dp_fsdp* f : order) ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
        for (dp_fsdp* f : order) ASSERT_EQ(dp_fsdp_finish_backward(f), DP_OK) << dp_last_error();
        dp_tensor* g = nullptr;
        ASSERT_EQ(dp_fsdp_shard_grad(second.get(), 0, &g), DP_OK);
        TensorPtr owned(g);
        EXPECT_EQ(read(g), std::vector<float>(rank == 0 ? 6 : 3, 3.5f));
      },
      20000);
}

// dp_module_zero_grad while a post_backward's reduce-scatter is still in
// flight (the other rank is late to its post_backward): the zeroing comes
// after the reduction, so the shard gradient ends zero, not the reduced
// average added to zeros.
TEST(Fsdp, ZeroGradWhileAPostBackwardIsInFlightZeroesAfterIt) {
  run_ranks(
      2, DP_BACKEND_GLOO,
      [&](int rank, dp_process_group* pg) {
        Toy toy(0.0f);
        FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
        ASSERT_TRUE(f);
        ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
        add_grad(toy.root.get(), kWeights[0], std::vector<float>(9, 2.0f));
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
        if (rank == 0) {
          ASSERT_EQ(dp_module_zero_grad(toy.root.get()), DP_OK) << dp_last_error();
        }
        ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
        dp_tensor* g = nullptr;
        ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 0, &g), DP_OK);
        TensorPtr owned(g);
        EXPECT_EQ(read(g), std::vector<float>(rank == 0 ? 6 : 3, rank == 0 ? 0.0f : 2.0f));
      },
      20000);
}

// A post_backward whose peer never makes its own fails within the group's
// timeout; dp_module_zero_grad, which waits for it, reports that failure
// naming it, and still zeroes every gradient of the module: the other
// layers', and the shard gradient an earlier backward left.
TEST(Fsdp, ZeroGradReportsAFailedPostBackwardAndStillZeroesEveryGradient) {
  std::atomic<bool> done{false};
  run_ranks(
      2, DP_BACKEND_GLOO,
      [&](int rank, dp_process_group* pg) {
        Toy toy(0.0f);
        FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
        ASSERT_TRUE(f);
        // A first backward that both make: the shard gradient is not zero.
        ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
        add_grad(toy.root.get(), kWeights[0], std::vector<float>(9, 1.0f));
        ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
        if (rank == 1) {
          while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        // Rank 1 waits for this however rank 0's checks end.
        struct Done {
          std::atomic<bool>& flag;
          ~Done() { flag = true; }
        } release_rank_1{done};
        add_grad(toy.root.get(), kWeights[0], std::vector<float>(9, 2.0f));
        add_grad(toy.root.get(), kWeights[1], std::vector<float>(9, 3.0f));
        ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
        EXPECT_EQ(dp_module_zero_grad(toy.root.get()), DP_ETIMEOUT);
        const std::string error = dp_last_error();
        EXPECT_NE(error.find("the post-backward reduce_scatter of dp_fsdp #"), std::string::npos) << error;
        EXPECT_EQ(parameter_grad(toy.root.get(), kWeights[1]), std::vector<float>(9, 0.0f));
        dp_tensor* g = nullptr;
        ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 0, &g), DP_OK);
        TensorPtr owned(g);
        EXPECT_EQ(read(g), std::vector<float>(6, 0.0f));
      },
      1000);
}

// dp_fsdp_destroy gathers the shards after the host's current stream: a
// shard write still queued there (the optimizer's last step) reaches the
// full parameter handed back to the module.
TEST(Fsdp, DestroyGathersTheShardsAfterTheHostsCurrentStream) {
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    const dp_device device = dptest::cpu(0);
    Toy toy(0.0f, device);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    void* stream = nullptr;
    ASSERT_EQ(dp_stream_create(device, &stream), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_set_current_stream(device, stream), DP_OK) << dp_last_error();
    dp_tensor* shard = nullptr;
    ASSERT_EQ(dp_fsdp_shard(f.get(), 0, &shard), DP_OK) << dp_last_error();
    TensorPtr owned(shard);
    const size_t rows = rank == 0 ? 2 : 1;
    dptest::queue_write(stream, shard, dptest::filled(rows * 3, 100.0f + 10.0f * static_cast<float>(rank)));
    f.reset();
    std::vector<float> want = dptest::filled(6, 100.0f);
    for (float v : dptest::filled(3, 110.0f)) want.push_back(v);
    EXPECT_EQ(parameter(toy.root.get(), kWeights[0]), want);  // the read follows the current stream
    EXPECT_EQ(dp_set_current_stream(device, nullptr), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_stream_destroy(device, stream), DP_OK) << dp_last_error();
  });
}

// The option is part of the agreement check: ranks that differ fail alike.
TEST(Fsdp, RanksThatDisagreeOnViewsFailTogetherNamingTheOption) {
  run_ranks(2, DP_BACKEND_SHM, [](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = rank == 0 ? 1 : 0;
    dp_fsdp* f = nullptr;
    EXPECT_EQ(dp_fsdp_create(&f, toy.layer[0].get(), pg, &o), DP_EINVAL);
    EXPECT_NE(std::string(dp_last_error()).find("full_params_as_views"), std::string::npos) << dp_last_error();
    EXPECT_EQ(f, nullptr);
    // Nothing was taken: the parameter keeps its full value.
    EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[0]), (std::vector<int64_t>{3, 3}));
  });
}

TEST(Fsdp, MisuseIsAClearErrorNamingWhatToCall) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    dp_tensor* g = nullptr;
    EXPECT_EQ(dp_module_grad(toy.root.get(), kWeights[0], &g), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("dp_fsdp_unshard"), std::string::npos) << dp_last_error();
    EXPECT_NE(std::string(dp_last_error()).find("'weight'"), std::string::npos) << dp_last_error();
    EXPECT_EQ(dp_fsdp_post_backward(f.get()), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("not unsharded"), std::string::npos) << dp_last_error();
    EXPECT_EQ(dp_fsdp_wait_unshard(f.get()), DP_ESTATE);
    EXPECT_EQ(dp_fsdp_shard(f.get(), 1, &g), DP_EINVAL);
    EXPECT_EQ(dp_fsdp_unshard(nullptr, 0), DP_EINVAL);
    // A second dp_fsdp over the same module manages nothing; a dp_ddp over it
    // has nothing left to reduce.
    dp_fsdp* second = nullptr;
    ASSERT_EQ(dp_fsdp_create(&second, toy.layer[0].get(), pg, nullptr), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_num_parameters(second), 0u);
    dp_fsdp_destroy(second);
    dp_ddp* d = nullptr;
    EXPECT_EQ(dp_ddp_create(&d, toy.layer[0].get(), pg, nullptr), DP_EINVAL);
    // With the parameters unsharded, the full-size gradient is there.
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_module_grad(toy.root.get(), kWeights[0], &g), DP_OK) << dp_last_error();
    EXPECT_EQ(dptest::shape(g), (std::vector<int64_t>{3, 3}));
    dp_tensor_destroy(g);
  });
}

// While the slot holds the shard, a gradient of the shard's shape would pass
// dp_module_set_grad's shape check and fail post_backward on this rank
// alone: it is refused at once, saying when and in what shape; once
// unsharded, a full gradient is taken and reduced.
TEST(Fsdp, AGradientSetWhileTheSlotHoldsTheShardIsRefusedSayingWhenAndItsFullShape) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    const int64_t rows = rank == 0 ? 2 : 1;
    TensorPtr shard_shaped = make<float>({rows, kDim}, std::vector<float>(static_cast<size_t>(rows * kDim), 1.0f));
    EXPECT_EQ(dp_module_set_grad(toy.layer[0].get(), "weight", shard_shaped.get()), DP_ESTATE);
    std::string error = dp_last_error();
    EXPECT_NE(error.find("argument 'grad'"), std::string::npos) << error;
    EXPECT_NE(error.find("float32 3x3"), std::string::npos) << error;
    EXPECT_NE(error.find("while it is unsharded"), std::string::npos) << error;
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    TensorPtr full = make<float>({kDim, kDim}, std::vector<float>(kDim * kDim, static_cast<float>(rank + 1)));
    ASSERT_EQ(dp_module_set_grad(toy.layer[0].get(), "weight", full.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    dp_tensor* g = nullptr;
    ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 0, &g), DP_OK) << dp_last_error();
    TensorPtr owned(g);
    EXPECT_EQ(read(g), std::vector<float>(static_cast<size_t>(rows * kDim), 1.5f));
  });
}

namespace {

// What the on_bucket_reduced callback below got from the calls it made.
struct CallsInsideACallback {
  dp_module* layer = nullptr;
  dp_fsdp* fsdp = nullptr;
  dp_status zero_grad = DP_OK, finish = DP_OK;
  std::string zero_grad_error, finish_error;
};

int call_fsdp_inside_callback(void* data, dp_ddp*, size_t, const size_t*, size_t) {
  auto* calls = static_cast<CallsInsideACallback*>(data);
  calls->zero_grad = dp_module_zero_grad(calls->layer);
  calls->zero_grad_error = dp_last_error();
  calls->finish = dp_fsdp_finish_backward(calls->fsdp);
  calls->finish_error = dp_last_error();
  return 0;
}

}  // namespace

// A dp_ddp callback runs on the group's comm lane: from there, a dp_fsdp
// call and a zero_grad that would wait for the dp_fsdp's post_backward (it
// needs that lane) are DP_ESTATE saying why, not a wait until the timeout;
// after the backward, both work.
TEST(Fsdp, CallsThatNeedTheLaneAreRefusedInsideADdpCallback) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    CallsInsideACallback calls;
    calls.layer = toy.layer[0].get();
    calls.fsdp = f.get();
    dp_ddp_options o;
    ASSERT_EQ(dp_ddp_options_init(&o, sizeof o), DP_OK);
    o.on_bucket_reduced = call_fsdp_inside_callback;
    o.on_bucket_reduced_data = &calls;
    dp_ddp* d = nullptr;
    ASSERT_EQ(dp_ddp_create(&d, toy.layer[3].get(), pg, &o), DP_OK) << dp_last_error();
    DdpPtr ddp(d);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_ddp_pre_forward(ddp.get()), DP_OK) << dp_last_error();
    add_grad(toy.root.get(), kWeights[0], std::vector<float>(9, 1.0f));
    add_grad(toy.root.get(), kWeights[3], std::vector<float>(9, 1.0f));
    ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_ddp_mark_grad_ready(ddp.get(), "weight"), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_ddp_finish_backward(ddp.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(calls.zero_grad, DP_ESTATE) << calls.zero_grad_error;
    EXPECT_NE(calls.zero_grad_error.find("inside a dp_ddp callback"), std::string::npos) << calls.zero_grad_error;
    EXPECT_EQ(calls.finish, DP_ESTATE) << calls.finish_error;
    EXPECT_NE(calls.finish_error.find("comm lane"), std::string::npos) << calls.finish_error;
    ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_module_zero_grad(toy.layer[0].get()), DP_OK) << dp_last_error();
  });
}

// A parameter a live dp_ddp manages is refused by name.
TEST(Fsdp, ParametersOfALiveDdpAreRefusedByName) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Toy toy(0.0f);
    dp_ddp* d = nullptr;
    ASSERT_EQ(dp_ddp_create(&d, toy.layer[3].get(), pg, nullptr), DP_OK) << dp_last_error();
    DdpPtr ddp(d);
    dp_fsdp* f = nullptr;
    EXPECT_EQ(dp_fsdp_create(&f, toy.root.get(), pg, nullptr), DP_EINVAL);
    EXPECT_NE(std::string(dp_last_error()).find("'proj.weight' is managed by a live dp_ddp"), std::string::npos)
        << dp_last_error();
  });
}

// The group's comm lane refuses a host collective while a dp_fsdp's unshard
// waits there for the other rank, naming the dp_fsdp and its own calls (the
// lane is shared with dp_ddp, whose calls it must not name here).
TEST(Fsdp, AHostCollectiveWhileAnUnshardIsQueuedIsRefusedNamingTheDpFsdp) {
  std::atomic<bool> refused{false};
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    if (rank == 0) {
      struct Release {  // however this rank's checks end, the other goes on
        std::atomic<bool>& flag;
        ~Release() { flag = true; }
      } release{refused};
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
      EXPECT_EQ(dp_pg_barrier(pg), DP_ESTATE);
      const std::string error = dp_last_error();
      EXPECT_NE(error.find("dp_fsdp #"), std::string::npos) << error;
      EXPECT_NE(error.find("has collectives queued"), std::string::npos) << error;
      EXPECT_NE(error.find("dp_fsdp_finish_backward"), std::string::npos) << error;
      EXPECT_EQ(error.find("dp_ddp"), std::string::npos) << error;
      refused = true;
      ASSERT_EQ(dp_fsdp_wait_unshard(f.get()), DP_OK) << dp_last_error();
    } else {
      while (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    }
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_pg_barrier(pg), DP_OK) << dp_last_error();
  });
}

// A rank that skips an unshard the other makes and waits: the other's
// unshard fails within the group's timeout naming it, and so does every
// later call that needs the group's lane.
TEST(Fsdp, ARankThatSkipsAnUnshardIsNamedWithinTheTimeout) {
  std::atomic<bool> failed{false};
  run_ranks(
      2, DP_BACKEND_GLOO,
      [&](int rank, dp_process_group* pg) {
        Toy toy(0.0f);
        FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
        ASSERT_TRUE(f);
        if (rank == 0) {
          EXPECT_EQ(dp_fsdp_unshard(f.get(), 0), DP_ETIMEOUT);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("the unshard of dp_fsdp #"), std::string::npos) << error;
          EXPECT_NE(error.find("rank(s) 1 did not arrive"), std::string::npos) << error;
          EXPECT_NE(dp_fsdp_unshard(f.get(), 0), DP_OK);
          EXPECT_NE(std::string(dp_last_error()).find("comm lane stopped"), std::string::npos) << dp_last_error();
          failed = true;
        } else {
          while (!failed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      },
      1000);
}

namespace {

// A rank that makes another call in the skipped unshard's place (here its
// destroy's gather): both calls fail at once, each naming both. With views
// the unshard is a barrier, and so is the gather's first step.
void expect_another_call_in_an_unshards_place_fails(int32_t backend, int views) {
  run_ranks(2, backend, [views](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = views;
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg, &o);
    ASSERT_TRUE(f);
    if (rank == 0) {
      EXPECT_EQ(dp_fsdp_unshard(f.get(), 0), DP_EREMOTE);
      std::string error = dp_last_error();
      EXPECT_NE(error.find("(the unshard, iteration"), std::string::npos) << error;
      EXPECT_NE(error.find("(the full parameters' gather, iteration"), std::string::npos) << error;
    } else {
      f.reset();
      EXPECT_NE(std::string(dp_last_error()).find("(the unshard, iteration"), std::string::npos) << dp_last_error();
      // The gather failed: the slot keeps this rank's shard.
      EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[0]), (std::vector<int64_t>{1, 3}));
    }
  });
}

}  // namespace

TEST(Fsdp, ARankThatMakesAnotherCallInAnUnshardsPlaceFailsNamingBoth) {
  expect_another_call_in_an_unshards_place_fails(DP_BACKEND_GLOO, 0);
}

TEST(Fsdp, ARankThatMakesAnotherCallInAViewUnshardsPlaceFailsNamingBoth) {
  expect_another_call_in_an_unshards_place_fails(DP_BACKEND_SHM, 1);
}

// ---- state dicts ----

namespace {

// Removes a save's folder and the files in it.
void remove_sharded_save(const std::string& folder, int) {
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (dirent* d = ::readdir(dir)) {
      if (std::strcmp(d->d_name, ".") != 0 && std::strcmp(d->d_name, "..") != 0) {
        ::unlink((folder + "/" + d->d_name).c_str());
      }
    }
    ::closedir(dir);
  }
  ::rmdir(folder.c_str());
}

// The names of the files in `folder`, sorted.
std::vector<std::string> files_in(const std::string& folder) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (dirent* d = ::readdir(dir)) {
      if (d->d_name[0] != '.') names.push_back(d->d_name);
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}

// Toy(skew) sharded on every layer (init_sync off: each rank keeps its own
// values), with the linears' full weights checked after an unshard.
void expect_full_weights(Toy& toy, Sharded& s, float skew) {
  for (int l = 0; l < 4; ++l) {
    if (l < 3) {
      ASSERT_EQ(dp_fsdp_unshard(s.layer[l].get(), 0), DP_OK) << dp_last_error();
    }
    EXPECT_EQ(parameter(toy.root.get(), kWeights[l]), initial_weights(l, skew)) << kWeights[l];
    if (l < 3) {
      ASSERT_EQ(dp_fsdp_reshard(s.layer[l].get()), DP_OK) << dp_last_error();
    }
  }
}

Sharded shard_unsynced(Toy& toy, dp_process_group* pg) {
  Sharded s;
  dp_fsdp_options o;
  EXPECT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
  o.init_sync = 0;
  for (int l = 0; l < 3; ++l) {
    s.layer[l] = fully_shard(toy.layer[l].get(), pg, &o);
  }
  return s;
}

}  // namespace

TEST(FsdpStateDict, FullSaveIsTheUnshardedModulesFileAndEveryRankLoadsItsRows) {
  const std::string saved = dptest::temp_path("fsdp_full_", "sharded.safetensors");
  const std::string plain = dptest::temp_path("fsdp_full_", "plain.safetensors");
  Toy unsharded(0.0f);
  ASSERT_EQ(dp_module_save(unsharded.root.get(), plain.c_str()), DP_OK) << dp_last_error();
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(0.0f);
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_save_full_state_dict(toy.root.get(), pg, saved.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    if (rank == 0) {
      EXPECT_EQ(dptest::read_bytes(saved), dptest::read_bytes(plain));
    }
    // Another rank's values, then the file's.
    Toy other(0.5f + static_cast<float>(rank));
    Sharded t = shard_unsynced(other, pg);
    ASSERT_EQ(dp_fsdp_load_full_state_dict(other.root.get(), saved.c_str(), 1), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter_shape(other.root.get(), kWeights[0]), (std::vector<int64_t>{rank == 0 ? 2 : 1, 3}));
    expect_full_weights(other, t, 0.0f);
    // Unsharded, a load is refused.
    ASSERT_EQ(dp_fsdp_unshard(t.layer[1].get(), 0), DP_OK);
    EXPECT_EQ(dp_fsdp_load_full_state_dict(other.root.get(), saved.c_str(), 1), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("reshard"), std::string::npos) << dp_last_error();
    ASSERT_EQ(dp_fsdp_reshard(t.layer[1].get()), DP_OK);
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
  });
  ::unlink(saved.c_str());
  ::unlink(plain.c_str());
}

// A rank that keeps no rows of one parameter next to an empty one still
// lists both (their empty shards are not one tied tensor), so a sharded
// save loads back on every rank.
TEST(FsdpStateDict, EmptyShardsOfNeighbouringParametersStayApartWithViews) {
  const std::string folder = dptest::temp_path("fsdp_empty_", "save");
  run_ranks(3, DP_BACKEND_SHM, [&](int, dp_process_group* pg) {
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr two_rows = make<float>({2, 16}, std::vector<float>(32, 1.0f));
    TensorPtr no_rows = make<float>({0, 16}, {});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "two_rows", two_rows.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "no_rows", no_rows.get(), 1), DP_OK);
    dp_fsdp_options o;
    ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
    o.full_params_as_views = 1;
    FsdpPtr f = fully_shard(m.get(), pg, &o);
    ASSERT_TRUE(f);
    EXPECT_EQ(dp_module_num_parameters(m.get()), 2u);
    ASSERT_EQ(dp_fsdp_save_sharded_state_dict(m.get(), pg, folder.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(m.get(), folder.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK) << dp_last_error();
  });
  remove_sharded_save(folder, 3);
}

// A load writes the shards: refused while they are, or are about to be,
// read as full parameters.
TEST(FsdpStateDict, LoadsAreRefusedWhileAnUnshardIsInFlight) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Toy toy(0.0f);
    FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
    ASSERT_TRUE(f);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_load_full_state_dict(toy.root.get(), "/nonexistent/full.safetensors", 1), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("'linears.0.weight' is unsharded or being unsharded"),
              std::string::npos)
        << dp_last_error();
    ASSERT_EQ(dp_fsdp_wait_unshard(f.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_load_full_state_dict(toy.root.get(), "/nonexistent/full.safetensors", 1), DP_ESTATE);
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[0]),
              (std::vector<int64_t>{dp_process_group_rank(pg) == 0 ? 2 : 1, 3}));
  });
}

TEST(FsdpStateDict, ShardedSaveAtTwoRanksLoadsAtThree) {
  const std::string folder = dptest::temp_path("fsdp_sharded_", "save");
  run_ranks(2, DP_BACKEND_GLOO, [&](int, dp_process_group* pg) {
    Toy toy(0.25f);
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_save_sharded_state_dict(toy.root.get(), pg, folder.c_str()), DP_OK) << dp_last_error();
  });
  run_ranks(3, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(-1.0f - static_cast<float>(rank));
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_load_sharded_state_dict(toy.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter_shape(toy.root.get(), kWeights[2]), (std::vector<int64_t>{1, 3}));
    expect_full_weights(toy, s, 0.25f);
    // A module whose tensors differ is refused by name and left as it is.
    dptest::ModulePtr wrong = dptest::new_module();
    dptest::ModulePtr proj = dptest::new_module();
    TensorPtr w = make<float>({2, 2}, {1, 2, 3, 4});
    ASSERT_EQ(dp_module_register_parameter(proj.get(), "weight", w.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_module(wrong.get(), "proj", proj.get()), DP_OK);
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(wrong.get(), folder.c_str()), DP_EINVAL);
    std::string error = dp_last_error();
    EXPECT_NE(error.find("'proj.weight' is float32 3x3"), std::string::npos) << error;
    EXPECT_NE(error.find("unexpected key 'linears.0.weight'"), std::string::npos) << error;
    EXPECT_EQ(dptest::values<float>(w.get()), (std::vector<float>{1, 2, 3, 4}));
  });
  remove_sharded_save(folder, 2);
}

// Ranks that are threads of one process, each with its own group: each
// group's background save is written on a thread of its own, so neither
// waits behind the other's (whose report it needs); the save loads at
// another world size. A 20 s group timeout bounds a save left waiting.
TEST(FsdpStateDict, BackgroundSavesOfRanksInOneProcessAreWrittenSideBySideAndLoadAtThree) {
  const std::string folder = dptest::temp_path("fsdp_async_", "save");
  run_ranks(
      2, DP_BACKEND_GLOO,
      [&](int, dp_process_group* pg) {
        Toy toy(0.25f);
        Sharded s = shard_unsynced(toy, pg);
        dp_work* work = nullptr;
        ASSERT_EQ(dp_fsdp_save_sharded_state_dict_async(toy.root.get(), pg, folder.c_str(), &work), DP_OK)
            << dp_last_error();
        EXPECT_EQ(dp_work_wait(work), DP_OK) << dp_last_error();
        dp_work_destroy(work);
      },
      20000);
  run_ranks(3, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(-1.0f - static_cast<float>(rank));
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_load_sharded_state_dict(toy.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    expect_full_weights(toy, s, 0.25f);
  });
  remove_sharded_save(folder, 2);
}

// On 2 GPUs: rank 1 queues none of its transfers after the call headers
// (DP_TEST_NCCL_SKIP_QUEUED, as a peer that died there), so rank 0's queued
// all-gather never finishes. Its watch aborts the communicator at the
// group's timeout; the blocking unshard, which waited on the host (no
// stream set), fails naming the queued all-gather, and rank 1's next call
// fails within the timeout too instead of hanging.
TEST(CudaFsdp, AQueuedAllGatherWhosePeerNeverSendsIsAbortedAtTheTimeoutAndNamed) {
  if (dptest::cuda_count() < 2) GTEST_SKIP() << "needs 2 GPU(s), found " << dptest::cuda_count();
  ::setenv("DP_TEST_NCCL_SKIP_QUEUED", "1", 1);
  run_ranks(
      2, DP_BACKEND_NCCL,
      [&](int rank, dp_process_group* pg) {
        Toy toy(0.0f, dptest::cuda(rank));
        FsdpPtr f = fully_shard(toy.layer[0].get(), pg);
        ASSERT_TRUE(f);
        if (rank == 0) {
          EXPECT_EQ(dp_fsdp_unshard(f.get(), 0), DP_ESTATE);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("the queued all_gather"), std::string::npos) << error;
          EXPECT_NE(error.find("did not finish within 5000 ms"), std::string::npos) << error;
          EXPECT_NE(dp_fsdp_unshard(f.get(), 0), DP_OK);
        } else {
          EXPECT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();  // its own transfer was skipped
          ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
          EXPECT_NE(dp_fsdp_unshard(f.get(), 0), DP_OK);
        }
      },
      5000, true);
  ::unsetenv("DP_TEST_NCCL_SKIP_QUEUED");
}

namespace {
// One gate per rank (ranks are threads) that a stream's host function waits at.
std::atomic<bool> g_stream_gate_open[2];
void hold_stream_until_open(void* gate) {
  auto* open = static_cast<std::atomic<bool>*>(gate);
  while (!open->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}
}  // namespace

// With two ranks, each collective's call header and the lane's agreement
// rounds go between the ranks apart from the queued transfers, which wait
// for the host's stream: blocking unshards of two dp_fsdp, and an async one
// with its wait, return while the host's stream is still held before them,
// even after another call made the library's own stream wait for it; the
// stream then sees the gathered parameters. Held on every rank, then on
// rank 0 only (rank 1's gathers then wait on the device for rank 0's).
TEST(CudaFsdp, BlockingUnshardsOnTwoGpusReturnWhileTheHostsStreamIsHeld) {
  if (dptest::cuda_count() < 2) GTEST_SKIP() << "needs 2 GPU(s), found " << dptest::cuda_count();
  for (bool every_rank : {true, false}) {
    SCOPED_TRACE(every_rank ? "held on every rank" : "held on rank 0 only");
    run_ranks(
        2, DP_BACKEND_NCCL,
        [&](int rank, dp_process_group* pg) {
          const dp_device device = dptest::cuda(rank);
          Toy toy(0.0f, device);
          FsdpPtr f[3];
          for (int l = 0; l < 3; ++l) {
            f[l] = fully_shard(toy.layer[l].get(), pg);
            ASSERT_TRUE(f[l]);
          }
          void* stream = nullptr;
          ASSERT_EQ(dp_stream_create(device, &stream), DP_OK) << dp_last_error();
          const bool held = every_rank || rank == 0;
          std::atomic<bool>& open = g_stream_gate_open[rank];
          open = !held;
          ASSERT_EQ(dp_stream_launch_host_func(device, stream, hold_stream_until_open, &open), DP_OK)
              << dp_last_error();
          auto calls = std::async(std::launch::async, [&]() -> std::string {
            if (dp_set_current_stream(device, stream) != DP_OK) return dp_last_error();
            std::string failure;
            // Between the unshards, a call that makes the library's own
            // stream wait for the held one (proj has no gradient to zero,
            // so nothing waits on the host).
            if (dp_fsdp_unshard(f[0].get(), 0) != DP_OK || dp_module_zero_grad(toy.layer[3].get()) != DP_OK ||
                dp_fsdp_unshard(f[1].get(), 0) != DP_OK || dp_fsdp_unshard(f[2].get(), 1) != DP_OK ||
                dp_fsdp_wait_unshard(f[2].get()) != DP_OK) {
              failure = dp_last_error();
            }
            dp_set_current_stream(device, nullptr);
            return failure;
          });
          // Half the group's timeout: calls that wait for the stream stay
          // there until the gate opens below.
          const bool returned = calls.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
          open = true;
          EXPECT_TRUE(returned) << "rank " << rank << ": the blocking unshards waited for the host's held stream";
          EXPECT_EQ(calls.get(), "");
          ASSERT_EQ(dp_set_current_stream(device, stream), DP_OK) << dp_last_error();
          for (int l = 0; l < 3; ++l) EXPECT_EQ(parameter(toy.root.get(), kWeights[l]), initial_weights(l, 0.0f));
          EXPECT_EQ(dp_stream_synchronize(device, stream), DP_OK) << dp_last_error();
          EXPECT_EQ(dp_set_current_stream(device, nullptr), DP_OK) << dp_last_error();
          for (FsdpPtr& one : f) one.reset();
          EXPECT_EQ(dp_stream_destroy(device, stream), DP_OK) << dp_last_error();
        },
        60000, true);
  }
}

// Hostile sharded saves: the manifest missing, damaged or edited (rows in
// two files, rows in none, a file named elsewhere), a rank's file missing,
// garbage, replaced by another save's, its header or its data changed by a
// byte. Each is refused on every rank, naming the file or the tensor, and
// leaves the module as it was; the save loads again once it is restored.
TEST(FsdpStateDict, ABrokenShardedSaveIsRefusedByNameOnEveryRankAndChangesNothing) {
  const std::string folder = dptest::temp_path("fsdp_hostile_", "save");
  const std::string other = dptest::temp_path("fsdp_hostile_", "other");
  for (const std::string& f : {folder, other}) {
    run_ranks(2, DP_BACKEND_GLOO, [&](int, dp_process_group* pg) {
      Toy toy(0.25f);
      Sharded s = shard_unsynced(toy, pg);
      ASSERT_EQ(dp_fsdp_save_sharded_state_dict(toy.root.get(), pg, f.c_str()), DP_OK) << dp_last_error();
    });
  }
  // manifest.json and one file per rank, of one save.
  const std::vector<std::string> names = files_in(folder);
  ASSERT_EQ(names.size(), 3u);
  ASSERT_EQ(names[0], "manifest.json");
  const std::string manifest = folder + "/manifest.json";
  const std::string rank0 = folder + "/" + names[1];
  const std::string rank1 = folder + "/" + names[2];
  ASSERT_EQ(names[1].rfind("shard-00000-of-00002-", 0), 0u) << names[1];
  ASSERT_EQ(names[2].rfind("shard-00001-of-00002-", 0), 0u) << names[2];
  const std::string good_manifest = dptest::read_bytes(manifest);
  const std::string good0 = dptest::read_bytes(rank0), good1 = dptest::read_bytes(rank1);
  auto expect_refused = [&](const char* what, dp_status want, const std::string& needle, int world = 2) {
    run_ranks(world, DP_BACKEND_GLOO, [&](int, dp_process_group* pg) {
      Toy toy(-1.0f);
      Sharded s = shard_unsynced(toy, pg);
      EXPECT_EQ(dp_fsdp_load_sharded_state_dict(toy.root.get(), folder.c_str()), want) << what;
      EXPECT_NE(std::string(dp_last_error()).find(needle), std::string::npos) << what << ": " << dp_last_error();
      expect_full_weights(toy, s, -1.0f);
    });
  };
  auto edit_manifest = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = nlohmann::json::parse(good_manifest);
    edit(m);
    write_file(manifest, m.dump(1));
  };
  auto piece_of = [](nlohmann::json& m, const std::string& tensor, size_t file) -> nlohmann::json& {
    for (auto& t : m["tensors"]) {
      if (t["name"] != tensor) continue;
      for (auto& p : t["pieces"]) {
        if (p["file"] == file) return p;
      }
    }
    throw std::runtime_error("no piece of " + tensor);
  };
  ::unlink(manifest.c_str());
  expect_refused("no manifest", DP_EINVAL, "holds no complete sharded save");
  write_file(manifest, "{\"format\": \"dp-fsdp-sharded-manifest\", ");
  expect_refused("a cut manifest", DP_EIO, "it is not JSON");
  // Rank 1's rows 2..3 of linears.0.weight claimed from row 1: rows 1..2 in
  // two files, also when one rank loads all the rows.
  edit_manifest([&](nlohmann::json& m) { piece_of(m, "linears.0.weight", 1)["first_row"] = 1; });
  expect_refused("overlapping rows", DP_EIO, "'linears.0.weight''s rows 1 to 2 are in two files");
  expect_refused("overlapping rows at one rank", DP_EIO, "are in two files", 1);
  edit_manifest([&](nlohmann::json& m) { piece_of(m, "linears.1.weight", 1)["row_count"] = 0; });
  expect_refused("missing rows", DP_EIO, "'linears.1.weight''s rows 2 to 3 are in no file");
  edit_manifest([&](nlohmann::json& m) { m["files"][1]["name"] = "../" + names[2]; });
  expect_refused("a file named elsewhere", DP_EIO, "where this save's is");
  edit_manifest([&](nlohmann::json& m) { m["world_size"] = 3; });
  expect_refused("another world size", DP_EIO, "not a list of world_size (3) files");
  write_file(manifest, good_manifest);
  // Rank 1's file.
  ::unlink(rank1.c_str());
  expect_refused("a missing file", DP_EIO, rank1);
  write_file(rank1, "garbage");
  expect_refused("garbage", DP_EIO, rank1);
  write_file(rank1, dptest::read_bytes(other + "/" + files_in(other)[2]));
  expect_refused("another save's file", DP_EIO, "is not rank 1's file of save");
  // One byte of the rows in its header ("2 1 3": row 2, one row, of 3).
  std::string edited = good1;
  const size_t at = edited.find("\"2 1 3\"");
  ASSERT_NE(at, std::string::npos) << good1.substr(0, 400);
  edited[at + 1] = '1';
  write_file(rank1, edited);
  expect_refused("rows edited in a header", DP_EIO, "its header differs from its checksum");
  // One bit of its data: rank 0 reads none of rank 1's file at two ranks
  // and fails through rank 1's verdict.
  edited = good1;
  edited[edited.size() - 2] = static_cast<char>(edited[edited.size() - 2] ^ 0x01);
  write_file(rank1, edited);
  expect_refused("a flipped bit", DP_EIO, "' differ from their checksum in the manifest");
  expect_refused("a flipped bit at one rank", DP_EIO, "' differ from their checksum in the manifest", 1);
  write_file(rank1, good1);
  // An ordinary safetensors file in rank 0's place.
  Toy plain(0.0f);
  ASSERT_EQ(dp_module_save(plain.root.get(), rank0.c_str()), DP_OK);
  expect_refused("an unsharded file", DP_EIO, rank0);
  write_file(rank0, good0);
  // Restored, it loads.
  run_ranks(2, DP_BACKEND_GLOO, [&](int, dp_process_group* pg) {
    Toy toy(-1.0f);
    Sharded s = shard_unsynced(toy, pg);
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(toy.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    expect_full_weights(toy, s, 0.25f);
  });
  remove_sharded_save(folder, 2);
  remove_sharded_save(other, 2);
}

// A second save that fails on one rank (here its folder cannot be made)
// fails on every rank, naming that rank; no file of it is left, and the
// first save loads as it was. A third save succeeds and removes the first's
// files.
TEST(FsdpStateDict, ASaveThatFailsOnOneRankFailsOnEveryRankAndTheLastCompleteSaveStillLoads) {
  const std::string folder = dptest::temp_path("fsdp_failing_", "save");
  const std::string blocked = dptest::temp_path("fsdp_failing_", "not_a_folder");
  write_file(blocked, "a file");
  run_ranks(2, DP_BACKEND_SHM, [&](int rank, dp_process_group* pg) {
    Toy toy(0.25f);
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_save_sharded_state_dict(toy.root.get(), pg, folder.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    const std::vector<std::string> first = files_in(folder);
    Toy changed(0.75f);
    Sharded c = shard_unsynced(changed, pg);
    const std::string mine = rank == 1 ? blocked : folder;
    EXPECT_EQ(dp_fsdp_save_sharded_state_dict(changed.root.get(), pg, mine.c_str()), DP_EINVAL);
    const std::string error = dp_last_error();
    if (rank == 0) {
      EXPECT_NE(error.find("failed on rank 1"), std::string::npos) << error;
    }
    EXPECT_NE(error.find("is not a folder"), std::string::npos) << error;
    EXPECT_NE(error.find("last complete save is as it was"), std::string::npos) << error;
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    EXPECT_EQ(files_in(folder), first);
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(changed.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    expect_full_weights(changed, c, 0.25f);
    // The group is still in step: a third save replaces the first.
    Toy third(0.5f);
    Sharded t = shard_unsynced(third, pg);
    ASSERT_EQ(dp_fsdp_save_sharded_state_dict(third.root.get(), pg, folder.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    const std::vector<std::string> now = files_in(folder);
    EXPECT_EQ(now.size(), 3u);
    for (const std::string& name : first) {
      if (name != "manifest.json") {
        EXPECT_EQ(std::count(now.begin(), now.end(), name), 0) << name;
      }
    }
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(changed.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    expect_full_weights(changed, c, 0.5f);
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
  });
  remove_sharded_save(folder, 2);
  ::unlink(blocked.c_str());
}

// A NULL folder on one rank is that rank's refusal in the save's (and the
// load's) place: every rank fails at once naming it, and the group stays in
// step for the next save and load.
TEST(FsdpStateDict, ANullFolderOnOneRankFailsEveryRanksShardedSaveAndLoadNamingIt) {
  const std::string folder = dptest::temp_path("fsdp_null_folder_", "save");
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(0.25f);
    Sharded s = shard_unsynced(toy, pg);
    const char* mine = rank == 1 ? nullptr : folder.c_str();
    EXPECT_EQ(dp_fsdp_save_sharded_state_dict(toy.root.get(), pg, mine), DP_EINVAL);
    std::string error = dp_last_error();
    EXPECT_NE(error.find("'folder'"), std::string::npos) << error;
    if (rank == 0) {
      EXPECT_NE(error.find("failed on rank 1"), std::string::npos) << error;
    }
    ASSERT_EQ(dp_fsdp_save_sharded_state_dict(toy.root.get(), pg, folder.c_str()), DP_OK) << dp_last_error();
    Toy other(-1.0f);
    Sharded o = shard_unsynced(other, pg);
    EXPECT_EQ(dp_fsdp_load_sharded_state_dict(other.root.get(), mine), DP_EINVAL);
    error = dp_last_error();
    if (rank == 0) {
      EXPECT_NE(error.find("failed on rank 1"), std::string::npos) << error;
    }
    expect_full_weights(other, o, -1.0f);
    ASSERT_EQ(dp_fsdp_load_sharded_state_dict(other.root.get(), folder.c_str()), DP_OK) << dp_last_error();
    expect_full_weights(other, o, 0.25f);
  });
  remove_sharded_save(folder, 2);
}

// A full save is collective: when rank 0 cannot write the file every rank
// fails, naming rank 0, and a file already there is as it was.
TEST(FsdpStateDict, AFullSaveThatRankZeroCannotWriteFailsOnEveryRank) {
  const std::string path = dptest::temp_path("fsdp_full_fail_", "full.safetensors");
  const std::string nowhere = dptest::temp_path("fsdp_full_fail_", "no_such_folder") + "/full.safetensors";
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Toy toy(0.25f);
    Sharded s = shard_unsynced(toy, pg);
    EXPECT_EQ(dp_fsdp_save_full_state_dict(toy.root.get(), pg, nowhere.c_str()), DP_EIO);
    std::string error = dp_last_error();
    if (rank == 1) {
      EXPECT_NE(error.find("rank 0 could not write the full state dict"), std::string::npos) << error;
    }
    EXPECT_NE(error.find("no_such_folder"), std::string::npos) << error;
    ASSERT_EQ(dp_fsdp_save_full_state_dict(toy.root.get(), pg, path.c_str()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    const std::string before = dptest::read_bytes(path);
    if (rank == 0) {
      ASSERT_EQ(::chmod(path.c_str(), 0444), 0);
    }
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
    Toy changed(0.75f);
    Sharded c = shard_unsynced(changed, pg);
    EXPECT_EQ(dp_fsdp_save_full_state_dict(changed.root.get(), pg, path.c_str()), DP_EIO);
    error = dp_last_error();
    EXPECT_NE(error.find("read-only"), std::string::npos) << error;
    EXPECT_EQ(dptest::read_bytes(path), before);
    ASSERT_EQ(dp_pg_barrier(pg), DP_OK);
  });
  ::unlink(path.c_str());
}

// A load that is not strict leaves what the file lacks as it was: the
// fsdp-held parameters a file of the projection alone does not hold, and
// the whole module for another model's file.
TEST(FsdpStateDict, ANonStrictFullLoadLeavesWhatTheFileLacksAsItWas) {
  const std::string proj_only = dptest::temp_path("fsdp_partial_", "proj.safetensors");
  const std::string unrelated = dptest::temp_path("fsdp_partial_", "other.safetensors");
  {
    Toy source(0.5f);
    dptest::ModulePtr root = dptest::new_module();
    ASSERT_EQ(dp_module_register_module(root.get(), "proj", source.layer[3].get()), DP_OK);
    ASSERT_EQ(dp_module_save(root.get(), proj_only.c_str()), DP_OK) << dp_last_error();
    dptest::ModulePtr m = dptest::new_module();
    TensorPtr w = make<float>({2, 2}, {1, 2, 3, 4});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_save(m.get(), unrelated.c_str()), DP_OK) << dp_last_error();
  }
  run_ranks(2, DP_BACKEND_GLOO, [&](int, dp_process_group* pg) {
    Toy toy(-1.0f);
    Sharded s = shard_unsynced(toy, pg);
    ASSERT_EQ(dp_fsdp_load_full_state_dict(toy.root.get(), unrelated.c_str(), 0), DP_OK) << dp_last_error();
    expect_full_weights(toy, s, -1.0f);
    ASSERT_EQ(dp_fsdp_load_full_state_dict(toy.root.get(), proj_only.c_str(), 0), DP_OK) << dp_last_error();
    for (int l = 0; l < 3; ++l) {
      ASSERT_EQ(dp_fsdp_unshard(s.layer[l].get(), 0), DP_OK) << dp_last_error();
      EXPECT_EQ(parameter(toy.root.get(), kWeights[l]), initial_weights(l, -1.0f)) << kWeights[l];
      ASSERT_EQ(dp_fsdp_reshard(s.layer[l].get()), DP_OK) << dp_last_error();
    }
    EXPECT_EQ(parameter(toy.root.get(), kWeights[3]), initial_weights(3, 0.5f));
  });
  ::unlink(proj_only.c_str());
  ::unlink(unrelated.c_str());
}
