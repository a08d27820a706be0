/* dp-train: data-parallel training of an MLP through dparallel's C ABI.
 *
 * The program plays the host framework: it owns the model's math (Linear and
 * tanh layers, MSE loss, forward and backward with OpenBLAS, SGD) and hands
 * dparallel the rest, in one of two ways:
 *  - in one process (the default): the module tree, replicas kept across
 *    steps, scatter of each batch, the per-replica forward/backward on the
 *    device workers, and the reduction of the replicas' gradients;
 *  - with --ddp, one process per rank under tools/dp-run: every rank holds
 *    the whole model and trains on its shard of each batch, and the DDP
 *    reducer averages the gradients across ranks while the backward runs:
 *    the backward marks each layer's gradients ready as it produces them,
 *    last layer first, the way an autograd hook would.
 * The task: regression onto a fixed random teacher network of the same
 * shape. At the end the program trains the same model in this process on the
 * full batch and checks that both reach the same parameters.
 *
 *   dp-train --devices cpu:0,cpu:1 --steps 30 --batch 1024 --width 512 --layers 4
 *   dp-run -n 2 dp-train --ddp --steps 30 --batch 1024 --width 512 --layers 4
 */
#define _POSIX_C_SOURCE 200809L

#include <cblas.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
  double min_loss_drop;    /* > 0: the first step's loss over the last one's must reach it */
  const char *save_path;
  int ddp; /* one process per rank under dp-run, gradients averaged by dp_ddp */
  double bucket_cap_mb, first_bucket_cap_mb;
  int grad_as_bucket_view;
  const char *checkpoint_dir; /* --ddp: rank 0 saves step-N.safetensors here; a run starts from the newest */
  int checkpoint_every;       /* steps between saves (default 10) */
  int die_at_step;            /* > 0: rank 1 exits after this step of a job's first run (DP_RESTART_COUNT 0) */
  uint64_t dying_ranks;       /* the ranks that exit then (bit r: rank r; default rank 1 alone) */
  int backend;                /* --ddp: the process group's dp_backend (default AUTO) */
  int elastic;                /* --ddp: a step failed by a peer's death goes on over the survivors */
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
  /* Gradients are scaled by this: the DDP reducer divides the ranks' sum by
   * the world size, so each rank contributes world x its share. */
  int world;
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

static void die_errno(const char *what, const char *path) {
  fprintf(stderr, "dp-train: %s '%s': %s\n", what, path, strerror(errno));
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
static float normal(uint64_t *state) {
  double u = uniform01(state), v = uniform01(state);
  return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

/* ---- the model's math, on host memory ---- */

/* Forward over n rows of x (row pitch ld): act + l*n*W receives layer l's
 * output (tanh after every layer but the last). tanh rather than ReLU because
 * its slope is continuous: the data-parallel and the reference runs sum
 * gradients in different orders, and once the model learns, a last-bit
 * difference that moves a ReLU input across zero changes a whole row of the
 * next update by ~1e-5, enough to fail the parity check on some runs. */
static void forward(const model_math *m, float *const *w, float *const *b, const float *x, int64_t ld, int64_t n,
                    float *act) {
  const int64_t W = m->width;
  const int L = m->layers;
  for (int l = 0; l < L; ++l) {
    const float *in = l == 0 ? x : act + (size_t)(l - 1) * (size_t)(n * W);
    float *out = act + (size_t)l * (size_t)(n * W);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)W, (int)W, 1.0f, in, (int)(l == 0 ? ld : W), w[l],
                (int)W, 0.0f, out, (int)W);
    for (int64_t r = 0; r < n; ++r) {
      float *row = out + r * W;
      for (int64_t j = 0; j < W; ++j) {
        float v = row[j] + b[l][j];
        row[j] = l < L - 1 ? tanhf(v) : v;
      }
    }
  }
}

/* Called once a layer's weight and bias gradients are final, last layer
 * first: where an autograd hook would tell the DDP reducer. */
typedef void (*layer_done_fn)(void *user_data, int layer);

/* Forward and backward over n rows of x (row pitch ld) with targets y (pitch
 * ld): writes every layer's weight and bias gradient of the loss over
 * full_batch rows (MSE, mean over rows and outputs) that these rows
 * contribute (times m->world), and returns their part of the loss. After
 * each layer's gradients, layer_done (may be NULL) is called. */
static double forward_backward(const model_math *m, float *const *w, float *const *b, float *const *gw,
                               float *const *gb, const float *x, const float *y, int64_t ld, int64_t n, workspace *ws,
                               layer_done_fn layer_done, void *user_data) {
  const int64_t W = m->width;
  const int L = m->layers;
  if (!ensure(&ws->data, &ws->capacity, (size_t)(L + 2) * (size_t)(n * W))) return NAN;
  float *act = ws->data; /* act + l*n*W: output of layer l */
  float *dz = act + (size_t)L * (size_t)(n * W);
  float *da = dz + n * W;
  forward(m, w, b, x, ld, n, act);
  double loss = 0.0;
  const float *pred = act + (size_t)(L - 1) * (size_t)(n * W);
  const float scale = 2.0f * (float)m->world / (float)(m->full_batch * W);
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
    if (layer_done != NULL) layer_done(user_data, l);
    if (l == 0) break;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)W, (int)W, 1.0f, dz, (int)W, w[l], (int)W, 0.0f,
                da, (int)W);
    for (int64_t i = 0; i < n * W; ++i) da[i] *= 1.0f - in[i] * in[i]; /* tanh' from its output `in` */
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
    loss = forward_backward(&ctx->math, w, b, gw, gb, rows, rows + W, shape[1], shape[0], ws, NULL, NULL);
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

