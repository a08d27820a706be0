/* dparallel — base types, status codes, devices and dtypes.
 *
 * Conventions for the whole C ABI (written once, followed everywhere):
 * - Every fallible function returns dp_status: DP_OK (0) or a negative code,
 *   and on failure sets this thread's dp_last_error() message, which names the
 *   offending argument and the values involved.
 * - A handle that comes out through a first out-parameter (`**out`) is a new
 *   owned reference; release it with the matching `_destroy`, which accepts
 *   NULL. Arrays of output handles are caller-allocated and filled with new
 *   references. The only borrowed handles are those a callback receives for
 *   the length of the call (dp_forward_fn, dp_comm_hook_fn,
 *   dp_bucket_reduced_fn); each says so.
 * - On failure: a handle out-parameter is set to NULL (when the pointer to it
 *   is not itself NULL), value out-parameters and caller-allocated output
 *   arrays are left untouched, no handle is created and nothing leaks. Inputs
 *   are unchanged, with one exception: a call that writes tensors in place
 *   (the dp_pg_* collectives and the in-process "_into" calls) may leave them
 *   partly written when it fails after the transfer began. A failed
 *   dp_tensor_from_blob/dp_tensor_from_dlpack leaves the memory with the
 *   caller (the deleter is not called).
 * - Handles are checked for NULL and for their type. Using a handle after its
 *   `_destroy` (or destroying it twice) is undefined behaviour, as in libgit2
 *   and zstd: the library may notice, but cannot promise to.
 * - No exception, abort or exit ever crosses this ABI.
 *
 * docs/CONVENTIONS.md states these rules in full, with their exceptions.
 *
 * Thread safety: functions in this header are safe to call from any thread.
 */
#ifndef DPARALLEL_DP_BASE_H
#define DPARALLEL_DP_BASE_H

#include <stddef.h>
#include <stdint.h>

#include "dparallel/dp_export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DP_VERSION_MAJOR 0
#define DP_VERSION_MINOR 1
#define DP_VERSION_PATCH 0

typedef int32_t dp_status;
enum {
  DP_OK = 0,
  DP_EINVAL = -1,       /* bad argument, null handle, shape/dtype/device mismatch */
  DP_ENOMEM = -2,       /* an allocation failed */
  DP_EDEVICE = -3,      /* device missing, or a driver failure */
  DP_ETIMEOUT = -4,     /* a blocking call ran past its timeout */
  DP_EREMOTE = -5,      /* a peer failed or disconnected */
  DP_EUSER = -6,        /* a host callback returned non-zero */
  DP_EIO = -7,          /* file or socket I/O failed, or malformed data */
  DP_ESTATE = -8,       /* the call is not valid in the object's current state */
  DP_EUNSUPPORTED = -9, /* valid request this build or device cannot do */
  DP_EINTERNAL = -10    /* a bug in dparallel; please report it */
};

/* Static text for a status code ("unknown status" for an unknown one). */
DP_API const char *dp_status_string(dp_status status);
/* This thread's last failure message; "" if this thread has had none.
 * Valid until this thread's next failing dparallel call. */
DP_API const char *dp_last_error(void);
/* DP_VERSION_MAJOR*10000 + DP_VERSION_MINOR*100 + DP_VERSION_PATCH of the
 * library actually loaded. */
DP_API uint32_t dp_version_number(void);

/* Device types share DLPack's codes. */
typedef enum dp_device_type { DP_DEVICE_CPU = 1, DP_DEVICE_CUDA = 2 } dp_device_type;
typedef struct dp_device {
  int32_t type;  /* dp_device_type */
  int32_t index; /* >= 0 */
} dp_device;

/* CUDA: GPUs present (0 when none or when built without CUDA).
 * CPU: the number of logical CPU devices allowed (cpu:0 .. cpu:n-1): each has
 * its own allocations and one persistent worker thread, created on first use.
 * The default is 64; the environment variable DP_NUM_CPU_DEVICES overrides it
 * (1..4096), read once at first use. */
DP_API dp_status dp_device_count(int32_t type, int32_t *out);
/* Parses "cpu", "cpu:3", "cuda", "cuda:1" ("cpu" and "cuda" mean index 0).
 * Does not check that the device exists. */
DP_API dp_status dp_device_parse(const char *text, dp_device *out);
/* Writes "cpu:3" or "cuda:1" with a terminating NUL; DP_EINVAL if `cap` is
 * too small (the message says how much is needed). */
DP_API dp_status dp_device_format(dp_device device, char *buf, size_t cap);

/* Memory of a device's tensors: what the library allocated for them (memory
 * a host lends through dp_tensor_from_blob or DLPack is not counted; this
 * rank's part of a process group's shared memory for gradients, buckets or
 * shards is, while held, rounded up to whole 4 KiB pages), in bytes as
 * requested: in use now, the most in use at once since the last
 * dp_device_reset_peak_memory (or since the start), and the freed blocks
 * the library keeps for reuse (all devices together; DP_CACHE_LIMIT_MB).
 * Set struct_size; fields past it are not written. Any thread. */
typedef struct dp_memory_stats {
  size_t struct_size;
  uint64_t allocated_bytes;
  uint64_t peak_allocated_bytes;
  uint64_t cached_bytes;
} dp_memory_stats;
DP_API dp_status dp_device_memory_stats(dp_device device, dp_memory_stats *out);
DP_API dp_status dp_device_reset_peak_memory(dp_device device);

/* Ends the threads the library keeps for itself: one worker per device that
 * ran a forward (parallel_apply, data_parallel, replica sets), the compute
 * pool, with DP_CPU_ASYNC=1 the cpu default streams, and the comm lane of
 * every process group whose dp_ddp and dp_fsdp are idle (nothing issued or
 * running; the thread comm hooks and on_bucket_reduced run on). Each first
 * runs what it has queued; the call returns once they have all ended, so a
 * runtime that waits at exit for threads it has seen (Mono, the JVM) does
 * not wait on them. Safe to call twice, and from any thread but those (a
 * forward or host function calling it is DP_ESTATE); a later call that needs
 * them starts them again; so do the threads of streams from
 * dp_stream_create with nothing queued. A lane or stream at work keeps its
 * thread, and threads that belong to other handles (a process group's async
 * worker, stores) end when the handle is destroyed. */
DP_API dp_status dp_shutdown(void);

typedef enum dp_dtype {
  DP_FLOAT32 = 0,
  DP_FLOAT64 = 1,
  DP_FLOAT16 = 2,
  DP_BFLOAT16 = 3,
  DP_INT8 = 4,
  DP_UINT8 = 5,
  DP_INT32 = 6,
  DP_INT64 = 7,
  DP_BOOL = 8
} dp_dtype;
/* Bytes per element; 0 for an unknown dtype. */
DP_API size_t dp_dtype_size(int32_t dtype);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_BASE_H */
