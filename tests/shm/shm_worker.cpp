// One rank of a shared-memory test (shm_mp_test.cpp starts world-size copies
// with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; the
// group's timeout is DP_TEST_TIMEOUT_MS, default 60 s). Exit code 0 means every
// check passed; 3 that the group could not be created; failures are printed.
//   shm_worker backend NAME   the group reports backend NAME and all-reduces right
//   shm_worker collectives [BACKEND [HOSTS]]
//                             every collective x op x dtype against expectations,
//                             over one and several rounds of the segment; bitwise
//                             repeatable float sums in rank order. The group must
//                             report BACKEND (default shm); with HOSTS, the ranks
//                             run on that many (pretend) hosts, consecutive ranks
//                             on each, and float sums add each host's in rank
//                             order, then the hosts' in host order
//   shm_worker mismatch       sizes, ops or roots that differ, refusals and an
//                             out-of-step rank: the verdicts every backend gives
//   shm_worker die|stop RANK  RANK is killed (stops) in a stream of large all_reduces
//   shm_worker loop           all-reduces until killed (prints "looping" first)
#include <signal.h>
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

dp_tensor* make(int32_t dtype, size_t n, int r, size_t offset) {
  int64_t shape[1] = {static_cast<int64_t>(n)};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, dtype, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  if (t == nullptr) std::exit(4);
  for (size_t i = 0; i < n; ++i) store(dtype, dp_tensor_data(t), i, value(dtype, r, i + offset));
  return t;
}

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

void run_collectives(dp_process_group* pg, const char* backend, int hosts) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  CHECK(std::strcmp(dp_process_group_backend(pg), backend) == 0, "backend %s, want %s", dp_process_group_backend(pg),
        backend);
  // Empty; whole in one slot; past the small all_reduce; several rounds (the
  // slots hold 1 MiB per rank) with an odd remainder.
  const size_t sizes[] = {0, 7, 12000, 300007};
  for (size_t n : sizes) {
    for (int d = 0; d < 9; ++d) {
      const int32_t dtype = kDtypes[d];
      // Several rounds in four dtypes only: the checks cost more than the collectives.
      if (n > 100000 && dtype != DP_FLOAT32 && dtype != DP_FLOAT16 && dtype != DP_INT64 && dtype != DP_BOOL) continue;
      for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
        if (dtype == DP_BOOL && op == DP_AVG) continue;
        dp_tensor* t = make(dtype, n, rank, 0);
        CHECK_OK(dp_pg_all_reduce(pg, t, op));
        expect_values(t, d, n, "all_reduce", op, [&](size_t i) { return expected(dtype, op, world, i); });
        dp_tensor_destroy(t);

        std::vector<dp_tensor*> inputs;
        for (int q = 0; q < world; ++q) inputs.push_back(make(dtype, n, rank, static_cast<size_t>(q) * n));
        dp_tensor* out = make(dtype, n, 0, 7);
        CHECK_OK(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, op));
        expect_values(out, d, n, "reduce_scatter", op,
                      [&](size_t i) { return expected(dtype, op, world, i + static_cast<size_t>(rank) * n); });
        for (dp_tensor* in : inputs) dp_tensor_destroy(in);
        dp_tensor_destroy(out);
      }
      for (int root = 0; root<world; root += world - 1> 0 ? world - 1 : 1) {
        dp_tensor* b = make(dtype, n, rank, 0);
        CHECK_OK(dp_pg_broadcast(pg, b, root));
        expect_values(b, d, n, "broadcast", -1, [&](size_t i) { return value(dtype, root, i); });
        dp_tensor_destroy(b);
      }
      dp_tensor* in = make(dtype, n, rank, 0);
      std::vector<dp_tensor*> outs;
      for (int q = 0; q < world; ++q) outs.push_back(make(dtype, n, 0, 1));
      CHECK_OK(dp_pg_all_gather(pg, in, outs.data(), outs.size()));
      for (int q = 0; q < world; ++q) {
        expect_values(outs[static_cast<size_t>(q)], d, n, "all_gather", -1,
                      [&](size_t i) { return value(dtype, q, i); });
        dp_tensor_destroy(outs[static_cast<size_t>(q)]);
      }
      dp_tensor_destroy(in);
    }
  }

  // In place: the input is this rank's own output of a gather, or its own
  // input of a reduce-scatter; and an input inside another rank's output.
  const size_t n = 200003;
  std::vector<float> flat(n * static_cast<size_t>(world));
  for (size_t i = 0; i < n; ++i)
    flat[static_cast<size_t>(rank) * n + i] = static_cast<float>(value(DP_FLOAT32, rank, i));
  int64_t shape[1] = {static_cast<int64_t>(n)};
  std::vector<dp_tensor*> views(static_cast<size_t>(world));
  for (int q = 0; q < world; ++q) {
    CHECK_OK(dp_tensor_from_blob(&views[static_cast<size_t>(q)], flat.data() + n * static_cast<size_t>(q), DP_FLOAT32,
                                 1, shape, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr));
  }
  CHECK_OK(dp_pg_all_gather(pg, views[static_cast<size_t>(rank)], views.data(), views.size()));
  for (size_t i = 0; i < flat.size(); ++i) {
    if (flat[i] != static_cast<float>(value(DP_FLOAT32, static_cast<int>(i / n), i % n))) {
      CHECK(false, "all_gather in place differs at %zu", i);
      break;
    }
  }
  // The other rank's view as input: gathered into the views it overlaps.
  int other = (rank + 1) % world;
  CHECK_OK(dp_pg_all_gather(pg, views[static_cast<size_t>(other)], views.data(), views.size()));
  for (size_t i = 0; i < flat.size(); ++i) {
    int from = static_cast<int>(i / n);
    if (flat[i] != static_cast<float>(value(DP_FLOAT32, (from + 1) % world, i % n))) {
      CHECK(false, "all_gather of an overlapping input differs at %zu", i);
      break;
    }
  }
  for (size_t i = 0; i < flat.size(); ++i) flat[i] = static_cast<float>(value(DP_FLOAT32, rank, i));
  CHECK_OK(dp_pg_reduce_scatter(pg, views.data(), views.size(), views[static_cast<size_t>(rank)], DP_SUM));
  for (size_t i = 0; i < n; ++i) {
    size_t at = static_cast<size_t>(rank) * n + i;
    if (flat[at] != static_cast<float>(expected(DP_FLOAT32, DP_SUM, world, at))) {
      CHECK(false, "reduce_scatter in place differs at %zu", i);
      break;
    }
  }
  for (dp_tensor* v : views) dp_tensor_destroy(v);

  // Inexact float sums: rank order fixes every rounding, so the result is
  // the sequential sum x0 + x1 + ... bit for bit, every time.
  const size_t m = 700001;
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
    CHECK(std::memcmp(p, want.data(), m * sizeof(float)) == 0, "float sums differ from the rank-order sum");
    if (repeat == 0) std::memcpy(first.data(), p, m * sizeof(float));
    CHECK(std::memcmp(p, first.data(), m * sizeof(float)) == 0, "float sums differ between runs");
    dp_tensor_destroy(t);
  }

  // Async work keeps issue order.
  dp_tensor* a = make(DP_FLOAT32, 400000, rank, 0);
  dp_tensor* c = make(DP_INT64, 5, rank, 0);
  dp_work *w1 = nullptr, *w2 = nullptr, *w3 = nullptr;
  CHECK_OK(dp_pg_all_reduce_async(pg, a, DP_SUM, &w1));
  CHECK_OK(dp_pg_all_reduce_async(pg, c, DP_MAX, &w2));
  CHECK_OK(dp_pg_barrier_async(pg, &w3));
  CHECK_OK(dp_work_wait(w1));
  CHECK_OK(dp_work_wait(w2));
  CHECK_OK(dp_work_wait(w3));
  expect_values(a, 0, 400000, "async all_reduce", DP_SUM,
                [&](size_t i) { return expected(DP_FLOAT32, DP_SUM, world, i); });
  expect_values(c, 7, 5, "async all_reduce", DP_MAX, [&](size_t i) { return expected(DP_INT64, DP_MAX, world, i); });
  dp_work_destroy(w1);
  dp_work_destroy(w2);
  dp_work_destroy(w3);
  dp_tensor_destroy(a);
  dp_tensor_destroy(c);
  CHECK_OK(dp_pg_barrier(pg));
}