static void usage(const char *problem) {
  if (problem != NULL) fprintf(stderr, "dp-train: %s\n", problem);
  fprintf(stderr,
          "usage: dp-train [--devices cpu:0,cpu:1] [--steps 30] [--batch 1024] [--width 512] [--layers 4]\n"
          "                [--lr 2] [--no-check] [--max-rss-growth-kib N] [--min-loss-drop F]\n"
          "                [--save model.safetensors]\n"
          "       dp-run -n 2 dp-train --ddp [--bucket-cap-mb 25] [--first-bucket-cap-mb 1]\n"
          "                [--grad-as-bucket-view] [the options above but --devices]\n"
          "                [--checkpoint-dir D [--checkpoint-every 10]] [--die-at-step S [--dying-ranks 1]]\n"
          "                [--elastic]\n"
          "                [--backend auto|gloo|shm|mpi]   (mpi: under mpirun, DP_STORE_ADDR/PORT set)\n"
          "--checkpoint-dir: rank 0 saves the model as D/step-N.safetensors every N steps (each file\n"
          "whole or absent), and a run starts from the newest there, at its step: under\n"
          "dp-run --max-restarts a failed job resumes where its last save left it. --die-at-step S:\n"
          "rank 1 (or each of --dying-ranks) exits with code 9 after step S of the job's first run\n"
          "(DP_RESTART_COUNT 0), as a rank that died would. --elastic (under dp-run --survive-failures): when a peer "
          "dies, the\n"
          "others shrink the group (dp_process_group_shrink), the dp_ddp goes on over it\n"
          "(dp_ddp_rebind) and the failed step runs again over the survivors' split of its batch.\n");
  exit(2);
}

static void bad_value(const char *option, const char *takes, const char *value) {
  fprintf(stderr, "dp-train: %s takes %s, not '%s'\n", option, takes, value);
  exit(2);
}

static long long parse_integer(const char *option, const char *text, long long min, long long max) {
  char takes[96];
  char *end = NULL;
  errno = 0;
  long long value = strtoll(text, &end, 10);
  snprintf(takes, sizeof takes, "an integer in %lld..%lld", min, max);
  if (errno != 0 || end == text || *end != '\0' || value < min || value > max) bad_value(option, takes, text);
  return value;
}

static double parse_number(const char *option, const char *text, double max) {
  char takes[96];
  char *end = NULL;
  errno = 0;
  double value = strtod(text, &end);
  snprintf(takes, sizeof takes, "a number above 0 and at most %.10g", max);
  if (errno != 0 || end == text || *end != '\0' || !isfinite(value) || value <= 0 || value > max) {
    bad_value(option, takes, text);
  }
  return value;
}

static void parse_devices(const char *text, options *o) {
  char buf[1024];
  if (strlen(text) >= sizeof buf) bad_value("--devices", "at most 1023 characters", "...");
  strcpy(buf, text);
  o->ndevices = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
    if (o->ndevices == MAX_DEVICES) bad_value("--devices", "at most 64 devices", text);
    if (dp_device_parse(tok, &o->devices[o->ndevices++]) != DP_OK) {
      bad_value("--devices", "devices like cpu:0,cpu:1", text);
    }
  }
  if (o->ndevices == 0) bad_value("--devices", "devices like cpu:0,cpu:1", text);
}

