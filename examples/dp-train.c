/* dp-train: data-parallel training of an MLP through dparallel's C ABI.
 *
 * The program plays the host framework: it owns the model's math (Linear and
 * ReLU layers, MSE loss, forward and backward with OpenBLAS, SGD) and hands
 * dparallel the rest: the module tree, replicas kept across steps, scatter of
 * each batch, the per-replica forward/backward on the device workers, and the
 * reduction of the replicas' gradients. At the end it trains the same model
 * on one device with the full batch and checks that both reach the same
 * parameters.
 *
 *   dp-train --devices cpu:0,cpu:1 --steps 30 --batch 1024 --width 512 --layers 4
 */
#define _POSIX_C_SOURCE 200809L

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dparallel/dparallel.h"

#define MAX_DEVICES 64
#define MAX_LAYERS 64
#define RTOL 1.3e-6
#define ATOL 5e-5

typedef struct options {
  dp_device devices[MAX_DEVICES];
  size_t ndevices;
  int steps;
  int64_t batch;
  int64_t width;
  int layers;
  float lr;
  int check;
  long max_rss_growth_kib; /* < 0: not checked */
  const char *save_path;
} options;

/* Scratch memory kept across steps, one per replica (and one for the
 * reference run), so that steps do not allocate. */
typedef struct workspace {
  float *data;
  size_t capacity;
  float *host_params; /* staging for replicas on GPUs */
  size_t host_capacity;
  double start, end; /* this step's forward+backward, seconds */
} workspace;

typedef struct model_math {
  int layers;
  int64_t width;
  int64_t full_batch;
} model_math;

typedef struct train_context {
  model_math math;
  workspace replicas[MAX_DEVICES];
  const char *weight_names[MAX_LAYERS];
  const char *bias_names[MAX_LAYERS];
  int failed_line; /* first failure inside a callback, for the message */
} train_context;

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long rss_kib(void) {
  long pages = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f == NULL) return -1;
  if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
  fclose(f);
  return resident < 0 ? -1 : resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static void die(const char *what) {
  fprintf(stderr, "dp-train: %s: %s\n", what, dp_last_error());
  exit(1);
}

#define CHECK(call)                  \
  do {                               \
    if ((call) != DP_OK) die(#call); \
  } while (0)

static int ensure(float **data, size_t *capacity, size_t count) {
  if (*capacity >= count) return 1;
  free(*data);
  *data = malloc(count * sizeof(float));
  *capacity = *data == NULL ? 0 : count;
  return *data != NULL;
}

/* ---- deterministic random numbers (splitmix64) ---- */
static uint64_t next_random(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double uniform01(uint64_t *state) { return (double)(next_random(state) >> 11) * (1.0 / 9007199254740992.0); }
static float uniform(uint64_t *state, float bound) { return (float)((2.0 * uniform01(state) - 1.0) * bound); }
static float normal(uint64_t *state) {
  double u = uniform01(state), v = uniform01(state);
  return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

/* ---- the model's math, on host memory ---- */

/* Forward and backward over n rows of x (row pitch ld) with targets y (pitch
 * ld): writes every layer's weight and bias gradient of the loss over
 * full_batch rows (MSE, mean over rows and outputs) that these rows
 * contribute, and returns their part of the loss. */
static double forward_backward(const model_math *m, float *const *w, float *const *b, float *const *gw,
                               float *const *gb, const float *x, const float *y, int64_t ld, int64_t n, workspace *ws) {
  const int64_t W = m->width;
  const int L = m->layers;
  if (!ensure(&ws->data, &ws->capacity, (size_t)(L + 2) * (size_t)(n * W))) return NAN;
  float *act = ws->data; /* act + l*n*W: output of layer l */
  float *dz = act + (size_t)L * (size_t)(n * W);
  float *da = dz + n * W;
  for (int l = 0; l < L; ++l) {
    const float *in = l == 0 ? x : act + (size_t)(l - 1) * (size_t)(n * W);
    float *out = act + (size_t)l * (size_t)(n * W);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)W, (int)W, 1.0f, in, (int)(l == 0 ? ld : W), w[l],
                (int)W, 0.0f, out, (int)W);
    for (int64_t r = 0; r < n; ++r) {
      float *row = out + r * W;
      for (int64_t j = 0; j < W; ++j) {
        float v = row[j] + b[l][j];
        row[j] = (l < L - 1 && v < 0.0f) ? 0.0f : v;
      }
    }
  }
  double loss = 0.0;
  const float *pred = act + (size_t)(L - 1) * (size_t)(n * W);
  const float scale = 2.0f / (float)(m->full_batch * W);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < W; ++j) {
      float diff = pred[r * W + j] - y[r * ld + j];
      loss += (double)diff * diff;
      dz[r * W + j] = diff * scale;
    }
  }
  for (int l = L - 1; l >= 0; --l) {
    const float *in = l == 0 ? x : act + (size_t)(l - 1) * (size_t)(n * W);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)W, (int)W, (int)n, 1.0f, dz, (int)W, in,
                (int)(l == 0 ? ld : W), 0.0f, gw[l], (int)W);
    for (int64_t j = 0; j < W; ++j) gb[l][j] = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < W; ++j) gb[l][j] += dz[r * W + j];
    }
    if (l == 0) break;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)W, (int)W, 1.0f, dz, (int)W, w[l], (int)W, 0.0f,
                da, (int)W);
    for (int64_t i = 0; i < n * W; ++i) {
      if (in[i] <= 0.0f) da[i] = 0.0f; /* ReLU: `in` is the previous layer's output */
    }
    float *t = dz;
    dz = da;
    da = t;
  }
  return loss / (double)(m->full_batch * W);
}

