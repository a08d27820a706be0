// The safetensors format: an 8-byte little-endian header length, a JSON
// header ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__": {...}})
// and the tensors' bytes. Parsing trusts nothing in the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace dparallel::safetensors {

// Largest header accepted, as the reference implementation.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct Entry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range in the data section
  uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;  // in file order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data section starts in the file
};

// The format's name of a dtype: "F32", "BF16", ...
const char* dtype_code(DType dtype);

// Validates a whole file image: header length, JSON (no key twice in any
// object), dtypes, shapes, and that the tensors tile the data section
// exactly, in time linear in the header's size. Throws Error(kIo) with a message.
Header parse(const uint8_t* data, size_t size);
// The same in two steps, for a file read piecewise: the header length from
// the first min(8, size) bytes of a `size`-byte file, then the header text
// (that many bytes from offset 8) checked against that size.
uint64_t header_length(const uint8_t* first_bytes, uint64_t size);
Header parse_header(const char* text, uint64_t header_bytes, uint64_t size);

// The first bytes of a file holding `entries` (whose ranges must tile the
// data section in order): length, JSON header padded with spaces to 8 bytes.
std::string encode_header(const std::vector<Entry>& entries, const std::map<std::string, std::string>& metadata);

}  // namespace dparallel::safetensors
