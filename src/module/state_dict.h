// A module's state dict (parameters and persistent buffers) and its
// safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "module/module.h"
#include "module/safetensors.h"

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
// A safetensors file read piece by piece: opening checks that it is a
// regular file (kInvalidArgument, never blocking on a FIFO) and reads and
// checks its header against its size (kIo naming it); then byte ranges of
// its data section go straight into tensors.
class StateFileReader {
 public:
  explicit StateFileReader(const std::string& path);
  ~StateFileReader();
  StateFileReader(const StateFileReader&) = delete;
  StateFileReader& operator=(const StateFileReader&) = delete;

  const std::string& path() const { return path_; }
  const safetensors::Header& header() const { return header_; }
  // `nbytes` from `offset` into the data section, to `target_offset` bytes
  // into `target` (through `staging` for a device tensor).
  void read_into(const Tensor& target, size_t target_offset, uint64_t offset, size_t nbytes,
                 std::vector<uint8_t>& staging) const;

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
  safetensors::Header header_;
};
// The same from a file image in memory; `origin` names it in messages.
void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict);

}  // namespace dparallel
