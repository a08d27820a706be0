/* One rank of the DDP tests. ddp_test.cpp starts world-size copies with
 * RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and DP_TEST_DIR (a folder for
 * files) set. Plain C99 over the public headers, the way a host would use
 * dparallel: the host owns the net (3 x Linear(2,2), ReLU between, PyTorch's
 * composable-replicate test net), runs forward and backward by hand and marks
 * each gradient ready as it is produced.
 *   ddp_worker SCENARIO
 * Exit code 0 and "rank R: SCENARIO passed" when every check passed; every
 * failed check is printed with its line, and every expected error's message
 * is printed so that the driver can check it too. */
#define _POSIX_C_SOURCE 200809L

#include <dlpack/dlpack.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "c_worker_check.h"

/* Checks a call's status and that its message contains each of the
 * NULL-terminated `needles`; prints the message for the driver. Must run
 * right after the call, before any other dparallel call. */
static void expect_error(int line, const char *what, dp_status got, dp_status want, const char *const *needles) {
  const char *message = dp_last_error();
  printf("rank %d: %s: status %d (%s): %s\n", g_rank, what, (int)got, dp_status_string(got), message);
  if (got != want) {
    fprintf(stderr, "rank %d: line %d: %s: status %d (%s), want %d (%s); message: %s\n", g_rank, line, what, (int)got,
            dp_status_string(got), (int)want, dp_status_string(want), message);
    ++g_failures;
    return;
  }
  for (; *needles != NULL; ++needles) {
    if (strstr(message, *needles) == NULL) {
      fprintf(stderr, "rank %d: line %d: %s: message does not mention '%s': %s\n", g_rank, line, what, *needles,
              message);
      ++g_failures;
    }
  }
}
#define EXPECT_ERROR(what, expr, want, ...) \
  expect_error(__LINE__, what, (expr), want, (const char *const[]){__VA_ARGS__, NULL})

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&ts, NULL);
}

/* ---- deterministic numbers ---- */

static uint32_t rng_next(uint64_t *state) {
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (uint32_t)(*state >> 33);
}

/* Uniform in [-bound, bound). */
static float rng_uniform(uint64_t *state, float bound) {
  return bound * (2.0f * (float)(rng_next(state) & 0xFFFFFF) / 16777216.0f - 1.0f);
}

/* ---- the net: fc1, fc2, fc3, each Linear(2,2) ---- */

enum { NP = 6, MAXN = 8 };
static const char *const kParam[NP] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"};
static const char *const kLayer[3] = {"fc1", "fc2", "fc3"};
static const char *const kLocal[2] = {"weight", "bias"};
/* The order autograd produces gradients in: the last layer's first. */
static const int kReverse[NP] = {5, 4, 3, 2, 1, 0};
#define ALL_PARAMS 0x3Fu

static int param_numel(int p) { return p % 2 == 0 ? 4 : 2; }

/* Parameter (or gradient) values: v[p] holds weight p (row-major out x in)
 * or bias p in its first two entries. */
typedef struct Params {
  float v[NP][4];
} Params;

typedef struct Net {
  dp_module *root;
} Net;

static dp_tensor *new_tensor(int32_t ndim, int64_t d0, int64_t d1) {
  int64_t shape[2];
  dp_tensor *t = NULL;
  shape[0] = d0;
  shape[1] = d1;
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, ndim, shape, (dp_device){DP_DEVICE_CPU, 0}));
  if (t == NULL) exit(3);
  return t;
}

static void fill_uniform(dp_tensor *t, uint64_t *state, float bound) {
  float *v = (float *)dp_tensor_data(t);
  int64_t n = dp_tensor_numel(t);
  int64_t i;
  for (i = 0; i < n; ++i) v[i] = rng_uniform(state, bound);
}

/* Linear's init bound 1/sqrt(in_features) from `seed`. `fc2_rows` other than
 * 2 gives fc2.weight another shape (the mismatch scenarios); `with_buffer`
 * adds a persistent buffer "running" (2 floats) to the root. */
static void net_create(Net *net, uint64_t seed, int64_t fc2_rows, int with_buffer) {
  uint64_t state = seed * 2654435761ULL + 12345ULL;
  int l;
  CHECK_OK(dp_module_create(&net->root));
  if (net->root == NULL) exit(3);
  for (l = 0; l < 3; ++l) {
    dp_module *fc = NULL;
    dp_tensor *w = new_tensor(2, l == 1 ? fc2_rows : 2, 2);
    dp_tensor *b = new_tensor(1, 2, 0);
    fill_uniform(w, &state, 0.70710678f);
    fill_uniform(b, &state, 0.70710678f);
    CHECK_OK(dp_module_create(&fc));
    CHECK_OK(dp_module_register_parameter(fc, "weight", w, 1));
    CHECK_OK(dp_module_register_parameter(fc, "bias", b, 1));
    CHECK_OK(dp_module_register_module(net->root, kLayer[l], fc));
    dp_tensor_destroy(w);
    dp_tensor_destroy(b);
    dp_module_destroy(fc);
  }
  if (with_buffer) {
    dp_tensor *buf = new_tensor(1, 2, 0);
    fill_uniform(buf, &state, 10.0f);
    CHECK_OK(dp_module_register_buffer(net->root, "running", buf, 1));
    dp_tensor_destroy(buf);
  }
}

static void net_destroy(Net *net) {
  dp_module_destroy(net->root);
  net->root = NULL;
}

/* Copies between a module tensor and a host array, checking its size. */
static void copy_out(const dp_tensor *t, float *dst, int n, const char *name) {
  CHECK(t != NULL && dp_tensor_numel(t) == n, "%s holds %lld elements, want %d", name,
        t == NULL ? -1LL : (long long)dp_tensor_numel(t), n);
  if (t != NULL && dp_tensor_numel(t) == n) memcpy(dst, dp_tensor_data(t), (size_t)n * sizeof(float));
}

static void net_get(const Net *net, Params *out) {
  int p;
  memset(out, 0, sizeof(*out));
  for (p = 0; p < NP; ++p) {
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_get_parameter(net->root, kParam[p], &t));
    copy_out(t, out->v[p], param_numel(p), kParam[p]);
    dp_tensor_destroy(t);
  }
}

static void net_set(Net *net, const Params *in) {
  int p;
  for (p = 0; p < NP; ++p) {
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_get_parameter(net->root, kParam[p], &t));
    if (t != NULL) CHECK_OK(dp_tensor_copy_from_host(t, in->v[p], (size_t)param_numel(p) * sizeof(float)));
    dp_tensor_destroy(t);
  }
}

/* Gradients are fetched afresh each time: with gradient_as_bucket_view the
 * module's gradient tensors change when the buckets are rebuilt. */
static float *grad_data(Net *net, const char *name, dp_tensor **handle) {
  *handle = NULL;
  CHECK_OK(dp_module_grad(net->root, name, handle));
  if (*handle == NULL) exit(3);
  return (float *)dp_tensor_data(*handle);
}

static void grads_get(Net *net, Params *out) {
  int p;
  memset(out, 0, sizeof(*out));
  for (p = 0; p < NP; ++p) {
    dp_tensor *g = NULL;
    CHECK_OK(dp_module_grad(net->root, kParam[p], &g));
    copy_out(g, out->v[p], param_numel(p), kParam[p]);
    dp_tensor_destroy(g);
  }
}

/* What a host's autograd does: grad += value. */
static void grad_add(Net *net, int p, const float *value) {
  dp_tensor *g = NULL;
  float *d = grad_data(net, kParam[p], &g);
  int i;
  for (i = 0; i < param_numel(p); ++i) d[i] += value[i];
  dp_tensor_destroy(g);
}

static void grad_fill(Net *net, int p, float value) {
  dp_tensor *g = NULL;
  float *d = grad_data(net, kParam[p], &g);
  int i;
  for (i = 0; i < param_numel(p); ++i) d[i] = value;
  dp_tensor_destroy(g);
}

static void buffer_get(const Net *net, float out[2]) {
  dp_tensor *t = NULL;
  CHECK_OK(dp_module_get_buffer(net->root, "running", &t));
  copy_out(t, out, 2, "running");
  dp_tensor_destroy(t);
}

static void buffer_set(Net *net, float a, float b) {
  dp_tensor *t = NULL;
  float v[2];
  v[0] = a;
  v[1] = b;
  CHECK_OK(dp_module_get_buffer(net->root, "running", &t));
  if (t != NULL) CHECK_OK(dp_tensor_copy_from_host(t, v, sizeof(v)));
  dp_tensor_destroy(t);
}

/* ---- the math, by hand ---- */

typedef struct Batch {
  int n;
  float x[MAXN][2];
  float t[MAXN][2];
} Batch;

static void batch_make(Batch *b, uint64_t seed, int n) {
  uint64_t state = seed * 40503ULL + 7ULL;
  int s;
  b->n = n;
  for (s = 0; s < n; ++s) {
    b->x[s][0] = rng_uniform(&state, 2.0f);
    b->x[s][1] = rng_uniform(&state, 2.0f);
    b->t[s][0] = rng_uniform(&state, 1.0f);
    b->t[s][1] = rng_uniform(&state, 1.0f);
  }
}

/* Samples [first, first + n) of `all`. */
static void batch_slice(Batch *out, const Batch *all, int first, int n) {
  out->n = n;
  memcpy(out->x, all->x[first], (size_t)n * sizeof(out->x[0]));
  memcpy(out->t, all->t[first], (size_t)n * sizeof(out->t[0]));
}

/* A seeded permutation of the samples, the same on every rank. */
static void batch_shuffle(Batch *b, uint64_t seed) {
  uint64_t state = seed + 99ULL;
  int i;
  for (i = b->n - 1; i > 0; --i) {
    int j = (int)(rng_next(&state) % (uint32_t)(i + 1));
    float x0 = b->x[i][0], x1 = b->x[i][1], t0 = b->t[i][0], t1 = b->t[i][1];
    b->x[i][0] = b->x[j][0];
    b->x[i][1] = b->x[j][1];
    b->t[i][0] = b->t[j][0];
    b->t[i][1] = b->t[j][1];
    b->x[j][0] = x0;
    b->x[j][1] = x1;
    b->t[j][0] = t0;
    b->t[j][1] = t1;
  }
}

/* Forward (relu(fc1), relu(fc2), fc3) and backward of the MSE loss (mean over
 * every output element, as F.mse_loss) on batch `b`: sets *g to dLoss/dparam. */
static void net_grads(const Params *p, const Batch *b, Params *g) {
  float a[4][MAXN][2], z[3][MAXN][2], d[MAXN][2];
  int l, s, o, i;
  memset(g, 0, sizeof(*g));
  for (s = 0; s < b->n; ++s) {
    a[0][s][0] = b->x[s][0];
    a[0][s][1] = b->x[s][1];
  }
  for (l = 0; l < 3; ++l) {
    const float *w = p->v[2 * l], *bias = p->v[2 * l + 1];
    for (s = 0; s < b->n; ++s) {
      for (o = 0; o < 2; ++o) {
        z[l][s][o] = bias[o] + w[o * 2] * a[l][s][0] + w[o * 2 + 1] * a[l][s][1];
        a[l + 1][s][o] = l < 2 && z[l][s][o] < 0.0f ? 0.0f : z[l][s][o];
      }
    }
  }
  for (s = 0; s < b->n; ++s) {
    for (o = 0; o < 2; ++o) d[s][o] = 2.0f * (a[3][s][o] - b->t[s][o]) / (float)(b->n * 2);
  }
  for (l = 2; l >= 0; --l) {
    const float *w = p->v[2 * l];
    float *gw = g->v[2 * l], *gb = g->v[2 * l + 1];
    float prev[MAXN][2];
    for (s = 0; s < b->n; ++s) {
      for (o = 0; o < 2; ++o) {
        if (l < 2 && z[l][s][o] <= 0.0f) d[s][o] = 0.0f;
      }
      for (o = 0; o < 2; ++o) {
        gb[o] += d[s][o];
        for (i = 0; i < 2; ++i) gw[o * 2 + i] += d[s][o] * a[l][s][i];
      }
      for (i = 0; i < 2; ++i) prev[s][i] = d[s][0] * w[i] + d[s][1] * w[2 + i];
    }
    memcpy(d, prev, sizeof(d));
  }
}

