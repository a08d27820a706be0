// The NCCL group's failure messages. Free of NCCL and CUDA, so that CPU-only
// tests cover them; the header its ranks all-gather before each collective,
// and the checks on it, are the process group's (call_header.h).
#pragma once

#include <string>

#include "core/error.h"

namespace dparallel::dist::nccl {

// The message of a collective that failed or timed out on this rank.
inline std::string failure_message(const char* op, const std::string& tensor, int32_t rank, int32_t size,
                                   const std::string& cause, const std::string& missing) {
  return str_cat(op, tensor.empty() ? "" : " of ", tensor, " on rank ", rank, " of ", size, " ", cause,
                 "; the communicator was aborted: ", missing);
}

}  // namespace dparallel::dist::nccl
