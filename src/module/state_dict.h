// A module's state dict (parameters and persistent buffers) and its
// safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
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

// The metadata key of a file's checksum: the CRC-32C of its data section
// (every tensor's bytes), eight lowercase hex digits.
inline constexpr const char* kDataChecksumKey = "dp.crc32c";

// What save_state wrote: the file's size and checksums of its parts.
struct SavedFile {
  uint64_t bytes = 0;
  uint32_t header_crc = 0;           // of the 8-byte length and the header text
  std::vector<uint32_t> entry_crcs;  // of each entry's bytes, in `entries` order
};

// Writes a safetensors file (metadata {"format": "pt"} and the data
// section's checksum) through a temporary file (mkstemp, short fixed
// prefix), flushed to disk and renamed into place: the path holds the old
// file or the whole new one, never a part. A symbolic link is followed and
// kept; an existing target must be a regular file (kInvalidArgument) that
// is writable (kIo), and keeps its permissions.
void save_module(Module& module, const std::string& path);
// Writes `path` as save_module does (temporary file, flushed, renamed;
// links, permissions and refusals the same), with what `write` writes to
// the stream it is given; `write` returns false when a write failed.
void write_atomically(const std::string& path, const std::function<bool(std::FILE*)>& write);
// The same for `entries` (names unique) with `metadata` in the header.
SavedFile save_state(const std::vector<StateEntry>& entries, const std::map<std::string, std::string>& metadata,
                     const std::string& path);

// Copies a safetensors file into the module's tensors. A key may name any
// path to a tensor (a shared one included). With `strict`, missing and
// unexpected keys are kInvalidArgument naming all of them; a shape or dtype
// mismatch always is; without it, the module's tensors the file lacks are
// left as they are. A path that is not a regular file is kInvalidArgument
// (a FIFO is never opened for a blocking read); a malformed file, or one
// whose data differs from its checksum (kDataChecksumKey, when it has one),
// is kIo. The header and the checksum are checked first, then each
// tensor's bytes are read straight into it. On any error found before that
// the module is unchanged; a read failure while copying (the file changed
// meanwhile) is kIo and may leave it partly loaded. Returns the tensors
// the file wrote.
std::vector<Tensor> load_module(Module& module, const std::string& path, bool strict);
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
  // The CRC-32C of `nbytes` from `offset` into the data section, and of
  // the file's first bytes up to the data section (its length and header).
  uint32_t data_crc(uint64_t offset, uint64_t nbytes, std::vector<uint8_t>& staging) const;
  uint32_t header_crc() const;
  uint64_t file_size() const;
  // kIo naming the file when its data section differs from the checksum
  // in its metadata; nothing when it has none.
  void verify_data_checksum(std::vector<uint8_t>& staging) const;

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
  safetensors::Header header_;
};
// The same from a file image in memory; `origin` names it in messages.
void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict);

}  // namespace dparallel
