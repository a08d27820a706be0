// One rank of HSDP (fully_shard with a replicate group) across real
// processes: 4 ranks as 2 hosts of 2 (DP_HOST_ID h0 for ranks 0 and 1, h1
// for 2 and 3), each host's ranks a shard group (shared memory) and ranks k
// and k + 2 a replicate group, each group over a file store of its own in
// DP_TEST_DIR, so that no group needs another to be split. The ToyModel is
// fsdp_worker.c's: 3 x Linear(3, 3) in `linears`, then `proj`, fully_shard
// on each linear and on `linears`, a dp_ddp over every rank on the root.
// The sharding is made through FullyShard::create on those groups (and
// through dp_fsdp_create_on_mesh in mesh_parity), the rest through the C
// ABI. Scenarios:
//   parity      4 steps under 2x2 HSDP (with and without full parameters
//               as views) equal single-process training on the whole batch
//               and plain fully_shard over the 4 ranks
//   average     full gradients of rank + 1: every shard gradient is their
//               average over the 4 ranks, 2.5 exactly, in float32, float16
//               and bfloat16 reduce dtypes, also for a 0-d parameter
//   save_load   2 steps under 2x2, a sharded save (written by one shard
//               group: 2 files) and a full save; the sharded save loads
//               under 1x4 and under 4x1 (pure replication), the full one
//               under 2x2, and each trains 2 more steps like one process
//   refused_post  rank 3's post_backward is refused: every rank's fails
//               naming it, and the next iteration reduces as usual
//   save_refused  a sharded save refused on a rank that does not write:
//               every rank's fails naming it, and the last save loads
//   bad_names   the second host names a parameter otherwise: every rank's
//               create fails naming it, and every group stays usable
//   bad_shards  the second host's ranks are shard groups of one: their
//               replicas hold other shards, and every rank's create fails
//               naming the shard groups' sizes
//   mesh_parity dp_fsdp_create_on_mesh on the mesh by host and on a 1-D
//               mesh train like one process; a 3-D mesh is refused
// Prints "rank R: SCENARIO passed" and exits 0 when every check held.
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "c_worker_check.h"
#include "capi/capi_internal.h"
#include "capi/dist_internal.h"
#include "capi/fsdp_internal.h"
#include "core/error.h"
#include "dparallel/dparallel.h"
#include "fsdp/fsdp_state_dict.h"
#include "fsdp/fully_shard.h"

