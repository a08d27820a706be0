// Stream order at the library's boundary: PyTorch's current-stream contract.
//
// A thread may set a current stream per device (dp_set_current_stream). A
// call that touches tensors on that device starts its device work after the
// work queued so far on that stream, and the stream waits for the call's
// results, without the calling thread waiting for either. With none set, the
// call waits for the device's legacy default stream first and completes
// before returning. Every wait is an event through the device's runtime.
#pragma once

#include <vector>

#include "core/device.h"

namespace dparallel {

// This thread's current stream for `device`; nullptr where none is set.
void* current_stream(const Device& device);
// Sets (nullptr: clears) this thread's current stream for `device`; the
// runtime has checked the stream.
void set_current_stream(const Device& device, void* stream);

// The current streams of this thread, to hand to worker threads that run
// a host's callbacks for it (parallel_apply).
struct CurrentStreams {
  std::vector<std::pair<Device, void*>> streams;
};
CurrentStreams capture_current_streams();
// Makes `captured` current on this thread for the scope; restores after.
class CurrentStreamsScope {
 public:
  explicit CurrentStreamsScope(const CurrentStreams& captured);
  ~CurrentStreamsScope();
  CurrentStreamsScope(const CurrentStreamsScope&) = delete;
  CurrentStreamsScope& operator=(const CurrentStreamsScope&) = delete;

 private:
  CurrentStreams previous_;
};

// An event of one device's runtime, released on destruction.
class Event {
 public:
  explicit Event(const Device& device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;

  const Device& device() const { return device_; }
  void record(void* stream);
  // Work queued on `stream` of this event's device after this waits for it.
  void block(void* stream) const;
  bool query() const;
  void synchronize() const;

 private:
  Device device_;
  void* handle_ = nullptr;
};

// One call's stream order on its devices: construct before the call's
// device work (it waits for the host's streams), finish() after it (the
// host's streams wait for the call's work, or the call waits for it when no
// stream is set). Devices may repeat.
class StreamOrder {
 public:
  // kDeferred: on devices that queue the library's work, the library stream
  // does not wait for the host's streams here; the events are kept for the
  // caller (take_deferred) to hand to the work that reads the host's
  // tensors, so that the library's other work meanwhile never waits for the
  // host's (a dp_fsdp job makes the library stream wait when it starts).
  enum class HostWait { kNow, kDeferred };
  explicit StreamOrder(const std::vector<Device>& devices, HostWait host_wait = HostWait::kNow);
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Makes `stream` of `device` (a stream of the library's other than the
  // library stream, e.g. a process group's) wait for the host's work too.
  void also_order(const Device& device, void* stream);
  // The host's events a kDeferred order kept (empty otherwise).
  std::vector<Event> take_deferred() { return std::move(deferred_); }
  void finish();

 private:
  struct Entry {
    Device device;
    void* host_stream;  // the current stream, nullptr when none is set
  };
  std::vector<Entry> entries_;
  std::vector<Event> deferred_;
};

// Makes the library stream of each event's device wait for it (the events
// of a kDeferred StreamOrder, at the start of the work they order).
void library_streams_wait(const std::vector<Event>& host_ready);

// While it lives, the library's work on `device` from this thread goes to
// `stream` instead of the device's library stream, and on devices that
// queue the library's work (DeviceRuntime::library_work_is_queued) it stays
// queued: device-only copies within the device, fills, kernels and
// allocations return without waiting for it; copies to or from the host or
// another device still wait. Whoever uses the results later follows
// `stream` through an event; frees made inside the scope follow it too (the
// allocator records on the library stream the thread sees).
class LibraryWorkStaysQueued {
 public:
  LibraryWorkStaysQueued(const Device& device, void* stream);
  ~LibraryWorkStaysQueued();
  LibraryWorkStaysQueued(const LibraryWorkStaysQueued&) = delete;
  LibraryWorkStaysQueued& operator=(const LibraryWorkStaysQueued&) = delete;

 private:
  bool previous_active_;
  Device previous_device_;
  void* previous_stream_;
};
// Whether a LibraryWorkStaysQueued scope is open on this thread (the device
// runtimes ask before waiting for their library stream).
bool library_work_stays_queued();
// The stream such a scope gives the library's work on `device`, or nullptr
// (the device runtimes' library stream then, as ever).
void* library_stream_override(const Device& device);

// While it lives, this thread runs a host function queued on `stream` of
// `device` (dp_stream_launch_host_func): work queued on that stream after it
// cannot start before it returns, so nothing here may wait for that work.
class HostFunctionScope {
 public:
  HostFunctionScope(const Device& device, void* stream) noexcept;
  ~HostFunctionScope();
  HostFunctionScope(const HostFunctionScope&) = delete;
  HostFunctionScope& operator=(const HostFunctionScope&) = delete;

 private:
  bool previous_active_;
  Device previous_device_;
  void* previous_stream_;
};
// kState unless the calling thread may order after `stream` of `device`:
// a host function running on that very stream would wait for itself, and
// one running in a CUDA stream callback must not call CUDA at all.
void refuse_ordering_inside_host_function(const Device& device, void* stream);
// Whether this thread runs a host function queued on a stream of `type`.
bool running_host_function_of(DeviceType type);

// The test-only switch DP_TEST_SKIP_STREAM_WAIT=1 drops the wait for the
// host's stream at every call's start, so a test can show the asynchronous
// cpu mode catches exactly that mistake. Never set it otherwise.
bool skipping_stream_waits_for_tests();

}  // namespace dparallel
