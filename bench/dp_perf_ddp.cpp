// dp-perf ddp: what the DDP reducer adds to a training step, measured the
// way ../shared/anchors/5_ddp.sh measures PyTorch's DDP (same model, same
// modes, same report), so the two can run side by side.
//
//   dp-run -n 2 dp-perf ddp --layers 10 --width 1024 --batch 32
//   dp-run -n 2 dp-perf fsdp --layers 10 --width 1024 --batch 32
//
// Model: `layers` x Linear(width, width) with ReLU between, MSE loss, SGD
// (lr 1e-3), `batch` rows per rank of fixed random inputs and targets; the
// host's math is OpenBLAS with one thread per rank (the anchor's torch uses
// one thread per rank too). A step is forward, backward and SGD:
//   local           a plain model of this process's own (no dparallel)
//   ddp_no_sync     the DDP-wrapped model with dp_ddp_set_requires_gradient_sync(0)
//   ddp             pre_forward, forward, backward marking each layer's weight
//                   and bias ready as they are produced (last layer first, as
//                   an autograd hook would), finish_backward, SGD; with
//                   --optim-in-backward the SGD of each bucket's parameters
//                   runs in on_bucket_reduced while later buckets reduce
//   allreduce_only  dp_pg_all_reduce of one flat float32 tensor with as many
//                   elements as the model has parameters
//   fsdp            (dp-perf fsdp, or when asked for) one dp_fsdp per layer:
//                   each layer unsharded before its forward and its backward
//                   with the next one prefetched (async unshard), resharded
//                   after its forward (--reshard-after-forward 0: kept to its
//                   backward), post_backward once its backward is done, SGD
//                   on the shards; the allocator's peak in use over the timed
//                   steps against the unsharded parameters and gradients
//                   (--overlap 0: no prefetch, each post_backward waited for
//                   at once: one layer unsharded at a time; --views 1: the
//                   full parameters as views of the shards, shared memory)
//   fsdp_views      (dp-perf fsdp, or when asked for) fsdp with
//                   full_params_as_views (views on a shared-memory group,
//                   copies elsewhere), in the same run
//   --checkpoint-every N  (fsdp) the fsdp steps again, twice, with a sharded
//                   save every N steps into a temporary folder (removed at
//                   the end): dp_fsdp_save_sharded_state_dict, then
//                   dp_fsdp_save_sharded_state_dict_async (each waited for at
//                   the next save); the median of the steps that saved and
//                   of the others, each way, against the fsdp step without
//                   saves, and the copy aside (the async call's own time):
//                   an async save should cost its step no more than that
//   hsdp            (only when asked for) fsdp on the mesh by host
//                   (dp_device_mesh_create_by_host, dp_fsdp_create_on_mesh):
//                   each layer sharded over its host's ranks and replicated
//                   across the hosts, its shard gradients all-reduced between
//                   the replicas after each reduce-scatter
//   ddp_join        (only when asked for) ddp steps where the last rank runs
//                   out of data halfway and calls dp_ddp_join while the
//                   others go on: rank 0's own step times (no barrier, a
//                   joined rank takes part in none) with every rank active
//                   and with one joined, and how long dp_ddp_join took
// Each step is timed after a barrier; a step's time is the maximum over the
// ranks; the table gives the median and the minimum over the steps, and
// cpu_ms, the CPU time a step costs (this process with all its threads: the
// reducer's and Gloo's too; mean over the steps, the larger rank's). Then:
// the overhead of ddp over local in percent of the local step, the share of
// the reductions' time hidden behind the backward (dp_ddp_last_stats,
// summed over the measured ddp steps), and rank 0's resident memory before
// the DDP model's gradients and buckets exist and after, with its peak
// (VmHWM) over the warm-up, which holds the one-time bucket rebuild, and,
// reset through /proc/self/clear_refs, over the timed steps. Run once with and once without --grad-as-bucket-view to
// see the gradient copy that the view removes (a fresh process each: freed blocks stay in the library's cache, so a
// second mode in one process would reuse the first one's memory; DP_CACHE_LIMIT_MB=0 turns the cache off and leaves
// only the memory in use).
#include "dp_perf_ddp.h"

#include <cblas.h>
#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"
#include "perf_args.h"

namespace {

struct Options {
  int layers = 10;
  int64_t width = 1024;
  int64_t batch = 32;
  int steps = 41;
  int warmup = 5;
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  bool grad_as_bucket_view = false;
  bool optim_in_backward = false;  // SGD in on_bucket_reduced instead of after finish_backward
  bool static_graph = false;
  int reshard_after_forward = 1;  // fsdp: 0 keeps each layer unsharded from its forward to its backward
  // fsdp: 0 holds one layer unsharded at a time: no prefetch, and each
  // layer's reduce_scatter is waited for before the next layer's backward.
  int overlap = 1;
  int views = 0;             // fsdp: full_params_as_views
  int checkpoint_every = 0;  // fsdp: a sharded save every that many steps, sync then async (0: none)
  std::vector<std::string> modes{"local", "ddp_no_sync", "ddp", "allreduce_only"};
};

constexpr float kLearningRate = 1e-3f;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void fail_on(dp_status s, const char* what) {
  if (s != DP_OK) {
    std::fprintf(stderr, "dp-perf ddp: %s failed: %s\n", what, dp_last_error());
    std::exit(1);
  }
}

// VmRSS or VmHWM of this process, in KiB (-1 when /proc is not there).
long status_kib(const char* key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
  }
  return -1;
}

// This process's proportional set size in KiB: shared memory counted as its
// share (resident size counts every page of another rank's part of a shared
// region that it touched); -1 without /proc/self/smaps_rollup.
long pss_kib() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  for (std::string line; std::getline(rollup, line);) {
    if (line.rfind("Pss:", 0) == 0) return std::atol(line.c_str() + 4);
  }
  return -1;
}

