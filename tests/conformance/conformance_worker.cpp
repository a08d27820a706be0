// One rank of the conformance suite (conformance_test.cpp starts world-size
// copies with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set):
//   conformance_worker SCENARIO[,SCENARIO...] [RANK]
// runs the scenarios in order on one group over the backend DP_TEST_BACKEND
// names (backends.h; default: whatever DP_BACKEND_AUTO picks). DP_TEST_STORE=
// <path> makes the group use a file store. RANK is the refusing, killed or
// stopped rank (default the last). Exit code 0 means every check passed, 3
// that the group could not be created; failures are printed.
//   collectives   every collective x op x dtype x size against expectations
//   async         the same through the async calls, all in flight at once
//   in_place      inputs and outputs that are views of one buffer
//   mismatch      sizes, dtypes, ops, roots or counts that differ: every rank
//                 gets DP_EINVAL and the group carries on
//   out_of_step   one rank calls another collective: DP_EREMOTE on every rank,
//                 and the group is broken (run it last)
//   bad_handles   NULL and wrong handles: DP_EINVAL here, nothing sent
//   refuse        RANK refuses calls for bad arguments: every rank fails at
//                 once naming it, and the group carries on
//   die|stop, die_reduce_scatter|stop_reduce_scatter
//                 RANK is killed (stops) in a large all_reduce (reduce_scatter)
//   hog_loop      many collectives, right and within the timeout (the driver
//                 runs a busy loop per core beside them)
//   oom           rank 0's all_gather runs out of memory; the group stays in step
//   fork          rank 0's forked child is refused every call on the inherited
//                 group; the parents' collectives stay right
//   thread_handover  one thread after another drives the group: allowed
//   thread_overlap   rank 0 calls from a second thread while its first
//                 thread's call is in flight: refused, and every rank fails
//   threads       4 threads x 50 all_reduces on one group: errors, never a hang
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends.h"
#include "dparallel/dparallel.h"
#include "worker_util.h"

namespace {

using namespace dptest_worker;  // NOLINT(google-build-using-namespace): the test helpers
using dptest::Backend;
using Clock = std::chrono::steady_clock;

Backend g_backend = Backend::kGloo;
dp_device g_device = {DP_DEVICE_CPU, 0};  // where the collectives' tensors live

bool on_gpu() { return g_device.type == DP_DEVICE_CUDA; }

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

const char* dtype_name(int32_t dtype) {
  for (int d = 0; d < 9; ++d) {
    if (kDtypes[d] == dtype) return kDtypeNames[d];
  }
  return "?";
}

const char* op_name(int32_t op) { return op >= DP_SUM && op <= DP_PROD ? kOpNames[op] : ""; }

// Rank r's n elements value(dtype, r, offset + i), on the group's device.
dp_tensor* make(int32_t dtype, size_t n, int r, size_t offset) {
  dp_tensor* t = host_values(dtype, n, r, offset);
  if (!on_gpu()) return t;
  int64_t shape[1] = {static_cast<int64_t>(n)};
  dp_tensor* g = nullptr;
  CHECK_OK(dp_tensor_create(&g, dtype, 1, shape, g_device));
  if (g == nullptr) std::exit(4);
  CHECK_OK(dp_tensor_copy_from_host(g, dp_tensor_data(t), dp_tensor_nbytes(t)));
  dp_tensor_destroy(t);
  return g;
}

std::vector<dp_tensor*> make_each(int32_t dtype, size_t n, int r, size_t offset_step, int count) {
  std::vector<dp_tensor*> tensors;
  for (int q = 0; q < count; ++q) tensors.push_back(make(dtype, n, r, static_cast<size_t>(q) * offset_step));
  return tensors;
}

void destroy_each(const std::vector<dp_tensor*>& tensors) {
  for (dp_tensor* t : tensors) dp_tensor_destroy(t);
}

// The tensor's bytes, readable on the host wherever it lives.
std::vector<uint8_t> host(const dp_tensor* t) {
  std::vector<uint8_t> bytes(dp_tensor_nbytes(t));
  if (!bytes.empty()) CHECK_OK(dp_tensor_copy_to_host(t, bytes.data(), bytes.size()));
  return bytes;
}

// NCCL scales float averages by 1/size, so they may differ in the last
// bits; products of six ranks pass bfloat16's 8-bit mantissa, and round by
// the order of the reduction.
bool matches(double got, double want, int32_t dtype, int32_t op) {
  if (got == want) return true;
  if (dtype == DP_BFLOAT16 && op == DP_PROD) return std::fabs(got - want) <= std::fabs(want) / 64;
  if (g_backend != Backend::kNccl || op != DP_AVG || is_integer(dtype) || dtype == DP_BOOL) return false;
  const bool narrow = dtype == DP_FLOAT16 || dtype == DP_BFLOAT16;
  return std::fabs(got - want) <= (narrow ? 1e-2 : 1e-6) * std::fabs(want);
}

// Checks t's n elements against want(i) (op < 0: no reduction); reports the first difference.
template <typename Want>
void expect_values(const dp_tensor* t, int32_t dtype, size_t n, const char* what, int32_t op, Want&& want) {
  const std::vector<uint8_t> bytes = host(t);
  for (size_t i = 0; i < n; ++i) {
    const double got = load(dtype, bytes.data(), i), w = want(i);
    if (!matches(got, w, dtype, op)) {
      CHECK(false, "%s %s %s n=%zu [%zu]: got %g want %g", what, dtype_name(dtype), op_name(op), n, i, got, w);
      return;
    }
  }
}

bool op_applies(int32_t dtype, int32_t op) { return !(dtype == DP_BOOL && op == DP_AVG); }

// Elements per tensor. Empty; inline in Gloo's call header and whole in one
// shm slot; a block exchange on Gloo and past shm's small all_reduce; Gloo's
// own algorithms and, in 8-byte dtypes, several 1 MiB shm rounds; and kLarge:
// many shm rounds in every collective, and several of Gloo's 8 MiB
// reduce_scatter segments in int64, with an odd remainder.
constexpr size_t kLarge = 1600007;
const size_t kSizes[] = {0, 7, 5000, 140000, kLarge};

// kLarge in a dtype of each size only: the checks cost more than the collectives.
bool size_applies(int32_t dtype, size_t n) {
  return n < kLarge || dtype == DP_FLOAT32 || dtype == DP_FLOAT16 || dtype == DP_INT64 || dtype == DP_BOOL;
}

// Every op on sizes that run each reduction's vector loop and its tail; two
// on larger ones, taking turns over the dtypes, where only the path differs.
std::vector<int32_t> ops_for(int d, size_t n) {
  std::vector<int32_t> ops;
  for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
    const bool taken = n <= 5000 || op == d % 5 || op == (d + 2) % 5;
    if (taken && op_applies(kDtypes[d], op)) ops.push_back(op);
  }
  return ops;
}

