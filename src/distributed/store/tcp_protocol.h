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

constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;
// The largest body before the greeting is done: a command byte and a proof as a string.
constexpr uint32_t kMaxGreetingBytes = 1 + 4 + kProofBytes;

// The greeting proves knowledge of the job token both ways without sending
// it: the client's kHello carries its nonce; the server answers kOk with its
// own nonce and proof; the client checks that and sends kProof with its
// proof. Proofs are HMAC-SHA256 under the token over both nonces.
enum class Command : uint8_t { kHello = 1, kSet = 2, kGet = 3, kAdd = 4, kCheck = 5, kProof = 6 };
enum class ReplyStatus : uint8_t { kOk = 0, kNotFound = 1, kRefused = 2, kError = 3 };

struct Request {
  Command command = Command::kHello;
  std::vector<std::string> keys;  // kSet, kGet, kAdd: one; kCheck: any; kHello: a nonce; kProof: the proof
  std::vector<uint8_t> value;     // kSet
  int64_t delta = 0;              // kAdd
};

enum class ParseResult { kNeedMore, kOk, kMalformed };

// Parses one request frame from the front of [data, data + size). On kOk,
// `*consumed` is the frame's size; on kMalformed, `*error` says why.
ParseResult parse_request(const uint8_t* data, size_t size, Request* out, size_t* consumed, std::string* error);

std::vector<uint8_t> encode_request(const Request& request);
std::vector<uint8_t> encode_reply(ReplyStatus status, const std::vector<uint8_t>& payload);

// HMAC-SHA256 (RFC 2104, FIPS 180-4) of `message` under `key`.
std::string hmac_sha256(const std::string& key, const std::string& message);
// The greeting's proofs: the server's over (client nonce, server nonce), the client's the other way round.
std::string server_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce);
std::string client_proof(const std::string& token, const std::string& client_nonce, const std::string& server_nonce);
// Compares in time independent of where the strings differ.
bool equal_in_constant_time(const std::string& a, const std::string& b);

}  // namespace dparallel::dist::wire