static options parse_options(int argc, char **argv) {
  options o;
  memset(&o, 0, sizeof o);
  parse_devices("cpu:0,cpu:1", &o);
  o.steps = 30;
  o.batch = 1024;
  o.width = 512;
  o.layers = 4;
  o.lr = 2.0f;
  o.check = 1;
  o.max_rss_growth_kib = -1;
  o.min_loss_drop = 0;
  o.bucket_cap_mb = 25.0;
  o.first_bucket_cap_mb = 1.0;
  o.checkpoint_every = 10;
  o.dying_ranks = (uint64_t)1 << 1;
  const char *devices = NULL, *ddp_only = NULL, *every = NULL;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    if (strcmp(a, "--no-check") == 0) {
      o.check = 0;
      continue;
    }
    if (strcmp(a, "--ddp") == 0) {
      o.ddp = 1;
      continue;
    }
    if (strcmp(a, "--elastic") == 0) {
      o.elastic = 1;
      ddp_only = a;
      continue;
    }
    if (strcmp(a, "--grad-as-bucket-view") == 0) {
      o.grad_as_bucket_view = 1;
      ddp_only = a;
      continue;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) usage(NULL);
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strncmp(a, "--", 2) != 0) {
      char problem[128];
      snprintf(problem, sizeof problem, "unexpected argument '%.64s'", a);
      usage(problem);
    }
    if (v == NULL) {
      char problem[128];
      snprintf(problem, sizeof problem, "%.64s needs a value", a);
      usage(problem);
    }
    ++i;
    if (strcmp(a, "--devices") == 0) {
      parse_devices(v, &o);
      devices = a;
    } else if (strcmp(a, "--steps") == 0) {
      o.steps = (int)parse_integer(a, v, 1, 1000000);
    } else if (strcmp(a, "--batch") == 0) {
      o.batch = parse_integer(a, v, 1, 1 << 24);
    } else if (strcmp(a, "--width") == 0) {
      o.width = parse_integer(a, v, 1, 16384);
    } else if (strcmp(a, "--layers") == 0) {
      o.layers = (int)parse_integer(a, v, 1, MAX_LAYERS);
    } else if (strcmp(a, "--lr") == 0) {
      o.lr = (float)parse_number(a, v, 1e6);
    } else if (strcmp(a, "--min-loss-drop") == 0) {
      o.min_loss_drop = parse_number(a, v, 1e12);
    } else if (strcmp(a, "--max-rss-growth-kib") == 0) {
      o.max_rss_growth_kib = (long)parse_integer(a, v, 0, 1LL << 40);
    } else if (strcmp(a, "--save") == 0) {
      o.save_path = v;
    } else if (strcmp(a, "--bucket-cap-mb") == 0) {
      o.bucket_cap_mb = parse_number(a, v, 1048576);
      ddp_only = a;
    } else if (strcmp(a, "--first-bucket-cap-mb") == 0) {
      o.first_bucket_cap_mb = parse_number(a, v, 1048576);
      ddp_only = a;
    } else if (strcmp(a, "--checkpoint-dir") == 0) {
      if (*v == '\0' || strlen(v) > 3000) bad_value(a, "a folder's path", v);
      o.checkpoint_dir = v;
      ddp_only = a;
    } else if (strcmp(a, "--checkpoint-every") == 0) {
      o.checkpoint_every = (int)parse_integer(a, v, 1, 1000000);
      ddp_only = every = a;
    } else if (strcmp(a, "--backend") == 0) {
      static const char *const names[] = {"auto", "gloo", "", "shm", "mpi"};
      static const int values[] = {DP_BACKEND_AUTO, DP_BACKEND_GLOO, -1, DP_BACKEND_SHM, DP_BACKEND_MPI};
      o.backend = -1;
      for (size_t k = 0; k < sizeof values / sizeof values[0]; ++k) {
        if (values[k] >= 0 && strcmp(v, names[k]) == 0) o.backend = values[k];
      }
      if (o.backend < 0) bad_value(a, "auto, gloo, shm or mpi", v);
      ddp_only = a;
    } else if (strcmp(a, "--die-at-step") == 0) {
      o.die_at_step = (int)parse_integer(a, v, 1, 1000000);
      ddp_only = a;
    } else if (strcmp(a, "--dying-ranks") == 0) {
      o.dying_ranks = 0;
      for (const char *at = v; *at != '\0';) {
        char *end = NULL;
        long r = strtol(at, &end, 10);
        if (end == at || r < 0 || r > 63 || (*end != ',' && *end != '\0')) bad_value(a, "ranks like 2,3 (0 to 63)", v);
        o.dying_ranks |= (uint64_t)1 << r;
        at = *end == ',' ? end + 1 : end;
      }
      ddp_only = a;
    } else {
      char problem[128];
      snprintf(problem, sizeof problem, "unknown option '%.64s'", a);
      usage(problem);
    }
  }
  if (o.ddp && devices != NULL) usage("--devices does not go with --ddp: each rank runs on cpu:0");
  if (every != NULL && o.checkpoint_dir == NULL) usage("--checkpoint-every needs --checkpoint-dir");
  if (!o.ddp && ddp_only != NULL) {
    char problem[128];
    snprintf(problem, sizeof problem, "%s needs --ddp", ddp_only);
    usage(problem);
  }
  /* The replicas split the batch: each needs a row. */
  if (!o.ddp && o.batch < (int64_t)o.ndevices) {
    char takes[64], value[32];
    snprintf(takes, sizeof takes, "at least one row per device (%zu)", o.ndevices);
    snprintf(value, sizeof value, "%lld", (long long)o.batch);
    bad_value("--batch", takes, value);
  }
  return o;
}

/* Glorot (Xavier) normal initialisation for square layers: weights with
 * variance 1 / width, biases zero, so that signals and gradients keep their
 * size through the tanh layers. */
static void init_network(int layers, int64_t width, uint64_t seed, float **w, float **b) {
  uint64_t rng = seed;
  const float std = 1.0f / sqrtf((float)width);
  for (int l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < width * width; ++i) w[l][i] = std * normal(&rng);
    for (int64_t i = 0; i < width; ++i) b[l][i] = 0.0f;
  }
}

/* The student's initial parameters; in a DDP run each rank draws its own
 * (seed 42 + rank) and dp_ddp_create gives every rank rank 0's. */
static void initial_parameters(const options *o, int rank, float **w, float **b) {
  init_network(o->layers, o->width, 42 + (uint64_t)rank, w, b);
}

/* Synthetic regression data: a pool of rows [x | teacher(x)], the teacher a
 * fixed random network of the student's shape (its own seed), so the student
 * can fit it. The inputs lie in a random 16-dimensional subspace (standard
 * normal in it, unit variance per coordinate), as real inputs have a few
 * directions that matter: on full-rank noise a few dozen steps learn little.
 * Each step draws a shuffled batch from the pool. */
typedef struct dataset {
  int64_t rows, width;
  float *pool; /* rows x 2*width */
} dataset;