uint64_t next_random(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float uniform(uint64_t* state, float bound) {
  double u = static_cast<double>(next_random(state) >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>((2.0 * u - 1.0) * bound);
}

// The host's half of training: forward and backward over pointers it is
// given (a plain model's arrays, or a dp_module's tensors), with scratch kept
// across steps.
class Mlp {
 public:
  Mlp(int layers, int64_t width, int64_t batch)
      : layers_(layers),
        width_(width),
        batch_(batch),
        act_(static_cast<size_t>(layers * batch * width)),
        dz_(static_cast<size_t>(batch * width)),
        da_(static_cast<size_t>(batch * width)) {}

  // Writes every layer's gradients (MSE, mean over rows and outputs); after
  // layer l's weight and bias gradients, calls ready(l) when given.
  template <typename Ready>
  void forward_backward(float* const* w, float* const* b, float* const* gw, float* const* gb, const float* x,
                        const float* y, Ready&& ready) {
    struct Marks {
      Ready& ready;
      void pre_forward(int) {}
      void post_forward(int) {}
      void pre_backward(int) {}
      void grads_done(int l) { ready(l); }
      void layer_done(int) {}
    } hooks{ready};
    forward_backward_hooked(w, b, gw, gb, x, y, hooks);
  }

  // The same, with a hook around each layer's use: pre_forward(l) and
  // pre_backward(l) before it reads w[l], b[l] (and gw[l], gb[l]), which it
  // reads only after them; post_forward(l) after its forward; grads_done(l)
  // once its gradients are written; layer_done(l) once its backward no
  // longer reads w[l].
  template <typename Hooks>
  void forward_backward_hooked(float* const* w, float* const* b, float* const* gw, float* const* gb, const float* x,
                               const float* y, Hooks& hooks) {
    const int L = layers_;
    const int n = static_cast<int>(batch_), W = static_cast<int>(width_);
    for (int l = 0; l < L; ++l) {
      hooks.pre_forward(l);
      const float* in = l == 0 ? x : out(l - 1);
      float* o = out(l);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, W, W, 1.0f, in, W, w[l], W, 0.0f, o, W);
      for (int r = 0; r < n; ++r) {
        float* row = o + static_cast<size_t>(r) * W;
        for (int j = 0; j < W; ++j) {
          float v = row[j] + b[l][j];
          row[j] = (l < L - 1 && v < 0.0f) ? 0.0f : v;
        }
      }
      hooks.post_forward(l);
    }
    const float scale = 2.0f / static_cast<float>(static_cast<int64_t>(n) * W);
    const float* pred = out(L - 1);
    float* dz = dz_.data();
    float* da = da_.data();
    for (size_t i = 0; i < static_cast<size_t>(n) * W; ++i) dz[i] = (pred[i] - y[i]) * scale;
    for (int l = L - 1; l >= 0; --l) {
      hooks.pre_backward(l);
      const float* in = l == 0 ? x : out(l - 1);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, W, W, n, 1.0f, dz, W, in, W, 0.0f, gw[l], W);
      std::fill(gb[l], gb[l] + W, 0.0f);
      for (int r = 0; r < n; ++r) {
        for (int j = 0; j < W; ++j) gb[l][j] += dz[static_cast<size_t>(r) * W + j];
      }
      hooks.grads_done(l);
      if (l == 0) {
        hooks.layer_done(l);
        break;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, W, W, 1.0f, dz, W, w[l], W, 0.0f, da, W);
      hooks.layer_done(l);
      for (size_t i = 0; i < static_cast<size_t>(n) * W; ++i) {
        if (in[i] <= 0.0f) da[i] = 0.0f;  // ReLU: `in` is its output
      }
      std::swap(dz, da);
    }
  }

 private:
  float* out(int l) { return act_.data() + static_cast<size_t>(l) * static_cast<size_t>(batch_ * width_); }

  int layers_;
  int64_t width_, batch_;
  std::vector<float> act_, dz_, da_;
};

// What on_bucket_reduced steps: parameter i (2l: layer l's weight, 2l + 1
// its bias) at params[i], its gradient at grads[i], counts[i] floats.
struct InBackward {
  std::vector<float*> params, grads;
  std::vector<int64_t> counts;
};

void sgd(float* p, const float* g, int64_t count);

int sgd_in_backward(void* user_data, dp_ddp*, size_t, const size_t* indices, size_t n) {
  auto* s = static_cast<InBackward*>(user_data);
  for (size_t i = 0; i < n; ++i) sgd(s->params[indices[i]], s->grads[indices[i]], s->counts[indices[i]]);
  return 0;
}

void sgd(float* p, const float* g, int64_t count) {
  for (int64_t i = 0; i < count; ++i) p[i] -= kLearningRate * g[i];
}

// torch.nn.Linear's default initialisation, the same on every rank.
void init_layer(uint64_t* rng, float* w, float* b, int64_t width) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(width));
  for (int64_t i = 0; i < width * width; ++i) w[i] = uniform(rng, bound);
  for (int64_t i = 0; i < width; ++i) b[i] = uniform(rng, bound);
}

struct Timing {
  double median = 0, min = 0;
  double cpu = 0;  // mean CPU time per step of this process, all its threads
};

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) * 1e-6;
}

// Median and minimum of the steps' times, each the maximum over the ranks,
// and the largest rank's mean CPU time per step.
Timing summarize(dp_process_group* pg, std::vector<double> times, double cpu) {
  times.push_back(cpu);
  int64_t n = static_cast<int64_t>(times.size());
  dp_tensor* t = nullptr;
  fail_on(dp_tensor_create(&t, DP_FLOAT64, 1, &n, dp_device{DP_DEVICE_CPU, 0}), "creating the timing tensor");
  fail_on(dp_tensor_copy_from_host(t, times.data(), times.size() * sizeof(double)), "copying the times");
  fail_on(dp_pg_all_reduce(pg, t, DP_MAX), "all_reduce MAX of the times");
  fail_on(dp_tensor_copy_to_host(t, times.data(), times.size() * sizeof(double)), "copying the times back");
  dp_tensor_destroy(t);
  cpu = times.back();
  times.pop_back();
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], times.front(), cpu};
}

// Resets this process's VmHWM to its current resident size (Linux 4.0+);
// false where that is not possible.
bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

// Runs warm-up steps, then timed steps, each after a barrier; after_warmup
// runs in between.
template <typename Step, typename AfterWarmup>
Timing measure(dp_process_group* pg, const Options& o, Step&& step, AfterWarmup&& after_warmup) {
  for (int i = 0; i < o.warmup; ++i) step(-1);
  after_warmup();
  std::vector<double> times;
  double cpu = 0;
  for (int i = 0; i < o.steps; ++i) {
    fail_on(dp_pg_barrier(pg), "barrier");
    double c0 = cpu_seconds();
    double t0 = now();
    step(i);
    times.push_back(now() - t0);
    cpu += cpu_seconds() - c0;
  }
  return summarize(pg, times, cpu / o.steps);
}

template <typename Step>
Timing measure(dp_process_group* pg, const Options& o, Step&& step) {
  return measure(pg, o, step, [] {});
}

// What every mode of one run shares: the group, the options, this rank's
// inputs and targets, the host's model, and the timings reported so far.
struct Bench {
  Bench(const Options& options, dp_process_group* group)
      : o(options),
        pg(group),
        rank(dp_process_group_rank(group)),
        world(dp_process_group_size(group)),
        L(options.layers),
        W(options.width),
        B(options.batch),
        nparams(static_cast<int64_t>(L) * (W * W + W)),
        per_layer(static_cast<size_t>(W * W + W)),
        x(static_cast<size_t>(B * W)),
        y(static_cast<size_t>(B * W)),
        mlp(L, W, B) {
    // Inputs and targets of this rank, fixed across steps (as in the anchor).
    uint64_t data_rng = 1000 + static_cast<uint64_t>(rank);
    for (float& v : x) v = uniform(&data_rng, 1.7f);
    for (float& v : y) v = uniform(&data_rng, 1.7f);
  }