/* Rank r's own batch for the gradient scenarios: different on every rank. */
static void rank_batch(Batch *b, int r, uint64_t salt) { batch_make(b, 1000ULL + 37ULL * salt + (uint64_t)r, 2); }

static void sgd(Params *p, const Params *g, float lr) {
  int q, i;
  for (q = 0; q < NP; ++q) {
    for (i = 0; i < param_numel(q); ++i) p->v[q][i] -= lr * g->v[q][i];
  }
}

/* The sum in rank order, then divided by the world size, as the reducer does. */
static void average(Params *out, const Params *per_rank, int world) {
  int q, i, r;
  memset(out, 0, sizeof(*out));
  for (r = 0; r < world; ++r) {
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i) out->v[q][i] += per_rank[r].v[q][i];
    }
  }
  for (q = 0; q < NP; ++q) {
    for (i = 0; i < param_numel(q); ++i) out->v[q][i] /= (float)world;
  }
}

static int close_to(double got, double want, double rtol, double atol) {
  return fabs(got - want) <= atol + rtol * fabs(want);
}

/* Compares the parameters in `mask` (bit p for kParam[p]). */
static void expect_params(int line, const char *what, const Params *got, const Params *want, unsigned mask, double rtol,
                          double atol) {
  int p, i;
  for (p = 0; p < NP; ++p) {
    if ((mask & (1u << p)) == 0) continue;
    for (i = 0; i < param_numel(p); ++i) {
      if (!close_to(got->v[p][i], want->v[p][i], rtol, atol)) {
        fprintf(stderr, "rank %d: line %d: %s: %s[%d] is %.9g, want %.9g (rtol %g, atol %g)\n", g_rank, line, what,
                kParam[p], i, (double)got->v[p][i], (double)want->v[p][i], rtol, atol);
        ++g_failures;
        break;
      }
    }
  }
}
#define GRAD_RTOL 1e-6
#define GRAD_ATOL 1e-7
#define EXPECT_PARAMS(what, got, want, mask, rtol, atol) expect_params(__LINE__, what, got, want, mask, rtol, atol)

/* ---- wrapping: the whole net under one dp_ddp, or each layer under its own ---- */

typedef struct Wrap {
  dp_ddp *ddp[3];
  int count;
  dp_ddp *owner[NP];     /* the dp_ddp managing kParam[p]; NULL when none does */
  const char *local[NP]; /* its name relative to that dp_ddp's module */
} Wrap;

static dp_status wrap_whole(Wrap *w, Net *net, dp_process_group *pg, const dp_ddp_options *opts) {
  int p;
  dp_status st;
  memset(w, 0, sizeof(*w));
  st = dp_ddp_create(&w->ddp[0], net->root, pg, opts);
  if (st != DP_OK) return st;
  w->count = 1;
  for (p = 0; p < NP; ++p) {
    w->owner[p] = w->ddp[0];
    w->local[p] = kParam[p];
  }
  return DP_OK;
}

/* fc1, fc2 and fc3 each under its own dp_ddp, created over the submodule
 * handle that dp_module_get_module gives. */
static dp_status wrap_layers(Wrap *w, Net *net, dp_process_group *pg, const dp_ddp_options *opts) {
  int l;
  memset(w, 0, sizeof(*w));
  for (l = 0; l < 3; ++l) {
    dp_module *m = NULL;
    dp_status st = dp_module_get_module(net->root, kLayer[l], &m);
    if (st == DP_OK) st = dp_ddp_create(&w->ddp[l], m, pg, opts);
    dp_module_destroy(m); /* the dp_ddp holds its own reference */
    if (st != DP_OK) return st;
    w->count = l + 1;
    w->owner[2 * l] = w->owner[2 * l + 1] = w->ddp[l];
    w->local[2 * l] = kLocal[0];
    w->local[2 * l + 1] = kLocal[1];
  }
  return DP_OK;
}

static void wrap_destroy(Wrap *w) {
  int i;
  for (i = 0; i < w->count; ++i) dp_ddp_destroy(w->ddp[i]);
  memset(w, 0, sizeof(*w));
}

static void wrap_pre_forward(Wrap *w) {
  int i;
  for (i = 0; i < w->count; ++i) CHECK_OK(dp_ddp_pre_forward(w->ddp[i]));
}

/* The first failure, if any; later dp_ddp are not finished after one. */
static dp_status wrap_finish(Wrap *w) {
  int i;
  for (i = 0; i < w->count; ++i) {
    dp_status st = dp_ddp_finish_backward(w->ddp[i]);
    if (st != DP_OK) return st;
  }
  return DP_OK;
}

/* The host's backward: each gradient is accumulated into the module and
 * marked ready at once, in `order` (NULL: the last layer's first); the
 * parameters in `unused` (bit p) are neither touched nor marked. */
static void backward(Net *net, const Wrap *w, const Params *g, const int *order, unsigned unused) {
  int k;
  if (order == NULL) order = kReverse;
  for (k = 0; k < NP; ++k) {
    int p = order[k];
    if (unused & (1u << p)) continue;
    grad_add(net, p, g->v[p]);
    if (w->owner[p] != NULL) CHECK_OK(dp_ddp_mark_grad_ready(w->owner[p], w->local[p]));
  }
}

static void set_sync(Wrap *w, int sync) {
  int i;
  for (i = 0; i < w->count; ++i) CHECK_OK(dp_ddp_set_requires_gradient_sync(w->ddp[i], sync));
}

/* ---- bucket plans ---- */

/* "{3,2},{1},{0}" for the dp_ddp's current plan. */
static void plan_string(const dp_ddp *ddp, char *out, size_t cap) {
  size_t b, i, n = dp_ddp_num_buckets(ddp), used = 0;
  out[0] = '\0';
  for (b = 0; b < n; ++b) {
    size_t idx[64], count = 0;
    CHECK_OK(dp_ddp_bucket_parameters(ddp, b, idx, 64, &count));
    used += (size_t)snprintf(out + used, cap - used, "%s{", b == 0 ? "" : ",");
    for (i = 0; i < count && i < 64 && used < cap; ++i) {
      used += (size_t)snprintf(out + used, cap - used, "%s%zu", i == 0 ? "" : ",", idx[i]);
    }
    if (used < cap) used += (size_t)snprintf(out + used, cap - used, "}");
    if (used >= cap) return;
  }
}

static void expect_plan(int line, const char *what, const dp_ddp *ddp, const char *want) {
  char got[512];
  plan_string(ddp, got, sizeof(got));
  printf("rank %d: %s: plan %s\n", g_rank, what, got);
  if (strcmp(got, want) != 0) {
    fprintf(stderr, "rank %d: line %d: %s: bucket plan %s, want %s\n", g_rank, line, what, got, want);
    ++g_failures;
  }
}
#define EXPECT_PLAN(what, ddp, want) expect_plan(__LINE__, what, ddp, want)

#define CAP_MB(bytes) ((double)(bytes) / 1048576.0)

/* ---- scenarios ---- */

/* Training parity: every rank trains on its shard of the global batch under
 * DDP, and computes the single-process reference on the full batch itself;
 * parameters agree after each of 2 SGD iterations (PyTorch's
 * _compare_module), the batch shuffled in between. */
static void run_parity(dp_process_group *pg, int layers, const dp_ddp_options *opts) {
  const int per_rank = 2, n = per_rank * g_world;
  const float lr = 1.0f;
  Net net;
  Params ref, cur, g, local;
  Batch all, mine;
  Wrap w;
  int it, i;
  net_create(&net, 42, 2, 0);
  net_get(&net, &ref);
  CHECK_OK(layers ? wrap_layers(&w, &net, pg, opts) : wrap_whole(&w, &net, pg, opts));
  if (w.count != (layers ? 3 : 1)) exit(1);
  batch_make(&all, 7, n);
  for (it = 0; it < 2; ++it) {
    char what[64];
    net_grads(&ref, &all, &g);
    sgd(&ref, &g, lr);

    CHECK_OK(dp_module_zero_grad(net.root));
    wrap_pre_forward(&w);
    net_get(&net, &cur);
    batch_slice(&mine, &all, g_rank * per_rank, per_rank);
    net_grads(&cur, &mine, &local);
    backward(&net, &w, &local, NULL, 0);
    CHECK_OK(wrap_finish(&w));
    grads_get(&net, &g);
    sgd(&cur, &g, lr);
    net_set(&net, &cur);
    snprintf(what, sizeof(what), "parameters after iteration %d", it + 1);
    EXPECT_PARAMS(what, &cur, &ref, ALL_PARAMS, 1.3e-6, 5e-5);
    for (i = 0; i < w.count; ++i) {
      dp_ddp_stats stats;
      memset(&stats, 0, sizeof(stats));
      stats.struct_size = sizeof(stats);
      CHECK_OK(dp_ddp_last_stats(w.ddp[i], &stats));
      CHECK(stats.num_buckets == dp_ddp_num_buckets(w.ddp[i]), "stats say %zu buckets, the dp_ddp %zu",
            stats.num_buckets, dp_ddp_num_buckets(w.ddp[i]));
      CHECK(stats.backward_ms >= 0 && stats.reduce_ms >= 0 && stats.exposed_ms >= 0, "times %g %g %g",
            stats.backward_ms, stats.reduce_ms, stats.exposed_ms);
    }
    batch_shuffle(&all, (uint64_t)it);
  }
  wrap_destroy(&w);
  net_destroy(&net);
}

static void parity_whole(dp_process_group *pg) { run_parity(pg, 0, NULL); }

/* Training parity on each dimension of a 2x2 device mesh: the dimension's
 * group (2 ranks) trains on its shard of the batch, as any group does. */
static void parity_mesh(dp_process_group *pg) {
  static const int32_t shape[2] = {2, 2};
  static const char *const names[2] = {"outer", "inner"};
  const int rank = g_rank, world = g_world;
  dp_device_mesh *mesh = NULL;
  int d;
  CHECK(world == 4, "parity_mesh runs on 4 ranks, not %d", world);
  CHECK_OK(dp_device_mesh_create(&mesh, pg, shape, 2, names));
  for (d = 0; d < 2 && mesh != NULL; ++d) {
    dp_process_group *dim = NULL;
    CHECK_OK(dp_device_mesh_group(mesh, names[d], &dim));
    if (dim == NULL) break;
    g_rank = dp_process_group_rank(dim);
    g_world = dp_process_group_size(dim);
    /* Row-major: "outer" joins ranks 2 apart, "inner" neighbours. */
    CHECK(g_world == 2 && g_rank == (d == 0 ? rank / 2 : rank % 2), "%s: rank %d of %d", names[d], g_rank, g_world);
    run_parity(dim, 0, NULL);
  }
  g_rank = rank;
  g_world = world;
  dp_device_mesh_destroy(mesh);
}

static void parity_layers(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  run_parity(pg, 1, &o);
}

