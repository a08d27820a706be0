// What the tests of the library's internals share about the errors its
// calls throw (dparallel::Error); the C ABI tests read dp_last_error instead.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "core/error.h"

namespace dptest {

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The message of the error with `code` that `fn` throws, or "" (with a
// failure) if it throws none.
template <typename Fn>
std::string error_of(dparallel::StatusCode code, Fn&& fn) {
  try {
    fn();
  } catch (const dparallel::Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

template <typename Fn>
std::string device_error_of(Fn&& fn) {
  return error_of(dparallel::StatusCode::kDevice, std::forward<Fn>(fn));
}

template <typename Fn>
std::string invalid_argument_error_of(Fn&& fn) {
  return error_of(dparallel::StatusCode::kInvalidArgument, std::forward<Fn>(fn));
}

}  // namespace dptest
