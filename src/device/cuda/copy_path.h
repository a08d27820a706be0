// How copy_rows moves a block of rows, and how large batched_copy's kept
// chunk table grows: host decisions with no CUDA in them, so that a test
// decides the cases without a GPU.
#pragma once

#include <cstddef>

namespace dparallel::cuda {

enum class CopyPath {
  kLinear,    // one 1-D copy of rows * row_bytes bytes (one row, or rows back to back)
  kPitched,   // one 2-D copy with the pitches
  kRowByRow,  // a 1-D copy per row: a pitch beyond the device's maximum
};

// cudaMemcpy2DAsync refuses a pitch or width above the device's maximum
// pitch (cudaDevAttrMaxPitch, 2^31 - 1 bytes on current GPUs), so a single
// copy of 2 GiB or more cannot go through it as one row of pitch nbytes.
inline CopyPath copy_path(size_t rows, size_t dst_pitch, size_t src_pitch, size_t row_bytes, size_t max_pitch) {
  if (rows <= 1 || (dst_pitch == row_bytes && src_pitch == row_bytes)) return CopyPath::kLinear;
  if (dst_pitch <= max_pitch && src_pitch <= max_pitch && row_bytes <= max_pitch) return CopyPath::kPitched;
  return CopyPath::kRowByRow;
}

// The capacity batched_copy's kept table on a device grows to for a plan of
// `needed` bytes, from `current`: doubled (at least 4 KiB), so that a run of
// growing plans reallocates a few times only; never shrinks.
inline size_t copy_table_capacity(size_t needed, size_t current) {
  if (needed <= current) return current;
  size_t capacity = current < 4096 ? 4096 : current;
  while (capacity < needed) capacity *= 2;
  return capacity;
}

}  // namespace dparallel::cuda
