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

}  // namespace dparallel::dist::wire
