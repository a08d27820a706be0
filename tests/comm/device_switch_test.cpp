// Which device a DeviceGuard puts back when it ends, decided without a GPU.
#include "device/cuda/device_switch.h"

#include <gtest/gtest.h>

namespace dparallel::cuda {
namespace {

TEST(CudaDeviceSwitch, RestoresOnlyADeviceTheThreadChoseWhoseContextExists) {
  // A thread that had chosen cuda:2 (its context is current) gets it back.
  EXPECT_EQ(device_to_restore(2, 1, Known::kYes, Known::kYes), 2);
  // The DDP comm thread, a group's worker, a C host's thread: cudaGetDevice
  // says 0, but no device was chosen; restoring would make a context on GPU 0.
  EXPECT_EQ(device_to_restore(0, 3, Known::kNo, Known::kYes), -1);
  EXPECT_EQ(device_to_restore(0, 3, Known::kNo, Known::kNo), -1);
  // MaybeSetDevice: never make a primary context only to restore it.
  EXPECT_EQ(device_to_restore(0, 3, Known::kYes, Known::kNo), -1);
  EXPECT_EQ(device_to_restore(0, 3, Known::kUnknown, Known::kNo), -1);
  // Nothing switched, nothing to restore.
  EXPECT_EQ(device_to_restore(1, 1, Known::kYes, Known::kYes), -1);
  EXPECT_EQ(device_to_restore(-1, 1, Known::kYes, Known::kYes), -1);
}

TEST(CudaDeviceSwitch, WithoutTheDriverEntryPointsRestoresAsBefore) {
  EXPECT_EQ(device_to_restore(0, 1, Known::kUnknown, Known::kUnknown), 0);
  EXPECT_EQ(device_to_restore(2, 1, Known::kYes, Known::kUnknown), 2);
}

}  // namespace
}  // namespace dparallel::cuda
