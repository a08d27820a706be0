// One rank of an MPI backend test (mpi_test.cpp starts it under mpirun, or
// as plain processes). Its rank and world size come from the MPI launcher's
// variables (Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_*), else from RANK and
// WORLD_SIZE. Prints "rank <r>: <scenario> passed" when every check held,
// failures otherwise; exits 77 with "skip: <why>" when no MPI library loads.
//   collectives   every dtype and op of all_reduce (sync and async), broadcast,
//                 all_gather, reduce_scatter, barrier; a refused call leaves
//                 the group usable
//   timeout       rank 0 all-reduces alone: DP_ETIMEOUT naming the call, no hang
//   not_one_job   ranks that are not one MPI job: DP_EUNSUPPORTED on every rank
//   host_init_funneled, host_init_multiple
//                 the host initialises MPI itself at that thread level:
//                 FUNNELED is refused naming it, MULTIPLE runs, and MPI stays
//                 initialised for the host to finalise
//   hierarchical  AUTO with DP_CROSS_HOST=mpi, the ranks on two pretend hosts
//                 (DP_HOST_ID): shared memory inside each, MPI across; the
//                 collectives as above
//   cross_host_refused  AUTO on two pretend hosts with a DP_CROSS_HOST that is
//                 refused: DP_EINVAL containing DP_TEST_EXPECT, no MPI mapped
//   no_mpi        a Gloo group all-reduces; no MPI library is mapped
//   mpi_mapped    an MPI group all-reduces; the MPI library is mapped
//   fsdp          three steps of a dp_fsdp over the MPI group (uneven shards:
//                 5 rows on 2 ranks; prefetching unshards): each unshard
//                 gathers the full parameter, each rank's shard gradient is
//                 the ranks' average of its rows
// Usage: mpi_worker <scenario> <file store path>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"
#include "worker_util.h"

namespace {

using namespace dptest_worker;  // NOLINT(google-build-using-namespace): the test helpers

int env_int(const char* first, const char* second, const char* third, int fallback) {
  for (const char* name : {first, second, third}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return std::atoi(value);
  }
  return fallback;
}

bool mentions(const char* text, const char* part) { return text != nullptr && std::strstr(text, part) != nullptr; }

// Whether this process maps a library whose file name starts with libmpi or libmpich.
bool mpi_mapped() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    size_t slash = line.rfind('/');
    if (slash != std::string::npos && line.compare(slash + 1, 6, "libmpi") == 0) return true;
  }
  return false;
}

dp_process_group* make_group(int backend, int rank, int world, const std::string& store_path, int timeout_ms) {
  dp_store* store = nullptr;
  CHECK_OK(dp_store_create_file(&store, store_path.c_str(), world));
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.backend = backend;
  opts.rank = rank;
  opts.world_size = world;
  opts.store = store;
  opts.timeout_ms = timeout_ms;
  dp_process_group* pg = nullptr;
  dp_status status = dp_process_group_create(&pg, &opts);
  dp_store_destroy(store);
  if (status == DP_EUNSUPPORTED && mentions(dp_last_error(), "no MPI library could be loaded")) {
    std::printf("skip: %s\n", dp_last_error());
    std::exit(77);
  }
  if (status != DP_OK) {
    std::fprintf(stderr, "rank %d: group creation failed (%d): %s\n", rank, status, dp_last_error());
    return nullptr;
  }
  return pg;
}

// The all_reduce of `dtype` and `op` over n elements checked against the expected reduction.
void check_all_reduce(dp_process_group* pg, int32_t dtype, int32_t op, size_t n, bool async, int r, int world) {
  dp_tensor* t = host_values(dtype, n, r, 0);
  if (async) {
    dp_work* work = nullptr;
    CHECK_OK(dp_pg_all_reduce_async(pg, t, op, &work));
    CHECK_OK(dp_work_wait(work));
    dp_work_destroy(work);
  } else {
    CHECK_OK(dp_pg_all_reduce(pg, t, op));
  }
  int wrong = 0;
  for (size_t i = 0; i < n; ++i) {
    if (load(dtype, dp_tensor_data(t), i) != expected(dtype, op, world, i)) ++wrong;
  }
  CHECK(wrong == 0, "all_reduce %s %s n=%zu%s: %d wrong elements", kDtypeNames[dtype], kOpNames[op], n,
        async ? " async" : "", wrong);
  dp_tensor_destroy(t);
}

