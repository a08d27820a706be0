#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist::wire {

void put_le32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  out.insert(out.end(), b, b + 4);
}

void put_le64(std::vector<uint8_t>& out, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  out.insert(out.end(), b, b + 8);
}

uint32_t get_le32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t get_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint32_t frame_body_size(const uint8_t* data) { return get_le32(data); }

namespace {

// Reads fields from a body, refusing to read past its end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool u8(uint8_t* v) {
    if (size_ - pos_ < 1) return false;
    *v = data_[pos_++];
    return true;
  }
  bool u32(uint32_t* v) {
    if (size_ - pos_ < 4) return false;
    *v = get_le32(data_ + pos_);
    pos_ += 4;
    return true;
  }
  bool i64(int64_t* v) {
    if (size_ - pos_ < 8) return false;
    *v = static_cast<int64_t>(get_le64(data_ + pos_));
    pos_ += 8;
    return true;
  }
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
  bool key_list(std::vector<std::string>* keys) {
    uint32_t count = 0;
    if (!u32(&count) || count > kMaxKeys) return false;
    std::string key;
    for (uint32_t i = 0; i < count; ++i) {
      if (!string(&key, kMaxKeyBytes)) return false;
      keys->push_back(key);
    }
    return true;
  }
  bool at_end() const { return pos_ == size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

void put_string(std::vector<uint8_t>& out, const void* data, size_t size) {
  put_le32(out, static_cast<uint32_t>(size));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  out.insert(out.end(), p, p + size);
}

void put_key_list(std::vector<uint8_t>& out, const std::vector<std::string>& keys) {
  put_le32(out, static_cast<uint32_t>(keys.size()));
  for (const std::string& key : keys) put_string(out, key.data(), key.size());
}

// Prefixes `body` with its length.
std::vector<uint8_t> frame(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> out;
  out.reserve(body.size() + 4);
  put_le32(out, static_cast<uint32_t>(body.size()));
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
  out->timeout_ms = 0;
  std::string key;
  switch (static_cast<Command>(command)) {
    case Command::kHello:
    case Command::kProof:
      if (!in.string(&key, kMaxKeyBytes)) break;
      out->keys.push_back(key);
      out->command = static_cast<Command>(command);
      return true;
    case Command::kGet:
      if (!in.string(&key, kMaxKeyBytes) || !in.u32(&out->timeout_ms)) break;
      out->keys.push_back(key);
      out->command = Command::kGet;
      return true;
    case Command::kSet:
      if (!in.string(&key, kMaxKeyBytes) || !in.bytes(&out->value, kMaxValueBytes)) break;
      out->keys.push_back(key);
      out->command = Command::kSet;
      return true;
    case Command::kSetOnClose:
      if (!in.string(&key, kMaxKeyBytes) || !in.bytes(&out->value, kMaxCloseValueBytes)) break;
      out->keys.push_back(key);
      out->command = Command::kSetOnClose;
      return true;
    case Command::kAdd:
      if (!in.string(&key, kMaxKeyBytes) || !in.i64(&out->delta)) break;
      out->keys.push_back(key);
      out->command = Command::kAdd;
      return true;
    case Command::kNumKeys:
      out->command = Command::kNumKeys;
      return true;
    case Command::kErase:
      if (!in.string(&key, kMaxKeyBytes)) break;
      out->keys.push_back(key);
      out->command = Command::kErase;
      return true;
    case Command::kCheck:
      if (!in.key_list(&out->keys)) {
        *error = "truncated or oversized key list";
        return false;
      }
      out->command = Command::kCheck;
      return true;
    case Command::kWait:
      if (!in.key_list(&out->keys) || !in.u32(&out->timeout_ms)) {
        *error = "truncated or oversized key list";
        return false;
      }
      out->command = Command::kWait;
      return true;
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
  uint32_t body_size = frame_body_size(data);
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
  std::vector<uint8_t> body(1, static_cast<uint8_t>(request.command));
  if (request.command == Command::kCheck || request.command == Command::kWait) {
    put_key_list(body, request.keys);
    if (request.command == Command::kWait) put_le32(body, request.timeout_ms);
    return frame(body);
  }
  if (request.command == Command::kNumKeys) return frame(body);
  const std::string& key = request.keys.at(0);
  put_string(body, key.data(), key.size());
  if (request.command == Command::kSet || request.command == Command::kSetOnClose) {
    put_string(body, request.value.data(), request.value.size());
  }
  if (request.command == Command::kAdd) put_le64(body, static_cast<uint64_t>(request.delta));
  if (request.command == Command::kGet) put_le32(body, request.timeout_ms);
  return frame(body);
}

std::vector<uint8_t> encode_reply(ReplyStatus status, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out;
  out.reserve(payload.size() + 5);
  put_le32(out, static_cast<uint32_t>(payload.size() + 1));
  out.insert(out.end(), 1, static_cast<uint8_t>(status));
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

bool decode_reply(const std::vector<uint8_t>& body, Reply* out) {
  if (body.empty()) return false;
  out->status = static_cast<ReplyStatus>(body[0]);
  out->payload.assign(body.begin() + 1, body.end());
  return true;
}

std::vector<uint8_t> encode_keys(const std::vector<std::string>& keys) {
  std::vector<uint8_t> out;
  put_key_list(out, keys);
  return out;
}

bool decode_keys(const std::vector<uint8_t>& payload, std::vector<std::string>* keys) {
  Reader in(payload.data(), payload.size());
  keys->clear();
  return in.key_list(keys) && in.at_end();
}

}  // namespace dparallel::dist::wire
