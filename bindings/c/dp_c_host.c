/* dp-c-host: a C host that loads libdparallel at run time and calls it only
 * through the dp_get_api() table.
 *
 * It trains a small MLP (Linear + tanh layers, MSE onto a fixed random
 * teacher network, SGD; forward and backward written here in plain loops)
 * data-parallel on the logical devices cpu:0 and cpu:1 through a replica
 * set, then trains the same model on the whole batch in plain C and checks
 * that both reach the same parameters.
 *
 *   dp-c-host LIBRARY                  train once and check parity
 *   dp-c-host LIBRARY --reload         then destroy every handle, dlclose
 *                                      the library, load it again, train
 *                                      again and compare the two runs
 *   dp-c-host LIBRARY --ask-next-major ask for ABI major DP_VERSION_MAJOR+1,
 *                                      which the library must refuse (exit 3)
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dp_load.h"

#define LAYERS 3
#define WIDTH 16
#define BATCH 64
#define STEPS 12
#define LR 0.5f
#define NDEVICES 2
#define RTOL 1e-5
#define ATOL 1e-6

#define WEIGHTS (WIDTH * WIDTH)

/* The parameters of the whole model, on the host. */
typedef struct params {
  float w[LAYERS][WEIGHTS]; /* [out][in], as torch.nn.Linear stores it */
  float b[LAYERS][WIDTH];
} params;

/* The Linear layers' parameters, as torch.nn.Sequential names them. */
static const char *const kWeightNames[LAYERS] = {"0.weight", "2.weight", "4.weight"};
static const char *const kBiasNames[LAYERS] = {"0.bias", "2.bias", "4.bias"};

/* ---- deterministic random numbers (splitmix64) ---- */
static uint64_t next_random(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static float normal(uint64_t *state) {
  double u = (double)(next_random(state) >> 11) * (1.0 / 9007199254740992.0);
  double v = (double)(next_random(state) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}

static void init_params(params *p, uint64_t seed) {
  uint64_t rng = seed;
  const float std = 1.0f / sqrtf((float)WIDTH);
  for (int l = 0; l < LAYERS; ++l) {
    for (int i = 0; i < WEIGHTS; ++i) p->w[l][i] = std * normal(&rng);
    for (int i = 0; i < WIDTH; ++i) p->b[l][i] = 0.0f;
  }
}

/* ---- the model's math ---- */

/* Forward over n rows of x (row pitch ld): act + l*n*WIDTH receives layer l's
 * output, tanh after every layer but the last. */
static void forward(float *const *w, float *const *b, const float *x, int64_t ld, int64_t n, float *act) {
  for (int l = 0; l < LAYERS; ++l) {
    const float *in = l == 0 ? x : act + (size_t)(l - 1) * (size_t)(n * WIDTH);
    const int64_t in_ld = l == 0 ? ld : WIDTH;
    float *out = act + (size_t)l * (size_t)(n * WIDTH);
    for (int64_t r = 0; r < n; ++r) {
      for (int j = 0; j < WIDTH; ++j) {
        float s = b[l][j];
        for (int k = 0; k < WIDTH; ++k) s += in[r * in_ld + k] * w[l][j * WIDTH + k];
        out[r * WIDTH + j] = l < LAYERS - 1 ? tanhf(s) : s;
      }
    }
  }
}

/* Forward and backward over n rows of [x | y] (row pitch ld): writes the
 * gradients that these rows contribute to the MSE over `full_batch` rows and
 * returns their part of the loss; NAN when out of memory. */
static double forward_backward(float *const *w, float *const *b, float *const *gw, float *const *gb, const float *rows,
                               int64_t ld, int64_t n, int64_t full_batch) {
  float *act = malloc((size_t)(LAYERS + 2) * (size_t)(n * WIDTH) * sizeof(float));
  if (act == NULL) return NAN;
  float *dz = act + (size_t)LAYERS * (size_t)(n * WIDTH);
  float *da = dz + n * WIDTH;
  forward(w, b, rows, ld, n, act);
  const float *pred = act + (size_t)(LAYERS - 1) * (size_t)(n * WIDTH);
  const float scale = 2.0f / (float)(full_batch * WIDTH);
  double loss = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < WIDTH; ++j) {
      float diff = pred[r * WIDTH + j] - rows[r * ld + WIDTH + j];
      loss += (double)diff * diff;
      dz[r * WIDTH + j] = diff * scale;
    }
  }
  for (int l = LAYERS - 1; l >= 0; --l) {
    const float *in = l == 0 ? rows : act + (size_t)(l - 1) * (size_t)(n * WIDTH);
    const int64_t in_ld = l == 0 ? ld : WIDTH;
    for (int j = 0; j < WIDTH; ++j) {
      for (int k = 0; k < WIDTH; ++k) {
        float s = 0.0f;
        for (int64_t r = 0; r < n; ++r) s += dz[r * WIDTH + j] * in[r * in_ld + k];
        gw[l][j * WIDTH + k] = s;
      }
      float s = 0.0f;
      for (int64_t r = 0; r < n; ++r) s += dz[r * WIDTH + j];
      gb[l][j] = s;
    }
    if (l == 0) break;
    for (int64_t r = 0; r < n; ++r) {
      for (int k = 0; k < WIDTH; ++k) {
        float s = 0.0f;
        for (int j = 0; j < WIDTH; ++j) s += dz[r * WIDTH + j] * w[l][j * WIDTH + k];
        float a = in[r * WIDTH + k];
        da[r * WIDTH + k] = s * (1.0f - a * a); /* tanh' from its output */
      }
    }
    float *t = dz;
    dz = da;
    da = t;
  }
  free(act);
  return loss / (double)(full_batch * WIDTH);
}

