#include "device/cpu/cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/half.h"
#include "core/thread_pool.h"

namespace dparallel::cpu {

namespace {

// Below this a second thread costs more to wake than it saves.
constexpr size_t kParallelBytes = size_t{256} << 10;
// Elements summed per block, so that every input's block stays in L1/L2.
constexpr size_t kBlock = 2048;

template <typename T>
void add_block(T* out, const T* const* inputs, size_t count, size_t n) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wrap on overflow, without UB
    const U* a = reinterpret_cast<const U*>(inputs[0]);
    const U* b = reinterpret_cast<const U*>(inputs[1]);
    U* o = reinterpret_cast<U*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = static_cast<U>(a[i] + b[i]);
    for (size_t k = 2; k < count; ++k) {
      const U* c = reinterpret_cast<const U*>(inputs[k]);
      for (size_t i = 0; i < n; ++i) o[i] = static_cast<U>(o[i] + c[i]);
    }
  } else {
    const T* a = inputs[0];
    const T* b = inputs[1];
    for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    for (size_t k = 2; k < count; ++k) {
      const T* c = inputs[k];
      for (size_t i = 0; i < n; ++i) out[i] += c[i];
    }
  }
}

void or_block(uint8_t* out, const uint8_t* const* inputs, size_t count, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint8_t any = 0;
    for (size_t k = 0; k < count; ++k) any |= inputs[k][i];
    out[i] = any != 0 ? 1 : 0;
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void add_half_block(uint16_t* out, const uint16_t* const* inputs, size_t count, size_t n) {
  float acc[kBlock];
  for (size_t i = 0; i < n; ++i) acc[i] = ToFloat(inputs[0][i]);
  for (size_t k = 1; k < count; ++k) {
    const uint16_t* in = inputs[k];
    for (size_t i = 0; i < n; ++i) acc[i] += ToFloat(in[i]);
  }
  for (size_t i = 0; i < n; ++i) out[i] = FromFloat(acc[i]);
}

template <typename T, typename Block>
void add_blocks(void* out, const void* const* inputs, size_t count, size_t numel, Block block) {
  size_t nblocks = (numel + kBlock - 1) / kBlock;
  size_t blocks_per_grain = std::max<size_t>(1, kParallelBytes / (kBlock * sizeof(T)));
  parallel_range(nblocks, blocks_per_grain, [&](size_t first, size_t last) {
    const T* ptrs[64];
    std::vector<const T*> many;
    const T** in = ptrs;
    if (count > 64) {
      many.resize(count);
      in = many.data();
    }
    for (size_t b = first; b < last; ++b) {
      size_t begin = b * kBlock;
      size_t n = std::min(kBlock, numel - begin);
      for (size_t k = 0; k < count; ++k) in[k] = static_cast<const T*>(inputs[k]) + begin;
      block(static_cast<T*>(out) + begin, in, count, n);
    }
  });
}

template <typename T>
void add_typed(void* out, const void* const* inputs, size_t count, size_t numel) {
  add_blocks<T>(out, inputs, count, numel, add_block<T>);
}

}  // namespace

void parallel_copy(void* dst, const void* src, size_t nbytes) {
  if (nbytes < kParallelBytes) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  parallel_range(nbytes, kParallelBytes, [&](size_t begin, size_t end) {
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  });
}

void copy_to_many(void* const* dsts, size_t ndsts, const void* src, size_t nbytes) {
  if (ndsts == 1) {
    parallel_copy(dsts[0], src, nbytes);
    return;
  }
  // Blocks small enough that the source block is still in cache for the next destination.
  constexpr size_t kCopyBlock = size_t{64} << 10;
  size_t nblocks = (nbytes + kCopyBlock - 1) / kCopyBlock;
  parallel_range(nblocks, std::max<size_t>(1, kParallelBytes / kCopyBlock), [&](size_t first, size_t last) {
    for (size_t b = first; b < last; ++b) {
      size_t begin = b * kCopyBlock;
      size_t n = std::min(kCopyBlock, nbytes - begin);
      for (size_t d = 0; d < ndsts; ++d) {
        std::memcpy(static_cast<char*>(dsts[d]) + begin, static_cast<const char*>(src) + begin, n);
      }
    }
  });
}

void parallel_zero(void* dst, size_t nbytes) {
  parallel_range(nbytes, kParallelBytes,
                 [&](size_t begin, size_t end) { std::memset(static_cast<char*>(dst) + begin, 0, end - begin); });
}

void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows) {
  if (rows == 0 || row_bytes == 0) return;
  if (rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes)) {
    parallel_copy(dst, src, row_bytes * rows);
    return;
  }
  size_t rows_per_grain = std::max<size_t>(1, kParallelBytes / row_bytes);
  parallel_range(rows, rows_per_grain, [&](size_t first, size_t last) {
    for (size_t r = first; r < last; ++r) {
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, row_bytes);
    }
  });
}

void add_n(DType dtype, void* out, const void* const* inputs, size_t count, size_t numel) {
  if (numel == 0 || count == 0) return;
  if (count == 1) {
    if (out != inputs[0]) parallel_copy(out, inputs[0], numel * dtype_size(dtype));
    return;
  }
  switch (dtype) {
    case DType::kFloat32:
      return add_typed<float>(out, inputs, count, numel);
    case DType::kFloat64:
      return add_typed<double>(out, inputs, count, numel);
    case DType::kInt8:
      return add_typed<int8_t>(out, inputs, count, numel);
    case DType::kUInt8:
      return add_typed<uint8_t>(out, inputs, count, numel);
    case DType::kInt32:
      return add_typed<int32_t>(out, inputs, count, numel);
    case DType::kInt64:
      return add_typed<int64_t>(out, inputs, count, numel);
    case DType::kBool:
      return add_blocks<uint8_t>(out, inputs, count, numel, or_block);
    case DType::kFloat16:
      return add_blocks<uint16_t>(out, inputs, count, numel, add_half_block<half_to_float, float_to_half>);
    case DType::kBFloat16:
      return add_blocks<uint16_t>(out, inputs, count, numel, add_half_block<bfloat16_to_float, float_to_bfloat16>);
  }
}

}  // namespace dparallel::cpu
