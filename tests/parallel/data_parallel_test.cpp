#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

#include "module/module_test_util.h"

using namespace dptest;

namespace {

constexpr int64_t kIn = 5, kHidden = 7, kOut = 3;

// A Linear-ReLU-Linear MLP with MSE loss, forward and backward written out as
// a host framework would. Rows of `batch` are [x (kIn) | target (kOut)].
struct Mlp {
  static ModulePtr make_module(uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    auto random = [&](size_t n) {
      std::vector<float> v(n);
      for (float& x : v) x = dist(rng);
      return v;
    };
    ModulePtr root = new_module();
    const int64_t dims[2][2] = {{kHidden, kIn}, {kOut, kHidden}};
    const char* names[2] = {"fc1", "fc2"};
    for (int l = 0; l < 2; ++l) {
      ModulePtr fc = new_module();
      auto w = make<float>({dims[l][0], dims[l][1]}, random(static_cast<size_t>(dims[l][0] * dims[l][1])));
      auto b = make<float>({dims[l][0]}, random(static_cast<size_t>(dims[l][0])));
      EXPECT_EQ(dp_module_register_parameter(fc.get(), "weight", w.get(), 1), DP_OK);
      EXPECT_EQ(dp_module_register_parameter(fc.get(), "bias", b.get(), 1), DP_OK);
      EXPECT_EQ(dp_module_register_module(root.get(), names[l], fc.get()), DP_OK);
    }
    return root;
  }

  // Writes (overwrites) the gradients of the loss over `full_batch` rows that
  // these rows contribute; returns the predictions.
  static std::vector<float> forward_backward(dp_module* m, const std::vector<float>& rows, int64_t full_batch) {
    auto p = [&](const char* name) { return static_cast<float*>(dp_tensor_data(parameter(m, name).get())); };
    auto g = [&](const char* name) { return static_cast<float*>(dp_tensor_data(grad(m, name).get())); };
    const float *w1 = p("fc1.weight"), *b1 = p("fc1.bias"), *w2 = p("fc2.weight"), *b2 = p("fc2.bias");
    float *gw1 = g("fc1.weight"), *gb1 = g("fc1.bias"), *gw2 = g("fc2.weight"), *gb2 = g("fc2.bias");
    std::fill(gw1, gw1 + kHidden * kIn, 0.0f);
    std::fill(gb1, gb1 + kHidden, 0.0f);
    std::fill(gw2, gw2 + kOut * kHidden, 0.0f);
    std::fill(gb2, gb2 + kOut, 0.0f);
    const size_t n = rows.size() / (kIn + kOut);
    std::vector<float> predictions;
    for (size_t r = 0; r < n; ++r) {
      const float* x = &rows[r * (kIn + kOut)];
      const float* target = x + kIn;
      float h[kHidden], dy[kOut], dh[kHidden];
      for (int64_t j = 0; j < kHidden; ++j) {
        float s = b1[j];
        for (int64_t i = 0; i < kIn; ++i) s += w1[j * kIn + i] * x[i];
        h[j] = s > 0 ? s : 0;
      }
      for (int64_t k = 0; k < kOut; ++k) {
        float s = b2[k];
        for (int64_t j = 0; j < kHidden; ++j) s += w2[k * kHidden + j] * h[j];
        predictions.push_back(s);
        dy[k] = 2.0f * (s - target[k]) / static_cast<float>(full_batch * kOut);
      }
      for (int64_t j = 0; j < kHidden; ++j) {
        float s = 0;
        for (int64_t k = 0; k < kOut; ++k) s += dy[k] * w2[k * kHidden + j];
        dh[j] = h[j] > 0 ? s : 0;
      }
      for (int64_t k = 0; k < kOut; ++k) {
        gb2[k] += dy[k];
        for (int64_t j = 0; j < kHidden; ++j) gw2[k * kHidden + j] += dy[k] * h[j];
      }
      for (int64_t j = 0; j < kHidden; ++j) {
        gb1[j] += dh[j];
        for (int64_t i = 0; i < kIn; ++i) gw1[j * kIn + i] += dh[j] * x[i];
      }
    }
    return predictions;
  }

