// What a dp_ddp and a dp_fsdp agree on at creation: every rank's
// description of what it manages, and rank 0's values.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/process_group.h"

namespace dparallel::lane {

std::vector<std::string> split_lines(const std::string& text);

// Collective: every rank's `mine`, in rank order.
std::vector<std::string> all_gather_strings(dist::ProcessGroup& group, const std::string& mine);

// Collective: every rank all-gathers every rank's description and fails the
// same way on the first difference from rank 0 (kInvalidArgument naming
// both lines), or on the lowest rank's own error (a first line "error ...").
void check_agreement(dist::ProcessGroup& group, const std::vector<std::string>& description);

// Collective: `tensors` from `root`, coalesced per dtype in chunks.
void broadcast_tensors(dist::ProcessGroup& group, const std::vector<Tensor>& tensors, int32_t root);

}  // namespace dparallel::lane
