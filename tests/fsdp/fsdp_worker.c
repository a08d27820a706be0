/* One rank of fully_shard across real processes, in plain C over the public
 * headers, as a C host drives it: the seed test's ToyModel (3 x Linear(3, 3)
 * in `linears`, then `proj`, no biases), fully_shard on each linear and on
 * `linears`, a dp_ddp on the root, a forward and backward written here, SGD
 * on the shards. Scenarios:
 *   toy          trains 4 steps with prefetching unshards and compares every
 *                parameter with single-process training on the whole batch;
 *                then a full state dict from rank 0 loads back on every rank
 *   toy_views    toy with full_params_as_views on the linears: the full
 *                parameter's rows are the shard itself on shared memory;
 *                elsewhere the option leaves copies
 *   peer_exits   the last rank exits before an unshard the others make:
 *                theirs fails within the group's timeout naming it
 *   peer_exits_views  the same with views on shared memory
 *   save_fails   a sharded save, then a second one that rank 1 cannot write
 *                (a file-size limit): it fails on every rank, naming rank 1,
 *                and the first save still loads, its files alone in the folder
 *   save_killed  the same, but rank 1 dies while writing (as SIGXFSZ's
 *                default would kill it, though with exit code 0 so that
 *                dp-run lets rank 0 go on): rank 0's save fails, and a new
 *                group of rank 0 alone loads the first save
 *   async_save   background saves: each holds the values at its call though
 *                the host changes them at once; saves started while one is
 *                in flight queue behind it; one survives its module's
 *                destroy; each loads on the group and on a group of rank 0
 *                alone (another world size), as a synchronous save does
 *   async_save_fails  a background save that rank 1 cannot write: every
 *                rank's work fails naming rank 1, no manifest is written,
 *                and the folder's last save still loads (a folder with no
 *                other save is refused)
 *   async_save_killed  rank 1 dies while writing a background save: rank 0's
 *                work fails within the group's timeout naming rank 1, and
 *                rank 0 alone loads the last complete save
 *   async_save_outlives  a background save outlives its module and its group
 *                (a split of the world, destroyed at once) and still
 *                loads; then a save left in flight at exit ends quietly
 *   async_refuse  arguments refused on one rank: DP_EINVAL naming them there,
 *                the other rank's work fails naming that rank, and the
 *                group's next background save still succeeds
 *   refuse_dtype  rank 1 alone asks for an integer param_dtype: every rank's
 *                create fails at once naming rank 1, and the group works on
 *   refuse_overlap  rank 1 alone gives a module with two parameters over
 *                overlapping memory: the same, naming both parameters
 * toy and toy_views run over the backend DP_TEST_GROUP_BACKEND names
 * (tests/backends.h rank_env; NCCL: rank r's tensors on cuda:LOCAL_RANK,
 * exit 77 without a GPU per rank), the others over their own.
 * Prints "rank R: SCENARIO passed" and exits 0 when every check held. */
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "c_worker_check.h"

#define DIM 3
#define ROWS_PER_RANK 4
#define MAX_ROWS 64
#define STEPS 4
#define LR 0.2

static int g_views;                             /* the scenario's full_params_as_views */
static dp_device g_device = {DP_DEVICE_CPU, 0}; /* where the toy's tensors live */

static const char *const kWeights[4] = {"linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight"};

static float initial(int layer, int k, float skew) { return 0.3f * sinf(1.7f * (float)(layer * 9 + k) + 0.4f) + skew; }

static void batch(int step, int rows, double *x, double *t) {
  for (int k = 0; k < rows * DIM; ++k) {
    x[k] = cos(0.37 * k + 0.91 * step);
    t[k] = 0.5 * sin(0.53 * k - 0.29 * step);
  }
}

/* y = x W^T over `rows` rows. */
static void linear(const double *x, const float *w, double *y, int rows) {
  for (int b = 0; b < rows; ++b) {
    for (int o = 0; o < DIM; ++o) {
      double sum = 0;
      for (int i = 0; i < DIM; ++i) sum += x[b * DIM + i] * w[o * DIM + i];
      y[b * DIM + o] = sum;
    }
  }
}

/* g += dy^T x; dx = dy W (dx may be NULL). */
static void backward(const double *dy, const double *x, const float *w, double *g, double *dx, int rows) {
  for (int b = 0; b < rows; ++b) {
    for (int o = 0; o < DIM; ++o) {
      for (int i = 0; i < DIM; ++i) g[o * DIM + i] += dy[b * DIM + o] * x[b * DIM + i];
    }
  }
  if (dx == NULL) return;
  for (int b = 0; b < rows; ++b) {
    for (int i = 0; i < DIM; ++i) {
      double sum = 0;
      for (int o = 0; o < DIM; ++o) sum += dy[b * DIM + o] * w[o * DIM + i];
      dx[b * DIM + i] = sum;
    }
  }
}