static void parity_cap1(dp_process_group *pg) {
  dp_ddp_options o;
  CHECK_OK(dp_ddp_options_init(&o, sizeof o));
  o.bucket_cap_mb = 1;
  run_parity(pg, 0, &o);
}

static void parity_view(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.gradient_as_bucket_view = 1;
  run_parity(pg, 0, &o);
}

/* 24-byte caps: a bucket per layer ({5,4},{3,2},{1,0}). */
static void parity_small_buckets(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  run_parity(pg, 0, &o);
}

static void parity_view_small_buckets(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  o.gradient_as_bucket_view = 1;
  run_parity(pg, 0, &o);
}

/* Names of the module's parameters and buffers, each followed by '\n'. */
static void names_of(const dp_module *m, char *out, size_t cap) {
  size_t i, used = 0;
  out[0] = '\0';
  for (i = 0; i < dp_module_num_parameters(m); ++i) {
    const char *name = NULL;
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_parameter_at(m, i, &name, &t));
    if (name != NULL && used < cap) used += (size_t)snprintf(out + used, cap - used, "parameter %s\n", name);
    dp_tensor_destroy(t);
  }
  for (i = 0; i < dp_module_num_buffers(m); ++i) {
    const char *name = NULL;
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_buffer_at(m, i, &name, &t));
    if (name != NULL && used < cap) used += (size_t)snprintf(out + used, cap - used, "buffer %s\n", name);
    dp_tensor_destroy(t);
  }
}

static long read_whole(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  size_t n;
  if (f == NULL) return -1;
  n = fread(buf, 1, cap, f);
  fclose(f);
  return (long)n;
}

/* Names, the state dict's bytes and the parameters' storage are what they
 * were before wrapping. */
static void expect_state_unchanged(Net *net, const char *what, const char *names_before, const char *file_before,
                                   void *const *data_before) {
  char names[1024], path[512];
  static char before[8192], after[8192];
  long nb, na;
  int p;
  names_of(net->root, names, sizeof(names));
  CHECK(strcmp(names, names_before) == 0, "%s: names changed:\n%s\nwere:\n%s", what, names, names_before);
  snprintf(path, sizeof(path), "%s/state_rank%d_after.safetensors", g_dir, g_rank);
  CHECK_OK(dp_module_save(net->root, path));
  nb = read_whole(file_before, before, sizeof(before));
  na = read_whole(path, after, sizeof(after));
  CHECK(nb > 0 && na == nb && memcmp(before, after, (size_t)nb) == 0,
        "%s: the state dict differs from the unwrapped one (%ld and %ld bytes)", what, nb, na);
  unlink(path);
  for (p = 0; p < NP; ++p) {
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_get_parameter(net->root, kParam[p], &t));
    CHECK(t != NULL && dp_tensor_data(t) == data_before[p], "%s: %s now lives elsewhere", what, kParam[p]);
    dp_tensor_destroy(t);
  }
}

static void state_dict(dp_process_group *pg) {
  Net net;
  Wrap w;
  char names[1024], path[512];
  void *data[NP];
  int p, l;
  net_create(&net, 42, 2, 1);
  names_of(net.root, names, sizeof(names));
  CHECK(strstr(names, "parameter fc3.bias\nbuffer running\n") != NULL, "unexpected names:\n%s", names);
  snprintf(path, sizeof(path), "%s/state_rank%d_before.safetensors", g_dir, g_rank);
  CHECK_OK(dp_module_save(net.root, path));
  for (p = 0; p < NP; ++p) {
    dp_tensor *t = NULL;
    CHECK_OK(dp_module_get_parameter(net.root, kParam[p], &t));
    data[p] = dp_tensor_data(t);
    dp_tensor_destroy(t);
  }

  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  expect_state_unchanged(&net, "whole net wrapped", names, path, data);
  wrap_destroy(&w);

  CHECK_OK(wrap_layers(&w, &net, pg, NULL));
  expect_state_unchanged(&net, "fc1, fc2, fc3 wrapped", names, path, data);
  for (l = 0; l < 3; ++l) {
    dp_module *m = NULL;
    char sub[256];
    CHECK_OK(dp_module_get_module(net.root, kLayer[l], &m));
    names_of(m, sub, sizeof(sub));
    CHECK(strcmp(sub, "parameter weight\nparameter bias\n") == 0, "%s's names: %s", kLayer[l], sub);
    dp_module_destroy(m);
  }
  wrap_destroy(&w);
  expect_state_unchanged(&net, "unwrapped again", names, path, data);
  unlink(path);
  net_destroy(&net);
}

/* Per-rank gradients of this net's parameters on each rank's own batch. */
static void all_rank_grads(const Params *p, Params per_rank[MAXN], uint64_t salt) {
  int r;
  memset(per_rank, 0, MAXN * sizeof(Params));
  for (r = 0; r < g_world; ++r) {
    Batch b;
    rank_batch(&b, r, salt);
    net_grads(p, &b, &per_rank[r]);
  }
}

/* fc1 ignored: its gradient stays this rank's own, fc2's and fc3's are
 * averaged. Then fc1 under a dp_ddp of its own, beside the first. Then
 * fc2.bias ignored as a parameter. */
static void ignored(dp_process_group *pg) {
  const char *const modules[] = {"fc1"};
  const char *const params[] = {"fc2.bias"};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  Params cur, grads[MAXN], avg, got;
  size_t b, total = 0;
  dp_module *fc1 = NULL;
  dp_ddp *fc1_ddp = NULL;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  average(&avg, grads, g_world);
  CHECK(g_world < 2 || memcmp(grads[0].v[0], grads[1].v[0], sizeof(grads[0].v[0])) != 0, "%s",
        "ranks' fc1 gradients are equal: the test would not see a reduction");

  o.ignored_modules = modules;
  o.num_ignored_modules = 1;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  w.owner[0] = w.owner[1] = NULL;
  for (b = 0; b < dp_ddp_num_buckets(w.ddp[0]); ++b) {
    size_t count = 0;
    CHECK_OK(dp_ddp_bucket_parameters(w.ddp[0], b, NULL, 0, &count));
    total += count;
  }
  CHECK(total == 4, "the buckets hold %zu parameters, want 4 (fc2, fc3)", total);
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("fc1 ignored: fc1 keeps this rank's gradient", &got, &grads[g_rank], 0x03u, 0, 0);
  EXPECT_PARAMS("fc1 ignored: fc2, fc3 averaged", &got, &avg, 0x3Cu, GRAD_RTOL, GRAD_ATOL);

  /* A second dp_ddp over the ignored submodule works beside the first. */
  CHECK_OK(dp_module_get_module(net.root, "fc1", &fc1));
  CHECK_OK(dp_ddp_create(&fc1_ddp, fc1, pg, NULL));
  dp_module_destroy(fc1);
  w.owner[0] = w.owner[1] = fc1_ddp;
  w.local[0] = "weight";
  w.local[1] = "bias";
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  CHECK_OK(dp_ddp_finish_backward(fc1_ddp));
  grads_get(&net, &got);
  EXPECT_PARAMS("fc1 under its own dp_ddp: all averaged", &got, &avg, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  dp_ddp_destroy(fc1_ddp);
  wrap_destroy(&w);

  o.ignored_modules = NULL;
  o.num_ignored_modules = 0;
  o.ignored_parameters = params;
  o.num_ignored_parameters = 1;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  w.owner[3] = NULL;
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("fc2.bias ignored: it keeps this rank's gradient", &got, &grads[g_rank], 0x08u, 0, 0);
  EXPECT_PARAMS("fc2.bias ignored: the others averaged", &got, &avg, ALL_PARAMS & ~0x08u, GRAD_RTOL, GRAD_ATOL);
  wrap_destroy(&w);
  net_destroy(&net);
}

/* A module of 1-D float32 parameters "a", "b", "c", "d" of 100, 200, 100, 50
 * elements (400, 800, 400, 200 bytes). */
static const char *const kFlat[4] = {"a", "b", "c", "d"};
static const int kFlatNumel[4] = {100, 200, 100, 50};

static dp_module *flat_module(void) {
  dp_module *m = NULL;
  int i;
  CHECK_OK(dp_module_create(&m));
  if (m == NULL) exit(3);
  for (i = 0; i < 4; ++i) {
    dp_tensor *t = new_tensor(1, kFlatNumel[i], 0);
    CHECK_OK(dp_module_register_parameter(m, kFlat[i], t, 1));
    dp_tensor_destroy(t);
  }
  return m;
}

static float flat_grad(int r, int p, int e, int step) { return (float)((r + 1) * (p + 1) + step) + 0.001f * (float)e; }

/* Sets this rank's gradients of step `step`, marking them in `order`. */
static void flat_backward(dp_module *m, dp_ddp *ddp, const int *order, int step) {
  int k, e;
  for (k = 0; k < 4; ++k) {
    int p = order[k];
    dp_tensor *g = NULL;
    float *d;
    CHECK_OK(dp_module_grad(m, kFlat[p], &g));
    if (g == NULL) exit(3);
    d = (float *)dp_tensor_data(g);
    for (e = 0; e < kFlatNumel[p]; ++e) d[e] = flat_grad(g_rank, p, e, step);
    dp_tensor_destroy(g);
    CHECK_OK(dp_ddp_mark_grad_ready(ddp, kFlat[p]));
  }
}

static void expect_flat_average(int line, dp_module *m, int step) {
  int p, e, r;
  for (p = 0; p < 4; ++p) {
    dp_tensor *g = NULL;
    const float *d;
    CHECK_OK(dp_module_grad(m, kFlat[p], &g));
    if (g == NULL) exit(3);
    d = (const float *)dp_tensor_data(g);
    for (e = 0; e < kFlatNumel[p]; ++e) {
      float want = 0;
      for (r = 0; r < g_world; ++r) want += flat_grad(r, p, e, step);
      want /= (float)g_world;
      if (!close_to(d[e], want, GRAD_RTOL, GRAD_ATOL)) {
        fprintf(stderr, "rank %d: line %d: step %d: gradient of %s[%d] is %.9g, want the average %.9g\n", g_rank, line,
                step, kFlat[p], e, (double)d[e], (double)want);
        ++g_failures;
        break;
      }
    }
    dp_tensor_destroy(g);
  }
}

/* First cap 400 bytes, the others 1000: the plan at create is {3,2},{1,0}
 * (visiting d, c, b, a). Rank 0 marks a, d, b, c in the first iteration (rank
 * 1 another order): the rebuilt plan follows rank 0's order on every rank:
 * a (400 B) closes the first bucket, d + b (1000 B) the second, c is left:
 * {0},{3,1},{2}. It is rebuilt once only. */
static void run_rebuild(dp_process_group *pg, int view) {
  static const int first_order[2][4] = {{0, 3, 1, 2}, {2, 1, 3, 0}};
  static const int second_order[2][4] = {{3, 2, 1, 0}, {1, 0, 3, 2}};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  dp_module *m = flat_module();
  dp_ddp *ddp = NULL;
  dp_ddp_stats stats;
  o.first_bucket_cap_mb = CAP_MB(400);
  o.bucket_cap_mb = CAP_MB(1000);
  o.gradient_as_bucket_view = view;
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &o));
  if (ddp == NULL) exit(1);
  EXPECT_PLAN("at create", ddp, "{3,2},{1,0}");
  CHECK(dp_ddp_num_buckets(ddp) == 2, "%zu buckets", dp_ddp_num_buckets(ddp));

  CHECK_OK(dp_module_zero_grad(m));
  flat_backward(m, ddp, first_order[g_rank == 0 ? 0 : 1], 0);
  CHECK_OK(dp_ddp_finish_backward(ddp));
  expect_flat_average(__LINE__, m, 0);
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  CHECK_OK(dp_ddp_last_stats(ddp, &stats));
  CHECK(stats.buckets_rebuilt == 1, "buckets_rebuilt is %d after the first synced iteration", stats.buckets_rebuilt);
  CHECK(stats.num_buckets == dp_ddp_num_buckets(ddp), "stats say %zu buckets, the dp_ddp %zu", stats.num_buckets,
        dp_ddp_num_buckets(ddp));
  EXPECT_PLAN("rebuilt in rank 0's order", ddp, "{0},{3,1},{2}");

  CHECK_OK(dp_module_zero_grad(m));
  flat_backward(m, ddp, second_order[g_rank == 0 ? 0 : 1], 1);
  CHECK_OK(dp_ddp_finish_backward(ddp));
  expect_flat_average(__LINE__, m, 1);
  CHECK_OK(dp_ddp_last_stats(ddp, &stats));
  CHECK(stats.buckets_rebuilt == 0, "buckets_rebuilt is %d after the second iteration", stats.buckets_rebuilt);
  EXPECT_PLAN("not rebuilt a second time", ddp, "{0},{3,1},{2}");
  dp_ddp_destroy(ddp);
  dp_module_destroy(m);
}

