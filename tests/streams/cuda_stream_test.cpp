// Stream order on a GPU: the producer is still running on a non-default
// stream (a host function that holds the stream, then an asynchronous copy
// that writes the tensor) when its tensor is handed to each entry point; the
// results are read back on that same stream, after the call, without any
// synchronisation in between. Compiled always; skips without a GPU
// (tests/gpu/check.sh runs it, also under compute-sanitizer).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

using namespace dptest;

#define REQUIRE_GPUS(n) \
  if (cuda_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda_count()

namespace {

// Long enough that a call that does not wait for the held stream reads the
// tensor before the copy wrote it (tests/gpu/check.sh runs these tests with
// the wait switched off, where each must fail).
constexpr int kHoldMs = 250;

void hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(kHoldMs)); }

std::vector<float> filled(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

// `v` through bfloat16 and back, rounded to nearest even (finite values).
float bf16_round_trip(float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Pinned host memory holding `values`: a copy from it stays queued (from
// pageable memory CUDA may wait for the stream first).
struct PinnedFloats {
  explicit PinnedFloats(const std::vector<float>& values) : n(values.size()) {
    EXPECT_EQ(cudaMallocHost(reinterpret_cast<void**>(&data), n * sizeof(float)), cudaSuccess);
    std::memcpy(data, values.data(), n * sizeof(float));
  }
  ~PinnedFloats() { cudaFreeHost(data); }
  float* data = nullptr;
  size_t n;
};

class CudaStreamOrder : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPUS(1);
    DP_ASSERT_OK(dp_stream_create(cuda(0), &stream_));
    DP_ASSERT_OK(dp_set_current_stream(cuda(0), stream_));
  }
  void TearDown() override {
    if (stream_ == nullptr) return;
    EXPECT_EQ(dp_set_current_stream(cuda(0), nullptr), DP_OK);
    EXPECT_EQ(dp_stream_destroy(cuda(0), stream_), DP_OK);
  }
  cudaStream_t s() const { return static_cast<cudaStream_t>(stream_); }

  // A tensor on cuda:0 that the stream writes later: held first, then copied.
  TensorPtr produced(size_t n, float start) {
    TensorPtr t = make<float>({static_cast<int64_t>(n)}, std::vector<float>(n, -7.0f), cuda(0));
    sources_.push_back(std::make_unique<PinnedFloats>(filled(n, start)));
    EXPECT_EQ(dp_stream_launch_host_func(cuda(0), stream_, hold_stream, nullptr), DP_OK) << dp_last_error();
    EXPECT_EQ(
        cudaMemcpyAsync(dp_tensor_data(t.get()), sources_.back()->data, n * sizeof(float), cudaMemcpyHostToDevice, s()),
        cudaSuccess);
    return t;
  }
  // Reads a GPU tensor back on the stream, after everything queued so far.
  std::vector<float> read_on_stream(const dp_tensor* t) {
    std::vector<float> out(static_cast<size_t>(dp_tensor_numel(t)));
    EXPECT_EQ(cudaMemcpyAsync(out.data(), dp_tensor_data(t), out.size() * sizeof(float), cudaMemcpyDeviceToHost, s()),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s()), cudaSuccess);
    return out;
  }

  void* stream_ = nullptr;
  // Pinned sources of queued copies: from pageable memory CUDA may wait for
  // the held stream before it returns, and the call after would find the
  // tensor written whether it waited or not.
  std::vector<std::unique_ptr<PinnedFloats>> sources_;
};

TEST_F(CudaStreamOrder, BroadcastOnOneGpuReadsWhatTheStreamWroteAndTheStreamWaitsForItsResult) {
  TensorPtr x = produced(1 << 20, 1.0f);
  dp_device devices[] = {cuda(0), cpu(0)};
  dp_tensor* out[2] = {};
  DP_ASSERT_OK(dp_broadcast(x.get(), devices, 2, out));
  TensorPtr a(out[0]), b(out[1]);
  EXPECT_EQ(values<float>(b.get()), filled(1 << 20, 1.0f));
}

