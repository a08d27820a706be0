// The TCP store's wire format. Every message is a frame: a little-endian u32
// body length, then the body. Request bodies start with a command byte;
// strings are a u32 length and the bytes. Replies start with a status byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dparallel::dist::wire {

constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint32_t kMaxValueBytes = 64u << 20;
constexpr uint32_t kMaxKeys = 4096;
// A body larger than this closes the connection.
constexpr uint32_t kMaxBodyBytes = kMaxValueBytes + kMaxKeyBytes + 64;

// The largest greeting body: the command byte and the token as a string.
constexpr uint32_t kMaxGreetingBytes = 1 + 4 + kMaxKeyBytes;

enum class Command : uint8_t { kHello = 1, kSet = 2, kGet = 3, kAdd = 4, kCheck = 5 };
enum class ReplyStatus : uint8_t { kOk = 0, kNotFound = 1, kRefused = 2, kError = 3 };

struct Request {
  Command command = Command::kHello;
  std::vector<std::string> keys;  // kSet, kGet, kAdd: one; kCheck: any; kHello: the token
  std::vector<uint8_t> value;     // kSet
  int64_t delta = 0;              // kAdd
};

enum class ParseResult { kNeedMore, kOk, kMalformed };

// Parses one request frame from the front of [data, data + size). On kOk,
// `*consumed` is the frame's size; on kMalformed, `*error` says why.
ParseResult parse_request(const uint8_t* data, size_t size, Request* out, size_t* consumed, std::string* error);

std::vector<uint8_t> encode_request(const Request& request);
std::vector<uint8_t> encode_reply(ReplyStatus status, const std::vector<uint8_t>& payload);

}  // namespace dparallel::dist::wire
