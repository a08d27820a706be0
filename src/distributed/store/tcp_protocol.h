// The TCP store's wire format. Every message is a frame: a little-endian u32
// body length, then the body. Request bodies start with a command byte;
// strings are a u32 length and the bytes; integers are little-endian
// whatever the host's order. Replies start with a status byte.
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
static_assert(kMaxBodyBytes >= 1 + 4 + 4 + kMaxKeys * (4 + kMaxKeyBytes), "a wait on kMaxKeys keys fits a body");

constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;
// The largest body before the greeting is done: a command byte and a proof as a string.
constexpr uint32_t kMaxGreetingBytes = 1 + 4 + kProofBytes;

// The greeting (greeting.h) is kHello then kProof. kGet and kWait carry how
// long the server may hold them: it answers as soon as the keys exist, or
// kTimeout (a wait's payload lists the missing keys) when the time is up.
enum class Command : uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kProof = 6,
  kWait = 7,
  kErase = 8,    // kOk when the key existed, kNotFound when not
  kNumKeys = 9,  // no key; the reply's payload is the count (le64)
  // As kSet, but the server sets the key only once this connection closes
  // (the client's process died or left): what a group's survivors read.
  kSetOnClose = 10
};
// The most kSetOnClose keys one connection may hold, and the largest value.
constexpr size_t kMaxCloseNotices = 256;
constexpr uint32_t kMaxCloseValueBytes = 4096;
enum class ReplyStatus : uint8_t { kOk = 0, kNotFound = 1, kRefused = 2, kError = 3, kTimeout = 4 };

struct Request {
  Command command = Command::kHello;
  std::vector<std::string>
      keys;  // kSet, kSetOnClose, kGet, kAdd, kErase: one; kCheck, kWait: any; kHello: a nonce; kProof: the proof
  std::vector<uint8_t> value;  // kSet, kSetOnClose
  int64_t delta = 0;           // kAdd
  uint32_t timeout_ms = 0;     // kGet, kWait
};

struct Reply {
  ReplyStatus status = ReplyStatus::kError;
  std::vector<uint8_t> payload;
};

enum class ParseResult { kNeedMore, kOk, kMalformed };

// Parses one request frame from the front of [data, data + size). On kOk,
// `*consumed` is the frame's size; on kMalformed, `*error` says why.
ParseResult parse_request(const uint8_t* data, size_t size, Request* out, size_t* consumed, std::string* error);
// The body length a frame at `data` (4 bytes at least) announces.
uint32_t frame_body_size(const uint8_t* data);

std::vector<uint8_t> encode_request(const Request& request);
std::vector<uint8_t> encode_reply(ReplyStatus status, const std::vector<uint8_t>& payload);
// A reply body (status byte, payload); false when empty.
bool decode_reply(const std::vector<uint8_t>& body, Reply* out);

// A list of keys as a payload (a wait's missing keys), and back; false when malformed.
std::vector<uint8_t> encode_keys(const std::vector<std::string>& keys);
bool decode_keys(const std::vector<uint8_t>& payload, std::vector<std::string>* keys);

// Little-endian integers, whatever the host's byte order.
void put_le32(std::vector<uint8_t>& out, uint32_t v);
void put_le64(std::vector<uint8_t>& out, uint64_t v);
uint32_t get_le32(const uint8_t* p);
uint64_t get_le64(const uint8_t* p);

}  // namespace dparallel::dist::wire
