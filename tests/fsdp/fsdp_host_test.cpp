// fully_shard driven by a host with its own autograd: per-parameter marks
// (dp_fsdp_mark_grad_ready) from the host's worker threads, and the full
// state dict in memory (dp_fsdp_full_state_dict). The model is three
// Linear(3, 3) layers with bias, `0`, `1` and `2`, one dp_fsdp over all of
// them; ranks are threads of this process with real collectives.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "thread_ranks.h"

using dptest::FsdpPtr;
using dptest::make;
using dptest::ModulePtr;
using dptest::TensorPtr;

namespace {

constexpr int kDim = 3;
constexpr int kLayers = 3;
constexpr int kRows = 4;  // per rank
const char* const kNames[] = {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"};
constexpr size_t kParams = std::size(kNames);

void run_ranks(int world, int32_t backend, const std::function<void(int, dp_process_group*)>& body) {
  dptest::run_thread_ranks("fsdp_host_", world, dptest::RankOptions{backend, 60000, false}, body);
}

std::vector<float> read(const dp_tensor* t) {
  std::vector<float> v(static_cast<size_t>(dp_tensor_numel(t)));
  EXPECT_EQ(dp_tensor_copy_to_host(t, v.data(), v.size() * sizeof(float)), DP_OK) << dp_last_error();
  return v;
}

void write(dp_tensor* t, const std::vector<float>& v) {
  ASSERT_EQ(static_cast<size_t>(dp_tensor_numel(t)), v.size());
  ASSERT_EQ(dp_tensor_copy_from_host(t, v.data(), v.size() * sizeof(float)), DP_OK) << dp_last_error();
}

std::vector<float> parameter(const dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << name << ": " << dp_last_error();
  TensorPtr owned(p);
  return p == nullptr ? std::vector<float>{} : read(p);
}

int64_t rows_of(const dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << dp_last_error();
  TensorPtr owned(p);
  int64_t shape[2] = {0, 0};
  if (p != nullptr) {
    EXPECT_EQ(dp_tensor_shape(p, shape, 2), DP_OK);
  }
  return shape[0];
}

// root { 0 { weight, bias }, 1 { ... }, 2 { ... } }; `skew` differs per rank
// so that init_sync shows.
struct Net {
  ModulePtr root = dptest::new_module();
  ModulePtr layer[kLayers];
  explicit Net(float skew) {
    for (int l = 0; l < kLayers; ++l) {
      layer[l] = dptest::new_module();
      std::vector<float> w(kDim * kDim), b(kDim);
      for (int k = 0; k < kDim * kDim; ++k) w[k] = 0.4f * std::sin(1.3f * static_cast<float>(l * 9 + k) + 0.2f) + skew;
      for (int k = 0; k < kDim; ++k) b[k] = 0.1f * std::cos(0.7f * static_cast<float>(l * 3 + k)) + skew;
      TensorPtr wt = make<float>({kDim, kDim}, w), bt = make<float>({kDim}, b);
      EXPECT_EQ(dp_module_register_parameter(layer[l].get(), "weight", wt.get(), 1), DP_OK) << dp_last_error();
      EXPECT_EQ(dp_module_register_parameter(layer[l].get(), "bias", bt.get(), 1), DP_OK) << dp_last_error();
      EXPECT_EQ(dp_module_register_module(root.get(), std::to_string(l).c_str(), layer[l].get()), DP_OK);
    }
  }
};

FsdpPtr fully_shard(dp_module* m, dp_process_group* pg) {
  dp_fsdp* f = nullptr;
  EXPECT_EQ(dp_fsdp_create(&f, m, pg, nullptr), DP_OK) << dp_last_error();
  return FsdpPtr(f);
}

// How a backward ends for the dp_fsdp.
enum class Ending {
  kExplicit,  // dp_fsdp_post_backward once every gradient is written
  kMarks,     // every parameter marked from its own thread, shuffled, then the explicit call (a no-op)
  kMixed,     // layer 2's parameters marked, then the explicit call
};

// Runs fn(i) for each index on a thread of its own, started together, in
// an order shuffled by `seed`.
void on_threads(std::vector<size_t> indices, unsigned seed, const std::function<void(size_t)>& fn) {
  std::shuffle(indices.begin(), indices.end(), std::mt19937(seed));
  std::atomic<int> waiting{static_cast<int>(indices.size())};
  std::vector<std::thread> threads;
  for (size_t i : indices) {
    threads.emplace_back([&, i] {
      --waiting;
      while (waiting.load() > 0) std::this_thread::yield();
      fn(i);
    });
  }
  for (auto& t : threads) t.join();
}

// One step on this rank's rows: forward, backward ended as `ending` says,
// finish_backward, SGD on the shards, gradients zeroed.
void train_step(Net& net, dp_fsdp* f, int rank, int step, Ending ending) {
  dp_module* root = net.root.get();
  std::vector<double> x(kRows * kDim), t(kRows * kDim);
  for (size_t k = 0; k < x.size(); ++k) {
    x[k] = std::cos(0.41 * static_cast<double>(k) + 0.83 * step + 1.7 * rank);
    t[k] = 0.5 * std::sin(0.57 * static_cast<double>(k) - 0.31 * step + 0.9 * rank);
  }
  ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
  std::vector<std::vector<float>> w(kLayers), b(kLayers);
  std::vector<std::vector<double>> h{x};
  for (int l = 0; l < kLayers; ++l) {
    w[l] = parameter(root, kNames[2 * l]);
    b[l] = parameter(root, kNames[2 * l + 1]);
    std::vector<double> y(kRows * kDim, 0.0);
    for (int r = 0; r < kRows; ++r) {
      for (int o = 0; o < kDim; ++o) {
        y[r * kDim + o] = b[l][o];
        for (int i = 0; i < kDim; ++i) y[r * kDim + o] += h.back()[r * kDim + i] * w[l][o * kDim + i];
      }
    }
    h.push_back(y);
  }
  ASSERT_EQ(dp_fsdp_reshard(f), DP_OK) << dp_last_error();
  // Backward: every full gradient, computed here, written by "the autograd".
  ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
  std::vector<std::vector<float>> grads(kParams);
  std::vector<double> dy(kRows * kDim);
  for (size_t k = 0; k < dy.size(); ++k) dy[k] = (h[kLayers][k] - t[k]) / kRows;
  for (int l = kLayers - 1; l >= 0; --l) {
    std::vector<float> gw(kDim * kDim, 0.0f), gb(kDim, 0.0f);
    std::vector<double> dx(kRows * kDim, 0.0);
    for (int r = 0; r < kRows; ++r) {
      for (int o = 0; o < kDim; ++o) {
        gb[o] += static_cast<float>(dy[r * kDim + o]);
        for (int i = 0; i < kDim; ++i) {
          gw[o * kDim + i] += static_cast<float>(dy[r * kDim + o] * h[l][r * kDim + i]);
          dx[r * kDim + i] += dy[r * kDim + o] * w[l][o * kDim + i];
        }
      }
    }
    grads[2 * l] = gw;
    grads[2 * l + 1] = gb;
    dy = dx;
  }
  auto write_grad = [&](size_t i) {
    dp_tensor* g = nullptr;
    ASSERT_EQ(dp_module_grad(root, kNames[i], &g), DP_OK) << dp_last_error();
    TensorPtr owned(g);
    write(g, grads[i]);
  };
  const unsigned seed = static_cast<unsigned>(rank * 1000 + step);
  if (ending == Ending::kExplicit) {
    for (size_t i = 0; i < kParams; ++i) write_grad(i);
    ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
  } else if (ending == Ending::kMarks) {
    std::vector<dp_status> marked(kParams, DP_EINTERNAL);
    on_threads({0, 1, 2, 3, 4, 5}, seed, [&](size_t i) {
      write_grad(i);
      marked[i] = dp_fsdp_mark_grad_ready(f, kNames[i]);
    });
    for (size_t i = 0; i < kParams; ++i) EXPECT_EQ(marked[i], DP_OK) << kNames[i];
    // The last mark ran post_backward: the slots hold the shards again.
    EXPECT_LT(rows_of(root, "0.weight"), kDim);
    EXPECT_EQ(dp_fsdp_post_backward(f), DP_OK) << "the explicit call after the marks is a no-op: " << dp_last_error();
  } else {
    for (size_t i = 0; i < 4; ++i) write_grad(i);
    on_threads({4, 5}, seed, [&](size_t i) {
      write_grad(i);
      EXPECT_EQ(dp_fsdp_mark_grad_ready(f, kNames[i]), DP_OK) << dp_last_error();
    });
    EXPECT_EQ(rows_of(root, "0.weight"), kDim) << "two of six marks ran no post_backward";
    ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
    // That post_backward ended the backward's marks.
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f, "0.weight"), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("not unsharded since its last post_backward"), std::string::npos)
        << dp_last_error();
  }
  ASSERT_EQ(dp_fsdp_finish_backward(f), DP_OK) << dp_last_error();
  for (size_t i = 0; i < dp_fsdp_num_parameters(f); ++i) {
    dp_tensor* shard = nullptr;
    dp_tensor* grad = nullptr;
    ASSERT_EQ(dp_fsdp_shard(f, i, &shard), DP_OK);
    ASSERT_EQ(dp_fsdp_shard_grad(f, i, &grad), DP_OK);
    TensorPtr owned_shard(shard), owned_grad(grad);
    std::vector<float> v = read(shard), g = read(grad);
    for (size_t k = 0; k < v.size(); ++k) v[k] -= 0.3f * g[k];
    write(shard, v);
  }
  ASSERT_EQ(dp_module_zero_grad(root), DP_OK) << dp_last_error();
}

