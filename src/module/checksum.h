// CRC-32C (Castagnoli), the checksum the library's checkpoints carry: the
// SSE4.2 instruction where the processor has it, a table elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dparallel {

// Extends `crc` (0 for a new checksum) over `size` bytes.
uint32_t crc32c(uint32_t crc, const void* data, size_t size);

// Eight lowercase hex digits, and back (false for anything else).
std::string crc32c_text(uint32_t crc);
bool parse_crc32c(const std::string& text, uint32_t* crc);

}  // namespace dparallel
