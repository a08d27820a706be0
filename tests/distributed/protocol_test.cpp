// The TCP store's message parser and the reductions, from the inside.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "distributed/reduce_ops.h"
#include "distributed/store/greeting.h"
#include "distributed/store/sha256.h"
#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist {
namespace {

using wire::Command;
using wire::ParseResult;

TEST(StoreProtocol, RoundTripsEveryCommandAndWaitsForWholeFrames) {
  wire::Request set;
  set.command = Command::kSet;
  set.keys = {"key"};
  set.value = {1, 2, 3};
  wire::Request check;
  check.command = Command::kCheck;
  check.keys = {"a", "bb", ""};
  wire::Request add;
  add.command = Command::kAdd;
  add.keys = {"n"};
  add.delta = -42;
  wire::Request get;
  get.command = Command::kGet;
  get.keys = {"g"};
  get.timeout_ms = 1234;
  wire::Request wait;
  wait.command = Command::kWait;
  wait.keys = {"x", "yy"};
  wait.timeout_ms = 0xfffffffeu;
  for (const wire::Request& r : {set, check, add, get, wait}) {
    std::vector<uint8_t> frame = wire::encode_request(r);
    wire::Request parsed;
    size_t consumed = 0;
    std::string error;
    for (size_t cut = 0; cut < frame.size(); ++cut) {
      EXPECT_EQ(wire::parse_request(frame.data(), cut, &parsed, &consumed, &error), ParseResult::kNeedMore) << cut;
    }
    ASSERT_EQ(wire::parse_request(frame.data(), frame.size(), &parsed, &consumed, &error), ParseResult::kOk) << error;
    EXPECT_EQ(consumed, frame.size());
    EXPECT_EQ(parsed.command, r.command);
    EXPECT_EQ(parsed.keys, r.keys);
    EXPECT_EQ(parsed.value, r.value);
    EXPECT_EQ(parsed.delta, r.delta);
    EXPECT_EQ(parsed.timeout_ms, r.timeout_ms);
  }
}

// Little-endian on the wire whatever the host's order.
TEST(StoreProtocol, EncodesIntegersLittleEndian) {
  wire::Request get;
  get.command = Command::kGet;
  get.keys = {"k"};
  get.timeout_ms = 0x01020304;
  EXPECT_EQ(wire::encode_request(get), (std::vector<uint8_t>{10, 0, 0, 0, 3, 1, 0, 0, 0, 'k', 4, 3, 2, 1}));
  wire::Request add;
  add.command = Command::kAdd;
  add.keys = {""};
  add.delta = -2;
  EXPECT_EQ(wire::encode_request(add),
            (std::vector<uint8_t>{13, 0, 0, 0, 4, 0, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}));
  const uint8_t le[8] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
  EXPECT_EQ(wire::get_le32(le), 0x05060708u);
  EXPECT_EQ(wire::get_le64(le), 0x0102030405060708u);
  EXPECT_EQ(wire::encode_reply(wire::ReplyStatus::kTimeout, {9}), (std::vector<uint8_t>{2, 0, 0, 0, 4, 9}));
  std::vector<std::string> keys;
  ASSERT_TRUE(wire::decode_keys(wire::encode_keys({"a", "bc"}), &keys));
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "bc"}));
  EXPECT_FALSE(wire::decode_keys({1, 0, 0, 0}, &keys)) << "a list of one key with the key missing";
}

TEST(StoreProtocol, RejectsOversizedTruncatedAndUnknownMessages) {
  wire::Request parsed;
  size_t consumed = 0;
  std::string error;
  std::vector<uint8_t> oversized;
  wire::put_le32(oversized, wire::kMaxBodyBytes + 1);
  EXPECT_EQ(wire::parse_request(oversized.data(), 4, &parsed, &consumed, &error), ParseResult::kMalformed);
  EXPECT_NE(error.find("exceeds"), std::string::npos);
  const uint8_t unknown[] = {1, 0, 0, 0, 99};
  EXPECT_EQ(wire::parse_request(unknown, sizeof(unknown), &parsed, &consumed, &error), ParseResult::kMalformed);
  const uint8_t empty[] = {0, 0, 0, 0};
  EXPECT_EQ(wire::parse_request(empty, sizeof(empty), &parsed, &consumed, &error), ParseResult::kMalformed);
  const uint8_t overrun[] = {6, 0, 0, 0, 3, 9, 0, 0, 0, 'k'};  // key length 9 in a 6-byte body
  EXPECT_EQ(wire::parse_request(overrun, sizeof(overrun), &parsed, &consumed, &error), ParseResult::kMalformed);
  const uint8_t trailing[] = {7, 0, 0, 0, 6, 1, 0, 0, 0, 'k', 'x'};  // a proof of 'k', then 'x'
  EXPECT_EQ(wire::parse_request(trailing, sizeof(trailing), &parsed, &consumed, &error), ParseResult::kMalformed);
  EXPECT_NE(error.find("trailing"), std::string::npos);
  const uint8_t many[] = {5, 0, 0, 0, 5, 0xff, 0xff, 0xff, 0xff};  // 4 G keys
  EXPECT_EQ(wire::parse_request(many, sizeof(many), &parsed, &consumed, &error), ParseResult::kMalformed);
}