namespace {

using dparallel::DType;
using dparallel::Tensor;
using dparallel::fsdp::FullyShard;
using dparallel::fsdp::ShardingOptions;
using Sharding = std::shared_ptr<FullyShard>;

constexpr int kDim = 3;
constexpr int kRowsPerRank = 4;
constexpr int kWorld = 4;
constexpr int kRows = kRowsPerRank * kWorld;
constexpr int kSteps = 4;
constexpr double kLr = 0.2;
const dparallel::Device kCpu{dparallel::DeviceType::kCpu, 0};
const char* const kWeights[4] = {"linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight"};

using Weights = std::vector<std::vector<float>>;  // [layer][k]

float initial(int layer, int k, float skew) {
  return 0.3f * sinf(1.7f * static_cast<float>(layer * 9 + k) + 0.4f) + skew;
}

void batch(int step, double* x, double* t) {
  for (int k = 0; k < kRows * kDim; ++k) {
    x[k] = cos(0.37 * k + 0.91 * step);
    t[k] = 0.5 * sin(0.53 * k - 0.29 * step);
  }
}

void linear(const double* x, const float* w, double* y, int rows) {
  for (int b = 0; b < rows; ++b) {
    for (int o = 0; o < kDim; ++o) {
      double sum = 0;
      for (int i = 0; i < kDim; ++i) sum += x[b * kDim + i] * w[o * kDim + i];
      y[b * kDim + o] = sum;
    }
  }
}

void backward(const double* dy, const double* x, const float* w, double* g, double* dx, int rows) {
  for (int b = 0; b < rows; ++b) {
    for (int o = 0; o < kDim; ++o) {
      for (int i = 0; i < kDim; ++i) g[o * kDim + i] += dy[b * kDim + o] * x[b * kDim + i];
    }
  }
  for (int b = 0; b < rows; ++b) {
    for (int i = 0; i < kDim; ++i) {
      double sum = 0;
      for (int o = 0; o < kDim; ++o) sum += dy[b * kDim + o] * w[o * kDim + i];
      dx[b * kDim + i] = sum;
    }
  }
}

// Single-process training on the whole batch, `steps` steps.
Weights reference(int steps) {
  Weights w(4, std::vector<float>(kDim * kDim));
  for (int l = 0; l < 4; ++l) {
    for (int k = 0; k < kDim * kDim; ++k) w[l][k] = initial(l, k, 0.0f);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<double> x(kRows * kDim), t(kRows * kDim), dy(kRows * kDim), dx(kRows * kDim);
    std::vector<std::vector<double>> h(5, std::vector<double>(kRows * kDim));
    std::vector<std::vector<double>> g(4, std::vector<double>(kDim * kDim));
    batch(s, x.data(), t.data());
    h[0] = x;
    for (int l = 0; l < 4; ++l) linear(h[l].data(), w[l].data(), h[l + 1].data(), kRows);
    for (int k = 0; k < kRows * kDim; ++k) dy[k] = (h[4][k] - t[k]) / kRows;
    for (int l = 3; l >= 0; --l) {
      backward(dy.data(), h[l].data(), w[l].data(), g[l].data(), dx.data(), kRows);
      dy = dx;
    }
    for (int l = 0; l < 4; ++l) {
      for (int k = 0; k < kDim * kDim; ++k) w[l][k] -= static_cast<float>(kLr * g[l][k]);
    }
  }
  return w;
}

// This rank's groups: `world` over every rank, and a mesh's shard and replicate groups.
struct Groups {
  dp_process_group* world = nullptr;
  dp_process_group* shard = nullptr;
  dp_process_group* replicate = nullptr;  // null: plain fully_shard
};

dp_process_group* make_group(const std::string& name, int rank, int size) {
  dp_store* store = nullptr;
  const std::string path = std::string(g_dir) + "/store-" + name;
  CHECK_OK(dp_store_create_file(&store, path.c_str(), size));
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = size;
  o.store = store;
  o.timeout_ms = 60000;
  dp_process_group* pg = nullptr;
  CHECK_OK(dp_process_group_create(&pg, &o));
  dp_store_destroy(store);
  if (pg == nullptr) exit(3);
  return pg;
}

std::shared_ptr<dparallel::dist::ProcessGroup> group_of(dp_process_group* pg) {
  return pg != nullptr ? pg->group : nullptr;
}

struct Toy {
  dp_module* root = nullptr;
  dp_module* linears = nullptr;
  dp_module* layer[4] = {};
  Sharding fsdp[3], fsdp_linears;
  dp_fsdp* handles[4] = {};  // made by dp_fsdp_create_on_mesh: layers 0-2, then `linears`
  dp_ddp* ddp = nullptr;
  Groups groups;
  const void* full_address[3] = {};  // each layer's full parameter at its first unshard
};

// The toy's modules and, unless `only_modules`, its dp_fsdp (on
// `groups.shard`, replicated across `groups.replicate`) and dp_ddp.
// With `mesh`, the dp_fsdp are made through the C ABI's
// dp_fsdp_create_on_mesh (with init_sync), not from `groups`' shard and
// replicate groups.
void toy_create(Toy& toy, float skew, const Groups& groups, const ShardingOptions& options = {},
                const char* layer0_name = "weight", const dp_device_mesh* mesh = nullptr) {
  toy.groups = groups;
  for (const void*& at : toy.full_address) at = nullptr;
  CHECK_OK(dp_module_create(&toy.root));
  CHECK_OK(dp_module_create(&toy.linears));
  for (int l = 0; l < 4; ++l) {
    float v[kDim * kDim];
    int64_t shape[2] = {kDim, kDim};
    dp_tensor* w = nullptr;
    for (int k = 0; k < kDim * kDim; ++k) v[k] = initial(l, k, skew);
    CHECK_OK(dp_module_create(&toy.layer[l]));
    CHECK_OK(dp_tensor_create(&w, DP_FLOAT32, 2, shape, dp_device{DP_DEVICE_CPU, 0}));
    CHECK_OK(dp_tensor_copy_from_host(w, v, sizeof v));
    CHECK_OK(dp_module_register_parameter(toy.layer[l], l == 0 ? layer0_name : "weight", w, 1));
    dp_tensor_destroy(w);
    if (l < 3) {
      const char name[2] = {static_cast<char>('0' + l), 0};
      CHECK_OK(dp_module_register_module(toy.linears, name, toy.layer[l]));
    }
  }
  CHECK_OK(dp_module_register_module(toy.root, "linears", toy.linears));
  CHECK_OK(dp_module_register_module(toy.root, "proj", toy.layer[3]));
  if (mesh != nullptr) {
    for (int l = 0; l < 4; ++l) {
      CHECK_OK(dp_fsdp_create_on_mesh(&toy.handles[l], l < 3 ? toy.layer[l] : toy.linears, mesh, nullptr));
      if (toy.handles[l] == nullptr) exit(3);
      (l < 3 ? toy.fsdp[l] : toy.fsdp_linears) = toy.handles[l]->sharding;
    }
  } else {
    const auto shard = group_of(groups.shard), replicate = group_of(groups.replicate);
    for (int l = 0; l < 3; ++l) toy.fsdp[l] = FullyShard::create(toy.layer[l]->module, shard, replicate, options);
    toy.fsdp_linears = FullyShard::create(toy.linears->module, shard, replicate, options);
  }
  CHECK_OK(dp_ddp_create(&toy.ddp, toy.root, groups.world, nullptr));
}

void toy_destroy(Toy& toy) {
  dp_ddp_destroy(toy.ddp);
  for (Sharding* f : {&toy.fsdp_linears, &toy.fsdp[2], &toy.fsdp[1], &toy.fsdp[0]}) {
    if (*f && toy.handles[0] == nullptr) (*f)->close();
    f->reset();
  }
  for (int l = 3; l >= 0; --l) dp_fsdp_destroy(toy.handles[l]);
  for (dp_module* m : toy.layer) dp_module_destroy(m);
  dp_module_destroy(toy.linears);
  dp_module_destroy(toy.root);
}

std::vector<float> get(dp_module* m, const char* name, bool grad) {
  dp_tensor* t = nullptr;
  std::vector<float> out;
  if ((grad ? dp_module_grad(m, name, &t) : dp_module_get_parameter(m, name, &t)) != DP_OK || t == nullptr) {
    CHECK(0, "%s of %s: %s", grad ? "grad" : "parameter", name, dp_last_error());
    return out;
  }
  out.resize(static_cast<size_t>(dp_tensor_numel(t)));
  CHECK_OK(dp_tensor_copy_to_host(t, out.data(), out.size() * sizeof(float)));
  dp_tensor_destroy(t);
  return out;
}

void add_grad(dp_module* m, const char* name, const double* delta) {
  dp_tensor* t = nullptr;
  CHECK_OK(dp_module_grad(m, name, &t));
  if (t == nullptr) return;
  float g[kDim * kDim];
  CHECK_OK(dp_tensor_copy_to_host(t, g, sizeof g));
  for (int k = 0; k < kDim * kDim; ++k) g[k] += static_cast<float>(delta[k]);
  CHECK_OK(dp_tensor_copy_from_host(t, g, sizeof g));
  dp_tensor_destroy(t);
}

// Layer `l`'s full parameter (unsharded) is where its first unshard put it:
// one address for the dp_fsdp's life (dp_fsdp.h).
void check_full_address(Toy& toy, int l) {
  dp_tensor* t = nullptr;
  CHECK_OK(dp_module_get_parameter(toy.root, kWeights[l], &t));
  if (t == nullptr) return;
  const void* at = dp_tensor_data(t);
  dp_tensor_destroy(t);
  if (toy.full_address[l] == nullptr) toy.full_address[l] = at;
  CHECK(at == toy.full_address[l], "%s moved from %p to %p between unshards", kWeights[l], toy.full_address[l], at);
}

// Runs `fn`, counting an exception as a failed check.
void checked(const char* what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    CHECK(0, "%s threw: %s", what, e.what());
  }
}

