#include "distributed/store/store.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <functional>
#include <thread>
#include <utility>

#include "core/error.h"

namespace dparallel::dist {

namespace {
using Clock = std::chrono::steady_clock;
thread_local Clock::time_point t_reply_deadline = Clock::time_point::max();
}  // namespace

PrefixStore::PrefixStore(std::shared_ptr<Store> base, std::string prefix)
    : base_(std::move(base)), prefix_(std::move(prefix)) {
  set_default_timeout(base_->default_timeout());
}
void PrefixStore::set(const std::string& key, const Bytes& value) { base_->set(prefix_ + key, value); }
Bytes PrefixStore::get(const std::string& key, Millis timeout) { return base_->get(prefix_ + key, timeout); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return base_->add(prefix_ + key, delta); }
bool PrefixStore::check(const std::vector<std::string>& keys) { return base_->check(prefixed(keys)); }
bool PrefixStore::erase(const std::string& key) { return base_->erase(prefix_ + key); }
int64_t PrefixStore::num_keys() { return base_->num_keys(); }
void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) { base_->wait(prefixed(keys), timeout); }
bool PrefixStore::set_on_close(const std::string& key, const Bytes& value) {
  return base_->set_on_close(prefix_ + key, value);
}
bool Store::set_on_close(const std::string&, const Bytes&) { return false; }
std::vector<std::string> PrefixStore::prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(prefix_ + key);
  return out;
}
Store* PrefixStore::innermost(Store* store) {
  while (auto* prefix = dynamic_cast<PrefixStore*>(store)) store = prefix->base_.get();
  return store;
}

void forget_keys(Store& store, const std::vector<std::string>& keys) noexcept {
  for (const std::string& key : keys) {
    try {
      store.erase(key);
    } catch (...) {
      return;  // the store is gone or failing: the keys stay
    }
  }
}

ReplyDeadlineCap::ReplyDeadlineCap(Millis cap) : previous_(t_reply_deadline) {
  auto now = Clock::now();
  auto until =
      cap >= std::chrono::duration_cast<Millis>(Clock::time_point::max() - now) ? Clock::time_point::max() : now + cap;
  t_reply_deadline = std::min(until, previous_);
}
ReplyDeadlineCap::~ReplyDeadlineCap() { t_reply_deadline = previous_; }
Millis ReplyDeadlineCap::current() {
  if (t_reply_deadline == Clock::time_point::max()) return Millis::max();
  return std::max(Millis(0), std::chrono::duration_cast<Millis>(t_reply_deadline - Clock::now()));
}

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
  try {
    ReplyDeadlineCap cap(timeout);  // one deadline for every request of this call
    if (poll_until([&] { return check(keys); }, timeout)) return;
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;  // a request cut off by the deadline is a plain timeout
  }
  // Names the missing keys, asking the store briefly; unknown ones count as missing.
  std::string missing, cause;
  ReplyDeadlineCap brief(kMissingKeysBound);
  for (const std::string& key : keys) {
    bool present = false;
    try {
      present = cause.empty() && check({key});
    } catch (const Error& e) {
      cause = std::string(" (the store did not answer: ") + e.what() + ")";
    }
    if (!present) missing += (missing.empty() ? "'" : ", '") + key + "'";
  }
  fail(StatusCode::kTimeout, "store wait timed out after ", timeout.count(), " ms; missing key(s) ", missing, cause);
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