/* Single-process training on the whole batch: the reference weights. */
static void reference(float w[4][DIM * DIM]) {
  const int rows = ROWS_PER_RANK * g_world;
  for (int l = 0; l < 4; ++l) {
    for (int k = 0; k < DIM * DIM; ++k) w[l][k] = initial(l, k, 0.0f);
  }
  for (int s = 0; s < STEPS; ++s) {
    double x[MAX_ROWS * DIM], t[MAX_ROWS * DIM], h[5][MAX_ROWS * DIM], dy[MAX_ROWS * DIM], dx[MAX_ROWS * DIM];
    double g[4][DIM * DIM] = {{0}};
    batch(s, rows, x, t);
    memcpy(h[0], x, sizeof(double) * rows * DIM);
    for (int l = 0; l < 4; ++l) linear(h[l], w[l], h[l + 1], rows);
    for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - t[k]) / rows;
    for (int l = 3; l >= 0; --l) {
      backward(dy, h[l], w[l], g[l], dx, rows);
      memcpy(dy, dx, sizeof(double) * rows * DIM);
    }
    for (int l = 0; l < 4; ++l) {
      for (int k = 0; k < DIM * DIM; ++k) w[l][k] -= (float)(LR * g[l][k]);
    }
  }
}

typedef struct Toy {
  dp_module *root, *linears, *layer[4];
  dp_fsdp *fsdp[3], *fsdp_linears;
  dp_ddp *ddp;
} Toy;

static void toy_create(Toy *toy, float skew, dp_process_group *pg) {
  memset(toy, 0, sizeof *toy);
  CHECK_OK(dp_module_create(&toy->root));
  CHECK_OK(dp_module_create(&toy->linears));
  for (int l = 0; l < 4; ++l) {
    float v[DIM * DIM];
    int64_t shape[2] = {DIM, DIM};
    dp_tensor *w = NULL;
    for (int k = 0; k < DIM * DIM; ++k) v[k] = initial(l, k, skew);
    CHECK_OK(dp_module_create(&toy->layer[l]));
    CHECK_OK(dp_tensor_create(&w, DP_FLOAT32, 2, shape, g_device));
    CHECK_OK(dp_tensor_copy_from_host(w, v, sizeof v));
    CHECK_OK(dp_module_register_parameter(toy->layer[l], "weight", w, 1));
    dp_tensor_destroy(w);
    if (l < 3) {
      char name[2] = {(char)('0' + l), 0};
      CHECK_OK(dp_module_register_module(toy->linears, name, toy->layer[l]));
    }
  }
  CHECK_OK(dp_module_register_module(toy->root, "linears", toy->linears));
  CHECK_OK(dp_module_register_module(toy->root, "proj", toy->layer[3]));
  if (pg == NULL) return;
  dp_fsdp_options o = DP_FSDP_OPTIONS_INIT;
  o.full_params_as_views = g_views;
  for (int l = 0; l < 3; ++l) CHECK_OK(dp_fsdp_create(&toy->fsdp[l], toy->layer[l], pg, &o));
  CHECK_OK(dp_fsdp_create(&toy->fsdp_linears, toy->linears, pg, NULL));
  CHECK_OK(dp_ddp_create(&toy->ddp, toy->root, pg, NULL));
}

static void toy_destroy(Toy *toy) {
  dp_ddp_destroy(toy->ddp);
  dp_fsdp_destroy(toy->fsdp_linears);
  for (int l = 2; l >= 0; --l) dp_fsdp_destroy(toy->fsdp[l]);
  for (int l = 0; l < 4; ++l) dp_module_destroy(toy->layer[l]);
  dp_module_destroy(toy->linears);
  dp_module_destroy(toy->root);
}

/* The parameter (or, with `grad`, its gradient) as floats; returns the count. */
static size_t get(dp_module *m, const char *name, int grad, float *out, size_t cap) {
  dp_tensor *t = NULL;
  if ((grad ? dp_module_grad(m, name, &t) : dp_module_get_parameter(m, name, &t)) != DP_OK) {
    CHECK(0, "%s of %s: %s", grad ? "grad" : "parameter", name, dp_last_error());
    return 0;
  }
  size_t n = (size_t)dp_tensor_numel(t);
  CHECK(n <= cap, "%zu elements", n);
  if (n <= cap) CHECK_OK(dp_tensor_copy_to_host(t, out, n * sizeof(float)));
  dp_tensor_destroy(t);
  return n;
}

/* grad += delta */
static void add_grad(dp_module *m, const char *name, const double *delta) {
  float g[DIM * DIM];
  dp_tensor *t = NULL;
  CHECK_OK(dp_module_grad(m, name, &t));
  if (t == NULL) return;
  CHECK_OK(dp_tensor_copy_to_host(t, g, sizeof g));
  for (int k = 0; k < DIM * DIM; ++k) g[k] += (float)delta[k];
  CHECK_OK(dp_tensor_copy_from_host(t, g, sizeof g));
  dp_tensor_destroy(t);
}