/* The data: BATCH rows of [x | teacher(x)], the teacher a random network of
 * the student's shape. */
static void make_batch(float *rows) {
  params teacher;
  float *w[LAYERS], *b[LAYERS];
  float x[BATCH * WIDTH];
  float act[LAYERS * BATCH * WIDTH];
  uint64_t rng = 8;
  init_params(&teacher, 7);
  for (int l = 0; l < LAYERS; ++l) {
    w[l] = teacher.w[l];
    b[l] = teacher.b[l];
  }
  for (int i = 0; i < BATCH * WIDTH; ++i) x[i] = normal(&rng);
  forward(w, b, x, WIDTH, BATCH, act);
  for (int r = 0; r < BATCH; ++r) {
    memcpy(rows + r * 2 * WIDTH, x + r * WIDTH, WIDTH * sizeof(float));
    memcpy(rows + r * 2 * WIDTH + WIDTH, act + (LAYERS - 1) * BATCH * WIDTH + r * WIDTH, WIDTH * sizeof(float));
  }
}

/* ---- the reference: one device, plain C ---- */

static int train_reference(const float *rows, params *p, double *first_loss, double *last_loss) {
  static params g;
  float *w[LAYERS], *b[LAYERS], *gw[LAYERS], *gb[LAYERS];
  for (int l = 0; l < LAYERS; ++l) {
    w[l] = p->w[l];
    b[l] = p->b[l];
    gw[l] = g.w[l];
    gb[l] = g.b[l];
  }
  for (int step = 0; step < STEPS; ++step) {
    double loss = forward_backward(w, b, gw, gb, rows, 2 * WIDTH, BATCH, BATCH);
    if (isnan(loss)) return -1;
    if (step == 0) *first_loss = loss;
    *last_loss = loss;
    for (int l = 0; l < LAYERS; ++l) {
      for (int i = 0; i < WEIGHTS; ++i) w[l][i] -= LR * gw[l][i];
      for (int i = 0; i < WIDTH; ++i) b[l][i] -= LR * gb[l][i];
    }
  }
  return 0;
}

/* ---- data-parallel through the library ---- */

/* Runs on the device's worker: this replica's rows, forward and backward,
 * gradients written into the replica's gradient tensors. */
