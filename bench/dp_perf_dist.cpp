// Options (nccl-tests names): -b min bytes, -e max bytes, -f factor, -d dtype,
// -o reduce op, -r root, -n ops per sample (default: 256 MiB / size, 1..200),
// -s samples (21), -w warm-up ops (default max(2, n/10)), -c 0 to skip the
// check, --device cpu|cuda (default cpu; cuda puts each rank on cuda:LOCAL_RANK
// and uses NCCL), --backend auto|gloo|shm|mpi|nccl (default auto). Sizes take K/M/G suffixes (KiB...). For all_gather
// and reduce_scatter the size is the whole gathered or scattered buffer, as in nccl-tests. Time: per sample, a barrier
// then n back-to-back ops; per-op time is the sample's time / n, the maximum over ranks; the table gives the median
// over samples (and the best busbw). #wrong counts elements of the checked first op that differ from the expected
// result. Exit codes: 0 all right, 1 wrong results or a failed call, 2 bad usage (a bad option value, or sizes whose
// buffers do not fit in the memory this machine has free).
#include "dp_perf_dist.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "dparallel/dparallel.h"
#include "perf_args.h"
#include "perf_values.h"

namespace {

struct Options {
  size_t min_bytes = 4 << 10;
  size_t max_bytes = 64 << 20;
  double factor = 4;
  int32_t dtype = DP_FLOAT32;
  int32_t op = DP_SUM;
  int32_t root = 0;
  long ops = 0;
  int samples = 21;
  long warmup = -1;
  bool check = true;
  int32_t device_type = DP_DEVICE_CPU;
  int32_t backend = DP_BACKEND_AUTO;
};

int32_t parse_dtype(const std::string& s) {
  const char* names[] = {"float", "double", "half", "bfloat16", "int8", "uint8", "int32", "int64"};
  const char* alt[] = {"float32", "float64", "float16", "bf16", "char", "byte", "int", "long"};
  for (int i = 0; i < 8; ++i) {
    if (s == names[i] || s == alt[i]) return i;
  }
  return -1;
}

const char* dtype_label(int32_t dtype) {
  const char* names[] = {"float", "double", "half", "bfloat16", "int8", "uint8", "int32", "int64"};
  return dtype >= 0 && dtype < 8 ? names[dtype] : "?";
}

const char* op_label(int32_t op) {
  const char* names[] = {"sum", "avg", "min", "max", "prod"};
  return op >= 0 && op < 5 ? names[op] : "?";
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Element i of rank r's buffer; small integers keep every dtype exact.
double pattern(int r, long long i) { return static_cast<double>((r + 1) + (i % 5)); }

void fail_on(dp_status s, const char* what) {
  if (s != DP_OK) {
    std::fprintf(stderr, "dp-perf: %s failed: %s\n", what, dp_last_error());
    std::exit(1);
  }
}

// A tensor on the group's device, written and read through host copies so
// that CPU and GPU runs check the same way.
struct Tensor {
  dp_tensor* t = nullptr;
  Tensor(int32_t dtype, long long n, dp_device device) {
    int64_t shape[1] = {n};
    fail_on(dp_tensor_create(&t, dtype, 1, shape, device), "creating a tensor");
  }
  ~Tensor() { dp_tensor_destroy(t); }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  std::vector<uint8_t> read() const {
    std::vector<uint8_t> bytes(dp_tensor_nbytes(t));
    fail_on(dp_tensor_copy_to_host(t, bytes.data(), bytes.size()), "copying to the host");
    return bytes;
  }
  void write(const std::vector<uint8_t>& bytes) {
    fail_on(dp_tensor_copy_from_host(t, bytes.data(), bytes.size()), "copying from the host");
  }
};

// This rank's device for --device: cuda:LOCAL_RANK (or mpirun's local rank).
dp_device rank_device(int32_t type) {
  if (type == DP_DEVICE_CPU) return dp_device{DP_DEVICE_CPU, 0};
  const char* local = std::getenv("LOCAL_RANK");
  if (local == nullptr) local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return dp_device{DP_DEVICE_CUDA, local != nullptr ? std::atoi(local) : 0};
}

}  // namespace

namespace {

double reduce_expected(int32_t op, int world, long long i) {
  double acc = pattern(0, i);
  for (int r = 1; r < world; ++r) {
    double v = pattern(r, i);
    if (op == DP_SUM || op == DP_AVG) acc += v;
    if (op == DP_MIN) acc = std::min(acc, v);
    if (op == DP_MAX) acc = std::max(acc, v);
    if (op == DP_PROD) acc *= v;
  }
  return op == DP_AVG ? acc / world : acc;
}

bool close_enough(int32_t dtype, double got, double want) {
  if (dtype >= DP_INT8 && dtype <= DP_INT64) return got == std::trunc(want);
  double tol = dtype == DP_FLOAT16 || dtype == DP_BFLOAT16 ? 1e-2 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

int run(const std::string& op, const Options& o) {
  const dp_device device = rank_device(o.device_type);
  dp_process_group_options pg_options = DP_PROCESS_GROUP_OPTIONS_INIT;
  pg_options.device = device;
  pg_options.backend = o.backend;
  dp_process_group* pg = nullptr;
  fail_on(dp_process_group_create_from_env(&pg, &pg_options), "creating the process group from the environment");
  const int rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  const size_t esize = dp_dtype_size(o.dtype);
  if (o.root < 0 || o.root >= world) {
    std::fprintf(stderr, "dp-perf: -r %d is not a rank of this %d-rank job\n", o.root, world);
    dp_process_group_destroy(pg);
    return 2;
  }
  if (rank == 0) {
    std::printf("# dp-perf %s: %d ranks, backend %s, dtype %s, op %s, samples %d, GB = 1e9 B\n", op.c_str(), world,
                dp_process_group_backend(pg), dtype_label(o.dtype), op_label(o.op), o.samples);
    std::printf("# %10s %12s %8s %6s %6s %11s %11s %11s %11s %8s\n", "size(B)", "count", "type", "redop", "root",
                "time(us)", "algbw(GB/s)", "busbw(GB/s)", "busbw_best", "#wrong");
  }
  long long total_wrong = 0;
  for (double sz = static_cast<double>(o.min_bytes); sz <= static_cast<double>(o.max_bytes) * 1.0000001;
       sz *= o.factor) {
    // Per-rank element count; all_gather and reduce_scatter sizes are whole buffers.
    bool whole = op == "all_gather" || op == "reduce_scatter";
    long long bytes = static_cast<long long>(sz);
    long long count = bytes / static_cast<long long>(esize) / (whole ? world : 1);
    if (count <= 0) continue;
    bytes = count * static_cast<long long>(esize) * (whole ? world : 1);
    Tensor buf(o.dtype, count, device);
    std::vector<std::unique_ptr<Tensor>> many;
    for (int r = 0; r < (whole ? world : 0); ++r) many.push_back(std::make_unique<Tensor>(o.dtype, count, device));
    std::vector<dp_tensor*> handles;
    for (const auto& t : many) handles.push_back(t->t);
    auto run = [&] {
      if (op == "all_reduce") return dp_pg_all_reduce(pg, buf.t, o.op);
      if (op == "broadcast") return dp_pg_broadcast(pg, buf.t, o.root);
      if (op == "all_gather") return dp_pg_all_gather(pg, buf.t, handles.data(), handles.size());
      return dp_pg_reduce_scatter(pg, handles.data(), handles.size(), buf.t, o.op);
    };

    long long wrong = 0;
    if (o.check) {
      std::vector<uint8_t> host(static_cast<size_t>(count) * esize);
      for (long long i = 0; i < count; ++i) perf::store(o.dtype, host.data(), i, pattern(rank, i));
      buf.write(host);
      for (int r = 0; r < static_cast<int>(many.size()); ++r) {
        for (long long i = 0; i < count; ++i) perf::store(o.dtype, host.data(), i, pattern(rank, i + r * count));
        many[r]->write(host);
      }
    }
    fail_on(run(), op.c_str());
    if (o.check) {
      std::vector<uint8_t> result = buf.read();
      for (long long i = 0; i < count; ++i) {
        double got = perf::load(o.dtype, result.data(), i);
        if (op == "all_reduce") wrong += !close_enough(o.dtype, got, reduce_expected(o.op, world, i));
        if (op == "broadcast") wrong += !close_enough(o.dtype, got, pattern(o.root, i));
        if (op == "reduce_scatter")
          wrong += !close_enough(o.dtype, got, reduce_expected(o.op, world, i + rank * count));
      }
      for (int r = 0; op == "all_gather" && r < world; ++r) {
        std::vector<uint8_t> gathered = many[r]->read();
        for (long long i = 0; i < count; ++i)
          wrong += !close_enough(o.dtype, perf::load(o.dtype, gathered.data(), i), pattern(r, i));
      }
      // Zeros keep repeated in-place reductions finite during the timing.
      std::vector<uint8_t> zeros(static_cast<size_t>(count) * esize, 0);
      buf.write(zeros);
      for (const auto& t : many) t->write(zeros);
    }
    long k = o.ops > 0 ? o.ops : std::max(1LL, std::min(200LL, (256LL << 20) / bytes));
    long warm = o.warmup >= 0 ? o.warmup : std::max(2L, k / 10);
    for (long w = 0; w < warm; ++w) fail_on(run(), op.c_str());
    std::vector<double> t(static_cast<size_t>(o.samples));
    for (int s = 0; s < o.samples; ++s) {
      fail_on(dp_pg_barrier(pg), "barrier");
      double t0 = now();
      for (long j = 0; j < k; ++j) fail_on(run(), op.c_str());
      t[static_cast<size_t>(s)] = (now() - t0) / static_cast<double>(k);
    }
    // The op is done when the slowest rank is: the maximum over ranks.
    // The count of wrong elements rides along with the timings.
    t.push_back(static_cast<double>(wrong));
    Tensor times(DP_FLOAT64, static_cast<long long>(t.size()), device);
    std::vector<uint8_t> time_bytes(t.size() * sizeof(double));
    std::memcpy(time_bytes.data(), t.data(), time_bytes.size());
    times.write(time_bytes);
    fail_on(dp_pg_all_reduce(pg, times.t, DP_MAX), "all_reduce of the timings");
    time_bytes = times.read();
    std::memcpy(t.data(), time_bytes.data(), time_bytes.size());
    wrong = static_cast<long long>(t.back());
    t.pop_back();
    total_wrong += wrong;

    std::sort(t.begin(), t.end());
    double med = t[t.size() / 2], best = t[0];
    double factor = op == "all_reduce"  ? 2.0 * (world - 1) / world
                    : op == "broadcast" ? 1.0
                                        : double(world - 1) / world;
    double algbw = static_cast<double>(bytes) / med / 1e9;
    if (rank == 0) {
      std::printf("  %10lld %12lld %8s %6s %6d %11.1f %11.3f %11.3f %11.3f %8lld\n", bytes, count * (whole ? world : 1),
                  dtype_label(o.dtype), op == "all_reduce" || op == "reduce_scatter" ? op_label(o.op) : "none",
                  op == "broadcast" ? o.root : -1, med * 1e6, algbw, algbw * factor,
                  static_cast<double>(bytes) / best / 1e9 * factor, wrong);
      std::fflush(stdout);
    }
  }
  if (rank == 0) std::printf("# out of bounds values: %lld %s\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
  dp_process_group_destroy(pg);
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int dp_perf_dist_main(const char* op_name, int argc, char** argv) {
  std::string op = op_name;
  if (op != "all_reduce" && op != "broadcast" && op != "all_gather" && op != "reduce_scatter") {
    std::fprintf(stderr, "dp-perf: unknown collective '%s' (all_reduce, broadcast, all_gather, reduce_scatter)\n",
                 op_name);
    return 2;
  }
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (i + 1 >= argc) throw perf::UsageError("option " + a + " needs a value");
      const std::string v = argv[++i];
      if (a == "-b") {
        o.min_bytes = perf::parse_size(a, v);
      } else if (a == "-e") {
        o.max_bytes = perf::parse_size(a, v);
      } else if (a == "-f") {
        o.factor = perf::parse_factor(a, v);
      } else if (a == "-t" || a == "-d") {  // -t as in single-process dp-perf
        o.dtype = parse_dtype(v);
        if (o.dtype < 0) perf::bad_value(a, v, "float, double, half, bfloat16, int8, uint8, int32 or int64");
      } else if (a == "-o") {
        o.op = v == "sum"    ? DP_SUM
               : v == "avg"  ? DP_AVG
               : v == "min"  ? DP_MIN
               : v == "max"  ? DP_MAX
               : v == "prod" ? DP_PROD
                             : -1;
        if (o.op < 0) perf::bad_value(a, v, "sum, avg, min, max or prod");
      } else if (a == "-r") {
        o.root = static_cast<int32_t>(perf::parse_int(a, v, 0, 1 << 30));
      } else if (a == "-n") {
        o.ops = perf::parse_int(a, v, 1, 1000000);
      } else if (a == "-s") {
        o.samples = static_cast<int>(perf::parse_int(a, v, 1, 100000));
      } else if (a == "-w") {
        o.warmup = perf::parse_int(a, v, 0, 1000000);
      } else if (a == "-c") {
        o.check = perf::parse_int(a, v, 0, 1) != 0;
      } else if (a == "--device") {
        o.device_type = v == "cpu" ? DP_DEVICE_CPU : v == "cuda" ? DP_DEVICE_CUDA : -1;
        if (o.device_type < 0) perf::bad_value(a, v, "cpu or cuda");
      } else if (a == "--backend") {
        o.backend = v == "auto"   ? DP_BACKEND_AUTO
                    : v == "gloo" ? DP_BACKEND_GLOO
                    : v == "shm"  ? DP_BACKEND_SHM
                    : v == "mpi"  ? DP_BACKEND_MPI
                    : v == "nccl" ? DP_BACKEND_NCCL
                                  : -1;
        if (o.backend < 0) perf::bad_value(a, v, "auto, gloo, shm, mpi or nccl");
      } else {
        throw perf::UsageError("unknown option " + a);
      }
    }
    perf::check_size_steps(o.min_bytes, o.max_bytes, o.factor);
    // Per rank at the largest size: the buffers and their host copies (about
    // 3 times the size), for every rank on this machine.
    const char* local_ranks_text = std::getenv("LOCAL_WORLD_SIZE");
    const long local_ranks = local_ranks_text != nullptr ? std::max(1L, std::atol(local_ranks_text)) : 1;
    perf::check_fits("-e " + std::to_string(o.max_bytes) + " on " + std::to_string(local_ranks) + " local rank(s)",
                     3.0 * static_cast<double>(o.max_bytes) * static_cast<double>(local_ranks));
  } catch (const perf::UsageError& e) {
    std::fprintf(stderr, "dp-perf: %s\n", e.what());
    return 2;
  }
  // Memory can still run out after the check (other programs allocate too): reported, never an abort.
  try {
    return run(op, o);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "dp-perf: out of memory; a smaller -e needs less\n");
    return 1;
  }
}
