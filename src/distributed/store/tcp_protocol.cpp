#include "distributed/store/tcp_protocol.h"

#include <cstring>

namespace dparallel::dist::wire {

namespace {

// Reads fields from a body, refusing to read past its end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool u8(uint8_t* v) { return raw(v, 1); }
  bool u32(uint32_t* v) { return raw(v, 4); }
  bool i64(int64_t* v) { return raw(v, 8); }
  bool bytes(std::vector<uint8_t>* v, uint32_t limit) {
    uint32_t n = 0;
    if (!u32(&n) || n > limit || size_ - pos_ < n) return false;
    v->assign(data_ + pos_, data_ + pos_ + n);
    pos_ += n;
    return true;
  }
  bool string(std::string* v, uint32_t limit) {
    uint32_t n = 0;
    if (!u32(&n) || n > limit || size_ - pos_ < n) return false;
    v->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return true;
  }
  bool at_end() const { return pos_ == size_; }

 private:
  bool raw(void* v, size_t n) {
    if (size_ - pos_ < n) return false;
    std::memcpy(v, data_ + pos_, n);
    pos_ += n;
    return true;
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  std::memcpy(b, &v, 4);
  out.insert(out.end(), b, b + 4);
}

void put_string(std::vector<uint8_t>& out, const void* data, size_t size) {
  put_u32(out, static_cast<uint32_t>(size));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + size);
}

// Prefixes `body` with its length.
std::vector<uint8_t> frame(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> out;
  out.reserve(body.size() + 4);
  put_u32(out, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

bool parse_body(Reader& in, Request* out, std::string* error) {
  uint8_t command = 0;
  if (!in.u8(&command)) {
    *error = "empty body";
    return false;
  }
  out->keys.clear();
  out->value.clear();
  out->delta = 0;
  std::string key;
  switch (static_cast<Command>(command)) {
    case Command::kHello:
    case Command::kProof:
    case Command::kGet:
      if (!in.string(&key, kMaxKeyBytes)) break;
      out->keys.push_back(key);
      out->command = static_cast<Command>(command);
      return true;
    case Command::kSet:
      if (!in.string(&key, kMaxKeyBytes) || !in.bytes(&out->value, kMaxValueBytes)) break;
      out->keys.push_back(key);
      out->command = Command::kSet;
      return true;
    case Command::kAdd:
      if (!in.string(&key, kMaxKeyBytes) || !in.i64(&out->delta)) break;
      out->keys.push_back(key);
      out->command = Command::kAdd;
      return true;
    case Command::kCheck: {
      uint32_t count = 0;
      if (!in.u32(&count) || count > kMaxKeys) break;
      for (uint32_t i = 0; i < count; ++i) {
        if (!in.string(&key, kMaxKeyBytes)) {
          *error = "truncated or oversized key list";
          return false;
        }
        out->keys.push_back(key);
      }
      out->command = Command::kCheck;
      return true;
    }
    default:
      *error = "unknown command " + std::to_string(command);
      return false;
  }
  *error = "truncated or oversized field for command " + std::to_string(command);
  return false;
}

}  // namespace

ParseResult parse_request(const uint8_t* data, size_t size, Request* out, size_t* consumed, std::string* error) {
  if (size < 4) return ParseResult::kNeedMore;
  uint32_t body_size = 0;
  std::memcpy(&body_size, data, 4);
  if (body_size > kMaxBodyBytes) {
    *error = "frame of " + std::to_string(body_size) + " bytes exceeds the limit of " + std::to_string(kMaxBodyBytes);
    return ParseResult::kMalformed;
  }
  if (size - 4 < body_size) return ParseResult::kNeedMore;
  Reader in(data + 4, body_size);
  if (!parse_body(in, out, error)) return ParseResult::kMalformed;
  if (!in.at_end()) {
    *error = "trailing bytes after the request";
    return ParseResult::kMalformed;
  }
  *consumed = 4 + static_cast<size_t>(body_size);
  return ParseResult::kOk;
}

std::vector<uint8_t> encode_request(const Request& request) {
  std::vector<uint8_t> body;
  body.push_back(static_cast<uint8_t>(request.command));
  if (request.command == Command::kCheck) {
    put_u32(body, static_cast<uint32_t>(request.keys.size()));
    for (const std::string& key : request.keys) put_string(body, key.data(), key.size());
    return frame(body);
  }
  const std::string& key = request.keys.at(0);
  put_string(body, key.data(), key.size());
  if (request.command == Command::kSet) put_string(body, request.value.data(), request.value.size());
  if (request.command == Command::kAdd) {
    uint8_t b[8];
    std::memcpy(b, &request.delta, 8);
    body.insert(body.end(), b, b + 8);
  }
  return frame(body);
}

std::vector<uint8_t> encode_reply(ReplyStatus status, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> body;
  body.reserve(payload.size() + 1);
  body.push_back(static_cast<uint8_t>(status));
  body.insert(body.end(), payload.begin(), payload.end());
  return frame(body);
}

namespace {

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

std::string sha256(const std::string& data) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string padded = data;
  padded.push_back(static_cast<char>(0x80));
  while (padded.size() % 64 != 56) padded.push_back('\0');
  uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  for (int i = 7; i >= 0; --i) padded.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  for (size_t chunk = 0; chunk < padded.size(); chunk += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      const auto* p = reinterpret_cast<const uint8_t*>(padded.data() + chunk + 4 * static_cast<size_t>(i));
      w[i] = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
  }
  std::string out(32, '\0');
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j)
      out[4 * static_cast<size_t>(i) + static_cast<size_t>(j)] = static_cast<char>((h[i] >> (24 - 8 * j)) & 0xff);
  }
  return out;
}

}  // namespace

std::string hmac_sha256(const std::string& key, const std::string& message) {
  std::string k = key.size() > 64 ? sha256(key) : key;
  k.resize(64, '\0');
  std::string inner(64, '\0'), outer(64, '\0');
  for (size_t i = 0; i < 64; ++i) {
    inner[i] = static_cast<char>(k[i] ^ 0x36);
    outer[i] = static_cast<char>(k[i] ^ 0x5c);
  }
  return sha256(outer + sha256(inner + message));
}

std::string server_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce) {
  return hmac_sha256(token, "dparallel store server\n" + client_nonce + server_nonce);
}

std::string client_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce) {
  return hmac_sha256(token, "dparallel store client\n" + server_nonce + client_nonce);
}

bool equal_in_constant_time(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace dparallel::dist::wire