static int replica_step(void *user_data, size_t index, dp_module *replica, dp_tensor *input, dp_device device,
                        dp_tensor **output) {
  const dp_api *api = user_data;
  dp_tensor *handles[4 * LAYERS] = {0};
  float *w[LAYERS] = {0}, *b[LAYERS] = {0}, *gw[LAYERS] = {0}, *gb[LAYERS] = {0};
  int64_t shape[2];
  int rc = 0;
  (void)index;
  if (api->tensor_shape(input, shape, 2) != DP_OK || shape[1] != 2 * WIDTH) return 1;
  for (int l = 0; l < LAYERS && rc == 0; ++l) {
    dp_tensor **t = handles + 4 * l;
    if (api->module_get_parameter(replica, kWeightNames[l], &t[0]) != DP_OK ||
        api->module_get_parameter(replica, kBiasNames[l], &t[1]) != DP_OK ||
        api->module_grad(replica, kWeightNames[l], &t[2]) != DP_OK ||
        api->module_grad(replica, kBiasNames[l], &t[3]) != DP_OK) {
      rc = 2;
      break;
    }
    /* Logical CPU devices hold host memory: the loops read it in place. */
    w[l] = api->tensor_data(t[0]);
    b[l] = api->tensor_data(t[1]);
    gw[l] = api->tensor_data(t[2]);
    gb[l] = api->tensor_data(t[3]);
  }
  double loss = NAN;
  if (rc == 0) loss = forward_backward(w, b, gw, gb, api->tensor_data(input), shape[1], shape[0], BATCH);
  for (int i = 0; i < 4 * LAYERS; ++i) api->tensor_destroy(handles[i]);
  if (rc != 0) return rc;
  if (isnan(loss)) return 3;
  int64_t one = 1;
  float value = (float)loss;
  if (api->tensor_create(output, DP_FLOAT32, 1, &one, device) != DP_OK) return 4;
  if (api->tensor_copy_from_host(*output, &value, sizeof value) != DP_OK) return 5;
  return 0;
}

static int fail(const dp_api *api, const char *what) {
  fprintf(stderr, "dp-c-host: %s failed: %s\n", what, api->last_error());
  return -1;
}

