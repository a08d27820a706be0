#include "distributed/store/store.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <functional>
#include <thread>

#include "core/error.h"

namespace dparallel::dist {

namespace {
thread_local Millis t_reply_cap = Millis::max();
}  // namespace

ReplyDeadlineCap::ReplyDeadlineCap(Millis cap) : previous_(t_reply_cap) { t_reply_cap = std::min(cap, previous_); }
ReplyDeadlineCap::~ReplyDeadlineCap() { t_reply_cap = previous_; }
Millis ReplyDeadlineCap::current() { return t_reply_cap; }

bool poll_until(const std::function<bool()>& check, Millis timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  for (;;) {
    if (check()) return true;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

void Store::wait(const std::vector<std::string>& keys, Millis timeout) {
  if (poll_until([&] { return check(keys); }, timeout)) return;
  std::string missing;
  for (const std::string& key : keys) {
    if (!check({key})) missing += (missing.empty() ? "'" : ", '") + key + "'";
  }
  fail(StatusCode::kTimeout, "store wait timed out after ", timeout.count(), " ms; missing key(s) ", missing);
}

int64_t parse_counter(const Bytes& value, const std::string& key) {
  std::string text(value.begin(), value.end());
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end != text.c_str() + text.size()) {
    fail(StatusCode::kIo, "store key '", key, "' holds no integer, so add() cannot update it");
  }
  return parsed;
}

Bytes format_counter(int64_t value) {
  std::string text = std::to_string(value);
  return Bytes(text.begin(), text.end());
}

}  // namespace dparallel::dist