void run_collectives(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  for (size_t n : kSizes) {
    for (int d = 0; d < 9; ++d) {
      const int32_t dtype = kDtypes[d];
      if (!size_applies(dtype, n)) continue;
      for (int32_t op : ops_for(d, n)) {
        dp_tensor* t = make(dtype, n, rank, 0);
        CHECK_OK(dp_pg_all_reduce(pg, t, op));
        expect_values(t, dtype, n, "all_reduce", op, [&](size_t i) { return expected(dtype, op, world, i); });
        dp_tensor_destroy(t);

        std::vector<dp_tensor*> inputs = make_each(dtype, n, rank, n, world);
        dp_tensor* out = make(dtype, n, 0, 7);
        CHECK_OK(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, op));
        expect_values(out, dtype, n, "reduce_scatter", op,
                      [&](size_t i) { return expected(dtype, op, world, i + static_cast<size_t>(rank) * n); });
        destroy_each(inputs);
        dp_tensor_destroy(out);
      }
      for (int root : {0, world - 1}) {
        dp_tensor* b = make(dtype, n, rank, 0);
        CHECK_OK(dp_pg_broadcast(pg, b, root));
        expect_values(b, dtype, n, "broadcast", -1, [&](size_t i) { return value(dtype, root, i); });
        dp_tensor_destroy(b);
      }
      dp_tensor* in = make(dtype, n, rank, 0);
      std::vector<dp_tensor*> outs = make_each(dtype, n, 0, 1, world);
      CHECK_OK(dp_pg_all_gather(pg, in, outs.data(), outs.size()));
      for (int q = 0; q < world; ++q) {
        expect_values(outs[static_cast<size_t>(q)], dtype, n, "all_gather", -1,
                      [&](size_t i) { return value(dtype, q, i); });
      }
      destroy_each(outs);
      dp_tensor_destroy(in);
      CHECK_OK(dp_pg_barrier(pg));
    }
  }
}

// Every async call in flight at once, per size and dtype: an all_reduce per
// op, a reduce_scatter, a broadcast, an all_gather and a barrier, waited for
// last first. Each must give what its blocking call gives.
void run_async(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  for (size_t n : {size_t(0), size_t(7), size_t(140000), kLarge}) {
    for (int32_t dtype : kDtypes) {
      if (n == kLarge && dtype != DP_FLOAT32) continue;
      std::vector<dp_work*> works;
      dp_work* w = nullptr;  // each call's work, kept by issued()
      auto issued = [&](dp_status s, const char* what) {
        CHECK(s == DP_OK && w != nullptr, "%s_async %s n=%zu: %s", what, dtype_name(dtype), n, dp_last_error());
        works.push_back(w);
        w = nullptr;
      };
      std::vector<dp_tensor*> reduced;
      std::vector<int32_t> ops;
      for (int32_t op = DP_SUM; op <= DP_PROD; ++op) {
        if (!op_applies(dtype, op)) continue;
        reduced.push_back(make(dtype, n, rank, 0));
        ops.push_back(op);
        issued(dp_pg_all_reduce_async(pg, reduced.back(), op, &w), "all_reduce");
      }
      const int32_t scatter_op = dtype == DP_BOOL ? DP_MIN : DP_AVG;
      std::vector<dp_tensor*> inputs = make_each(dtype, n, rank, n, world);
      dp_tensor* scattered = make(dtype, n, 0, 7);
      issued(dp_pg_reduce_scatter_async(pg, inputs.data(), inputs.size(), scattered, scatter_op, &w), "reduce_scatter");
      const int root = world - 1;
      dp_tensor* b = make(dtype, n, rank, 0);
      issued(dp_pg_broadcast_async(pg, b, root, &w), "broadcast");
      dp_tensor* in = make(dtype, n, rank, 0);
      std::vector<dp_tensor*> outs = make_each(dtype, n, 0, 1, world);
      issued(dp_pg_all_gather_async(pg, in, outs.data(), outs.size(), &w), "all_gather");
      issued(dp_pg_barrier_async(pg, &w), "barrier");
      for (size_t k = works.size(); k-- > 0;) CHECK_OK(dp_work_wait(works[k]));
      for (dp_work* done_work : works) {
        int done = 0;
        CHECK_OK(dp_work_test(done_work, &done));
        CHECK(done == 1, "a waited work is done");
        dp_work_destroy(done_work);
      }
      for (size_t k = 0; k < reduced.size(); ++k) {
        const int32_t op = ops[k];
        expect_values(reduced[k], dtype, n, "all_reduce_async", op,
                      [&](size_t i) { return expected(dtype, op, world, i); });
      }
      expect_values(scattered, dtype, n, "reduce_scatter_async", scatter_op,
                    [&](size_t i) { return expected(dtype, scatter_op, world, i + static_cast<size_t>(rank) * n); });
      expect_values(b, dtype, n, "broadcast_async", -1, [&](size_t i) { return value(dtype, root, i); });
      for (int q = 0; q < world; ++q) {
        expect_values(outs[static_cast<size_t>(q)], dtype, n, "all_gather_async", -1,
                      [&](size_t i) { return value(dtype, q, i); });
      }
      destroy_each(reduced);
      destroy_each(inputs);
      destroy_each(outs);
      dp_tensor_destroy(scattered);
      dp_tensor_destroy(b);
      dp_tensor_destroy(in);
    }
  }
}

