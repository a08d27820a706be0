// What a reduction does to floating tensors on their own device, for the
// dp_ddp hooks and the dp_fsdp reduce-scatter alike.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace dparallel::lane {

// dst = src converted: the same element count and device, floating dtypes
// (a copy when they are the same dtype).
void cast_into(const Tensor& dst, const Tensor& src);
// t /= divisor, in place, on t's device (floating dtypes).
void divide_tensor(const Tensor& t, int64_t divisor);

}  // namespace dparallel::lane