#define TRY(call)            \
  do {                       \
    if ((call) != DP_OK) {   \
      rc = fail(api, #call); \
      goto done;             \
    }                        \
  } while (0)

/* The model as torch.nn.Sequential(Linear, Tanh, Linear, Tanh, Linear)
 * names it, on cpu:0, trained for STEPS steps over cpu:0 and cpu:1. Every
 * handle is destroyed before returning. */
static int train_data_parallel(const dp_api *api, const float *rows, params *p, double *last_loss) {
  dp_device devices[NDEVICES];
  dp_module *root = NULL;
  dp_replica_set *set = NULL;
  dp_tensor *input = NULL;
  int rc = 0;
  TRY(api->device_parse("cpu:0", &devices[0]));
  TRY(api->device_parse("cpu:1", &devices[1]));
  TRY(api->module_create(&root));
  for (int l = 0; l < LAYERS; ++l) {
    dp_module *linear = NULL;
    dp_tensor *weight = NULL, *bias = NULL;
    int64_t wshape[2] = {WIDTH, WIDTH}, bshape[1] = {WIDTH};
    char child[8];
    int ok = api->module_create(&linear) == DP_OK &&
             api->tensor_create(&weight, DP_FLOAT32, 2, wshape, devices[0]) == DP_OK &&
             api->tensor_create(&bias, DP_FLOAT32, 1, bshape, devices[0]) == DP_OK &&
             api->tensor_copy_from_host(weight, p->w[l], sizeof p->w[l]) == DP_OK &&
             api->tensor_copy_from_host(bias, p->b[l], sizeof p->b[l]) == DP_OK &&
             api->module_register_parameter(linear, "weight", weight, 1) == DP_OK &&
             api->module_register_parameter(linear, "bias", bias, 1) == DP_OK;
    snprintf(child, sizeof child, "%d", 2 * l);
    ok = ok && api->module_register_module(root, child, linear) == DP_OK;
    if (ok && l < LAYERS - 1) {
      dp_module *activation = NULL;
      snprintf(child, sizeof child, "%d", 2 * l + 1);
      ok = api->module_create(&activation) == DP_OK && api->module_register_module(root, child, activation) == DP_OK;
      api->module_destroy(activation);
    }
    if (!ok) rc = fail(api, "building the model");
    api->tensor_destroy(weight);
    api->tensor_destroy(bias);
    api->module_destroy(linear);
    if (rc != 0) goto done;
  }

  int64_t batch_shape[2] = {BATCH, 2 * WIDTH};
  TRY(api->tensor_create(&input, DP_FLOAT32, 2, batch_shape, devices[0]));
  TRY(api->tensor_copy_from_host(input, rows, sizeof(float) * BATCH * 2 * WIDTH));
  TRY(api->replica_set_create(&set, root, devices, NDEVICES));
  for (int step = 0; step < STEPS; ++step) {
    dp_tensor *losses = NULL;
    float parts[NDEVICES];
    TRY(api->replica_set_sync(set));
    TRY(api->replica_set_apply(set, input, 0, devices[0], replica_step, (void *)api, &losses));
    int copied =
        api->tensor_numel(losses) == NDEVICES && api->tensor_copy_to_host(losses, parts, sizeof parts) == DP_OK;
    api->tensor_destroy(losses);
    if (!copied) {
      rc = fail(api, "reading the replicas' losses");
      goto done;
    }
    *last_loss = (double)parts[0] + (double)parts[1];
    TRY(api->module_zero_grad(root));
    TRY(api->replica_set_reduce_gradients(set));
    /* SGD on the root's parameters, in place. */
    for (int l = 0; l < LAYERS; ++l) {
      const char *names[2] = {kWeightNames[l], kBiasNames[l]};
      for (int k = 0; k < 2; ++k) {
        dp_tensor *param = NULL, *grad = NULL;
        int ok = api->module_get_parameter(root, names[k], &param) == DP_OK &&
                 api->module_grad(root, names[k], &grad) == DP_OK;
        if (ok) {
          float *pv = api->tensor_data(param);
          const float *gv = api->tensor_data(grad);
          for (int64_t i = 0; i < api->tensor_numel(param); ++i) pv[i] -= LR * gv[i];
        }
        api->tensor_destroy(param);
        api->tensor_destroy(grad);
        if (!ok) {
          rc = fail(api, "reading a parameter and its gradient");
          goto done;
        }
      }
    }
  }
  /* The trained parameters, back into p. */
  for (int l = 0; l < LAYERS; ++l) {
    dp_tensor *weight = NULL, *bias = NULL;
    int ok = api->module_get_parameter(root, kWeightNames[l], &weight) == DP_OK &&
             api->module_get_parameter(root, kBiasNames[l], &bias) == DP_OK &&
             api->tensor_copy_to_host(weight, p->w[l], sizeof p->w[l]) == DP_OK &&
             api->tensor_copy_to_host(bias, p->b[l], sizeof p->b[l]) == DP_OK;
    api->tensor_destroy(weight);
    api->tensor_destroy(bias);
    if (!ok) {
      rc = fail(api, "reading the trained parameters");
      goto done;
    }
  }
done:
  api->tensor_destroy(input);
  api->replica_set_destroy(set);
  api->module_destroy(root);
  return rc;
}

/* Largest violation of |a - b| <= ATOL + RTOL |b|, as a multiple of the
 * allowance (<= 1 passes). */
static double mismatch(const params *a, const params *b) {
  double worst = 0.0;
  const float *x = &a->w[0][0], *y = &b->w[0][0];
  for (size_t i = 0; i < sizeof(params) / sizeof(float); ++i) {
    double err = fabs((double)x[i] - (double)y[i]) / (ATOL + RTOL * fabs((double)y[i]));
    if (err > worst || isnan(err)) worst = isnan(err) ? INFINITY : err;
  }
  return worst;
}

static int load(dp_library *lib, const char *path, uint32_t major) {
  char why[1024];
  if (dp_library_open(lib, path, major, why, sizeof why) != 0) {
    fprintf(stderr, "dp-c-host: %s\n", why);
    return -1;
  }
  printf("loaded %s: ABI %u.%u, version %u\n", path, (unsigned)lib->api->abi_major, (unsigned)lib->api->abi_minor,
         (unsigned)lib->api->version_number());
  return 0;
}

static int run_once(const dp_api *api, const float *rows, const params *initial, params *trained, int round) {
  double loss = NAN;
  *trained = *initial;
  if (train_data_parallel(api, rows, trained, &loss) != 0) return -1;
  printf("round %d: data-parallel over cpu:0,cpu:1, loss after %d steps %.6f\n", round, STEPS, loss);
  return 0;
}

int main(int argc, char **argv) {
  const char *path = NULL;
  int reload = 0, next_major = 0;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--reload") == 0) {
      reload = 1;
    } else if (strcmp(argv[i], "--ask-next-major") == 0) {
      next_major = 1;
    } else if (argv[i][0] == '-' || path != NULL) {
      fprintf(stderr, "usage: dp-c-host LIBRARY [--reload | --ask-next-major]\n");
      return 2;
    } else {
      path = argv[i];
    }
  }
  if (path == NULL) {
    fprintf(stderr, "usage: dp-c-host LIBRARY [--reload | --ask-next-major]\n");
    return 2;
  }

  dp_library lib;
  if (load(&lib, path, DP_VERSION_MAJOR + (uint32_t)next_major) != 0) return 3;
  if (next_major) {
    fprintf(stderr, "dp-c-host: FAIL: the library accepted ABI major %u\n", (unsigned)(DP_VERSION_MAJOR + 1));
    dp_library_close(&lib);
    return 1;
  }

  static float rows[BATCH * 2 * WIDTH];
  static params initial, reference, first, second;
  double first_loss = NAN, last_loss = NAN;
  make_batch(rows);
  init_params(&initial, 42);
  reference = initial;
  if (train_reference(rows, &reference, &first_loss, &last_loss) != 0) {
    fprintf(stderr, "dp-c-host: out of memory\n");
    return 1;
  }
  printf("reference on one device: loss %.6f at step 1, %.6f at step %d\n", first_loss, last_loss, STEPS);
  /* The parity check means something only if training moved the model. */
  if (!(last_loss < 0.5 * first_loss)) {
    fprintf(stderr, "dp-c-host: FAIL: the reference did not learn (loss %.6f -> %.6f)\n", first_loss, last_loss);
    return 1;
  }

  int rc = run_once(lib.api, rows, &initial, &first, 1);
  if (rc == 0 && reload) {
    /* Every handle is gone: unload the library, load it again, train again. */
    dp_library_close(&lib);
    /* The library's worker threads outlive its handles; it pins itself
     * (-z nodelete) so that dlclose cannot unmap code they run. */
    void *still = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    printf("closed the library (%s)\n", still != NULL ? "it stays loaded" : "it was unloaded");
    if (still != NULL) dlclose(still);
    if (load(&lib, path, DP_VERSION_MAJOR) != 0) return 1;
    rc = run_once(lib.api, rows, &initial, &second, 2);
    if (rc == 0 && memcmp(&first, &second, sizeof first) != 0) {
      fprintf(stderr, "dp-c-host: FAIL: the run after reloading the library reached other parameters\n");
      rc = -1;
    }
  }
  dp_library_close(&lib);
  if (rc != 0) return 1;
  double worst = mismatch(&first, &reference);
  printf("parity with single-device training: worst error %.3f of the tolerance (rtol %g, atol %g)\n", worst, RTOL,
         ATOL);
  if (worst > 1.0) {
    fprintf(stderr, "dp-c-host: FAIL: data-parallel and single-device parameters differ\n");
    return 1;
  }
  printf("ok\n");
  return 0;
}