// One step of the toy on this rank's rows of the whole batch: its rank in
// the world, whatever the mesh.
void train_step(Toy& toy, int step) {
  checked("a training step", [&] {
    std::vector<double> all_x(kRows * kDim), all_t(kRows * kDim);
    double h[5][kRowsPerRank * kDim], dy[kRowsPerRank * kDim], dx[kRowsPerRank * kDim];
    std::vector<float> w[4];
    batch(step, all_x.data(), all_t.data());
    std::memcpy(h[0], all_x.data() + g_rank * kRowsPerRank * kDim, sizeof h[0]);
    toy.fsdp_linears->unshard(false);
    toy.fsdp[0]->unshard(false);
    for (int l = 0; l < 3; ++l) {
      if (l + 1 < 3) toy.fsdp[l + 1]->unshard(true);
      toy.fsdp[l]->wait_unshard();
      check_full_address(toy, l);
      w[l] = get(toy.root, kWeights[l], false);
      linear(h[l], w[l].data(), h[l + 1], kRowsPerRank);
      toy.fsdp[l]->reshard();
    }
    CHECK_OK(dp_ddp_pre_forward(toy.ddp));
    w[3] = get(toy.root, kWeights[3], false);
    linear(h[3], w[3].data(), h[4], kRowsPerRank);
    for (int k = 0; k < kRowsPerRank * kDim; ++k) {
      dy[k] = (h[4][k] - all_t[g_rank * kRowsPerRank * kDim + k]) / kRowsPerRank;
    }
    for (int l = 3; l >= 0; --l) {
      double g[kDim * kDim] = {0};
      if (l < 3) {
        if (l == 2) toy.fsdp[2]->unshard(false);
        if (l > 0) toy.fsdp[l - 1]->unshard(true);
        toy.fsdp[l]->wait_unshard();
        check_full_address(toy, l);
        w[l] = get(toy.root, kWeights[l], false);
      }
      backward(dy, h[l], w[l].data(), g, dx, kRowsPerRank);
      add_grad(toy.root, kWeights[l], g);
      if (l == 3) {
        CHECK_OK(dp_ddp_mark_grad_ready(toy.ddp, kWeights[3]));
      } else {
        toy.fsdp[l]->post_backward();
      }
      std::memcpy(dy, dx, sizeof dy);
    }
    toy.fsdp_linears->post_backward();
    for (int l = 0; l < 3; ++l) toy.fsdp[l]->finish_backward();
    toy.fsdp_linears->finish_backward();
    CHECK_OK(dp_ddp_finish_backward(toy.ddp));
    for (int l = 0; l < 3; ++l) {
      const Tensor shard = toy.fsdp[l]->shard(0), grad = toy.fsdp[l]->shard_grad(0);
      auto* v = static_cast<float*>(shard.data());
      const auto* g = static_cast<const float*>(grad.data());
      for (int64_t k = 0; k < shard.numel(); ++k) v[k] -= static_cast<float>(kLr) * g[k];
    }
    std::vector<float> p = get(toy.root, kWeights[3], false), g = get(toy.root, kWeights[3], true);
    for (size_t k = 0; k < p.size() && k < g.size(); ++k) p[k] -= static_cast<float>(kLr) * g[k];
    dp_tensor* t = nullptr;
    CHECK_OK(dp_module_get_parameter(toy.root, kWeights[3], &t));
    CHECK_OK(dp_tensor_copy_from_host(t, p.data(), p.size() * sizeof(float)));
    dp_tensor_destroy(t);
    CHECK_OK(dp_module_zero_grad(toy.root));
  });
}

