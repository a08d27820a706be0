// Turns CUDA runtime errors into kDevice errors that name the call, and
// switches devices without creating contexts nobody asked for.
#pragma once

#include <cuda_runtime_api.h>

#include <new>

#include "backend/cuda/device_switch.h"
#include "core/error.h"

namespace dparallel::cuda {

inline void check(cudaError_t result, const char* call) {
  if (result != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    fail(StatusCode::kDevice, call, " failed: ", cudaGetErrorString(result));
  }
}

// What the driver says, read through cudaGetDriverEntryPoint: libcuda is
// never linked, so the library loads on machines without a driver.
// Whether the calling thread has a current context (it chose a device).
Known thread_has_context() noexcept;
// Whether GPU `index`'s primary context exists (cuDevicePrimaryCtxGetState).
Known primary_context_active(int32_t index) noexcept;

// Makes `index` current for the scope. At its end the previous device comes
// back only where device_to_restore says so: a thread that never chose a
// device (the DDP comm thread, a group's worker, a C host's thread) stays on
// `index` rather than gaining a context on GPU 0.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t index) {
    const char* call = nullptr;
    check(enter(index, &call), call);
  }
  // For teardown that must not throw: a failed switch is cleared, so no later
  // launch check reports it, and leaves the thread as it was; see ok().
  DeviceGuard(int32_t index, std::nothrow_t) noexcept {
    const char* call = nullptr;
    ok_ = enter(index, &call) == cudaSuccess;
    if (!ok_) cudaGetLastError();
  }
  ~DeviceGuard() {
    if (restore_ >= 0 && cudaSetDevice(restore_) != cudaSuccess) cudaGetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // Whether `index` is current (always, for the throwing constructor).
  bool ok() const { return ok_; }

 private:
  cudaError_t enter(int32_t index, const char** call) noexcept {
    int previous = 0;
    *call = "cudaGetDevice";
    cudaError_t rc = cudaGetDevice(&previous);
    if (rc != cudaSuccess || previous == index) return rc;
    // Asked before the switch, which gives the thread a context.
    Known had_context = thread_has_context();
    Known primary = had_context == Known::kNo ? Known::kUnknown : primary_context_active(previous);
    *call = "cudaSetDevice";
    rc = cudaSetDevice(index);
    if (rc == cudaSuccess) restore_ = device_to_restore(previous, index, had_context, primary);
    return rc;
  }

  int32_t restore_ = -1;
  bool ok_ = true;
};

// The stream dparallel uses on a device (created once, non-blocking).
cudaStream_t stream_of(int32_t index);

}  // namespace dparallel::cuda
