// Streams and events of cuda devices: the cuda side of DeviceRuntime's
// stream and event calls (see core/device_runtime.h for their contract).
#pragma once

#include <cstdint>
#include <functional>

namespace dparallel::cuda {

void* create_stream(int32_t index);
void destroy_stream(int32_t index, void* stream) noexcept;
void check_stream(int32_t index, void* stream, const char* argument);
void stream_synchronize(int32_t index, void* stream);
void launch_host_func(int32_t index, void* stream, std::function<void()> fn);
void* create_event(int32_t index);
void destroy_event(void* event) noexcept;
void record_event(void* event, int32_t index, void* stream);
void stream_wait_event(int32_t index, void* stream, void* event);
bool event_query(void* event);
void event_synchronize(void* event);

}  // namespace dparallel::cuda