static void sgd(float *w, const float *g, int64_t count, float lr) {
  for (int64_t i = 0; i < count; ++i) w[i] -= lr * g[i];
}

/* ---- host access to a tensor on any device ---- */

/* A host pointer to the tensor's contents: its memory on CPU devices, else a
 * copy in `staging`. */
static float *host_floats(const dp_tensor *t, float *staging) {
  if (dp_tensor_device(t).type == DP_DEVICE_CPU) return dp_tensor_data(t);
  if (dp_tensor_copy_to_host(t, staging, dp_tensor_nbytes(t)) != DP_OK) return NULL;
  return staging;
}

/* Writes staged contents back (no-op when `host` is the tensor's memory). */
static int put_back(dp_tensor *t, const float *host) {
  if (host == dp_tensor_data(t)) return 1;
  return dp_tensor_copy_from_host(t, host, dp_tensor_nbytes(t)) == DP_OK;
}

/* ---- the replica callback ---- */

static int replica_step(void *user_data, size_t index, dp_module *replica, dp_tensor *input, dp_device device,
                        dp_tensor **output) {
  train_context *ctx = user_data;
  workspace *ws = &ctx->replicas[index];
  const int L = ctx->math.layers;
  const int64_t W = ctx->math.width;
  dp_tensor *handles[4 * MAX_LAYERS] = {0};
  float *w[MAX_LAYERS] = {0}, *b[MAX_LAYERS] = {0}, *gw[MAX_LAYERS] = {0}, *gb[MAX_LAYERS] = {0};
  int64_t shape[2];
  int ok = 1;
  ws->start = now_seconds();
  if (dp_tensor_shape(input, shape, 2) != DP_OK) return 1;
  size_t per_layer = (size_t)(W * W + W) * 2;
  size_t staging = device.type == DP_DEVICE_CPU ? 0 : (size_t)L * per_layer + (size_t)(shape[0] * shape[1]);
  if (staging > 0 && !ensure(&ws->host_params, &ws->host_capacity, staging)) return 2;
  for (int l = 0; ok && l < L; ++l) {
    float *slot = staging > 0 ? ws->host_params + (size_t)l * per_layer : NULL;
    dp_tensor **h = handles + 4 * l;
    ok = dp_module_get_parameter(replica, ctx->weight_names[l], &h[0]) == DP_OK &&
         dp_module_get_parameter(replica, ctx->bias_names[l], &h[1]) == DP_OK &&
         dp_module_grad(replica, ctx->weight_names[l], &h[2]) == DP_OK &&
         dp_module_grad(replica, ctx->bias_names[l], &h[3]) == DP_OK;
    if (!ok) break;
    w[l] = host_floats(h[0], slot);
    b[l] = host_floats(h[1], staging > 0 ? slot + W * W : NULL);
    gw[l] = staging > 0 ? slot + W * W + W : dp_tensor_data(h[2]);
    gb[l] = staging > 0 ? slot + 2 * W * W + W : dp_tensor_data(h[3]);
    ok = w[l] != NULL && b[l] != NULL;
  }
  float *rows = ok ? host_floats(input, staging > 0 ? ws->host_params + (size_t)L * per_layer : NULL) : NULL;
  double loss = NAN;
  if (ok && rows != NULL) {
    loss = forward_backward(&ctx->math, w, b, gw, gb, rows, rows + W, shape[1], shape[0], ws);
  }
  for (int l = 0; ok && l < L; ++l) ok = put_back(handles[4 * l + 2], gw[l]) && put_back(handles[4 * l + 3], gb[l]);
  for (int i = 0; i < 4 * L; ++i) dp_tensor_destroy(handles[i]);
  if (!ok || rows == NULL || isnan(loss)) return 3;
  int64_t one = 1;
  float value = (float)loss;
  if (dp_tensor_create(output, DP_FLOAT32, 1, &one, device) != DP_OK) return 4;
  if (dp_tensor_copy_from_host(*output, &value, sizeof value) != DP_OK) return 5;
  ws->end = now_seconds();
  return 0;
}