static void train_step(Toy *toy, int step) {
  const int rows = ROWS_PER_RANK, global = ROWS_PER_RANK * g_world;
  double all_x[MAX_ROWS * DIM], all_t[MAX_ROWS * DIM], h[5][ROWS_PER_RANK * DIM], dy[ROWS_PER_RANK * DIM],
      dx[ROWS_PER_RANK * DIM];
  float w[4][DIM * DIM];
  batch(step, global, all_x, all_t);
  memcpy(h[0], all_x + g_rank * rows * DIM, sizeof h[0]);
  /* forward: unshard with the next layer prefetched, reshard after */
  CHECK_OK(dp_fsdp_unshard(toy->fsdp_linears, 0));
  CHECK_OK(dp_fsdp_unshard(toy->fsdp[0], 0));
  for (int l = 0; l < 3; ++l) {
    if (l + 1 < 3) CHECK_OK(dp_fsdp_unshard(toy->fsdp[l + 1], 1));
    CHECK_OK(dp_fsdp_wait_unshard(toy->fsdp[l]));
    get(toy->root, kWeights[l], 0, w[l], DIM * DIM);
    linear(h[l], w[l], h[l + 1], rows);
    CHECK_OK(dp_fsdp_reshard(toy->fsdp[l]));
  }
  CHECK_OK(dp_ddp_pre_forward(toy->ddp));
  get(toy->root, kWeights[3], 0, w[3], DIM * DIM);
  linear(h[3], w[3], h[4], rows);
  for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - all_t[g_rank * rows * DIM + k]) / rows;
  /* backward: proj through the dp_ddp, the linears through their dp_fsdp */
  for (int l = 3; l >= 0; --l) {
    double g[DIM * DIM] = {0};
    if (l < 3) {
      if (l == 2) CHECK_OK(dp_fsdp_unshard(toy->fsdp[2], 0));
      if (l > 0) CHECK_OK(dp_fsdp_unshard(toy->fsdp[l - 1], 1));
      CHECK_OK(dp_fsdp_wait_unshard(toy->fsdp[l]));
      get(toy->root, kWeights[l], 0, w[l], DIM * DIM);
    }
    backward(dy, h[l], w[l], g, dx, rows);
    add_grad(toy->root, kWeights[l], g);
    if (l == 3) {
      CHECK_OK(dp_ddp_mark_grad_ready(toy->ddp, kWeights[3]));
    } else {
      CHECK_OK(dp_fsdp_post_backward(toy->fsdp[l]));
    }
    memcpy(dy, dx, sizeof dy);
  }
  CHECK_OK(dp_fsdp_post_backward(toy->fsdp_linears));
  for (int l = 0; l < 3; ++l) CHECK_OK(dp_fsdp_finish_backward(toy->fsdp[l]));
  CHECK_OK(dp_fsdp_finish_backward(toy->fsdp_linears));
  CHECK_OK(dp_ddp_finish_backward(toy->ddp));
  /* SGD on the shards and on proj */
  for (int l = 0; l < 3; ++l) {
    dp_tensor *shard = NULL, *grad = NULL;
    float v[DIM * DIM], g[DIM * DIM];
    CHECK_OK(dp_fsdp_shard(toy->fsdp[l], 0, &shard));
    CHECK_OK(dp_fsdp_shard_grad(toy->fsdp[l], 0, &grad));
    if (shard == NULL || grad == NULL) return;
    size_t n = (size_t)dp_tensor_numel(shard);
    CHECK_OK(dp_tensor_copy_to_host(shard, v, n * sizeof(float)));
    CHECK_OK(dp_tensor_copy_to_host(grad, g, n * sizeof(float)));
    for (size_t k = 0; k < n; ++k) v[k] -= (float)LR * g[k];
    CHECK_OK(dp_tensor_copy_from_host(shard, v, n * sizeof(float)));
    dp_tensor_destroy(shard);
    dp_tensor_destroy(grad);
  }
  {
    float p[DIM * DIM], g[DIM * DIM];
    dp_tensor *t = NULL;
    get(toy->root, kWeights[3], 0, p, DIM * DIM);
    get(toy->root, kWeights[3], 1, g, DIM * DIM);
    for (int k = 0; k < DIM * DIM; ++k) p[k] -= (float)LR * g[k];
    CHECK_OK(dp_module_get_parameter(toy->root, kWeights[3], &t));
    CHECK_OK(dp_tensor_copy_from_host(t, p, sizeof p));
    dp_tensor_destroy(t);
  }
  CHECK_OK(dp_module_zero_grad(toy->root));
}

static void expect_weights(Toy *toy, float expected[4][DIM * DIM], const char *what) {
  for (int l = 0; l < 4; ++l) {
    float got[DIM * DIM];
    if (l < 3) CHECK_OK(dp_fsdp_unshard(toy->fsdp[l], 0));
    get(toy->root, kWeights[l], 0, got, DIM * DIM);
    for (int k = 0; k < DIM * DIM; ++k) {
      CHECK(fabsf(got[k] - expected[l][k]) <= 2e-5f * (1.0f + fabsf(expected[l][k])), "%s: %s[%d] is %g, expected %g",
            what, kWeights[l], k, got[k], expected[l][k]);
    }
    if (l < 3) CHECK_OK(dp_fsdp_reshard(toy->fsdp[l]));
  }
}

/* With views, the unsharded slot is the full parameter whose rows this
 * rank keeps are its shard itself; without, a copy. */
static void expect_full_parameter_is_view(Toy *toy, int views) {
  dp_tensor *shard = NULL, *full = NULL;
  CHECK_OK(dp_fsdp_shard(toy->fsdp[1], 0, &shard));
  CHECK_OK(dp_fsdp_unshard(toy->fsdp[1], 0));
  CHECK_OK(dp_module_get_parameter(toy->root, kWeights[1], &full));
  if (shard != NULL && full != NULL) {
    const int64_t chunk = (DIM + g_world - 1) / g_world;
    const int64_t start = chunk * g_rank < DIM ? chunk * g_rank : DIM;
    const char *rows = (const char *)dp_tensor_data(full) + start * DIM * (int64_t)sizeof(float);
    CHECK((rows == (const char *)dp_tensor_data(shard)) == (views != 0),
          "the full parameter's rows %lld.. are %s the shard (views %d)", (long long)start,
          rows == (const char *)dp_tensor_data(shard) ? "" : "not", views);
  }
  dp_tensor_destroy(full);
  dp_tensor_destroy(shard);
  CHECK_OK(dp_fsdp_reshard(toy->fsdp[1]));
}

