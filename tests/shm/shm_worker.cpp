// One rank of a shared-memory test (shm_mp_test.cpp starts world-size copies
// with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; the
// group's timeout is DP_TEST_TIMEOUT_MS, default 60 s). Exit code 0 means every
// check passed; 3 that the group could not be created; failures are printed.
//   shm_worker backend NAME   the group reports backend NAME and all-reduces right
//   shm_worker rank_order_sums BACKEND [HOSTS]
//                             float sums that round are the rank-order sum bit
//                             for bit, every time; the group must report BACKEND
//   shm_worker small_mismatch BACKEND
//                             small all_reduces that differ on the last rank
//                             fail every rank and change no tensor
//   shm_worker loop           all-reduces until killed (prints "looping" first)
//   shm_worker past_file_limit BACKEND
//                             the group reports BACKEND and all-reduces right; a
//                             dp_ddp and a dp_fsdp over a parameter of 16 MiB
//                             (their shared regions past the limit below) train
//                             and shard right
// DP_TEST_FILE_SIZE_LIMIT=BYTES sets this process's RLIMIT_FSIZE first.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"
#include "worker_util.h"

namespace {

using namespace dptest_worker;  // NOLINT(google-build-using-namespace): the test helpers

// Checks t[i] == want(i) for every i; reports the first difference.
template <typename Want>
void expect_values(const dp_tensor* t, int d, size_t n, const char* what, int32_t op, Want&& want) {
  for (size_t i = 0; i < n; ++i) {
    double got = load(kDtypes[d], dp_tensor_data(t), i), w = want(i);
    if (got != w) {
      CHECK(got == w, "%s %s %s n=%zu [%zu]: got %g want %g", what, kDtypeNames[d], op >= 0 ? kOpNames[op] : "", n, i,
            got, w);
      return;
    }
  }
}

// Inexact float sums: rank order fixes every rounding, so the result is the
// sequential sum x0 + x1 + ... bit for bit, every time. With HOSTS, the ranks
// run on that many (pretend) hosts, consecutive ranks on each, and the sums
// add each host's in rank order, then the hosts' in host order.
void expect_rank_order_sums(dp_process_group* pg, int hosts, size_t m) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  auto noise = [](int r, size_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(r + 1) * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return static_cast<float>(static_cast<double>(x % 2000003) / 7.0 - 142857.0);
  };
  std::vector<float> want(m), first(m);
  const int per_host = world / hosts;
  for (size_t i = 0; i < m; ++i) {
    float acc = 0;
    for (int h = 0; h < hosts; ++h) {
      float host_sum = noise(h * per_host, i);
      for (int r = h * per_host + 1; r < (h + 1) * per_host; ++r) host_sum = host_sum + noise(r, i);
      acc = h == 0 ? host_sum : acc + host_sum;
    }
    want[i] = acc;
  }
  int64_t mshape[1] = {static_cast<int64_t>(m)};
  for (int repeat = 0; repeat < 3; ++repeat) {
    dp_tensor* t = nullptr;
    CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, mshape, dp_device{DP_DEVICE_CPU, 0}));
    auto* p = static_cast<float*>(dp_tensor_data(t));
    for (size_t i = 0; i < m; ++i) p[i] = noise(rank, i);
    CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
    CHECK(std::memcmp(p, want.data(), m * sizeof(float)) == 0, "float sums of %zu differ from the rank-order sum", m);
    if (repeat == 0) std::memcpy(first.data(), p, m * sizeof(float));
    CHECK(std::memcmp(p, first.data(), m * sizeof(float)) == 0, "float sums of %zu differ between runs", m);
    dp_tensor_destroy(t);
  }
}

void run_rank_order_sums(dp_process_group* pg, int hosts) {
  // Large, and small enough to cross hosts inside the header exchange
  // (evenly split among a host's ranks or not).
  for (size_t m : {size_t{700001}, size_t{700}, size_t{5}}) expect_rank_order_sums(pg, hosts, m);
}

void expect_group_works(dp_process_group* pg, size_t n) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  dp_tensor* t = host_values(DP_FLOAT32, n, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  expect_values(t, 0, n, "all_reduce", DP_SUM, [&](size_t i) { return expected(DP_FLOAT32, DP_SUM, world, i); });
  dp_tensor_destroy(t);
}

