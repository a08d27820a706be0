// One rank of a multi-process test. The test driver (mp_test.cpp) starts
// world-size copies with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
// MASTER_PORT set; DP_TEST_STORE=<path> makes it use a file store instead,
// and DP_TEST_DEVICE=cuda puts each rank's tensors on cuda:LOCAL_RANK (NCCL).
// Exit code 0 means every check passed; failures are printed.
//   mp_worker collectives   every collective x op x dtype against expectations
//   mp_worker large_reduce_scatter  reduce_scatter of 1 MiB, 4 and 8 MiB + 7 elements per rank
//   mp_worker mismatch      sizes differ across ranks: every rank gets DP_EINVAL
//   mp_worker die [rank]    a rank (default the last) is killed during a large all_reduce
//   mp_worker stop [rank]   a rank (default the last) stops (SIGSTOP) before an all_reduce
//   mp_worker die_reduce_scatter|stop_reduce_scatter [rank]   ... during a large reduce_scatter
//   mp_worker oom           rank 0's all_gather runs out of memory; the group stays in step
//   mp_worker refuse [rank] a rank (default the last) refuses calls for bad arguments:
//                           every rank fails at once naming it, and the group carries on
//   mp_worker fork          rank 0's forked child is refused every call on the inherited
//                           group; the parents' collectives stay right
//   mp_worker thread_handover  one thread after another drives the group: allowed
//   mp_worker thread_overlap   rank 0 calls from a second thread while its first
//                           thread's call is in flight: refused, and every rank fails
//   mp_worker threads       4 threads x 50 all_reduces on one group: errors, never a hang
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dparallel/dparallel.h"
#include "worker_util.h"