static dataset make_dataset(const options *o) {
  dataset d = {4 * o->batch, o->width, NULL};
  const int64_t W = o->width;
  const int L = o->layers;
  const int64_t k = W < 16 ? W : 16;
  model_math math = {L, W, d.rows, 1};
  float *tw[MAX_LAYERS], *tb[MAX_LAYERS];
  float *x = malloc((size_t)(d.rows * W) * sizeof(float));
  float *z = malloc((size_t)(d.rows * k) * sizeof(float));
  float *basis = malloc((size_t)(k * W) * sizeof(float));
  float *act = malloc((size_t)L * (size_t)(d.rows * W) * sizeof(float));
  d.pool = malloc((size_t)(d.rows * 2 * W) * sizeof(float));
  int ok = x != NULL && z != NULL && basis != NULL && act != NULL && d.pool != NULL;
  for (int l = 0; l < L; ++l) {
    tw[l] = malloc((size_t)(W * W) * sizeof(float));
    tb[l] = malloc((size_t)W * sizeof(float));
    ok = ok && tw[l] != NULL && tb[l] != NULL;
  }
  if (!ok) {
    fprintf(stderr, "dp-train: out of memory for the data set\n");
    exit(1);
  }
  init_network(L, W, 7, tw, tb);
  uint64_t rng = 8;
  for (int64_t i = 0; i < d.rows * k; ++i) z[i] = normal(&rng);
  for (int64_t i = 0; i < k * W; ++i) basis[i] = normal(&rng) / sqrtf((float)k);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)d.rows, (int)W, (int)k, 1.0f, z, (int)k, basis, (int)W,
              0.0f, x, (int)W);
  forward(&math, tw, tb, x, W, d.rows, act);
  const float *y = act + (size_t)(L - 1) * (size_t)(d.rows * W);
  for (int64_t r = 0; r < d.rows; ++r) {
    memcpy(d.pool + r * 2 * W, x + r * W, (size_t)W * sizeof(float));
    memcpy(d.pool + r * 2 * W + W, y + r * W, (size_t)W * sizeof(float));
  }
  for (int l = 0; l < L; ++l) {
    free(tw[l]);
    free(tb[l]);
  }
  free(x);
  free(z);
  free(basis);
  free(act);
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

/* The module as torch.nn.Sequential(Linear, Tanh, ..., Linear) names it:
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
      dp_module *tanh_layer = NULL;
      snprintf(child, sizeof child, "%d", 2 * l + 1);
      CHECK(dp_module_create(&tanh_layer));
      CHECK(dp_module_register_module(root, child, tanh_layer));
      dp_module_destroy(tanh_layer);
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

/* What every run shares: the data, a batch buffer and scratch memory. */
typedef struct run_state {
  const options *o;
  train_context ctx;
  dp_module *model;
  dataset data;
  float *batch; /* o->batch rows of [x | y] */
  int64_t *order;
  float *staging;
  int blas_threads;
  long rss_at_10, rss_at_end;
  double first_loss, last_loss; /* the whole batch's, at the first and the last step */
  int start_step;               /* where this run began: a checkpoint's step, else 0 */
} run_state;

static void note_rss(run_state *r, int step) {
  if (step + 1 == 10) r->rss_at_10 = rss_kib();
  if (step + 1 == r->o->steps) r->rss_at_end = rss_kib();
}

static void note_loss(run_state *r, int step, double loss) {
  if (step == r->start_step) r->first_loss = loss;
  r->last_loss = loss;
}

/* --min-loss-drop: training must have learnt, not merely stayed in parity. */
static int check_loss(const run_state *r) {
  const double want = r->o->min_loss_drop;
  if (want <= 0) return 0;
  const double drop = r->first_loss / r->last_loss;
  printf("loss fell %.1f-fold over %d steps (%.6f to %.6f; at least %.1f-fold wanted)\n", drop, r->o->steps,
         r->first_loss, r->last_loss, want);
  if (!(drop >= want)) {
    fprintf(stderr, "dp-train: FAIL: the loss fell only %.2f-fold\n", drop);
    return 1;
  }
  return 0;
}

static int check_rss(const run_state *r) {
  const options *o = r->o;
  if (o->max_rss_growth_kib < 0) return 0;
  if (o->steps < 10 || r->rss_at_10 < 0) {
    fprintf(stderr, "dp-train: --max-rss-growth-kib needs at least 10 steps and /proc/self/statm\n");
    return 1;
  }
  long growth = r->rss_at_end - r->rss_at_10;
  printf("resident memory: %ld KiB after step 10, %ld KiB after step %d (%+ld KiB, limit %ld)\n", r->rss_at_10,
         r->rss_at_end, o->steps, growth, o->max_rss_growth_kib);
  if (growth > o->max_rss_growth_kib) {
    fprintf(stderr, "dp-train: FAIL: resident memory grew by %ld KiB\n", growth);
    return 1;
  }
  return 0;
}