// Every rank's shards, concatenated, after `steps` steps ended as `ending` says.
std::vector<std::vector<float>> train(int32_t backend, Ending ending, int steps = 3) {
  std::vector<std::vector<float>> shards(2);
  run_ranks(2, backend, [&](int rank, dp_process_group* pg) {
    Net net(0.03f * static_cast<float>(rank));
    FsdpPtr f = fully_shard(net.root.get(), pg);
    ASSERT_EQ(dp_fsdp_num_parameters(f.get()), kParams);
    for (int step = 0; step < steps; ++step) train_step(net, f.get(), rank, step, ending);
    for (size_t i = 0; i < kParams; ++i) {
      dp_tensor* shard = nullptr;
      ASSERT_EQ(dp_fsdp_shard(f.get(), i, &shard), DP_OK);
      TensorPtr owned(shard);
      std::vector<float> v = read(shard);
      shards[rank].insert(shards[rank].end(), v.begin(), v.end());
    }
  });
  return shards;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class FsdpMarks : public ::testing::TestWithParam<int32_t> {};

std::string backend_name(const ::testing::TestParamInfo<int32_t>& info) {
  return info.param == DP_BACKEND_SHM ? "shm" : "gloo";
}

}  // namespace

TEST_P(FsdpMarks, MarksFromSeveralThreadsInShuffledOrderTrainBitwiseLikeTheExplicitPostBackward) {
  const auto explicit_shards = train(GetParam(), Ending::kExplicit);
  const auto marked_shards = train(GetParam(), Ending::kMarks);
  ASSERT_FALSE(explicit_shards[0].empty());
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(explicit_shards[r], marked_shards[r])) << "rank " << r;
}

