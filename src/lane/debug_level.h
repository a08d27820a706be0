// DP_DEBUG: how much a dp_ddp and a dp_fsdp write to stderr about their
// plans and their failures.
#pragma once

namespace dparallel::lane {

enum class DebugLevel { kOff, kInfo, kDetail };

// DP_DEBUG=INFO or DETAIL (any case); anything else, or unset, is kOff.
DebugLevel debug_level_from_env();

}  // namespace dparallel::lane