Weights weights_of(Toy& toy) {
  Weights out(4);
  checked("reading the weights", [&] {
    for (int l = 0; l < 4; ++l) {
      if (l < 3) toy.fsdp[l]->unshard(false);
      out[l] = get(toy.root, kWeights[l], false);
      if (l < 3) toy.fsdp[l]->reshard();
    }
  });
  return out;
}

void expect_weights(const Weights& got, const Weights& expected, const char* what) {
  for (int l = 0; l < 4; ++l) {
    CHECK(got[l].size() == expected[l].size(), "%s: %s has %zu values", what, kWeights[l], got[l].size());
    for (size_t k = 0; k < got[l].size() && k < expected[l].size(); ++k) {
      CHECK(fabsf(got[l][k] - expected[l][k]) <= 2e-5f * (1.0f + fabsf(expected[l][k])),
            "%s: %s[%zu] is %.9g, expected %.9g", what, kWeights[l], k, got[l][k], expected[l][k]);
    }
  }
}

// This rank's 2x2 mesh: shard group = its host's ranks, replicate group =
// the same rank of each host.
Groups mesh_2x2(dp_process_group* world) {
  const int host = g_rank / 2, local = g_rank % 2;
  Groups g;
  g.world = world;
  g.shard = make_group("shard-h" + std::to_string(host), local, 2);
  g.replicate = make_group("replicate-" + std::to_string(local), host, 2);
  return g;
}

void destroy_mesh(Groups& g) {
  dp_process_group_destroy(g.shard);
  dp_process_group_destroy(g.replicate);
  g.shard = g.replicate = nullptr;
}