/* ---- setup ---- */

static void usage(void) {
  fprintf(stderr,
          "usage: dp-train [--devices cpu:0,cpu:1] [--steps 30] [--batch 1024] [--width 512] [--layers 4]\n"
          "                [--lr 1] [--no-check] [--max-rss-growth-kib N] [--save model.safetensors]\n");
  exit(2);
}

static void parse_devices(const char *text, options *o) {
  char buf[1024];
  if (strlen(text) >= sizeof buf) usage();
  strcpy(buf, text);
  o->ndevices = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
    if (o->ndevices == MAX_DEVICES) usage();
    if (dp_device_parse(tok, &o->devices[o->ndevices++]) != DP_OK) die("--devices");
  }
  if (o->ndevices == 0) usage();
}

static options parse_options(int argc, char **argv) {
  options o;
  memset(&o, 0, sizeof o);
  parse_devices("cpu:0,cpu:1", &o);
  o.steps = 30;
  o.batch = 1024;
  o.width = 512;
  o.layers = 4;
  o.lr = 1.0f;
  o.check = 1;
  o.max_rss_growth_kib = -1;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--no-check") == 0) {
      o.check = 0;
      continue;
    }
    if (v == NULL) usage();
    ++i;
    if (strcmp(a, "--devices") == 0)
      parse_devices(v, &o);
    else if (strcmp(a, "--steps") == 0)
      o.steps = atoi(v);
    else if (strcmp(a, "--batch") == 0)
      o.batch = atoll(v);
    else if (strcmp(a, "--width") == 0)
      o.width = atoll(v);
    else if (strcmp(a, "--layers") == 0)
      o.layers = atoi(v);
    else if (strcmp(a, "--lr") == 0)
      o.lr = (float)atof(v);
    else if (strcmp(a, "--max-rss-growth-kib") == 0)
      o.max_rss_growth_kib = atol(v);
    else if (strcmp(a, "--save") == 0)
      o.save_path = v;
    else
      usage();
  }
  if (o.steps < 1 || o.batch < 1 || o.width < 1 || o.layers < 1 || o.layers > MAX_LAYERS) usage();
  return o;
}

/* Initial parameters, as torch.nn.Linear's default (uniform in +-1/sqrt(fan_in)). */
static void initial_parameters(const options *o, float **w, float **b) {
  uint64_t rng = 42;
  const float bound = 1.0f / sqrtf((float)o->width);
  for (int l = 0; l < o->layers; ++l) {
    for (int64_t i = 0; i < o->width * o->width; ++i) w[l][i] = uniform(&rng, bound);
    for (int64_t i = 0; i < o->width; ++i) b[l][i] = uniform(&rng, bound);
  }
}

/* Synthetic regression data: a pool of rows [x | tanh(x T)] with a fixed
 * random teacher T; each step draws a shuffled batch from it. */
typedef struct dataset {
  int64_t rows, width;
  float *pool; /* rows x 2*width */
} dataset;

static dataset make_dataset(const options *o) {
  dataset d = {4 * o->batch, o->width, NULL};
  const int64_t W = o->width;
  float *teacher = malloc((size_t)(W * W) * sizeof(float));
  float *x = malloc((size_t)(d.rows * W) * sizeof(float));
  float *y = malloc((size_t)(d.rows * W) * sizeof(float));
  d.pool = malloc((size_t)(d.rows * 2 * W) * sizeof(float));
  if (teacher == NULL || x == NULL || y == NULL || d.pool == NULL) {
    fprintf(stderr, "dp-train: out of memory for the data set\n");
    exit(1);
  }
  uint64_t rng = 7;
  for (int64_t i = 0; i < W * W; ++i) teacher[i] = normal(&rng) / sqrtf((float)W);
  for (int64_t i = 0; i < d.rows * W; ++i) x[i] = normal(&rng);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)d.rows, (int)W, (int)W, 1.0f, x, (int)W, teacher, (int)W,
              0.0f, y, (int)W);
  for (int64_t r = 0; r < d.rows; ++r) {
    memcpy(d.pool + r * 2 * W, x + r * W, (size_t)W * sizeof(float));
    for (int64_t j = 0; j < W; ++j) d.pool[r * 2 * W + W + j] = tanhf(y[r * W + j]);
  }
  free(teacher);
  free(x);
  free(y);
  return d;
}

