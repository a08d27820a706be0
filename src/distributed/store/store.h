// Key-value stores for rendezvous: the contract of c10d's stores. Values are
// bytes; add() keeps a decimal integer; get() and wait() block up to a timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dparallel::dist {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const Bytes& value) = 0;
  // The value of `key`, waiting for it up to `timeout`; kTimeout names the key.
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  // Adds `delta` to the integer at `key` (0 when absent) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists, without waiting.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Removes `key`; true when it existed (c10d's deleteKey).
  virtual bool erase(const std::string& key) = 0;
  // How many keys the whole store holds (c10d's getNumKeys).
  virtual int64_t num_keys() = 0;
  // Waits until every key exists; kTimeout names the keys still missing.
  // This one polls check().
  virtual void wait(const std::vector<std::string>& keys, Millis timeout);
  // Has the store set `key` to `value` once this client's connection to it
  // closes (its process died, or left); false where the store cannot (only
  // the TCP store can). A connection opened again registers them again.
  virtual bool set_on_close(const std::string& key, const Bytes& value);

  // The timeout of calls that take none (the C ABI's get and wait).
  Millis default_timeout() const { return Millis(default_timeout_ms_.load()); }
  void set_default_timeout(Millis timeout) { default_timeout_ms_ = timeout.count(); }

 private:
  std::atomic<int64_t> default_timeout_ms_{300000};
};

// The keys of `base` under `prefix`: a namespace of its own for a group
// built inside another one (whose keys the base group's ranks already use).
class PrefixStore : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, std::string prefix);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool erase(const std::string& key) override;
  int64_t num_keys() override;  // the base store's, every prefix included
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool set_on_close(const std::string& key, const Bytes& value) override;
  // The innermost store below any prefixes.
  static Store* innermost(Store* store);

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const;
  std::shared_ptr<Store> base_;
  std::string prefix_;
};

// Caps how long this thread's store requests wait for a reply while it lives:
// a deadline `cap` from its construction, shared by every request under it.
// For error diagnostics, and for calls with one overall timeout.
class ReplyDeadlineCap {
 public:
  explicit ReplyDeadlineCap(Millis cap);
  ~ReplyDeadlineCap();
  ReplyDeadlineCap(const ReplyDeadlineCap&) = delete;
  ReplyDeadlineCap& operator=(const ReplyDeadlineCap&) = delete;
  // The cap in force on this thread (Millis::max() when none).
  static Millis current();

 private:
  std::chrono::steady_clock::time_point previous_;
};

// How long a timed-out wait may spend asking which keys are missing.
constexpr Millis kMissingKeysBound{200};

// Erases `keys` a finished rendezvous no longer needs, as far as the store
// lets it: a store gone or failing leaves them (they cost memory only).
void forget_keys(Store& store, const std::vector<std::string>& keys) noexcept;

// Polls `check` with a growing pause until it holds or `timeout` passes.
bool poll_until(const std::function<bool()>& check, Millis timeout);

// The integer text add() stores; kIo when `value` is not one.
int64_t parse_counter(const Bytes& value, const std::string& key);
Bytes format_counter(int64_t value);

}  // namespace dparallel::dist