/* Trains with a dp_replica_set over o->devices in this process. */
static void run_replicas(run_state *r) {
  const options *o = r->o;
  train_context *ctx = &r->ctx;
  const int64_t W = o->width;
  int64_t batch_shape[2] = {o->batch, 2 * W};
  dp_device host = {DP_DEVICE_CPU, 0};
  dp_tensor *input = NULL;
  CHECK(dp_tensor_create(&input, DP_FLOAT32, 2, batch_shape, host));

  char device_list[256] = "";
  for (size_t i = 0; i < o->ndevices; ++i) {
    char name[32];
    CHECK(dp_device_format(o->devices[i], name, sizeof name));
    if (strlen(device_list) + strlen(name) + 2 < sizeof device_list) {
      if (i > 0) strcat(device_list, ",");
      strcat(device_list, name);
    }
  }
  printf("dp-train: %d x Linear(%lld, %lld) + Tanh, %zu parameters, batch %lld on %s, BLAS threads per replica %d\n",
         o->layers, (long long)W, (long long)W, dp_module_num_parameters(r->model), (long long)o->batch, device_list,
         r->blas_threads);

  dp_replica_set *set = NULL;
  CHECK(dp_replica_set_create(&set, r->model, o->devices, o->ndevices));
  const int warmup = o->steps > 2 ? 2 : 0;
  double total = 0, compute = 0, sync = 0, scatter_gather = 0, reduction = 0;
  for (int step = 0; step < o->steps; ++step) {
    fill_batch(&r->data, step, o->batch, r->batch, r->order);
    CHECK(dp_tensor_copy_from_host(input, r->batch, dp_tensor_nbytes(input)));
    dp_tensor *losses = NULL;
    double t0 = now_seconds();
    CHECK(dp_replica_set_sync(set));
    double t1 = now_seconds();
    for (size_t i = 0; i < o->ndevices; ++i) ctx->replicas[i].start = ctx->replicas[i].end = t1;
    CHECK(dp_replica_set_apply(set, input, 0, host, replica_step, ctx, &losses));
    double t2 = now_seconds();
    CHECK(dp_module_zero_grad(r->model));
    CHECK(dp_replica_set_reduce_gradients(set));
    double t3 = now_seconds();
    module_sgd(r->model, o->lr, r->staging);
    double t4 = now_seconds();

    double first = ctx->replicas[0].start, last = ctx->replicas[0].end;
    for (size_t i = 1; i < o->ndevices; ++i) {
      if (ctx->replicas[i].start < first) first = ctx->replicas[i].start;
      if (ctx->replicas[i].end > last) last = ctx->replicas[i].end;
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
    printf("step %4d/%d  loss %.6f  %9.0f samples/s  %7.2f ms\n", step + 1, o->steps, loss,
           (double)o->batch / step_time, step_time * 1e3);
    fflush(stdout);
    note_rss(r, step);
    note_loss(r, step, loss);
  }
  int measured = o->steps - warmup;
  printf("\nsteps %d..%d: %.2f ms per step, %.0f samples/s\n", warmup + 1, o->steps, total / measured * 1e3,
         (double)o->batch * measured / total);
  printf("  compute         %8.2f ms  %5.1f%%  (replica forward+backward, SGD)\n", compute / measured * 1e3,
         100 * compute / total);
  printf("  sync            %8.2f ms  %5.1f%%\n", sync / measured * 1e3, 100 * sync / total);
  printf("  scatter/gather  %8.2f ms  %5.1f%%\n", scatter_gather / measured * 1e3, 100 * scatter_gather / total);
  printf("  reduction       %8.2f ms  %5.1f%%\n", reduction / measured * 1e3, 100 * reduction / total);
  printf("  library share   %8.2f ms  %5.1f%%  (sync + scatter/gather + reduction)\n",
         (sync + scatter_gather + reduction) / measured * 1e3, 100 * (sync + scatter_gather + reduction) / total);
  dp_tensor_destroy(input);
  dp_replica_set_destroy(set);
}

/* ---- --ddp: one process per rank ---- */

typedef struct ddp_marks {
  dp_ddp *ddp;
  const train_context *ctx;
} ddp_marks;

/* The backward's per-layer hook: this layer's gradients are final, so the
 * reducer may copy them into their bucket and start the bucket's reduction
 * while the backward goes on with the layers below. By name here; a host
 * that tracks indices calls dp_ddp_mark_grad_ready_index. */
static void mark_layer_ready(void *user_data, int layer) {
  ddp_marks *m = user_data;
  CHECK(dp_ddp_mark_grad_ready(m->ddp, m->ctx->weight_names[layer]));
  CHECK(dp_ddp_mark_grad_ready(m->ddp, m->ctx->bias_names[layer]));
}

/* Host pointers to the module's parameters and gradients. Fetched every
 * step: with gradient_as_bucket_view the gradients are views into the
 * reducer's buckets, which are rebuilt once after the first step. */
static void layer_pointers(dp_module *model, const train_context *ctx, float **w, float **b, float **gw, float **gb) {
  for (int l = 0; l < ctx->math.layers; ++l) {
    dp_tensor *t[4] = {NULL, NULL, NULL, NULL};
    CHECK(dp_module_get_parameter(model, ctx->weight_names[l], &t[0]));
    CHECK(dp_module_get_parameter(model, ctx->bias_names[l], &t[1]));
    CHECK(dp_module_grad(model, ctx->weight_names[l], &t[2]));
    CHECK(dp_module_grad(model, ctx->bias_names[l], &t[3]));
    w[l] = dp_tensor_data(t[0]);
    b[l] = dp_tensor_data(t[1]);
    gw[l] = dp_tensor_data(t[2]);
    gb[l] = dp_tensor_data(t[3]);
    /* The module keeps them alive. */
    for (int i = 0; i < 4; ++i) dp_tensor_destroy(t[i]);
  }
}

/* ---- checkpoints (--checkpoint-dir) ---- */

/* The step of a file named step-N.safetensors, else -1 (a save still being
 * written has another name until it is whole). */
static int checkpoint_step(const char *name) {
  int step = -1, end = 0;
  if (sscanf(name, "step-%9d.safetensors%n", &step, &end) != 1 || name[end] != '\0' || step < 1) return -1;
  char canonical[64];
  snprintf(canonical, sizeof canonical, "step-%d.safetensors", step);
  return strcmp(canonical, name) == 0 ? step : -1;
}

/* Loads the newest save of at most `steps` steps into the model; returns
 * its step, 0 when there is none (the folder is made then). */
static int load_newest_checkpoint(dp_module *model, const char *dir, int steps, int rank) {
  DIR *d = opendir(dir);
  if (d == NULL) {
    if (errno != ENOENT) die_errno("--checkpoint-dir", dir);
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) die_errno("--checkpoint-dir: making", dir);
    return 0;
  }
  int newest = 0;
  for (struct dirent *e = readdir(d); e != NULL; e = readdir(d)) {
    const int step = checkpoint_step(e->d_name);
    if (step > newest && step <= steps) newest = step;
  }
  closedir(d);
  if (newest == 0) return 0;
  char path[4096];
  snprintf(path, sizeof path, "%s/step-%d.safetensors", dir, newest);
  CHECK(dp_module_load(model, path, 1));
  if (rank == 0) printf("resuming from %s: step %d on\n", path, newest + 1);
  return newest;
}