// Small all_reduces that the last rank makes with another size, dtype or
// op: every rank fails naming the difference and keeps its tensor as it
// was, and the group goes on. Across hosts, the hosts whose ranks agree
// reduce-scatter before the verdict, into the header block only.
void run_small_mismatch(dp_process_group* pg, const char* backend) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const bool last = rank == world - 1;
  CHECK(std::strcmp(dp_process_group_backend(pg), backend) == 0, "backend %s, want %s", dp_process_group_backend(pg),
        backend);
  struct Case {
    const char* what;
    size_t n;
    int32_t dtype;
    int32_t op;
  };
  const Case cases[] = {{"size", last ? size_t{702} : size_t{700}, DP_FLOAT32, DP_SUM},
                        {"dtype", 700, last ? DP_INT32 : DP_FLOAT32, DP_SUM},
                        {"op", 700, DP_FLOAT32, last ? DP_MAX : DP_SUM},
                        {"odd size", last ? size_t{6} : size_t{5}, DP_FLOAT32, DP_AVG}};
  for (const Case& c : cases) {
    dp_tensor* t = host_values(c.dtype, c.n, rank, 0);
    const size_t bytes = dp_tensor_nbytes(t);
    std::vector<uint8_t> before(static_cast<const uint8_t*>(dp_tensor_data(t)),
                                static_cast<const uint8_t*>(dp_tensor_data(t)) + bytes);
    dp_status st = dp_pg_all_reduce(pg, t, c.op);
    CHECK(st == DP_EINVAL && std::strstr(dp_last_error(), "differ") != nullptr,
          "all_reduce of a different %s gave %d: %s", c.what, st, dp_last_error());
    CHECK(std::memcmp(dp_tensor_data(t), before.data(), bytes) == 0,
          "all_reduce of a different %s changed this rank's tensor", c.what);
    dp_tensor_destroy(t);
    expect_group_works(pg, 700);
  }
}

void run_loop(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg);
  dp_tensor* t = host_values(DP_FLOAT32, size_t(4) << 20, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  std::printf("rank %d: looping\n", rank);
  std::fflush(stdout);
  for (;;) {
    if (dp_pg_all_reduce(pg, t, DP_SUM) != DP_OK) {
      std::printf("rank %d: all_reduce failed: %s\n", rank, dp_last_error());
      std::fflush(stdout);
      pause();
    }
  }
}