TEST_F(CudaStreamOrder, ReduceAddScatterGatherAndCopiesSeeTheStreamsWrites) {
  TensorPtr x = produced(4096, 1.0f), y = produced(4096, 2.0f);
  const dp_tensor* in[] = {x.get(), y.get()};
  dp_tensor* sum = nullptr;
  DP_ASSERT_OK(dp_reduce_add(in, 2, cuda(0), &sum));
  TensorPtr owned_sum(sum);
  std::vector<float> expected(4096);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = 3.0f + 2.0f * static_cast<float>(i);
  EXPECT_EQ(read_on_stream(sum), expected);

  TensorPtr z = produced(64, 10.0f);
  std::vector<float> host(64);
  DP_ASSERT_OK(dp_tensor_copy_to_host(z.get(), host.data(), host.size() * sizeof(float)));
  EXPECT_EQ(host, filled(64, 10.0f));

  TensorPtr w = produced(64, 20.0f);
  dp_tensor* moved = nullptr;
  DP_ASSERT_OK(dp_tensor_to_device(&moved, w.get(), cpu(0)));
  TensorPtr owned_moved(moved);
  EXPECT_EQ(values<float>(moved), filled(64, 20.0f));

  TensorPtr v = produced(8, 1.0f);
  dp_device targets[] = {cuda(0), cpu(0)};
  dp_tensor* chunks[2] = {};
  size_t count = 0;
  DP_ASSERT_OK(dp_scatter(v.get(), targets, 2, nullptr, 0, chunks, &count));
  TensorPtr c0(chunks[0]), c1(chunks[1]);
  EXPECT_EQ(values<float>(c1.get()), filled(4, 5.0f));
  TensorPtr g0 = produced(4, 100.0f);
  const dp_tensor* parts[] = {g0.get(), c1.get()};
  dp_tensor* whole = nullptr;
  DP_ASSERT_OK(dp_gather(parts, 2, 0, cuda(0), &whole));
  TensorPtr owned_whole(whole);
  std::vector<float> joined = filled(4, 100.0f), tail = filled(4, 5.0f);
  joined.insert(joined.end(), tail.begin(), tail.end());
  EXPECT_EQ(read_on_stream(whole), joined);
}

// An NCCL group of one rank on cuda:0; its store file is removed at once.
dp_process_group* nccl_group_of_one() {
  char path[] = "/tmp/dp_cuda_stream_store_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  ::unlink(path);
  dp_store* store = nullptr;
  EXPECT_EQ(dp_store_create_file(&store, path, 1), DP_OK) << dp_last_error();
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.backend = DP_BACKEND_NCCL;
  o.rank = 0;
  o.world_size = 1;
  o.store = store;
  o.timeout_ms = 60000;
  o.device = cuda(0);
  dp_process_group* pg = nullptr;
  EXPECT_EQ(dp_process_group_create(&pg, &o), DP_OK) << dp_last_error();
  dp_store_destroy(store);
  ::unlink(path);
  return pg;
}

// The bf16 hook rounds the gradient (1 .. 65536: most need more than bf16's
// 8 bits), so the result tells which came last: the reduction of the
// host's write (rounded), or the host's write itself (a reduction that read
// the gradient before it, with no wait for the stream).
TEST_F(CudaStreamOrder, DdpMarksWithoutAStreamArgumentWaitForTheCurrentStream) {
  dp_process_group* pg = nccl_group_of_one();
  ASSERT_NE(pg, nullptr);
  dp_module* m = nullptr;
  DP_ASSERT_OK(dp_module_create(&m));
  TensorPtr w = make<float>({1 << 16}, std::vector<float>(1 << 16, 0.0f), cuda(0));
  DP_ASSERT_OK(dp_module_register_parameter(m, "w", w.get(), 1));
  dp_ddp* ddp = nullptr;
  dp_ddp_options options = DP_DDP_OPTIONS_INIT;
  options.comm_hook = DP_HOOK_BF16;
  DP_ASSERT_OK(dp_ddp_create(&ddp, m, pg, &options));
  dp_tensor* g = nullptr;
  DP_ASSERT_OK(dp_module_grad(m, "w", &g));
  TensorPtr grad(g);
  sources_.push_back(std::make_unique<PinnedFloats>(filled(1 << 16, 1.0f)));
  DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), stream_, hold_stream, nullptr));
  ASSERT_EQ(cudaMemcpyAsync(dp_tensor_data(g), sources_.back()->data, sources_.back()->n * sizeof(float),
                            cudaMemcpyHostToDevice, s()),
            cudaSuccess);
  DP_ASSERT_OK(dp_ddp_mark_grad_ready(ddp, "w"));
  DP_ASSERT_OK(dp_ddp_finish_backward(ddp));
  std::vector<float> rounded = filled(1 << 16, 1.0f);
  for (float& v : rounded) v = bf16_round_trip(v);
  EXPECT_EQ(read_on_stream(g), rounded);
  dp_ddp_destroy(ddp);
  dp_module_destroy(m);
  dp_process_group_destroy(pg);
}

