// How batched_copy shares its segments among thread blocks: host code with no
// CUDA in it, so that a test checks the plan without a GPU, and the kernel
// only follows it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "device/cuda/cuda_runtime.h"

namespace dparallel::cuda {

// One block's share of a segment: `head` bytes one at a time, up to where
// both pointers are `width`-aligned, then whole words of `width` bytes, then
// the bytes left over.
struct CopyChunk {
  char* dst;
  const char* src;
  size_t nbytes;
  uint32_t width;  // 16, 8, 4, 2 or 1
  uint32_t head;   // < width, <= nbytes
};

// Chunks are 64 KiB to 1 MiB: enough blocks to fill the GPU from one large
// segment, few enough that each block's setup is small beside its copy.
constexpr size_t kMinCopyChunk = size_t{64} << 10;
constexpr size_t kMaxCopyChunk = size_t{1} << 20;
constexpr size_t kMaxCopyGrid = 2147483647;  // grid.x's limit; the kernel strides past it

// The widest word both pointers can be aligned to at once: their addresses
// must agree modulo the width. 1 when they differ by an odd amount.
inline uint32_t copy_width(uintptr_t dst, uintptr_t src) {
  uintptr_t skew = dst ^ src;  // low bits where the two misalignments differ
  for (uint32_t width : {16u, 8u, 4u, 2u}) {
    if ((skew & (width - 1)) == 0) return width;
  }
  return 1;
}

// Bytes from `dst` to the next multiple of `width` (a power of two), at most `nbytes`.
inline uint32_t copy_head(uintptr_t dst, uint32_t width, size_t nbytes) {
  size_t head = (width - (dst & (width - 1))) & (width - 1);
  return static_cast<uint32_t>(std::min(head, nbytes));
}

// The chunk size for `total` bytes spread over about `target_blocks`
// blocks, a multiple of 16 so that every chunk of a segment keeps the
// segment's alignment.
inline size_t copy_chunk_bytes(size_t total, size_t target_blocks) {
  size_t per = target_blocks == 0 ? kMaxCopyChunk : total / target_blocks;
  per = std::clamp(per, kMinCopyChunk, kMaxCopyChunk);
  return per / 16 * 16;
}

// Every non-empty segment cut into chunks in order; a segment shorter than
// a chunk is one chunk.
inline std::vector<CopyChunk> plan_batched_copy(const std::vector<Segment>& segments, size_t target_blocks) {
  size_t total = 0;
  for (const Segment& s : segments) {
    total =
        s.nbytes > std::numeric_limits<size_t>::max() - total ? std::numeric_limits<size_t>::max() : total + s.nbytes;
  }
  const size_t chunk = copy_chunk_bytes(total, target_blocks);
  size_t count = 0;
  for (const Segment& s : segments) count += s.nbytes / chunk + (s.nbytes % chunk != 0 ? 1 : 0);
  std::vector<CopyChunk> plan;
  plan.reserve(count);
  for (const Segment& s : segments) {
    auto* dst = static_cast<char*>(s.dst);
    const auto* src = static_cast<const char*>(s.src);
    const uint32_t width = copy_width(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src));
    size_t nbytes = 0;
    for (size_t offset = 0; offset < s.nbytes; offset += nbytes) {  // never past nbytes: no wrap
      nbytes = std::min(chunk, s.nbytes - offset);
      plan.push_back(CopyChunk{dst + offset, src + offset, nbytes, width,
                               copy_head(reinterpret_cast<uintptr_t>(dst + offset), width, nbytes)});
    }
  }
  return plan;
}

// Blocks to launch for `chunks` chunks (each block strides over the rest).
inline unsigned copy_grid(size_t chunks) { return static_cast<unsigned>(std::min(chunks, kMaxCopyGrid)); }

}  // namespace dparallel::cuda