/* The batch of step `step`: a shuffled draw from the pool (the same for both runs). */
static void fill_batch(const dataset *d, int step, int64_t batch, float *out, int64_t *order) {
  uint64_t rng = 1000 + (uint64_t)step;
  for (int64_t i = 0; i < d->rows; ++i) order[i] = i;
  for (int64_t i = 0; i < batch; ++i) {
    int64_t j = i + (int64_t)(next_random(&rng) % (uint64_t)(d->rows - i));
    int64_t t = order[i];
    order[i] = order[j];
    order[j] = t;
    memcpy(out + i * 2 * d->width, d->pool + order[i] * 2 * d->width, (size_t)(2 * d->width) * sizeof(float));
  }
}

/* The module as torch.nn.Sequential(Linear, ReLU, ..., Linear) names it:
 * "0.weight", "0.bias", "2.weight", ... on devices[0]. */
static dp_module *build_module(const options *o, train_context *ctx, float **w, float **b) {
  dp_module *root = NULL;
  CHECK(dp_module_create(&root));
  static char names[MAX_LAYERS][2][32];
  for (int l = 0; l < o->layers; ++l) {
    dp_module *linear = NULL;
    dp_tensor *weight = NULL, *bias = NULL;
    int64_t wshape[2] = {o->width, o->width};
    char child[16];
    CHECK(dp_module_create(&linear));
    CHECK(dp_tensor_create(&weight, DP_FLOAT32, 2, wshape, o->devices[0]));
    CHECK(dp_tensor_create(&bias, DP_FLOAT32, 1, &o->width, o->devices[0]));
    CHECK(dp_tensor_copy_from_host(weight, w[l], dp_tensor_nbytes(weight)));
    CHECK(dp_tensor_copy_from_host(bias, b[l], dp_tensor_nbytes(bias)));
    CHECK(dp_module_register_parameter(linear, "weight", weight, 1));
    CHECK(dp_module_register_parameter(linear, "bias", bias, 1));
    snprintf(child, sizeof child, "%d", 2 * l);
    CHECK(dp_module_register_module(root, child, linear));
    if (l < o->layers - 1) {
      dp_module *relu = NULL;
      snprintf(child, sizeof child, "%d", 2 * l + 1);
      CHECK(dp_module_create(&relu));
      CHECK(dp_module_register_module(root, child, relu));
      dp_module_destroy(relu);
    }
    dp_tensor_destroy(weight);
    dp_tensor_destroy(bias);
    dp_module_destroy(linear);
    snprintf(names[l][0], sizeof names[l][0], "%d.weight", 2 * l);
    snprintf(names[l][1], sizeof names[l][1], "%d.bias", 2 * l);
    ctx->weight_names[l] = names[l][0];
    ctx->bias_names[l] = names[l][1];
  }
  return root;
}

/* SGD on the module's parameters, wherever they live. */
static void module_sgd(dp_module *module, float lr, float *staging) {
  size_t n = dp_module_num_parameters(module);
  for (size_t i = 0; i < n; ++i) {
    const char *name = NULL;
    dp_tensor *param = NULL, *grad = NULL;
    CHECK(dp_module_parameter_at(module, i, &name, &param));
    CHECK(dp_module_grad(module, name, &grad));
    int64_t count = dp_tensor_numel(param);
    float *p = host_floats(param, staging);
    float *g = host_floats(grad, staging + count);
    if (p == NULL || g == NULL) die("reading parameters");
    sgd(p, g, count, lr);
    if (!put_back(param, p)) die("writing parameters");
    dp_tensor_destroy(param);
    dp_tensor_destroy(grad);
  }
}

static int cpu_count(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : (int)n;
}