// Outputs that are consecutive views of one host buffer: this rank's input
// is its own output of an all_gather, then another rank's (overlapping the
// outputs it is gathered into), then its own input of a reduce_scatter.
void run_in_place(dp_process_group* pg) {
  if (on_gpu()) return;  // views of host memory
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const size_t n = 200003;
  std::vector<float> flat(n * static_cast<size_t>(world), -1.0f);
  for (size_t i = 0; i < n; ++i) {
    flat[static_cast<size_t>(rank) * n + i] = static_cast<float>(value(DP_FLOAT32, rank, i));
  }
  int64_t shape[1] = {static_cast<int64_t>(n)};
  std::vector<dp_tensor*> views(static_cast<size_t>(world));
  for (int q = 0; q < world; ++q) {
    CHECK_OK(dp_tensor_from_blob(&views[static_cast<size_t>(q)], flat.data() + n * static_cast<size_t>(q), DP_FLOAT32,
                                 1, shape, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr));
  }
  auto expect_flat = [&](const char* what, auto&& want) {
    for (size_t i = 0; i < flat.size(); ++i) {
      if (flat[i] != static_cast<float>(want(i))) {
        CHECK(false, "%s differs at %zu: got %g want %g", what, i, static_cast<double>(flat[i]), want(i));
        return;
      }
    }
  };
  CHECK_OK(dp_pg_all_gather(pg, views[static_cast<size_t>(rank)], views.data(), views.size()));
  expect_flat("all_gather in place", [&](size_t i) { return value(DP_FLOAT32, static_cast<int>(i / n), i % n); });
  const int other = (rank + 1) % world;
  CHECK_OK(dp_pg_all_gather(pg, views[static_cast<size_t>(other)], views.data(), views.size()));
  expect_flat("all_gather of an overlapping input",
              [&](size_t i) { return value(DP_FLOAT32, (static_cast<int>(i / n) + 1) % world, i % n); });
  for (size_t i = 0; i < flat.size(); ++i) flat[i] = static_cast<float>(value(DP_FLOAT32, rank, i));
  CHECK_OK(dp_pg_reduce_scatter(pg, views.data(), views.size(), views[static_cast<size_t>(rank)], DP_SUM));
  for (size_t i = 0; i < n; ++i) {
    const size_t at = static_cast<size_t>(rank) * n + i;
    if (flat[at] != static_cast<float>(expected(DP_FLOAT32, DP_SUM, world, at))) {
      CHECK(false, "reduce_scatter in place differs at %zu", i);
      break;
    }
  }
  destroy_each(views);
}

// An all_reduce (sum) of n float32 elements gives the right values.
void expect_group_works(dp_process_group* pg, size_t n) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  expect_values(t, DP_FLOAT32, n, "all_reduce after a failed call", DP_SUM,
                [&](size_t i) { return expected(DP_FLOAT32, DP_SUM, world, i); });
  dp_tensor_destroy(t);
}

void expect_differ(dp_status s, const char* what) {
  CHECK(s == DP_EINVAL, "%s gave %d: %s", what, s, dp_last_error());
  CHECK(std::strstr(dp_last_error(), "differ") != nullptr, "%s: %s", what, dp_last_error());
}

