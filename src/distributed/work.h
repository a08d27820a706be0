// The completion of one asynchronous collective: a status and a message.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>

#include "core/error.h"

namespace dparallel::dist {

class Work {
 public:
  void finish(StatusCode code, std::string message);
  // Blocks until finished; throws the collective's error, if any.
  void wait();
  bool done();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace dparallel::dist