void scenario_collectives(dp_process_group* pg, int r, int world, const char* backend) {
  const char* name = dp_process_group_backend(pg);
  CHECK(name != nullptr && std::strcmp(name, backend) == 0, "backend %s, want %s", name, backend);
  for (int32_t dtype : kDtypes) {
    for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
      if (dtype == DP_BOOL && op == DP_AVG) continue;  // no average of truth values
      check_all_reduce(pg, dtype, op, 37, false, r, world);
      check_all_reduce(pg, dtype, op, 37, true, r, world);
    }
  }
  check_all_reduce(pg, DP_FLOAT32, DP_SUM, 1 << 20, false, r, world);  // past any eager limit
  check_all_reduce(pg, DP_BFLOAT16, DP_SUM, 100000, true, r, world);

  // broadcast from the last rank.
  dp_tensor* b = host_values(DP_INT64, 1000, r, 0);
  CHECK_OK(dp_pg_broadcast(pg, b, world - 1));
  int wrong = 0;
  for (size_t i = 0; i < 1000; ++i) wrong += load(DP_INT64, dp_tensor_data(b), i) != value(DP_INT64, world - 1, i);
  CHECK(wrong == 0, "broadcast: %d wrong elements", wrong);
  dp_tensor_destroy(b);

  // all_gather into separate tensors.
  dp_tensor* in = host_values(DP_FLOAT16, 300, r, 0);
  std::vector<dp_tensor*> outs(static_cast<size_t>(world));
  for (auto& o : outs) o = host_values(DP_FLOAT16, 300, 99, 0);
  CHECK_OK(dp_pg_all_gather(pg, in, outs.data(), outs.size()));
  wrong = 0;
  for (int q = 0; q < world; ++q) {
    for (size_t i = 0; i < 300; ++i) wrong += load(DP_FLOAT16, dp_tensor_data(outs[q]), i) != value(DP_FLOAT16, q, i);
  }
  CHECK(wrong == 0, "all_gather: %d wrong elements", wrong);
  for (auto* o : outs) dp_tensor_destroy(o);
  dp_tensor_destroy(in);

  // reduce_scatter: part q of rank r holds value(r, q * n + i); this rank's result is their sum.
  for (int32_t dtype : {DP_FLOAT32, DP_FLOAT16, DP_INT64}) {
    const size_t n = 129;
    std::vector<dp_tensor*> parts(static_cast<size_t>(world));
    for (int q = 0; q < world; ++q) parts[q] = host_values(dtype, n, r, static_cast<size_t>(q) * n);
    dp_tensor* out = host_values(dtype, n, 0, 0);
    CHECK_OK(dp_pg_reduce_scatter(pg, parts.data(), parts.size(), out, DP_SUM));
    wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      wrong += load(dtype, dp_tensor_data(out), i) != expected(dtype, DP_SUM, world, static_cast<size_t>(r) * n + i);
    }
    CHECK(wrong == 0, "reduce_scatter %s: %d wrong elements", kDtypeNames[dtype], wrong);
    for (auto* p : parts) dp_tensor_destroy(p);
    dp_tensor_destroy(out);
  }
  CHECK_OK(dp_pg_barrier(pg));

  // Different sizes on rank 0: refused on every rank, the group still in step.
  dp_tensor* odd = host_values(DP_FLOAT32, r == 0 ? 3 : 4, r, 0);
  dp_status status = dp_pg_all_reduce(pg, odd, DP_SUM);
  CHECK(status == DP_EINVAL, "mismatched all_reduce gave %d: %s", status, dp_last_error());
  dp_tensor_destroy(odd);
  check_all_reduce(pg, DP_FLOAT64, DP_SUM, 10, false, r, world);
}