void run_mismatch(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const bool last = rank == world - 1;
  // Sizes that differ a little, across the small and the large paths, and
  // by whole block sizes of Gloo's block exchange (12, 32, 52 KB).
  const size_t apart[][2] = {{10, 11}, {100, 400000}, {500000, 500001}, {3000, 8000}};
  for (const auto& sizes : apart) {
    dp_tensor* t = make(DP_FLOAT32, sizes[last ? 1 : 0], rank, 0);
    expect_differ(dp_pg_all_reduce(pg, t, DP_SUM), "all_reduce of different sizes");
    dp_tensor_destroy(t);
    // Each size on every rank: the refused call left the transfers in step.
    expect_group_works(pg, sizes[0]);
    expect_group_works(pg, sizes[1]);
  }
  dp_tensor* t = make(last ? DP_INT32 : DP_FLOAT32, 1000, rank, 0);
  expect_differ(dp_pg_all_reduce(pg, t, DP_SUM), "all_reduce of different dtypes");
  dp_tensor_destroy(t);
  t = make(DP_FLOAT32, 1000, rank, 0);
  expect_differ(dp_pg_all_reduce(pg, t, last ? DP_MAX : DP_SUM), "all_reduce of different ops");
  expect_differ(dp_pg_broadcast(pg, t, rank), "broadcast from different roots");
  dp_tensor_destroy(t);

  dp_tensor* in = make(DP_INT32, last ? 3 : 4, rank, 0);
  std::vector<dp_tensor*> outs = make_each(DP_INT32, last ? 3 : 4, 0, 0, world);
  expect_differ(dp_pg_all_gather(pg, in, outs.data(), outs.size()), "all_gather of different counts");
  destroy_each(outs);
  dp_tensor_destroy(in);

  const size_t n = last ? 3001 : 3000;
  std::vector<dp_tensor*> inputs = make_each(DP_FLOAT32, n, rank, n, world);
  dp_tensor* out = make(DP_FLOAT32, n, 0, 0);
  expect_differ(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, DP_SUM),
                "reduce_scatter of different sizes");
  destroy_each(inputs);
  dp_tensor_destroy(out);
  inputs = make_each(DP_FLOAT32, 3000, rank, 3000, world);
  out = make(DP_FLOAT32, 3000, 0, 0);
  expect_differ(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, last ? DP_MIN : DP_SUM),
                "reduce_scatter of different ops");
  destroy_each(inputs);
  dp_tensor_destroy(out);
  expect_group_works(pg, 300000);
  CHECK_OK(dp_pg_barrier(pg));
}

// The last rank calls a barrier where the others all-reduce; with three
// ranks or more rank 1's size differs too. Every rank must see the rank out
// of step, which breaks the group, rather than some seeing only the size.
void run_out_of_step(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  dp_status s;
  if (rank == world - 1) {
    s = dp_pg_barrier(pg);
  } else {
    dp_tensor* t = make(DP_FLOAT32, rank == 1 ? 20 : 10, rank, 0);
    s = dp_pg_all_reduce(pg, t, DP_SUM);
    dp_tensor_destroy(t);
  }
  CHECK(s == DP_EREMOTE, "out of step gave %d: %s", s, dp_last_error());
  CHECK(std::strstr(dp_last_error(), "same order") != nullptr, "message: %s", dp_last_error());
  CHECK(dp_pg_barrier(pg) == DP_ESTATE, "the group is broken afterwards: %s", dp_last_error());
}

// Handles that are NULL or of another kind: DP_EINVAL on this rank alone,
// before anything is sent, so the group stays in step.
void run_bad_handles(dp_process_group* pg) {
  dp_tensor* t = make(DP_FLOAT32, 10, dp_process_group_rank(pg), 0);
  dp_work* w = reinterpret_cast<dp_work*>(t);  // must come back NULL
  CHECK(dp_pg_all_reduce(nullptr, t, DP_SUM) == DP_EINVAL, "all_reduce on no group: %s", dp_last_error());
  CHECK(std::strstr(dp_last_error(), "pg") != nullptr, "names the argument: %s", dp_last_error());
  CHECK(dp_pg_all_reduce_async(nullptr, t, DP_SUM, &w) == DP_EINVAL && w == nullptr, "all_reduce_async on no group");
  CHECK(dp_pg_broadcast(nullptr, t, 0) == DP_EINVAL, "broadcast on no group");
  CHECK(dp_pg_barrier(nullptr) == DP_EINVAL, "barrier on no group");
  CHECK(dp_pg_barrier_async(nullptr, &w) == DP_EINVAL && w == nullptr, "barrier_async on no group");
  CHECK(dp_process_group_rank(nullptr) == -1 && dp_process_group_size(nullptr) == -1, "rank and size of no group");
  CHECK(dp_process_group_backend(nullptr) == nullptr, "backend of no group");
  // A handle of another kind is told apart from a group, and a group from a work.
  CHECK(dp_pg_barrier(reinterpret_cast<dp_process_group*>(t)) == DP_EINVAL, "barrier on a tensor handle");
  CHECK(dp_work_wait(reinterpret_cast<dp_work*>(pg)) == DP_EINVAL, "wait on a group handle");
  CHECK(dp_work_wait(nullptr) == DP_EINVAL, "wait on no work");
  int done = 0;
  CHECK(dp_work_test(nullptr, &done) == DP_EINVAL, "test on no work");
  CHECK_OK(dp_pg_barrier_async(pg, &w));
  CHECK(dp_work_test(w, nullptr) == DP_EINVAL, "test without a result");
  CHECK_OK(dp_work_wait(w));
  dp_work_destroy(w);
  dp_work_destroy(nullptr);
  dp_tensor_destroy(t);
  expect_group_works(pg, 5000);
}