void parity(dp_process_group* world) {
  Groups mesh = mesh_2x2(world);
  // On one host the shard group is shared memory; across hosts the replicas are not.
  CHECK(strcmp(dp_process_group_backend(mesh.shard), "shm") == 0, "the shard group runs over %s",
        dp_process_group_backend(mesh.shard));
  CHECK(strcmp(dp_process_group_backend(mesh.replicate), "shm") != 0, "the replicate group runs over shm");
  Toy hsdp, flat;
  toy_create(hsdp, 0.05f * static_cast<float>(g_rank), mesh);  // init_sync: rank 0's values
  CHECK(hsdp.fsdp[0]->shard(0).shape()[0] == (g_rank % 2 == 0 ? 2 : 1), "rank %d keeps %lld rows", g_rank,
        static_cast<long long>(hsdp.fsdp[0]->shard(0).shape()[0]));
  toy_create(flat, 0.05f * static_cast<float>(g_rank), Groups{world, world, nullptr});
  // And with the full parameters as views of the shards in the shard group's shared memory.
  Toy views;
  ShardingOptions as_views;
  as_views.full_params_as_views = true;
  toy_create(views, 0.05f * static_cast<float>(g_rank), mesh, as_views);
  for (int s = 0; s < kSteps; ++s) {
    train_step(hsdp, s);
    train_step(flat, s);
    train_step(views, s);
  }
  const Weights expected = reference(kSteps), hsdp_weights = weights_of(hsdp);
  expect_weights(hsdp_weights, expected, "2x2 HSDP against one process");
  expect_weights(hsdp_weights, weights_of(flat), "2x2 HSDP against fully_shard over 4 ranks");
  expect_weights(weights_of(views), expected, "2x2 HSDP with views against one process");
  toy_destroy(views);
  toy_destroy(flat);
  toy_destroy(hsdp);
  destroy_mesh(mesh);
}

// The C ABI's HSDP: dp_fsdp_create_on_mesh over dp_device_mesh_create_by_host
// (2 hosts of 2: shards inside a host, replicas across) trains like one
// process, and so does a 1-D mesh of every rank (plain fully_shard); the
// dp_fsdp hold the mesh's groups after its destroy; a 3-D mesh is refused
// naming it on every rank.
void mesh_parity(dp_process_group* world) {
  dp_device_mesh *by_host = nullptr, *flat = nullptr, *cube = nullptr;
  CHECK_OK(dp_device_mesh_create_by_host(&by_host, world));
  const int32_t all = kWorld, cube_shape[3] = {1, 2, 2};
  CHECK_OK(dp_device_mesh_create(&flat, world, &all, 1, nullptr));
  CHECK_OK(dp_device_mesh_create(&cube, world, cube_shape, 3, nullptr));
  if (by_host == nullptr || flat == nullptr || cube == nullptr) exit(3);
  int32_t shape[2] = {0, 0};
  CHECK_OK(dp_device_mesh_shape(by_host, shape, 2));
  CHECK(shape[0] == 2 && shape[1] == 2, "the mesh by host is %d x %d", shape[0], shape[1]);
  const Groups none{world, nullptr, nullptr};
  Toy hsdp, plain;
  toy_create(hsdp, 0.05f * static_cast<float>(g_rank), none, {}, "weight", by_host);
  toy_create(plain, 0.05f * static_cast<float>(g_rank), none, {}, "weight", flat);
  dp_device_mesh_destroy(by_host);
  dp_device_mesh_destroy(flat);
  checked("the layouts", [&] {
    CHECK(hsdp.fsdp[0]->replicate_group() != nullptr && plain.fsdp[0]->replicate_group() == nullptr,
          "only the 2-D mesh replicates");
    CHECK(strcmp(hsdp.fsdp[0]->group()->backend_name(), "shm") == 0, "the shard group runs over %s",
          hsdp.fsdp[0]->group()->backend_name());
    CHECK(hsdp.fsdp[0]->shard(0).shape()[0] == (g_rank % 2 == 0 ? 2 : 1), "rank %d keeps %lld rows", g_rank,
          static_cast<long long>(hsdp.fsdp[0]->shard(0).shape()[0]));
    CHECK(plain.fsdp[0]->group()->size() == kWorld, "the 1-D mesh shards over %d ranks",
          plain.fsdp[0]->group()->size());
  });
  for (int s = 0; s < kSteps; ++s) {
    train_step(hsdp, s);
    train_step(plain, s);
  }
  const Weights expected = reference(kSteps);
  expect_weights(weights_of(hsdp), expected, "dp_fsdp_create_on_mesh by host against one process");
  expect_weights(weights_of(plain), expected, "dp_fsdp_create_on_mesh on a 1-D mesh against one process");
  toy_destroy(plain);
  toy_destroy(hsdp);
  dp_module* m = nullptr;
  CHECK_OK(dp_module_create(&m));
  dp_fsdp* refused = nullptr;
  const dp_status st = dp_fsdp_create_on_mesh(&refused, m, cube, nullptr);
  CHECK(st == DP_EINVAL && strstr(dp_last_error(), "'mesh'") != nullptr && refused == nullptr, "a 3-D mesh: %d (%s)",
        static_cast<int>(st), dp_last_error());
  dp_module_destroy(m);
  dp_device_mesh_destroy(cube);
}