TEST_P(FsdpMarks, SomeMarksThenTheExplicitPostBackwardTrainBitwiseLikeTheExplicitPostBackward) {
  const auto explicit_shards = train(GetParam(), Ending::kExplicit);
  const auto mixed_shards = train(GetParam(), Ending::kMixed);
  ASSERT_FALSE(explicit_shards[0].empty());
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(bitwise_equal(explicit_shards[r], mixed_shards[r])) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Backends, FsdpMarks, ::testing::Values(DP_BACKEND_GLOO, DP_BACKEND_SHM), backend_name);

TEST(FsdpMarks, AMarkTwiceInABackwardIsEstateNamingItAlsoAfterTheSetCompleted) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_mark_grad_ready(f.get(), "1.bias"), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f.get(), "1.bias"), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("'1.bias'"), std::string::npos) << dp_last_error();
    EXPECT_NE(std::string(dp_last_error()).find("already marked"), std::string::npos) << dp_last_error();
    for (const char* name : kNames) {
      if (std::strcmp(name, "1.bias") != 0) {
        ASSERT_EQ(dp_fsdp_mark_grad_ready(f.get(), name), DP_OK) << dp_last_error();
      }
    }
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f.get(), "2.weight"), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("'2.weight'"), std::string::npos) << dp_last_error();
    EXPECT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << "rank " << rank << ": " << dp_last_error();
  });
}