  bool wants(const char* mode) const { return std::find(o.modes.begin(), o.modes.end(), mode) != o.modes.end(); }
  const Timing* find(const char* name) const {
    for (const auto& [n, t] : results) {
      if (n == name) return &t;
    }
    return nullptr;
  }
  // Keeps a mode's timing; rank 0 prints it, against the local step's.
  void report(const std::string& name, Timing t) {
    results.emplace_back(name, t);
    if (rank != 0) return;
    std::string rel(16, ' ');
    if (name != "local" && !results.empty() && results.front().first == "local") {
      char text[32];
      std::snprintf(text, sizeof text, "%+16.2f", (t.median - results.front().second.median) * 1e3);
      rel = text;
    }
    std::printf("%-15s %9.2f %9.2f %s %10.2f\n", name.c_str(), t.median * 1e3, t.min * 1e3, rel.c_str(), t.cpu * 1e3);
    std::fflush(stdout);
  }

  const Options& o;
  dp_process_group* pg;
  const int rank, world, L;
  const int64_t W, B, nparams;
  const size_t per_layer;
  std::vector<float> x, y;
  Mlp mlp;
  std::vector<std::pair<std::string, Timing>> results;
};

// What a save every N fsdp steps costs (--checkpoint-every), in ms: the
// median of the steps that saved and of the others, each the maximum over
// the ranks, sync and async, and the async call's own time (the copy aside).
struct CheckpointFigures {
  int every = 0, saves = 0;
  double shard_mib = 0;  // rank 0's file
  double sync_saving_ms = 0, sync_other_ms = 0, async_saving_ms = 0, async_other_ms = 0, copy_aside_ms = 0;
  double drain_ms = 0;  // waiting for the last async save after the last step
};

// What the fsdp modes report beside their step times.
struct FsdpFigures {
  double peak_mib = -1, rss_mib = -1, unshard_wait_ms = 0, reduce_wait_ms = 0;
  int views = 0;
  CheckpointFigures checkpoint;
};

// What the ddp modes report beside their step times.
struct DdpFigures {
  double hidden_share = -1, reduce_ms = 0, exposed_ms = 0;
  size_t num_buckets = 0;
  long rss_before = -1, hwm_warm = -1, rss_warm = -1, hwm_timed = -1, rss_after = -1;
  long pss_before = -1, pss_after = -1;
  bool peak_reset = false;
  std::vector<double> all_active, one_joined;
  double join_ms = -1;
};

// Rank 0's first lines: the run's settings and the table's head.
void print_header(const Bench& bench) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  const int rank = bench.rank, world = bench.world, L = bench.L;
  const int64_t W = bench.W, B = bench.B, nparams = bench.nparams;
  if (rank == 0) {
    std::printf(
        "# dparallel DDP/%s, world=%d, model %dxLinear(%lld,%lld) = %.2f M params (%.1f MB grads), batch=%lld/rank, "
        "BLAS threads/rank=1, steps=%d (+%d warm-up), buckets %g MB (first %g MB), gradient_as_bucket_view=%d, "
        "optim_in_backward=%d, static_graph=%d, blas=%s\n",
        dp_process_group_backend(pg), world, L, static_cast<long long>(W), static_cast<long long>(W),
        static_cast<double>(nparams) / 1e6, static_cast<double>(nparams) * 4 / 1e6, static_cast<long long>(B), o.steps,
        o.warmup, o.bucket_cap_mb, o.first_bucket_cap_mb, o.grad_as_bucket_view ? 1 : 0, o.optim_in_backward ? 1 : 0,
        o.static_graph ? 1 : 0, openblas_get_config());
    // OpenBLAS falls back to its oldest kernels on a CPU model it does not
    // know, which more than doubles the local step and so shrinks every
    // ratio below: say so, since figures are only comparable per core type.
    const std::string core = openblas_get_corename();
    if ((core == "Prescott" || core == "Core2" || core == "Nehalem") && __builtin_cpu_supports("avx2")) {
      std::printf(
          "# note: OpenBLAS chose its %s kernels on a CPU with AVX2; OPENBLAS_CORETYPE=%s picks the ones "
          "bench/RESULTS.md was measured with\n",
          core.c_str(), __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell");
    }
    std::printf("%-15s %9s %9s %16s %10s\n", "mode", "t_med_ms", "t_min_ms", "vs_local_med_ms", "cpu_ms");
    std::fflush(stdout);
  }
}

void run_local(Bench& bench) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  const int L = bench.L;
  const int64_t W = bench.W, nparams = bench.nparams;
  const size_t per_layer = bench.per_layer;
  std::vector<float>&x = bench.x, &y = bench.y;
  Mlp& mlp = bench.mlp;
  auto report = [&](const std::string& name, Timing t) { bench.report(name, t); };
  auto no_marks = [](int) {};
  // local: the host's own arrays, no dparallel call in the step.
  {
    std::vector<float> params(per_layer * L), grads(per_layer * L);
    std::vector<float*> w(L), b(L), gw(L), gb(L);
    uint64_t rng = 42;
    for (int l = 0; l < L; ++l) {
      w[l] = params.data() + per_layer * l;
      b[l] = w[l] + W * W;
      gw[l] = grads.data() + per_layer * l;
      gb[l] = gw[l] + W * W;
      init_layer(&rng, w[l], b[l], W);
    }
    report("local", measure(pg, o, [&](int) {
             mlp.forward_backward(w.data(), b.data(), gw.data(), gb.data(), x.data(), y.data(), no_marks);
             sgd(params.data(), grads.data(), nparams);
           }));
  }
}

// A folder of this run's, the same on every rank: rank 0's pid under TMPDIR.
std::string checkpoint_folder(dp_process_group* pg) {
  int64_t pid = static_cast<int64_t>(getpid()), one = 1;
  dp_tensor* t = nullptr;
  fail_on(dp_tensor_create(&t, DP_INT64, 1, &one, dp_device{DP_DEVICE_CPU, 0}), "creating the pid tensor");
  fail_on(dp_tensor_copy_from_host(t, &pid, sizeof pid), "copying the pid");
  fail_on(dp_pg_broadcast(pg, t, 0), "broadcasting rank 0's pid");
  fail_on(dp_tensor_copy_to_host(t, &pid, sizeof pid), "copying the pid back");
  dp_tensor_destroy(t);
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/dp-perf-checkpoint-" + std::to_string(pid);
}

// Every file in `folder`, then the folder (what another rank removed first is gone already).
void remove_folder(const std::string& folder) {
  if (DIR* dir = opendir(folder.c_str())) {
    std::vector<std::string> names;
    while (dirent* d = readdir(dir)) {
      if (std::strcmp(d->d_name, ".") != 0 && std::strcmp(d->d_name, "..") != 0) names.push_back(d->d_name);
    }
    closedir(dir);
    for (const std::string& name : names) std::remove((folder + "/" + name).c_str());
  }
  rmdir(folder.c_str());
}

