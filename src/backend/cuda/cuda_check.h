// Turns CUDA runtime errors into kDevice errors that name the call.
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace dparallel::cuda {

inline void check(cudaError_t result, const char* call) {
  if (result != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    fail(StatusCode::kDevice, call, " failed: ", cudaGetErrorString(result));
  }
}

// Makes `index` current for the scope and restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t index) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != index) check(cudaSetDevice(index), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The stream dparallel uses on a device (created once, non-blocking).
cudaStream_t stream_of(int32_t index);

}  // namespace dparallel::cuda