  static void sgd(dp_module* m, float lr) {
    for (size_t i = 0; i < dp_module_num_parameters(m); ++i) {
      const char* name = nullptr;
      dp_tensor* t = nullptr;
      ASSERT_EQ(dp_module_parameter_at(m, i, &name, &t), DP_OK);
      TensorPtr w(t);
      auto gw = grad(m, name);
      float* wd = static_cast<float*>(dp_tensor_data(t));
      const float* gd = static_cast<const float*>(dp_tensor_data(gw.get()));
      for (int64_t k = 0; k < dp_tensor_numel(t); ++k) wd[k] -= lr * gd[k];
    }
  }
};

struct TrainContext {
  int64_t full_batch;
};

int train_step(void* user_data, size_t, dp_module* replica, dp_tensor* input, dp_device device, dp_tensor** output) {
  auto* ctx = static_cast<TrainContext*>(user_data);
  std::vector<float> predictions = Mlp::forward_backward(replica, values<float>(input), ctx->full_batch);
  int64_t shape[2] = {static_cast<int64_t>(predictions.size()) / kOut, kOut};
  if (dp_tensor_create(output, DP_FLOAT32, 2, shape, device) != DP_OK) return 1;
  return dp_tensor_copy_from_host(*output, predictions.data(), predictions.size() * sizeof(float)) == DP_OK ? 0 : 2;
}

void expect_close(dp_module* got, dp_module* expected) {
  for (size_t i = 0; i < dp_module_num_parameters(expected); ++i) {
    const char* name = nullptr;
    dp_tensor* t = nullptr;
    ASSERT_EQ(dp_module_parameter_at(expected, i, &name, &t), DP_OK);
    TensorPtr e(t);
    std::vector<float> a = values<float>(parameter(got, name).get()), b = values<float>(t);
    for (size_t k = 0; k < b.size(); ++k) {
      // torch's replicate test tolerances
      EXPECT_LE(std::fabs(a[k] - b[k]), 5e-5 + 1.3e-6 * std::fabs(b[k])) << name << "[" << k << "]";
    }
  }
}

std::vector<dp_device> cpus(int n) {
  std::vector<dp_device> d;
  for (int i = 0; i < n; ++i) d.push_back(cpu(i));
  return d;
}

enum class Mode { kDataParallel, kReplicaSet };

class TrainingParity : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

}  // namespace

// Two iterations with shuffled inputs: data-parallel training matches training
// on one device with the full batch.
TEST_P(TrainingParity, MatchesSingleDeviceTraining) {
  const int ndevices = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  const int64_t batch = 13;  // not a multiple of the device count
  ModulePtr reference = Mlp::make_module(1), trained = Mlp::make_module(1);
  std::vector<dp_device> devices = cpus(ndevices);
  dp_replica_set* raw = nullptr;
  if (mode == Mode::kReplicaSet) {
    DP_ASSERT_OK(dp_replica_set_create(&raw, trained.get(), devices.data(), devices.size()));
  }
  ReplicaSetPtr set(raw);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> rows(static_cast<size_t>(batch * (kIn + kOut)));
  for (float& v : rows) v = normal(rng);
  for (int iteration = 0; iteration < 2; ++iteration) {
    std::vector<size_t> order(static_cast<size_t>(batch));
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<float> shuffled;
    for (size_t r : order)
      shuffled.insert(shuffled.end(), rows.begin() + static_cast<std::ptrdiff_t>(r * (kIn + kOut)),
                      rows.begin() + static_cast<std::ptrdiff_t>((r + 1) * (kIn + kOut)));
    auto input = make<float>({batch, kIn + kOut}, shuffled);

    std::vector<float> expected = Mlp::forward_backward(reference.get(), shuffled, batch);
    Mlp::sgd(reference.get(), 0.1f);

    TrainContext ctx{batch};
    dp_tensor* out = nullptr;
    DP_ASSERT_OK(dp_module_zero_grad(trained.get()));
    if (mode == Mode::kDataParallel) {
      DP_ASSERT_OK(dp_data_parallel(trained.get(), input.get(), devices.data(), devices.size(), cpu(0), 0, train_step,
                                    &ctx, &out));
    } else {
      DP_ASSERT_OK(dp_replica_set_sync(set.get()));
      DP_ASSERT_OK(dp_replica_set_apply(set.get(), input.get(), 0, cpu(0), train_step, &ctx, &out));
      DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
    }
    TensorPtr output(out);
    EXPECT_EQ(shape(out), (std::vector<int64_t>{batch, kOut}));
    std::vector<float> got = values<float>(out);
    for (size_t k = 0; k < expected.size(); ++k) EXPECT_NEAR(got[k], expected[k], 1e-5) << k;
    Mlp::sgd(trained.get(), 0.1f);
    expect_close(trained.get(), reference.get());
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, TrainingParity,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(Mode::kDataParallel, Mode::kReplicaSet)),
                         [](const ::testing::TestParamInfo<std::tuple<int, Mode>>& param_info) {
                           return std::to_string(std::get<0>(param_info.param)) +
                                  (std::get<1>(param_info.param) == Mode::kDataParallel ? "DataParallel"
                                                                                        : "ReplicaSet");
                         });

namespace {

struct CallLog {
  std::mutex mutex;
  std::vector<size_t> indices;
  std::vector<dp_device> input_devices;
  std::vector<std::thread::id> threads;
  std::vector<const void*> replica_weights;
};

int log_and_copy(void* user_data, size_t index, dp_module* replica, dp_tensor* input, dp_device device,
                 dp_tensor** output) {
  auto* log = static_cast<CallLog*>(user_data);
  {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->indices.push_back(index);
    log->input_devices.push_back(dp_tensor_device(input));
    log->threads.push_back(std::this_thread::get_id());
    dp_tensor* w = nullptr;
    dp_module_get_parameter(replica, "weight", &w);
    log->replica_weights.push_back(dp_tensor_data(w));
    dp_tensor_destroy(w);
  }
  return dp_tensor_to_device(output, input, device);
}

}  // namespace

