#include "distributed/work.h"

#include "distributed/background_calls.h"

namespace dparallel::dist {

void Work::finish(StatusCode code, std::string message) {
  std::lock_guard<std::mutex> lock(mutex_);
  code_ = code;
  message_ = std::move(message);
  done_ = true;
  cv_.notify_all();
}

void Work::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  BackgroundCalls::Awaited awaited;
  // Every collective ends by its group's timeout, so this wait ends too.
  cv_.wait(lock, [&] { return done_; });
  if (code_ != StatusCode::kOk) throw Error(code_, message_);
}

bool Work::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

}  // namespace dparallel::dist
