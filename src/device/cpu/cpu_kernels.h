// Host kernels: copies and sums that use every compute thread.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace dparallel::cpu {

void parallel_copy(void* dst, const void* src, size_t nbytes);
void parallel_zero(void* dst, size_t nbytes);
// Copies src into every dst, reading each block of src once for all of them.
void copy_to_many(void* const* dsts, size_t ndsts, const void* src, size_t nbytes);
// rows x row_bytes from src (rows src_pitch apart) to dst (dst_pitch apart).
void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows);
// out = inputs[0] + ... + inputs[count-1], element-wise, summed left to right.
// float16/bfloat16 accumulate in float32 and round once; bool is logical or;
// integers wrap. `out` may alias inputs[0].
void add_n(DType dtype, void* out, const void* const* inputs, size_t count, size_t numel);

}  // namespace dparallel::cpu