TEST_F(CudaStreamOrder, CoalescedCallsReplicationAndSavesSeeTheStreamsWrites) {
  TensorPtr x = produced(1000, 1.0f), y = produced(10, 50.0f);
  const dp_tensor* in[] = {x.get(), y.get()};
  dp_device devices[] = {cuda(0), cpu(0)};
  dp_tensor* copies[4] = {};
  DP_ASSERT_OK(dp_broadcast_coalesced(in, 2, devices, 2, 1 << 20, copies));
  std::vector<TensorPtr> owned;
  for (dp_tensor* t : copies) owned.emplace_back(t);
  EXPECT_EQ(values<float>(copies[2]), filled(1000, 1.0f));
  EXPECT_EQ(values<float>(copies[3]), filled(10, 50.0f));

  TensorPtr a = produced(100, 1.0f);
  TensorPtr b = make<float>({100}, std::vector<float>(100, 1.0f), cpu(0));
  const dp_tensor* lists[] = {a.get(), b.get()};
  dp_tensor* sums[1] = {};
  DP_ASSERT_OK(dp_reduce_add_coalesced(lists, 2, 1, cpu(0), 1 << 20, sums));
  TensorPtr owned_sum(sums[0]);
  EXPECT_EQ(values<float>(sums[0]), filled(100, 2.0f));

  dp_module* m = nullptr;
  DP_ASSERT_OK(dp_module_create(&m));
  TensorPtr w = produced(4096, 3.0f);
  DP_ASSERT_OK(dp_module_register_parameter(m, "w", w.get(), 1));
  dp_device to_host[] = {cpu(0)};
  dp_module* replica = nullptr;
  DP_ASSERT_OK(dp_replicate(m, to_host, 1, 1, &replica));
  dp_tensor* rw = nullptr;
  DP_ASSERT_OK(dp_module_get_parameter(replica, "w", &rw));
  EXPECT_EQ(values<float>(rw), filled(4096, 3.0f));
  dp_tensor_destroy(rw);
  dp_module_destroy(replica);

  TensorPtr w2 = produced(4096, 9.0f);
  DP_ASSERT_OK(dp_module_register_parameter(m, "w2", w2.get(), 1));
  char path[] = "/tmp/dp_cuda_stream_save_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  DP_ASSERT_OK(dp_module_save(m, path));
  dp_module* loaded = nullptr;
  DP_ASSERT_OK(dp_module_create(&loaded));
  TensorPtr l1 = make<float>({4096}, std::vector<float>(4096, 0.0f)),
            l2 = make<float>({4096}, std::vector<float>(4096, 0.0f));
  DP_ASSERT_OK(dp_module_register_parameter(loaded, "w", l1.get(), 1));
  DP_ASSERT_OK(dp_module_register_parameter(loaded, "w2", l2.get(), 1));
  DP_ASSERT_OK(dp_module_load(loaded, path, 1));
  ::unlink(path);
  EXPECT_EQ(values<float>(l2.get()), filled(4096, 9.0f));
  dp_module_destroy(loaded);
  dp_module_destroy(m);
}