namespace {

using namespace dptest_worker;  // NOLINT(google-build-using-namespace): the test helpers

dp_device g_device = {DP_DEVICE_CPU, 0};  // where the collectives' tensors live

bool on_gpu() { return g_device.type == DP_DEVICE_CUDA; }

dp_tensor* make(int32_t dtype, size_t n, int r, size_t offset) {
  int64_t shape[1] = {static_cast<int64_t>(n)};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, dtype, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  if (t == nullptr) std::exit(3);
  for (size_t i = 0; i < n; ++i) store(dtype, dp_tensor_data(t), i, value(dtype, r, i + offset));
  if (!on_gpu()) return t;
  dp_tensor* g = nullptr;
  CHECK_OK(dp_tensor_create(&g, dtype, 1, shape, g_device));
  if (g == nullptr) std::exit(3);
  CHECK_OK(dp_tensor_copy_from_host(g, dp_tensor_data(t), dp_tensor_nbytes(t)));
  dp_tensor_destroy(t);
  return g;
}

// The tensor's bytes, readable on the host wherever it lives.
std::vector<uint8_t> host(const dp_tensor* t) {
  std::vector<uint8_t> bytes(dp_tensor_nbytes(t));
  if (!bytes.empty()) CHECK_OK(dp_tensor_copy_to_host(t, bytes.data(), bytes.size()));
  return bytes;
}

void run_collectives(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  // Inline in the header slab, through a block exchange, and through Gloo's algorithms.
  const size_t sizes[] = {7, 5000, 140000};
  for (size_t n : sizes) {
    for (int d = 0; d < 9; ++d) {
      int32_t dtype = kDtypes[d];
      for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
        if (dtype == DP_BOOL && op == DP_AVG) continue;
        dp_tensor* t = make(dtype, n, rank, 0);
        CHECK_OK(dp_pg_all_reduce(pg, t, op));
        const std::vector<uint8_t> reduced = host(t);
        for (size_t i = 0; i < n; ++i) {
          double want = expected(dtype, op, world, i), got = load(dtype, reduced.data(), i);
          if (got != want) {
            CHECK(got == want, "all_reduce %s %s n=%zu [%zu]: got %g want %g", kDtypeNames[d], kOpNames[op], n, i, got,
                  want);
            break;
          }
        }
        dp_tensor_destroy(t);

        std::vector<dp_tensor*> inputs(static_cast<size_t>(world));
        for (int q = 0; q < world; ++q)
          inputs[static_cast<size_t>(q)] = make(dtype, n, rank, static_cast<size_t>(q) * n);
        dp_tensor* out = make(dtype, n, 0, 0);
        CHECK_OK(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, op));
        const std::vector<uint8_t> scattered = host(out);
        for (size_t i = 0; i < n; ++i) {
          double want = expected(dtype, op, world, i + static_cast<size_t>(rank) * n);
          double got = load(dtype, scattered.data(), i);
          if (got != want) {
            CHECK(got == want, "reduce_scatter %s %s n=%zu [%zu]: got %g want %g", kDtypeNames[d], kOpNames[op], n, i,
                  got, want);
            break;
          }
        }
        for (dp_tensor* in : inputs) dp_tensor_destroy(in);
        dp_tensor_destroy(out);
      }

      int root = world - 1;
      dp_tensor* b = make(dtype, n, rank, 0);
      CHECK_OK(dp_pg_broadcast(pg, b, root));
      const std::vector<uint8_t> broadcast = host(b);
      for (size_t i = 0; i < n; ++i) {
        if (load(dtype, broadcast.data(), i) != value(dtype, root, i)) {
          CHECK(false, "broadcast %s n=%zu [%zu] differs from root %d", kDtypeNames[d], n, i, root);
          break;
        }
      }
      dp_tensor_destroy(b);

      dp_tensor* in = make(dtype, n, rank, 0);
      std::vector<dp_tensor*> outs(static_cast<size_t>(world));
      for (int q = 0; q < world; ++q) outs[static_cast<size_t>(q)] = make(dtype, n, 0, 1);
      CHECK_OK(dp_pg_all_gather(pg, in, outs.data(), outs.size()));
      for (int q = 0; q < world; ++q) {
        const std::vector<uint8_t> gathered = host(outs[static_cast<size_t>(q)]);
        for (size_t i = 0; i < n; ++i) {
          if (load(dtype, gathered.data(), i) != value(dtype, q, i)) {
            CHECK(false, "all_gather %s n=%zu output %d [%zu] differs", kDtypeNames[d], n, q, i);
            break;
          }
        }
        dp_tensor_destroy(outs[static_cast<size_t>(q)]);
      }
      dp_tensor_destroy(in);
    }
  }

  // Outputs that are consecutive views of one host buffer (gathered in place).
  if (!on_gpu()) {
    const size_t n = 3000;
    std::vector<float> flat(n * static_cast<size_t>(world), -1.0f);
    std::vector<dp_tensor*> views(static_cast<size_t>(world));
    int64_t shape[1] = {static_cast<int64_t>(n)};
    for (int q = 0; q < world; ++q) {
      CHECK_OK(dp_tensor_from_blob(&views[static_cast<size_t>(q)], flat.data() + n * static_cast<size_t>(q), DP_FLOAT32,
                                   1, shape, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr));
    }
    dp_tensor* in = make(DP_FLOAT32, n, rank, 0);
    CHECK_OK(dp_pg_all_gather(pg, in, views.data(), views.size()));
    for (size_t i = 0; i < flat.size(); ++i) {
      if (flat[i] != static_cast<float>(value(DP_FLOAT32, static_cast<int>(i / n), i % n))) {
        CHECK(false, "all_gather into one buffer differs at %zu", i);
        break;
      }
    }
    for (dp_tensor* v : views) dp_tensor_destroy(v);
    dp_tensor_destroy(in);
  }

  // Async work keeps issue order: two all-reduces and a barrier in flight at once.
  dp_tensor* a = make(DP_FLOAT32, 3000, rank, 0);
  dp_tensor* c = make(DP_INT64, 5, rank, 0);
  dp_work *w1 = nullptr, *w2 = nullptr, *w3 = nullptr;
  CHECK_OK(dp_pg_all_reduce_async(pg, a, DP_SUM, &w1));
  CHECK_OK(dp_pg_all_reduce_async(pg, c, DP_MAX, &w2));
  CHECK_OK(dp_pg_barrier_async(pg, &w3));
  CHECK_OK(dp_work_wait(w1));
  CHECK_OK(dp_work_wait(w2));
  CHECK_OK(dp_work_wait(w3));
  int done = 0;
  CHECK_OK(dp_work_test(w1, &done));
  CHECK(done == 1, "a waited work is done");
  CHECK(load(DP_FLOAT32, host(a).data(), 2999) == expected(DP_FLOAT32, DP_SUM, world, 2999), "async all_reduce");
  CHECK(load(DP_INT64, host(c).data(), 4) == expected(DP_INT64, DP_MAX, world, 4), "async all_reduce max");
  dp_work_destroy(w1);
  dp_work_destroy(w2);
  dp_work_destroy(w3);
  dp_tensor_destroy(a);
  dp_tensor_destroy(c);
  CHECK_OK(dp_pg_barrier(pg));
}

// Checks out = the reduction of every rank's part `rank` of n elements.
void check_reduce_scatter(const dp_tensor* out, int32_t dtype_index, int32_t op, int world, int rank, size_t n) {
  const int32_t dtype = kDtypes[dtype_index];
  std::vector<uint8_t> result = host(out);
  for (size_t i = 0; i < n; ++i) {
    double want = expected(dtype, op, world, i + static_cast<size_t>(rank) * n);
    double got = load(dtype, result.data(), i);
    if (got != want) {
      CHECK(got == want, "reduce_scatter %s %s n=%zu [%zu]: got %g want %g", kDtypeNames[dtype_index], kOpNames[op], n,
            i, got, want);
      break;
    }
  }
}

