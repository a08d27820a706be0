// Streams and events of cpu devices. In the default mode the library's cpu
// work runs on the calling thread and the legacy default stream is that
// thread itself; streams made with create_stream are queues run by their own
// thread. With DP_CPU_ASYNC=1 each cpu device behaves like a GPU for
// ordering: its default stream is a queue too, every queued task starts
// after a random delay (up to DP_CPU_ASYNC_DELAY_US, default 500 us), and
// fresh memory is poisoned, so work that reads before its producer finished
// reads garbage instead of passing by luck.
#pragma once

#include <cstdint>
#include <functional>

namespace dparallel::cpu {

// DP_CPU_ASYNC=1, read once.
bool async_mode();

void* create_stream(int32_t index);
void destroy_stream(void* stream) noexcept;
// kInvalidArgument naming `argument` unless `stream` is a live stream this
// process made for cpu:`index` (nullptr, the default stream, always is).
void check_stream(int32_t index, void* stream, const char* argument);
void stream_synchronize(int32_t index, void* stream);
void launch_host_func(int32_t index, void* stream, std::function<void()> fn);

// Ends the asynchronous mode's default streams after what they hold; the
// next use starts new ones. Streams from create_stream stay.
void stop_default_streams();
// Ends the threads of the streams from create_stream that have nothing
// queued or running; their next task starts a new one.
void park_idle_streams();

void* create_event();
void destroy_event(void* event) noexcept;
void record_event(void* event, int32_t index, void* stream);
void stream_wait_event(int32_t index, void* stream, void* event);
bool event_query(void* event);
void event_synchronize(void* event);

}  // namespace dparallel::cpu