// The fsdp step `step` again, twice, with a sharded save of `model` every
// o.checkpoint_every steps: synchronous, then in the background (each
// waited for at the next save, as a host that keeps one in flight would).
CheckpointFigures measure_checkpoints(Bench& bench, dp_module* model, const std::function<void(int)>& step) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  CheckpointFigures figures;
  figures.every = o.checkpoint_every;
  const std::string root = checkpoint_folder(pg);
  if (mkdir(root.c_str(), 0777) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "dp-perf fsdp: cannot make %s: %s\n", root.c_str(), std::strerror(errno));
    std::exit(1);
  }
  const std::string sync_folder = root + "/sync", async_folder = root + "/async";
  std::vector<double> copies;
  auto run = [&](bool async, double* saving_ms, double* other_ms) {
    const std::string& folder = async ? async_folder : sync_folder;
    dp_work* pending = nullptr;
    auto save = [&] {
      if (!async) {
        fail_on(dp_fsdp_save_sharded_state_dict(model, pg, folder.c_str()), "dp_fsdp_save_sharded_state_dict");
        return;
      }
      if (pending != nullptr) {
        fail_on(dp_work_wait(pending), "the background save");
        dp_work_destroy(pending);
        pending = nullptr;
      }
      const double t0 = now();
      fail_on(dp_fsdp_save_sharded_state_dict_async(model, pg, folder.c_str(), &pending),
              "dp_fsdp_save_sharded_state_dict_async");
      copies.push_back(now() - t0);
    };
    save();  // warm-up: the folder made, the first files written
    copies.clear();
    std::vector<double> saving, other;
    for (int i = 0; i < o.steps; ++i) {
      fail_on(dp_pg_barrier(pg), "barrier");
      const double t0 = now();
      step(i);
      const bool saves = (i + 1) % o.checkpoint_every == 0;
      if (saves) save();
      (saves ? saving : other).push_back(now() - t0);
    }
    const double t0 = now();
    if (pending != nullptr) {
      fail_on(dp_work_wait(pending), "the last background save");
      dp_work_destroy(pending);
    }
    if (async) figures.drain_ms = (now() - t0) * 1e3;
    figures.saves = static_cast<int>(saving.size());
    *saving_ms = saving.empty() ? 0 : summarize(pg, saving, 0).median * 1e3;
    *other_ms = other.empty() ? 0 : summarize(pg, other, 0).median * 1e3;
  };
  run(false, &figures.sync_saving_ms, &figures.sync_other_ms);
  run(true, &figures.async_saving_ms, &figures.async_other_ms);
  if (!copies.empty()) figures.copy_aside_ms = summarize(pg, copies, 0).median * 1e3;
  if (bench.rank == 0) {
    struct stat info {};
    char name[64];
    std::snprintf(name, sizeof name, "/shard-%05d-of-%05d-", 0, bench.world);
    if (DIR* dir = opendir(sync_folder.c_str())) {
      while (dirent* d = readdir(dir)) {
        const std::string path = sync_folder + "/" + d->d_name;
        if (std::strncmp(d->d_name, name + 1, std::strlen(name + 1)) == 0 && stat(path.c_str(), &info) == 0) {
          figures.shard_mib = static_cast<double>(info.st_size) / 1048576.0;
        }
      }
      closedir(dir);
    }
  }
  fail_on(dp_pg_barrier(pg), "barrier");
  remove_folder(sync_folder);
  remove_folder(async_folder);
  remove_folder(root);
  return figures;
}