// Rank `refuser` refuses calls that the others make correctly: a bad op on
// each payload path, a bad root, an output of another size, too few outputs
// or inputs, and a NULL tensor through the async call. Every rank's call
// fails well within the timeout with DP_EINVAL naming the refusing rank and
// why; then a correct all_reduce on the same group gives correct values.
void run_refuse(dp_process_group* pg, int refuser, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const bool refusing = rank == refuser;
  const std::string who = "rank " + std::to_string(refuser) + " refused the call";
  auto expect_refused = [&](dp_status s, Clock::time_point start, const char* what, const std::string& reason) {
    const double elapsed_ms = ms_since(start);
    std::string m = dp_last_error();
    CHECK(s == DP_EINVAL, "%s gave %d: %s", what, s, m.c_str());
    CHECK(m.find(who) != std::string::npos, "%s names the refusing rank: %s", what, m.c_str());
    CHECK(m.find(reason) != std::string::npos, "%s gives the reason '%s': %s", what, reason.c_str(), m.c_str());
    CHECK(elapsed_ms < timeout_ms / 2.0, "%s took %.0f ms of a %d ms timeout", what, elapsed_ms, timeout_ms);
  };

  for (size_t n : {size_t(7), size_t(5000), size_t(140000)}) {
    dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
    auto start = Clock::now();
    expect_refused(dp_pg_all_reduce(pg, t, refusing ? 9 : DP_SUM), start, "bad op", "'op' is 9");
    dp_tensor_destroy(t);
    expect_group_works(pg, n);
  }

  dp_tensor* b = make(DP_INT32, 4, rank, 0);
  auto start = Clock::now();
  expect_refused(dp_pg_broadcast(pg, b, refusing ? world : 0), start, "bad root", "'root' is " + std::to_string(world));
  dp_tensor_destroy(b);
  expect_group_works(pg, 100);

  // all_gather of 3000 elements; the refusing rank's outputs[0] has 2999.
  dp_tensor* in = make(DP_FLOAT32, 3000, rank, 0);
  std::vector<dp_tensor*> outs;
  for (int q = 0; q < world; ++q) outs.push_back(make(DP_FLOAT32, refusing && q == 0 ? 2999 : 3000, 0, 0));
  start = Clock::now();
  expect_refused(dp_pg_all_gather(pg, in, outs.data(), outs.size()), start, "mismatched output size",
                 "outputs[0] is float32 2999");
  start = Clock::now();
  expect_refused(dp_pg_all_gather(pg, in, outs.data(), refusing ? outs.size() - 1 : outs.size()), start,
                 "too few outputs", "'noutputs' is " + std::to_string(world - 1));
  destroy_each(outs);
  dp_tensor_destroy(in);
  expect_group_works(pg, 5000);

  std::vector<dp_tensor*> inputs = make_each(DP_FLOAT32, 3000, rank, 3000, world);
  dp_tensor* out = make(DP_FLOAT32, 3000, 0, 0);
  start = Clock::now();
  expect_refused(dp_pg_reduce_scatter(pg, inputs.data(), refusing ? inputs.size() - 1 : inputs.size(), out, DP_SUM),
                 start, "too few inputs", "'ninputs' is " + std::to_string(world - 1));
  start = Clock::now();
  expect_refused(dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), out, refusing ? -1 : DP_SUM), start,
                 "reduce_scatter with a bad op", "'op' is -1");
  destroy_each(inputs);
  dp_tensor_destroy(out);

  // The async call refuses at once; the refusal still takes its place in order.
  dp_tensor* t = make(DP_FLOAT32, 100, rank, 0);
  start = Clock::now();
  dp_work* w = reinterpret_cast<dp_work*>(t);  // must come back NULL
  dp_status s = refusing ? dp_pg_all_reduce_async(pg, nullptr, DP_SUM, &w) : dp_pg_all_reduce(pg, t, DP_SUM);
  expect_refused(s, start, "NULL tensor", "'tensor' is NULL");
  if (refusing) CHECK(w == nullptr, "a refused async call yields no work");
  dp_tensor_destroy(t);
  expect_group_works(pg, 140000);
  CHECK_OK(dp_pg_barrier(pg));
}

// The ranks listed after "rank(s) " in a failure message.
std::set<int> named_ranks(const std::string& message) {
  std::set<int> ranks;
  const size_t at = message.find("rank(s) ");
  if (at == std::string::npos) return ranks;
  const char* p = message.c_str() + at + 8;
  for (;;) {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    if (end == p) break;
    ranks.insert(static_cast<int>(r));
    if (end[0] != ',' || end[1] != ' ') break;
    p = end + 2;
  }
  return ranks;
}

// Shared memory watches its peers' pids: a dead one fails the others long
// before the timeout. Gloo and NCCL may notice only by the timeout.
bool notices_dead_peers() { return g_backend == Backend::kShm || g_backend == Backend::kHierarchical; }

// The store-serving rank stays until every survivor has its verdict: gone,
// it would leave the others unable to ask the store who is missing.
void wait_for_survivors(int rank, int victim, int world, int32_t timeout_ms) {
  if (victim == 0) return;
  dp_store* store = nullptr;
  const std::string path = std::string("/tmp/dp_verdicts_") + std::getenv("MASTER_PORT");
  CHECK_OK(dp_store_create_file(&store, path.c_str(), world - 1));
  if (store == nullptr) return;
  int64_t verdicts = 0;
  CHECK_OK(dp_store_add(store, "verdicts", 1, &verdicts));
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (rank == 0 && verdicts < world - 1 && Clock::now() < until) {
    usleep(10000);
    CHECK_OK(dp_store_add(store, "verdicts", 0, &verdicts));
  }
  dp_store_destroy(store);
}

// How many collectives a victim that dies mid-transfer queues before it dies.
constexpr int kVictimCollectives = 3;