// A module of a [4, 3] weight and a 0-d scale whose full gradients are
// rank + 1 on every rank: their shard gradients are the average, 2.5.
void average(dp_process_group* world) {
  Groups mesh = mesh_2x2(world);
  for (DType reduce : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    checked("an averaging", [&] {
      auto module = std::make_shared<dparallel::Module>();
      module->register_parameter("weight", Tensor::zeros(DType::kFloat32, {4, kDim}, kCpu), true);
      module->register_parameter("scale", Tensor::zeros(DType::kFloat32, {}, kCpu), true);
      ShardingOptions o;
      o.reduce_dtype = reduce;
      Sharding f = FullyShard::create(module, group_of(mesh.shard), group_of(mesh.replicate), o);
      for (int iteration = 1; iteration <= 2; ++iteration) {
        f->unshard(false);
        for (const char* name : {"weight", "scale"}) {
          const Tensor g = module->get_parameter(name)->grad();
          auto* v = static_cast<float*>(g.data());
          for (int64_t k = 0; k < g.numel(); ++k) v[k] = static_cast<float>(g_rank + 1);
        }
        f->post_backward();
        f->finish_backward();
        // The shard gradients add up across iterations: 2.5 each time.
        for (size_t i = 0; i < f->num_parameters(); ++i) {
          const Tensor g = f->shard_grad(i);
          const auto* v = static_cast<const float*>(g.data());
          for (int64_t k = 0; k < g.numel(); ++k) {
            CHECK(v[k] == 2.5f * static_cast<float>(iteration),
                  "reduce dtype %s, iteration %d: %s's gradient[%lld] is %g", dparallel::dtype_name(reduce), iteration,
                  f->parameter_name(i).c_str(), static_cast<long long>(k), v[k]);
          }
        }
      }
      f->close();
    });
  }
  destroy_mesh(mesh);
}

// The files the sharded save left in `folder`.
std::vector<std::string> files_in(const std::string& folder) {
  std::vector<std::string> names;
  if (DIR* d = opendir(folder.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    }
    closedir(d);
  }
  return names;
}

// A fresh toy on `groups` (skewed values), `load`ed, trained from step 2 to the end.
void continue_after_load(dp_process_group* world, const Groups& groups, const char* what,
                         const std::function<void(Toy&)>& load) {
  Toy toy;
  toy_create(toy, 1.0f + static_cast<float>(g_rank), groups);
  checked(what, [&] { load(toy); });
  expect_weights(weights_of(toy), reference(2), what);
  for (int s = 2; s < kSteps; ++s) train_step(toy, s);
  expect_weights(weights_of(toy), reference(kSteps), what);
  toy_destroy(toy);
  CHECK_OK(dp_pg_barrier(world));
}