// fsdp: one dp_fsdp per layer, the host unsharding each layer before its
// forward and backward with the next one prefetched, resharding after its
// forward, post_backward once its backward is done, SGD on the shards.
// The initial weights are the host's (from_blob) and freed once sharded,
// as a host that loads a checkpoint would; the resident peak over the
// timed steps, less the resident size before the model, is what the
// sharded model costs this rank.
std::vector<std::pair<std::string, FsdpFigures>> run_fsdp_modes(Bench& bench) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  const int L = bench.L;
  const int64_t W = bench.W;
  std::vector<float>&x = bench.x, &y = bench.y;
  Mlp& mlp = bench.mlp;
  auto wants = [&](const char* mode) { return bench.wants(mode); };
  auto report = [&](const std::string& name, Timing t) { bench.report(name, t); };
  std::vector<std::pair<std::string, FsdpFigures>> fsdp_figures;
  auto run_fsdp = [&](const char* mode, int views, bool on_mesh_by_host) {
    FsdpFigures figures;
    figures.views = views;
    const dp_device cpu0{DP_DEVICE_CPU, 0};
    auto allocated = [&](bool peak) {
      dp_memory_stats stats{};
      stats.struct_size = sizeof stats;
      fail_on(dp_device_memory_stats(cpu0, &stats), "dp_device_memory_stats");
      return static_cast<double>(peak ? stats.peak_allocated_bytes : stats.allocated_bytes);
    };
    const double in_use_before = allocated(false);
    const long rss_model = status_kib("VmRSS:");
    std::vector<std::vector<float>> host_weights(static_cast<size_t>(2 * L));
    dp_module* model = nullptr;
    fail_on(dp_module_create(&model), "dp_module_create");
    std::vector<dp_module*> layers(L);
    uint64_t rng = 42;
    for (int l = 0; l < L; ++l) {
      std::vector<float>& wv = host_weights[2 * l];
      std::vector<float>& bv = host_weights[2 * l + 1];
      wv.resize(static_cast<size_t>(W * W));
      bv.resize(static_cast<size_t>(W));
      init_layer(&rng, wv.data(), bv.data(), W);
      int64_t wshape[2] = {W, W};
      dp_tensor *weight = nullptr, *bias = nullptr;
      fail_on(dp_module_create(&layers[l]), "dp_module_create");
      fail_on(
          dp_tensor_from_blob(&weight, wv.data(), DP_FLOAT32, 2, wshape, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr),
          "dp_tensor_from_blob");
      fail_on(dp_tensor_from_blob(&bias, bv.data(), DP_FLOAT32, 1, &W, dp_device{DP_DEVICE_CPU, 0}, nullptr, nullptr),
              "dp_tensor_from_blob");
      fail_on(dp_module_register_parameter(layers[l], "weight", weight, 1), "registering a weight");
      fail_on(dp_module_register_parameter(layers[l], "bias", bias, 1), "registering a bias");
      fail_on(dp_module_register_module(model, std::to_string(2 * l).c_str(), layers[l]), "registering a layer");
      dp_tensor_destroy(weight);
      dp_tensor_destroy(bias);
    }
    std::vector<dp_fsdp*> fsdp(L);
    dp_fsdp_options fopts;
    fail_on(dp_fsdp_options_init(&fopts, sizeof fopts), "dp_fsdp_options_init");
    fopts.reshard_after_forward = o.reshard_after_forward;
    fopts.full_params_as_views = views;
    if (on_mesh_by_host) {
      dp_device_mesh* mesh = nullptr;
      fail_on(dp_device_mesh_create_by_host(&mesh, pg), "dp_device_mesh_create_by_host");
      for (int l = 0; l < L; ++l) {
        const dp_status st = dp_fsdp_create_on_mesh(&fsdp[l], layers[l], mesh, &fopts);
        if (st != DP_OK) dp_device_mesh_destroy(mesh);
        fail_on(st, "dp_fsdp_create_on_mesh");
      }
      dp_device_mesh_destroy(mesh);  // the dp_fsdps hold its groups
    } else {
      for (int l = 0; l < L; ++l) fail_on(dp_fsdp_create(&fsdp[l], layers[l], pg, &fopts), "dp_fsdp_create");
    }
    host_weights = {};  // the slots hold the shards now
    std::vector<float*> w(L), b(L), gw(L), gb(L);
    // Time the host spends waiting for unshards (blocking or completing a
    // prefetch) and for the reduce-scatters, summed over the timed steps.
    struct Waits {
      double unshard = 0, reduce = 0;
    } fsdp_waits;
    auto tensor_data = [](dp_tensor* t) {
      auto* data = static_cast<float*>(dp_tensor_data(t));
      dp_tensor_destroy(t);  // the module keeps it alive
      return data;
    };
    auto fetch_full = [&](int l, bool grads) {
      dp_tensor* t = nullptr;
      fail_on(dp_module_get_parameter(layers[l], "weight", &t), "dp_module_get_parameter");
      w[l] = tensor_data(t);
      fail_on(dp_module_get_parameter(layers[l], "bias", &t), "dp_module_get_parameter");
      b[l] = tensor_data(t);
      if (!grads) return;
      fail_on(dp_module_grad(layers[l], "weight", &t), "dp_module_grad");
      gw[l] = tensor_data(t);
      fail_on(dp_module_grad(layers[l], "bias", &t), "dp_module_grad");
      gb[l] = tensor_data(t);
    };
    struct Hooks {
      std::vector<dp_fsdp*>& fsdp;
      std::function<void(int, bool)> fetch;
      int layers;
      bool overlap;
      Waits* waits;
      void wait_for(dp_fsdp* f, bool blocking) {
        const double t0 = now();
        fail_on(blocking ? dp_fsdp_unshard(f, 0) : dp_fsdp_wait_unshard(f), "unshard");
        waits->unshard += now() - t0;
      }
      void pre_forward(int l) {
        wait_for(fsdp[l], l == 0 || !overlap);
        if (overlap && l + 1 < layers) fail_on(dp_fsdp_unshard(fsdp[l + 1], 1), "prefetch");
        fetch(l, false);
      }
      void post_forward(int l) { fail_on(dp_fsdp_reshard(fsdp[l]), "dp_fsdp_reshard"); }
      void pre_backward(int l) {
        wait_for(fsdp[l], l == layers - 1 || !overlap);
        if (overlap && l > 0) fail_on(dp_fsdp_unshard(fsdp[l - 1], 1), "prefetch");
        fetch(l, true);
      }
      void grads_done(int) {}
      void layer_done(int l) {
        fail_on(dp_fsdp_post_backward(fsdp[l]), "dp_fsdp_post_backward");
        if (overlap) return;
        const double t0 = now();
        fail_on(dp_fsdp_finish_backward(fsdp[l]), "dp_fsdp_finish_backward");
        waits->reduce += now() - t0;
      }
    } hooks{fsdp, fetch_full, L, o.overlap != 0, &fsdp_waits};
    auto fsdp_step = [&](int timed) {
      if (timed == 0) fsdp_waits = Waits{};
      mlp.forward_backward_hooked(w.data(), b.data(), gw.data(), gb.data(), x.data(), y.data(), hooks);
      for (int l = 0; l < L; ++l) {
        const double t0 = now();
        fail_on(dp_fsdp_finish_backward(fsdp[l]), "dp_fsdp_finish_backward");
        fsdp_waits.reduce += now() - t0;
        for (size_t i = 0; i < 2; ++i) {
          dp_tensor *p = nullptr, *g = nullptr;
          fail_on(dp_fsdp_shard(fsdp[l], i, &p), "dp_fsdp_shard");
          fail_on(dp_fsdp_shard_grad(fsdp[l], i, &g), "dp_fsdp_shard_grad");
          const int64_t count = dp_tensor_numel(p);
          sgd(tensor_data(p), tensor_data(g), count);
        }
      }
      fail_on(dp_module_zero_grad(model), "dp_module_zero_grad");
    };
    report(mode, measure(pg, o, fsdp_step, [&] {
             reset_peak();
             fail_on(dp_device_reset_peak_memory(cpu0), "dp_device_reset_peak_memory");
           }));
    figures.peak_mib = (allocated(true) - in_use_before) / 1048576.0;
    figures.unshard_wait_ms = fsdp_waits.unshard * 1e3 / o.steps;
    figures.reduce_wait_ms = fsdp_waits.reduce * 1e3 / o.steps;
    figures.rss_mib = static_cast<double>(status_kib("VmHWM:") - rss_model) / 1024.0;
    // After the figures above: the saves' steps would count in them.
    if (o.checkpoint_every > 0 && std::strcmp(mode, "fsdp") == 0) {
      figures.checkpoint = measure_checkpoints(bench, model, fsdp_step);
    }
    for (dp_fsdp* f : fsdp) dp_fsdp_destroy(f);
    for (dp_module* m : layers) dp_module_destroy(m);
    dp_module_destroy(model);
    fsdp_figures.emplace_back(mode, figures);
  };
  if (wants("fsdp")) run_fsdp("fsdp", o.views, false);
  if (wants("fsdp_views")) run_fsdp("fsdp_views", 1, false);
  if (wants("hsdp")) run_fsdp("hsdp", o.views, true);
  return fsdp_figures;
}

