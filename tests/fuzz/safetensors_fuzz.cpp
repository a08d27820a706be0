// libFuzzer target for the safetensors parser: any input is refused with an
// Error or parsed into ranges that lie inside it; a parsed header re-encodes
// into a file that parses to the same entries.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "module/safetensors.h"

namespace st = dparallel::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  st::Header header;
  try {
    header = st::parse(data, size);
  } catch (const dparallel::Error&) {
    return 0;
  }
  // Read every byte the parser vouched for, so AddressSanitizer sees any overrun.
  unsigned sum = 0;
  for (const st::Entry& e : header.entries) {
    for (uint64_t i = e.begin; i < e.end; ++i) sum += data[header.data_offset + i];
  }
  std::string image = st::encode_header(header.entries, header.metadata);
  image.append(reinterpret_cast<const char*>(data) + header.data_offset, size - header.data_offset);
  st::Header again = st::parse(reinterpret_cast<const uint8_t*>(image.data()), image.size());
  if (again.entries.size() != header.entries.size() || again.metadata != header.metadata) std::abort();
  for (size_t i = 0; i < again.entries.size(); ++i) {
    const st::Entry &a = again.entries[i], &b = header.entries[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin || a.end != b.end) {
      std::abort();
    }
  }
  return static_cast<int>(sum & 0);
}