TEST(FsdpMarks, AnUnknownNameOrNoNameIsEinvalNamingIt) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f.get(), "3.weight"), DP_EINVAL);
    EXPECT_NE(std::string(dp_last_error()).find("'3.weight'"), std::string::npos) << dp_last_error();
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f.get(), nullptr), DP_EINVAL);
    EXPECT_NE(std::string(dp_last_error()).find("'name'"), std::string::npos) << dp_last_error();
    EXPECT_EQ(dp_fsdp_mark_grad_ready(nullptr, "0.weight"), DP_EINVAL);
    // Nothing was marked: the explicit path still works.
    EXPECT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
  });
}

TEST(FsdpMarks, AMarkWithNoUnshardSinceTheLastPostBackwardIsEstate) {
  run_ranks(2, DP_BACKEND_GLOO, [](int, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    EXPECT_EQ(dp_fsdp_mark_grad_ready(f.get(), "0.weight"), DP_ESTATE);
    EXPECT_NE(std::string(dp_last_error()).find("dp_fsdp_unshard"), std::string::npos) << dp_last_error();
  });
}

TEST(FsdpMarks, AFinishWithAParameterUnmarkedIsEstateNamingItThePeersNameThisRankAndAllGoOn) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    for (const char* name : kNames) {
      if (rank == 1 && std::strcmp(name, "1.bias") == 0) continue;  // the forgotten mark
      ASSERT_EQ(dp_fsdp_mark_grad_ready(f.get(), name), DP_OK) << dp_last_error();
    }
    const dp_status finished = dp_fsdp_finish_backward(f.get());
    const std::string why = dp_last_error();
    if (rank == 1) {
      EXPECT_EQ(finished, DP_ESTATE) << why;
      EXPECT_NE(why.find("'1.bias'"), std::string::npos) << why;
      EXPECT_EQ(why.find("'1.weight'"), std::string::npos) << why;
      EXPECT_LT(rows_of(net.root.get(), "0.weight"), kDim) << "the refused post_backward resharded";
    } else {
      EXPECT_EQ(finished, DP_EINVAL) << why;
      EXPECT_NE(why.find("rank 1"), std::string::npos) << why;
    }
    // The next backward, every mark made, goes through on both.
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    for (const char* name : kNames) ASSERT_EQ(dp_fsdp_mark_grad_ready(f.get(), name), DP_OK) << dp_last_error();
    EXPECT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
  });
}