// Reduce-scatters beyond the small-block exchange, which take Gloo's
// algorithms: every op, on outputs of 1 MiB (every dtype), 4 MiB + 7
// elements (an odd size, in a few dtypes) and 8 MiB + 7 elements.
void run_large_reduce_scatter(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  // Past 8 MiB per rank the parts travel in several all-to-alls, the last one short.
  std::vector<size_t> sizes = {std::size_t(1) << 20, (std::size_t(4) << 20) + 7, (std::size_t(8) << 20) + 7};
  for (size_t bytes : sizes) {
    for (int d = 0; d < 9; ++d) {
      int32_t dtype = kDtypes[d];
      bool odd = bytes % 2 != 0;
      bool several = bytes > (std::size_t(8) << 20);
      if (odd && dtype != DP_FLOAT32 && dtype != DP_FLOAT16 && dtype != DP_BFLOAT16 && dtype != DP_INT8 &&
          dtype != DP_INT64) {
        continue;
      }
      if (several && dtype != DP_FLOAT32 && dtype != DP_INT64) continue;
      size_t esize = dp_dtype_size(dtype);
      size_t n = odd ? ((bytes - 7) / esize) + 7 : bytes / esize;
      std::vector<dp_tensor*> inputs(static_cast<size_t>(world));
      for (int q = 0; q < world; ++q) inputs[static_cast<size_t>(q)] = make(dtype, n, rank, static_cast<size_t>(q) * n);
      for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
        if (dtype == DP_BOOL && op == DP_AVG) continue;
        dp_tensor* out = make(dtype, n, 0, 1);
        CHECK_OK(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, op));
        check_reduce_scatter(out, d, op, world, rank, n);
        dp_tensor_destroy(out);
      }
      for (dp_tensor* in : inputs) dp_tensor_destroy(in);
    }
  }
  CHECK_OK(dp_pg_barrier(pg));
}

void run_mismatch(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg);
  for (size_t base : {size_t(10), size_t(3000)}) {
    dp_tensor* t = make(DP_FLOAT32, base + static_cast<size_t>(rank), rank, 0);
    dp_status s = dp_pg_all_reduce(pg, t, DP_SUM);
    CHECK(s == DP_EINVAL, "mismatched sizes gave %d: %s", s, dp_last_error());
    CHECK(std::strstr(dp_last_error(), "differ across ranks") != nullptr, "message: %s", dp_last_error());
    dp_tensor_destroy(t);
  }
  // Different roots are an error too, and the group stays usable afterwards.
  dp_tensor* b = make(DP_INT32, 4, rank, 0);
  CHECK(dp_pg_broadcast(pg, b, rank) == DP_EINVAL, "different roots: %s", dp_last_error());
  dp_tensor_destroy(b);
  dp_tensor* t = make(DP_FLOAT32, 100, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  dp_tensor_destroy(t);
  // Sizes that differ across ranks by whole block sizes of the small-payload
  // path (12, 32, 52 KB), then each of those sizes on every rank: the
  // refused call must leave the ranks' transfers in step.
  const int world = dp_process_group_size(pg);
  dp_tensor* apart = make(DP_FLOAT32, 3000 + 5000 * static_cast<size_t>(rank), rank, 0);
  CHECK(dp_pg_all_reduce(pg, apart, DP_SUM) == DP_EINVAL, "block-size mismatch: %s", dp_last_error());
  dp_tensor_destroy(apart);
  for (int r = 0; r < world; ++r) {
    size_t n = 3000 + 5000 * static_cast<size_t>(r);
    dp_tensor* u = make(DP_FLOAT32, n, rank, 0);
    CHECK_OK(dp_pg_all_reduce(pg, u, DP_SUM));
    std::vector<uint8_t> sum = host(u);
    for (size_t i = 0; i < n; i += 997) {
      double want = expected(DP_FLOAT32, DP_SUM, world, i);
      CHECK(load(DP_FLOAT32, sum.data(), i) == want, "all_reduce of %zu after the mismatch [%zu]: got %g want %g", n, i,
            load(DP_FLOAT32, sum.data(), i), want);
    }
    dp_tensor_destroy(u);
  }
  // With three ranks or more: rank 1's size differs and the last rank calls
  // another collective. Every rank must see the out-of-step rank, which breaks
  // the group, rather than some seeing only the size and carrying on.
  if (world < 3) return;
  dp_status s;
  if (rank == world - 1) {
    s = dp_pg_barrier(pg);
  } else {
    dp_tensor* u = make(DP_FLOAT32, rank == 1 ? 20 : 10, rank, 0);
    s = dp_pg_all_reduce(pg, u, DP_SUM);
    dp_tensor_destroy(u);
  }
  CHECK(s == DP_EREMOTE, "out of step and mismatched at once gave %d: %s", s, dp_last_error());
  CHECK(std::strstr(dp_last_error(), "same order") != nullptr, "message: %s", dp_last_error());
}