static void rebuild(dp_process_group *pg) { run_rebuild(pg, 0); }
static void rebuild_view(dp_process_group *pg) { run_rebuild(pg, 1); }

static float flat_average(int p, int e, int step) {
  float sum = 0;
  int r;
  for (r = 0; r < g_world; ++r) sum += flat_grad(r, p, e, step);
  return sum / (float)g_world;
}

/* The floats at `d` are parameter p's averaged gradient of `step`; the
 * first that is not is printed, with the parameter whose gradient of step
 * `now` it is, if any. */
static void expect_flat_values(int line, const char *what, const float *d, int p, int step, int now) {
  int e, q;
  for (e = 0; e < kFlatNumel[p]; ++e) {
    float want = flat_average(p, e, step);
    if (close_to(d[e], want, GRAD_RTOL, GRAD_ATOL)) continue;
    fprintf(stderr, "rank %d: line %d: %s of %s: [%d] is %.9g, want step %d's average %.9g", g_rank, line, what,
            kFlat[p], e, (double)d[e], step, (double)want);
    for (q = 0; q < 4; ++q) {
      if (q != p && close_to(d[e], flat_average(q, e, now), GRAD_RTOL, GRAD_ATOL)) {
        fprintf(stderr, " (%s's gradient of step %d)", kFlat[q], now);
      }
    }
    fprintf(stderr, "\n");
    ++g_failures;
    return;
  }
}

static uint64_t allocated_bytes(void) {
  dp_memory_stats stats;
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  CHECK_OK(dp_device_memory_stats((dp_device){DP_DEVICE_CPU, 0}, &stats));
  return stats.allocated_bytes;
}

/* Four float32 parameters of 1 MiB each, two to a bucket, three synced
 * steps averaged. The third step, after the rebuild, allocates no memory of
 * a bucket's size: where a coalesced all_reduce would flatten the bucket's
 * gradients into scratch (Gloo), each bucket is reduced where it lies. */
static void step_scratch(dp_process_group *pg) {
  enum { kNumel = 1 << 18 };
  static const char *const names[4] = {"w0", "w1", "w2", "w3"};
  const dp_device cpu = {DP_DEVICE_CPU, 0};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  dp_module *m = NULL;
  dp_ddp *ddp = NULL;
  dp_memory_stats stats;
  uint64_t before = 0;
  int p, e, r, step;
  printf("rank %d: backend %s\n", g_rank, dp_process_group_backend(pg));
  CHECK_OK(dp_module_create(&m));
  if (m == NULL) exit(3);
  for (p = 0; p < 4; ++p) {
    dp_tensor *t = new_tensor(1, kNumel, 0);
    CHECK_OK(dp_module_register_parameter(m, names[p], t, 1));
    dp_tensor_destroy(t);
  }
  o.first_bucket_cap_mb = o.bucket_cap_mb = CAP_MB(2 * kNumel * sizeof(float));
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &o));
  if (ddp == NULL) exit(1);
  EXPECT_PLAN("at create", ddp, "{3,2},{1,0}");
  for (step = 0; step < 3; ++step) {
    if (step == 2) {
      CHECK_OK(dp_device_reset_peak_memory(cpu));
      before = allocated_bytes();
    }
    CHECK_OK(dp_module_zero_grad(m));
    for (p = 3; p >= 0; --p) {
      dp_tensor *g = NULL;
      float *d;
      CHECK_OK(dp_module_grad(m, names[p], &g));
      if (g == NULL) exit(3);
      d = (float *)dp_tensor_data(g);
      for (e = 0; e < kNumel; ++e) d[e] = (float)((g_rank + 1) * (p + 1) + step) + 0.25f * (float)(e % 8);
      dp_tensor_destroy(g);
      CHECK_OK(dp_ddp_mark_grad_ready(ddp, names[p]));
    }
    CHECK_OK(dp_ddp_finish_backward(ddp));
    for (p = 0; p < 4; ++p) {
      dp_tensor *g = NULL;
      const float *d;
      CHECK_OK(dp_module_grad(m, names[p], &g));
      if (g == NULL) exit(3);
      d = (const float *)dp_tensor_data(g);
      for (e = 0; e < kNumel; ++e) {
        float want = 0;
        for (r = 0; r < g_world; ++r) want += (float)((r + 1) * (p + 1) + step) + 0.25f * (float)(e % 8);
        want /= (float)g_world;
        if (!close_to(d[e], want, GRAD_RTOL, GRAD_ATOL)) {
          fprintf(stderr, "rank %d: step %d: gradient of %s[%d] is %.9g, want the average %.9g\n", g_rank, step,
                  names[p], e, (double)d[e], (double)want);
          ++g_failures;
          break;
        }
      }
      dp_tensor_destroy(g);
    }
  }
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  CHECK_OK(dp_device_memory_stats(cpu, &stats));
  CHECK(stats.peak_allocated_bytes - before < kNumel * sizeof(float) / 2,
        "a synced step allocated up to %llu bytes beyond the %llu in use before it (a bucket holds %llu)",
        (unsigned long long)(stats.peak_allocated_bytes - before), (unsigned long long)before,
        (unsigned long long)(2 * kNumel * sizeof(float)));
  dp_ddp_destroy(ddp);
  dp_module_destroy(m);
}

/* With gradient_as_bucket_view the first finish rebuilds the plan as in
 * run_rebuild, moving every gradient. Rank 0 holds across it, for each
 * gradient, a DLPack export, a tensor made from a second export and its
 * dp_module_grad handle, all taken before the finish; rank 1 holds none.
 * The exports and tensors keep their own parameter's step 0 average (what
 * the gradient held at the move) through two more steps, the dp_ddp's
 * destroy and a new dp_ddp over the module; the handles follow the moves.
 * The old memory stays while an export does and goes with the last one:
 * no rank holds more memory than at create once none is left. */
static void run_rebuild_exports(dp_process_group *pg, int static_graph) {
  static const int orders[4][2][4] = {{{0, 3, 1, 2}, {2, 1, 3, 0}},
                                      {{3, 2, 1, 0}, {1, 0, 3, 2}},
                                      {{1, 2, 3, 0}, {0, 1, 2, 3}},
                                      {{2, 0, 3, 1}, {3, 1, 0, 2}}};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  dp_module *m = flat_module();
  dp_ddp *ddp = NULL;
  DLManagedTensor *exported[4] = {NULL, NULL, NULL, NULL};
  dp_tensor *imported[4] = {NULL, NULL, NULL, NULL};
  dp_tensor *handle[4] = {NULL, NULL, NULL, NULL};
  dp_ddp_stats stats;
  const int holder = g_rank == 0;
  uint64_t at_create, held, released;
  int p, step;
  printf("rank %d: backend %s\n", g_rank, dp_process_group_backend(pg));
  o.first_bucket_cap_mb = CAP_MB(400);
  o.bucket_cap_mb = CAP_MB(1000);
  o.gradient_as_bucket_view = 1;
  o.static_graph = static_graph;
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &o));
  if (ddp == NULL) exit(1);
  EXPECT_PLAN("at create", ddp, "{3,2},{1,0}");
  at_create = allocated_bytes();

  CHECK_OK(dp_module_zero_grad(m));
  flat_backward(m, ddp, orders[0][g_rank == 0 ? 0 : 1], 0);
  for (p = 0; holder && p < 4; ++p) {
    DLManagedTensor *second = NULL;
    CHECK_OK(dp_module_grad(m, kFlat[p], &handle[p]));
    if (handle[p] == NULL) exit(3);
    CHECK_OK(dp_tensor_to_dlpack(handle[p], &exported[p]));
    CHECK_OK(dp_tensor_to_dlpack(handle[p], &second));
    if (exported[p] == NULL || second == NULL) exit(3);
    CHECK_OK(dp_tensor_from_dlpack(&imported[p], second));
    if (imported[p] == NULL) exit(3);
  }
  CHECK_OK(dp_ddp_finish_backward(ddp));
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  CHECK_OK(dp_ddp_last_stats(ddp, &stats));
  CHECK(stats.buckets_rebuilt == 1, "buckets_rebuilt is %d after the first synced iteration", stats.buckets_rebuilt);
  EXPECT_PLAN("rebuilt in rank 0's order", ddp, "{0},{3,1},{2}");
  expect_flat_average(__LINE__, m, 0);

  for (step = 1; step <= 2; ++step) {
    CHECK_OK(dp_module_zero_grad(m));
    flat_backward(m, ddp, orders[step][g_rank == 0 ? 0 : 1], step);
    CHECK_OK(dp_ddp_finish_backward(ddp));
    expect_flat_average(__LINE__, m, step);
    for (p = 0; holder && p < 4; ++p) {
      expect_flat_values(__LINE__, "the export taken before the rebuild", (const float *)exported[p]->dl_tensor.data, p,
                         0, step);
      expect_flat_values(__LINE__, "the tensor made from an export", (const float *)dp_tensor_data(imported[p]), p, 0,
                         step);
      expect_flat_values(__LINE__, "the dp_module_grad handle", (const float *)dp_tensor_data(handle[p]), p, step,
                         step);
    }
  }
  held = allocated_bytes();
  if (holder) {
    CHECK(held > at_create, "%llu bytes allocated with the old gradients exported, %llu at create: not held",
          (unsigned long long)held, (unsigned long long)at_create);
  } else {
    CHECK(held <= at_create, "%llu bytes allocated after the rebuild, %llu at create: the old buckets stayed",
          (unsigned long long)held, (unsigned long long)at_create);
  }

  /* A new dp_ddp moves the gradients again (into memory of its own). */
  dp_ddp_destroy(ddp);
  ddp = NULL;
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &o));
  if (ddp == NULL) exit(1);
  CHECK_OK(dp_module_zero_grad(m));
  flat_backward(m, ddp, orders[3][g_rank == 0 ? 0 : 1], 3);
  CHECK_OK(dp_ddp_finish_backward(ddp));
  expect_flat_average(__LINE__, m, 3);
  for (p = 0; holder && p < 4; ++p) {
    expect_flat_values(__LINE__, "the export after a new dp_ddp", (const float *)exported[p]->dl_tensor.data, p, 0, 3);
    expect_flat_values(__LINE__, "the tensor from an export after a new dp_ddp",
                       (const float *)dp_tensor_data(imported[p]), p, 0, 3);
    expect_flat_values(__LINE__, "the dp_module_grad handle after a new dp_ddp",
                       (const float *)dp_tensor_data(handle[p]), p, 3, 3);
  }
  dp_ddp_destroy(ddp);

  /* The first dp_ddp's memory goes with the last export (the handles
   * followed the moves and hold none of it). */
  held = allocated_bytes();
  for (p = 0; holder && p < 4; ++p) {
    exported[p]->deleter(exported[p]);
    dp_tensor_destroy(imported[p]);
  }
  released = allocated_bytes();
  if (holder) {
    CHECK(released < held, "%llu bytes allocated after the exports went, %llu with them: nothing released",
          (unsigned long long)released, (unsigned long long)held);
  }
  /* Left: the gradients in the second dp_ddp's buckets, as many bytes. */
  CHECK(released <= at_create, "%llu bytes allocated at the end, %llu at the first create: old buckets stayed",
        (unsigned long long)released, (unsigned long long)at_create);
  for (p = 0; holder && p < 4; ++p) dp_tensor_destroy(handle[p]);
  dp_module_destroy(m);
}