static void toy(dp_process_group *pg) {
  float expected[4][DIM * DIM];
  Toy t, other;
  char path[512];
  reference(expected);
  toy_create(&t, 0.05f * (float)g_rank, pg); /* init_sync: rank 0's values */
  {
    int64_t rows = 0;
    dp_tensor *shard = NULL;
    CHECK_OK(dp_fsdp_shard(t.fsdp[0], 0, &shard));
    if (shard != NULL) {
      int64_t shape[2] = {0, 0};
      CHECK_OK(dp_tensor_shape(shard, shape, 2));
      rows = shape[0];
    }
    /* torch.chunk's split of the 3 rows */
    const int64_t chunk = (DIM + g_world - 1) / g_world;
    const int64_t start = chunk * g_rank < DIM ? chunk * g_rank : DIM;
    const int64_t count = start + chunk < DIM ? chunk : DIM - start;
    CHECK(rows == count, "rank %d keeps %lld rows, not %lld", g_rank, (long long)rows, (long long)count);
    dp_tensor_destroy(shard);
  }
  CHECK(dp_ddp_num_buckets(t.ddp) == 1, "the dp_ddp has %zu buckets", dp_ddp_num_buckets(t.ddp));
  /* Views need memory every rank maps: the shared-memory group. */
  expect_full_parameter_is_view(&t, g_views && strcmp(dp_process_group_backend(pg), "shm") == 0);
  for (int s = 0; s < STEPS; ++s) train_step(&t, s);
  expect_weights(&t, expected, "after training");
  /* The full state dict: rank 0 writes it, every rank loads its rows. */
  snprintf(path, sizeof path, "%s/full.safetensors", g_dir);
  CHECK_OK(dp_fsdp_save_full_state_dict(t.root, pg, path));
  CHECK_OK(dp_pg_barrier(pg));
  toy_create(&other, 1.0f + (float)g_rank, NULL);
  for (int l = 0; l < 3; ++l) {
    dp_fsdp_options o = DP_FSDP_OPTIONS_INIT;
    o.init_sync = 0;
    CHECK_OK(dp_fsdp_create(&other.fsdp[l], other.layer[l], pg, &o));
  }
  CHECK_OK(dp_fsdp_create(&other.fsdp_linears, other.linears, pg, NULL));
  CHECK_OK(dp_fsdp_load_full_state_dict(other.root, path, 1));
  expect_weights(&other, expected, "loaded");
  toy_destroy(&other);
  toy_destroy(&t);
}

static void peer_exits(dp_process_group *pg) {
  Toy t;
  toy_create(&t, 0.0f, pg);
  if (g_rank == g_world - 1) {
    /* Gone without a word: no destroy, no further collective. */
    fflush(stdout);
    _Exit(0);
  }
  dp_status st = dp_fsdp_unshard(t.fsdp[0], 0);
  CHECK(st == DP_ETIMEOUT || st == DP_EREMOTE, "unshard returned %d", (int)st);
  char missing[32];
  snprintf(missing, sizeof missing, "%d", g_world - 1);
  CHECK(strstr(dp_last_error(), missing) != NULL, "the error does not name rank %d: %s", g_world - 1, dp_last_error());
  printf("rank %d: unshard failed: %s\n", g_rank, dp_last_error());
  toy_destroy(&t);
}

/* Prints a failed call's message for the driver and checks it: DP_EINVAL
 * naming `a` and `b`. */
static void expect_einval(dp_status st, const char *what, const char *a, const char *b) {
  const char *message = dp_last_error();
  printf("rank %d: %s: status %d: %s\n", g_rank, what, (int)st, st == DP_OK ? "" : message);
  CHECK(st == DP_EINVAL, "%s returned %d, want DP_EINVAL", what, (int)st);
  if (st == DP_OK) return;
  CHECK(strstr(message, a) != NULL && strstr(message, b) != NULL, "%s: the error does not name '%s' and '%s': %s", what,
        a, b, message);
}

/* After a refused create the group still works: an all_reduce, then a
 * dp_fsdp made with good options on every rank, unsharded and resharded. */
static void expect_group_usable(dp_module *module, dp_process_group *pg) {
  int64_t one = 1;
  dp_tensor *t = NULL;
  CHECK_OK(dp_tensor_create(&t, DP_FLOAT32, 1, &one, g_device));
  float v = (float)(g_rank + 1);
  CHECK_OK(dp_tensor_copy_from_host(t, &v, sizeof v));
  CHECK_OK(dp_pg_all_reduce(pg, t, DP_SUM));
  CHECK_OK(dp_tensor_copy_to_host(t, &v, sizeof v));
  CHECK(v == (float)(g_world * (g_world + 1) / 2), "the all_reduce after the refusal gave %g", (double)v);
  dp_tensor_destroy(t);
  dp_fsdp *f = NULL;
  CHECK_OK(dp_fsdp_create(&f, module, pg, NULL));
  if (f == NULL) return;
  CHECK_OK(dp_fsdp_unshard(f, 0));
  CHECK_OK(dp_fsdp_reshard(f));
  dp_fsdp_destroy(f);
}

