// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the store's greeting.
// Kept in the library rather than taken from libcrypto: libcrypto keeps
// per-thread state that its exit handler frees before the store's threads
// end, which leak-checkers report in every host that exits with a store up.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dparallel::dist {

class Sha256 {
 public:
  static constexpr size_t kDigestBytes = 32;
  static constexpr size_t kBlockBytes = 64;
  using Digest = std::array<uint8_t, kDigestBytes>;

  Sha256();
  void update(const void* data, size_t size);
  Digest finish();

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, kBlockBytes> pending_{};
  size_t pending_size_ = 0;
  uint64_t total_bytes_ = 0;
};

// HMAC-SHA256 of `message` under `key`, as 32 raw bytes.
std::string hmac_sha256_bytes(const std::string& key, const std::string& message);

}  // namespace dparallel::dist