// The DDP model: a dp_module whose parameters are library tensors; its
// gradients are left to the reducer (with gradient_as_bucket_view they are
// views into the buckets and never allocated on their own).
DdpFigures run_ddp_modes(Bench& bench) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  const int L = bench.L;
  const int64_t W = bench.W;
  std::vector<float>&x = bench.x, &y = bench.y;
  Mlp& mlp = bench.mlp;
  auto wants = [&](const char* mode) { return bench.wants(mode); };
  auto report = [&](const std::string& name, Timing t) { bench.report(name, t); };
  const int rank = bench.rank, world = bench.world;
  double hidden_share = -1, reduce_ms = 0, exposed_ms = 0;
  size_t num_buckets = 0;
  // Resident size before dp_ddp_create; peak and resident size after the
  // ddp warm-up (which holds the one-time bucket rebuild: old and new
  // buckets at once); peak over the timed ddp steps; resident size after.
  long rss_before = -1, hwm_warm = -1, rss_warm = -1, hwm_timed = -1, rss_after = -1;
  long pss_before = -1, pss_after = -1;  // shared memory as this rank's share
  bool peak_reset = false;
  // ddp_join: rank 0's step times with every rank active, then with the
  // last rank joined; how long rank 0's dp_ddp_join took.
  std::vector<double> all_active, one_joined;
  double join_ms = -1;
  if (wants("ddp_no_sync") || wants("ddp") || wants("ddp_join")) {
    dp_module* model = nullptr;
    fail_on(dp_module_create(&model), "dp_module_create");
    std::vector<std::string> names;
    uint64_t rng = 42;
    for (int l = 0; l < L; ++l) {
      dp_module* linear = nullptr;
      dp_tensor *weight = nullptr, *bias = nullptr;
      int64_t wshape[2] = {W, W};
      fail_on(dp_module_create(&linear), "dp_module_create");
      fail_on(dp_tensor_create(&weight, DP_FLOAT32, 2, wshape, dp_device{DP_DEVICE_CPU, 0}), "dp_tensor_create");
      fail_on(dp_tensor_create(&bias, DP_FLOAT32, 1, &W, dp_device{DP_DEVICE_CPU, 0}), "dp_tensor_create");
      init_layer(&rng, static_cast<float*>(dp_tensor_data(weight)), static_cast<float*>(dp_tensor_data(bias)), W);
      fail_on(dp_module_register_parameter(linear, "weight", weight, 1), "registering a weight");
      fail_on(dp_module_register_parameter(linear, "bias", bias, 1), "registering a bias");
      fail_on(dp_module_register_module(model, std::to_string(2 * l).c_str(), linear), "registering a layer");
      if (l < L - 1) {
        dp_module* relu = nullptr;
        fail_on(dp_module_create(&relu), "dp_module_create");
        fail_on(dp_module_register_module(model, std::to_string(2 * l + 1).c_str(), relu), "registering a ReLU");
        dp_module_destroy(relu);
      }
      names.push_back(std::to_string(2 * l) + ".weight");
      names.push_back(std::to_string(2 * l) + ".bias");
      dp_tensor_destroy(weight);
      dp_tensor_destroy(bias);
      dp_module_destroy(linear);
    }
    rss_before = status_kib("VmRSS:");
    pss_before = pss_kib();
    dp_ddp_options dopts;
    fail_on(dp_ddp_options_init(&dopts, sizeof dopts), "dp_ddp_options_init");
    dopts.bucket_cap_mb = o.bucket_cap_mb;
    dopts.first_bucket_cap_mb = o.first_bucket_cap_mb;
    dopts.gradient_as_bucket_view = o.grad_as_bucket_view ? 1 : 0;
    dopts.static_graph = o.static_graph ? 1 : 0;
    InBackward in_backward;
    in_backward.params.resize(names.size());
    in_backward.grads.resize(names.size());
    in_backward.counts.resize(names.size());
    if (o.optim_in_backward) {
      dopts.on_bucket_reduced = sgd_in_backward;
      dopts.on_bucket_reduced_data = &in_backward;
    }
    dp_ddp* ddp = nullptr;
    fail_on(dp_ddp_create(&ddp, model, pg, &dopts), "dp_ddp_create");

    std::vector<float*> w(L), b(L), gw(L), gb(L);
    // Fetched every step: with gradient_as_bucket_view the gradients move
    // into the rebuilt buckets after the first synced step.
    auto fetch = [&] {
      for (size_t i = 0; i < names.size(); ++i) {
        dp_tensor *p = nullptr, *g = nullptr;
        fail_on(dp_module_get_parameter(model, names[i].c_str(), &p), "dp_module_get_parameter");
        fail_on(dp_module_grad(model, names[i].c_str(), &g), "dp_module_grad");
        (i % 2 == 0 ? w : b)[i / 2] = static_cast<float*>(dp_tensor_data(p));
        (i % 2 == 0 ? gw : gb)[i / 2] = static_cast<float*>(dp_tensor_data(g));
        in_backward.params[i] = static_cast<float*>(dp_tensor_data(p));
        in_backward.grads[i] = static_cast<float*>(dp_tensor_data(g));
        in_backward.counts[i] = dp_tensor_numel(p);
        dp_tensor_destroy(p);  // the module keeps both alive
        dp_tensor_destroy(g);
      }
    };
    // Managed index of layer l's weight is 2l, its bias 2l + 1.
    auto mark = [&](int l) {
      fail_on(dp_ddp_mark_grad_ready_index(ddp, static_cast<size_t>(2 * l)), "dp_ddp_mark_grad_ready_index");
      fail_on(dp_ddp_mark_grad_ready_index(ddp, static_cast<size_t>(2 * l + 1)), "dp_ddp_mark_grad_ready_index");
    };
    double reduce_sum = 0, exposed_sum = 0;
    int requires_sync = 1;
    auto ddp_step = [&](int timed) {
      fail_on(dp_ddp_pre_forward(ddp), "dp_ddp_pre_forward");
      fetch();
      mlp.forward_backward(w.data(), b.data(), gw.data(), gb.data(), x.data(), y.data(), mark);
      fail_on(dp_ddp_finish_backward(ddp), "dp_ddp_finish_backward");
      fetch();
      // In a no_sync step no bucket is reported: the host steps as usual.
      if (!o.optim_in_backward || requires_sync == 0) {
        for (int l = 0; l < L; ++l) {
          sgd(w[l], gw[l], W * W);
          sgd(b[l], gb[l], W);
        }
      }
      if (timed >= 0) {
        dp_ddp_stats stats{};
        stats.struct_size = sizeof stats;
        fail_on(dp_ddp_last_stats(ddp, &stats), "dp_ddp_last_stats");
        reduce_sum += stats.reduce_ms;
        exposed_sum += stats.exposed_ms;
        num_buckets = stats.num_buckets;
      }
    };
    if (wants("ddp_no_sync")) {
      fail_on(dp_ddp_set_requires_gradient_sync(ddp, 0), "dp_ddp_set_requires_gradient_sync");
      requires_sync = 0;
      report("ddp_no_sync", measure(pg, o, ddp_step));
      fail_on(dp_ddp_set_requires_gradient_sync(ddp, 1), "dp_ddp_set_requires_gradient_sync");
      requires_sync = 1;
    }
    if (wants("ddp")) {
      reduce_sum = exposed_sum = 0;
      report("ddp", measure(pg, o, ddp_step, [&] {
               hwm_warm = status_kib("VmHWM:");
               rss_warm = status_kib("VmRSS:");
               peak_reset = reset_peak();
             }));
      hwm_timed = status_kib("VmHWM:");
      reduce_ms = reduce_sum / o.steps;
      exposed_ms = exposed_sum / o.steps;
      hidden_share = reduce_sum > 0 ? 1.0 - exposed_sum / reduce_sum : 0.0;
    }
    if (wants("ddp_join")) {
      for (int i = 0; i < o.warmup; ++i) ddp_step(-1);
      fail_on(dp_pg_barrier(pg), "barrier");
      const int half = o.steps / 2;
      const int mine = world > 1 && rank == world - 1 ? half : o.steps;
      for (int i = 0; i < mine; ++i) {
        const double t0 = now();
        ddp_step(-1);
        (i < half ? all_active : one_joined).push_back(now() - t0);
      }
      const double j0 = now();
      fail_on(dp_ddp_join(&ddp, 1), "dp_ddp_join");
      join_ms = (now() - j0) * 1e3;
    }
    rss_after = status_kib("VmRSS:");
    pss_after = pss_kib();
    dp_ddp_destroy(ddp);
    dp_module_destroy(model);
  }

  return DdpFigures{hidden_share, reduce_ms,  exposed_ms, num_buckets, rss_before, hwm_warm,   rss_warm, hwm_timed,
                    rss_after,    pss_before, pss_after,  peak_reset,  all_active, one_joined, join_ms};
}