TEST_F(CudaStreamOrder, NcclAllGatherOfWorldOneSendsWhatTheStreamWrote) {
  dp_process_group* pg = nccl_group_of_one();
  ASSERT_NE(pg, nullptr);
  TensorPtr x = produced(1 << 16, 1.0f);
  TensorPtr out = make<float>({1 << 16}, std::vector<float>(1 << 16, 0.0f), cuda(0));
  dp_tensor* outs[] = {out.get()};
  DP_EXPECT_OK(dp_pg_all_gather(pg, x.get(), outs, 1));
  EXPECT_EQ(read_on_stream(out.get()), filled(1 << 16, 1.0f));
  TensorPtr y = produced(1 << 16, 5.0f);
  TensorPtr reduced = make<float>({1 << 16}, std::vector<float>(1 << 16, 0.0f), cuda(0));
  const dp_tensor* ins[] = {y.get()};
  DP_EXPECT_OK(dp_pg_reduce_scatter(pg, ins, 1, reduced.get(), DP_SUM));
  EXPECT_EQ(read_on_stream(reduced.get()), filled(1 << 16, 5.0f));
  dp_process_group_destroy(pg);
}

TEST_F(CudaStreamOrder, FreedMemoryIsNotReusedBeforeTheStreamPassesTheFree) {
  const size_t n = 1 << 20;
  // Pinned, so that the read below stays queued (into pageable memory it
  // would return only once done).
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess);
  auto* seen_data = static_cast<float*>(pinned);
  std::memset(seen_data, 0, n * sizeof(float));
  {
    TensorPtr x = make<float>({static_cast<int64_t>(n)}, filled(n, 1.0f), cuda(0));
    DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), stream_, hold_stream, nullptr));
    ASSERT_EQ(cudaMemcpyAsync(seen_data, dp_tensor_data(x.get()), n * sizeof(float), cudaMemcpyDeviceToHost, s()),
              cudaSuccess);
  }  // freed while the queued read still has to run
  std::vector<TensorPtr> reused;
  for (int i = 0; i < 4; ++i) {
    dp_tensor* t = nullptr;
    int64_t shape = static_cast<int64_t>(n);
    DP_ASSERT_OK(dp_tensor_create(&t, DP_FLOAT32, 1, &shape, cuda(0)));  // zero-filled
    reused.emplace_back(t);
  }
  ASSERT_EQ(cudaStreamSynchronize(s()), cudaSuccess);
  std::vector<float> seen(seen_data, seen_data + n);
  cudaFreeHost(seen_data);
  EXPECT_EQ(seen, filled(n, 1.0f)) << "the freed block was handed out again before the queued read";
}

// A host thread capturing a CUDA graph in the global mode (CUDA's default)
// forbids synchronizing calls on every thread whose mode is not relaxed. The
// library's work on running streams, on the capturing thread and on another,
// neither fails nor breaks the host's capture.
TEST_F(CudaStreamOrder, LibraryWorkBesideAHostsGlobalCaptureSucceedsAndTheCaptureStaysValid) {
  cudaStream_t capturing = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking), cudaSuccess);
  void* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&scratch, 256), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(scratch, 1, 256, capturing), cudaSuccess);
  // This thread: its current stream (stream_) is not the one capturing.
  TensorPtr mine = make<float>({4096}, filled(4096, 3.0f), cuda(0));
  EXPECT_EQ(values<float>(mine.get()), filled(4096, 3.0f));
  mine.reset();
  std::vector<float> seen;
  std::thread other([&] {
    EXPECT_EQ(dp_set_current_stream(cuda(0), stream_), DP_OK) << dp_last_error();
    TensorPtr x = make<float>({1 << 16}, filled(1 << 16, 2.0f), cuda(0));
    seen = values<float>(x.get());
    x.reset();
    EXPECT_EQ(dp_set_current_stream(cuda(0), nullptr), DP_OK);
  });
  other.join();
  EXPECT_EQ(seen, filled(1 << 16, 2.0f));
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(capturing, &graph), cudaSuccess);
  EXPECT_NE(graph, nullptr);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaFree(scratch);
  cudaStreamDestroy(capturing);
}

