// One rank of a subgroup or device-mesh test (split_test.cpp starts world-size
// copies with the launcher's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a
// test pretends several hosts with DP_HOST_ID). Prints "rank <r>: <scenario>
// passed" when every check held; failures are printed.
//   split           colors and reversing keys, a negative color, a split of a split
//                   used after its parent is gone; sums prove who joined
//   hosts           4 ranks on 2 hosts: local rank/size, hosts, the by-host mesh
//   uneven_hosts    3 ranks on one host, 1 on another: the by-host mesh is refused
//   mesh            2x2 and 2x1x2 meshes: shapes, coordinates, names, each dimension's group
//   bad_mesh        bad shapes and names (on every rank, then on rank 0 alone,
//                   then differing meshes): DP_EINVAL naming them, the group still usable
//   split_vs_all_reduce  rank 0 splits while rank 1 all-reduces: both fail, neither hangs
//   shrink_after_kill    4 ranks; rank 2 dies; the others' all_reduce fails, they
//                        shrink to 3 and all-reduce there (backend: DP_TEST_BACKEND)
//   shrink_none_lost     every rank shrinks with none lost: a new group of all
//   shrink_late_rank     rank 2 lives but calls shrink only after the others
//                        decided without it (at the timeout): it is left out
//   shrink_alone         rank 2 calls shrink while the others never do: it forms
//                        no group, and the group is untouched
//   shrink_store_lost    rank 0, which holds the store, dies: shrink fails naming the store
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dparallel/dparallel.h"
#include "worker_util.h"