// The victim queues large collectives and dies (or stops) a moment into
// them; the others go on until theirs fails, which must happen by the
// bound, name the collective, the tensor and the victim, break the group,
// and leave it destroyable.
void run_failure(dp_process_group* pg, bool stop, bool reduce_scatter, int victim, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  // 32 MiB to all-reduce, or 16 MiB parts to reduce-scatter (two of Gloo's
  // segments): the exit lands mid-transfer. A stopped rank only needs the
  // others to be waiting: 4 MiB parts start quickly within a short timeout.
  const size_t n = reduce_scatter ? (stop ? 1u << 20 : 4u << 20) : 8u << 20;
  dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
  std::vector<dp_tensor*> inputs;
  if (reduce_scatter) inputs = make_each(DP_FLOAT32, n, rank, 0, world);
  auto collective = [&](dp_work** w) {
    if (w == nullptr) {
      return reduce_scatter ? dp_pg_reduce_scatter(pg, inputs.data(), inputs.size(), t, DP_SUM)
                            : dp_pg_all_reduce(pg, t, DP_SUM);
    }
    return reduce_scatter ? dp_pg_reduce_scatter_async(pg, inputs.data(), inputs.size(), t, DP_SUM, w)
                          : dp_pg_all_reduce_async(pg, t, DP_SUM, w);
  };
  // A first one allocates the scratch on every rank, so that the victim's
  // exit lands in the transfer rather than before the header exchange.
  CHECK_OK(collective(nullptr));
  CHECK_OK(dp_pg_barrier(pg));
  if (rank == victim) {
    if (on_gpu()) raise(SIGKILL);  // NCCL would finish 32 MiB before a delay ends: die before it starts
    for (int k = 0; k < kVictimCollectives; ++k) {
      dp_work* w = nullptr;
      CHECK_OK(collective(&w));
    }
    // Shared memory may finish 32 MiB in less than Gloo takes to start it.
    usleep(notices_dead_peers() ? 1000 : 20000);
    raise(stop ? SIGSTOP : SIGKILL);
    pause();  // continued (SIGCONT) only to be killed
  }
  // The victim's queued collectives may complete before it dies.
  dp_status s = DP_OK;
  double elapsed_ms = 0;
  for (int k = 0; k <= kVictimCollectives && s == DP_OK; ++k) {
    auto start = Clock::now();
    s = collective(nullptr);
    elapsed_ms = ms_since(start);
  }
  const std::string message = dp_last_error();
  std::printf("rank %d: status %d after %.0f ms: %s\n", rank, s, elapsed_ms, message.c_str());
  if (!stop && notices_dead_peers()) {
    CHECK(s == DP_EREMOTE, "status %d", s);
    CHECK(elapsed_ms < timeout_ms / 2.0, "a dead peer took %.0f ms of a %d ms timeout", elapsed_ms, timeout_ms);
  } else {
    // A stopped rank, or a killed one that a pending send does not notice,
    // makes the others wait out the timeout: they must end by it, not hang
    // (twice it leaves room for a loaded machine).
    CHECK(s == DP_ETIMEOUT || s == DP_EREMOTE, "status %d", s);
    CHECK(elapsed_ms < 2.0 * timeout_ms, "took %.0f ms of a %d ms timeout", elapsed_ms, timeout_ms);
  }
  const char* name = reduce_scatter ? "reduce_scatter" : "all_reduce";
  CHECK(message.find(name) != std::string::npos, "names the collective: %s", message.c_str());
  const std::string tensor = "float32 " + std::to_string(n);
  CHECK(message.find(tensor) != std::string::npos, "names the tensor: %s", message.c_str());
  const std::set<int> named = named_ranks(message);
  const std::string gone = "rank " + std::to_string(victim) + " (pid";
  // On a loaded machine a live rank still in the transfer may be named too, but never this one.
  CHECK(named.count(victim) == 1 || message.find(gone) != std::string::npos ||
            (victim == 0 && message.find("rank 0 serves it") != std::string::npos),
        "names rank %d: %s", victim, message.c_str());
  CHECK(named.count(rank) == 0, "does not name itself: %s", message.c_str());
  CHECK(dp_pg_barrier(pg) == DP_ESTATE, "a broken group refuses further collectives: %s", dp_last_error());
  wait_for_survivors(rank, victim, world, timeout_ms);
  dp_tensor_destroy(t);
  destroy_each(inputs);
  auto destroy_start = Clock::now();
  dp_process_group_destroy(pg);
  const double destroy_ms = ms_since(destroy_start);
  CHECK(destroy_ms < timeout_ms / 2.0, "destroy took %.0f ms of a %d ms timeout", destroy_ms, timeout_ms);
}

// Collectives of every payload path, each checked, as a loaded machine runs
// them: waits that spin forever starve the rank they wait for.
void run_hog_loop(dp_process_group* pg, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const size_t sizes[] = {7, 12000, 300007};
  auto start = Clock::now();
  for (int i = 0; i < 150 && g_failures == 0; ++i) {
    const size_t n = sizes[i % 3];
    dp_tensor* t = make(DP_FLOAT32, n, rank, 0);
    CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
    expect_values(t, DP_FLOAT32, n, "all_reduce beside the hog", DP_SUM,
                  [&](size_t k) { return expected(DP_FLOAT32, DP_SUM, world, k); });
    dp_tensor_destroy(t);
    if (i % 10 == 0) CHECK_OK(dp_pg_barrier(pg));
  }
  const double elapsed_ms = ms_since(start);
  std::printf("rank %d: 150 all_reduces beside the hog in %.0f ms\n", rank, elapsed_ms);
  CHECK(elapsed_ms < timeout_ms / 2.0, "took %.0f ms of a %d ms timeout", elapsed_ms, timeout_ms);
}