// During a capture most CUDA calls are refused and break the host's capture:
// the library only asks whether the stream is capturing, refuses, and the
// host's graph still ends cleanly.
TEST_F(CudaStreamOrder, AStreamUnderGraphCaptureIsRefusedAndTheHostsCaptureSurvives) {
  cudaStream_t capturing = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking), cudaSuccess);
  TensorPtr x = make<float>({4}, filled(4, 1.0f), cuda(0));
  // Made current while running, captured afterwards: the copy is refused.
  DP_ASSERT_OK(dp_set_current_stream(cuda(0), capturing));
  ASSERT_EQ(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  std::vector<float> host(4);
  EXPECT_EQ(dp_tensor_copy_to_host(x.get(), host.data(), sizeof(float) * host.size()), DP_ESTATE);
  EXPECT_NE(last_error().find("captured into a CUDA graph"), std::string::npos) << last_error();
  // Made current while capturing: refused at once.
  EXPECT_EQ(dp_set_current_stream(cuda(0), capturing), DP_ESTATE);
  EXPECT_NE(last_error().find("argument 'stream' is being captured into a CUDA graph"), std::string::npos)
      << last_error();
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(capturing, &graph), cudaSuccess);
  if (graph != nullptr) cudaGraphDestroy(graph);
  EXPECT_EQ(dp_set_current_stream(cuda(0), stream_), DP_OK);
  cudaStreamDestroy(capturing);
}

// With no current stream, the library orders after the legacy default
// stream; while the host captures a blocking stream, that stream cannot be
// used: a copy is refused with DP_ESTATE, a free still returns, and the
// host's capture stays valid (an event recorded on the legacy stream would
// have invalidated it).
TEST_F(CudaStreamOrder, NoCurrentStreamDuringABlockingCaptureLeavesTheCaptureValid) {
  DP_ASSERT_OK(dp_set_current_stream(cuda(0), nullptr));
  TensorPtr x = make<float>({1024}, filled(1024, 1.0f), cuda(0));
  TensorPtr y = make<float>({1024}, filled(1024, 2.0f), cuda(0));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t blocking = nullptr;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);  // blocking: synchronizes with the legacy stream
  ASSERT_EQ(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(dp_tensor_data(y.get()), 0, 1024 * sizeof(float), blocking), cudaSuccess);
  std::vector<float> host(1024);
  EXPECT_EQ(dp_tensor_copy_to_host(x.get(), host.data(), sizeof(float) * host.size()), DP_ESTATE);
  EXPECT_NE(last_error().find("legacy default stream"), std::string::npos) << last_error();
  x.reset();  // a free without a current stream
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(blocking, &graph), cudaSuccess) << "the host's capture was invalidated";
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  cudaStreamDestroy(blocking);
  EXPECT_EQ(values<float>(y.get()), filled(1024, 2.0f));  // captured, never run
}