// `side`: a store of its own that every rank opened before the group's
// (a file store's file goes once as many handles as ranks have closed).
void scenario_timeout(dp_process_group* pg, int r, dp_store* side) {
  dp_store* store = side;
  if (r == 0) {
    dp_tensor* t = host_values(DP_FLOAT32, 8, r, 0);
    dp_status status = dp_pg_all_reduce(pg, t, DP_SUM);
    CHECK(status == DP_ETIMEOUT, "lone all_reduce gave %d: %s", status, dp_last_error());
    CHECK(mentions(dp_last_error(), "all_reduce"), "the error names no all_reduce: %s", dp_last_error());
    dp_tensor_destroy(t);
    CHECK_OK(dp_store_set(store, "test/done", "1", 1));
  } else {
    const char* keys[] = {"test/done"};
    CHECK_OK(dp_store_wait(store, keys, 1, 120000));
  }
}

// The host's own MPI_Init_thread at `level` (FUNNELED 1, MULTIPLE 3) before
// dparallel's group, and its own MPI_Finalize after.
std::vector<float> tensor_values(const dp_tensor* t) {
  std::vector<float> v(static_cast<size_t>(dp_tensor_numel(t)));
  CHECK_OK(dp_tensor_copy_to_host(t, v.data(), v.size() * sizeof(float)));
  return v;
}

// fully_shard's lane over MPI: all-gathers at unshard, reduce-scatters at
// post_backward. The full parameter starts as w[i] = i; each step every rank
// sets its full gradient to g[i] = (rank + 1) * (i + step), so a row's shard
// gradient must be the ranks' average; the host steps its shard (w -= shard
// gradient), zeroes the shard gradient, and the next unshard must gather
// what the shards hold.
void scenario_fsdp(dp_process_group* pg, int r, int world) {
  constexpr int64_t kRows = 5, kCols = 3;
  const int64_t shape[2] = {kRows, kCols};
  std::vector<float> full(kRows * kCols);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i);
  dp_module* m = nullptr;
  CHECK_OK(dp_module_create(&m));
  dp_tensor* w = nullptr;
  CHECK_OK(dp_tensor_create(&w, DP_FLOAT32, 2, shape, dp_device{DP_DEVICE_CPU, 0}));
  CHECK_OK(dp_tensor_copy_from_host(w, full.data(), full.size() * sizeof(float)));
  CHECK_OK(dp_module_register_parameter(m, "w", w, 1));
  dp_tensor_destroy(w);
  dp_fsdp* f = nullptr;
  CHECK_OK(dp_fsdp_create(&f, m, pg, nullptr));
  dp_tensor* shard = nullptr;
  CHECK_OK(dp_fsdp_shard(f, 0, &shard));
  // This rank's rows: the shard's first row in the full parameter.
  const int64_t rows = f != nullptr && shard != nullptr ? dp_tensor_numel(shard) / kCols : 0;
  const int64_t first_row = r == 0 ? 0 : kRows - rows;
  for (int step = 0; step < 3 && f != nullptr && shard != nullptr; ++step) {
    CHECK_OK(dp_fsdp_unshard(f, 1));
    CHECK_OK(dp_fsdp_wait_unshard(f));
    dp_tensor* gathered = nullptr;
    CHECK_OK(dp_module_get_parameter(m, "w", &gathered));
    if (gathered != nullptr) CHECK(tensor_values(gathered) == full, "step %d: the unshard gathered other values", step);
    dp_tensor_destroy(gathered);
    dp_tensor* g = nullptr;
    CHECK_OK(dp_module_grad(m, "w", &g));
    std::vector<float> grad(full.size());
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>((r + 1) * (static_cast<int>(i) + step));
    if (g != nullptr) CHECK_OK(dp_tensor_copy_from_host(g, grad.data(), grad.size() * sizeof(float)));
    dp_tensor_destroy(g);
    CHECK_OK(dp_fsdp_post_backward(f));
    CHECK_OK(dp_fsdp_finish_backward(f));
    dp_tensor* shard_grad = nullptr;
    CHECK_OK(dp_fsdp_shard_grad(f, 0, &shard_grad));
    std::vector<float> got = shard_grad != nullptr ? tensor_values(shard_grad) : std::vector<float>();
    // The host's zero_grad: shard gradients accumulate across steps otherwise.
    const std::vector<float> zeros(got.size(), 0.0f);
    if (shard_grad != nullptr)
      CHECK_OK(dp_tensor_copy_from_host(shard_grad, zeros.data(), zeros.size() * sizeof(float)));
    dp_tensor_destroy(shard_grad);
    std::vector<float> values = tensor_values(shard);
    const float mean_factor = static_cast<float>(world + 1) / 2.0f;  // the average of rank + 1
    for (int64_t k = 0; k < rows * kCols && static_cast<size_t>(k) < got.size(); ++k) {
      const int64_t i = first_row * kCols + k;
      const float expected = mean_factor * static_cast<float>(i + step);
      CHECK(got[static_cast<size_t>(k)] == expected, "step %d: shard gradient [%lld] is %g, not %g", step,
            static_cast<long long>(k), got[static_cast<size_t>(k)], expected);
      values[static_cast<size_t>(k)] -= expected;
    }
    CHECK_OK(dp_tensor_copy_from_host(shard, values.data(), values.size() * sizeof(float)));
    for (size_t i = 0; i < full.size(); ++i) full[i] -= mean_factor * static_cast<float>(static_cast<int>(i) + step);
  }
  dp_tensor_destroy(shard);
  dp_fsdp_destroy(f);
  dp_module_destroy(m);
}

