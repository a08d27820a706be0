// What fully_shard's state dicts (fsdp_state_dict.cpp) and the sharded-load
// planning (sharded_load_plan.cpp) share: the keys a sharded save writes and
// the module's state dict entries with the dp_fsdp that hold them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/fully_shard.h"
#include "module/module.h"
#include "module/state_dict.h"

namespace dparallel::fsdp {

inline constexpr const char* kShardedFormat = "dp-fsdp-sharded";
inline constexpr const char* kRowsKey = "dp.rows.";
inline constexpr const char* kSaveIdKey = "dp.save_id";

// A state dict entry and, when a dp_fsdp holds it, which one and its index there.
struct Held {
  StateEntry entry;
  std::shared_ptr<FullyShard> holder;
  size_t index = 0;
  bool sharded() const { return holder && !holder->full_shape(index).empty(); }
};

// state_dict(module), each entry with the dp_fsdp that holds it (if any).
std::vector<Held> held_state(Module& module);

// A load writes the shards: not while they are read as full parameters (or
// in flight to be), here or, with views, on the other ranks. kState naming
// `name` otherwise.
void check_resharded(const FullyShard& holder, const std::string& name);

}  // namespace dparallel::fsdp