// A free with no current stream during a blocking capture cannot record on
// the legacy stream; the block waits until the capture has ended, so that a
// read queued before the free still sees the freed tensor's values, however
// another thread allocates meanwhile.
TEST_F(CudaStreamOrder, AFreeDuringABlockingCaptureIsNotReusedBeforeTheQueuedRead) {
  const size_t n = 1 << 20;
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess);
  auto* seen_data = static_cast<float*>(pinned);
  std::memset(seen_data, 0, n * sizeof(float));
  DP_ASSERT_OK(dp_set_current_stream(cuda(0), nullptr));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t reading = nullptr, capturing = nullptr;
  ASSERT_EQ(cudaStreamCreate(&reading), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&capturing), cudaSuccess);
  {
    TensorPtr x = make<float>({static_cast<int64_t>(n)}, filled(n, 1.0f), cuda(0));
    DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), reading, hold_stream, nullptr));
    ASSERT_EQ(cudaMemcpyAsync(seen_data, dp_tensor_data(x.get()), n * sizeof(float), cudaMemcpyDeviceToHost, reading),
              cudaSuccess);
    ASSERT_EQ(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  }  // freed during the capture, with no current stream, while the read is queued
  std::vector<TensorPtr> reused;
  std::thread other([&] {
    EXPECT_EQ(dp_set_current_stream(cuda(0), stream_), DP_OK) << dp_last_error();
    for (int i = 0; i < 4; ++i) {
      dp_tensor* t = nullptr;
      int64_t shape = static_cast<int64_t>(n);
      EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 1, &shape, cuda(0)), DP_OK) << dp_last_error();  // zero-filled
      reused.emplace_back(t);
    }
    EXPECT_EQ(dp_set_current_stream(cuda(0), nullptr), DP_OK);
  });
  other.join();
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(capturing, &graph), cudaSuccess) << "the host's capture was invalidated";
  if (graph != nullptr) cudaGraphDestroy(graph);
  ASSERT_EQ(cudaStreamSynchronize(reading), cudaSuccess);
  std::vector<float> seen(seen_data, seen_data + n);
  cudaFreeHost(seen_data);
  cudaStreamDestroy(capturing);
  cudaStreamDestroy(reading);
  EXPECT_EQ(seen, filled(n, 1.0f)) << "the block freed during the capture was handed out before the queued read";
}

}  // namespace

namespace {

// Holds a stream until the test opens it (at most two minutes, so that a
// failing test cannot hang the stream for good).
struct StreamGate {
  std::atomic<bool> open{false};
  static void hold(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(2);
    while (!gate->open.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
};

// Opens the gate however the test ends.
struct OpenOnExit {
  StreamGate* gate;
  ~OpenOnExit() { gate->open = true; }
};

// Runs `call` on a thread of its own with `stream` current there: "" for
// DP_OK, else the error.
template <typename Call>
std::future<std::string> on_thread(void* stream, Call call) {
  return std::async(std::launch::async, [stream, call] {
    dp_status st = dp_set_current_stream(cuda(0), stream);
    if (st == DP_OK) st = call();
    return st == DP_OK ? std::string() : std::string(dp_last_error());
  });
}

// Whether `call` returned within 60 s while `gate` still held `stream`;
// opens the gate either way.
bool returned_while_held(std::future<std::string>& call, StreamGate* gate, cudaStream_t stream) {
  const bool returned = call.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the gate let go early: the test proves nothing";
  gate->open = true;
  return returned;
}

}  // namespace

// dp_fsdp_unshard and post_backward + finish_backward return while the host's
// stream is still held before the shard (and the gradient) it wrote: their
// work is queued after that stream, and the stream sees their results.
TEST_F(CudaStreamOrder, FsdpUnshardAndPostBackwardReturnWhileTheHostsStreamIsHeldAndItSeesTheirResults) {
  dp_process_group* pg = nccl_group_of_one();
  ASSERT_NE(pg, nullptr);
  const int64_t rows = 64, cols = 256;
  const size_t n = static_cast<size_t>(rows * cols);
  dp_module* m = nullptr;
  DP_ASSERT_OK(dp_module_create(&m));
  TensorPtr w = make<float>({rows, cols}, std::vector<float>(n, 0.0f), cuda(0));
  DP_ASSERT_OK(dp_module_register_parameter(m, "w", w.get(), 1));
  dp_fsdp* f = nullptr;
  DP_ASSERT_OK(dp_fsdp_create(&f, m, pg, nullptr));
  dp_tensor* shard_handle = nullptr;
  DP_ASSERT_OK(dp_fsdp_shard(f, 0, &shard_handle));
  TensorPtr shard(shard_handle);
  // Static: a host function may still read its gate after a failed test returns.
  static StreamGate gates[2];
  StreamGate* first = &gates[0];
  StreamGate* second = &gates[1];
  first->open = false;
  second->open = false;
  OpenOnExit open_first{first}, open_second{second};
  PinnedFloats new_shard(filled(n, 3.0f)), grad_values(filled(n, 100.0f));

  // The host's optimizer writes the shard on its stream, held before the write.
  DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), stream_, StreamGate::hold, first));
  ASSERT_EQ(
      cudaMemcpyAsync(dp_tensor_data(shard.get()), new_shard.data, n * sizeof(float), cudaMemcpyHostToDevice, s()),
      cudaSuccess);
  auto unshard = on_thread(stream_, [f] { return dp_fsdp_unshard(f, 0); });
  ASSERT_TRUE(returned_while_held(unshard, first, s())) << "dp_fsdp_unshard waited for the host's held stream";
  ASSERT_EQ(unshard.get(), "");
  dp_tensor* full = nullptr;
  DP_ASSERT_OK(dp_module_get_parameter(m, "w", &full));
  TensorPtr full_owner(full);
  EXPECT_EQ(read_on_stream(full), filled(n, 3.0f));

  // The host's backward writes the full gradient on its held stream.
  dp_tensor* g = nullptr;
  DP_ASSERT_OK(dp_module_grad(m, "w", &g));
  TensorPtr grad(g);
  DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), stream_, StreamGate::hold, second));
  ASSERT_EQ(cudaMemcpyAsync(dp_tensor_data(g), grad_values.data, n * sizeof(float), cudaMemcpyHostToDevice, s()),
            cudaSuccess);
  auto backward = on_thread(stream_, [f] {
    dp_status st = dp_fsdp_post_backward(f);
    return st == DP_OK ? dp_fsdp_finish_backward(f) : st;
  });
  ASSERT_TRUE(returned_while_held(backward, second, s()))
      << "post_backward + finish_backward waited for the host's held stream";
  ASSERT_EQ(backward.get(), "");
  dp_tensor* shard_grad = nullptr;
  DP_ASSERT_OK(dp_fsdp_shard_grad(f, 0, &shard_grad));
  TensorPtr shard_grad_owner(shard_grad);
  EXPECT_EQ(read_on_stream(shard_grad), filled(n, 100.0f));
  dp_fsdp_destroy(f);
  dp_module_destroy(m);
  dp_process_group_destroy(pg);
}