// ---- the full state dict in memory ----

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(FsdpFullStateDict, InMemoryHoldsTheFullSavesTensorsAndTheUnshardedParametersOnRootOnly) {
  const std::string saved = dptest::temp_path("fsdp_host_", "full.safetensors");
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Net net(0.0f);
    TensorPtr stats = make<float>({2}, {7.0f, 8.0f}), scratch = make<float>({1}, {9.0f});
    ASSERT_EQ(dp_module_register_buffer(net.root.get(), "stats", stats.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_buffer(net.root.get(), "scratch", scratch.get(), 0), DP_OK);
    // Three dp_fsdp: layers 0 and 1, then the root over layer 2.
    FsdpPtr f0 = fully_shard(net.layer[0].get(), pg), f1 = fully_shard(net.layer[1].get(), pg);
    FsdpPtr froot = fully_shard(net.root.get(), pg);
    // Each rank's shards get values of its own, so the full ones need both.
    for (dp_fsdp* f : {f0.get(), f1.get(), froot.get()}) {
      for (size_t i = 0; i < dp_fsdp_num_parameters(f); ++i) {
        dp_tensor* shard = nullptr;
        ASSERT_EQ(dp_fsdp_shard(f, i, &shard), DP_OK);
        TensorPtr owned(shard);
        std::vector<float> v = read(shard);
        for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(100 * rank + 10 * i + k) + 0.25f;
        write(shard, v);
      }
    }
    dp_module* on_one = nullptr;
    ASSERT_EQ(dp_fsdp_full_state_dict(net.root.get(), pg, 1, &on_one), DP_OK) << dp_last_error();
    ModulePtr owned_one(on_one);
    EXPECT_EQ(on_one != nullptr, rank == 1);
    dp_module* full = nullptr;
    ASSERT_EQ(dp_fsdp_full_state_dict(net.root.get(), pg, -1, &full), DP_OK) << dp_last_error();
    ModulePtr owned_full(full);
    ASSERT_NE(full, nullptr);
    ASSERT_EQ(dp_fsdp_save_full_state_dict(net.root.get(), pg, saved.c_str()), DP_OK) << dp_last_error();
    // Names, kinds and order of the state dict; persistent buffers only.
    ASSERT_EQ(dp_module_num_parameters(full), kParams);
    ASSERT_EQ(dp_module_num_buffers(full), 1u);
    for (size_t i = 0; i < kParams; ++i) {
      const char* name = nullptr;
      dp_tensor* t = nullptr;
      ASSERT_EQ(dp_module_parameter_at(full, i, &name, &t), DP_OK);
      TensorPtr owned(t);
      EXPECT_STREQ(name, kNames[i]);
      EXPECT_EQ(dp_tensor_device(t).type, DP_DEVICE_CPU);
      int requires_grad = 0;
      ASSERT_EQ(dp_module_requires_grad(full, name, &requires_grad), DP_OK);
      EXPECT_EQ(requires_grad, 1);
    }
    EXPECT_EQ((std::vector<float>{7.0f, 8.0f}), [&] {
      dp_tensor* b = nullptr;
      EXPECT_EQ(dp_module_get_buffer(full, "stats", &b), DP_OK) << dp_last_error();
      TensorPtr owned(b);
      return b == nullptr ? std::vector<float>{} : read(b);
    }());
    // The file-based save's contents: dp_module_save of it writes the same bytes.
    const std::string mine = dptest::temp_path("fsdp_host_", "mine" + std::to_string(rank) + ".safetensors");
    ASSERT_EQ(dp_module_save(full, mine.c_str()), DP_OK) << dp_last_error();
    const std::string expected = file_bytes(saved);
    EXPECT_FALSE(expected.empty());
    EXPECT_TRUE(file_bytes(mine) == expected) << "rank " << rank;
    std::remove(mine.c_str());
    // The unsharded parameters, and rank `root`'s copy the same.
    for (dp_fsdp* f : {f0.get(), f1.get(), froot.get()}) ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
    for (const char* name : kNames) {
      const std::vector<float> unsharded = parameter(net.root.get(), name);
      EXPECT_EQ(parameter(full, name), unsharded) << name;
      if (on_one != nullptr) {
        EXPECT_EQ(parameter(on_one, name), unsharded) << name;
      }
      // Every rank's rows are in it: rank 1's values start at 100.
      if (std::strcmp(name, "0.weight") == 0) {
        EXPECT_GE(unsharded.back(), 100.0f);
      }
    }
    for (dp_fsdp* f : {f0.get(), f1.get(), froot.get()}) ASSERT_EQ(dp_fsdp_reshard(f), DP_OK) << dp_last_error();
    // A copy: writing it leaves the module alone.
    dp_tensor* copy = nullptr;
    ASSERT_EQ(dp_module_get_buffer(full, "stats", &copy), DP_OK);
    TensorPtr owned_copy(copy);
    write(copy, {0.0f, 0.0f});
    EXPECT_EQ(read(stats.get()), (std::vector<float>{7.0f, 8.0f}));
  });
  std::remove(saved.c_str());
}

