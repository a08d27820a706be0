// The CUDA runtime's side of the backend on a GPU: its memory pool and
// device guards. Built only with CUDA; each test skips without the GPUs it
// needs.
#include "device/cuda/cuda_runtime.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <thread>

#include "core/device_runtime.h"
#include "device/cuda/cuda_check.h"

namespace dparallel::cuda {
namespace {

#define REQUIRE_GPUS(n) \
  if (device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << device_count()

// The library's pool keeps freed memory across a synchronize (its release
// threshold is not 0), so the next allocation maps nothing anew.
TEST(CudaPool, TheLibraryPoolKeepsFreedMemoryAcrossASynchronize) {
  REQUIRE_GPUS(1);
  DeviceGuard guard(0);
  cudaMemPool_t pool = library_pool(0);
  if (pool == nullptr) GTEST_SKIP() << "cuda:0 has no memory pools";
  cudaStream_t stream = device_stream_of(0);
  void* p = nullptr;
  const size_t n = size_t{64} << 20;
  ASSERT_EQ(malloc_async(0, &p, n, stream), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(p, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  uint64_t reserved = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved), cudaSuccess);
  EXPECT_GE(reserved, n) << "the pool gave its memory back to the driver at the synchronize";
}

// A thread that never chose a device and queries an event of cuda:1 makes
// cuda:1 current, not GPU 0 (which would cost a context there).
TEST(CudaStreams, AFreshThreadQueryingAnEventOfGpu1StaysOffGpu0) {
  REQUIRE_GPUS(2);
  const DeviceRuntime& runtime = device_runtime(DeviceType::kCuda);
  void* event = runtime.create_event(1);
  runtime.record_event(event, 1, runtime.library_stream(1));
  int current = -1;
  std::thread([&] {
    runtime.event_synchronize(event);
    EXPECT_TRUE(runtime.event_query(event));
    cudaGetDevice(&current);
  }).join();
  EXPECT_EQ(current, 1);
  std::thread([&] {
    runtime.destroy_event(event);
    cudaGetDevice(&current);
  }).join();
  EXPECT_EQ(current, 1);
}

}  // namespace
}  // namespace dparallel::cuda
