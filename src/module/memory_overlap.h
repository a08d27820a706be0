// Where parameters' memory overlaps: a dp_ddp and a dp_fsdp refuse two
// managed parameters over overlapping memory (their gradients would be
// reduced twice, or their shards cut apart), and a dp_ddp checks its
// gradients against each other and the values again after one moves.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "module/module.h"

namespace dparallel {

// Memory a parameter's value or gradient covers; `param` is the caller's index.
struct MemorySpan {
  Device device;
  const char* start;
  size_t nbytes;
  size_t param;
  bool grad;
};

// Two of `spans` (sorted here) that overlap, at least one a gradient unless
// `values_too`; none when they lie apart.
std::optional<std::pair<MemorySpan, MemorySpan>> first_overlap(std::vector<MemorySpan>& spans, bool values_too);

// kInvalidArgument naming the first two of `params` whose values overlap
// (tied weights are one Parameter, listed once, so never two of them).
void check_values_apart(const std::vector<std::pair<std::string, const Parameter*>>& params);

}  // namespace dparallel