void scenario_host_init(int level, int r, int world, const std::string& store_path) {
  void* mpi = ::dlopen(std::getenv("DP_MPI_LIBRARY"), RTLD_NOW | RTLD_GLOBAL);
  if (mpi == nullptr) {
    std::printf("skip: %s\n", ::dlerror());
    std::exit(77);
  }
  auto init_thread = reinterpret_cast<int (*)(int*, char***, int, int*)>(::dlsym(mpi, "MPI_Init_thread"));
  auto finalized = reinterpret_cast<int (*)(int*)>(::dlsym(mpi, "MPI_Finalized"));
  auto finalize = reinterpret_cast<int (*)()>(::dlsym(mpi, "MPI_Finalize"));
  int provided = -1;
  CHECK(init_thread(nullptr, nullptr, level, &provided) == 0, "MPI_Init_thread failed");
  dp_store* store = nullptr;
  CHECK_OK(dp_store_create_file(&store, store_path.c_str(), world));
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.backend = DP_BACKEND_MPI;
  opts.rank = r;
  opts.world_size = world;
  opts.store = store;
  opts.timeout_ms = 60000;
  dp_process_group* pg = nullptr;
  dp_status status = dp_process_group_create(&pg, &opts);
  if (provided < 2) {
    CHECK(status == DP_EUNSUPPORTED, "thread level %d gave %d: %s", provided, status, dp_last_error());
    CHECK(mentions(dp_last_error(), provided == 0 ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED"),
          "the error names no thread level: %s", dp_last_error());
  } else {
    CHECK(status == DP_OK, "thread level %d gave %d: %s", provided, status, dp_last_error());
    if (pg != nullptr) check_all_reduce(pg, DP_INT32, DP_SUM, 64, true, r, world);
  }
  dp_process_group_destroy(pg);
  dp_store_destroy(store);
  CHECK_OK(dp_shutdown());  // finalises only an MPI that dparallel initialised
  int done = -1;
  finalized(&done);
  CHECK(done == 0, "MPI was finalised under the host that initialised it");
  CHECK(finalize() == 0, "the host's MPI_Finalize failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: mpi_worker <scenario> <store path>\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const std::string store_path = argv[2];
  const int r = env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", 0);
  const int world = env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", 1);
  g_rank = r;
  if (scenario == "no_mpi") {
    CHECK(!mpi_mapped(), "MPI mapped at start");
    dp_process_group* pg = make_group(DP_BACKEND_GLOO, r, world, store_path, 60000);
    if (pg != nullptr) check_all_reduce(pg, DP_FLOAT32, DP_SUM, 16, false, r, world);
    CHECK(!mpi_mapped(), "a Gloo group mapped an MPI library");
    dp_process_group_destroy(pg);
  } else if (scenario == "host_init_funneled" || scenario == "host_init_multiple") {
    scenario_host_init(scenario == "host_init_funneled" ? 1 : 3, r, world, store_path);
  } else if (scenario == "hierarchical") {
    ::setenv("DP_HOST_ID", r < world / 2 ? "first" : "second", 1);
    ::setenv("DP_CROSS_HOST", "mpi", 1);
    ::unsetenv("DP_SHM");
    dp_process_group* pg = make_group(DP_BACKEND_AUTO, r, world, store_path, 120000);
    CHECK(pg != nullptr, "no group");
    if (pg != nullptr) scenario_collectives(pg, r, world, "shm+mpi");
    dp_process_group_destroy(pg);
  } else if (scenario == "cross_host_refused") {
    ::setenv("DP_HOST_ID", r < world / 2 ? "first" : "second", 1);
    dp_store* store = nullptr;
    CHECK_OK(dp_store_create_file(&store, store_path.c_str(), world));
    dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
    opts.rank = r;
    opts.world_size = world;
    opts.store = store;
    opts.timeout_ms = 60000;
    dp_process_group* pg = nullptr;
    dp_status status = dp_process_group_create(&pg, &opts);
    const char* expect = std::getenv("DP_TEST_EXPECT");
    CHECK(status == DP_EINVAL, "gave %d: %s", status, dp_last_error());
    CHECK(expect != nullptr && mentions(dp_last_error(), expect), "the error does not say '%s': %s", expect,
          dp_last_error());
    CHECK(!mpi_mapped(), "a refused group mapped an MPI library");
    dp_process_group_destroy(pg);
    dp_store_destroy(store);
  } else if (scenario == "not_one_job") {
    dp_store* store = nullptr;
    CHECK_OK(dp_store_create_file(&store, store_path.c_str(), world));
    dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
    opts.backend = DP_BACKEND_MPI;
    opts.rank = r;
    opts.world_size = world;
    opts.store = store;
    opts.timeout_ms = 60000;
    dp_process_group* pg = nullptr;
    dp_status status = dp_process_group_create(&pg, &opts);
    if (status == DP_EUNSUPPORTED && mentions(dp_last_error(), "no MPI library could be loaded")) {
      std::printf("skip: %s\n", dp_last_error());
      return 77;
    }
    CHECK(status == DP_EUNSUPPORTED, "gave %d: %s", status, dp_last_error());
    CHECK(mentions(dp_last_error(), "not processes of one MPI job") && mentions(dp_last_error(), "mpirun"),
          "the error does not say to use mpirun: %s", dp_last_error());
    dp_process_group_destroy(pg);
    dp_store_destroy(store);
  } else {
    dp_store* side = nullptr;
    if (scenario == "timeout") CHECK_OK(dp_store_create_file(&side, (store_path + ".side").c_str(), world));
    dp_process_group* pg = make_group(DP_BACKEND_MPI, r, world, store_path, scenario == "timeout" ? 3000 : 120000);
    CHECK(pg != nullptr, "no group");
    if (pg != nullptr) {
      if (scenario == "collectives") {
        scenario_collectives(pg, r, world, "mpi");
      } else if (scenario == "timeout") {
        scenario_timeout(pg, r, side);
      } else if (scenario == "fsdp") {
        scenario_fsdp(pg, r, world);
      } else if (scenario == "mpi_mapped") {
        check_all_reduce(pg, DP_FLOAT32, DP_SUM, 16, false, r, world);
        CHECK(mpi_mapped(), "an MPI group runs but no MPI library is mapped");
      } else {
        std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
        return 2;
      }
    }
    dp_process_group_destroy(pg);
    dp_store_destroy(side);
  }
  if (g_failures == 0) std::printf("rank %d: %s passed\n", r, scenario.c_str());
  std::fflush(stdout);
  return g_failures == 0 ? 0 : 1;
}