void expect_group_works(dp_process_group* pg, size_t n) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  expect_values(t, 0, n, "all_reduce after a failed call", DP_SUM,
                [&](size_t i) { return expected(DP_FLOAT32, DP_SUM, world, i); });
  dp_tensor_destroy(t);
}

void run_mismatch(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  // Sizes that differ a little, and across the small and the large path.
  for (size_t base : {size_t(10), size_t(3000), size_t(500000)}) {
    size_t n = base == 3000 ? (rank == 0 ? 100 : 400000) : base + static_cast<size_t>(rank);
    dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
    dp_status s = dp_pg_all_reduce(pg, t, DP_SUM);
    CHECK(s == DP_EINVAL, "mismatched sizes gave %d: %s", s, dp_last_error());
    CHECK(std::strstr(dp_last_error(), "differ across ranks") != nullptr, "message: %s", dp_last_error());
    dp_tensor_destroy(t);
    expect_group_works(pg, base);
  }
  // Another op on one rank; other roots; another count in all_gather.
  dp_tensor* t = make(DP_FLOAT32, 1000, rank, 0);
  CHECK(dp_pg_all_reduce(pg, t, rank == 0 ? DP_MAX : DP_SUM) == DP_EINVAL, "different ops: %s", dp_last_error());
  CHECK(dp_pg_broadcast(pg, t, rank) == DP_EINVAL, "different roots: %s", dp_last_error());
  dp_tensor_destroy(t);
  dp_tensor* in = make(DP_INT32, rank == world - 1 ? 3 : 4, rank, 0);
  std::vector<dp_tensor*> outs;
  for (int q = 0; q < world; ++q) outs.push_back(make(DP_INT32, rank == world - 1 ? 3 : 4, 0, 0));
  CHECK(dp_pg_all_gather(pg, in, outs.data(), outs.size()) == DP_EINVAL, "different counts: %s", dp_last_error());
  for (dp_tensor* o : outs) dp_tensor_destroy(o);
  dp_tensor_destroy(in);
  expect_group_works(pg, 300000);
  // A refused call (a bad op on the last rank) fails every rank naming it.
  dp_tensor* u = make(DP_FLOAT32, 300000, rank, 0);
  dp_status s = dp_pg_all_reduce(pg, u, rank == world - 1 ? 9 : DP_SUM);
  CHECK(s == DP_EINVAL, "a refusal gave %d: %s", s, dp_last_error());
  std::string who = "rank " + std::to_string(world - 1) + " refused the call";
  CHECK(std::strstr(dp_last_error(), who.c_str()) != nullptr, "names the refusing rank: %s", dp_last_error());
  dp_tensor_destroy(u);
  expect_group_works(pg, 7);
  // Out of step: the last rank calls a barrier where the others all-reduce.
  if (world < 2) return;
  if (rank == world - 1) {
    s = dp_pg_barrier(pg);
  } else {
    dp_tensor* v = make(DP_FLOAT32, 10, rank, 0);
    s = dp_pg_all_reduce(pg, v, DP_SUM);
    dp_tensor_destroy(v);
  }
  CHECK(s == DP_EREMOTE, "out of step gave %d: %s", s, dp_last_error());
  CHECK(std::strstr(dp_last_error(), "same order") != nullptr, "message: %s", dp_last_error());
  CHECK(dp_pg_barrier(pg) == DP_ESTATE, "the group is broken afterwards: %s", dp_last_error());
}

