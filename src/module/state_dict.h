// A module's state dict (parameters and persistent buffers) and its
// safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
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
// file (mkstemp, short fixed prefix) renamed into place. A symbolic link is
// followed and kept; an existing target must be a regular file
// (kInvalidArgument) that is writable (kIo), and keeps its permissions.
void save_module(Module& module, const std::string& path);
// The same for `entries` (names unique) with `metadata` in the header.
void save_state(const std::vector<StateEntry>& entries, const std::map<std::string, std::string>& metadata,
                const std::string& path);

// Copies a safetensors file into the module's tensors. A key may name any
// path to a tensor (a shared one included). With `strict`, missing and
// unexpected keys are kInvalidArgument naming all of them; a shape or dtype
// mismatch always is. A path that is not a regular file is kInvalidArgument
// (a FIFO is never opened for a blocking read); a malformed file is kIo. The header is read and
// checked first, then each tensor's bytes are read straight into it. On any
// error found before that the module is unchanged; a read failure while
// copying (the file changed meanwhile) is kIo and may leave it partly loaded.
void load_module(Module& module, const std::string& path, bool strict);
// A whole safetensors file (a regular file, as load_module checks), for
// parse(); kIo naming it on failure.
std::vector<uint8_t> read_state_file(const std::string& path);
// The same from a file image in memory; `origin` names it in messages.
void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict);

}  // namespace dparallel