static void refuse_dtype(dp_process_group *pg) {
  Toy t;
  toy_create(&t, 0.0f, NULL);
  dp_fsdp_options o = DP_FSDP_OPTIONS_INIT;
  if (g_rank == 1) o.param_dtype = DP_INT32;
  dp_fsdp *f = NULL;
  expect_einval(dp_fsdp_create(&f, t.layer[0], pg, &o), "create with param_dtype DP_INT32 on rank 1", "rank 1 refused",
                "opts->param_dtype");
  CHECK(f == NULL, "%s", "a dp_fsdp came out of a failed create");
  expect_group_usable(t.layer[0], pg);
  toy_destroy(&t);
}

static void no_delete(void *ctx) { (void)ctx; }

static void refuse_overlap(dp_process_group *pg) {
  Toy t;
  toy_create(&t, 0.0f, NULL);
  /* "alias": on rank 1 the weight's second row, elsewhere memory of its own. */
  dp_module *m = NULL;
  CHECK_OK(dp_module_create(&m));
  dp_tensor *weight = NULL, *alias = NULL;
  CHECK_OK(dp_module_get_parameter(t.layer[0], "weight", &weight));
  CHECK_OK(dp_module_register_parameter(m, "weight", weight, 1));
  int64_t row = DIM;
  if (g_rank == 1) {
    CHECK_OK(dp_tensor_from_blob(&alias, (float *)dp_tensor_data(weight) + DIM, DP_FLOAT32, 1, &row, g_device,
                                 no_delete, NULL));
  } else {
    CHECK_OK(dp_tensor_create(&alias, DP_FLOAT32, 1, &row, g_device));
  }
  CHECK_OK(dp_module_register_parameter(m, "alias", alias, 1));
  dp_tensor_destroy(alias);
  dp_tensor_destroy(weight);
  dp_fsdp *f = NULL;
  expect_einval(dp_fsdp_create(&f, m, pg, NULL), "create over overlapping parameters on rank 1", "rank 1 refused",
                "'weight'");
  CHECK(strstr(dp_last_error(), "'alias'") != NULL && strstr(dp_last_error(), "overlap") != NULL,
        "the error does not name 'alias' and the overlap: %s", dp_last_error());
  CHECK(f == NULL, "%s", "a dp_fsdp came out of a failed create");
  expect_group_usable(t.layer[1], pg);
  dp_module_destroy(m);
  toy_destroy(&t);
}

/* Adds `delta` to every weight: the shards of the linears and proj whole. */
static void add_to_weights(Toy *toy, float delta) {
  for (int l = 0; l < 4; ++l) {
    dp_tensor *t = NULL;
    float v[DIM * DIM];
    if (l < 3) {
      CHECK_OK(dp_fsdp_shard(toy->fsdp[l], 0, &t));
    } else {
      CHECK_OK(dp_module_get_parameter(toy->root, kWeights[3], &t));
    }
    if (t == NULL) continue;
    size_t n = (size_t)dp_tensor_numel(t);
    CHECK_OK(dp_tensor_copy_to_host(t, v, n * sizeof(float)));
    for (size_t k = 0; k < n; ++k) v[k] += delta;
    CHECK_OK(dp_tensor_copy_from_host(t, v, n * sizeof(float)));
    dp_tensor_destroy(t);
  }
}

/* The entries of `folder` whose names do not start with a dot. */
static int count_files(const char *folder) {
  int n = 0;
  DIR *dir = opendir(folder);
  if (dir == NULL) return -1;
  for (struct dirent *d; (d = readdir(dir)) != NULL;) n += d->d_name[0] != '.';
  closedir(dir);
  return n;
}

static void exit_quietly(int sig) {
  (void)sig;
  _exit(0);
}

/* Rank 0 alone, in a group of its own (another world size than the
 * save's), loads `folder` and finds `expected`. */
static void load_alone(const char *folder, float expected[4][DIM * DIM], const char *what) {
  char store_path[600];
  dp_store *store = NULL;
  dp_process_group *alone = NULL;
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  snprintf(store_path, sizeof store_path, "%s/alone-%s.store", g_dir, strrchr(folder, '/') + 1);
  CHECK_OK(dp_store_create_file(&store, store_path, 1));
  o.rank = 0;
  o.world_size = 1;
  o.store = store;
  o.backend = DP_BACKEND_GLOO;
  CHECK_OK(dp_process_group_create(&alone, &o));
  dp_store_destroy(store);
  if (alone == NULL) return;
  Toy again;
  toy_create(&again, 2.0f, alone);
  CHECK_OK(dp_fsdp_load_sharded_state_dict(again.root, folder));
  expect_weights(&again, expected, what);
  toy_destroy(&again);
  dp_process_group_destroy(alone);
}

