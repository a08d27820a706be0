// libFuzzer target: the TCP store's request parser on arbitrary bytes, fed
// the way the server feeds it (frames back to back, parsed until one is
// incomplete or malformed). Encoding what was parsed must give the frame back.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "distributed/store/tcp_protocol.h"

using namespace dparallel::dist;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t offset = 0;
  while (offset < size) {
    wire::Request request;
    size_t consumed = 0;
    std::string error;
    auto result = wire::parse_request(data + offset, size - offset, &request, &consumed, &error);
    if (result != wire::ParseResult::kOk) break;
    if (consumed == 0 || consumed > size - offset) std::abort();
    std::vector<uint8_t> again = wire::encode_request(request);
    if (again.size() != consumed || std::memcmp(again.data(), data + offset, consumed) != 0) std::abort();
    offset += consumed;
  }
  return 0;
}
