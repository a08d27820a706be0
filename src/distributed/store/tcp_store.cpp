#include "distributed/store/tcp_store.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <random>
#include <thread>

#include "core/error.h"
#include "distributed/store/greeting.h"
#include "distributed/store/socket.h"

namespace dparallel::dist {

using wire::Command;
using wire::ReplyStatus;

namespace {

constexpr const char* kJoinedKey = "__dp_store/joined";
// How long a server whose workers did not all join may spend counting them.
constexpr Millis kJoinedCountBound{2000};

// A connection that is not up within this is tried afresh: under a flood,
// a dropped handshake would otherwise wait out the kernel's growing retries.
constexpr Millis kConnectAttemptLimit{2000};
// The pause between attempts to connect and greet: doubling, with jitter.
constexpr Millis kFirstRetryPause{10};
constexpr Millis kLongestRetryPause{250};

// A greeting cut short by the connection (closed, reset, refused): worth
// another attempt, unlike a refusal of the token.
struct GreetingCutShort {
  std::string what;
};

// How long past a held request's time the client waits for the server's answer.
Millis reply_grace(Millis hold) { return std::clamp(hold / 10, Millis(100), Millis(1000)); }

// A hold the wire can carry, within the call's overall deadline.
Millis hold_of(Millis timeout) {
  return std::clamp(std::min(timeout, ReplyDeadlineCap::current()), Millis(0),
                    Millis(std::numeric_limits<uint32_t>::max()));
}

void check_key(const std::string& key, const char* what) {
  if (key.size() > wire::kMaxKeyBytes) {
    fail_invalid(what, ": the key is ", key.size(), " bytes; the TCP store's limit is ", wire::kMaxKeyBytes, " bytes");
  }
}

// A request carrying `key` and `value`, both checked against the limits.
wire::Request keyed_value(Command command, const std::string& key, const Bytes& value, uint32_t limit,
                          const char* what) {
  check_key(key, what);
  if (value.size() > limit) {
    fail_invalid(what, ": the value of key '", key, "' is ", value.size(), " bytes; the TCP store's limit is ", limit,
                 " bytes");
  }
  wire::Request r;
  r.command = command;
  r.keys.push_back(key);
  r.value = value;
  return r;
}

void check_keys(const std::vector<std::string>& keys, const char* what) {
  if (keys.size() > wire::kMaxKeys) {
    fail_invalid(what, ": ", keys.size(), " keys; the TCP store's limit is ", wire::kMaxKeys, " keys per call");
  }
  for (const std::string& key : keys) check_key(key, what);
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& key : keys) out += (out.empty() ? "'" : ", '") + key + "'";
  return out;
}

// True when the server closed the connection (or sent what nobody asked for) while it was idle.
bool closed_while_idle(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0;
}

}  // namespace

TcpStore::TcpStore(const TcpStoreOptions& options) : options_(options), port_(options.port) {
  if (options.host.empty()) fail_invalid("argument 'host' is empty");
  if (options.timeout.count() <= 0)
    fail_invalid("argument 'timeout_ms' is ", options.timeout.count(), "; it must be > 0");
  if (!options.is_server && options.port == 0) fail_invalid("argument 'port' is 0; a client needs the server's port");
  if (options.world_size < 0) fail_invalid("argument 'world_size' is ", options.world_size, "; it must be >= 0");
  set_default_timeout(options.timeout);
  if (options.is_server) {
    server_ = std::make_unique<TcpStoreServer>(options.host, options.port, options.token, options.limits);
    port_ = server_->port();
  }
  try {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      connect(net::Clock::now() + options.timeout);
    }
    if (options.world_size > 0) join_workers();
  } catch (...) {
    disconnect();
    throw;
  }
}

TcpStore::~TcpStore() { disconnect(); }

// Counts this handle as a worker; the server's waits for the last of them.
void TcpStore::join_workers() {
  {
    ReplyDeadlineCap cap(options_.timeout);
    int64_t number = TcpStore::add(kJoinedKey, 1);
    TcpStore::set(str_cat(kJoinedKey, "/", number), {});
  }
  if (!options_.is_server) return;
  try {
    TcpStore::wait({str_cat(kJoinedKey, "/", options_.world_size)}, options_.timeout);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;
    int64_t joined = -1;
    try {
      ReplyDeadlineCap brief(kJoinedCountBound);
      joined = TcpStore::add(kJoinedKey, 0);
    } catch (const Error&) {
      // Only the count in the message is lost.
    }
    fail(StatusCode::kTimeout, "the store server at ", options_.host, ":", port_, " waited ", options_.timeout.count(),
         " ms for world_size ", options_.world_size, " workers (itself included) but ",
         joined < 0 ? std::string("fewer") : std::to_string(joined), " joined");
  }
}