static void rebuild_exports(dp_process_group *pg) { run_rebuild_exports(pg, 0); }
static void rebuild_exports_static(dp_process_group *pg) { run_rebuild_exports(pg, 1); }

/* Rank 1 joins before any iteration and stands in for rank 0's first
 * finish, whose rebuild moves every gradient on both ranks (the shared
 * region's path on each); rank 0 holds an export of each gradient across
 * it. Rank 0's gradients average with rank 1's zeros; its exports keep
 * step 0's; after rank 0 joins too, a step on both ranks pairs up. */
static void rebuild_exports_join(dp_process_group *pg) {
  static const int order[4] = {0, 3, 1, 2};
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  dp_module *m = flat_module();
  dp_ddp *ddp = NULL;
  DLManagedTensor *exported[4] = {NULL, NULL, NULL, NULL};
  int p, e, step;
  o.first_bucket_cap_mb = CAP_MB(400);
  o.bucket_cap_mb = CAP_MB(1000);
  o.gradient_as_bucket_view = 1;
  CHECK_OK(dp_ddp_create(&ddp, m, pg, &o));
  if (ddp == NULL) exit(1);
  CHECK_OK(dp_module_zero_grad(m));
  if (g_rank == 0) {
    for (step = 0; step < 2; ++step) {
      CHECK_OK(dp_module_zero_grad(m));
      flat_backward(m, ddp, order, step);
      for (p = 0; step == 0 && p < 4; ++p) {
        dp_tensor *g = NULL;
        CHECK_OK(dp_module_grad(m, kFlat[p], &g));
        if (g == NULL) exit(3);
        CHECK_OK(dp_tensor_to_dlpack(g, &exported[p]));
        if (exported[p] == NULL) exit(3);
        dp_tensor_destroy(g);
      }
      CHECK_OK(dp_ddp_finish_backward(ddp));
      for (p = 0; p < 4; ++p) {
        dp_tensor *g = NULL;
        const float *d;
        CHECK_OK(dp_module_grad(m, kFlat[p], &g));
        if (g == NULL) exit(3);
        d = (const float *)dp_tensor_data(g);
        for (e = 0; e < kFlatNumel[p]; ++e) {
          float want = flat_grad(0, p, e, step) / (float)g_world; /* rank 1 stands in with zeros */
          if (!close_to(d[e], want, GRAD_RTOL, GRAD_ATOL)) {
            fprintf(stderr, "rank 0: line %d: step %d: gradient of %s[%d] is %.9g, want %.9g\n", __LINE__, step,
                    kFlat[p], e, (double)d[e], (double)want);
            ++g_failures;
            break;
          }
        }
        dp_tensor_destroy(g);
        d = (const float *)exported[p]->dl_tensor.data;
        for (e = 0; e < kFlatNumel[p]; ++e) {
          float want = flat_grad(0, p, e, 0) / (float)g_world;
          if (!close_to(d[e], want, GRAD_RTOL, GRAD_ATOL)) {
            fprintf(stderr, "rank 0: line %d: step %d: the export of %s[%d] is %.9g, want step 0's %.9g\n", __LINE__,
                    step, kFlat[p], e, (double)d[e], (double)want);
            ++g_failures;
            break;
          }
        }
      }
    }
  }
  CHECK_OK(dp_ddp_join(&ddp, 1));
  EXPECT_PLAN("rebuilt in rank 0's order, the joined rank's too", ddp, "{0},{3,1},{2}");
  CHECK_OK(dp_module_zero_grad(m));
  flat_backward(m, ddp, order, 2);
  CHECK_OK(dp_ddp_finish_backward(ddp));
  expect_flat_average(__LINE__, m, 2);
  for (p = 0; g_rank == 0 && p < 4; ++p) exported[p]->deleter(exported[p]);
  dp_ddp_destroy(ddp);
  dp_module_destroy(m);
}

/* Two backwards without sync accumulate locally (rank 0 runs a third, which
 * no communication could pair), then a synced one reduces the sums. */
static void no_sync(dp_process_group *pg) {
  Net net;
  Wrap w;
  Params cur, a[MAXN], b[MAXN], c[MAXN], d[MAXN], sums[MAXN], want, got;
  int r, q, i;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, a, 1);
  all_rank_grads(&cur, b, 2);
  all_rank_grads(&cur, c, 3);
  all_rank_grads(&cur, d, 4);
  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  CHECK_OK(dp_module_zero_grad(net.root));
  set_sync(&w, 0);

  backward(&net, &w, &a[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("after no_sync step 1: this rank's own", &got, &a[g_rank], ALL_PARAMS, 0, 0);

  backward(&net, &w, &b[g_rank], NULL, 0);
  EXPECT_ERROR("no_sync double mark", dp_ddp_mark_grad_ready(w.ddp[0], "fc3.weight"), DP_ESTATE, "fc3.weight");
  CHECK_OK(wrap_finish(&w));
  if (g_rank == 0) {
    backward(&net, &w, &d[0], NULL, 0);
    CHECK_OK(wrap_finish(&w));
  }
  grads_get(&net, &got);
  for (r = 0; r < g_world; ++r) {
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i) {
        sums[r].v[q][i] = a[r].v[q][i] + b[r].v[q][i];
        if (r == 0) sums[r].v[q][i] += d[r].v[q][i];
      }
    }
  }
  EXPECT_PARAMS("after no_sync steps: this rank's sum", &got, &sums[g_rank], ALL_PARAMS, 0, 0);

  set_sync(&w, 1);
  backward(&net, &w, &c[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  for (r = 0; r < g_world; ++r) {
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i) sums[r].v[q][i] += c[r].v[q][i];
    }
  }
  average(&want, sums, g_world);
  grads_get(&net, &got);
  EXPECT_PARAMS("synced step: the average of the accumulated sums", &got, &want, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  wrap_destroy(&w);
  net_destroy(&net);
}

/* Rank 1 leaves fc2.bias unmarked without find_unused_parameters: it gets
 * DP_ESTATE naming it, rank 0 fails at once (not by the 60 s timeout), and
 * the next iteration works. */
static void run_unused_error(dp_process_group *pg, const dp_ddp_options *opts, int good_first) {
  Net net;
  Wrap w;
  Params cur, grads[MAXN], avg, got, local;
  double start, elapsed;
  dp_status st;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  average(&avg, grads, g_world);
  CHECK_OK(wrap_whole(&w, &net, pg, opts));
  if (good_first) {
    /* After it the plan is rebuilt: the last bucket's reduction is no
     * longer saved, as nothing can fail the iteration once it runs. */
    CHECK_OK(dp_module_zero_grad(net.root));
    backward(&net, &w, &grads[g_rank], NULL, 0);
    CHECK_OK(wrap_finish(&w));
    grads_get(&net, &got);
    EXPECT_PARAMS("the iteration before the error", &got, &avg, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  }
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, g_rank == 1 ? 0x08u : 0u);
  start = now_ms();
  st = wrap_finish(&w);
  elapsed = now_ms() - start;
  if (g_rank == 1) {
    EXPECT_ERROR("finish with fc2.bias unmarked", st, DP_ESTATE, "fc2.bias", "find_unused_parameters");
  } else {
    EXPECT_ERROR("finish while rank 1 left fc2.bias unmarked", st, DP_EINVAL, "rank 1");
    CHECK(elapsed < 30000.0, "rank 0 failed only after %.0f ms: it waited for the timeout", elapsed);
  }
  /* Every gradient is this rank's own again, also in buckets reduced
   * before the refusal: never a mix of averaged and local ones. */
  local = grads[g_rank];
  if (g_rank == 1) memset(local.v[3], 0, sizeof(local.v[3]));
  grads_get(&net, &got);
  EXPECT_PARAMS("the gradients after a failed finish (this rank's own)", &got, &local, ALL_PARAMS, 0, 0);

  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("the iteration after the error", &got, &avg, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  wrap_destroy(&w);
  net_destroy(&net);
}

static void unused_error(dp_process_group *pg) { run_unused_error(pg, NULL, 0); }

static void unused_error_buckets(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  run_unused_error(pg, &o, 0);
}

static void unused_error_buckets_rebuilt(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  run_unused_error(pg, &o, 1);
}

static void unused_error_views(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  o.gradient_as_bucket_view = 1;
  run_unused_error(pg, &o, 0);
}

/* find_unused_parameters: fc2.bias is used on rank 0 only (every rank ends
 * with rank 0's gradient / world size), fc3.bias by no rank (each rank keeps
 * its own, untouched); twice (the second time over the rebuilt plan), then
 * an iteration using everything. */
static void unused_found(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  Params cur, grads[MAXN], avg, got, want;
  int it, i;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  average(&avg, grads, g_world);
  o.find_unused_parameters = 1;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  for (it = 0; it < 2; ++it) {
    const float untouched = (float)(100 * (it + 1) + g_rank);
    CHECK_OK(dp_module_zero_grad(net.root));
    grad_fill(&net, 5, untouched);
    backward(&net, &w, &grads[g_rank], NULL, g_rank == 0 ? 0x20u : 0x28u);
    CHECK_OK(wrap_finish(&w));
    grads_get(&net, &got);
    want = avg;
    for (i = 0; i < 2; ++i) {
      want.v[3][i] = grads[0].v[3][i] / (float)g_world;
      want.v[5][i] = untouched;
    }
    EXPECT_PARAMS("used everywhere: averaged", &got, &want, 0x17u, GRAD_RTOL, GRAD_ATOL);
    EXPECT_PARAMS("fc2.bias used on rank 0 only: its gradient / world size", &got, &want, 0x08u, GRAD_RTOL, GRAD_ATOL);
    EXPECT_PARAMS("fc3.bias used by no rank: untouched", &got, &want, 0x20u, 0, 0);
  }
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("every parameter used again", &got, &avg, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  wrap_destroy(&w);
  net_destroy(&net);
}

/* fp16 and bf16 compression: within the 16-bit type's precision of the
 * average; fc3.bias[0] is 1 + 2^-15 (fp16) or 1 + 2^-12 (bf16) on every
 * rank, which only an uncompressed reduction keeps: compressed it is 1. */
static void run_compressed(dp_process_group *pg, int32_t hook, double unit, float probe) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  Params cur, grads[MAXN], avg, got;
  int it, r, q, i;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  for (r = 0; r < g_world; ++r) grads[r].v[5][0] = probe;
  average(&avg, grads, g_world);
  o.comm_hook = hook;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  for (it = 0; it < 2; ++it) {
    CHECK_OK(dp_module_zero_grad(net.root));
    backward(&net, &w, &grads[g_rank], NULL, 0);
    CHECK_OK(wrap_finish(&w));
    grads_get(&net, &got);
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i) {
        double magnitude = 0;
        for (r = 0; r < g_world; ++r) magnitude += fabs(grads[r].v[q][i]);
        magnitude /= g_world;
        /* Each rank's value rounded once, the sum once, the result once. */
        CHECK(close_to(got.v[q][i], avg.v[q][i], 0, 4 * unit * magnitude + 1e-6),
              "iteration %d: %s[%d] is %.9g, want %.9g within the 16-bit precision", it + 1, kParam[q], i,
              (double)got.v[q][i], (double)avg.v[q][i]);
      }
    }
    CHECK(got.v[5][0] == 1.0f, "the probe %.9g came back as %.9g: the bucket was not compressed", (double)probe,
          (double)got.v[5][0]);
  }
  wrap_destroy(&w);
  net_destroy(&net);
}

