// In-process GPU collectives below the C ABI. Compiled always; each test
// skips cleanly without the GPUs it needs.
#include <gtest/gtest.h>

#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "comm/comm.h"

namespace dparallel::comm {
namespace {

#define REQUIRE_GPUS(n) \
  if (cuda::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda::device_count()

Tensor filled(const std::vector<int32_t>& values, const Device& device) {
  Tensor host = Tensor::empty(DType::kInt32, {static_cast<int64_t>(values.size())}, Device{DeviceType::kCpu, 0});
  std::copy(values.begin(), values.end(), static_cast<int32_t*>(host.data()));
  return device.is_cpu() ? host : host.to(device);
}

std::vector<int32_t> read(const Tensor& t) {
  Tensor host = t.to(Device{DeviceType::kCpu, 0});
  const auto* p = static_cast<const int32_t*>(host.data());
  return std::vector<int32_t>(p, p + host.numel());
}

// Through NCCL (every device a distinct GPU, the source among them), an output
// on the source's GPU that is not the source itself must be written too.
TEST(CudaCommInternal, BroadcastIntoWritesAnOutputBesideTheSourceOnItsGpu) {
  REQUIRE_GPUS(2);
  const Device gpu0{DeviceType::kCuda, 0}, gpu1{DeviceType::kCuda, 1};
  Tensor source = filled({1, 2, 3, 4, 5}, gpu0);
  Tensor beside = filled({0, 0, 0, 0, 0}, gpu0);
  Tensor remote = filled({0, 0, 0, 0, 0}, gpu1);
  broadcast_into(source, {beside, remote});
  EXPECT_EQ(read(beside), (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(read(remote), (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

}  // namespace
}  // namespace dparallel::comm