void save_load(dp_process_group* world) {
  using namespace dparallel::fsdp;
  const std::string folder = std::string(g_dir) + "/sharded", full = std::string(g_dir) + "/full.safetensors";
  Groups mesh = mesh_2x2(world);
  {
    Toy toy;
    toy_create(toy, 0.0f, mesh);
    for (int s = 0; s < 2; ++s) train_step(toy, s);
    checked("the sharded save", [&] { save_sharded_state_dict(*toy.root->module, *toy.groups.shard->group, folder); });
    checked("the full save", [&] { save_full_state_dict(*toy.root->module, *toy.groups.shard->group, full); });
    toy_destroy(toy);
  }
  CHECK_OK(dp_pg_barrier(world));
  // One shard group wrote: its 2 files and the manifest.
  int shard_files = 0;
  const std::vector<std::string> names = files_in(folder);
  for (const std::string& name : names) {
    CHECK(name == "manifest.json" || name.find("-of-00002-") != std::string::npos, "the save wrote '%s'", name.c_str());
    shard_files += name.find("-of-00002-") != std::string::npos ? 1 : 0;
  }
  CHECK(shard_files == 2 && names.size() == 3, "the save wrote %zu files, %d of them shards", names.size(),
        shard_files);
  auto load_sharded = [&](Toy& toy) { load_sharded_state_dict(*toy.root->module, folder); };
  continue_after_load(world, Groups{world, world, nullptr}, "the 2x2 sharded save loaded under 1x4", load_sharded);
  {
    // The replicas' lane is the dp_ddp's: their jobs pair by identity there.
    dp_process_group* alone = make_group("alone-" + std::to_string(g_rank), 0, 1);
    continue_after_load(world, Groups{world, alone, world}, "the 2x2 sharded save loaded under 4x1", load_sharded);
    dp_process_group_destroy(alone);
  }
  continue_after_load(world, mesh, "the full save loaded under 2x2",
                      [&](Toy& toy) { load_full_state_dict(*toy.root->module, full, true); });
  destroy_mesh(mesh);
  // The folder goes (the test reads and removes plain files only).
  if (g_rank == 0) {
    for (const std::string& name : files_in(folder)) remove((folder + "/" + name).c_str());
    rmdir(folder.c_str());
  }
}

// Runs `fn`, which must fail with kInvalidArgument naming `needle`; returns whether it failed.
bool expect_refused(const char* what, const std::string& needle, const std::function<void()>& fn) {
  try {
    fn();
    return false;
  } catch (const dparallel::Error& e) {
    printf("rank %d: %s failed: %s\n", g_rank, what, e.what());
    CHECK(e.code() == dparallel::StatusCode::kInvalidArgument, "%s failed with %d: %s", what,
          static_cast<int>(e.code()), e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos, "%s's error does not name '%s': %s", what,
          needle.c_str(), e.what());
    return true;
  }
}

// Rank 3's full gradient has another shape: its post_backward is refused,
// which fails its shard group's reduce-scatter (rank 2's), whose failure
// stands in for the all-reduces across the replicas (ranks 1's and 0's):
// every rank fails naming the parameter, none hangs, and the next
// iteration reduces as usual.
void refused_post(dp_process_group* world) {
  Groups mesh = mesh_2x2(world);
  checked("a refused post_backward", [&] {
    auto module = std::make_shared<dparallel::Module>();
    module->register_parameter("weight", Tensor::zeros(DType::kFloat32, {4, kDim}, kCpu), true);
    Sharding f = FullyShard::create(module, group_of(mesh.shard), group_of(mesh.replicate), {});
    auto set_grads = [&](bool refused) {
      auto parameter = module->get_parameter("weight");
      if (refused) {
        parameter->set_grad(Tensor::zeros(DType::kFloat32, {2, kDim}, kCpu));
        return;
      }
      const Tensor g = parameter->grad();
      auto* v = static_cast<float*>(g.data());
      for (int64_t k = 0; k < g.numel(); ++k) v[k] = static_cast<float>(g_rank + 1);
    };
    f->unshard(false);
    set_grads(g_rank == 3);
    bool failed = expect_refused("the post_backward", "'weight'", [&] {
      f->post_backward();
      f->finish_backward();
    });
    CHECK(failed, "the first iteration's post_backward passed");
    f->unshard(false);
    set_grads(false);
    f->post_backward();
    f->finish_backward();
    const Tensor g = f->shard_grad(0);
    const auto* v = static_cast<const float*>(g.data());
    for (int64_t k = 0; k < g.numel(); ++k)
      CHECK(v[k] == 2.5f, "gradient[%lld] is %g", static_cast<long long>(k), v[k]);
    f->close();
  });
  destroy_mesh(mesh);
}