// A module of one float parameter "w" of n values, value(i) on every rank
// but junk on the others than rank 0 where `only_rank0` is set.
dp_module* one_parameter(size_t n, int rank, bool only_rank0) {
  dp_module* m = nullptr;
  CHECK_OK(dp_module_create(&m));
  int64_t shape[1] = {static_cast<int64_t>(n)};
  dp_tensor* w = nullptr;
  CHECK_OK(dp_tensor_create(&w, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  auto* p = static_cast<float*>(dp_tensor_data(w));
  for (size_t i = 0; i < n; ++i) p[i] = only_rank0 && rank != 0 ? -1.0f : static_cast<float>(i % 13);
  CHECK_OK(dp_module_register_parameter(m, "w", w, 1));
  dp_tensor_destroy(w);
  return m;
}

// DDP's buckets and FSDP's shards go in shared regions where they fit; past
// rank 0's file-size limit every rank keeps them in private memory, and both
// still compute right.
void run_past_file_limit(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const size_t n = size_t(4) << 20;  // 16 MiB of floats
  dp_module* sharded = one_parameter(n, rank, true);
  dp_fsdp* fsdp = nullptr;
  CHECK_OK(dp_fsdp_create(&fsdp, sharded, pg, nullptr));
  if (fsdp != nullptr) {
    dp_tensor* shard = nullptr;
    CHECK_OK(dp_fsdp_shard(fsdp, 0, &shard));
    const size_t rows = n / static_cast<size_t>(world);
    const auto* sp = static_cast<const float*>(dp_tensor_data(shard));
    bool right = static_cast<size_t>(dp_tensor_numel(shard)) == rows;
    for (size_t i = 0; i < rows && right; ++i) right = sp[i] == static_cast<float>((rank * rows + i) % 13);
    CHECK(right, "this rank's shard is not rank 0's rows %zu..%zu", rank * rows, (rank + 1) * rows);
    dp_tensor_destroy(shard);
    CHECK_OK(dp_fsdp_unshard(fsdp, 0));
    dp_tensor* full = nullptr;
    CHECK_OK(dp_module_get_parameter(sharded, "w", &full));
    const auto* fp = static_cast<const float*>(dp_tensor_data(full));
    right = static_cast<size_t>(dp_tensor_numel(full)) == n;
    for (size_t i = 0; i < n && right; ++i) right = fp[i] == static_cast<float>(i % 13);
    CHECK(right, "the unsharded parameter is not rank 0's");
    dp_tensor_destroy(full);
    dp_fsdp_destroy(fsdp);
  }
  dp_module_destroy(sharded);

  dp_module* m = one_parameter(n, rank, false);
  dp_ddp_options options = DP_DDP_OPTIONS_INIT;
  options.gradient_as_bucket_view = 1;  // buckets in a shared region, where there is room
  dp_ddp* ddp = nullptr;
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &options));
  if (ddp != nullptr) {
    CHECK_OK(dp_ddp_pre_forward(ddp));
    dp_tensor* g = nullptr;
    CHECK_OK(dp_module_grad(m, "w", &g));
    auto* gp = static_cast<float*>(dp_tensor_data(g));
    for (size_t i = 0; i < n; ++i) gp[i] = static_cast<float>(rank + 1);
    CHECK_OK(dp_ddp_mark_grad_ready(ddp, "w"));
    CHECK_OK(dp_ddp_finish_backward(ddp));
    const float mean = static_cast<float>(world + 1) / 2.0f;
    gp = static_cast<float*>(dp_tensor_data(g));
    bool right = true;
    for (size_t i = 0; i < n && right; ++i) right = gp[i] == mean;
    CHECK(right, "the averaged gradient is not %g everywhere", static_cast<double>(mean));
    dp_tensor_destroy(g);
    dp_ddp_destroy(ddp);
  }
  dp_module_destroy(m);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: shm_worker backend NAME|rank_order_sums BACKEND [HOSTS]|loop\n");
    return 2;
  }
  std::string scenario = argv[1];
  if (const char* limit_text = std::getenv("DP_TEST_FILE_SIZE_LIMIT")) {
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = static_cast<rlim_t>(std::strtoull(limit_text, nullptr, 10));
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) {
      std::fprintf(stderr, "setrlimit(RLIMIT_FSIZE) failed\n");
      return 2;
    }
  }
  const char* rank_text = std::getenv("RANK");
  g_rank = rank_text != nullptr ? std::atoi(rank_text) : -1;
  const char* timeout_text = std::getenv("DP_TEST_TIMEOUT_MS");
  const int32_t timeout_ms = timeout_text != nullptr ? std::atoi(timeout_text) : 60000;
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.timeout_ms = timeout_ms;
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    std::fprintf(stderr, "rank %d: create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  if (scenario == "backend" && argc > 2) {
    CHECK(std::strcmp(dp_process_group_backend(pg), argv[2]) == 0, "backend %s, want %s", dp_process_group_backend(pg),
          argv[2]);
    expect_group_works(pg, 300000);
  } else if (scenario == "rank_order_sums" && argc > 2) {
    CHECK(std::strcmp(dp_process_group_backend(pg), argv[2]) == 0, "backend %s, want %s", dp_process_group_backend(pg),
          argv[2]);
    run_rank_order_sums(pg, argc > 3 ? std::atoi(argv[3]) : 1);
  } else if (scenario == "past_file_limit" && argc > 2) {
    CHECK(std::strcmp(dp_process_group_backend(pg), argv[2]) == 0, "backend %s, want %s", dp_process_group_backend(pg),
          argv[2]);
    expect_group_works(pg, 300000);
    run_past_file_limit(pg);
  } else if (scenario == "small_mismatch" && argc > 2) {
    run_small_mismatch(pg, argv[2]);
  } else if (scenario == "loop") {
    run_loop(pg);
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  dp_process_group_destroy(pg);
  if (g_failures == 0) std::printf("rank %d: %s passed\n", g_rank, scenario.c_str());
  return g_failures == 0 ? 0 : 1;
}