/* Rank 0 saves the model after `step` steps; dp_module_save replaces the
 * file whole or not at all. The others wait for it, so that a save every
 * rank went past is complete. */
static void save_checkpoint(dp_module *model, dp_process_group *pg, const char *dir, int step) {
  if (dp_process_group_rank(pg) == 0) {
    char path[4096];
    snprintf(path, sizeof path, "%s/step-%d.safetensors", dir, step);
    CHECK(dp_module_save(model, path));
  }
  CHECK(dp_pg_barrier(pg));
}

/* Trains this rank's shard of every batch; dp_ddp averages the gradients. */
/* --elastic, after a call of step `step` failed with `status`: the survivors
 * shrink the group and the dp_ddp goes on over it, its parameters the new
 * rank 0's; returns the step every survivor goes on at, rank 0's (`next`:
 * this rank's, the failed step unless its update was already made). */
static int go_on_without_the_lost(dp_process_group **pg, dp_ddp *ddp, int step, int next, dp_status status) {
  fprintf(stderr, "dp-train: step %d failed on rank %d (%s: %s); shrinking the group\n", step + 1,
          dp_process_group_rank(*pg), dp_status_string(status), dp_last_error());
  dp_process_group *survivors = NULL;
  if (dp_process_group_shrink(*pg, &survivors) != DP_OK) die("dp_process_group_shrink");
  char lost[256];
  snprintf(lost, sizeof lost, "%s", dp_last_error());
  CHECK(dp_ddp_rebind(ddp, survivors));
  dp_process_group_destroy(*pg);
  *pg = survivors;
  /* Every survivor goes on where rank 0 does: it has rank 0's parameters now. */
  int64_t one = 1;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  dp_tensor *at = NULL;
  float value = (float)next;
  CHECK(dp_tensor_create(&at, DP_FLOAT32, 1, &one, cpu));
  CHECK(dp_tensor_copy_from_host(at, &value, sizeof value));
  CHECK(dp_pg_broadcast(*pg, at, 0));
  CHECK(dp_tensor_copy_to_host(at, &value, sizeof value));
  dp_tensor_destroy(at);
  if (dp_process_group_rank(*pg) == 0) {
    printf("%s; going on at step %d over %d ranks\n", lost, (int)value + 1, dp_process_group_size(*pg));
    fflush(stdout);
  }
  return (int)value;
}