// Rank 0's all_gather needs more scratch memory than can exist: it fails
// alone, before any rank hears of it, and the group carries on.
void run_oom(dp_process_group* pg) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  if (rank == 0) {
    // Views of no real memory: the scratch buffer fails before anything is read.
    int64_t shape[1] = {int64_t(1) << 50};
    void* nowhere = reinterpret_cast<void*>(uintptr_t(1) << 12);
    dp_tensor* in = nullptr;
    std::vector<dp_tensor*> outs(static_cast<size_t>(world));
    CHECK_OK(dp_tensor_from_blob(&in, nowhere, DP_UINT8, 1, shape, g_device, nullptr, nullptr));
    for (dp_tensor*& o : outs)
      CHECK_OK(dp_tensor_from_blob(&o, nowhere, DP_UINT8, 1, shape, g_device, nullptr, nullptr));
    const dp_status s = dp_pg_all_gather(pg, in, outs.data(), outs.size());
    CHECK(s == DP_ENOMEM, "status %d: %s", s, dp_last_error());
    dp_tensor_destroy(in);
    destroy_each(outs);
  }
  expect_group_works(pg, 100);
}

// An all_reduce (sum) of 1000 float32 elements whose rank-r values are
// r + 1 + tag: the sum must be world * (world + 1) / 2 + world * tag.
// Returns its status; checks the sum when it is DP_OK and `check`.
dp_status tagged_all_reduce(dp_process_group* pg, int tag, bool check, std::string* message = nullptr) {
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  int64_t shape[1] = {1000};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  if (t == nullptr) std::exit(4);
  auto* v = static_cast<float*>(dp_tensor_data(t));
  for (int i = 0; i < 1000; ++i) v[i] = static_cast<float>(rank + 1 + tag);
  const dp_status s = dp_pg_all_reduce(pg, t, DP_SUM);
  if (message != nullptr) *message = dp_last_error();
  const auto want = static_cast<float>(world * (world + 1) / 2 + world * tag);
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
    const pid_t child = ::fork();
    if (child == 0) {
      int bad = 0;
      std::string m;
      const dp_status s = tagged_all_reduce(pg, 7, false, &m);
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
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  int64_t shape[1] = {64};
  dp_tensor* t = nullptr;
  CHECK_OK(dp_tensor_create(&t, DP_INT32, 1, shape, dp_device{DP_DEVICE_CPU, 0}));
  for (int i = 0; i < 64; ++i) static_cast<int32_t*>(dp_tensor_data(t))[i] = rank + 1;
  dp_work* w = nullptr;
  CHECK_OK(dp_pg_all_reduce_async(pg, t, DP_SUM, &w));
  CHECK(tagged_all_reduce(pg, 9, true) == DP_OK, "a sync call after this thread's async one: %s", dp_last_error());
  CHECK_OK(dp_work_wait(w));
  dp_work_destroy(w);
  CHECK(static_cast<int32_t*>(dp_tensor_data(t))[0] == world * (world + 1) / 2, "the async sum");
  dp_tensor_destroy(t);
  CHECK_OK(dp_pg_barrier(pg));
}

// Rank 0's main thread has an async all_reduce in flight (the others hold
// theirs back until told) when a second thread calls: that call is refused
// naming the first, the first fails too once it ran, and every later call
// fails on every rank at once, none at its timeout.
void run_thread_overlap(dp_process_group* pg, int32_t timeout_ms) {
  const int rank = dp_process_group_rank(pg);
  dp_store* store = nullptr;
  const std::string path = std::string("/tmp/dp_overlap_") + std::getenv("MASTER_PORT");
  CHECK_OK(dp_store_create_file(&store, path.c_str(), dp_process_group_size(pg)));
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
    const dp_status first_status = dp_work_wait(first);
    const std::string m = dp_last_error();
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
    const dp_status s = tagged_all_reduce(pg, 0, true, &m);
    CHECK(s == DP_OK || (s == DP_EINVAL && m.find("rank 0 refused") != std::string::npos),
          "the peer's matching all_reduce gave %d: %s", s, m.c_str());
  }
  for (int i = 0; i < 3; ++i) {
    auto start = Clock::now();
    std::string m;
    const dp_status s = tagged_all_reduce(pg, i, false, &m);
    const double ms = ms_since(start);
    CHECK(s == (rank == 0 ? DP_ESTATE : DP_EINVAL), "all_reduce %d after the overlap gave %d: %s", i, s, m.c_str());
    CHECK(m.find("several threads at once") != std::string::npos, "it says why: %s", m.c_str());
    if (rank != 0) CHECK(m.find("rank 0 refused") != std::string::npos, "it names rank 0: %s", m.c_str());
    CHECK(ms < timeout_ms / 2.0, "all_reduce %d after the overlap took %.0f ms of a %d ms timeout", i, ms, timeout_ms);
  }
  dp_store_destroy(store);
  if (rank == 0) ::unlink(path.c_str());
}