namespace {

using namespace dptest_worker;  // NOLINT(google-build-using-namespace): the test helpers

bool mentions(const char* text, const char* part) { return text != nullptr && std::strstr(text, part) != nullptr; }

// The all_reduce (sum) of `value` over `pg`, or -1 after reporting a failure.
double sum_of(dp_process_group* pg, double value) {
  int64_t shape[1] = {1};
  dp_tensor* t = nullptr;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  double result = -1;
  if (dp_tensor_create(&t, DP_FLOAT64, 1, shape, cpu) == DP_OK &&
      dp_tensor_copy_from_host(t, &value, sizeof value) == DP_OK && dp_pg_all_reduce(pg, t, DP_SUM) == DP_OK &&
      dp_tensor_copy_to_host(t, &result, sizeof result) == DP_OK) {
    dp_tensor_destroy(t);
    return result;
  }
  CHECK(false, "all_reduce failed: %s", dp_last_error());
  dp_tensor_destroy(t);
  return -1;
}

// Every rank's `value` over `pg`, in its ranks' order.
std::vector<int64_t> gather_of(dp_process_group* pg, int64_t value) {
  const int n = dp_process_group_size(pg);
  int64_t shape[1] = {1};
  dp_device cpu = {DP_DEVICE_CPU, 0};
  dp_tensor* in = nullptr;
  std::vector<dp_tensor*> outs(static_cast<size_t>(n), nullptr);
  std::vector<int64_t> values(static_cast<size_t>(n), -1);
  CHECK_OK(dp_tensor_create(&in, DP_INT64, 1, shape, cpu));
  CHECK_OK(dp_tensor_copy_from_host(in, &value, sizeof value));
  for (auto& o : outs) CHECK_OK(dp_tensor_create(&o, DP_INT64, 1, shape, cpu));
  CHECK_OK(dp_pg_all_gather(pg, in, outs.data(), outs.size()));
  for (int q = 0; q < n; ++q) CHECK_OK(dp_tensor_copy_to_host(outs[q], &values[q], sizeof(int64_t)));
  for (auto* o : outs) dp_tensor_destroy(o);
  dp_tensor_destroy(in);
  return values;
}

std::string join(const std::vector<int64_t>& values) {
  std::string text;
  for (int64_t v : values) text += (text.empty() ? "" : ",") + std::to_string(v);
  return text;
}

void expect_group(dp_process_group* pg, const char* what, int rank, int size, const char* backend) {
  CHECK(pg != nullptr, "%s: no group", what);
  if (pg == nullptr) return;
  CHECK(dp_process_group_rank(pg) == rank && dp_process_group_size(pg) == size, "%s: rank %d of %d, want %d of %d",
        what, dp_process_group_rank(pg), dp_process_group_size(pg), rank, size);
  const char* name = dp_process_group_backend(pg);
  CHECK(name != nullptr && std::strcmp(name, backend) == 0, "%s: backend %s, want %s", what, name, backend);
}

void scenario_split(dp_process_group* pg, int r) {
  // Colors by parity; keys reverse the order: {2, 0} and {3, 1}.
  dp_process_group* parity = nullptr;
  CHECK_OK(dp_process_group_split(pg, r % 2, -r, nullptr, &parity));
  expect_group(parity, "parity", r < 2 ? 1 : 0, 2, "shm");
  if (parity != nullptr) {
    const double sum = sum_of(parity, 1 << r);
    CHECK(sum == (r % 2 == 0 ? 5 : 10), "parity group's sum of 1<<rank is %g", sum);
    const std::string order = join(gather_of(parity, r));
    CHECK(order == (r % 2 == 0 ? "2,0" : "3,1"), "parity group's ranks in pg: %s", order.c_str());
  }
  // Rank 3 joins none; the others form one group, options given.
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.backend = DP_BACKEND_GLOO;
  opts.timeout_ms = 30000;
  dp_process_group* three = reinterpret_cast<dp_process_group*>(&opts);  // must come back NULL for rank 3
  CHECK_OK(dp_process_group_split(pg, r == 3 ? -1 : 7, 0, &opts, &three));
  if (r == 3) {
    CHECK(three == nullptr, "a negative color gave a group");
  } else {
    expect_group(three, "three", r, 3, "gloo");
    if (three != nullptr) CHECK(sum_of(three, 1 << r) == 7, "the three-rank group's sum is not 7");
  }
  // A split of a split, used after its parent is destroyed: {0, 1} and {2}.
  dp_process_group* inner = nullptr;
  if (three != nullptr) {
    CHECK_OK(dp_process_group_split(three, r / 2, r, nullptr, &inner));
    dp_process_group_destroy(three);
    expect_group(inner, "inner", r % 2, r < 2 ? 2 : 1, "shm");
    if (inner != nullptr) {
      const double sum = sum_of(inner, 1 << r);
      CHECK(sum == (r < 2 ? 3 : 4), "the split of a split's sum is %g", sum);
    }
  }
  // The parent is still in step: its collectives and the children's interleave.
  CHECK(sum_of(pg, 1 << r) == 15, "the parent's sum after its splits is not 15");
  dp_process_group_destroy(inner);
  dp_process_group_destroy(parity);
}

void scenario_hosts(dp_process_group* pg, int r) {
  // Hosts "a" (ranks 0, 1) and "b" (ranks 2, 3).
  CHECK(std::strcmp(dp_process_group_backend(pg), "shm+gloo") == 0, "pg runs %s", dp_process_group_backend(pg));
  CHECK(dp_process_group_local_rank(pg) == r % 2, "local rank %d", dp_process_group_local_rank(pg));
  CHECK(dp_process_group_local_size(pg) == 2, "local size %d", dp_process_group_local_size(pg));
  CHECK(dp_process_group_num_hosts(pg) == 2, "%d hosts", dp_process_group_num_hosts(pg));
  dp_device_mesh* mesh = nullptr;
  CHECK_OK(dp_device_mesh_create_by_host(&mesh, pg));
  if (mesh == nullptr) return;
  int32_t shape[2] = {0, 0}, coordinate[2] = {-1, -1};
  CHECK_OK(dp_device_mesh_shape(mesh, shape, 2));
  CHECK_OK(dp_device_mesh_coordinate(mesh, coordinate, 2));
  CHECK(dp_device_mesh_ndim(mesh) == 2 && shape[0] == 2 && shape[1] == 2, "shape %dx%d", shape[0], shape[1]);
  CHECK(coordinate[0] == r / 2 && coordinate[1] == r % 2, "coordinate (%d, %d)", coordinate[0], coordinate[1]);
  dp_process_group* local = nullptr;
  dp_process_group* across = nullptr;
  CHECK_OK(dp_device_mesh_group(mesh, "local", &local));
  CHECK_OK(dp_device_mesh_group(mesh, "host", &across));
  expect_group(local, "local", r % 2, 2, "shm");
  expect_group(across, "host", r / 2, 2, "gloo");
  if (local != nullptr && across != nullptr) {
    CHECK(sum_of(local, 1 << r) == (r < 2 ? 3 : 12), "the local group's sum is wrong");
    CHECK(sum_of(across, 1 << r) == (r % 2 == 0 ? 5 : 10), "the host group's sum is wrong");
    CHECK(dp_process_group_num_hosts(local) == 1 && dp_process_group_local_size(local) == 2,
          "the local group spans %d hosts", dp_process_group_num_hosts(local));
    CHECK(dp_process_group_num_hosts(across) == 2 && dp_process_group_local_size(across) == 1 &&
              dp_process_group_local_rank(across) == 0,
          "the host group spans %d hosts, %d ranks here", dp_process_group_num_hosts(across),
          dp_process_group_local_size(across));
  }
  dp_device_mesh_destroy(mesh);
}

void scenario_uneven_hosts(dp_process_group* pg, int r) {
  CHECK(dp_process_group_num_hosts(pg) == 2, "%d hosts", dp_process_group_num_hosts(pg));
  CHECK(dp_process_group_local_size(pg) == (r < 3 ? 3 : 1), "local size %d", dp_process_group_local_size(pg));
  CHECK(dp_process_group_local_rank(pg) == (r < 3 ? r : 0), "local rank %d", dp_process_group_local_rank(pg));
  dp_device_mesh* mesh = nullptr;
  dp_status status = dp_device_mesh_create_by_host(&mesh, pg);
  CHECK(status == DP_EINVAL && mesh == nullptr, "status %d", status);
  CHECK(mentions(dp_last_error(), "host 0: 3, host 1: 1"), "message: %s", dp_last_error());
  CHECK(sum_of(pg, 1 << r) == 15, "the group is not usable after the refusal");
}

void scenario_mesh(dp_process_group* pg, int r) {
  const int32_t square[2] = {2, 2};
  const char* const names[2] = {"dp", "tp"};
  dp_device_mesh* mesh = nullptr;
  CHECK_OK(dp_device_mesh_create(&mesh, pg, square, 2, names));
  if (mesh != nullptr) {
    int32_t coordinate[2] = {-1, -1};
    CHECK_OK(dp_device_mesh_coordinate(mesh, coordinate, 2));
    CHECK(coordinate[0] == r / 2 && coordinate[1] == r % 2, "coordinate (%d, %d)", coordinate[0], coordinate[1]);
    dp_process_group* dp = nullptr;
    dp_process_group* tp = nullptr;
    CHECK_OK(dp_device_mesh_group(mesh, "dp", &dp));
    CHECK_OK(dp_device_mesh_group(mesh, "tp", &tp));
    expect_group(dp, "dp", r / 2, 2, "shm");
    expect_group(tp, "tp", r % 2, 2, "shm");
    if (dp != nullptr && tp != nullptr) {
      CHECK(sum_of(dp, 1 << r) == (r % 2 == 0 ? 5 : 10), "dp's sum is wrong");
      CHECK(sum_of(tp, 1 << r) == (r < 2 ? 3 : 12), "tp's sum is wrong");
      // Borrowed: destroying it is refused and it stays usable.
      dp_process_group_destroy(dp);
      CHECK(mentions(dp_last_error(), "lent"), "destroying a mesh's group: %s", dp_last_error());
      CHECK(sum_of(dp, 1) == 2, "the mesh's group is gone after a refused destroy");
    }
    dp_process_group* none = reinterpret_cast<dp_process_group*>(mesh);
    CHECK(dp_device_mesh_group(mesh, "pp", &none) == DP_EINVAL && none == nullptr, "unknown dim found");
    CHECK(mentions(dp_last_error(), "'pp'") && mentions(dp_last_error(), "'dp', 'tp'"), "message: %s", dp_last_error());
    const char* name = nullptr;
    CHECK_OK(dp_device_mesh_dim_name(mesh, 1, &name));
    CHECK(name != nullptr && std::strcmp(name, "tp") == 0, "dim 1 is %s", name);
    CHECK(dp_device_mesh_dim_name(mesh, 2, &name) == DP_EINVAL && mentions(dp_last_error(), "'dim'"), "dim 2: %s",
          dp_last_error());
    int32_t small[1];
    CHECK(dp_device_mesh_shape(mesh, small, 1) == DP_EINVAL && mentions(dp_last_error(), "'cap'"), "cap 1: %s",
          dp_last_error());
    dp_device_mesh_destroy(mesh);
  }
  // 2x1x2, default names: the middle dimension's groups have one rank.
  const int32_t three_d[3] = {2, 1, 2};
  mesh = nullptr;
  CHECK_OK(dp_device_mesh_create(&mesh, pg, three_d, 3, nullptr));
  if (mesh == nullptr) return;
  CHECK(dp_device_mesh_ndim(mesh) == 3, "ndim %zu", dp_device_mesh_ndim(mesh));
  int32_t coordinate[3] = {-1, -1, -1};
  CHECK_OK(dp_device_mesh_coordinate(mesh, coordinate, 3));
  CHECK(coordinate[0] == r / 2 && coordinate[1] == 0 && coordinate[2] == r % 2, "coordinate (%d, %d, %d)",
        coordinate[0], coordinate[1], coordinate[2]);
  dp_process_group* groups[3] = {nullptr, nullptr, nullptr};
  for (int d = 0; d < 3; ++d) CHECK_OK(dp_device_mesh_group(mesh, ("dim" + std::to_string(d)).c_str(), &groups[d]));
  expect_group(groups[0], "dim0", r / 2, 2, "shm");
  expect_group(groups[1], "dim1", 0, 1, "shm");
  expect_group(groups[2], "dim2", r % 2, 2, "shm");
  if (groups[0] != nullptr && groups[1] != nullptr && groups[2] != nullptr) {
    CHECK(sum_of(groups[0], 1 << r) == (r % 2 == 0 ? 5 : 10), "dim0's sum is wrong");
    CHECK(sum_of(groups[1], 1 << r) == (1 << r), "dim1's sum is wrong");
    CHECK(sum_of(groups[2], 1 << r) == (r < 2 ? 3 : 12), "dim2's sum is wrong");
  }
  dp_device_mesh_destroy(mesh);
}

// A mesh create every rank makes alike must fail with DP_EINVAL mentioning `parts`.
void expect_refused(dp_status status, dp_device_mesh* mesh, const char* what, const std::vector<const char*>& parts) {
  CHECK(status == DP_EINVAL && mesh == nullptr, "%s: status %d", what, status);
  for (const char* part : parts) CHECK(mentions(dp_last_error(), part), "%s: message: %s", what, dp_last_error());
}

void scenario_bad_mesh(dp_process_group* pg, int r) {
  dp_device_mesh* mesh = nullptr;
  const int32_t three[1] = {3};
  expect_refused(dp_device_mesh_create(&mesh, pg, three, 1, nullptr), mesh, "shape 3", {"'shape'", "3", "4 ranks"});
  const int32_t zero[2] = {0, 4};
  expect_refused(dp_device_mesh_create(&mesh, pg, zero, 2, nullptr), mesh, "shape 0x4", {"shape[0] is 0"});
  const int32_t negative[2] = {-2, -2};
  expect_refused(dp_device_mesh_create(&mesh, pg, negative, 2, nullptr), mesh, "shape -2x-2", {"shape[0] is -2"});
  const int32_t huge[3] = {65536, 65536, 65536};
  expect_refused(dp_device_mesh_create(&mesh, pg, huge, 3, nullptr), mesh, "shape 2^48", {"'shape'", "more than 4"});
  const int32_t square[2] = {2, 2};
  const char* const same[2] = {"x", "x"};
  expect_refused(dp_device_mesh_create(&mesh, pg, square, 2, same), mesh, "names x, x", {"'dim_names'", "repeats"});
  const char* const empty[2] = {"x", ""};
  expect_refused(dp_device_mesh_create(&mesh, pg, square, 2, empty), mesh, "names x, ''", {"dim_names[1] is empty"});
  expect_refused(dp_device_mesh_create(nullptr, pg, square, 2, nullptr), mesh, "NULL out", {"'out'"});
  expect_refused(dp_device_mesh_create(&mesh, pg, nullptr, 2, nullptr), mesh, "NULL shape", {"'shape'"});
  expect_refused(dp_device_mesh_create(&mesh, pg, square, 0, nullptr), mesh, "ndim 0", {"'ndim'"});
  // Rank 0 alone passes a bad shape: the others fail naming it.
  dp_status status = dp_device_mesh_create(&mesh, pg, r == 0 ? three : square, r == 0 ? 1 : 2, nullptr);
  expect_refused(status, mesh, "rank 0's shape 3", {"rank 0 refused", "'shape'"});
  // Valid but different meshes: every rank fails rather than wait.
  const int32_t row[1] = {4};
  status = dp_device_mesh_create(&mesh, pg, r == 1 ? row : square, r == 1 ? 1 : 2, nullptr);
  expect_refused(status, mesh, "differing meshes", {"rank(s) 1", "different mesh"});
  dp_process_group* none = nullptr;
  CHECK(dp_process_group_split(pg, 0, 0, nullptr, nullptr) == DP_EINVAL && mentions(dp_last_error(), "'out'"),
        "split with NULL out: %s", dp_last_error());
  dp_process_group_options bad = DP_PROCESS_GROUP_OPTIONS_INIT;
  bad.timeout_ms = 0;
  CHECK(dp_process_group_split(pg, 0, 0, &bad, &none) == DP_EINVAL && none == nullptr &&
            mentions(dp_last_error(), "timeout_ms"),
        "split with timeout 0: %s", dp_last_error());
  CHECK(sum_of(pg, 1 << r) == 15, "the group is not usable after the refusals");
}

// The status of an all_reduce of one float over `pg`.
dp_status all_reduce_of_one(dp_process_group* pg) {
  float value = 1;
  int64_t shape[1] = {1};
  dp_tensor* t = nullptr;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, shape, cpu));
  CHECK_OK(dp_tensor_copy_from_host(t, &value, sizeof value));
  const dp_status status = dp_pg_all_reduce(pg, t, DP_SUM);
  dp_tensor_destroy(t);
  return status;
}