static dp_process_group *run_ddp(run_state *r, dp_process_group *pg) {
  const options *o = r->o;
  const int64_t W = o->width;
  int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  /* Rows [lo, hi) of each global batch are this rank's. */
  int64_t lo = o->batch * rank / world, hi = o->batch * (rank + 1) / world;
  model_math math = r->ctx.math;
  math.world = world;

  dp_ddp_options dopts;
  CHECK(dp_ddp_options_init(&dopts, sizeof dopts));
  dopts.bucket_cap_mb = o->bucket_cap_mb;
  dopts.first_bucket_cap_mb = o->first_bucket_cap_mb;
  dopts.gradient_as_bucket_view = o->grad_as_bucket_view;
  /* Every rank reads the same save (no rank writes before this point). */
  const int start = o->checkpoint_dir != NULL ? load_newest_checkpoint(r->model, o->checkpoint_dir, o->steps, rank) : 0;
  r->start_step = start;
  const char *restarts = getenv("DP_RESTART_COUNT");
  const int first_run = restarts == NULL || strcmp(restarts, "0") == 0;
  dp_ddp *ddp = NULL;
  CHECK(dp_ddp_create(&ddp, r->model, pg, &dopts));
  if (rank == 0) {
    printf(
        "dp-train --ddp: %d x Linear(%lld, %lld) + Tanh, %zu parameters, batch %lld over %d ranks (%s; %lld rows on "
        "rank 0), BLAS threads per rank %d, %zu buckets (cap %g MB, first %g MB)%s\n",
        o->layers, (long long)W, (long long)W, dp_module_num_parameters(r->model), (long long)o->batch, world,
        dp_process_group_backend(pg), (long long)(hi - lo), r->blas_threads, dp_ddp_num_buckets(ddp), o->bucket_cap_mb,
        o->first_bucket_cap_mb, o->grad_as_bucket_view ? ", gradients as bucket views" : "");
  }

  dp_tensor *loss_sum = NULL;
  int64_t one = 1;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  CHECK(dp_tensor_create(&loss_sum, DP_FLOAT32, 1, &one, cpu));
  ddp_marks marks = {ddp, &r->ctx};
  workspace ws = {0};
  float *w[MAX_LAYERS], *b[MAX_LAYERS], *gw[MAX_LAYERS], *gb[MAX_LAYERS];
  const int warmup = o->steps - start > 2 ? start + 2 : start;
  double total = 0, backward = 0, finish = 0, update = 0, reduce_ms = 0, exposed_ms = 0;
  dp_ddp_stats stats = {sizeof stats, 0, 0, 0, 0, 0};
  int shrunk = 0;
  for (int step = start; step < o->steps; ++step) {
    fill_batch(&r->data, step, o->batch, r->batch, r->order);
    const float *rows = r->batch + lo * 2 * W;
    double t0 = now_seconds();
    double loss = 0, t1 = t0, t2 = t0;
    dp_status status = dp_ddp_pre_forward(ddp);
    if (status == DP_OK) {
      layer_pointers(r->model, &r->ctx, w, b, gw, gb);
      loss = forward_backward(&math, w, b, gw, gb, rows, rows + W, 2 * W, hi - lo, &ws, mark_layer_ready, &marks);
      if (isnan(loss)) die("out of memory for the activations");
      t1 = now_seconds();
      status = dp_ddp_finish_backward(ddp);
      t2 = now_seconds();
    }
    int updated = 0;
    if (status == DP_OK) {
      module_sgd(r->model, o->lr, r->staging);
      updated = 1;
    }
    double t3 = now_seconds();
    /* The printed loss is the whole batch's: the ranks' parts summed. */
    float part = (float)loss;
    if (status == DP_OK) {
      CHECK(dp_tensor_copy_from_host(loss_sum, &part, sizeof part));
      status = dp_pg_all_reduce(pg, loss_sum, DP_SUM);
    }
    if (status != DP_OK) {
      if (!o->elastic) die("a collective of the step");
      step = go_on_without_the_lost(&pg, ddp, step, updated ? step + 1 : step, status) - 1;
      shrunk = 1;
      rank = dp_process_group_rank(pg);
      world = dp_process_group_size(pg);
      lo = o->batch * rank / world;
      hi = o->batch * (rank + 1) / world;
      math.world = world;
      continue;
    }
    CHECK(dp_tensor_copy_to_host(loss_sum, &part, sizeof part));
    CHECK(dp_ddp_last_stats(ddp, &stats));

    double step_time = t3 - t0;
    if (step >= warmup) {
      total += step_time;
      backward += t1 - t0;
      finish += t2 - t1;
      update += t3 - t2;
      reduce_ms += stats.reduce_ms;
      exposed_ms += stats.exposed_ms;
    }
    if (rank == 0) {
      printf("step %4d/%d  loss %.6f  %9.0f samples/s  %7.2f ms\n", step + 1, o->steps, part,
             (double)o->batch / step_time, step_time * 1e3);
      fflush(stdout);
    }
    note_rss(r, step);
    note_loss(r, step, part);
    if (o->checkpoint_dir != NULL && (step + 1) % o->checkpoint_every == 0) {
      save_checkpoint(r->model, pg, o->checkpoint_dir, step + 1);
    }
    if (first_run && !shrunk && rank < 64 && (o->dying_ranks >> rank & 1) != 0 && step + 1 == o->die_at_step) {
      fprintf(stderr, "dp-train: rank %d exits after step %d (--die-at-step)\n", rank, step + 1);
      fflush(stdout);
      _exit(9);
    }
  }
  if (rank == 0 && o->steps > warmup) {
    int measured = o->steps - warmup;
    printf("\nsteps %d..%d on rank 0: %.2f ms per step, %.0f samples/s (all ranks)\n", warmup + 1, o->steps,
           total / measured * 1e3, (double)o->batch * measured / total);
    printf("  forward+backward  %8.2f ms  %5.1f%%  (with the ready marks)\n", backward / measured * 1e3,
           100 * backward / total);
    printf("  finish_backward   %8.2f ms  %5.1f%%  (waiting for the last reductions)\n", finish / measured * 1e3,
           100 * finish / total);
    printf("  SGD               %8.2f ms  %5.1f%%\n", update / measured * 1e3, 100 * update / total);
    printf("  reductions        %8.2f ms, %.2f ms of it exposed: %.0f%% hidden behind the backward; %zu buckets\n",
           reduce_ms / measured, exposed_ms / measured, reduce_ms > 0 ? 100 * (1 - exposed_ms / reduce_ms) : 0.0,
           stats.num_buckets);
  }
  free(ws.data);
  dp_tensor_destroy(loss_sum);
  dp_ddp_destroy(ddp);
  return pg;
}

/* ---- the check ---- */

/* Trains the same model in this process on the full batch of every step
 * and compares the parameters. Returns 0 when they match. */
