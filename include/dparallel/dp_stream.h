/* dparallel — streams: PyTorch's current-stream contract.
 *
 * A stream is a queue of device work: a cudaStream_t for cuda devices, a
 * queue run by a host thread of its own for cpu devices (from
 * dp_stream_create). NULL is a device's legacy default stream.
 *
 * dp_set_current_stream makes `stream` current for `device` on the calling
 * thread. Every later call on this thread that touches tensors on that
 * device then starts its device work after the work queued so far on that
 * stream (an event, never a host wait on cuda), and the stream waits for
 * the call's results: the host queues its next work on the stream without
 * synchronising. An _async collective's results are the exception: they
 * are final once dp_work_wait returns (dp_dist.h). With none set (or after
 * setting NULL), a call waits for the legacy default stream first and
 * completes before it returns.
 * dp_parallel_apply runs each replica's callback with the caller's current
 * streams current; dp_ddp_mark_grad_ready uses the marking thread's.
 *
 * Memory freed while a current stream is set (or, on cuda, the legacy
 * default stream) is reused only once that stream has passed the point of
 * the free, so destroying a tensor that queued work still reads is safe.
 *
 * With the environment variable DP_CPU_ASYNC=1 every cpu device behaves as
 * a GPU does for ordering: its legacy default stream is a queue too, queued
 * work starts after a random delay of up to DP_CPU_ASYNC_DELAY_US
 * microseconds (default 500), and uninitialised memory is filled with
 * all-ones bytes (NaN for floats). Meant for tests: it makes a host's
 * missing wait fail on a machine without a GPU.
 *
 * CUDA graphs: the library's work never goes into a host's graph. A stream
 * being captured is refused with DP_ESTATE wherever a call would order
 * against it (dp_set_current_stream, the dp_stream_* calls below, and any
 * call while it is current), and the refusal leaves the capture valid.
 * While a host thread captures in CUDA's default global mode, the library's
 * calls on any thread (on streams not being captured) work as usual and do
 * not invalidate the capture: the library's CUDA calls run with the
 * thread's capture mode relaxed. A graph must not keep using a tensor the
 * library frees. With no current stream set, a tensor freed while a
 * blocking stream is being captured keeps its memory until the capture has
 * ended and the legacy default stream has passed the free.
 *
 * Thread safety: current streams are per thread. A stream may be used from
 * any thread. A cpu stream destroyed while still current on another thread
 * makes that thread's next call DP_EINVAL, saying so; a cudaStream_t
 * destroyed while in use is the caller's to prevent, as in CUDA.
 */
#ifndef DPARALLEL_DP_STREAM_H
#define DPARALLEL_DP_STREAM_H

#include "dparallel/dp_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DP_EINVAL when `stream` is not a stream of `device` (a cpu stream from
 * dp_stream_create not yet destroyed; a cudaStream_t of that GPU); DP_ESTATE
 * for a cudaStream_t being captured into a CUDA graph. */
DP_API dp_status dp_set_current_stream(dp_device device, void *stream);
/* *out = this thread's current stream for `device`, NULL when none is set. */
DP_API dp_status dp_get_current_stream(dp_device device, void **out);

/* A new stream of `device`: for cuda a non-blocking cudaStream_t, for cpu a
 * queue with a thread of its own. */
DP_API dp_status dp_stream_create(dp_device device, void **out);
/* Waits for the stream's queued work, then frees it (a host function may
 * destroy its own stream: the stream then ends after its queued work, on
 * another thread); NULL does nothing. Clears it as this thread's current
 * stream. Queued work that waits on something that never comes makes this
 * wait as long. */
DP_API dp_status dp_stream_destroy(dp_device device, void *stream);
/* Returns once the work queued so far on `stream` is done. */
DP_API dp_status dp_stream_synchronize(dp_device device, void *stream);
/* Queues fn(user_data) on `stream`: it runs on a host thread after the work
 * queued before it, and work queued after it waits for it (cuda:
 * cudaLaunchHostFunc; fn must not call CUDA). On a cpu device's legacy
 * default stream outside DP_CPU_ASYNC=1, fn runs before this returns.
 * Inside fn, a call that would order after `stream` itself (one with
 * `stream` current, or with none current on a default stream that is a
 * queue) would wait for fn: it returns DP_ESTATE instead; so does, on a
 * cuda device, any call that needs CUDA. */
DP_API dp_status dp_stream_launch_host_func(dp_device device, void *stream, void (*fn)(void *user_data),
                                            void *user_data);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_STREAM_H */