// A sharded save refused on rank 3 (no writer: its replica, rank 1,
// writes) fails on every rank naming the refusal, and the folder's last
// save stays whole and loads.
void save_refused(dp_process_group* world) {
  using namespace dparallel::fsdp;
  const std::string folder = std::string(g_dir) + "/sharded";
  const std::string refusal = "argument 'folder' is refused by this rank";
  Groups mesh = mesh_2x2(world);
  Toy toy;
  toy_create(toy, 0.0f, mesh);
  for (int s = 0; s < 2; ++s) train_step(toy, s);
  checked("the first save", [&] { save_sharded_state_dict(*toy.root->module, *mesh.shard->group, folder); });
  const std::vector<std::string> first = files_in(folder);
  CHECK(first.size() == 3, "the first save left %zu files", first.size());
  train_step(toy, 2);
  const bool failed = expect_refused("the second save", refusal, [&] {
    save_sharded_state_dict(*toy.root->module, *mesh.shard->group, folder, g_rank == 3 ? refusal : "");
  });
  CHECK(failed, "the second save passed");
  toy_destroy(toy);
  CHECK_OK(dp_pg_barrier(world));
  std::vector<std::string> now = files_in(folder);
  CHECK(now.size() == first.size(), "the folder holds %zu files, not %zu", now.size(), first.size());
  continue_after_load(world, mesh, "the first save loaded under 2x2",
                      [&](Toy& t) { load_sharded_state_dict(*t.root->module, folder); });
  destroy_mesh(mesh);
  if (g_rank == 0) {
    for (const std::string& name : files_in(folder)) remove((folder + "/" + name).c_str());
    rmdir(folder.c_str());
  }
}

// Every rank's create fails (kInvalidArgument naming `needle`), and every
// group works on.
void expect_create_fails(dp_process_group* world, const Groups& groups, const char* layer0_name,
                         const std::string& needle) {
  Toy toy;
  try {
    toy_create(toy, 0.0f, groups, {}, layer0_name);
    CHECK(0, "the create passed");
  } catch (const dparallel::Error& e) {
    printf("rank %d: the create failed: %s\n", g_rank, e.what());
    CHECK(e.code() == dparallel::StatusCode::kInvalidArgument, "the create failed with %d: %s",
          static_cast<int>(e.code()), e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos, "the create's error does not name '%s': %s",
          needle.c_str(), e.what());
  }
  for (dp_process_group* pg : {groups.shard, groups.replicate, world}) CHECK_OK(dp_pg_barrier(pg));
  toy_destroy(toy);  // what the failed create left: the modules
}

void bad_names(dp_process_group* world) {
  Groups mesh = mesh_2x2(world);
  expect_create_fails(world, mesh, g_rank < 2 ? "weight" : "weight2", "'weight2'");
  destroy_mesh(mesh);
}

void bad_shards(dp_process_group* world) {
  const int host = g_rank / 2, local = g_rank % 2;
  Groups g;
  g.world = world;
  g.shard = host == 0 ? make_group("shard-h0", local, 2) : make_group("alone-" + std::to_string(g_rank), 0, 1);
  g.replicate = make_group("replicate-" + std::to_string(local), host, 2);
  expect_create_fails(world, g, "weight", "of a shard group of 1");
  destroy_mesh(g);
}

}  // namespace

int main(int argc, char** argv) {
  struct Scenario {
    const char* name;
    void (*run)(dp_process_group*);
  };
  const Scenario scenarios[] = {{"parity", parity},
                                {"average", average},
                                {"save_load", save_load},
                                {"refused_post", refused_post},
                                {"save_refused", save_refused},
                                {"bad_names", bad_names},
                                {"bad_shards", bad_shards},
                                {"mesh_parity", mesh_parity}};
  const Scenario* scenario = nullptr;
  for (const Scenario& s : scenarios) {
    if (argc >= 2 && strcmp(argv[1], s.name) == 0) scenario = &s;
  }
  const char *rank_text = getenv("RANK"), *world_text = getenv("WORLD_SIZE"), *dir = getenv("DP_TEST_DIR");
  if (scenario == nullptr || rank_text == nullptr || world_text == nullptr || atoi(world_text) != kWorld) {
    fprintf(stderr,
            "usage: RANK=r WORLD_SIZE=4 hsdp_worker "
            "parity|average|save_load|refused_post|save_refused|bad_names|bad_shards|mesh_parity\n");
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  g_rank = atoi(rank_text);
  g_world = kWorld;
  if (dir != nullptr) g_dir = dir;
  dp_process_group* world = make_group("world", g_rank, kWorld);
  scenario->run(world);
  dp_process_group_destroy(world);
  if (g_failures != 0) {
    fprintf(stderr, "rank %d: %s failed (%d checks)\n", g_rank, scenario->name, g_failures);
    return 1;
  }
  printf("rank %d: %s passed\n", g_rank, scenario->name);
  return 0;
}