// Four threads make up to 500 all_reduces each on one group, started
// together, as a host that never read the thread-safety note would: the
// calls must end (no hang) in errors that say so, and the group must end
// unusable rather than go on pairing one thread's call with another's.
// Calls that happen not to overlap are allowed, and a fast backend finishes
// one in microseconds, while a spinning thread keeps its rank's others off
// the CPU: so the other ranks start only once rank 0 saw a call refused,
// which they make sure of by holding back while rank 0's first call waits
// in the collective.
void run_threads(dp_process_group* pg) {
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::atomic<bool> told{false};
  std::atomic<int> ready{0};
  dp_store* store = nullptr;
  const std::string path = std::string("/tmp/dp_threads_") + std::getenv("MASTER_PORT");
  CHECK_OK(dp_store_create_file(&store, path.c_str(), dp_process_group_size(pg)));
  const char* key = "threads_refused";
  if (g_rank != 0) CHECK_OK(dp_store_wait(store, &key, 1, -1));
  std::atomic<bool> announced{false};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      ready.fetch_add(1);
      while (ready.load() < 4) std::this_thread::yield();
      for (int i = 0; i < 500 && !told.load(); ++i) {
        std::string m;
        const dp_status s = tagged_all_reduce(pg, k, false, &m);
        if (s == DP_OK) {
          ++ok;
        } else if (s == DP_ESTATE || s == DP_EINVAL || s == DP_EREMOTE || s == DP_ETIMEOUT) {
          ++refused;
          if (m.find("one group per thread") != std::string::npos || m.find("several threads") != std::string::npos) {
            told = true;
            if (g_rank == 0 && !announced.exchange(true)) dp_store_set(store, key, "1", 1);
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
  dp_store_destroy(store);
  if (g_rank == 0) ::unlink(path.c_str());
}

bool is_failure(const std::string& scenario) { return scenario.rfind("die", 0) == 0 || scenario.rfind("stop", 0) == 0; }

// Failure scenarios wait out their timeout, so it is short, yet long enough
// for a first large collective on a loaded machine; a dead peer on shared
// memory is asserted against half of the default one; "at once" in the
// refusals is checked against half of a long one.
int32_t timeout_for(const std::string& scenario) {
  if (scenario.rfind("die", 0) == 0) return notices_dead_peers() ? 60000 : 10000;
  if (scenario.rfind("stop", 0) == 0) return 5000;
  if (scenario == "oom") return 10000;
  if (scenario == "refuse" || scenario == "thread_overlap" || scenario == "threads") return 20000;
  return 60000;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: conformance_worker SCENARIO[,SCENARIO...] [RANK]\n");
    return 2;
  }
  std::vector<std::string> scenarios;
  std::istringstream list(argv[1]);
  for (std::string s; std::getline(list, s, ',');) scenarios.push_back(s);
  const char* rank_text = std::getenv("RANK");
  const char* world_text = std::getenv("WORLD_SIZE");
  const char* local_text = std::getenv("LOCAL_RANK");
  g_rank = rank_text != nullptr ? std::atoi(rank_text) : -1;
  const int world = world_text != nullptr ? std::atoi(world_text) : 1;
  const int chosen = argc > 2 ? std::atoi(argv[2]) : world - 1;

  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  const char* backend = std::getenv("DP_TEST_BACKEND");
  if (backend != nullptr) {
    if (!dptest::backend_from_name(backend, &g_backend)) {
      std::fprintf(stderr, "unknown backend '%s'\n", backend);
      return 2;
    }
    dptest::select_backend(g_backend, g_rank, world, local_text != nullptr ? std::atoi(local_text) : 0, &opts);
    g_device = opts.device;
  }
  int32_t timeout_ms = 60000;
  for (const std::string& s : scenarios) timeout_ms = std::min(timeout_ms, timeout_for(s));
  opts.timeout_ms = timeout_ms;
  dp_store* store = nullptr;
  const char* store_path = std::getenv("DP_TEST_STORE");
  if (store_path != nullptr) {
    CHECK_OK(dp_store_create_file(&store, store_path, world));
    opts.store = store;
  }
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    std::fprintf(stderr, "rank %d: create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  dp_store_destroy(store);  // the group keeps its own reference
  if (backend != nullptr) {
    const char* reported = dp_process_group_backend(pg);
    CHECK(reported != nullptr && std::strcmp(reported, dptest::reported_backend(g_backend)) == 0,
          "the group runs over %s, not %s", reported != nullptr ? reported : "(null)",
          dptest::reported_backend(g_backend));
  }
  const std::map<std::string, std::function<void()>> runs = {
      {"collectives", [&] { run_collectives(pg); }},
      {"async", [&] { run_async(pg); }},
      {"in_place", [&] { run_in_place(pg); }},
      {"mismatch", [&] { run_mismatch(pg); }},
      {"out_of_step", [&] { run_out_of_step(pg); }},
      {"bad_handles", [&] { run_bad_handles(pg); }},
      {"refuse", [&] { run_refuse(pg, chosen, timeout_ms); }},
      {"hog_loop", [&] { run_hog_loop(pg, timeout_ms); }},
      {"oom", [&] { run_oom(pg); }},
      {"fork", [&] { run_fork(pg); }},
      {"thread_handover", [&] { run_thread_handover(pg); }},
      {"thread_overlap", [&] { run_thread_overlap(pg, timeout_ms); }},
      {"threads", [&] { run_threads(pg); }},
  };
  for (const std::string& scenario : scenarios) {
    if (is_failure(scenario)) {
      run_failure(pg, scenario.rfind("stop", 0) == 0, scenario.find("reduce_scatter") != std::string::npos, chosen,
                  timeout_ms);
      pg = nullptr;  // destroyed there
      break;
    }
    auto run = runs.find(scenario);
    if (run == runs.end()) {
      std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
      return 2;
    }
    run->second();
  }
  dp_process_group_destroy(pg);
  if (g_failures == 0) std::printf("rank %d: %s passed\n", g_rank, argv[1]);
  return g_failures == 0 ? 0 : 1;
}