static void hook_fp16(dp_process_group *pg) {
  run_compressed(pg, DP_HOOK_FP16, ldexp(1.0, -11), 1.0f + (float)ldexp(1.0, -15));
}
static void hook_bf16(dp_process_group *pg) {
  run_compressed(pg, DP_HOOK_BF16, ldexp(1.0, -8), 1.0f + (float)ldexp(1.0, -12));
}

/* Gradients near the fp16 maximum on every rank: each one fits, their sum
 * does not. Divided before the sum (as PyTorch's hooks do), the average
 * comes back finite and within fp16's precision of the true one. */
static void hook_fp16_large(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  Params grads[MAXN], avg, got;
  int r, q, i;
  net_create(&net, 42, 2, 0);
  memset(grads, 0, sizeof(grads));
  for (r = 0; r < g_world; ++r) {
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i)
        grads[r].v[q][i] = (float)(50000 + 4000 * r + 8 * i) * (q % 2 ? -1.0f : 1.0f);
    }
  }
  average(&avg, grads, g_world);
  o.comm_hook = DP_HOOK_FP16;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  for (q = 0; q < NP; ++q) {
    for (i = 0; i < param_numel(q); ++i) {
      CHECK(isfinite(got.v[q][i]) && close_to(got.v[q][i], avg.v[q][i], 0, 4 * ldexp(1.0, -11) * fabs(avg.v[q][i])),
            "%s[%d] is %.9g, want %.9g: the fp16 sum overflowed", kParam[q], i, (double)got.v[q][i],
            (double)avg.v[q][i]);
    }
  }
  wrap_destroy(&w);
  net_destroy(&net);
}

typedef struct HookState {
  int calls;
  int problems;
  int fail;
  unsigned seen; /* bit b: bucket b came through */
  int64_t elements;
} HookState;

/* All-reduce SUM then scale by 1/4, which no built-in hook does. */
static int scaled_sum_hook(void *user_data, dp_process_group *pg, size_t bucket_index, dp_tensor *flat_bucket) {
  HookState *s = (HookState *)user_data;
  float *v;
  int64_t i, n;
  ++s->calls;
  if (s->fail) return 7;
  if (pg == NULL || flat_bucket == NULL || dp_tensor_dtype(flat_bucket) != DP_FLOAT32 || bucket_index >= 32) {
    ++s->problems;
    return 1;
  }
  if (dp_pg_all_reduce(pg, flat_bucket, DP_SUM) != DP_OK) {
    fprintf(stderr, "rank %d: hook: all_reduce: %s\n", g_rank, dp_last_error());
    ++s->problems;
    return 2;
  }
  v = (float *)dp_tensor_data(flat_bucket);
  n = dp_tensor_numel(flat_bucket);
  for (i = 0; i < n; ++i) v[i] *= 0.25f;
  s->seen |= 1u << bucket_index;
  s->elements += n;
  return 0;
}

/* A C callback reduces each of the 3 buckets (24-byte caps); then a hook
 * that fails: DP_EUSER on every rank. */