// The ranks listed after "rank(s) " in a failure message.
std::set<int> named_ranks(const std::string& message) {
  std::set<int> ranks;
  size_t at = message.find("rank(s) ");
  if (at == std::string::npos) return ranks;
  const char* p = message.c_str() + at + 8;
  for (;;) {
    char* end = nullptr;
    long r = std::strtol(p, &end, 10);
    if (end == p) break;
    ranks.insert(static_cast<int>(r));
    if (end[0] != ',' || end[1] != ' ') break;
    p = end + 2;
  }
  return ranks;
}

// One rank (the last unless argv[2] names it) is killed during, or stops
// before, a large all_reduce; or is killed or stops during a large
// reduce_scatter; the others must fail by the timeout, name the collective
// and the missing rank, and still destroy the group.
// How many collectives a victim that dies mid-transfer queues before it dies.
constexpr int kVictimCollectives = 3;

void run_failure(dp_process_group* pg, bool stop, bool reduce_scatter, int victim, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  // 32 MiB to all-reduce, or 64 MiB per rank to reduce-scatter (8 segments):
  // the exit lands mid-transfer.
  const size_t n = reduce_scatter ? 16u << 20 : 8u << 20;
  dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
  std::vector<dp_tensor*> inputs;
  for (int q = 0; reduce_scatter && q < world; ++q) inputs.push_back(make(DP_FLOAT32, n, rank, 0));
  auto start_collective = [&](dp_work** w) {
    return reduce_scatter ? dp_pg_reduce_scatter_async(pg, inputs.data(), inputs.size(), t, DP_SUM, w)
                          : dp_pg_all_reduce_async(pg, t, DP_SUM, w);
  };
  // A first reduce_scatter allocates its scratch on every rank, so that the
  // victim's exit lands in the transfer rather than before the header exchange.
  if (reduce_scatter) CHECK_OK(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), t, DP_SUM));
  CHECK_OK(dp_pg_barrier(pg));
  if (rank == victim) {
    if (stop && !reduce_scatter) {
      raise(SIGSTOP);
    } else if (on_gpu()) {
      raise(SIGKILL);  // NCCL would finish 32 MiB well within 20 ms: die before it starts
    } else {
      // Several collectives queued, the exit landing in one of them: shared
      // memory may finish 32 MiB in less than Gloo takes to start it.
      const bool shm = std::strcmp(dp_process_group_backend(pg), "shm") == 0;
      for (int k = 0; k < kVictimCollectives; ++k) {
        dp_work* w = nullptr;
        CHECK_OK(start_collective(&w));
      }
      usleep(shm ? 1000 : 20000);
      raise(stop ? SIGSTOP : SIGKILL);
    }
  }
  // The survivors go on until a collective fails: the victim's queued ones
  // may complete before it dies.
  dp_status s = DP_OK;
  double elapsed_ms = 0;
  for (int k = 0; k <= kVictimCollectives && s == DP_OK; ++k) {
    auto start = std::chrono::steady_clock::now();
    s = reduce_scatter ? dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), t, DP_SUM)
                       : dp_pg_all_reduce(pg, t, DP_SUM);
    elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  }
  std::string message = dp_last_error();
  std::printf("rank %d: status %d after %.0f ms: %s\n", rank, s, elapsed_ms, message.c_str());
  CHECK(s == DP_ETIMEOUT || s == DP_EREMOTE, "status %d", s);
  // Often at once, but a stopped rank, or a killed one that a pending send of
  // Gloo's (or NCCL) does not notice, makes the others wait out the timeout:
  // they must end by it, not hang (twice it leaves room for a loaded machine).
  CHECK(elapsed_ms < 2.0 * timeout_ms, "took %.0f ms of a %d ms timeout", elapsed_ms, timeout_ms);
  const char* collective = reduce_scatter ? "reduce_scatter" : "all_reduce";
  CHECK(message.find(collective) != std::string::npos, "names the collective: %s", message.c_str());
  std::string tensor = "float32 " + std::to_string(n);
  CHECK(message.find(tensor) != std::string::npos, "names the tensor: %s", message.c_str());
  if (victim != 0) {
    // The victim is always among the ranks named; on a loaded machine a live
    // rank still blocked in the transfer may be too, but never this one.
    std::set<int> named = named_ranks(message);
    CHECK(named.count(victim) == 1, "names the missing rank: %s", message.c_str());
    CHECK(named.count(rank) == 0, "does not name itself: %s", message.c_str());
  } else {  // rank 0 took the store with it; on shared memory its exit is seen directly
    CHECK(message.find("rank 0 serves it") != std::string::npos || message.find("rank(s) 0") != std::string::npos,
          "names rank 0: %s", message.c_str());
  }
  CHECK(dp_pg_barrier(pg) == DP_ESTATE, "a broken group refuses further collectives: %s", dp_last_error());
  dp_tensor_destroy(t);
  for (dp_tensor* in : inputs) dp_tensor_destroy(in);
  auto destroy_start = std::chrono::steady_clock::now();
  dp_process_group_destroy(pg);
  double destroy_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - destroy_start).count();
  CHECK(destroy_ms < timeout_ms / 2.0, "destroy took %.0f ms of a %d ms timeout", destroy_ms, timeout_ms);
}

