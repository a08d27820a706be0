// Element-wise reductions of two host buffers, for every dtype and op, in
// the form Gloo's algorithms call: out[i] = a[i] (op) b[i], n elements.
// float16 and bfloat16 compute in float32 and round; bool sum/max are or,
// prod/min are and.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// DP_AVG reduces as a sum; divide afterwards with divide_in_place.
ReduceFn reduce_function(DType dtype, ReduceOp op);
// out[i] = (a[i] + b[i]) / 2 in one pass, the same bits as the sum and then
// divide_in_place by 2; null for dtypes other than float32 and float64.
ReduceFn average_of_two_function(DType dtype);
// data[i] /= divisor (integers truncate toward zero).
void divide_in_place(DType dtype, void* data, size_t n, int64_t divisor);
// out[i] = data[i] / divisor: divide_in_place's bits, written elsewhere in the same pass.
void divide_into(DType dtype, void* out, const void* data, size_t n, int64_t divisor);

}  // namespace dparallel::dist
