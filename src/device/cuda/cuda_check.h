// Turns CUDA runtime errors into kDevice errors that name the call, and
// switches devices without creating contexts nobody asked for.
#pragma once

#include <cuda_runtime_api.h>

#include <new>
#include <vector>

#include "core/error.h"
#include "core/stream.h"
#include "device/cuda/device_switch.h"

namespace dparallel::cuda {

inline void check(cudaError_t result, const char* call) {
  if (result != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    fail(StatusCode::kDevice, call, " failed: ", cudaGetErrorString(result));
  }
}

// CUDA forbids CUDA calls in a stream callback (cudaLaunchHostFunc): a host
// function queued there that calls the library gets kState, not a hang or a
// broken context.
inline void refuse_in_stream_callback() {
  if (running_host_function_of(DeviceType::kCuda)) {
    fail(StatusCode::kState,
         "a host function running as a CUDA stream callback (dp_stream_launch_host_func) called a function "
         "that needs CUDA, which CUDA forbids there; call it from a host thread instead");
  }
}

// What the driver says, read through cudaGetDriverEntryPoint: libcuda is
// never linked, so the library loads on machines without a driver.
// Whether the calling thread has a current context (it chose a device).
Known thread_has_context() noexcept;
// Whether GPU `index`'s primary context exists (cuDevicePrimaryCtxGetState).
Known primary_context_active(int32_t index) noexcept;

// The calling thread's stream capture mode is relaxed for the scope (outside
// a DeviceGuard, engaged only where the thread has a context already: the
// exchange is not documented to leave a thread without one). While a
// host thread captures a CUDA graph in the global mode (the default), any
// other thread's synchronizing call fails and invalidates that capture; the
// library's own work (its streams, its threads) never goes into a host's
// graph, so it must neither fail nor break the host's capture.
class RelaxedCapture {
 public:
  // `now` false: engaged later, by engage().
  explicit RelaxedCapture(bool now = true) noexcept {
    if (now) engage();
  }
  ~RelaxedCapture() { release(); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

  void engage() noexcept {
    if (engaged_) return;
    mode_ = cudaStreamCaptureModeRelaxed;
    engaged_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
    if (!engaged_) cudaGetLastError();
  }
  // Puts the thread's own mode back.
  void release() noexcept {
    if (engaged_ && cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) cudaGetLastError();
    engaged_ = false;
  }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool engaged_ = false;
};

// Makes `index` current for the scope, with the capture mode relaxed (see
// RelaxedCapture). At its end the previous device comes
// back only where device_to_restore says so: a thread that never chose a
// device (the DDP comm thread, a group's worker, a C host's thread) stays on
// `index` rather than gaining a context on GPU 0.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t index) {
    refuse_in_stream_callback();
    const char* call = nullptr;
    check(enter(index, &call), call);
    relaxed_.engage();
  }
  // For teardown that must not throw: a failed switch is cleared, so no later
  // launch check reports it, and leaves the thread as it was; see ok().
  DeviceGuard(int32_t index, std::nothrow_t) noexcept {
    const char* call = nullptr;
    ok_ = enter(index, &call) == cudaSuccess;
    if (!ok_) cudaGetLastError();
    if (ok_) relaxed_.engage();
  }
  ~DeviceGuard() {
    relaxed_.release();  // before the switch back, as it was engaged after it
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

  // Engaged once `index` is current, so that the exchange never meets a
  // thread without a context.
  RelaxedCapture relaxed_{false};
  int32_t restore_ = -1;
  bool ok_ = true;
};

// The stream dparallel uses on a device (created once, non-blocking), or
// the one a LibraryWorkStaysQueued scope on this thread gives it.
cudaStream_t stream_of(int32_t index);
// The device's own library stream, whatever scope is open.
cudaStream_t device_stream_of(int32_t index);

// The library's own stream-ordered memory pool on GPU `index`, or null where
// the device has no memory pools. Not the device's default pool: when that
// one cannot grow, it serves an allocation on one stream with memory freed
// on another by making the first stream wait for the second
// (cudaMemPoolReuseAllowInternalDependencies), which near a full device
// would tie the library or control stream to a dp_fsdp job's stream, and so
// to the host's. The library's pool has that off (its frees complete at
// once, see deallocate); the default pool stands in where it cannot be made.
cudaMemPool_t library_pool(int32_t index);
// cudaMallocAsync from library_pool(index) (or the default pool where there
// is none) on `stream`; the device is the caller's current one.
cudaError_t malloc_async(int32_t index, void** data, size_t nbytes, cudaStream_t stream);
// Pinned host memory of at least `nbytes` from a process-wide cache, and
// back to it: cudaMallocHost and cudaFreeHost may wait for every kernel on
// the device (another group's NCCL kernel spinning for a peer among them),
// so they run once per block only, and blocks are never freed.
void* pinned_host_take(size_t nbytes);
void pinned_host_give(void* block) noexcept;
// Peer access between every pair of `devices` that allows it, each one's
// library pool mapped for the others too (peer access alone does not reach
// pool memory): in-process NCCL may have one GPU's kernels read and write
// another's buffers directly.
void connect_peers(const std::vector<int32_t>& devices);

// The end of a device-only library operation queued on `stream`: it waits
// for it unless a LibraryWorkStaysQueued scope is open on this thread.
inline void finish_library_work(cudaStream_t stream) {
  if (!library_work_stays_queued()) check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

}  // namespace dparallel::cuda
