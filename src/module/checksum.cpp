#include "module/checksum.h"

#include <array>
#include <cstdio>
#include <cstring>

namespace dparallel {

namespace {

constexpr uint32_t kPolynomial = 0x82f63b78u;  // reflected Castagnoli

// Slicing by 8: table[k][b] is the CRC of byte b followed by k zero bytes.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kPolynomial : 0u);
    t[0][b] = c;
  }
  for (size_t k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xffu];
  }
  return t;
}

uint32_t crc32c_table(uint32_t state, const uint8_t* p, size_t n) {
  static const Tables t = make_tables();
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    const uint32_t low = static_cast<uint32_t>(word) ^ state;
    const auto high = static_cast<uint32_t>(word >> 32);
    state = t[7][low & 0xffu] ^ t[6][(low >> 8) & 0xffu] ^ t[5][(low >> 16) & 0xffu] ^ t[4][low >> 24] ^
            t[3][high & 0xffu] ^ t[2][(high >> 8) & 0xffu] ^ t[1][(high >> 16) & 0xffu] ^ t[0][high >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) state = (state >> 8) ^ t[0][(state ^ *p++) & 0xffu];
  return state;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t state, const uint8_t* p, size_t n) {
  uint64_t s = state;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    s = __builtin_ia32_crc32di(s, word);
    p += 8;
    n -= 8;
  }
  auto s32 = static_cast<uint32_t>(s);
  while (n-- > 0) s32 = __builtin_ia32_crc32qi(s32, *p++);
  return s32;
}

bool has_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2") != 0;
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (has_sse42()) return ~crc32c_sse42(state, p, size);
#endif
  return ~crc32c_table(state, p, size);
}

std::string crc32c_text(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

bool parse_crc32c(const std::string& text, uint32_t* crc) {
  if (text.size() != 8) return false;
  uint32_t value = 0;
  for (char c : text) {
    uint32_t digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint32_t>(c - 'a' + 10);
    } else {
      return false;
    }
    value = (value << 4) | digit;
  }
  *crc = value;
  return true;
}

}  // namespace dparallel
