// A sharded load's plan: every file of the save opened and checked against
// its manifest, and the byte ranges each rank copies into its tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "fsdp/save_manifest.h"
#include "fsdp/state_dict_entries.h"

namespace dparallel::fsdp {

// A byte range of a piece to copy into a tensor.
struct Copy {
  Tensor target;
  size_t target_offset;
  size_t file;
  uint64_t offset;  // into the file's data section
  size_t bytes;
};

struct ShardedLoad {
  std::vector<std::unique_ptr<StateFileReader>> files;
  std::vector<Copy> copies;
};

// Plans every copy and checks everything it reads (the manifest, the files,
// the checksums of the pieces the copies read): an error leaves the module
// unchanged.
ShardedLoad plan_sharded_load(const std::vector<Held>& state, const std::string& folder);

}  // namespace dparallel::fsdp