void run_allreduce_only(Bench& bench) {
  const Options& o = bench.o;
  dp_process_group* pg = bench.pg;
  const int64_t nparams = bench.nparams;
  auto report = [&](const std::string& name, Timing t) { bench.report(name, t); };
  {
    dp_tensor* flat = nullptr;
    fail_on(dp_tensor_create(&flat, DP_FLOAT32, 1, &nparams, dp_device{DP_DEVICE_CPU, 0}), "dp_tensor_create");
    report("allreduce_only", measure(pg, o, [&](int) { fail_on(dp_pg_all_reduce(pg, flat, DP_SUM), "all_reduce"); }));
    dp_tensor_destroy(flat);
  }
}

// Rank 0's closing lines: overheads, memory and waits, from every mode's figures.
void print_summary(const Bench& bench, const std::vector<std::pair<std::string, FsdpFigures>>& fsdp_figures,
                   const DdpFigures& ddp_figures) {
  const Options& o = bench.o;
  const int rank = bench.rank, world = bench.world;
  const int64_t nparams = bench.nparams;
  const double hidden_share = ddp_figures.hidden_share, reduce_ms = ddp_figures.reduce_ms,
               exposed_ms = ddp_figures.exposed_ms, join_ms = ddp_figures.join_ms;
  const size_t num_buckets = ddp_figures.num_buckets;
  const long rss_before = ddp_figures.rss_before, hwm_warm = ddp_figures.hwm_warm, rss_warm = ddp_figures.rss_warm,
             hwm_timed = ddp_figures.hwm_timed, rss_after = ddp_figures.rss_after, pss_before = ddp_figures.pss_before,
             pss_after = ddp_figures.pss_after;
  const bool peak_reset = ddp_figures.peak_reset;
  const std::vector<double>&all_active = ddp_figures.all_active, &one_joined = ddp_figures.one_joined;
  if (rank == 0) {
    auto find = [&](const char* name) { return bench.find(name); };
    const Timing *local = find("local"), *no_sync = find("ddp_no_sync"), *ddp = find("ddp"),
                 *flat = find("allreduce_only");
    if (local != nullptr && ddp != nullptr) {
      const double l = local->median, d = ddp->median;
      std::printf("# comm overhead (median): ddp - local = %.2f ms (%.1f%% of local step)", (d - l) * 1e3,
                  (d / l - 1) * 100);
      if (no_sync != nullptr) {
        std::printf("; ddp - ddp_no_sync = %.2f ms; ddp_no_sync - local = %.2f ms", (d - no_sync->median) * 1e3,
                    (no_sync->median - l) * 1e3);
      }
      std::printf("\n");
    }
    if (flat != nullptr && ddp != nullptr && no_sync != nullptr) {
      std::printf("# flat all_reduce of all grads alone = %.2f ms; exposed share of it in ddp = %.0f%%\n",
                  flat->median * 1e3, (ddp->median - no_sync->median) / flat->median * 100);
    }
    if (join_ms >= 0 && !all_active.empty()) {
      auto median = [](std::vector<double> v) {
        if (v.empty()) return 0.0;
        std::sort(v.begin(), v.end());
        return v[v.size() / 2] * 1e3;
      };
      const double active = median(all_active), joined = median(one_joined);
      std::printf("# join (rank 0's own step times, median, no barrier): every rank active %.2f ms", active);
      if (!one_joined.empty()) {
        std::printf("; rank %d joined %.2f ms (%+.1f%%)", world - 1, joined, (joined / active - 1) * 100);
      }
      std::printf("; rank 0's dp_ddp_join returned after %.2f ms\n", join_ms);
    }
    for (const auto& [mode, figures] : fsdp_figures) {
      const Timing* fsdp = find(mode.c_str());
      const double unsharded = static_cast<double>(nparams) * 2 * 4 / 1048576.0;
      std::printf(
          "# %s memory: %.1f MiB of parameters+gradients per rank vs %.1f MiB unsharded (ratio %.2f): rank 0's "
          "allocator peak in use over the timed %s steps (shards, their gradients, and what the layers unsharded "
          "at once hold) against the unsharded parameters and gradients; its resident peak grew %.1f MiB (freed "
          "blocks stay cached, DP_CACHE_LIMIT_MB=%s)\n",
          mode.c_str(), figures.peak_mib, unsharded, figures.peak_mib / unsharded, mode.c_str(), figures.rss_mib,
          std::getenv("DP_CACHE_LIMIT_MB") != nullptr ? std::getenv("DP_CACHE_LIMIT_MB") : "default");
      if (fsdp != nullptr && ddp != nullptr) {
        std::printf(
            "# %s step: %.2f ms vs ddp %.2f ms (ratio %.2f; reshard_after_forward=%d, %s, full_params_as_views=%d)\n",
            mode.c_str(), fsdp->median * 1e3, ddp->median * 1e3, fsdp->median / ddp->median, o.reshard_after_forward,
            o.overlap != 0 ? "next layer prefetched" : "one layer unsharded at a time, reduce_scatters waited",
            figures.views);
      }
      std::printf(
          "# %s waits (rank 0, mean per timed step): %.2f ms for unshards (blocking, or a prefetch not yet done), "
          "%.2f ms in dp_fsdp_finish_backward\n",
          mode.c_str(), figures.unshard_wait_ms, figures.reduce_wait_ms);
      const CheckpointFigures& c = figures.checkpoint;
      if (c.every > 0 && fsdp != nullptr) {
        std::printf(
            "# %s checkpoint every %d steps (%d saves, rank 0's file %.2f MiB): step median without saves %.2f ms; "
            "steps that saved: sync %.2f ms, async %.2f ms (copy aside %.2f ms); the other steps: sync %.2f ms, "
            "async %.2f ms; async save over a plain step %+.2f ms vs copy aside %.2f ms; last async save waited "
            "%.2f ms after the last step\n",
            mode.c_str(), c.every, c.saves, c.shard_mib, fsdp->median * 1e3, c.sync_saving_ms, c.async_saving_ms,
            c.copy_aside_ms, c.sync_other_ms, c.async_other_ms, c.async_saving_ms - fsdp->median * 1e3, c.copy_aside_ms,
            c.drain_ms);
      }
    }
    if (hidden_share >= 0) {
      std::printf(
          "# reducer (dp_ddp_last_stats, mean over the timed ddp steps, rank 0): reductions %.2f ms, %.2f ms of it "
          "exposed in finish_backward: %.0f%% hidden behind the backward; %zu buckets\n",
          reduce_ms, exposed_ms, hidden_share * 100, num_buckets);
    }
    if (rss_before >= 0 && rss_warm >= 0) {
      // Freed blocks stay resident in the library's cache (up to
      // DP_CACHE_LIMIT_MB, default 1024): 0 shows what is in use.
      const char* cache = std::getenv("DP_CACHE_LIMIT_MB");
      auto mib = [](long kib) { return static_cast<double>(kib) / 1024.0; };
      std::printf(
          "# memory (rank 0, gradient_as_bucket_view=%d, DP_CACHE_LIMIT_MB=%s; the gradients are %.1f MiB): "
          "resident %.1f MiB before dp_ddp_create; after the ddp warm-up %.1f MiB (%+.1f), its peak %.1f MiB (%+.1f, "
          "the one-time bucket rebuild included)",
          o.grad_as_bucket_view ? 1 : 0, cache != nullptr && *cache != '\0' ? cache : "default",
          static_cast<double>(nparams) * 4 / 1048576.0, mib(rss_before), mib(rss_warm), mib(rss_warm - rss_before),
          mib(hwm_warm), mib(hwm_warm - rss_before));
      if (peak_reset && hwm_timed >= 0) {
        std::printf("; peak over the timed ddp steps %.1f MiB (%+.1f)", mib(hwm_timed), mib(hwm_timed - rss_before));
      }
      std::printf("; resident at the end %.1f MiB (%+.1f)", mib(rss_after), mib(rss_after - rss_before));
      if (pss_before >= 0 && pss_after >= 0) {
        std::printf("; proportional set size %.1f MiB before, %.1f MiB (%+.1f) at the end", mib(pss_before),
                    mib(pss_after), mib(pss_after - pss_before));
      }
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}

int run(const Options& o) {
  dp_process_group* pg = nullptr;
  fail_on(dp_process_group_create_from_env(&pg, nullptr), "joining the process group (run it under dp-run)");
  openblas_set_num_threads(1);
  Bench b(o, pg);
  print_header(b);
  if (b.wants("local")) run_local(b);
  const auto fsdp_figures = run_fsdp_modes(b);
  const DdpFigures ddp_figures = run_ddp_modes(b);
  if (b.wants("allreduce_only")) run_allreduce_only(b);
  print_summary(b, fsdp_figures, ddp_figures);
  fail_on(dp_pg_barrier(pg), "final barrier");
  dp_process_group_destroy(pg);
  return 0;
}

}  // namespace

int dp_perf_ddp_main(int argc, char** argv) {
  static const char kModeList[] =
      "a comma-separated list of local, ddp_no_sync, ddp, allreduce_only, ddp_join, fsdp, fsdp_views, hsdp";
  Options o;
  // dp-perf fsdp: the same model sharded, with copies and with views of the
  // shards, beside the local and ddp steps.
  if (argc > 0 && std::string(argv[0]) == "fsdp") o.modes = {"local", "fsdp", "fsdp_views", "ddp"};
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--grad-as-bucket-view") {
        o.grad_as_bucket_view = true;
        continue;
      }
      if (a == "--optim-in-backward") {
        o.optim_in_backward = true;
        continue;
      }
      if (a == "--static-graph") {
        o.static_graph = true;
        continue;
      }
      if (i + 1 >= argc) throw perf::UsageError("option " + a + " needs a value");
      const std::string v = argv[++i];
      if (a == "--layers") {
        o.layers = static_cast<int>(perf::parse_int(a, v, 1, 1000));
      } else if (a == "--width") {
        o.width = perf::parse_int(a, v, 1, 16384);
      } else if (a == "--batch") {
        o.batch = perf::parse_int(a, v, 1, 1 << 20);
      } else if (a == "--steps") {
        o.steps = static_cast<int>(perf::parse_int(a, v, 1, 100000));
      } else if (a == "--reshard-after-forward") {
        o.reshard_after_forward = static_cast<int>(perf::parse_int(a, v, 0, 1));
      } else if (a == "--overlap") {
        o.overlap = static_cast<int>(perf::parse_int(a, v, 0, 1));
      } else if (a == "--views") {
        o.views = static_cast<int>(perf::parse_int(a, v, 0, 1));
      } else if (a == "--checkpoint-every") {
        o.checkpoint_every = static_cast<int>(perf::parse_int(a, v, 0, 100000));
      } else if (a == "--warmup") {
        o.warmup = static_cast<int>(perf::parse_int(a, v, 0, 100000));
      } else if (a == "--bucket-cap-mb" || a == "--first-bucket-cap-mb") {
        char* end = nullptr;
        double mb = std::strtod(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0' || !std::isfinite(mb) || mb <= 0 || mb > 1048576) {
          perf::bad_value(a, v, "a number of MB above 0 and at most 1048576");
        }
        (a == "--bucket-cap-mb" ? o.bucket_cap_mb : o.first_bucket_cap_mb) = mb;
      } else if (a == "--modes") {
        o.modes.clear();
        std::stringstream list(v);
        for (std::string mode; std::getline(list, mode, ',');) {
          if (mode != "local" && mode != "ddp_no_sync" && mode != "ddp" && mode != "allreduce_only" &&
              mode != "ddp_join" && mode != "fsdp" && mode != "fsdp_views" && mode != "hsdp") {
            perf::bad_value(a, v, kModeList);
          }
          o.modes.push_back(mode);
        }
        if (o.modes.empty()) perf::bad_value(a, v, kModeList);
      } else {
        throw perf::UsageError("unknown option " + a);
      }
    }
    // Per rank: the local model and the DDP model (parameters, gradients,
    // buckets, rebuilt buckets: 6 model-sized buffers), for every rank here.
    const char* local_ranks_text = std::getenv("LOCAL_WORLD_SIZE");
    const long local_ranks = local_ranks_text != nullptr ? std::max(1L, std::atol(local_ranks_text)) : 1;
    const double model_bytes = 4.0 * static_cast<double>(o.layers) * static_cast<double>(o.width * o.width + o.width);
    const double act_bytes =
        4.0 * static_cast<double>(o.layers + 2) * static_cast<double>(o.batch) * static_cast<double>(o.width);
    perf::check_fits("this model on " + std::to_string(local_ranks) + " local rank(s)",
                     (8 * model_bytes + act_bytes) * static_cast<double>(local_ranks));
  } catch (const perf::UsageError& e) {
    std::fprintf(stderr, "dp-perf ddp: %s\n", e.what());
    std::fprintf(stderr,
                 "usage: dp-run -n 2 dp-perf ddp [--layers 10] [--width 1024] [--batch 32] [--steps 41] [--warmup 5]\n"
                 "       [--bucket-cap-mb 25] [--first-bucket-cap-mb 1] [--grad-as-bucket-view]\n"
                 "       [--optim-in-backward] [--static-graph]\n"
                 "       [--modes local,ddp_no_sync,ddp,allreduce_only,ddp_join,fsdp,fsdp_views,hsdp]\n"
                 "usage: dp-run -n 2 dp-perf fsdp [the same options] [--reshard-after-forward 1] [--overlap 1] "
                 "[--views 0] [--checkpoint-every 0]: --modes "
                 "local,fsdp,fsdp_views,ddp\n");
    return 2;
  }
  try {
    return run(o);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "dp-perf ddp: out of memory; a smaller --width or --layers needs less\n");
    return 1;
  }
}
