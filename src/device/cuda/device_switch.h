// Whether a DeviceGuard puts the thread's previous device back when it ends.
// Pure, so that a test decides the cases without a GPU.
#pragma once

#include <cstdint>

namespace dparallel::cuda {

// An answer from the driver that may be missing (an old driver without the entry point).
enum class Known { kNo, kYes, kUnknown };

// The device to make current again after a guard switched from `previous`
// to `used`, or -1 to leave the thread on `used`. Making a device current
// creates its primary context (about 0.5 GB since CUDA 12, and an error in
// exclusive-process mode), so, as PyTorch's MaybeSetDevice, a device is
// restored only when the thread had chosen one (it had a current context)
// and that device's primary context already exists. Unknown answers restore,
// as the guard did before it could ask.
inline int32_t device_to_restore(int32_t previous, int32_t used, Known thread_had_context,
                                 Known previous_primary_active) {
  if (previous == used || previous < 0) return -1;
  if (thread_had_context == Known::kNo) return -1;
  if (previous_primary_active == Known::kNo) return -1;
  return previous;
}

}  // namespace dparallel::cuda