// Connects and greets, again and again until `deadline` while the
// connection fails (a server under a flood closes newcomers); a refusal of
// the token, or a peer that is no dparallel store, fails at once.
void TcpStore::connect(net::Clock::time_point deadline) {
  std::string where = str_cat(options_.host, ":", port_);
  auto greeting_exchange = [&](const std::vector<uint8_t>& frame) {
    try {
      return exchange(frame, deadline, "store greeting");
    } catch (const Error& e) {
      if (e.code() == StatusCode::kRemote) throw GreetingCutShort{e.what()};
      throw;
    }
  };
  auto start = net::Clock::now();
  thread_local std::minstd_rand jitter(static_cast<unsigned>(start.time_since_epoch().count()));
  Millis pause = kFirstRetryPause;
  std::string last;  // what ended the last attempt
  for (int attempt = 1;; ++attempt) {
    try {
      fd_ = net::connect_to(options_.host, port_, std::min(deadline, net::Clock::now() + kConnectAttemptLimit));
      greeting::greet_server(greeting_exchange, options_.token, where);
      return;
    } catch (const GreetingCutShort& e) {
      last = e.what;
    } catch (const Error& e) {
      disconnect();
      if (e.code() != StatusCode::kTimeout) throw;
      last = e.what();
    }
    disconnect();
    auto now = net::Clock::now();
    if (now + pause >= deadline) {
      fail(StatusCode::kTimeout, "cannot connect to the store at ", where, " before the timeout (", attempt,
           attempt == 1 ? " attempt in " : " attempts in ", std::chrono::duration_cast<Millis>(now - start).count(),
           " ms); the last one: ", last);
    }
    std::this_thread::sleep_for(pause / 2 + Millis(jitter() % (pause.count() / 2 + 1)));
    pause = std::min(pause * 2, kLongestRetryPause);
  }
}

void TcpStore::reconnect(net::Clock::time_point deadline) {
  connect(deadline);
  for (const wire::Request& notice : close_notices_)
    exchange(wire::encode_request(notice), deadline, "store set_on_close");
}

void TcpStore::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

sockaddr_storage TcpStore::local_address() {
  std::lock_guard<std::mutex> lock(mutex_);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) addr.ss_family = AF_UNSPEC;
  return addr;
}

// One request and its reply on the open connection. Anything but a
// well-formed reply closes it: the stream can no longer be trusted.
wire::Reply TcpStore::exchange(const std::vector<uint8_t>& frame, net::Clock::time_point deadline, const char* what) {
  wire::Reply r;
  try {
    net::send_all(fd_, frame.data(), frame.size(), deadline, what);
    uint8_t header[4];
    net::recv_all(fd_, header, 4, deadline, what);
    uint32_t size = wire::frame_body_size(header);
    if (size == 0 || size > wire::kMaxBodyBytes) {
      fail(StatusCode::kIo, what, ": malformed reply from the store (a ", size, "-byte frame); connection closed");
    }
    Bytes body(size);
    net::recv_all(fd_, body.data(), size, deadline, what);
    wire::decode_reply(body, &r);
  } catch (...) {
    disconnect();
    throw;
  }
  if (r.status == ReplyStatus::kError)
    fail(StatusCode::kIo, what, ": ", std::string(r.payload.begin(), r.payload.end()));
  return r;
}

wire::Reply TcpStore::request(const wire::Request& request, const char* what, Millis hold) {
  std::lock_guard<std::mutex> lock(mutex_);
  return request_locked(request, what, hold);
}

