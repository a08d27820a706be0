// Google Benchmark micro-benchmarks of the in-process collectives on logical
// CPU devices, through the public C ABI.
#include <benchmark/benchmark.h>

#include <vector>

#include "dparallel/dparallel.h"

namespace {

dp_device cpu(int index) { return dp_device{DP_DEVICE_CPU, index}; }

dp_tensor* floats(int64_t count, dp_device device) {
  dp_tensor* t = nullptr;
  if (dp_tensor_create(&t, DP_FLOAT32, 1, &count, device) != DP_OK) return nullptr;
  return t;
}

void BM_Broadcast(benchmark::State& state) {
  dp_tensor* src = floats(state.range(0) / 4, cpu(0));
  dp_device devices[] = {cpu(0), cpu(1)};
  for (auto _ : state) {
    dp_tensor* out[2] = {};
    if (dp_broadcast(src, devices, 2, out) != DP_OK) state.SkipWithError(dp_last_error());
    for (dp_tensor* t : out) dp_tensor_destroy(t);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  dp_tensor_destroy(src);
}

void BM_ReduceAdd(benchmark::State& state) {
  dp_tensor* a = floats(state.range(0) / 4, cpu(0));
  dp_tensor* b = floats(state.range(0) / 4, cpu(1));
  const dp_tensor* inputs[] = {a, b};
  for (auto _ : state) {
    dp_tensor* out = nullptr;
    if (dp_reduce_add(inputs, 2, cpu(0), &out) != DP_OK) state.SkipWithError(dp_last_error());
    dp_tensor_destroy(out);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  dp_tensor_destroy(a);
  dp_tensor_destroy(b);
}

// Many small parameters, as a model's state has: the coalescing path.
void BM_BroadcastCoalesced(benchmark::State& state) {
  std::vector<dp_tensor*> tensors;
  for (int i = 0; i < 64; ++i) tensors.push_back(floats(state.range(0) / 4 / 64, cpu(0)));
  dp_device devices[] = {cpu(0), cpu(1)};
  std::vector<dp_tensor*> out(2 * tensors.size());
  for (auto _ : state) {
    if (dp_broadcast_coalesced(tensors.data(), tensors.size(), devices, 2, 0, out.data()) != DP_OK) {
      state.SkipWithError(dp_last_error());
    }
    for (dp_tensor* t : out) dp_tensor_destroy(t);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  for (dp_tensor* t : tensors) dp_tensor_destroy(t);
}

void BM_ScatterGather(benchmark::State& state) {
  int64_t rows = state.range(0) / 4 / 256;
  int64_t shape[2] = {rows, 256};
  dp_tensor* src = nullptr;
  dp_tensor_create(&src, DP_FLOAT32, 2, shape, cpu(0));
  dp_device devices[] = {cpu(0), cpu(1)};
  for (auto _ : state) {
    dp_tensor* chunks[2] = {};
    size_t count = 0;
    dp_tensor* back = nullptr;
    if (dp_scatter(src, devices, 2, nullptr, 0, chunks, &count) != DP_OK ||
        dp_gather(chunks, count, 0, cpu(0), &back) != DP_OK) {
      state.SkipWithError(dp_last_error());
    }
    dp_tensor_destroy(back);
    for (dp_tensor* t : chunks) dp_tensor_destroy(t);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  dp_tensor_destroy(src);
}

}  // namespace

BENCHMARK(BM_Broadcast)->RangeMultiplier(16)->Range(64 << 10, 64 << 20)->UseRealTime();
BENCHMARK(BM_ReduceAdd)->RangeMultiplier(16)->Range(64 << 10, 64 << 20)->UseRealTime();
BENCHMARK(BM_BroadcastCoalesced)->RangeMultiplier(16)->Range(1 << 20, 64 << 20)->UseRealTime();
BENCHMARK(BM_ScatterGather)->RangeMultiplier(16)->Range(1 << 20, 64 << 20)->UseRealTime();
BENCHMARK_MAIN();