TEST(FsdpFullStateDict, ABadRootOnOneRankFailsEveryRankNamingItAndTheGroupStaysUsable) {
  run_ranks(2, DP_BACKEND_GLOO, [&](int rank, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    dp_module* out = nullptr;
    EXPECT_EQ(dp_fsdp_full_state_dict(net.root.get(), pg, rank == 0 ? 2 : 0, &out), DP_EINVAL);
    EXPECT_EQ(out, nullptr);
    const std::string why = dp_last_error();
    EXPECT_NE(why.find(rank == 0 ? "'root'" : "rank 0"), std::string::npos) << why;
    ASSERT_EQ(dp_fsdp_full_state_dict(net.root.get(), pg, 0, &out), DP_OK) << dp_last_error();
    ModulePtr owned(out);
    EXPECT_EQ(out != nullptr, rank == 0);
  });
}

// ---- the unshard protocol and what create does to the host's memory (dp_fsdp.h) ----

namespace {

std::vector<int64_t> shape_of(const dp_tensor* t) {
  std::vector<int64_t> shape(static_cast<size_t>(dp_tensor_ndim(t)));
  EXPECT_EQ(dp_tensor_shape(t, shape.data(), static_cast<int32_t>(shape.size())), DP_OK);
  return shape;
}

std::vector<int64_t> slot_shape(const dp_module* m, const char* name) {
  dp_tensor* p = nullptr;
  EXPECT_EQ(dp_module_get_parameter(m, name, &p), DP_OK) << dp_last_error();
  TensorPtr owned(p);
  return p == nullptr ? std::vector<int64_t>{} : shape_of(p);
}

}  // namespace

TEST(FsdpProtocol, RepeatedUnshardsMakeNoCollectiveAndWaitUnshardFollowsTheState) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    Net net(0.0f);
    FsdpPtr f = fully_shard(net.root.get(), pg);
    EXPECT_EQ(dp_fsdp_wait_unshard(f.get()), DP_ESTATE) << "resharded, none in flight";
    EXPECT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << "a reshard while resharded does nothing";
    // Rank 0 repeats its unshards, async and blocking; rank 1 makes one.
    if (rank == 0) {
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
    } else {
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    }
    EXPECT_EQ(dp_fsdp_wait_unshard(f.get()), DP_OK) << "unsharded: at once: " << dp_last_error();
    EXPECT_EQ(slot_shape(net.root.get(), "0.weight"), (std::vector<int64_t>{kDim, kDim}));
    ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    // Had a repeat issued an all-gather, this collective would pair with it.
    dp_module* state = nullptr;
    ASSERT_EQ(dp_fsdp_full_state_dict(net.root.get(), pg, -1, &state), DP_OK) << dp_last_error();
    ModulePtr owned(state);
    EXPECT_EQ(dp_fsdp_wait_unshard(f.get()), DP_ESTATE) << "post_backward resharded";
    EXPECT_EQ(dp_fsdp_post_backward(f.get()), DP_ESTATE) << "no unshard since the last post_backward";
  });
}