int main(int argc, char **argv) {
  options o = parse_options(argc, argv);
  const int L = o.layers;
  const int64_t W = o.width;
  /* Replicas already run side by side: give each an equal share of the cores. */
  int blas_threads = cpu_count() / (int)o.ndevices;
  openblas_set_num_threads(blas_threads < 1 ? 1 : blas_threads);

  static train_context ctx;
  ctx.math.layers = L;
  ctx.math.width = W;
  ctx.math.full_batch = o.batch;
  float *w[MAX_LAYERS], *b[MAX_LAYERS], *gw[MAX_LAYERS], *gb[MAX_LAYERS];
  for (int l = 0; l < L; ++l) {
    w[l] = malloc((size_t)(W * W) * sizeof(float));
    gw[l] = malloc((size_t)(W * W) * sizeof(float));
    b[l] = malloc((size_t)W * sizeof(float));
    gb[l] = malloc((size_t)W * sizeof(float));
    if (w[l] == NULL || gw[l] == NULL || b[l] == NULL || gb[l] == NULL) die("out of memory");
  }
  initial_parameters(&o, w, b);
  dp_module *model = build_module(&o, &ctx, w, b);
  dataset data = make_dataset(&o);
  float *batch = malloc((size_t)(o.batch * 2 * W) * sizeof(float));
  int64_t *order = malloc((size_t)data.rows * sizeof(int64_t));
  float *staging = malloc((size_t)(2 * W * W) * sizeof(float));
  if (batch == NULL || order == NULL || staging == NULL) die("out of memory");
  int64_t batch_shape[2] = {o.batch, 2 * W};
  dp_device host = {DP_DEVICE_CPU, 0};
  dp_tensor *input = NULL;
  CHECK(dp_tensor_create(&input, DP_FLOAT32, 2, batch_shape, host));

  char device_list[256] = "";
  for (size_t i = 0; i < o.ndevices; ++i) {
    char name[32];
    CHECK(dp_device_format(o.devices[i], name, sizeof name));
    if (strlen(device_list) + strlen(name) + 2 < sizeof device_list) {
      if (i > 0) strcat(device_list, ",");
      strcat(device_list, name);
    }
  }
  printf("dp-train: %d x Linear(%lld, %lld) + ReLU, %zu parameters, batch %lld on %s, BLAS threads per replica %d\n", L,
         (long long)W, (long long)W, dp_module_num_parameters(model), (long long)o.batch, device_list,
         blas_threads < 1 ? 1 : blas_threads);

  dp_replica_set *set = NULL;
  CHECK(dp_replica_set_create(&set, model, o.devices, o.ndevices));
  const int warmup = o.steps > 2 ? 2 : 0;
  double total = 0, compute = 0, sync = 0, scatter_gather = 0, reduction = 0;
  long rss_at_10 = -1, rss_at_end = -1;
  for (int step = 0; step < o.steps; ++step) {
    fill_batch(&data, step, o.batch, batch, order);
    CHECK(dp_tensor_copy_from_host(input, batch, dp_tensor_nbytes(input)));
    dp_tensor *losses = NULL;
    double t0 = now_seconds();
    CHECK(dp_replica_set_sync(set));
    double t1 = now_seconds();
    for (size_t i = 0; i < o.ndevices; ++i) ctx.replicas[i].start = ctx.replicas[i].end = t1;
    CHECK(dp_replica_set_apply(set, input, 0, host, replica_step, &ctx, &losses));
    double t2 = now_seconds();
    CHECK(dp_module_zero_grad(model));
    CHECK(dp_replica_set_reduce_gradients(set));
    double t3 = now_seconds();
    module_sgd(model, o.lr, staging);
    double t4 = now_seconds();

    double first = ctx.replicas[0].start, last = ctx.replicas[0].end;
    for (size_t i = 1; i < o.ndevices; ++i) {
      if (ctx.replicas[i].start < first) first = ctx.replicas[i].start;
      if (ctx.replicas[i].end > last) last = ctx.replicas[i].end;
    }
    float parts[MAX_DEVICES];
    double loss = 0;
    int64_t nparts = dp_tensor_numel(losses);
    CHECK(dp_tensor_copy_to_host(losses, parts, (size_t)nparts * sizeof(float)));
    for (int64_t i = 0; i < nparts; ++i) loss += parts[i];
    dp_tensor_destroy(losses);

    double step_time = t4 - t0;
    if (step >= warmup) {
      total += step_time;
      compute += (last - first) + (t4 - t3);
      sync += t1 - t0;
      scatter_gather += (t2 - t1) - (last - first);
      reduction += t3 - t2;
    }
    printf("step %4d/%d  loss %.6f  %9.0f samples/s  %7.2f ms\n", step + 1, o.steps, loss, (double)o.batch / step_time,
           step_time * 1e3);
    fflush(stdout);
    if (step + 1 == 10) rss_at_10 = rss_kib();
    if (step + 1 == o.steps) rss_at_end = rss_kib();
  }
  int measured = o.steps - warmup;
  printf("\nsteps %d..%d: %.2f ms per step, %.0f samples/s\n", warmup + 1, o.steps, total / measured * 1e3,
         (double)o.batch * measured / total);
  printf("  compute         %8.2f ms  %5.1f%%  (replica forward+backward, SGD)\n", compute / measured * 1e3,
         100 * compute / total);
  printf("  sync            %8.2f ms  %5.1f%%\n", sync / measured * 1e3, 100 * sync / total);
  printf("  scatter/gather  %8.2f ms  %5.1f%%\n", scatter_gather / measured * 1e3, 100 * scatter_gather / total);
  printf("  reduction       %8.2f ms  %5.1f%%\n", reduction / measured * 1e3, 100 * reduction / total);
  printf("  library share   %8.2f ms  %5.1f%%  (sync + scatter/gather + reduction)\n",
         (sync + scatter_gather + reduction) / measured * 1e3, 100 * (sync + scatter_gather + reduction) / total);

  int status = 0;
  if (o.max_rss_growth_kib >= 0) {
    if (o.steps < 10 || rss_at_10 < 0) {
      fprintf(stderr, "dp-train: --max-rss-growth-kib needs at least 10 steps and /proc/self/statm\n");
      status = 1;
    } else {
      long growth = rss_at_end - rss_at_10;
      printf("resident memory: %ld KiB after step 10, %ld KiB after step %d (%+ld KiB, limit %ld)\n", rss_at_10,
             rss_at_end, o.steps, growth, o.max_rss_growth_kib);
      if (growth > o.max_rss_growth_kib) {
        fprintf(stderr, "dp-train: FAIL: resident memory grew by %ld KiB\n", growth);
        status = 1;
      }
    }
  }

  if (o.save_path != NULL) {
    CHECK(dp_module_save(model, o.save_path));
    printf("saved the model to %s\n", o.save_path);
  }

  if (o.check) {
    /* The same training on one device with the full batch. */
    openblas_set_num_threads(cpu_count());
    workspace reference = {0};
    model_math math = ctx.math;
    initial_parameters(&o, w, b);
    for (int step = 0; step < o.steps; ++step) {
      fill_batch(&data, step, o.batch, batch, order);
      forward_backward(&math, w, b, gw, gb, batch, batch + W, 2 * W, o.batch, &reference);
      for (int l = 0; l < L; ++l) {
        sgd(w[l], gw[l], W * W, o.lr);
        sgd(b[l], gb[l], W, o.lr);
      }
    }
    double worst = 0;
    const char *worst_name = "";
    long bad = 0;
    for (int l = 0; l < L; ++l) {
      for (int part = 0; part < 2; ++part) {
        const char *name = part == 0 ? ctx.weight_names[l] : ctx.bias_names[l];
        const float *expected = part == 0 ? w[l] : b[l];
        dp_tensor *t = NULL;
        CHECK(dp_module_get_parameter(model, name, &t));
        int64_t count = dp_tensor_numel(t);
        CHECK(dp_tensor_copy_to_host(t, staging, dp_tensor_nbytes(t)));
        for (int64_t i = 0; i < count; ++i) {
          double diff = fabs((double)staging[i] - expected[i]);
          if (diff > ATOL + RTOL * fabs((double)expected[i])) ++bad;
          if (diff > worst) {
            worst = diff;
            worst_name = name;
          }
        }
        dp_tensor_destroy(t);
      }
    }
    printf(
        "parity with single-device training on the full batch: max |difference| %.3g (%s), %ld values outside "
        "rtol %.2g atol %.2g: %s\n",
        worst, worst_name, bad, RTOL, ATOL, bad == 0 ? "OK" : "FAIL");
    if (bad != 0) status = 1;
    free(reference.data);
  }

  for (size_t i = 0; i < o.ndevices; ++i) {
    free(ctx.replicas[i].data);
    free(ctx.replicas[i].host_params);
  }
  for (int l = 0; l < L; ++l) {
    free(w[l]);
    free(b[l]);
    free(gw[l]);
    free(gb[l]);
  }
  free(batch);
  free(order);
  free(staging);
  free(data.pool);
  dp_tensor_destroy(input);
  dp_replica_set_destroy(set);
  dp_module_destroy(model);
  return status;
}