wire::Reply TcpStore::request_locked(const wire::Request& request, const char* what, Millis hold) {
  std::vector<uint8_t> frame = wire::encode_request(request);
  auto now = net::Clock::now();
  Millis bound = std::min(default_timeout(), ReplyDeadlineCap::current());
  // A call whose overall deadline has passed sends nothing: a request that
  // cannot be answered in time would close the connection, which the server
  // takes for this process leaving (its close notices).
  if (hold <= Millis(0) && bound <= Millis(0)) fail(StatusCode::kTimeout, what, ": the call's time is up");
  // An idle connection the server closed (evicted, say) is opened again; so
  // is one closed by an earlier timeout: one late reply must not lose the store.
  if (fd_ >= 0 && closed_while_idle(fd_)) disconnect();
  if (fd_ < 0) reconnect(now + bound);
  auto deadline = hold > Millis(0) ? net::Clock::now() + hold + reply_grace(hold) : now + bound;
  return exchange(frame, deadline, what);
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  request(keyed_value(Command::kSet, key, value, wire::kMaxValueBytes, "store set"), "store set");
}

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  check_key(key, "store get");
  wire::Request r;
  r.command = Command::kGet;
  r.keys.push_back(key);
  Millis hold = hold_of(timeout);
  r.timeout_ms = static_cast<uint32_t>(hold.count());
  wire::Reply reply;
  try {
    reply = request(r, "store get", hold);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;
    fail(StatusCode::kTimeout, "store get of key '", key, "' timed out after ", hold.count(),
         " ms (the store did not answer: ", e.what(), ")");
  }
  if (reply.status == ReplyStatus::kOk) return std::move(reply.payload);
  if (reply.status == ReplyStatus::kTimeout) {
    fail(StatusCode::kTimeout, "store get of key '", key, "' timed out after ", hold.count(), " ms");
  }
  fail(StatusCode::kIo, "store get: unexpected reply status ", static_cast<int>(reply.status), " from the store");
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  check_keys(keys, "store wait");
  wire::Request r;
  r.command = Command::kWait;
  r.keys = keys;
  Millis hold = hold_of(timeout);
  r.timeout_ms = static_cast<uint32_t>(hold.count());
  wire::Reply reply;
  try {
    reply = request(r, "store wait", hold);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;
    fail(StatusCode::kTimeout, "store wait timed out after ", hold.count(), " ms; missing key(s) ", quoted_list(keys),
         " (the store did not answer: ", e.what(), ")");
  }
  if (reply.status == ReplyStatus::kOk) return;
  std::vector<std::string> missing;
  if (reply.status == ReplyStatus::kTimeout && wire::decode_keys(reply.payload, &missing)) {
    fail(StatusCode::kTimeout, "store wait timed out after ", hold.count(), " ms; missing key(s) ",
         quoted_list(missing));
  }
  fail(StatusCode::kIo, "store wait: unexpected reply status ", static_cast<int>(reply.status), " from the store");
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  check_key(key, "store add");
  wire::Request r;
  r.command = Command::kAdd;
  r.keys.push_back(key);
  r.delta = delta;
  wire::Reply reply = request(r, "store add");
  if (reply.status != ReplyStatus::kOk || reply.payload.size() != 8) {
    fail(StatusCode::kIo, "store add: malformed reply from the store");
  }
  return static_cast<int64_t>(wire::get_le64(reply.payload.data()));
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  check_keys(keys, "store check");
  wire::Request r;
  r.command = Command::kCheck;
  r.keys = keys;
  return request(r, "store check").status == ReplyStatus::kOk;
}

bool TcpStore::erase(const std::string& key) {
  check_key(key, "store erase");
  wire::Request r;
  r.command = Command::kErase;
  r.keys.push_back(key);
  return request(r, "store erase").status == ReplyStatus::kOk;
}

int64_t TcpStore::num_keys() {
  wire::Request r;
  r.command = Command::kNumKeys;
  wire::Reply reply = request(r, "store num_keys");
  if (reply.status != ReplyStatus::kOk || reply.payload.size() != 8) {
    fail(StatusCode::kIo, "store num_keys: malformed reply from the store");
  }
  return static_cast<int64_t>(wire::get_le64(reply.payload.data()));
}

bool TcpStore::set_on_close(const std::string& key, const Bytes& value) {
  wire::Request r = keyed_value(Command::kSetOnClose, key, value, wire::kMaxCloseValueBytes, "store set_on_close");
  // One hold of the lock: a reconnect in between would register it twice or not at all.
  std::lock_guard<std::mutex> lock(mutex_);
  request_locked(r, "store set_on_close");
  auto same = std::find_if(close_notices_.begin(), close_notices_.end(),
                           [&](const wire::Request& notice) { return notice.keys[0] == key; });
  if (same != close_notices_.end()) {
    same->value = value;
  } else {
    close_notices_.push_back(std::move(r));
  }
  return true;
}

}  // namespace dparallel::dist
