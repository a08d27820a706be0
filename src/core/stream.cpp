#include "core/stream.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "core/device_runtime.h"
#include "core/error.h"

namespace dparallel {

namespace {

thread_local CurrentStreams t_current;
struct QueuedScope {
  bool active = false;
  Device device;
  void* stream = nullptr;
};
thread_local QueuedScope t_queued_scope;
struct RunningHostFunction {
  bool active = false;
  Device device;
  void* stream = nullptr;
};
thread_local RunningHostFunction t_host_function;

std::string stream_name(void* stream) {
  if (stream == nullptr) return "the legacy default stream";
  std::ostringstream name;
  name << "stream " << stream;
  return name.str();
}

}  // namespace

void* current_stream(const Device& device) {
  for (const auto& [d, stream] : t_current.streams) {
    if (d == device) return stream;
  }
  return nullptr;
}

void set_current_stream(const Device& device, void* stream) {
  auto& streams = t_current.streams;
  auto it = std::find_if(streams.begin(), streams.end(), [&](const auto& entry) { return entry.first == device; });
  if (stream == nullptr) {
    if (it != streams.end()) streams.erase(it);
  } else if (it != streams.end()) {
    it->second = stream;
  } else {
    streams.emplace_back(device, stream);
  }
}

CurrentStreams capture_current_streams() { return t_current; }

CurrentStreamsScope::CurrentStreamsScope(const CurrentStreams& captured) : previous_(t_current) {
  t_current = captured;
}

CurrentStreamsScope::~CurrentStreamsScope() { t_current = std::move(previous_); }

Event::Event(const Device& device) : device_(device) {
  handle_ = device_runtime(device.type).create_event(device.index);
}

Event::~Event() {
  if (handle_ == nullptr) return;
  if (const DeviceRuntime* runtime = find_device_runtime(device_.type)) runtime->destroy_event(handle_);
}

Event::Event(Event&& other) noexcept : device_(other.device_), handle_(std::exchange(other.handle_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event dying(std::move(*this));
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Event::record(void* stream) { device_runtime(device_.type).record_event(handle_, device_.index, stream); }

void Event::block(void* stream) const {
  device_runtime(device_.type).stream_wait_event(device_.index, stream, handle_);
}

bool Event::query() const { return device_runtime(device_.type).event_query(handle_); }

void Event::synchronize() const { device_runtime(device_.type).event_synchronize(handle_); }

LibraryWorkStaysQueued::LibraryWorkStaysQueued(const Device& device, void* stream)
    : previous_active_(t_queued_scope.active),
      previous_device_(t_queued_scope.device),
      previous_stream_(t_queued_scope.stream) {
  t_queued_scope = {true, device, stream};
}

LibraryWorkStaysQueued::~LibraryWorkStaysQueued() {
  t_queued_scope = {previous_active_, previous_device_, previous_stream_};
}

bool library_work_stays_queued() { return t_queued_scope.active; }

void* library_stream_override(const Device& device) {
  return t_queued_scope.active && t_queued_scope.device == device ? t_queued_scope.stream : nullptr;
}

HostFunctionScope::HostFunctionScope(const Device& device, void* stream) noexcept
    : previous_active_(t_host_function.active),
      previous_device_(t_host_function.device),
      previous_stream_(t_host_function.stream) {
  t_host_function = {true, device, stream};
}

HostFunctionScope::~HostFunctionScope() { t_host_function = {previous_active_, previous_device_, previous_stream_}; }

bool running_host_function_of(DeviceType type) { return t_host_function.active && t_host_function.device.type == type; }

void refuse_ordering_inside_host_function(const Device& device, void* stream) {
  const RunningHostFunction& running = t_host_function;
  if (!running.active) return;
  if (running.device.type == DeviceType::kCuda && device.type == DeviceType::kCuda) {
    fail(StatusCode::kState, "a host function running as a CUDA stream callback (dp_stream_launch_host_func on ",
         stream_name(running.stream), " of ", to_string(running.device), ") called a function that uses ",
         to_string(device), ", but CUDA allows no CUDA call there; call it from a host thread instead");
  }
  if (running.device == device && running.stream == stream) {
    fail(StatusCode::kState, "a host function running on ", stream_name(stream), " of ", to_string(device),
         " called a function that orders its work after that same stream, so it would wait for the host "
         "function itself; call it from another thread, or make another stream current first");
  }
}

bool skipping_stream_waits_for_tests() {
  static const bool skip = [] {
    const char* text = std::getenv("DP_TEST_SKIP_STREAM_WAIT");
    return text != nullptr && text[0] == '1' && text[1] == '\0';
  }();
  return skip;
}

namespace {

// An event after the work queued so far on `host_stream` of `device` (NULL:
// the legacy default), or none where nothing can be pending there.
std::optional<Event> host_work_event(const Device& device, void* host_stream) {
  if (host_stream == nullptr && !device_runtime(device.type).default_stream_is_queued()) return std::nullopt;
  refuse_ordering_inside_host_function(device, host_stream);
  if (skipping_stream_waits_for_tests()) return std::nullopt;
  std::optional<Event> ready(std::in_place, device);
  ready->record(host_stream);
  return ready;
}

}  // namespace

StreamOrder::StreamOrder(const std::vector<Device>& devices, HostWait host_wait) {
  for (const Device& device : devices) {
    bool seen = std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.device == device; });
    if (seen) continue;
    void* host_stream = current_stream(device);
    entries_.push_back({device, host_stream});
    std::optional<Event> ready = host_work_event(device, host_stream);
    if (!ready) continue;
    const DeviceRuntime& runtime = device_runtime(device.type);
    if (runtime.library_work_is_queued() && host_wait == HostWait::kDeferred) {
      deferred_.push_back(std::move(*ready));
    } else if (runtime.library_work_is_queued()) {
      ready->block(runtime.library_stream(device.index));
    } else {
      ready->synchronize();  // the library's work for this device runs on this thread
    }
  }
}

void StreamOrder::also_order(const Device& device, void* stream) {
  if (std::optional<Event> ready = host_work_event(device, current_stream(device))) ready->block(stream);
}

void library_streams_wait(const std::vector<Event>& host_ready) {
  for (const Event& e : host_ready) e.block(device_runtime(e.device().type).library_stream(e.device().index));
}

void StreamOrder::finish() {
  for (const Entry& entry : entries_) {
    const DeviceRuntime& runtime = device_runtime(entry.device.type);
    if (!runtime.library_work_is_queued()) continue;  // done on this thread already
    Event done(entry.device);
    done.record(runtime.library_stream(entry.device.index));
    if (entry.host_stream != nullptr) {
      done.block(entry.host_stream);
    } else {
      done.synchronize();
    }
  }
}

}  // namespace dparallel