void scenario_split_vs_all_reduce(dp_process_group* pg, int r) {
  dp_status status;
  if (r == 0) {
    dp_process_group* child = nullptr;
    status = dp_process_group_split(pg, 0, 0, nullptr, &child);
    CHECK(child == nullptr, "a split against an all_reduce gave a group");
  } else {
    status = all_reduce_of_one(pg);
  }
  CHECK(status != DP_OK, "the mismatched call passed");
  std::printf("rank %d: mismatched call status %d: %s\n", r, static_cast<int>(status), dp_last_error());
}

std::string lost_of(dp_process_group* pg) {
  int32_t ranks[8] = {0};
  const int32_t n = dp_process_group_lost_ranks(pg, ranks, 8);
  std::vector<int64_t> values(ranks, ranks + std::max(0, std::min(n, 8)));
  return n < 0 ? "error" : join(values);
}

void scenario_shrink_after_kill(dp_process_group* pg, int r) {
  const std::string backend = dp_process_group_backend(pg);
  CHECK(sum_of(pg, 1 << r) == 15, "the sum before the failure is not 15");
  if (r == 2) ::raise(SIGKILL);
  CHECK(all_reduce_of_one(pg) != DP_OK, "an all_reduce with a dead rank passed");
  CHECK(dp_process_group_lost_ranks(pg, nullptr, 0) == 0, "lost ranks before any shrink");
  dp_process_group* shrunk = nullptr;
  CHECK_OK(dp_process_group_shrink(pg, &shrunk));
  CHECK(mentions(dp_last_error(), "rank(s) 2 lost"), "shrink's message: %s", dp_last_error());
  expect_group(shrunk, "shrunk", r < 2 ? r : 2, 3, backend.c_str());
  if (shrunk == nullptr) return;
  CHECK(lost_of(pg) == "2" && lost_of(shrunk) == "2", "lost ranks: %s and %s", lost_of(pg).c_str(),
        lost_of(shrunk).c_str());
  CHECK(sum_of(shrunk, 1 << r) == 11, "the survivors' sum is not 11");
  const std::string order = join(gather_of(shrunk, r));
  CHECK(order == "0,1,3", "the survivors in the new group's order: %s", order.c_str());
  dp_process_group_destroy(shrunk);
}

