// fully_shard's full parameters on a GPU: one address for the dp_fsdp's
// life, their memory given back at reshard where the driver has virtual
// memory management (VMM), kept with DP_CUDA_VMM=0 (the fallback).
// cudaMemGetInfo measures the device's own free memory. Skips without a
// GPU; tests/gpu/check.sh runs it both ways.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "module/module_test_util.h"
#include "test_util.h"
#include "thread_ranks.h"

namespace {

constexpr int64_t kRows = 4096;
constexpr int64_t kCols = 4096;  // 64 MiB of float32
constexpr size_t kBytes = static_cast<size_t>(kRows * kCols) * sizeof(float);
// What else may move the device's free memory meanwhile (the library's
// pools, NCCL): far below one parameter.
constexpr size_t kSlack = size_t{16} << 20;

size_t free_bytes() {
  size_t free = 0;
  size_t total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return free;
}

std::vector<float> pattern(int cycle) {
  std::vector<float> v(static_cast<size_t>(kRows * kCols));
  for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(k % 977) * 0.25f + static_cast<float>(cycle);
  return v;
}

std::vector<float> read(const dp_tensor* t) {
  std::vector<float> out(static_cast<size_t>(dp_tensor_numel(t)));
  EXPECT_EQ(dp_tensor_copy_to_host(t, out.data(), out.size() * sizeof(float)), DP_OK) << dp_last_error();
  return out;
}

bool vmm_turned_off() {
  const char* v = std::getenv("DP_CUDA_VMM");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

}  // namespace

// Many unshard (async, then waited for) / reshard cycles of one 64 MiB
// parameter on cuda:0, the shard rewritten between them: the full
// parameter's address never changes, a handle taken at the first unshard
// reads each cycle's values once unsharded, and the device's free memory
// drops by the parameter at each unshard and comes back at each reshard
// (with DP_CUDA_VMM=0 it stays taken: the documented fallback).
TEST(CudaFsdpFullAddress, FullParameterKeepsOneAddressAndItsMemoryGoesAtReshard) {
  if (dptest::cuda_count() < 1) GTEST_SKIP() << "needs 1 GPU(s), found 0";
  const bool released = !vmm_turned_off();
  dptest::run_thread_ranks(
      "fsdp_cuda_", 1, dptest::RankOptions{DP_BACKEND_NCCL, 60000, true}, [&](int, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        {
          dptest::TensorPtr w = dptest::make<float>({kRows, kCols}, pattern(0), dptest::cuda(0));
          ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
        }
        dp_fsdp* raw = nullptr;
        ASSERT_EQ(dp_fsdp_create(&raw, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        dptest::FsdpPtr f(raw);
        dptest::TensorPtr first;
        const void* address = nullptr;
        for (int cycle = 0; cycle < 8; ++cycle) {
          SCOPED_TRACE("cycle " + std::to_string(cycle));
          const size_t before = free_bytes();
          ASSERT_EQ(dp_fsdp_unshard(f.get(), 1), DP_OK) << dp_last_error();
          ASSERT_EQ(dp_fsdp_wait_unshard(f.get()), DP_OK) << dp_last_error();
          dptest::TensorPtr full = dptest::parameter(m.get(), "weight");
          ASSERT_TRUE(full);
          if (cycle == 0) {
            address = dp_tensor_data(full.get());
            first = std::move(full);
          } else {
            EXPECT_EQ(dp_tensor_data(full.get()), address);
          }
          EXPECT_EQ(read(first.get()), pattern(cycle)) << "the first unshard's handle";
          const size_t unsharded = free_bytes();
          if (released) {
            EXPECT_GE(before + kSlack, unsharded + kBytes) << "the unshard took less than the parameter";
          }
          ASSERT_EQ(dp_fsdp_reshard(f.get()), DP_OK) << dp_last_error();
          // The pages go once the work queued before the reshard is done,
          // from a thread of the library's where it was not yet.
          size_t resharded = free_bytes();
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (released && resharded + kSlack < unsharded + kBytes && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            resharded = free_bytes();
          }
          if (released) {
            EXPECT_GE(resharded + kSlack, unsharded + kBytes) << "the reshard gave back less than the parameter";
          } else {
            EXPECT_LE(resharded, unsharded + kSlack) << "without VMM the memory stays";
          }
          // The optimizer's step: this one rank's shard is the whole parameter.
          dp_tensor* shard = nullptr;
          ASSERT_EQ(dp_fsdp_shard(f.get(), 0, &shard), DP_OK) << dp_last_error();
          dptest::TensorPtr owned(shard);
          const std::vector<float> next = pattern(cycle + 1);
          ASSERT_EQ(dp_tensor_copy_from_host(shard, next.data(), next.size() * sizeof(float)), DP_OK)
              << dp_last_error();
        }
        first.reset();
        f.reset();
      });
}
