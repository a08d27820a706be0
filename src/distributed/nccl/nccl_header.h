// What the NCCL group's ranks all-gather before each collective, and the
// checks on it. Free of NCCL and CUDA, so that CPU-only tests cover it.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "distributed/process_group.h"

namespace dparallel::dist::nccl {

enum class Kind : uint32_t { kAllReduce = 1, kBroadcast = 2, kAllGather = 3, kReduceScatter = 4, kBarrier = 5 };

struct Header {
  uint32_t kind;
  int32_t dtype;
  int32_t op;
  int32_t root;
  int64_t numel;
  uint64_t seq;
  uint8_t reserved[32];
};
static_assert(sizeof(Header) == 64, "the header is part of the wire format");

inline Header make_header(Kind kind, DType dtype, int64_t numel, uint64_t seq, ReduceOp op = ReduceOp::kSum,
                          int32_t root = -1) {
  Header h{};
  h.kind = static_cast<uint32_t>(kind);
  h.dtype = static_cast<int32_t>(dtype);
  h.op = static_cast<int32_t>(op);
  h.root = root;
  h.numel = numel;
  h.seq = seq;
  return h;
}

inline const char* kind_name(uint32_t kind) {
  static const char* names[] = {"?", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  return kind < 6 ? names[kind] : "?";
}

// Throws unless every rank's header matches `mine`. Out-of-step ranks are
// looked for first, over all ranks, so that every rank classifies the same
// mismatch the same way (kRemote breaks the group, kInvalid does not).
inline void check_headers(const Header& mine, const Header* all, int32_t rank, int32_t size) {
  const char* name = kind_name(mine.kind);
  for (int32_t r = 0; r < size; ++r) {
    const Header& h = all[r];
    if (h.kind != mine.kind || h.seq != mine.seq) {
      fail(StatusCode::kRemote, name, " (collective #", mine.seq, " of rank ", rank, "): rank ", r, " called ",
           kind_name(h.kind), " as its collective #", h.seq,
           "; every rank must issue the same collectives in the same order");
    }
  }
  for (int32_t r = 0; r < size; ++r) {
    const Header& h = all[r];
    if (h.numel != mine.numel || h.dtype != mine.dtype || h.op != mine.op || h.root != mine.root) {
      fail_invalid(name, ": arguments differ across ranks: rank ", rank, " has ", mine.numel, " elements of ",
                   dtype_name(static_cast<DType>(mine.dtype)), " (op ", reduce_op_name(static_cast<ReduceOp>(mine.op)),
                   ", root ", mine.root, "), rank ", r, " has ", h.numel, " elements of ",
                   dtype_name(static_cast<DType>(h.dtype)), " (op ", reduce_op_name(static_cast<ReduceOp>(h.op)),
                   ", root ", h.root, ")");
    }
  }
}

// The message of a collective that failed or timed out on this rank.
inline std::string failure_message(const char* op, const std::string& tensor, int32_t rank, int32_t size,
                                   const std::string& cause, const std::string& missing) {
  return str_cat(op, tensor.empty() ? "" : " of ", tensor, " on rank ", rank, " of ", size, " ", cause,
                 "; the communicator was aborted: ", missing);
}

}  // namespace dparallel::dist::nccl