void scenario_shrink_none_lost(dp_process_group* pg, int r) {
  dp_process_group* shrunk = nullptr;
  CHECK_OK(dp_process_group_shrink(pg, &shrunk));
  CHECK(mentions(dp_last_error(), "no rank was lost"), "shrink's message: %s", dp_last_error());
  expect_group(shrunk, "shrunk", r, 2, dp_process_group_backend(pg));
  if (shrunk == nullptr) return;
  CHECK(lost_of(shrunk) == "", "lost ranks: %s", lost_of(shrunk).c_str());
  CHECK(sum_of(shrunk, 1 << r) == 3, "the new group's sum is not 3");
  CHECK(sum_of(pg, 1 << r) == 3, "the group shrunk from is not usable any more");
  dp_process_group_destroy(shrunk);
}

void scenario_shrink_late_rank(dp_process_group* pg, int r) {
  const std::string decided = std::string(std::getenv("DP_TEST_DIR")) + "/decided";
  dp_process_group* shrunk = nullptr;
  if (r == 2) {
    // Alive, but calls shrink only once the others have their group.
    for (int i = 0; i < 6000 && ::access(decided.c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    CHECK(
        dp_process_group_shrink(pg, &shrunk) == DP_ESTATE && shrunk == nullptr && mentions(dp_last_error(), "left out"),
        "the late rank's shrink: %s", dp_last_error());
    CHECK(lost_of(pg) == "2", "the late rank's lost ranks: %s", lost_of(pg).c_str());
    std::fclose(std::fopen((decided + ".read").c_str(), "w"));
    return;
  }
  CHECK_OK(dp_process_group_shrink(pg, &shrunk));
  expect_group(shrunk, "shrunk", r, 2, dp_process_group_backend(pg));
  if (shrunk == nullptr) return;
  CHECK(sum_of(shrunk, 1 << r) == 3, "the survivors' sum is not 3");
  dp_process_group_destroy(shrunk);
  if (r != 0) return;
  // Rank 0 holds the store the late rank reads the decision from.
  std::fclose(std::fopen(decided.c_str(), "w"));
  for (int i = 0; i < 6000 && ::access((decided + ".read").c_str(), F_OK) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void scenario_shrink_alone(dp_process_group* pg, int r) {
  const std::string done = std::string(std::getenv("DP_TEST_DIR")) + "/alone";
  if (r == 2) {
    dp_process_group* shrunk = reinterpret_cast<dp_process_group*>(pg);
    CHECK(dp_process_group_shrink(pg, &shrunk) == DP_ETIMEOUT && shrunk == nullptr &&
              mentions(dp_last_error(), "forms no group"),
          "a shrink alone: %s", dp_last_error());
    std::fclose(std::fopen(done.c_str(), "w"));
  }
  // The others live on, never calling shrink; rank 0 holds the store.
  for (int i = 0; i < 6000 && ::access(done.c_str(), F_OK) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The group the lone rank tried to shrink is untouched.
  CHECK(sum_of(pg, 1 << r) == 7, "the group's sum after the lone shrink is not 7");
}

void scenario_shrink_store_lost(dp_process_group* pg, int r) {
  CHECK(sum_of(pg, 1 << r) == 7, "the sum before the failure is not 7");
  if (r == 0) ::raise(SIGKILL);
  dp_process_group* shrunk = nullptr;
  CHECK(dp_process_group_shrink(pg, &shrunk) != DP_OK && shrunk == nullptr && mentions(dp_last_error(), "store"),
        "shrink without the store: %s", dp_last_error());
  std::printf("rank %d: shrink without the store: %s\n", r, dp_last_error());
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const char* scenario = argc >= 2 ? argv[1] : "";
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.timeout_ms = 30000;
  if (const char* ms = std::getenv("DP_TEST_TIMEOUT_MS")) opts.timeout_ms = std::atoi(ms);
  if (const char* backend = std::getenv("DP_TEST_BACKEND")) {
    opts.backend = std::strcmp(backend, "gloo") == 0 ? DP_BACKEND_GLOO : DP_BACKEND_AUTO;
  }
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    std::fprintf(stderr, "group create failed: %s\n", dp_last_error());
    return 3;
  }
  const int r = dp_process_group_rank(pg);
  g_rank = r;
  const struct {
    const char* name;
    void (*run)(dp_process_group*, int);
  } scenarios[] = {{"split", scenario_split},
                   {"hosts", scenario_hosts},
                   {"uneven_hosts", scenario_uneven_hosts},
                   {"mesh", scenario_mesh},
                   {"bad_mesh", scenario_bad_mesh},
                   {"split_vs_all_reduce", scenario_split_vs_all_reduce},
                   {"shrink_after_kill", scenario_shrink_after_kill},
                   {"shrink_none_lost", scenario_shrink_none_lost},
                   {"shrink_late_rank", scenario_shrink_late_rank},
                   {"shrink_alone", scenario_shrink_alone},
                   {"shrink_store_lost", scenario_shrink_store_lost}};
  bool known = false;
  for (const auto& s : scenarios) {
    if (std::strcmp(scenario, s.name) != 0) continue;
    s.run(pg, r);
    known = true;
  }
  if (!known) {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario);
    return 2;
  }
  dp_process_group_destroy(pg);
  if (g_failures == 0) std::printf("rank %d: %s passed\n", r, scenario);
  return g_failures == 0 ? 0 : 1;
}