TEST(Reductions, HalfPrecisionRoundsOnceAndBoolIsLogical) {
  uint16_t a[2] = {float_to_half(1.5f), float_to_half(-2.0f)};
  uint16_t b[2] = {float_to_half(2.25f), float_to_half(3.0f)};
  uint16_t out[2];
  reduce_function(DType::kFloat16, ReduceOp::kSum)(out, a, b, 2);
  EXPECT_EQ(half_to_float(out[0]), 3.75f);
  EXPECT_EQ(half_to_float(out[1]), 1.0f);
  reduce_function(DType::kBFloat16, ReduceOp::kProd)(out, a, b, 0);
  uint8_t x[3] = {0, 1, 1}, y[3] = {0, 0, 2}, o[3];
  reduce_function(DType::kBool, ReduceOp::kSum)(o, x, y, 3);
  EXPECT_EQ(o[0] + 2 * o[1] + 4 * o[2], 6);
  reduce_function(DType::kBool, ReduceOp::kProd)(o, x, y, 3);
  EXPECT_EQ(o[0] + 2 * o[1] + 4 * o[2], 4);
  int8_t i[1] = {100}, j[1] = {100}, k[1];
  reduce_function(DType::kInt8, ReduceOp::kSum)(k, i, j, 1);
  EXPECT_EQ(k[0], static_cast<int8_t>(-56)) << "integer sums wrap";
  int32_t avg[2] = {7, -7};
  divide_in_place(DType::kInt32, avg, 2, 2);
  EXPECT_EQ(avg[0], 3);
  EXPECT_EQ(avg[1], -3);
}

TEST(Reductions, DivideIntoWritesTheBitsOfDivideInPlaceAndLeavesItsSourceAlone) {
  for (int64_t divisor : {2, 3, 4, 7}) {
    std::vector<float> source(1000), in_place(1000), into(1000, -1.0f);
    for (size_t i = 0; i < source.size(); ++i) source[i] = 0.1f * static_cast<float>(i) - 33.3f;
    in_place = source;
    const std::vector<float> kept = source;
    divide_in_place(DType::kFloat32, in_place.data(), in_place.size(), divisor);
    divide_into(DType::kFloat32, into.data(), source.data(), source.size(), divisor);
    EXPECT_EQ(std::memcmp(into.data(), in_place.data(), into.size() * sizeof(float)), 0) << "divisor " << divisor;
    EXPECT_EQ(source, kept);
    EXPECT_EQ(into[10], source[10] / static_cast<float>(divisor));
  }
  uint16_t half[2] = {float_to_half(3.0f), float_to_half(-1.0f)}, halved[2];
  divide_into(DType::kFloat16, halved, half, 2, 2);
  EXPECT_EQ(half_to_float(halved[0]), 1.5f);
  EXPECT_EQ(half_to_float(halved[1]), -0.5f);
  int64_t whole[2] = {7, -7}, third[2];
  divide_into(DType::kInt64, third, whole, 2, 3);
  EXPECT_EQ(third[0], 2);
  EXPECT_EQ(third[1], -2);
  EXPECT_THROW(divide_into(DType::kBool, halved, half, 1, 2), Error);
}

std::string hex(const void* data, size_t size) {
  std::string out;
  char buf[3];
  for (size_t i = 0; i < size; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", static_cast<const unsigned char*>(data)[i]);
    out += buf;
  }
  return out;
}
std::string hex(const std::string& bytes) { return hex(bytes.data(), bytes.size()); }

std::string sha256_hex(const std::string& message, size_t piece) {
  Sha256 h;
  for (size_t at = 0; at < message.size(); at += piece)
    h.update(message.data() + at, std::min(piece, message.size() - at));
  Sha256::Digest d = h.finish();
  return hex(d.data(), d.size());
}

TEST(StoreProtocol, Sha256MatchesFips180ExamplesFedWholeOrInPieces) {
  for (size_t piece : {size_t{1}, size_t{7}, size_t{64}, size_t{1} << 20}) {
    EXPECT_EQ(sha256_hex("", piece), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(sha256_hex("abc", piece), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    // 56 bytes: the length no longer fits the first block.
    EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", piece),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  }
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a'), 4096),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(StoreProtocol, NoncesAreFullLengthAndDiffer) {
  std::string a = greeting::random_nonce(), b = greeting::random_nonce();
  EXPECT_EQ(a.size(), wire::kNonceBytes);
  EXPECT_EQ(b.size(), wire::kNonceBytes);
  EXPECT_NE(a, b);
}

TEST(StoreProtocol, HmacSha256MatchesRfc4231) {
  EXPECT_EQ(hex(greeting::hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(greeting::hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // A key longer than the block is hashed first (test case 6).
  EXPECT_EQ(
      hex(greeting::hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
      "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_TRUE(greeting::equal_in_constant_time("abc", "abc"));
  EXPECT_FALSE(greeting::equal_in_constant_time("abc", "abd"));
  EXPECT_FALSE(greeting::equal_in_constant_time("abc", "ab"));
}

}  // namespace
}  // namespace dparallel::dist