// Rank 0's all_gather needs more scratch memory than can exist: it fails
// alone, before any rank hears of it, and the group carries on.
void run_oom(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg);
  if (rank == 0) {
    // Views of no real memory: the scratch buffer fails before anything is read.
    int64_t shape[1] = {int64_t(1) << 50};
    void* nowhere = reinterpret_cast<void*>(uintptr_t(1) << 12);
    dp_tensor* in = nullptr;
    dp_tensor* outs[2] = {nullptr, nullptr};
    CHECK_OK(dp_tensor_from_blob(&in, nowhere, DP_UINT8, 1, shape, g_device, nullptr, nullptr));
    for (dp_tensor*& o : outs) {
      CHECK_OK(dp_tensor_from_blob(&o, nowhere, DP_UINT8, 1, shape, g_device, nullptr, nullptr));
    }
    dp_status s = dp_pg_all_gather(pg, in, outs, 2);
    CHECK(s == DP_ENOMEM, "status %d: %s", s, dp_last_error());
    dp_tensor_destroy(in);
    for (dp_tensor* o : outs) dp_tensor_destroy(o);
  }
  dp_tensor* t = make(DP_FLOAT32, 100, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  std::vector<float> sum(100);
  CHECK_OK(dp_tensor_copy_to_host(t, sum.data(), sum.size() * sizeof(float)));
  CHECK(sum[0] == 3.0f, "all_reduce after the failure gave %f", static_cast<double>(sum[0]));
  dp_tensor_destroy(t);
}

// Rank `refuser` refuses calls that the others make correctly: a bad op on
// each payload path (inline, block exchange, Gloo's algorithm), a bad root,
// an output of another size, too few outputs, and a NULL tensor through the
// async call. Every rank's call must fail well within the timeout with
// DP_EINVAL naming the refusing rank and why; then a correct all_reduce on
// the same group must give correct values.
void run_refuse(dp_process_group* pg, int refuser, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const bool refusing = rank == refuser;
  const std::string who = "rank " + std::to_string(refuser) + " refused the call";
  using Clock = std::chrono::steady_clock;
  auto expect_refused = [&](dp_status s, Clock::time_point start, const char* what, const std::string& reason) {
    double elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    std::string m = dp_last_error();
    CHECK(s == DP_EINVAL, "%s gave %d: %s", what, s, m.c_str());
    CHECK(m.find(who) != std::string::npos, "%s names the refusing rank: %s", what, m.c_str());
    CHECK(m.find(reason) != std::string::npos, "%s gives the reason '%s': %s", what, reason.c_str(), m.c_str());
    CHECK(elapsed_ms < timeout_ms / 2.0, "%s took %.0f ms of a %d ms timeout", what, elapsed_ms, timeout_ms);
  };
  auto expect_group_works = [&](size_t n) {
    dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
    CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
    std::vector<uint8_t> sum = host(t);
    for (size_t i = 0; i < n; i += 997) {
      double want = expected(DP_FLOAT32, DP_SUM, world, i);
      CHECK(load(DP_FLOAT32, sum.data(), i) == want, "all_reduce of %zu after a refusal [%zu]: got %g want %g", n, i,
            load(DP_FLOAT32, sum.data(), i), want);
    }
    dp_tensor_destroy(t);
  };

  for (size_t n : {size_t(7), size_t(5000), size_t(140000)}) {
    dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
    auto start = Clock::now();
    dp_status s = dp_pg_all_reduce(pg, t, refusing ? 9 : DP_SUM);
    expect_refused(s, start, "bad op", "'op' is 9");
    dp_tensor_destroy(t);
    expect_group_works(n);
  }

  dp_tensor* b = make(DP_INT32, 4, rank, 0);
  auto start = Clock::now();
  dp_status s = dp_pg_broadcast(pg, b, refusing ? world : 0);
  expect_refused(s, start, "bad root", "'root' is " + std::to_string(world));
  dp_tensor_destroy(b);
  expect_group_works(100);

  // all_gather of 3000 elements; the refusing rank's outputs[0] has 2999.
  dp_tensor* in = make(DP_FLOAT32, 3000, rank, 0);
  std::vector<dp_tensor*> outs;
  for (int q = 0; q < world; ++q) outs.push_back(make(DP_FLOAT32, refusing && q == 0 ? 2999 : 3000, 0, 0));
  start = Clock::now();
  s = dp_pg_all_gather(pg, in, outs.data(), outs.size());
  expect_refused(s, start, "mismatched output size", "outputs[0] is float32 2999");
  start = Clock::now();
  s = dp_pg_all_gather(pg, in, outs.data(), refusing ? outs.size() - 1 : outs.size());
  expect_refused(s, start, "too few outputs", "'noutputs' is " + std::to_string(world - 1));
  for (dp_tensor* o : outs) dp_tensor_destroy(o);
  dp_tensor_destroy(in);
  expect_group_works(5000);

  // The async call refuses at once; the refusal still takes its place in order.
  dp_tensor* t = make(DP_FLOAT32, 100, rank, 0);
  start = Clock::now();
  dp_work* w = reinterpret_cast<dp_work*>(&s);  // must come back NULL
  s = refusing ? dp_pg_all_reduce_async(pg, nullptr, DP_SUM, &w) : dp_pg_all_reduce(pg, t, DP_SUM);
  expect_refused(s, start, "NULL tensor", "'tensor' is NULL");
  if (refusing) CHECK(w == nullptr, "a refused async call yields no work");
  dp_tensor_destroy(t);
  expect_group_works(140000);
  CHECK_OK(dp_pg_barrier(pg));
}