// The library's GPU memory comes from a pool of its own that never makes one
// stream wait for another to reuse memory: the device's default pool may
// (cudaMemPoolReuseAllowInternalDependencies), and a dp_fsdp job's stream,
// which waits for the host's, could then hold up the library's own stream.
namespace {

// The stream-ordered pool `t`'s memory comes from, or null.
cudaMemPool_t pool_of(const dp_tensor* t) {
  using GetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t rc =
      cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &function, 12000, cudaEnableDefault, &found);
#else
  cudaError_t rc = cudaGetDriverEntryPoint("cuPointerGetAttribute", &function, cudaEnableDefault, &found);
#endif
  EXPECT_EQ(rc, cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSuccess);
  if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  CUmemoryPool pool = nullptr;
  const auto address = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(dp_tensor_data(t)));
  EXPECT_EQ(reinterpret_cast<GetAttribute>(function)(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, address),
            CUDA_SUCCESS);
  return reinterpret_cast<cudaMemPool_t>(pool);
}

// What a host function on a CUDA stream got from the library.
struct CallbackCalls {
  dp_tensor* tensor = nullptr;
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  dp_status copy = DP_OK, synchronize = DP_OK, current = DP_OK;
  std::string copy_error;
};

void call_cuda_from_callback(void* data) {
  auto* c = static_cast<CallbackCalls*>(data);
  float one = 1.0f;
  dp_status copy = dp_tensor_copy_from_host(c->tensor, &one, sizeof one);
  std::string copy_error = copy == DP_OK ? "" : dp_last_error();
  dp_status synchronize = dp_stream_synchronize(cuda(0), nullptr);
  dp_status current = dp_set_current_stream(cuda(0), nullptr);
  std::lock_guard<std::mutex> lock(c->mutex);
  c->copy = copy;
  c->copy_error = copy_error;
  c->synchronize = synchronize;
  c->current = current;
  c->done = true;
  c->finished.notify_all();
}