TEST(FsdpProtocol, ReshardKeepsTheFullParametersUntilPostBackwardOnlyWithoutReshardAfterForward) {
  for (int after_forward : {0, 1}) {
    run_ranks(2, DP_BACKEND_GLOO, [after_forward](int rank, dp_process_group* pg) {
      Net net(0.0f);
      const int64_t shard_rows = rank == 0 ? 2 : 1;  // 3 rows in chunks of 2
      dp_fsdp_options o;
      ASSERT_EQ(dp_fsdp_options_init(&o, sizeof o), DP_OK);
      o.reshard_after_forward = after_forward;
      dp_fsdp* raw = nullptr;
      ASSERT_EQ(dp_fsdp_create(&raw, net.root.get(), pg, &o), DP_OK) << dp_last_error();
      FsdpPtr f(raw);
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << "completes the unshard first: " << dp_last_error();
      EXPECT_EQ(slot_shape(net.root.get(), "1.weight")[0], after_forward != 0 ? shard_rows : kDim);
      EXPECT_EQ(dp_fsdp_wait_unshard(f.get()), after_forward != 0 ? DP_ESTATE : DP_OK);
      ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
      EXPECT_EQ(slot_shape(net.root.get(), "1.weight")[0], shard_rows) << "post_backward always reshards";
      ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    });
  }
}

TEST(FsdpProtocol, ShardsThatHoldNothingAreZeroRowTensorsAndAnEmptyDpFsdpMakesNoCollective) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    ModulePtr root = dptest::new_module(), child = dptest::new_module();
    TensorPtr narrow = make<float>({1, 3}, {1, 2, 3});
    ASSERT_EQ(dp_module_register_parameter(child.get(), "narrow", narrow.get(), 1), DP_OK);
    ASSERT_EQ(dp_module_register_module(root.get(), "child", child.get()), DP_OK);
    FsdpPtr f = fully_shard(child.get(), pg);
    FsdpPtr empty = fully_shard(root.get(), pg);  // the child's dp_fsdp holds everything
    ASSERT_EQ(dp_fsdp_num_parameters(empty.get()), 0u);
    const int64_t rows = rank == 0 ? 1 : 0;
    dp_tensor* shard = nullptr;
    dp_tensor* grad = nullptr;
    ASSERT_EQ(dp_fsdp_shard(f.get(), 0, &shard), DP_OK);
    ASSERT_EQ(dp_fsdp_shard_grad(f.get(), 0, &grad), DP_OK);
    TensorPtr owned_shard(shard), owned_grad(grad);
    ASSERT_NE(shard, nullptr);
    ASSERT_NE(grad, nullptr);
    EXPECT_EQ(shape_of(shard), (std::vector<int64_t>{rows, 3}));
    EXPECT_EQ(shape_of(grad), (std::vector<int64_t>{rows, 3}));
    EXPECT_EQ(slot_shape(root.get(), "child.narrow"), (std::vector<int64_t>{rows, 3}));
    // The empty dp_fsdp's state errors hold; its calls pair with nothing, so
    // rank 0 making them twice leaves the next collective in step.
    EXPECT_EQ(dp_fsdp_wait_unshard(empty.get()), DP_ESTATE);
    EXPECT_EQ(dp_fsdp_post_backward(empty.get()), DP_ESTATE);
    for (int round = 0; round < (rank == 0 ? 2 : 1); ++round) {
      ASSERT_EQ(dp_fsdp_unshard(empty.get(), 1), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_wait_unshard(empty.get()), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_post_backward(empty.get()), DP_OK) << dp_last_error();
      ASSERT_EQ(dp_fsdp_finish_backward(empty.get()), DP_OK) << dp_last_error();
    }
    // Every rank, rows or none, takes part in the all-gather and reduce-scatter.
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter(root.get(), "child.narrow"), (std::vector<float>{1, 2, 3}));
    dp_tensor* full_grad = nullptr;
    ASSERT_EQ(dp_module_grad(root.get(), "child.narrow", &full_grad), DP_OK) << dp_last_error();
    TensorPtr owned_full_grad(full_grad);
    write(full_grad, {2.0f * static_cast<float>(rank), 0.0f, 4.0f});
    ASSERT_EQ(dp_fsdp_post_backward(f.get()), DP_OK) << dp_last_error();
    ASSERT_EQ(dp_fsdp_finish_backward(f.get()), DP_OK) << dp_last_error();
    EXPECT_EQ(read(grad), rank == 0 ? (std::vector<float>{1.0f, 0.0f, 4.0f}) : std::vector<float>{});
  });
}