// An all_reduce (sum) of 1000 float32 elements whose rank-r values are
// r + 1 + tag: the sum must be world * (world + 1) / 2 + world * tag.
// Returns its status; checks the sum when it is DP_OK and `check`.
dp_status tagged_all_reduce(dp_process_group* pg, int tag, bool check, std::string* message = nullptr) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  int64_t shape[1] = {1000};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  if (t == nullptr) std::exit(3);
  auto* v = static_cast<float*>(dp_tensor_data(t));
  for (int i = 0; i < 1000; ++i) v[i] = static_cast<float>(rank + 1 + tag);
  dp_status s = dp_pg_all_reduce(pg, t, DP_SUM);
  if (message != nullptr) *message = dp_last_error();
  const float want = static_cast<float>(world * (world + 1) / 2 + world * tag);
  if (s == DP_OK && check) {
    for (int i = 0; i < 1000; i += 111)
      CHECK(v[i] == want, "all_reduce tag %d [%d]: got %g want %g", tag, i, v[i], want);
  }
  dp_tensor_destroy(t);
  return s;
}

// Rank 0 forks; its child uses the inherited group, which must refuse every
// call without a byte on the parent's connections or shared memory. Then the
// parents' collectives must still give the right sums.
void run_fork(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg);
  CHECK(tagged_all_reduce(pg, 1, true) == DP_OK, "all_reduce before the fork: %s", dp_last_error());
  if (rank == 0) {
    pid_t child = ::fork();
    if (child == 0) {
      int bad = 0;
      std::string m;
      dp_status s = tagged_all_reduce(pg, 7, false, &m);
      if (s != DP_ESTATE || m.find("forked child") == std::string::npos) {
        std::fprintf(stderr, "child: all_reduce gave %d: %s\n", s, m.c_str());
        ++bad;
      }
      dp_work* w = nullptr;
      if (dp_pg_barrier_async(pg, &w) != DP_ESTATE || w != nullptr) {
        std::fprintf(stderr, "child: barrier_async was not refused: %s\n", dp_last_error());
        ++bad;
      }
      if (dp_process_group_rank(pg) != -1) {
        std::fprintf(stderr, "child: the group's rank was answered\n");
        ++bad;
      }
      dp_process_group_destroy(pg);  // frees nothing of the parent's, and returns
      ::_exit(bad == 0 ? 0 : 1);
    }
    CHECK(child > 0, "fork failed");
    int status = 0;
    pid_t got = 0;
    for (int i = 0; i < 3000 && got == 0; ++i) {
      got = ::waitpid(child, &status, WNOHANG);
      if (got == 0) ::usleep(10000);
    }
    if (got == 0) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      CHECK(false, "the forked child did not finish within 30 s");
    } else {
      CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child's checks failed (status %d)", status);
    }
  }
  for (int tag = 2; tag < 5; ++tag) {
    CHECK(tagged_all_reduce(pg, tag, true) == DP_OK, "all_reduce %d after the fork: %s", tag, dp_last_error());
  }
  CHECK_OK(dp_pg_barrier(pg));
}

