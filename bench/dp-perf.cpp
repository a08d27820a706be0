// dp-perf: nccl-tests-style benchmark of dparallel's collectives.
//
//   dp-perf <op> [-b MIN] [-e MAX] [-f FACTOR] [-d DEVICES] [-t TYPE] [-s SAMPLES] [-w WARMUP]
//
// On its own, dp-perf measures the in-process collectives (broadcast,
// reduce_add, scatter, gather) across the devices of -d. Under a launcher
// (dp-run, torchrun or mpirun set WORLD_SIZE), it measures the process
// group's collectives across the ranks: dp-run -n 2 dp-perf all_reduce.
// `dp-run -n 2 dp-perf ddp` times a training step with and without the DDP
// reducer (built with OpenBLAS; see dp_perf_ddp.cpp).
//
// One row per size: size, count, type, time (us), algbw and busbw (GB/s, as
// nccl-tests defines them) and the number of wrong elements found by a real
// check. Beside every row stand this machine's memcpy and add bandwidth for
// the same size, measured in the same run with every core, and the share of
// that physical limit the operation reached.
//
// Exit codes: 0 all results right, 1 wrong results or a failed call (out of
// memory included), 2 bad usage: a bad option value, or sizes whose buffers
// do not fit in the memory this machine has free.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "dp_perf_dist.h"
#ifdef DP_PERF_WITH_DDP
#include "dp_perf_ddp.h"
#endif
#include "dparallel/dparallel.h"
#include "perf_args.h"
#include "perf_values.h"