static int check_parity(run_state *r) {
  const options *o = r->o;
  const int L = o->layers;
  const int64_t W = o->width;
  float *w[MAX_LAYERS], *b[MAX_LAYERS], *gw[MAX_LAYERS], *gb[MAX_LAYERS];
  for (int l = 0; l < L; ++l) {
    w[l] = malloc((size_t)(W * W) * sizeof(float));
    gw[l] = malloc((size_t)(W * W) * sizeof(float));
    b[l] = malloc((size_t)W * sizeof(float));
    gb[l] = malloc((size_t)W * sizeof(float));
    if (w[l] == NULL || gw[l] == NULL || b[l] == NULL || gb[l] == NULL) die("out of memory");
  }
  workspace reference = {0};
  model_math math = r->ctx.math;
  math.world = 1;
  initial_parameters(o, 0, w, b);
  for (int step = 0; step < o->steps; ++step) {
    fill_batch(&r->data, step, o->batch, r->batch, r->order);
    if (isnan(forward_backward(&math, w, b, gw, gb, r->batch, r->batch + W, 2 * W, o->batch, &reference, NULL, NULL))) {
      die("out of memory for the reference run");
    }
    for (int l = 0; l < L; ++l) {
      sgd(w[l], gw[l], W * W, o->lr);
      sgd(b[l], gb[l], W, o->lr);
    }
  }
  double worst = 0;
  const char *worst_name = "";
  long bad = 0;
  for (int l = 0; l < L; ++l) {
    for (int part = 0; part < 2; ++part) {
      const char *name = part == 0 ? r->ctx.weight_names[l] : r->ctx.bias_names[l];
      const float *expected = part == 0 ? w[l] : b[l];
      dp_tensor *t = NULL;
      CHECK(dp_module_get_parameter(r->model, name, &t));
      int64_t count = dp_tensor_numel(t);
      CHECK(dp_tensor_copy_to_host(t, r->staging, dp_tensor_nbytes(t)));
      for (int64_t i = 0; i < count; ++i) {
        double diff = fabs((double)r->staging[i] - expected[i]);
        /* A NaN fails too. */
        if (!(diff <= ATOL + RTOL * fabs((double)expected[i]))) ++bad;
        if (diff > worst) {
          worst = diff;
          worst_name = name;
        }
      }
      dp_tensor_destroy(t);
    }
  }
  printf(
      "parity with single-%s training on the full batch: max |difference| %.3g (%s), %ld values outside rtol %.2g "
      "atol %.2g: %s\n",
      o->ddp ? "process" : "device", worst, worst_name, bad, RTOL, ATOL, bad == 0 ? "OK" : "FAIL");
  fflush(stdout);
  free(reference.data);
  for (int l = 0; l < L; ++l) {
    free(w[l]);
    free(b[l]);
    free(gw[l]);
    free(gb[l]);
  }
  return bad == 0 ? 0 : 1;
}

/* Ranks on this host run side by side: each gets an equal share of the cores. */
static int blas_threads_per_rank(void) {
  const char *local = getenv("LOCAL_WORLD_SIZE");
  long ranks = local != NULL ? atol(local) : 1;
  int threads = cpu_count() / (int)(ranks < 1 ? 1 : ranks);
  return threads < 1 ? 1 : threads;
}

int main(int argc, char **argv) {
  options o = parse_options(argc, argv);
  const int L = o.layers;
  const int64_t W = o.width;
  static run_state r;
  r.o = &o;
  r.rss_at_10 = r.rss_at_end = -1;
  r.ctx.math.layers = L;
  r.ctx.math.width = W;
  r.ctx.math.full_batch = o.batch;
  r.ctx.math.world = 1;

  dp_process_group *pg = NULL;
  int rank = 0;
  if (o.ddp) {
    /* From dp-run's (or torchrun's, mpirun's) environment; Gloo on cpu:0. */
    dp_process_group_options group_options = DP_PROCESS_GROUP_OPTIONS_INIT;
    group_options.backend = o.backend;
    if (dp_process_group_create_from_env(&pg, &group_options) != DP_OK) {
      fprintf(stderr,
              "dp-train: --ddp: joining the process group: %s\n(one process per rank: dp-run -n 2 dp-train --ddp)\n",
              dp_last_error());
      return 1;
    }
    rank = dp_process_group_rank(pg);
    int world = dp_process_group_size(pg);
    if (o.batch < world) {
      fprintf(stderr, "dp-train: --batch takes at least one row per rank (%d), not '%lld'\n", world,
              (long long)o.batch);
      dp_process_group_destroy(pg);
      return 2;
    }
    r.blas_threads = blas_threads_per_rank();
  } else {
    /* Replicas already run side by side: give each an equal share of the cores. */
    r.blas_threads = cpu_count() / (int)o.ndevices;
    if (r.blas_threads < 1) r.blas_threads = 1;
  }
  openblas_set_num_threads(r.blas_threads);

  float *w[MAX_LAYERS], *b[MAX_LAYERS];
  for (int l = 0; l < L; ++l) {
    w[l] = malloc((size_t)(W * W) * sizeof(float));
    b[l] = malloc((size_t)W * sizeof(float));
    if (w[l] == NULL || b[l] == NULL) die("out of memory");
  }
  initial_parameters(&o, rank, w, b);
  r.model = build_module(&o, &r.ctx, w, b);
  for (int l = 0; l < L; ++l) {
    free(w[l]);
    free(b[l]);
  }
  r.data = make_dataset(&o);
  r.batch = malloc((size_t)(o.batch * 2 * W) * sizeof(float));
  r.order = malloc((size_t)r.data.rows * sizeof(int64_t));
  r.staging = malloc((size_t)(2 * W * W) * sizeof(float));
  if (r.batch == NULL || r.order == NULL || r.staging == NULL) die("out of memory");

  if (o.ddp) {
    pg = run_ddp(&r, pg);
  } else {
    run_replicas(&r);
  }

  int status = check_rss(&r);
  if (check_loss(&r) != 0) status = 1;
  if (o.save_path != NULL && rank == 0) {
    CHECK(dp_module_save(r.model, o.save_path));
    printf("saved the model to %s\n", o.save_path);
  }
  if (o.check && check_parity(&r) != 0) status = 1;

  for (size_t i = 0; i < o.ndevices; ++i) {
    free(r.ctx.replicas[i].data);
    free(r.ctx.replicas[i].host_params);
  }
  free(r.batch);
  free(r.order);
  free(r.staging);
  free(r.data.pool);
  dp_module_destroy(r.model);
  dp_process_group_destroy(pg);
  return status;
}