// One thread after another drives the group (each joined before the next
// starts), and one thread mixes async and sync calls: all allowed.
void run_thread_handover(dp_process_group* pg) {
  for (int tag = 0; tag < 4; ++tag) {
    std::thread([&] {
      CHECK(tagged_all_reduce(pg, tag, true) == DP_OK, "all_reduce from thread %d: %s", tag, dp_last_error());
    }).join();
  }
  const int rank = dp_process_group_rank(pg);
  int64_t shape[1] = {64};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, DP_INT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  for (int i = 0; i < 64; ++i) static_cast<int32_t*>(dp_tensor_data(t))[i] = rank + 1;
  dp_work* w = nullptr;
  CHECK_OK(dp_pg_all_reduce_async(pg, t, DP_SUM, &w));
  CHECK(tagged_all_reduce(pg, 9, true) == DP_OK, "a sync call after this thread's async one: %s", dp_last_error());
  CHECK_OK(dp_work_wait(w));
  dp_work_destroy(w);
  const int world = dp_process_group_size(pg);
  CHECK(static_cast<int32_t*>(dp_tensor_data(t))[0] == world * (world + 1) / 2, "the async sum");
  dp_tensor_destroy(t);
  CHECK_OK(dp_pg_barrier(pg));
}

// Rank 0's main thread has an async all_reduce in flight (rank 1 holds its
// own back until told) when a second thread calls: that call is refused
// naming the first, the first fails too once it ran, and every later call
// fails on every rank at once, none at its timeout.
void run_thread_overlap(dp_process_group* pg, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg);
  dp_store* store = nullptr;
  std::string path = std::string("/tmp/dp_mp_overlap_") + std::getenv("MASTER_PORT");
  CHECK_OK(dp_store_create_file(&store, path.c_str(), dp_process_group_size(pg)));
  using Clock = std::chrono::steady_clock;
  if (rank == 0) {
    int64_t shape[1] = {1000};
    dp_tensor* t = nullptr;
    CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
    for (int i = 0; i < 1000; ++i) static_cast<float*>(dp_tensor_data(t))[i] = 1.0f;  // tag 0 of rank 0
    dp_work* first = nullptr;
    CHECK_OK(dp_pg_all_reduce_async(pg, t, DP_SUM, &first));
    std::string second_message;
    dp_status second = DP_OK;
    std::thread([&] { second = tagged_all_reduce(pg, 0, false, &second_message); }).join();
    CHECK(second == DP_ESTATE, "the overlapping call gave %d: %s", second, second_message.c_str());
    CHECK(second_message.find("use one group per thread") != std::string::npos &&
              second_message.find("all_reduce (call 1 on this rank)") != std::string::npos,
          "the refusal names the call in flight: %s", second_message.c_str());
    CHECK_OK(dp_store_set(store, "overlap_refused", "1", 1));
    dp_status first_status = dp_work_wait(first);
    std::string m = dp_last_error();
    // Ran before the overlap was seen (its pairing is unknown), or after (refused in its place).
    CHECK(first_status == DP_ESTATE && (m.find("paired it with is unknown") != std::string::npos ||
                                        m.find("several threads at once") != std::string::npos),
          "the call in flight gave %d: %s", first_status, m.c_str());
    dp_work_destroy(first);
    dp_tensor_destroy(t);
  } else {
    const char* key = "overlap_refused";
    CHECK_OK(dp_store_wait(store, &key, 1, -1));
    // Paired with rank 0's call in flight, or with its refusal in that call's place.
    std::string m;
    dp_status s = tagged_all_reduce(pg, 0, true, &m);
    CHECK(s == DP_OK || (s == DP_EINVAL && m.find("rank 0 refused") != std::string::npos),
          "the peer's matching all_reduce gave %d: %s", s, m.c_str());
  }
  for (int i = 0; i < 3; ++i) {
    auto start = Clock::now();
    std::string m;
    dp_status s = tagged_all_reduce(pg, i, false, &m);
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    CHECK(s == (rank == 0 ? DP_ESTATE : DP_EINVAL), "all_reduce %d after the overlap gave %d: %s", i, s, m.c_str());
    CHECK(m.find("several threads at once") != std::string::npos, "it says why: %s", m.c_str());
    if (rank != 0) CHECK(m.find("rank 0 refused") != std::string::npos, "it names rank 0: %s", m.c_str());
    CHECK(ms < timeout_ms / 2.0, "all_reduce %d after the overlap took %.0f ms of a %d ms timeout", i, ms, timeout_ms);
  }
  dp_store_destroy(store);
  if (rank == 0) ::unlink(path.c_str());
}