TEST(DataParallel, SingleDeviceCallsTheCallbackDirectlyWithTheModule) {
  ModulePtr m = linear(2, 2, 0.0f, cpu(1));
  auto input = make<float>({2, 2}, {1, 2, 3, 4}, cpu(0));
  CallLog log;
  dp_device devices[] = {cpu(1)};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_data_parallel(m.get(), input.get(), devices, 1, cpu(2), 0, log_and_copy, &log, &out));
  TensorPtr output(out);
  ASSERT_EQ(log.indices.size(), 1u);
  EXPECT_EQ(log.threads[0], std::this_thread::get_id());
  EXPECT_EQ(log.replica_weights[0], dp_tensor_data(parameter(m.get(), "weight").get()));
  EXPECT_TRUE(same_device(log.input_devices[0], cpu(1)));  // the CPU input moved to the device
  EXPECT_TRUE(same_device(dp_tensor_device(out), cpu(2)));
  EXPECT_EQ(values<float>(out), (std::vector<float>{1, 2, 3, 4}));
  ModulePtr elsewhere = linear(2, 2, 0.0f, cpu(0));
  EXPECT_EQ(dp_data_parallel(elsewhere.get(), input.get(), devices, 1, cpu(0), 0, log_and_copy, &log, &out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "must be on cpu:1")) << last_error();
}

TEST(DataParallel, FewerChunksThanDevicesUsesOnlyThatMany) {
  ModulePtr m = linear(3, 1);
  auto input = make<float>({2, 3}, iota<float>(6));
  CallLog log;
  std::vector<dp_device> devices = cpus(4);
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_data_parallel(m.get(), input.get(), devices.data(), 4, cpu(0), 0, log_and_copy, &log, &out));
  TensorPtr output(out);
  EXPECT_EQ(log.indices.size(), 2u);
  EXPECT_EQ(values<float>(out), iota<float>(6));
}

TEST(DataParallel, CpuInputsAreMovedToTheReplicasDevices) {
  ModulePtr m = linear(2, 1, 0.0f, cpu(1));
  auto input = make<float>({4, 2}, iota<float>(8), cpu(0));
  CallLog log;
  dp_device devices[] = {cpu(1), cpu(2)};
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_data_parallel(m.get(), input.get(), devices, 2, cpu(3), 1, log_and_copy, &log, &out));
  TensorPtr output(out);
  ASSERT_EQ(log.indices.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(same_device(log.input_devices[i], devices[log.indices[i]]));
    EXPECT_NE(log.threads[i], std::this_thread::get_id());
  }
  EXPECT_TRUE(same_device(dp_tensor_device(out), cpu(3)));
  EXPECT_EQ(values<float>(out), iota<float>(8));  // split and gathered along dim 1
}

TEST(DataParallel, ErrorsAreReported) {
  ModulePtr m = linear(2, 1);
  auto input = make<float>({4, 2}, iota<float>(8));
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_tensor* out = reinterpret_cast<dp_tensor*>(1);
  EXPECT_EQ(dp_data_parallel(m.get(), input.get(), devices, 0, cpu(0), 0, log_and_copy, nullptr, &out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'ndevices' is 0")) << last_error();
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(dp_data_parallel(m.get(), input.get(), devices, 2, cpu(0), 0, nullptr, nullptr, &out), DP_EINVAL);
  EXPECT_EQ(dp_data_parallel(m.get(), input.get(), devices, 2, cpu(0), 5, log_and_copy, nullptr, &out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "dim")) << last_error();
  EXPECT_EQ(dp_data_parallel(m.get(), nullptr, devices, 2, cpu(0), 0, log_and_copy, nullptr, &out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'input' is NULL")) << last_error();
}

TEST(ReplicaSetApply, FewerChunksReduceOnlyTheReplicasThatRan) {
  ModulePtr m = linear(1, 1);
  std::vector<dp_device> devices = cpus(3);
  ReplicaSetPtr set = replica_set(m.get(), devices);
  for (size_t i = 0; i < 3; ++i) {
    dp_module* r = nullptr;
    DP_ASSERT_OK(dp_replica_set_replica(set.get(), i, &r));
    ModulePtr held(r);
    auto g = grad(r, "bias");
    float one = 1.0f;
    DP_ASSERT_OK(dp_tensor_copy_from_host(g.get(), &one, sizeof one));
  }
  auto input = make<float>({2, 1}, {1, 2});
  CallLog log;
  dp_tensor* out = nullptr;
  DP_ASSERT_OK(dp_replica_set_apply(set.get(), input.get(), 0, cpu(0), log_and_copy, &log, &out));
  dp_tensor_destroy(out);
  EXPECT_EQ(log.indices.size(), 2u);
  DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "bias").get()), (std::vector<float>{2.0f}));
}