static void hook_custom(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  HookState state;
  Net net;
  Wrap w;
  Params cur, grads[MAXN], want, got;
  int it, r, q, i;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  memset(&want, 0, sizeof(want));
  for (r = 0; r < g_world; ++r) {
    for (q = 0; q < NP; ++q) {
      for (i = 0; i < param_numel(q); ++i) want.v[q][i] += grads[r].v[q][i];
    }
  }
  for (q = 0; q < NP; ++q) {
    for (i = 0; i < param_numel(q); ++i) want.v[q][i] *= 0.25f;
  }
  memset(&state, 0, sizeof(state));
  o.comm_hook = DP_HOOK_CUSTOM;
  o.hook_fn = scaled_sum_hook;
  o.hook_user_data = &state;
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  CHECK(dp_ddp_num_buckets(w.ddp[0]) == 3, "%zu buckets, want 3", dp_ddp_num_buckets(w.ddp[0]));
  for (it = 0; it < 2; ++it) {
    memset(&state, 0, sizeof(state));
    CHECK_OK(dp_module_zero_grad(net.root));
    backward(&net, &w, &grads[g_rank], NULL, 0);
    CHECK_OK(wrap_finish(&w));
    CHECK(state.calls == 3 && state.seen == 7u && state.problems == 0 && state.elements == 18,
          "iteration %d: hook called %d times (buckets seen 0x%x, %d problems, %lld elements), want 3 (0x7, 0, 18)",
          it + 1, state.calls, state.seen, state.problems, (long long)state.elements);
    grads_get(&net, &got);
    EXPECT_PARAMS("custom hook: sum / 4", &got, &want, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  }
  wrap_destroy(&w);

  memset(&state, 0, sizeof(state));
  state.fail = 1;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  CHECK_OK(dp_module_zero_grad(net.root));
  backward(&net, &w, &grads[g_rank], NULL, 0);
  EXPECT_ERROR("a hook returning 7", wrap_finish(&w), DP_EUSER, "bucket");
  CHECK(state.calls >= 1, "%s", "the failing hook was not called");
  wrap_destroy(&w);
  net_destroy(&net);
}

/* Marking a parameter twice, by name or by index, is DP_ESTATE naming it,
 * and changes nothing: the backward goes on. */
static void double_ready(dp_process_group *pg) {
  Net net;
  Wrap w;
  Params cur, grads[MAXN], avg, got;
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  average(&avg, grads, g_world);
  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  CHECK_OK(dp_module_zero_grad(net.root));
  grad_add(&net, 4, grads[g_rank].v[4]);
  CHECK_OK(dp_ddp_mark_grad_ready(w.ddp[0], "fc3.weight"));
  EXPECT_ERROR("fc3.weight marked twice", dp_ddp_mark_grad_ready(w.ddp[0], "fc3.weight"), DP_ESTATE, "fc3.weight");
  EXPECT_ERROR("index 4 marked twice", dp_ddp_mark_grad_ready_index(w.ddp[0], 4), DP_ESTATE, "fc3.weight");
  /* fc2 and fc1, then fc3.bias by index. */
  backward(&net, &w, &grads[g_rank], NULL, 0x30u);
  grad_add(&net, 5, grads[g_rank].v[5]);
  CHECK_OK(dp_ddp_mark_grad_ready_index(w.ddp[0], 5));
  CHECK_OK(wrap_finish(&w));
  grads_get(&net, &got);
  EXPECT_PARAMS("after the refused marks", &got, &avg, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
  wrap_destroy(&w);
  net_destroy(&net);
}

static void flag_path(char *out, size_t cap) { snprintf(out, cap, "%s/rank0_done", g_dir); }

/* Rank 1 marks fc3 (bucket 0 reduces) and then stops marking; rank 0's
 * finish_backward times out (5 s group timeout) naming bucket 1 and rank 1.
 * Rank 1 waits for rank 0 to be done, without finishing. */
static void stop_marking(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  Params cur, grads[MAXN];
  char flag[512];
  flag_path(flag, sizeof(flag));
  net_create(&net, 42, 2, 0);
  net_get(&net, &cur);
  all_rank_grads(&cur, grads, 0);
  o.bucket_cap_mb = o.first_bucket_cap_mb = CAP_MB(24);
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  EXPECT_PLAN("a bucket per layer", w.ddp[0], "{5,4},{3,2},{1,0}");
  CHECK_OK(dp_module_zero_grad(net.root));
  if (g_rank == 1) {
    double start = now_ms();
    backward(&net, &w, &grads[1], NULL, 0x0Fu);
    while (access(flag, F_OK) != 0 && now_ms() - start < 120000.0) sleep_ms(20);
    CHECK(access(flag, F_OK) == 0, "%s", "rank 0 never finished");
  } else {
    backward(&net, &w, &grads[0], NULL, 0);
    EXPECT_ERROR("finish while rank 1 stopped marking", wrap_finish(&w), DP_ETIMEOUT, "bucket 1", "rank(s) 1");
    {
      FILE *f = fopen(flag, "w");
      CHECK(f != NULL, "cannot create %s", flag);
      if (f != NULL) fclose(f);
    }
  }
  wrap_destroy(&w);
  net_destroy(&net);
}

/* init_sync: rank r starts from seed 100 + r; after create every rank holds
 * rank 0's parameters and buffer. pre_forward broadcasts the buffer again;
 * without init_sync and broadcast_buffers nothing moves. */
static void init_sync(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net, rank0;
  Wrap w;
  Params mine, theirs, got;
  float buf0[2], buf[2];
  net_create(&net, 100 + (uint64_t)g_rank, 2, 1);
  net_create(&rank0, 100, 2, 1);
  net_get(&net, &mine);
  net_get(&rank0, &theirs);
  buffer_get(&rank0, buf0);
  if (g_rank != 0) CHECK(memcmp(&mine, &theirs, sizeof(mine)) != 0, "%s", "the seeds give equal parameters");

  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  net_get(&net, &got);
  EXPECT_PARAMS("after create: rank 0's parameters", &got, &theirs, ALL_PARAMS, 0, 0);
  buffer_get(&net, buf);
  CHECK(buf[0] == buf0[0] && buf[1] == buf0[1], "buffer is %g %g, rank 0's is %g %g", (double)buf[0], (double)buf[1],
        (double)buf0[0], (double)buf0[1]);
  buffer_set(&net, g_rank == 0 ? 3.0f : 7.0f, g_rank == 0 ? 4.0f : 7.0f);
  wrap_pre_forward(&w);
  buffer_get(&net, buf);
  CHECK(buf[0] == 3.0f && buf[1] == 4.0f, "after pre_forward the buffer is %g %g, want rank 0's 3 4", (double)buf[0],
        (double)buf[1]);
  wrap_destroy(&w);

  net_set(&net, &mine);
  o.init_sync = 0;
  o.broadcast_buffers = 0;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  buffer_set(&net, (float)(10 + g_rank), 0.5f);
  wrap_pre_forward(&w);
  net_get(&net, &got);
  EXPECT_PARAMS("without init_sync: this rank's parameters", &got, &mine, ALL_PARAMS, 0, 0);
  buffer_get(&net, buf);
  CHECK(buf[0] == (float)(10 + g_rank) && buf[1] == 0.5f, "without broadcast_buffers the buffer is %g %g",
        (double)buf[0], (double)buf[1]);
  wrap_destroy(&w);
  net_destroy(&rank0);
  net_destroy(&net);
}

/* Rank 1's fc2.weight is 3x2: create fails on every rank naming it and both
 * shapes; the group stays usable. */
static void init_mismatch(dp_process_group *pg) {
  Net net;
  Wrap w;
  net_create(&net, 42, g_rank == 1 ? 3 : 2, 0);
  EXPECT_ERROR("create with fc2.weight 3x2 on rank 1", wrap_whole(&w, &net, pg, NULL), DP_EINVAL, "fc2.weight", "3x2",
               "2x2", "rank 1");
  CHECK(w.ddp[0] == NULL, "%s", "a dp_ddp came out of a failed create");
  CHECK_OK(dp_pg_barrier(pg));
  net_destroy(&net);
}

/* The group still works after a refused create: an all_reduce sums every
 * rank's number, and a create with good options succeeds on every rank. */
static void expect_group_usable(Net *net, dp_process_group *pg) {
  dp_tensor *t = new_tensor(1, 1, 0);
  Wrap w;
  *(float *)dp_tensor_data(t) = (float)(g_rank + 1);
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  CHECK(*(float *)dp_tensor_data(t) == (float)(g_world * (g_world + 1) / 2), "the all_reduce after the refusal gave %g",
        (double)*(float *)dp_tensor_data(t));
  dp_tensor_destroy(t);
  CHECK_OK(wrap_whole(&w, net, pg, NULL));
  wrap_destroy(&w);
}

/* Rank 1 alone gives a bucket cap of -1 MiB: every rank's create fails at
 * once with DP_EINVAL naming rank 1 and the option (not at the group's
 * timeout), and the group stays usable. */
static void refuse_cap(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  net_create(&net, 42, 2, 0);
  if (g_rank == 1) o.bucket_cap_mb = -1.0;
  EXPECT_ERROR("create with bucket_cap_mb -1 on rank 1", wrap_whole(&w, &net, pg, &o), DP_EINVAL, "rank 1 refused",
               "opts->bucket_cap_mb");
  CHECK(w.ddp[0] == NULL, "%s", "a dp_ddp came out of a failed create");
  expect_group_usable(&net, pg);
  net_destroy(&net);
}

/* Without init_sync but with a bucket plan (a create that compares the
 * plans across ranks), rank 1 alone ignores a parameter the net does not
 * have: every rank fails at once naming rank 1 and the name. */
static void refuse_plan_name(dp_process_group *pg) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  const char *unknown[1] = {"fc9.weight"};
  char plan[512];
  size_t len = 0;
  Net net;
  Wrap w;
  net_create(&net, 42, 2, 0);
  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  if (w.count != 1) exit(1);
  CHECK_OK(dp_ddp_bucket_plan(w.ddp[0], plan, sizeof plan, &len));
  CHECK(len < sizeof plan, "the plan takes %zu bytes", len);
  wrap_destroy(&w);
  o.init_sync = 0;
  o.bucket_plan = plan;
  if (g_rank == 1) {
    o.ignored_parameters = unknown;
    o.num_ignored_parameters = 1;
  }
  EXPECT_ERROR("create with a plan and an unknown ignored parameter on rank 1", wrap_whole(&w, &net, pg, &o), DP_EINVAL,
               "rank 1 refused", "fc9.weight");
  CHECK(w.ddp[0] == NULL, "%s", "a dp_ddp came out of a failed create");
  expect_group_usable(&net, pg);
  net_destroy(&net);
}

/* No init_sync, and rank 1's fc2.weight is 3x2: its bucket holds 20
 * elements where rank 0's holds 18. finish_backward fails on every rank
 * (with DP_DEBUG=DETAIL naming the bucket), never hangs or reduces
 * mismatched data. */
static void run_graph_mismatch(dp_process_group *pg, int detail) {
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  Net net;
  Wrap w;
  int p;
  dp_status st;
  net_create(&net, 42, g_rank == 1 ? 3 : 2, 0);
  o.init_sync = 0;
  CHECK_OK(wrap_whole(&w, &net, pg, &o));
  if (w.count != 1) exit(1);
  CHECK_OK(dp_module_zero_grad(net.root));
  for (p = 5; p >= 0; --p) CHECK_OK(dp_ddp_mark_grad_ready(w.ddp[0], kParam[p]));
  st = wrap_finish(&w);
  if (detail) {
    EXPECT_ERROR("finish with diverging graphs under DP_DEBUG=DETAIL", st, DP_EINVAL, "bucket 0", "18", "20",
                 "rank 1 reduces");
  } else {
    printf("rank %d: finish with diverging graphs: status %d (%s): %s\n", g_rank, (int)st, dp_status_string(st),
           dp_last_error());
    CHECK(st != DP_OK, "%s", "mismatched buckets reduced without an error");
  }
  wrap_destroy(&w);
  net_destroy(&net);
}

static void detail_mismatch(dp_process_group *pg) { run_graph_mismatch(pg, 1); }
static void graph_mismatch(dp_process_group *pg) { run_graph_mismatch(pg, 0); }

/* ---- dp_ddp_rebind: the dp_ddp goes on over a shrunk group ---- */

/* What the rebind scenarios' custom hook saw. It averages over the group it
 * is given, so a hook still holding the old group would divide by 4. */
typedef struct RebindHook {
  dp_ddp *const *ddp; /* the hook's own dp_ddp, for a rebind tried from inside */
  int32_t group_size; /* the size of the last group it was given */
  int tried;
  dp_status inside; /* that rebind's status */
} RebindHook;

static int averaging_hook(void *user_data, dp_process_group *pg, size_t bucket_index, dp_tensor *flat_bucket) {
  RebindHook *h = (RebindHook *)user_data;
  (void)bucket_index;
  h->group_size = dp_process_group_size(pg);
  if (!h->tried && h->ddp != NULL && *h->ddp != NULL) {
    h->tried = 1;
    h->inside = dp_ddp_rebind(*h->ddp, pg);
    printf("rank %d: rebind inside the comm hook: status %d: %s\n", g_rank, (int)h->inside, dp_last_error());
  }
  return dp_pg_all_reduce(pg, flat_bucket, DP_AVG) == DP_OK ? 0 : 1;
}

/* on_bucket_reduced: counts the parameters reported. */
static int count_reported(void *user_data, dp_ddp *ddp, size_t bucket_index, const size_t *param_indices,
                          size_t nparams) {
  (void)ddp;
  (void)bucket_index;
  (void)param_indices;
  *(size_t *)user_data += nparams;
  return 0;
}

/* Ranks 0..world-1's gradients at `p`, averaged as the reducer does. */
static void rank_average(const Params *p, int world, uint64_t salt, Params *out) {
  Params per_rank[MAXN];
  int r;
  for (r = 0; r < world; ++r) {
    Batch b;
    rank_batch(&b, r, salt);
    net_grads(p, &b, &per_rank[r]);
  }
  average(out, per_rank, world);
}

/* 4 ranks train 2 steps; then rank 3 leaves (a negative color in the
 * split), rank 1's parameters and buffer drift, and ranks 0..2 rebind onto
 * their group of 3, which gives every rank rank 0's again; they train 2 more
 * steps. Each step's gradients are the average over the ranks of the group
 * at that step, of gradients computed at the very parameters the dp_ddp
 * holds (so only the reduction's summation order differs: GRAD_RTOL); the
 * parameters follow a reference trained by hand (4-rank averages, then
 * 3-rank ones), within float rounding accumulated over 4 steps. */
static void run_rebind_shrink(dp_process_group *pg, dp_ddp_options *opts, RebindHook *hook) {
  const int steps_before = 2, steps_after = 2;
  const float lr = 0.5f;
  size_t reported = 0;
  dp_process_group *sub = NULL;
  dp_tensor *held = NULL;
  Net net;
  Params ref, cur, g, want, local;
  Wrap w;
  int step;
  if (g_world != 4) exit(2);
  net_create(&net, 42, 2, 1);
  net_get(&net, &ref);
  if (opts->comm_hook != DP_HOOK_CUSTOM) {
    opts->on_bucket_reduced = count_reported;
    opts->on_bucket_reduced_data = &reported;
  }
  CHECK_OK(wrap_whole(&w, &net, pg, opts));
  if (w.count != 1) exit(1);
  if (hook != NULL) hook->ddp = &w.ddp[0];
  for (step = 0; step < steps_before + steps_after; ++step) {
    const int world = step < steps_before ? 4 : 3;
    char what[96];
    Batch mine;
    if (step == steps_before) {
      Params before, after;
      float buffer_before[2], buffer_after[2];
      CHECK_OK(dp_process_group_split(pg, g_rank == 3 ? -1 : 0, g_rank, NULL, &sub));
      if (g_rank == 3) {
        CHECK(sub == NULL, "rank 3 passed a negative color but got a group");
        break;
      }
      if (sub == NULL) exit(1);
      printf("rank %d: rebind onto a group of %d over %s\n", g_rank, dp_process_group_size(sub),
             dp_process_group_backend(sub));
      net_get(&net, &before);
      buffer_get(&net, buffer_before);
      if (g_rank == 1) {
        Params drifted = before;
        int p, i;
        for (p = 0; p < NP; ++p) {
          for (i = 0; i < param_numel(p); ++i) drifted.v[p][i] += 1.0f;
        }
        net_set(&net, &drifted);
        buffer_set(&net, 5.0f, 6.0f);
      }
      if (opts->gradient_as_bucket_view) CHECK_OK(dp_module_grad(net.root, "fc3.weight", &held));
      CHECK_OK(dp_ddp_rebind(w.ddp[0], sub));
      net_get(&net, &after);
      buffer_get(&net, buffer_after);
      CHECK(memcmp(&after, &before, sizeof(after)) == 0, "the parameters after the rebind are not rank 0's");
      CHECK(memcmp(buffer_after, buffer_before, sizeof(buffer_after)) == 0, "the buffer is %g %g, not rank 0's %g %g",
            buffer_after[0], buffer_after[1], buffer_before[0], buffer_before[1]);
      CHECK(dp_ddp_num_buckets(w.ddp[0]) >= 1, "no buckets after the rebind: %s", dp_last_error());
    }
    rank_average(&ref, world, (uint64_t)step, &want);
    sgd(&ref, &want, lr);

    reported = 0;
    CHECK_OK(dp_module_zero_grad(net.root));
    wrap_pre_forward(&w);
    net_get(&net, &cur);
    rank_batch(&mine, g_rank, (uint64_t)step);
    net_grads(&cur, &mine, &local);
    backward(&net, &w, &local, NULL, 0);
    CHECK_OK(wrap_finish(&w));
    grads_get(&net, &g);
    rank_average(&cur, world, (uint64_t)step, &want);
    snprintf(what, sizeof(what), "gradients of step %d (the average over %d ranks)", step + 1, world);
    EXPECT_PARAMS(what, &g, &want, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
    if (opts->comm_hook != DP_HOOK_CUSTOM) {
      CHECK(reported == NP, "step %d: on_bucket_reduced reported %zu parameters, want %d", step + 1, reported, NP);
    }
    if (hook != NULL) {
      CHECK(hook->group_size == world, "step %d: the hook was given a group of %d, want %d", step + 1, hook->group_size,
            world);
    }
    if (held != NULL) {
      float now[4];
      copy_out(held, now, 4, "fc3.weight's gradient taken before the rebind");
      CHECK(memcmp(now, g.v[4], sizeof(now)) == 0, "a gradient handle taken before the rebind does not follow it");
    }
    sgd(&cur, &g, lr);
    net_set(&net, &cur);
    snprintf(what, sizeof(what), "parameters after step %d", step + 1);
    EXPECT_PARAMS(what, &cur, &ref, ALL_PARAMS, 1e-5, 1e-6);
  }
  dp_tensor_destroy(held);
  wrap_destroy(&w);
  dp_process_group_destroy(sub);
  net_destroy(&net);
}

static void rebind_shrink(dp_process_group *pg) {
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  run_rebind_shrink(pg, &opts, NULL);
}

/* Views into buckets that the rebind lays out anew, with the used map and a
 * static graph recorded again on the new group. */
static void rebind_shrink_view(dp_process_group *pg) {
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  opts.gradient_as_bucket_view = 1;
  opts.find_unused_parameters = 1;
  opts.static_graph = 1;
  opts.first_bucket_cap_mb = CAP_MB(16);
  opts.bucket_cap_mb = CAP_MB(16);
  run_rebind_shrink(pg, &opts, NULL);
}

/* A custom hook is given the new group; a rebind from inside it is refused. */
static void rebind_shrink_hook(dp_process_group *pg) {
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  RebindHook hook;
  memset(&hook, 0, sizeof(hook));
  opts.comm_hook = DP_HOOK_CUSTOM;
  opts.hook_fn = averaging_hook;
  opts.hook_user_data = &hook;
  run_rebind_shrink(pg, &opts, &hook);
  CHECK(hook.tried && hook.inside == DP_ESTATE, "the rebind inside the hook returned %d, want DP_ESTATE",
        (int)hook.inside);
}

/* Rank 1 aborts its copy of the new group before the rebind: the rebind
 * fails on both ranks and leaves the dp_ddp refusing every call but
 * destroy; its parameters are free again for a dp_ddp made anew. */
static void rebind_failed(dp_process_group *pg) {
  dp_process_group *sub = NULL;
  dp_ddp *fresh = NULL;
  Net net;
  Wrap w;
  dp_status st;
  net_create(&net, 42, 2, 0);
  CHECK_OK(wrap_whole(&w, &net, pg, NULL));
  CHECK_OK(dp_process_group_split(pg, 0, g_rank, NULL, &sub));
  if (w.count != 1 || sub == NULL) exit(1);
  if (g_rank == 1) CHECK_OK(dp_process_group_abort(sub));
  st = dp_ddp_rebind(w.ddp[0], sub);
  printf("rank %d: failed rebind: status %d: %s\n", g_rank, (int)st, dp_last_error());
  CHECK(st != DP_OK, "the rebind onto an aborted group succeeded");
  EXPECT_ERROR("pre_forward after it", dp_ddp_pre_forward(w.ddp[0]), DP_ESTATE, "dp_ddp_rebind", "dp_ddp_destroy");
  EXPECT_ERROR("mark after it", dp_ddp_mark_grad_ready_index(w.ddp[0], 0), DP_ESTATE, "dp_ddp_rebind");
  EXPECT_ERROR("a second rebind", dp_ddp_rebind(w.ddp[0], pg), DP_ESTATE, "dp_ddp_rebind");
  CHECK(dp_ddp_num_buckets(w.ddp[0]) == 0, "a failed dp_ddp reports buckets");
  wrap_destroy(&w);
  CHECK_OK(dp_ddp_create(&fresh, net.root, pg, NULL));
  dp_ddp_destroy(fresh);
  dp_process_group_destroy(sub);
  net_destroy(&net);
}

/* One synced step of the whole net under `ddp`, on rank g_rank's batch
 * `salt`; checks that the gradients are the average over `world` ranks. */
static void rebind_step(Net *net, Wrap *w, int world, uint64_t salt, const char *what) {
  Params cur, local, g, want;
  Batch mine;
  CHECK_OK(dp_module_zero_grad(net->root));
  wrap_pre_forward(w);
  net_get(net, &cur);
  rank_batch(&mine, g_rank, salt);
  net_grads(&cur, &mine, &local);
  backward(net, w, &local, NULL, 0);
  CHECK_OK(wrap_finish(w));
  grads_get(net, &g);
  rank_average(&cur, world, salt, &want);
  EXPECT_PARAMS(what, &g, &want, ALL_PARAMS, GRAD_RTOL, GRAD_ATOL);
}

/* 3 ranks train a step; then rank 2 dies (exits without a word) and ranks
 * 0 and 1 fail their next finish_backward on the broken group. They shrink
 * it to the two of them and rebind onto that: nothing is sent on the old
 * group, and nothing waits for its timeout (120 s, past the driver's
 * limit); rank 1's drifted parameters become rank 0's, and the next step
 * averages over 2. */
static void rebind_after_peer_died(dp_process_group *pg) {
  dp_ddp_options opts = DP_DDP_OPTIONS_INIT;
  dp_process_group *survivors = NULL;
  int32_t lost[4] = {-1, -1, -1, -1}, lost_count;
  char path[512];
  Params before, after, local;
  Batch mine;
  Net net;
  Wrap w;
  dp_status st;
  if (g_world != 3) exit(2);
  opts.broadcast_buffers = 0; /* the failure comes at the finish, not at a broadcast */
  net_create(&net, 42, 2, 0);
  CHECK_OK(wrap_whole(&w, &net, pg, &opts));
  if (w.count != 1) exit(1);
  rebind_step(&net, &w, 3, 0, "gradients of the step over 3");
  snprintf(path, sizeof(path), "%s/stepped_%d", g_dir, g_rank);
  if (g_rank == 2) {
    /* Once the others are past the step, as if killed. */
    int r;
    for (r = 0; r < 2; ++r) {
      double start = now_ms();
      snprintf(path, sizeof(path), "%s/stepped_%d", g_dir, r);
      while (access(path, F_OK) != 0 && now_ms() - start < 60000.0) sleep_ms(10);
    }
    printf("rank %d: rebind_after_peer_died passed\n", g_rank);
    fflush(stdout);
    _exit(g_failures == 0 ? 0 : 1);
  }
  {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot create %s", path);
    if (f != NULL) fclose(f);
  }
  CHECK_OK(dp_module_zero_grad(net.root));
  net_get(&net, &before);
  rank_batch(&mine, g_rank, 1);
  net_grads(&before, &mine, &local);
  backward(&net, &w, &local, NULL, 0);
  st = wrap_finish(&w);
  printf("rank %d: finish with rank 2 dead: status %d: %s\n", g_rank, (int)st, dp_last_error());
  CHECK(st != DP_OK, "%s", "the finish with a dead peer succeeded");

  CHECK_OK(dp_process_group_shrink(pg, &survivors));
  if (survivors == NULL) exit(1);
  lost_count = dp_process_group_lost_ranks(survivors, lost, 4);
  CHECK(lost_count == 1 && lost[0] == 2, "the shrink lost %d rank(s), the first %d; want rank 2 alone", (int)lost_count,
        (int)lost[0]);
  CHECK(dp_process_group_size(survivors) == 2 && dp_process_group_rank(survivors) == g_rank,
        "the survivors' group: rank %d of %d", dp_process_group_rank(survivors), dp_process_group_size(survivors));
  if (g_rank == 1) {
    Params drifted = before;
    drifted.v[0][0] += 1.0f;
    net_set(&net, &drifted);
  }
  CHECK_OK(dp_ddp_rebind(w.ddp[0], survivors));
  net_get(&net, &after);
  CHECK(memcmp(&after, &before, sizeof(after)) == 0, "%s", "the parameters after the rebind are not rank 0's");
  rebind_step(&net, &w, 2, 2, "gradients of the step over the 2 survivors");
  printf("rank %d: rebind onto the survivors over %s\n", g_rank, dp_process_group_backend(survivors));
  wrap_destroy(&w);
  dp_process_group_destroy(survivors);
  net_destroy(&net);
}

typedef struct Scenario {
  const char *name;
  void (*run)(dp_process_group *);
  int32_t timeout_ms; /* the group's */
} Scenario;

static const Scenario kScenarios[] = {
    {"state_dict", state_dict, 60000},
    {"parity", parity_whole, 60000},
    {"parity_layers", parity_layers, 60000},
    {"parity_mesh", parity_mesh, 60000},
    {"parity_cap1", parity_cap1, 60000},
    {"parity_view", parity_view, 60000},
    {"parity_small_buckets", parity_small_buckets, 60000},
    {"parity_view_small_buckets", parity_view_small_buckets, 60000},
    {"ignored", ignored, 60000},
    {"rebuild", rebuild, 60000},
    {"rebuild_view", rebuild_view, 60000},
    {"rebuild_exports", rebuild_exports, 60000},
    {"step_scratch", step_scratch, 60000},
    {"rebuild_exports_static", rebuild_exports_static, 60000},
    {"rebuild_exports_join", rebuild_exports_join, 60000},
    {"no_sync", no_sync, 60000},
    {"unused_error", unused_error, 60000},
    {"unused_error_buckets", unused_error_buckets, 60000},
    {"unused_error_buckets_rebuilt", unused_error_buckets_rebuilt, 60000},
    {"unused_error_views", unused_error_views, 60000},
    {"unused_found", unused_found, 60000},
    {"hook_fp16", hook_fp16, 60000},
    {"hook_bf16", hook_bf16, 60000},
    {"hook_fp16_large", hook_fp16_large, 60000},
    {"hook_custom", hook_custom, 60000},
    {"double_ready", double_ready, 60000},
    {"stop_marking", stop_marking, 5000},
    {"init_sync", init_sync, 60000},
    {"init_mismatch", init_mismatch, 60000},
    {"detail_mismatch", detail_mismatch, 10000},
    {"graph_mismatch", graph_mismatch, 10000},
    {"rebind_shrink", rebind_shrink, 60000},
    {"rebind_shrink_view", rebind_shrink_view, 60000},
    {"rebind_shrink_hook", rebind_shrink_hook, 60000},
    {"rebind_failed", rebind_failed, 20000},
    /* Past the driver's limit: a rebind waiting for the broken group fails. */
    {"rebind_after_peer_died", rebind_after_peer_died, 120000},
    /* Longer than the driver's limit: a rank left waiting shows as killed. */
    {"refuse_cap", refuse_cap, 120000},
    {"refuse_plan_name", refuse_plan_name, 120000},
};

int main(int argc, char **argv) {
  const Scenario *scenario = NULL;
  const char *rank_text = getenv("RANK"), *world_text = getenv("WORLD_SIZE"), *dir = getenv("DP_TEST_DIR");
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  dp_process_group *pg = NULL;
  size_t i;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc >= 2) {
    for (i = 0; i < sizeof(kScenarios) / sizeof(kScenarios[0]); ++i) {
      if (strcmp(argv[1], kScenarios[i].name) == 0) scenario = &kScenarios[i];
    }
  }
  if (scenario == NULL) {
    fprintf(stderr, "usage: ddp_worker SCENARIO; unknown scenario '%s'\n", argc >= 2 ? argv[1] : "");
    return 2;
  }
  g_rank = rank_text != NULL ? atoi(rank_text) : -1;
  g_world = world_text != NULL ? atoi(world_text) : 0;
  if (dir != NULL) g_dir = dir;
  if (g_world < 1 || g_world > MAXN / 2) {
    fprintf(stderr, "rank %d: WORLD_SIZE must be 1..%d\n", g_rank, MAXN / 2);
    return 2;
  }
  opts.timeout_ms = scenario->timeout_ms;
  opts.backend = test_group_backend(DP_BACKEND_AUTO);
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    fprintf(stderr, "rank %d: group create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  CHECK(dp_process_group_rank(pg) == g_rank && dp_process_group_size(pg) == g_world, "group is rank %d of %d",
        dp_process_group_rank(pg), dp_process_group_size(pg));
  check_test_group_backend(pg);
  scenario->run(pg);
  dp_process_group_destroy(pg);
  if (g_failures == 0) printf("rank %d: %s passed\n", g_rank, scenario->name);
  return g_failures == 0 ? 0 : 1;
}