// Four threads make 50 all_reduces each on one group, as a host that never
// read the thread-safety note would: the calls must end (no hang) in errors
// that say so, and the group must end unusable rather than go on pairing
// one thread's call with another's.
void run_threads(dp_process_group* pg) {
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::atomic<bool> told{false};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 50; ++i) {
        std::string m;
        dp_status s = tagged_all_reduce(pg, k, false, &m);
        if (s == DP_OK) {
          ++ok;
        } else if (s == DP_ESTATE || s == DP_EINVAL || s == DP_EREMOTE || s == DP_ETIMEOUT) {
          ++refused;
          if (m.find("one group per thread") != std::string::npos || m.find("several threads") != std::string::npos) {
            told = true;
          }
        } else {
          ++other;
          std::fprintf(stderr, "rank %d: thread %d call %d gave %d: %s\n", g_rank, k, i, s, m.c_str());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("rank %d: %d calls ok, %d refused or failed\n", g_rank, ok.load(), refused.load());
  CHECK(other == 0, "%d calls gave another status", other.load());
  CHECK(refused > 0 && told, "no call was refused for the threads (%d ok)", ok.load());
  CHECK(tagged_all_reduce(pg, 0, false) != DP_OK, "the group is still used after being driven by several threads");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: mp_worker collectives|large_reduce_scatter|mismatch|oom|refuse [rank]|die [rank]|stop [rank]|"
                 "die_reduce_scatter [rank]|stop_reduce_scatter [rank]|fork|thread_handover|thread_overlap|threads\n");
    return 2;
  }
  std::string scenario = argv[1];
  const char* rank_text = std::getenv("RANK");
  g_rank = rank_text != nullptr ? std::atoi(rank_text) : -1;
  bool failure =
      scenario == "die" || scenario == "stop" || scenario == "die_reduce_scatter" || scenario == "stop_reduce_scatter";
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  const char* device = std::getenv("DP_TEST_DEVICE");
  if (device != nullptr && std::strcmp(device, "cuda") == 0) {
    const char* local = std::getenv("LOCAL_RANK");
    g_device = dp_device{DP_DEVICE_CUDA, local != nullptr ? std::atoi(local) : 0};
    opts.backend = DP_BACKEND_NCCL;
    opts.device = g_device;
  }
  // Failure scenarios wait out their timeout, so it is shorter, yet long
  // enough for their first 64 MiB reduce_scatter on a loaded machine; "at
  // once" in the refusals is checked against half of a long one.
  int32_t timeout_ms = 60000;
  if (failure || scenario == "oom") timeout_ms = 10000;
  if (scenario == "refuse" || scenario == "thread_overlap" || scenario == "threads") timeout_ms = 20000;
  opts.timeout_ms = timeout_ms;
  dp_store* store = nullptr;
  const char* store_path = std::getenv("DP_TEST_STORE");
  if (store_path != nullptr) {
    CHECK_OK(dp_store_create_file(&store, store_path, std::atoi(std::getenv("WORLD_SIZE"))));
    opts.store = store;
  }
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    std::fprintf(stderr, "rank %d: create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  dp_store_destroy(store);  // the group keeps its own reference
  if (scenario == "collectives") {
    run_collectives(pg);
  } else if (scenario == "large_reduce_scatter") {
    run_large_reduce_scatter(pg);
  } else if (scenario == "mismatch") {
    run_mismatch(pg);
  } else if (scenario == "oom") {
    run_oom(pg);
  } else if (scenario == "refuse") {
    run_refuse(pg, argc > 2 ? std::atoi(argv[2]) : std::atoi(std::getenv("WORLD_SIZE")) - 1, timeout_ms);
  } else if (scenario == "fork") {
    run_fork(pg);
  } else if (scenario == "thread_handover") {
    run_thread_handover(pg);
  } else if (scenario == "thread_overlap") {
    run_thread_overlap(pg, timeout_ms);
  } else if (scenario == "threads") {
    run_threads(pg);
  } else if (failure) {
    int victim = argc > 2 ? std::atoi(argv[2]) : std::atoi(std::getenv("WORLD_SIZE")) - 1;
    run_failure(pg, scenario.rfind("stop", 0) == 0, scenario.find("reduce_scatter") != std::string::npos, victim,
                timeout_ms);
    pg = nullptr;
  } else {
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  dp_process_group_destroy(pg);
  if (g_failures == 0) std::printf("rank %d: %s passed\n", g_rank, scenario.c_str());
  return g_failures == 0 ? 0 : 1;
}