static void save_fails_or_dies(dp_process_group *pg, int dies) {
  float expected[4][DIM * DIM];
  struct rlimit limit, saved;
  char folder[512];
  Toy t;
  for (int l = 0; l < 4; ++l) {
    for (int k = 0; k < DIM * DIM; ++k) expected[l][k] = initial(l, k, 0.0f);
  }
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  toy_create(&t, 0.05f * (float)g_rank, pg); /* init_sync: rank 0's values */
  CHECK_OK(dp_fsdp_save_sharded_state_dict(t.root, pg, folder));
  add_to_weights(&t, 1.0f);
  getrlimit(RLIMIT_FSIZE, &saved);
  if (g_rank == 1) {
    /* Smaller than any file of the save: its first write fails. */
    limit = saved;
    limit.rlim_cur = 64;
    signal(SIGXFSZ, dies ? exit_quietly : SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit");
  }
  dp_status st = dp_fsdp_save_sharded_state_dict(t.root, pg, folder);
  CHECK(st != DP_OK, "the second save returned DP_OK");
  if (g_rank == 0) {
    CHECK(strstr(dp_last_error(), dies ? "rank(s) 1 did not arrive" : "failed on rank 1") != NULL,
          "the error does not name rank 1: %s", dp_last_error());
  }
  printf("rank %d: the second save failed: %s\n", g_rank, dp_last_error());
  if (g_rank == 1) setrlimit(RLIMIT_FSIZE, &saved);
  if (!dies) {
    CHECK_OK(dp_pg_barrier(pg));
    CHECK(count_files(folder) == 3, "the folder holds %d files, not the first save's 3", count_files(folder));
    CHECK_OK(dp_fsdp_load_sharded_state_dict(t.root, folder));
    expect_weights(&t, expected, "the first save, loaded after the second failed");
    toy_destroy(&t);
    return;
  }
  /* Rank 1 is gone, and the group with it: rank 0 alone loads the first save. */
  toy_destroy(&t);
  load_alone(folder, expected, "the first save, loaded after rank 1 died in the second");
}

static void save_fails(dp_process_group *pg) { save_fails_or_dies(pg, 0); }
static void save_killed(dp_process_group *pg) { save_fails_or_dies(pg, 1); }

static void initial_weights(float w[4][DIM * DIM], float plus) {
  for (int l = 0; l < 4; ++l) {
    for (int k = 0; k < DIM * DIM; ++k) w[l][k] = initial(l, k, 0.0f) + plus;
  }
}

/* A fresh toy on `pg` (other values than the saves') loads `folder`. */
static void expect_loads(dp_process_group *pg, const char *folder, float expected[4][DIM * DIM], const char *what) {
  Toy fresh;
  toy_create(&fresh, 5.0f, pg);
  CHECK_OK(dp_fsdp_load_sharded_state_dict(fresh.root, folder));
  expect_weights(&fresh, expected, what);
  toy_destroy(&fresh);
}

/* Waits for a background save that must succeed. */
static void wait_ok(dp_work *work, const char *what) {
  if (work == NULL) return;
  dp_status st = dp_work_wait(work);
  CHECK(st == DP_OK, "%s: %s", what, dp_last_error());
  dp_work_destroy(work);
}

static void async_save(dp_process_group *pg) {
  float at_first[4][DIM * DIM], at_third[4][DIM * DIM], at_last[4][DIM * DIM];
  char folder[512], other[512];
  dp_work *first = NULL, *second = NULL, *third = NULL;
  Toy t;
  initial_weights(at_first, 0.0f);
  initial_weights(at_third, 2.0f);
  initial_weights(at_last, 3.0f);
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  snprintf(other, sizeof other, "%s/other", g_dir);
  toy_create(&t, 0.05f * (float)g_rank, pg); /* init_sync: rank 0's values */
  /* The optimizer's step right after each call does not reach its save. */
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &first));
  add_to_weights(&t, 1.0f);
  /* Two more while it may be in flight: they queue behind it, the third replacing the second. */
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, other, &second));
  add_to_weights(&t, 1.0f);
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, other, &third));
  add_to_weights(&t, 1.0f);
  wait_ok(first, "the first background save");
  wait_ok(second, "the second background save");
  wait_ok(third, "the third background save");
  CHECK(count_files(other) == g_world + 1, "the folder holds %d files, not the last save's %d", count_files(other),
        g_world + 1);
  expect_loads(pg, folder, at_first, "the first save");
  expect_loads(pg, other, at_third, "the third save, which replaced the second");
  /* A save outlives its module and dp_fsdp. */
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &first));
  toy_destroy(&t);
  wait_ok(first, "the save whose module was destroyed");
  expect_loads(pg, folder, at_last, "the save whose module was destroyed");
  CHECK_OK(dp_pg_barrier(pg));
  if (g_rank == 0) load_alone(folder, at_last, "a background save loaded at another world size");
}

/* Rank 1 cannot write (a file-size limit, SIGXFSZ ignored): every rank's
 * work fails naming it, with no manifest. */