// The victim all-reduces a few times, then dies (or stops) a moment into an
// all_reduce of its own; the others all-reduce until theirs fails.
void run_failure(dp_process_group* pg, bool stop, int victim, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg);
  const size_t n = size_t(8) << 20;  // 32 MiB
  dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
  if (rank == victim) {
    for (int i = 0; i < 3; ++i) CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
    dp_work* w = nullptr;
    CHECK_OK(dp_pg_all_reduce_async(pg, t, DP_SUM, &w));
    const char* delay = std::getenv("DP_TEST_DIE_DELAY_US");  // default 1 ms into it
    usleep(delay != nullptr ? static_cast<useconds_t>(std::atoi(delay)) : 1000);
    raise(stop ? SIGSTOP : SIGKILL);
    // Continued (SIGCONT) only to be killed.
    pause();
  }
  dp_status s = DP_OK;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100000 && s == DP_OK; ++i) {
    start = std::chrono::steady_clock::now();
    s = dp_pg_all_reduce(pg, t, DP_SUM);
  }
  double elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::string message = dp_last_error();
  std::printf("rank %d: status %d after %.0f ms: %s\n", rank, s, elapsed_ms, message.c_str());
  // A dead peer is noticed by its pid, before the timeout; a stopped one only by it.
  if (stop) {
    CHECK(s == DP_ETIMEOUT || s == DP_EREMOTE, "status %d", s);
  } else {
    CHECK(s == DP_EREMOTE, "status %d", s);
  }
  CHECK(elapsed_ms < 2.0 * timeout_ms, "took %.0f ms of a %d ms timeout", elapsed_ms, timeout_ms);
  CHECK(message.find("all_reduce") != std::string::npos, "names the collective: %s", message.c_str());
  std::string named = "rank(s) " + std::to_string(victim);
  std::string gone = "rank " + std::to_string(victim) + " (pid";
  if (victim == 0 && !stop) {
    CHECK(message.find(gone) != std::string::npos, "names the dead rank: %s", message.c_str());
  } else if (victim != 0) {
    CHECK(message.find(named) != std::string::npos || message.find(", " + std::to_string(victim)) != std::string::npos,
          "names the missing rank: %s", message.c_str());
  }
  CHECK(dp_pg_barrier(pg) == DP_ESTATE, "a broken group refuses further collectives: %s", dp_last_error());
  dp_tensor_destroy(t);
  auto destroy_start = std::chrono::steady_clock::now();
  dp_process_group_destroy(pg);
  double destroy_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - destroy_start).count();
  CHECK(destroy_ms < timeout_ms / 2.0, "destroy took %.0f ms of a %d ms timeout", destroy_ms, timeout_ms);
}

void run_loop(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg);
  dp_tensor* t = make(DP_FLOAT32, size_t(4) << 20, rank, 0);
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: shm_worker backend NAME|collectives [BACKEND [HOSTS]]|mismatch|die RANK|stop RANK|loop\n");
    return 2;
  }
  std::string scenario = argv[1];
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
  } else if (scenario == "collectives") {
    run_collectives(pg, argc > 2 ? argv[2] : "shm", argc > 3 ? std::atoi(argv[3]) : 1);
  } else if (scenario == "mismatch") {
    run_mismatch(pg);
  } else if ((scenario == "die" || scenario == "stop") && argc > 2) {
    run_failure(pg, scenario == "stop", std::atoi(argv[2]), timeout_ms);
    pg = nullptr;
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
