// Streams and events of cuda devices for the core's DeviceRuntime.
#include "device/cuda/cuda_streams.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <new>
#include <optional>

#include "device/cuda/cuda_check.h"
#include "device/cuda/event_devices.h"

namespace dparallel::cuda {

namespace {

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(void* event) { return static_cast<cudaEvent_t>(event); }

// A stream under capture into a CUDA graph takes events and waits into the
// graph, not the timeline the library orders against: refuse it plainly.
void refuse_capturing(void* stream, const char* what) {
  if (stream == nullptr) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(as_stream(stream), &status), "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone) {
    fail(StatusCode::kState, what,
         ": the stream is being captured into a CUDA graph; dparallel orders its work against running streams only");
  }
}

// The legacy default stream (null) of the current device while a blocking
// stream there is being captured into a CUDA graph: recording or waiting
// on it would fail with cudaErrorStreamCaptureImplicit and invalidate the
// host's capture. Asked first, by a query that leaves the capture alone.
void refuse_legacy_during_capture(void* stream, const char* what) {
  if (stream != nullptr) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t rc = cudaStreamIsCapturing(cudaStreamLegacy, &status);
  if (rc == cudaSuccess) return;
  cudaGetLastError();
  if (rc == cudaErrorStreamCaptureImplicit) {
    fail(StatusCode::kState, what,
         ": no current stream is set, and the legacy default stream cannot be used while a blocking stream is being "
         "captured into a CUDA graph; set a current stream (dp_set_current_stream)");
  }
  check(rc, "cudaStreamIsCapturing");
}

EventDevices& event_devices() {
  static auto* table = new EventDevices();  // as long as the process: events may outlive static destructors
  return *table;
}

// The event's device made current for the scope, where the library made
// the event (see event_devices.h); a failed switch leaves the thread as it was.
class EventDeviceGuard {
 public:
  explicit EventDeviceGuard(void* event) {
    const int32_t index = event_devices().device_of(event);
    if (index >= 0) guard_.emplace(index, std::nothrow);
  }

 private:
  std::optional<DeviceGuard> guard_;
};

void host_func_trampoline(void* data) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(data));
  (*fn)();
}

}  // namespace

void* create_stream(int32_t index) {
  DeviceGuard guard(index);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return stream;
}

void destroy_stream(int32_t index, void* stream) noexcept {
  if (stream == nullptr) return;
  // The stream's device, made current first: a thread's first CUDA call
  // would otherwise make a context on GPU 0 (and a failed switch is cleared).
  DeviceGuard guard(index, std::nothrow);
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  cudaStreamSynchronize(as_stream(stream));
  cudaStreamDestroy(as_stream(stream));
}

void check_stream(int32_t index, void* stream, const char* argument) {
  refuse_in_stream_callback();
  if (stream == nullptr) return;
  // First, and alone: during a capture most queries (cudaStreamGetDevice
  // among them) are refused and invalidate the host's capture.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t status = cudaStreamIsCapturing(as_stream(stream), &capture);
  if (status == cudaErrorStreamCaptureImplicit) {
    cudaGetLastError();
    fail(StatusCode::kState, "argument '", argument,
         "' is the legacy default stream while a blocking stream is being captured into a CUDA graph");
  }
  if (status == cudaSuccess && capture != cudaStreamCaptureStatusNone) {
    fail(StatusCode::kState, "argument '", argument,
         "' is being captured into a CUDA graph; dparallel orders its work against running streams only");
  }
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  int device = -1;
  if (status == cudaSuccess) status = cudaStreamGetDevice(as_stream(stream), &device);
  if (status != cudaSuccess) {
    cudaGetLastError();
    fail(StatusCode::kInvalidArgument, "argument '", argument, "' is not a usable cudaStream_t (",
         cudaGetErrorString(status), ")");
  }
  if (device != index) {
    fail(StatusCode::kInvalidArgument, "argument '", argument, "' is a stream of cuda:", device,
         ", not of cuda:", index);
  }
}

void stream_synchronize(int32_t index, void* stream) {
  DeviceGuard guard(index);
  check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void launch_host_func(int32_t index, void* stream, std::function<void()> fn) {
  DeviceGuard guard(index);
  auto* boxed = new std::function<void()>(std::move(fn));
  cudaError_t status = cudaLaunchHostFunc(as_stream(stream), host_func_trampoline, boxed);
  if (status != cudaSuccess) {
    delete boxed;
    check(status, "cudaLaunchHostFunc");
  }
}

void* create_event(int32_t index) {
  DeviceGuard guard(index);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  try {
    event_devices().remember(event, index);
  } catch (...) {
    cudaEventDestroy(event);
    throw;
  }
  return event;
}

void destroy_event(void* event) noexcept {
  if (event == nullptr) return;
  EventDeviceGuard guard(event);
  // Forgotten first: once destroyed, its handle may come back for another event.
  event_devices().forget(event);
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  cudaEventDestroy(as_event(event));
}

void record_event(void* event, int32_t index, void* stream) {
  refuse_capturing(stream, "recording an event");
  DeviceGuard guard(index);
  refuse_legacy_during_capture(stream, "recording an event");
  check(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
}

void stream_wait_event(int32_t index, void* stream, void* event) {
  refuse_capturing(stream, "waiting for an event");
  DeviceGuard guard(index);
  refuse_legacy_during_capture(stream, "waiting for an event");
  check(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
}

bool event_query(void* event) {
  EventDeviceGuard guard(event);
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  cudaError_t status = cudaEventQuery(as_event(event));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void event_synchronize(void* event) {
  EventDeviceGuard guard(event);
  RelaxedCapture relaxed(thread_has_context() == Known::kYes);
  check(cudaEventSynchronize(as_event(event)), "cudaEventSynchronize");
}

}  // namespace dparallel::cuda