static void async_save_fails(dp_process_group *pg) {
  float first_values[4][DIM * DIM];
  struct rlimit limit, saved;
  char folder[512], fresh[512], manifest[600];
  dp_work *work = NULL;
  Toy t;
  initial_weights(first_values, 0.0f);
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  snprintf(fresh, sizeof fresh, "%s/fresh", g_dir);
  toy_create(&t, 0.05f * (float)g_rank, pg);
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &work));
  wait_ok(work, "the first background save");
  add_to_weights(&t, 1.0f);
  getrlimit(RLIMIT_FSIZE, &saved);
  if (g_rank == 1) {
    limit = saved;
    limit.rlim_cur = 64;
    signal(SIGXFSZ, SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit");
  }
  const char *folders[2] = {folder, fresh};
  for (int i = 0; i < 2; ++i) {
    work = NULL;
    CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folders[i], &work));
    if (work == NULL) continue;
    CHECK(dp_work_wait(work) != DP_OK, "a save rank 1 could not write succeeded");
    CHECK(strstr(dp_last_error(), "failed on rank 1") != NULL, "the error does not name rank 1: %s", dp_last_error());
    printf("rank %d: the failed background save: %s\n", g_rank, dp_last_error());
    dp_work_destroy(work);
  }
  if (g_rank == 1) setrlimit(RLIMIT_FSIZE, &saved);
  CHECK_OK(dp_pg_barrier(pg));
  snprintf(manifest, sizeof manifest, "%s/manifest.json", fresh);
  CHECK(access(manifest, F_OK) != 0, "the failed save left a manifest");
  CHECK(dp_fsdp_load_sharded_state_dict(t.root, fresh) == DP_EINVAL, "a folder without a manifest loaded");
  CHECK(count_files(folder) == 3, "the folder holds %d files, not the first save's 3", count_files(folder));
  CHECK_OK(dp_fsdp_load_sharded_state_dict(t.root, folder));
  expect_weights(&t, first_values, "the first save, loaded after a background save failed");
  toy_destroy(&t);
}

/* Rank 1 dies writing its file (as SIGXFSZ's default would kill it, with
 * exit code 0 so that dp-run lets rank 0 go on). */
static void async_save_killed(dp_process_group *pg) {
  float first_values[4][DIM * DIM];
  struct rlimit limit;
  char folder[512];
  dp_work *work = NULL;
  Toy t;
  initial_weights(first_values, 0.0f);
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  toy_create(&t, 0.05f * (float)g_rank, pg);
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &work));
  wait_ok(work, "the first background save");
  add_to_weights(&t, 1.0f);
  if (g_rank == 1) {
    getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = 64;
    signal(SIGXFSZ, exit_quietly);
    CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0, "setrlimit");
  }
  work = NULL;
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &work));
  if (g_rank == 1) {
    dp_work_wait(work); /* not reached: the write kills the process */
    CHECK(0, "rank 1 outlived its write: %s", dp_last_error());
    return;
  }
  CHECK(work != NULL && dp_work_wait(work) != DP_OK, "the save rank 1 died in succeeded");
  CHECK(strstr(dp_last_error(), "rank(s) 1 did not report") != NULL, "the error does not name rank 1: %s",
        dp_last_error());
  printf("rank %d: the background save rank 1 died in: %s\n", g_rank, dp_last_error());
  dp_work_destroy(work);
  toy_destroy(&t);
  load_alone(folder, first_values, "the first save, loaded after rank 1 died in a background save");
}

static void async_save_outlives(dp_process_group *pg) {
  float values[4][DIM * DIM];
  char folder[512];
  dp_process_group *sub = NULL;
  dp_work *work = NULL;
  Toy t;
  initial_weights(values, 0.0f);
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  CHECK_OK(dp_process_group_split(pg, 0, g_rank, NULL, &sub));
  if (sub == NULL) return;
  toy_create(&t, 0.05f * (float)g_rank, sub);
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, sub, folder, &work));
  toy_destroy(&t);
  dp_process_group_destroy(sub);
  wait_ok(work, "the save whose module and group were destroyed");
  expect_loads(pg, folder, values, "the save whose module and group were destroyed");
  /* Left in flight: the process exits with it (main destroys the group, returns). */
  toy_create(&t, 0.0f, pg);
  work = NULL;
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &work));
  toy_destroy(&t);
  dp_work_destroy(work);
}

/* One rank's bad argument is its own DP_EINVAL and the others' failed work. */
static void expect_refused_on(int refusing, dp_status st, dp_work *work, const char *argument) {
  char named[64];
  snprintf(named, sizeof named, "argument '%s'", argument);
  if (g_rank == refusing) {
    CHECK(st == DP_EINVAL && work == NULL, "a NULL %s gave %d", argument, (int)st);
    CHECK(strstr(dp_last_error(), named) != NULL, "the error does not name %s: %s", argument, dp_last_error());
    return;
  }
  CHECK(st == DP_OK && work != NULL, "a good call was refused: %s", dp_last_error());
  if (work == NULL) return;
  CHECK(dp_work_wait(work) == DP_EINVAL, "the save with a refusal on rank %d did not fail", refusing);
  char rank_named[64];
  snprintf(rank_named, sizeof rank_named, "failed on rank %d", refusing);
  CHECK(strstr(dp_last_error(), rank_named) != NULL && strstr(dp_last_error(), named) != NULL,
        "the error does not name rank %d and %s: %s", refusing, argument, dp_last_error());
  dp_work_destroy(work);
}

