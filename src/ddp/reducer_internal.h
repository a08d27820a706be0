// What the reducer's sources (reducer*.cpp) share; not for its users.
#pragma once

#include <chrono>

#include "core/error.h"
#include "ddp/reducer.h"

namespace dparallel::ddp::detail {

[[noreturn]] inline void fail_finishing() {
  fail(StatusCode::kState,
       "dp_ddp_finish_backward is running on another thread; calls on one dp_ddp must not overlap it");
}

[[noreturn]] inline void fail_broken() { fail(StatusCode::kState, "the dp_ddp is unusable after an earlier failure"); }

[[noreturn]] inline void fail_retired() {
  fail(StatusCode::kState,
       "dp_ddp_rebind moved the dp_ddp to another process group while this call ran; call it again");
}

inline double ms_between(Reducer::Clock::time_point a, Reducer::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// In every message about an iteration that departs from the recorded static
// graph; a peer's refusal carrying it fails finish_backward with kState.
inline constexpr const char* kStaticDeparture = "departs from the static graph";

}  // namespace dparallel::ddp::detail