namespace {

void count_release(void* counter) { ++*static_cast<std::atomic<int>*>(counter); }

}  // namespace

TEST(FsdpProtocol, CreateDropsTheHostsParameterAndGradientMemoryAfterWritingRankZerosValues) {
  run_ranks(2, DP_BACKEND_GLOO, [](int rank, dp_process_group* pg) {
    ModulePtr m = dptest::new_module();
    const float skew = static_cast<float>(rank);
    // `lent`: the host's memory, whose last reference the module holds.
    std::vector<float> lent_memory{1 + skew, 2 + skew, 3 + skew, 4 + skew};
    std::vector<float> grad_memory(4, 5.0f);
    std::atomic<int> lent_released{0}, grad_released{0};
    const int64_t shape[] = {2, 2};
    dp_tensor* lent = nullptr;
    ASSERT_EQ(dp_tensor_from_blob(&lent, lent_memory.data(), DP_FLOAT32, 2, shape, dptest::cpu(0), count_release,
                                  &lent_released),
              DP_OK);
    ASSERT_EQ(dp_module_register_parameter(m.get(), "lent", lent, 1), DP_OK);
    dp_tensor_destroy(lent);
    // `kept`: a parameter the host keeps a handle on.
    TensorPtr kept = make<float>({2, 2}, {10 + skew, 20 + skew, 30 + skew, 40 + skew});
    ASSERT_EQ(dp_module_register_parameter(m.get(), "kept", kept.get(), 1), DP_OK);
    dp_tensor* grad = nullptr;
    ASSERT_EQ(dp_tensor_from_blob(&grad, grad_memory.data(), DP_FLOAT32, 2, shape, dptest::cpu(0), count_release,
                                  &grad_released),
              DP_OK);
    ASSERT_EQ(dp_module_set_grad(m.get(), "kept", grad), DP_OK) << dp_last_error();
    dp_tensor_destroy(grad);
    ASSERT_EQ(lent_released.load(), 0);
    ASSERT_EQ(grad_released.load(), 0);
    FsdpPtr f = fully_shard(m.get(), pg);
    // The module's slots dropped both: their memory went back at once.
    EXPECT_EQ(lent_released.load(), 1);
    EXPECT_EQ(grad_released.load(), 1);
    // The kept handle names the host's tensor, not the parameter: with
    // init_sync it holds rank 0's values, and the slot is the shard elsewhere.
    EXPECT_EQ(read(kept.get()), (std::vector<float>{10, 20, 30, 40}));
    dp_tensor* slot = nullptr;
    ASSERT_EQ(dp_module_get_parameter(m.get(), "kept", &slot), DP_OK);
    TensorPtr owned_slot(slot);
    EXPECT_NE(dp_tensor_data(slot), dp_tensor_data(kept.get()));
    // The gradient starts afresh: zeros, once unsharded.
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter(m.get(), "lent"), (std::vector<float>{1, 2, 3, 4}));
    dp_tensor* fresh = nullptr;
    ASSERT_EQ(dp_module_grad(m.get(), "kept", &fresh), DP_OK) << dp_last_error();
    TensorPtr owned_fresh(fresh);
    EXPECT_EQ(read(fresh), (std::vector<float>{0, 0, 0, 0}));
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
    // Writing the host's old tensor changes nothing the dp_fsdp holds.
    write(kept.get(), {-1, -1, -1, -1});
    ASSERT_EQ(dp_fsdp_unshard(f.get(), 0), DP_OK) << dp_last_error();
    EXPECT_EQ(parameter(m.get(), "kept"), (std::vector<float>{10, 20, 30, 40}));
    ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
  });
}
