// A module's state dict (parameters and persistent buffers) and its
// safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "module/module.h"

namespace dparallel {

struct StateEntry {
  std::string name;
  Tensor value;
};

// torch's state_dict() order: per module in pre-order, its parameters then
// its persistent buffers; NULL slots left out, a shared tensor listed once.
std::vector<StateEntry> state_dict(Module& module);

// Writes a safetensors file (metadata {"format": "pt"}) through a temporary
// file renamed into place.
void save_module(Module& module, const std::string& path);

// Copies a safetensors file into the module's tensors. A key may name any
// path to a tensor (a shared one included). With `strict`, missing and
// unexpected keys are kInvalidArgument naming all of them; a shape or dtype
// mismatch always is. A malformed file is kIo. On any error the module is
// unchanged.
void load_module(Module& module, const std::string& path, bool strict);
// The same from a file image in memory; `origin` names it in messages.
void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict);

}  // namespace dparallel