// CUDA forbids CUDA calls in a stream callback: the library refuses each
// such call with DP_ESTATE, at once, and the stream goes on.
TEST_F(CudaStreamOrder, AHostFunctionOnACudaStreamThatCallsTheLibraryForCudaIsEstate) {
  TensorPtr t = make<float>({1}, std::vector<float>{5.0f}, cuda(0));
  CallbackCalls c;
  c.tensor = t.get();
  DP_ASSERT_OK(dp_stream_launch_host_func(cuda(0), stream_, call_cuda_from_callback, &c));
  {
    std::unique_lock<std::mutex> lock(c.mutex);
    ASSERT_TRUE(c.finished.wait_for(lock, std::chrono::seconds(60), [&] { return c.done; }))
        << "the host function never finished";
  }
  EXPECT_EQ(c.copy, DP_ESTATE) << c.copy_error;
  EXPECT_NE(c.copy_error.find("CUDA stream callback"), std::string::npos) << c.copy_error;
  EXPECT_EQ(c.synchronize, DP_ESTATE);
  EXPECT_EQ(c.current, DP_ESTATE);
  DP_EXPECT_OK(dp_stream_synchronize(cuda(0), stream_));
  EXPECT_EQ(values<float>(t.get()), std::vector<float>{5.0f}) << "the refused copy wrote nothing";
}

}  // namespace

TEST_F(CudaStreamOrder, TensorsComeFromAPoolThatNeverMakesOneStreamWaitForAnother) {
  TensorPtr t = make<float>({1 << 20}, std::vector<float>(1 << 20, 0.0f), cuda(0));
  cudaMemPool_t pool = pool_of(t.get());
  ASSERT_NE(pool, nullptr) << "not from a stream-ordered pool";
  cudaMemPool_t default_pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&default_pool, 0), cudaSuccess);
  EXPECT_NE(pool, default_pool);
  int internal_dependencies = 1;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &internal_dependencies),
            cudaSuccess);
  EXPECT_EQ(internal_dependencies, 0);
}

// Peer access does not reach pool memory by itself: once two GPUs have
// exchanged data, each one's library pool is mapped for the other, so that
// in-process NCCL's kernels may use a peer's buffers directly.
TEST_F(CudaStreamOrder, APeerGpuReachesTheLibraryPoolOnceTheGpusExchangedData) {
  REQUIRE_GPUS(2);
  int can01 = 0, can10 = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can01, 0, 1), cudaSuccess);
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can10, 1, 0), cudaSuccess);
  if (can01 == 0 || can10 == 0) GTEST_SKIP() << "GPUs 0 and 1 have no peer access both ways";
  TensorPtr on0 = make<float>({1 << 20}, std::vector<float>(1 << 20, 1.0f), cuda(0));
  TensorPtr on1 = make<float>({1 << 20}, std::vector<float>(1 << 20, 2.0f), cuda(1));
  const dp_device from0[2] = {cuda(0), cuda(1)}, from1[2] = {cuda(1), cuda(0)};
  dp_tensor* out0[2] = {};
  dp_tensor* out1[2] = {};
  DP_ASSERT_OK(dp_broadcast(on0.get(), from0, 2, out0));
  TensorPtr keep00(out0[0]), keep01(out0[1]);
  DP_ASSERT_OK(dp_broadcast(on1.get(), from1, 2, out1));
  TensorPtr keep11(out1[0]), keep10(out1[1]);
  for (int gpu = 0; gpu < 2; ++gpu) {
    cudaMemPool_t pool = pool_of(gpu == 0 ? on0.get() : on1.get());
    ASSERT_NE(pool, nullptr);
    cudaMemLocation peer{};
    peer.type = cudaMemLocationTypeDevice;
    peer.id = 1 - gpu;
    cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
    ASSERT_EQ(cudaMemPoolGetAccess(&flags, pool, &peer), cudaSuccess);
    EXPECT_EQ(flags, cudaMemAccessFlagsProtReadWrite) << "GPU " << gpu << "'s pool, seen from GPU " << 1 - gpu;
  }
}