namespace {

struct Options {
  std::string op;
  size_t min_bytes = 8;
  size_t max_bytes = 256u << 20;
  double factor = 2.0;
  std::vector<dp_device> devices;
  std::string type = "float";
  int samples = 11;
  int warmup = 3;
};

[[noreturn]] void usage(const char* message) {
  std::fprintf(
      stderr,
      "dp-perf: %s\n"
      "usage: dp-perf <broadcast|reduce_add|scatter|gather> [-b MIN] [-e MAX] [-f FACTOR]\n"
      "               [-d cpu:0,cpu:1] [-t float|double|half|bfloat16|int8|uint8|int32|int64]\n"
      "               [-s SAMPLES] [-w WARMUP]\n"
      "       dp-run -n RANKS dp-perf <all_reduce|broadcast|all_gather|reduce_scatter> [-b 4K] [-e 64M]\n"
      "               [-f 4] [-t float] [-o sum] [-r ROOT]\n"
      "       dp-run -n RANKS dp-perf ddp [--layers 10] [--width 1024] [--batch 32] [--steps 41]\n"
      "               [--warmup 5] [--bucket-cap-mb 25] [--grad-as-bucket-view] [--optim-in-backward]\n"
      "               [--static-graph] [--modes ...]\n"
      "       dp-run -n RANKS dp-perf fsdp [the ddp options] [--checkpoint-every N]: one dp_fsdp per layer beside\n"
      "               ddp; with N, a sharded save every N steps, sync and async, and what it costs the step\n"
      "sizes: 1 to 1024G, with K, M or G suffixes (powers of 1024); -f: above 1, at most 1024;\n"
      "-s: 1..100000; -w: 0..100000\n",
      message);
  std::exit(2);
}

void check(dp_status status, const char* what) {
  if (status != DP_OK) {
    std::fprintf(stderr, "dp-perf: %s failed: %s (%s)\n", what, dp_status_string(status), dp_last_error());
    std::exit(1);
  }
}

std::vector<dp_device> parse_devices(const std::string& list) {
  std::vector<dp_device> devices;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    dp_device d{};
    if (dp_device_parse(item.c_str(), &d) != DP_OK) {
      throw perf::UsageError("-d takes devices like cpu:0,cpu:1; '" + item + "' is not one: " + dp_last_error());
    }
    devices.push_back(d);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return devices;
}

struct TypeInfo {
  const char* name;
  int32_t dtype;
};

TypeInfo parse_type(const std::string& name) {
  static const TypeInfo types[] = {{"float", DP_FLOAT32},     {"double", DP_FLOAT64}, {"half", DP_FLOAT16},
                                   {"bfloat16", DP_BFLOAT16}, {"int8", DP_INT8},      {"uint8", DP_UINT8},
                                   {"int32", DP_INT32},       {"int64", DP_INT64}};
  for (const TypeInfo& t : types) {
    if (name == t.name) return t;
  }
  perf::bad_value("-t", name, "float, double, half, bfloat16, int8, uint8, int32 or int64");
}

bool known_op(const std::string& op) {
  return op == "broadcast" || op == "reduce_add" || op == "scatter" || op == "gather";
}

// Host memory at the largest size: the reference buffers (3), one host copy
// for a check (1), and the op's tensors on CPU devices.
double needed_bytes(const Options& opts) {
  const double size = static_cast<double>(opts.max_bytes);
  const size_t n = opts.devices.size();
  size_t cpu = 0;
  for (const dp_device& d : opts.devices) cpu += d.type == DP_DEVICE_CPU;
  const double first_on_cpu = opts.devices[0].type == DP_DEVICE_CPU ? 1.0 : 0.0;
  double tensors = 0;
  if (opts.op == "broadcast" || opts.op == "reduce_add") {
    tensors = first_on_cpu + static_cast<double>(cpu);  // one per device, and the root's input or output
  } else {
    tensors = first_on_cpu + static_cast<double>(cpu) / static_cast<double>(n);  // the whole, and its parts
  }
  return size * (4.0 + tensors);
}

// Small integers, exact in every dtype, so sums can be checked exactly.
double pattern(size_t i, size_t device) { return static_cast<double>((i * 7 + device * 3) % 13); }

struct Owned {
  dp_tensor* t = nullptr;
  Owned() = default;
  explicit Owned(dp_tensor* tensor) : t(tensor) {}
  Owned(Owned&& o) noexcept : t(o.t) { o.t = nullptr; }
  Owned& operator=(Owned&& o) noexcept {
    std::swap(t, o.t);
    return *this;
  }
  ~Owned() { dp_tensor_destroy(t); }
};

Owned make_tensor(int32_t dtype, size_t count, dp_device device, size_t pattern_device) {
  int64_t shape[1] = {static_cast<int64_t>(count)};
  dp_tensor* t = nullptr;
  check(dp_tensor_create(&t, dtype, 1, shape, device), "dp_tensor_create");
  std::vector<uint8_t> host(count * dp_dtype_size(dtype));
  for (size_t i = 0; i < count; ++i)
    perf::store(dtype, host.data(), static_cast<int64_t>(i), pattern(i, pattern_device));
  check(dp_tensor_copy_from_host(t, host.data(), host.size()), "dp_tensor_copy_from_host");
  return Owned(t);
}

// One tensor of `count` elements on each device, holding that device's pattern.
std::vector<Owned> one_per_device(const Options& opts, int32_t dtype, size_t count) {
  std::vector<Owned> tensors;
  for (size_t d = 0; d < opts.devices.size(); ++d) tensors.push_back(make_tensor(dtype, count, opts.devices[d], d));
  return tensors;
}

std::vector<const dp_tensor*> handles(const std::vector<Owned>& tensors) {
  std::vector<const dp_tensor*> raw;
  for (const Owned& t : tensors) raw.push_back(t.t);
  return raw;
}

// Wrong elements of `t` against expected(i).
size_t count_wrong(const dp_tensor* t, int32_t dtype, const std::function<double(size_t)>& expected) {
  size_t count = static_cast<size_t>(dp_tensor_numel(t));
  std::vector<uint8_t> host(dp_tensor_nbytes(t));
  check(dp_tensor_copy_to_host(t, host.data(), host.size()), "dp_tensor_copy_to_host");
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) wrong += perf::load(dtype, host.data(), static_cast<int64_t>(i)) != expected(i);
  return wrong;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median over samples of the per-op time of `op` run k times back to back.
double time_op(const std::function<void()>& op, size_t bytes, const Options& opts) {
  size_t k = std::clamp<size_t>(bytes == 0 ? 200 : (256u << 20) / bytes, 1, 200);
  for (int i = 0; i < opts.warmup; ++i) op();
  std::vector<double> per_op;
  for (int s = 0; s < opts.samples; ++s) {
    double start = now_us();
    for (size_t i = 0; i < k; ++i) op();
    per_op.push_back((now_us() - start) / static_cast<double>(k));
  }
  std::sort(per_op.begin(), per_op.end());
  return per_op[per_op.size() / 2];
}

// The machine's own limits for one size, with every core, as the anchors measure them.
struct Reference {
  std::vector<float> a, b, c;
  explicit Reference(size_t max_bytes) {
    size_t n = std::max<size_t>(1, max_bytes / sizeof(float));
    a.assign(n, 1.0f);
    b.assign(n, 2.0f);
    c.assign(n, 0.0f);
  }
  double memcpy_us(size_t bytes, const Options& opts) {
    return time_op(
        [&] {
          char* dst = reinterpret_cast<char*>(c.data());
          const char* src = reinterpret_cast<const char*>(a.data());
#pragma omp parallel
          {
            size_t threads = static_cast<size_t>(omp_get_num_threads());
            size_t part = (bytes + threads - 1) / threads;
            size_t begin = std::min(bytes, part * static_cast<size_t>(omp_get_thread_num()));
            size_t end = std::min(bytes, begin + part);
            std::memcpy(dst + begin, src + begin, end - begin);
          }
        },
        bytes, opts);
  }
  double add_us(size_t bytes, const Options& opts) {
    long n = static_cast<long>(bytes / sizeof(float));
    float* x = a.data();
    float* y = b.data();
    float* z = c.data();
    return time_op(
        [&] {
#pragma omp parallel for schedule(static)
          for (long i = 0; i < n; ++i) z[i] = x[i] + y[i];
        },
        bytes, opts);
  }
};

struct Row {
  double time_us = 0;
  double algbw_factor = 1;  // algbw = bytes / time
  double busbw_factor = 1;  // busbw = algbw * this
  double limit_us = 0;      // the same bytes moved at memcpy/add speed
  size_t wrong = 0;
};

struct Limits {
  double memcpy_us = 0;  // copying `bytes` once
  double add_us = 0;     // c = a + b over `bytes`
};

Row run_size(const Options& opts, const TypeInfo& type, size_t count, const Limits& limits) {
  const size_t n = opts.devices.size();
  const size_t element = dp_dtype_size(type.dtype);
  const size_t bytes = count * element;
  Row row;
  if (opts.op == "broadcast") {
    Owned input = make_tensor(type.dtype, count, opts.devices[0], 0);
    std::vector<dp_tensor*> out(n);
    auto op = [&] { check(dp_broadcast(input.t, opts.devices.data(), n, out.data()), "dp_broadcast"); };
    op();
    for (size_t d = 0; d < n; ++d) row.wrong += count_wrong(out[d], type.dtype, [](size_t i) { return pattern(i, 0); });
    for (dp_tensor* t : out) dp_tensor_destroy(t);
    row.time_us = time_op(
        [&] {
          op();
          for (dp_tensor* t : out) dp_tensor_destroy(t);
        },
        bytes, opts);
    // Read once, written to every other device: (n) * bytes moved against memcpy's 2 * bytes.
    row.limit_us = limits.memcpy_us * static_cast<double>(n) / 2.0;
  } else if (opts.op == "reduce_add") {
    std::vector<Owned> inputs = one_per_device(opts, type.dtype, count);
    std::vector<const dp_tensor*> raw = handles(inputs);
    dp_tensor* out = nullptr;
    check(dp_reduce_add(raw.data(), n, opts.devices[0], &out), "dp_reduce_add");
    row.wrong = count_wrong(out, type.dtype, [&](size_t i) {
      double sum = 0;
      for (size_t d = 0; d < n; ++d) sum += pattern(i, d);
      return sum;
    });
    dp_tensor_destroy(out);
    row.time_us = time_op(
        [&] {
          check(dp_reduce_add(raw.data(), n, opts.devices[0], &out), "dp_reduce_add");
          dp_tensor_destroy(out);
        },
        bytes, opts);
    // n inputs read and one output written, against add's 3 * bytes.
    row.limit_us = limits.add_us * static_cast<double>(n + 1) / 3.0;
  } else if (opts.op == "scatter") {
    Owned input = make_tensor(type.dtype, count, opts.devices[0], 0);
    std::vector<dp_tensor*> out(n);
    size_t chunks = 0;
    auto op = [&] {
      check(dp_scatter(input.t, opts.devices.data(), n, nullptr, 0, out.data(), &chunks), "dp_scatter");
    };
    op();
    size_t offset = 0;
    for (size_t c = 0; c < chunks; ++c) {
      row.wrong += count_wrong(out[c], type.dtype, [&](size_t i) { return pattern(offset + i, 0); });
      offset += static_cast<size_t>(dp_tensor_numel(out[c]));
    }
    row.wrong += count - offset;
    auto release = [&] {
      for (size_t c = 0; c < chunks; ++c) dp_tensor_destroy(out[c]);
    };
    release();
    row.time_us = time_op(
        [&] {
          op();
          release();
        },
        bytes, opts);
    row.busbw_factor = static_cast<double>(n - 1) / static_cast<double>(n);
    row.limit_us = limits.memcpy_us * row.busbw_factor;
  } else if (opts.op == "gather") {
    size_t per = count / n;
    std::vector<Owned> inputs = one_per_device(opts, type.dtype, per);
    std::vector<const dp_tensor*> raw = handles(inputs);
    dp_tensor* out = nullptr;
    check(dp_gather(raw.data(), n, 0, opts.devices[0], &out), "dp_gather");
    row.wrong = count_wrong(out, type.dtype, [&](size_t i) { return pattern(i % per, i / per); });
    dp_tensor_destroy(out);
    row.time_us = time_op(
        [&] {
          check(dp_gather(raw.data(), n, 0, opts.devices[0], &out), "dp_gather");
          dp_tensor_destroy(out);
        },
        bytes, opts);
    row.busbw_factor = static_cast<double>(n - 1) / static_cast<double>(n);
    row.limit_us = limits.memcpy_us;
  } else {
    usage("unknown op");
  }
  return row;
}

int run(int argc, char** argv) {
  Options opts;
  TypeInfo type{};
  opts.op = argv[1];
  if (!known_op(opts.op)) {
    usage(("unknown op '" + opts.op +
           "' (broadcast, reduce_add, scatter, gather; across ranks: all_reduce, "
           "broadcast, all_gather, reduce_scatter)")
              .c_str());
  }
  try {
    opts.devices = parse_devices("cpu:0,cpu:1");
    for (int i = 2; i < argc; ++i) {
      std::string flag = argv[i];
      if (i + 1 >= argc) usage(("missing value after " + flag).c_str());
      const std::string value = argv[++i];
      if (flag == "-b")
        opts.min_bytes = perf::parse_size(flag, value);
      else if (flag == "-e")
        opts.max_bytes = perf::parse_size(flag, value);
      else if (flag == "-f")
        opts.factor = perf::parse_factor(flag, value);
      else if (flag == "-d")
        opts.devices = parse_devices(value);
      else if (flag == "-t")
        opts.type = value;
      else if (flag == "-s")
        opts.samples = static_cast<int>(perf::parse_int(flag, value, 1, 100000));
      else if (flag == "-w")
        opts.warmup = static_cast<int>(perf::parse_int(flag, value, 0, 100000));
      else
        usage(("unknown option " + flag).c_str());
    }
    type = parse_type(opts.type);
    perf::check_size_steps(opts.min_bytes, opts.max_bytes, opts.factor);
    perf::check_fits("-e " + std::to_string(opts.max_bytes) + " (" + opts.op + " on " +
                         std::to_string(opts.devices.size()) + " devices)",
                     needed_bytes(opts));
  } catch (const perf::UsageError& e) {
    usage(e.what());
  }
  const size_t element = dp_dtype_size(type.dtype);
  const size_t n = opts.devices.size();

  std::printf("# dp-perf %s, dparallel %u, devices", opts.op.c_str(), dp_version_number());
  for (const dp_device& d : opts.devices) {
    char text[32];
    dp_device_format(d, text, sizeof text);
    std::printf(" %s", text);
  }
  std::printf(", %d threads, median of %d samples, GB = 1e9 B\n", omp_get_max_threads(), opts.samples);
  std::printf("# memcpy and add: this machine with every core, same run (memcpy counts 2 B/byte, add 3 B/byte)\n");
  std::printf("# %%limit: the time the same bytes take at memcpy/add speed over the op's time\n");
  std::printf("%12s %12s %8s %10s %8s %8s %7s  %10s %9s %9s %7s\n", "size", "count", "type", "time_us", "algbw",
              "busbw", "wrong", "memcpyGB/s", "addGB/s", "limit_us", "%limit");

  Reference ref(opts.max_bytes);
  size_t total_wrong = 0;
  for (double size = static_cast<double>(opts.min_bytes); size <= static_cast<double>(opts.max_bytes) * 1.0001;
       size *= opts.factor) {
    size_t count = static_cast<size_t>(size) / element;
    if (opts.op == "gather") count = count / n * n;
    if (count == 0) continue;
    size_t bytes = count * element;
    // The limits are measured right before the op, so both see the same machine state.
    Limits limits{ref.memcpy_us(bytes, opts), ref.add_us(bytes, opts)};
    Row row = run_size(opts, type, count, limits);
    double memcpy_gbs = 2.0 * static_cast<double>(bytes) / limits.memcpy_us / 1e3;
    double add_gbs = 3.0 * static_cast<double>(bytes) / limits.add_us / 1e3;
    double algbw = static_cast<double>(bytes) / row.time_us / 1e3;
    std::printf("%12zu %12zu %8s %10.2f %8.2f %8.2f %7zu  %10.2f %9.2f %9.2f %6.1f%%\n", bytes, count, type.name,
                row.time_us, algbw, algbw * row.busbw_factor, row.wrong, memcpy_gbs, add_gbs, row.limit_us,
                100.0 * row.limit_us / row.time_us);
    std::fflush(stdout);
    total_wrong += row.wrong;
  }
  std::printf("# wrong elements in total: %zu\n", total_wrong);
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage("missing op");
  const std::string op = argv[1];
  if (op == "ddp" || op == "fsdp") {
#ifdef DP_PERF_WITH_DDP
    return dp_perf_ddp_main(argc - 1, argv + 1);
#else
    std::fprintf(stderr, "dp-perf: %s needs OpenBLAS (libopenblas-dev) when dp-perf is built\n", op.c_str());
    return 2;
#endif
  }
  const bool under_launcher = std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (under_launcher || op == "all_reduce" || op == "all_gather" || op == "reduce_scatter") {
    return dp_perf_dist_main(argv[1], argc - 1, argv + 1);
  }
  // Memory can still run out after the check (other programs allocate too): reported, never an abort.
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "dp-perf: out of memory; a smaller -e needs less\n");
    return 1;
  }
}