static void async_refuse(dp_process_group *pg) {
  char folder[512];
  dp_work *work = NULL;
  Toy t;
  snprintf(folder, sizeof folder, "%s/checkpoint", g_dir);
  toy_create(&t, 0.0f, pg);
  /* A missing group is this rank's error alone (nothing to tell the others through). */
  CHECK(dp_fsdp_save_sharded_state_dict_async(t.root, NULL, folder, &work) == DP_EINVAL && work == NULL,
        "a NULL pg was not refused");
  CHECK(strstr(dp_last_error(), "'pg'") != NULL, "the error does not name pg: %s", dp_last_error());
  dp_status st = dp_fsdp_save_sharded_state_dict_async(t.root, pg, g_rank == 1 ? NULL : folder, &work);
  expect_refused_on(1, st, work, "folder");
  work = NULL;
  st = dp_fsdp_save_sharded_state_dict_async(g_rank == 0 ? NULL : t.root, pg, folder, &work);
  expect_refused_on(0, st, work, "module");
  work = NULL;
  st = dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, g_rank == 1 ? NULL : &work);
  expect_refused_on(1, st, work, "out");
  /* The refusals kept the ranks' saves in step: the next one succeeds. */
  work = NULL;
  CHECK_OK(dp_fsdp_save_sharded_state_dict_async(t.root, pg, folder, &work));
  wait_ok(work, "the save after the refusals");
  float values[4][DIM * DIM];
  initial_weights(values, 0.0f);
  expect_loads(pg, folder, values, "the save after the refusals");
  toy_destroy(&t);
}

typedef struct Scenario {
  const char *name;
  void (*run)(dp_process_group *pg);
  int32_t backend;
  int timeout_ms;
  int views; /* full_params_as_views for the linears */
} Scenario;

static const Scenario kScenarios[] = {
    {"toy", toy, DP_BACKEND_AUTO, 60000, 0},
    {"toy_views", toy, DP_BACKEND_AUTO, 60000, 1},
    {"peer_exits", peer_exits, DP_BACKEND_GLOO, 3000, 0},
    {"peer_exits_views", peer_exits, DP_BACKEND_SHM, 3000, 1},
    /* Longer than the test's limit: a rank left waiting is killed. */
    {"refuse_dtype", refuse_dtype, DP_BACKEND_AUTO, 120000, 0},
    {"refuse_overlap", refuse_overlap, DP_BACKEND_AUTO, 120000, 0},
    {"save_fails", save_fails, DP_BACKEND_AUTO, 60000, 0},
    {"save_killed", save_killed, DP_BACKEND_GLOO, 10000, 0},
    {"async_save", async_save, DP_BACKEND_AUTO, 60000, 0},
    {"async_save_fails", async_save_fails, DP_BACKEND_AUTO, 60000, 0},
    {"async_save_killed", async_save_killed, DP_BACKEND_GLOO, 10000, 0},
    {"async_refuse", async_refuse, DP_BACKEND_AUTO, 60000, 0},
    {"async_save_outlives", async_save_outlives, DP_BACKEND_AUTO, 60000, 0},
};

int main(int argc, char **argv) {
  const Scenario *scenario = NULL;
  const char *rank_text = getenv("RANK"), *world_text = getenv("WORLD_SIZE"), *dir = getenv("DP_TEST_DIR");
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  dp_process_group *pg = NULL;
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (size_t i = 0; argc >= 2 && i < sizeof(kScenarios) / sizeof(kScenarios[0]); ++i) {
    if (strcmp(argv[1], kScenarios[i].name) == 0) scenario = &kScenarios[i];
  }
  if (scenario == NULL) {
    fprintf(stderr,
            "usage: fsdp_worker toy|toy_views|peer_exits|peer_exits_views|save_fails|save_killed|refuse_dtype|"
            "refuse_overlap|async_save|async_save_fails|async_save_killed|async_refuse|async_save_outlives "
            "(under dp-run); "
            "unknown '%s'\n",
            argc >= 2 ? argv[1] : "");
    return 2;
  }
  g_rank = rank_text != NULL ? atoi(rank_text) : -1;
  g_world = world_text != NULL ? atoi(world_text) : 0;
  if (dir != NULL) g_dir = dir;
  if (g_world < 1 || ROWS_PER_RANK * g_world > MAX_ROWS) {
    fprintf(stderr, "rank %d: WORLD_SIZE must be 1..%d\n", g_rank, MAX_ROWS / ROWS_PER_RANK);
    return 2;
  }
  opts.backend = scenario->run == toy ? test_group_backend(scenario->backend) : scenario->backend;
  if (opts.backend == DP_BACKEND_NCCL) {
    const char *local_text = getenv("LOCAL_RANK");
    int32_t gpus = 0;
    if (dp_device_count(DP_DEVICE_CUDA, &gpus) != DP_OK) gpus = 0;
    if (gpus < g_world) {
      printf("rank %d: needs %d GPU(s), found %d\n", g_rank, g_world, (int)gpus);
      return 77;
    }
    g_device = (dp_device){DP_DEVICE_CUDA, local_text != NULL ? atoi(local_text) : g_rank};
  }
  opts.timeout_ms = scenario->timeout_ms;
  opts.device = g_device;
  g_views = scenario->views;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) {
    fprintf(stderr, "rank %d: group create failed: %s\n", g_rank, dp_last_error());
    return 3;
  }
  if (scenario->run == toy) check_test_group_backend(pg);
  scenario->run(pg);
  dp_process_group_destroy(pg);
  if (g_failures == 0) printf("rank %d: %s passed\n", g_rank, scenario->name);
  return g_failures == 0 ? 0 : 1;
}
