// The dp_fsdp handle, for the capi/ files and tests that reach its sharding.
#pragma once

#include <memory>

#include "core/process_origin.h"
#include "fsdp/fully_shard.h"

constexpr uint64_t kFsdpTag = 0x6470'6673'6470'2121ull;  // "dpfsdp!!"

struct dp_fsdp {
  uint64_t tag = kFsdpTag;
  std::shared_ptr<dparallel::fsdp::FullyShard> sharding;
  dparallel::ProcessOrigin origin;
};
