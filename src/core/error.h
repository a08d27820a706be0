// Errors inside the core: one exception type carrying a status code.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dparallel {

// Values equal the C ABI's dp_status codes (checked in capi/).
enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = -1,
  kOutOfMemory = -2,
  kDevice = -3,
  kTimeout = -4,
  kRemote = -5,
  kUser = -6,
  kIo = -7,
  kState = -8,
  kUnsupported = -9,
  kInternal = -10,
};

class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  StatusCode code() const noexcept { return code_; }

 private:
  StatusCode code_;
};

template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(StatusCode code, Args&&... args) {
  throw Error(code, str_cat(std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail_invalid(Args&&... args) {
  fail(StatusCode::kInvalidArgument, std::forward<Args>(args)...);
}

}  // namespace dparallel
