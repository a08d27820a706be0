#include "distributed/store/tcp_store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "core/error.h"
#include "distributed/store/socket.h"
#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist {

using wire::Command;
using wire::ReplyStatus;

namespace {

std::string random_nonce() {
  std::random_device rd;
  std::string nonce(wire::kNonceBytes, '\0');
  for (size_t i = 0; i < nonce.size(); i += 4) {
    uint32_t r = rd();
    std::memcpy(&nonce[i], &r, std::min<size_t>(4, nonce.size() - i));
  }
  return nonce;
}

Bytes to_bytes(int64_t v) {
  Bytes out(8);
  std::memcpy(out.data(), &v, 8);
  return out;
}

}  // namespace

// Never blocks in its thread: replies queue per client and go out as the
// socket accepts them, so one slow or hostile client cannot stall the rest.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, uint16_t port, std::string token) : host_(host), token_(std::move(token)) {
    listen_fd_ = net::listen_on(host, port, &port_);
    if (::pipe2(wake_, O_CLOEXEC) != 0) {
      ::close(listen_fd_);
      fail(StatusCode::kIo, "cannot create the store server's wake pipe: ", std::strerror(errno));
    }
    thread_ = std::thread([this] { run(); });
  }

  ~TcpStoreServer() {
    char byte = 0;
    while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
    for (auto& [fd, client] : clients_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }

  // Limits that keep one client (or many unauthenticated ones) from taking the server down.
  static constexpr size_t kMaxClients = 1024;
  static constexpr size_t kMaxUngreeted = 64;
  static constexpr auto kGreetingDeadline = std::chrono::seconds(10);
  static constexpr auto kStallLimit = std::chrono::seconds(5);  // pending output with no progress
  static constexpr size_t kOutputCap = 1u << 20;                // stop reading requests above this
  static constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

 private:
  using Clock = net::Clock;

  struct Client {
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
    size_t out_sent = 0;
    bool greeted = false;
    bool closing = false;                    // close once `out` is sent (a refusal)
    std::string client_nonce, server_nonce;  // the greeting's, once it has begun
    std::string peer;
    Clock::time_point since;          // accepted; the greeting deadline counts from here
    Clock::time_point last_progress;  // last time pending output moved
    size_t pending() const { return out.size() - out_sent; }
  };

  void log(const std::string& peer, const std::string& message) {
    std::fprintf(stderr, "dparallel store server %s:%u: client %s: %s\n", host_.c_str(), port_, peer.c_str(),
                 message.c_str());
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<int> doomed;
    for (;;) {
      auto now = Clock::now();
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      bool listening = now >= accept_paused_until_ && clients_.size() < kMaxClients;
      fds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});
      Clock::time_point next = Clock::time_point::max();
      if (!listening && clients_.size() < kMaxClients) next = accept_paused_until_;
      for (auto& [fd, client] : clients_) {
        short events = 0;
        if (!client.closing && client.pending() <= kOutputCap) events |= POLLIN;
        if (client.pending() > 0) {
          events |= POLLOUT;
          next = std::min(next, client.last_progress + kStallLimit);
        }
        if (!client.greeted) next = std::min(next, client.since + kGreetingDeadline);
        fds.push_back({fd, events, 0});
      }
      int wait_ms = -1;
      if (next != Clock::time_point::max()) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
        wait_ms = static_cast<int>(std::clamp<long long>(left, 0, 60000));
      }
      int rc = ::poll(fds.data(), fds.size(), wait_ms);
      if (rc < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents != 0) return;
      if (fds[1].revents & POLLIN) accept_client();
      now = Clock::now();
      doomed.clear();
      for (size_t i = 2; i < fds.size(); ++i) {
        int fd = fds[i].fd;
        auto it = clients_.find(fd);
        if (it == clients_.end()) continue;  // closed by accept_client() this round
        Client& client = it->second;
        bool keep = true;
        if (fds[i].revents & POLLOUT) keep = flush(client, fd);
        if (keep && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) keep = serve(fd, client);
        if (keep && client.pending() > 0) keep = flush(client, fd);
        if (keep && client.closing && client.pending() == 0) keep = false;
        if (keep && !client.greeted && now - client.since >= kGreetingDeadline) {
          log(client.peer, "refused: no greeting within the greeting deadline");
          keep = false;
        }
        if (keep && client.pending() > 0 && now - client.last_progress >= kStallLimit) {
          log(client.peer, "closed: it stopped reading its replies");
          linger reset{1, 0};  // drop the unsent output now instead of leaving it queued in the kernel
          ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
          keep = false;
        }
        if (!keep) doomed.push_back(fd);
      }
      for (int fd : doomed) close_client(fd);
    }
  }

  void accept_client() {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors: the listener stays readable, so stop polling it for a while.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        accept_paused_until_ = Clock::now() + kAcceptBackoff;
      }
      return;
    }
    // Too many clients that have not greeted: the oldest goes, so idle
    // connections cannot lock out the ranks that greet at once.
    size_t ungreeted = 0;
    int oldest = -1;
    for (auto& [other, client] : clients_) {
      if (client.greeted) continue;
      ++ungreeted;
      if (oldest < 0 || client.since < clients_.at(oldest).since) oldest = other;
    }
    if (ungreeted >= kMaxUngreeted) {
      log(clients_.at(oldest).peer, "closed: too many clients have not greeted; the oldest goes");
      close_client(oldest);
    }
    Client& client = clients_[fd];
    client.peer = net::peer_name(fd);
    client.since = client.last_progress = Clock::now();
  }

  void close_client(int fd) {
    ::close(fd);
    clients_.erase(fd);
  }

  // Sends what the socket takes now; false closes the connection.
  bool flush(Client& client, int fd) {
    while (client.pending() > 0) {
      ssize_t n = ::send(fd, client.out.data() + client.out_sent, client.pending(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        client.out_sent += static_cast<size_t>(n);
        client.last_progress = Clock::now();
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
    client.out.clear();
    client.out_sent = 0;
    return true;
  }

  // Reads what is there and answers every complete request; false closes the connection.
  bool serve(int fd, Client& client) {
    if (client.closing || client.pending() > kOutputCap) return true;  // read again once it drains
    uint8_t chunk[65536];
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK;
    client.in.insert(client.in.end(), chunk, chunk + n);
    size_t offset = 0;
    bool keep = true;
    while (keep && !client.closing) {
      // Before the greeting, a frame longer than a greeting is refused as soon as its length arrives.
      if (!client.greeted && client.in.size() - offset >= 4) {
        uint32_t size = 0;
        std::memcpy(&size, client.in.data() + offset, 4);
        if (size > wire::kMaxGreetingBytes) {
          log(client.peer, "refused: the first message (" + std::to_string(size) + " bytes) is not a greeting");
          return false;
        }
      }
      wire::Request request;
      size_t consumed = 0;
      std::string error;
      auto result =
          wire::parse_request(client.in.data() + offset, client.in.size() - offset, &request, &consumed, &error);
      if (result == wire::ParseResult::kNeedMore) break;
      if (result == wire::ParseResult::kMalformed) {
        log(client.peer, "malformed message (" + error + "); connection closed");
        return false;
      }
      offset += consumed;
      keep = handle(client, request);
    }
    client.in.erase(client.in.begin(), client.in.begin() + static_cast<std::ptrdiff_t>(offset));
    return keep;
  }

  bool reply(Client& client, ReplyStatus status, const Bytes& payload) {
    std::vector<uint8_t> frame = wire::encode_reply(status, payload);
    if (client.pending() == 0) {
      client.out = std::move(frame);
      client.out_sent = 0;
      client.last_progress = Clock::now();
    } else {
      client.out.insert(client.out.end(), frame.begin(), frame.end());
    }
    return true;
  }

  bool handle(Client& client, const wire::Request& request) {
    if (!client.greeted) {
      if (client.server_nonce.empty()) {
        if (request.command != Command::kHello || request.keys[0].size() != wire::kNonceBytes) {
          log(client.peer, "refused: the first message was not a greeting");
          return false;
        }
        client.client_nonce = request.keys[0];
        client.server_nonce = random_nonce();
        std::string answer = client.server_nonce + wire::server_proof(token_, client.client_nonce, client.server_nonce);
        return reply(client, ReplyStatus::kOk, Bytes(answer.begin(), answer.end()));
      }
      if (request.command != Command::kProof) {
        log(client.peer, "refused: the greeting was not followed by a proof of the job token");
        return false;
      }
      if (!wire::equal_in_constant_time(request.keys[0],
                                        wire::client_proof(token_, client.client_nonce, client.server_nonce))) {
        log(client.peer, "refused: job token mismatch (DP_STORE_TOKEN)");
        client.closing = true;
        return reply(client, ReplyStatus::kRefused, {});
      }
      client.greeted = true;
      return reply(client, ReplyStatus::kOk, {});
    }
    switch (request.command) {
      case Command::kHello:
      case Command::kProof:
        return reply(client, ReplyStatus::kOk, {});
      case Command::kSet:
        data_[request.keys[0]] = request.value;
        return reply(client, ReplyStatus::kOk, {});
      case Command::kGet: {
        auto it = data_.find(request.keys[0]);
        if (it == data_.end()) return reply(client, ReplyStatus::kNotFound, {});
        return reply(client, ReplyStatus::kOk, it->second);
      }
      case Command::kAdd: {
        auto it = data_.find(request.keys[0]);
        int64_t value = 0;
        if (it != data_.end()) {
          try {
            value = parse_counter(it->second, request.keys[0]);
          } catch (const Error& e) {
            std::string text = e.what();
            return reply(client, ReplyStatus::kError, Bytes(text.begin(), text.end()));
          }
        }
        // Wraps like the other stores' integers rather than overflowing.
        value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(request.delta));
        data_[request.keys[0]] = format_counter(value);
        return reply(client, ReplyStatus::kOk, to_bytes(value));
      }
      case Command::kCheck: {
        bool all = true;
        for (const std::string& key : request.keys) all = all && data_.count(key) != 0;
        return reply(client, all ? ReplyStatus::kOk : ReplyStatus::kNotFound, {});
      }
    }
    return false;
  }

  std::string host_;
  std::string token_;
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::map<int, Client> clients_;
  std::map<std::string, Bytes> data_;
  Clock::time_point accept_paused_until_{};
};

struct TcpStore::Reply {
  ReplyStatus status;
  Bytes payload;
};

TcpStore::TcpStore(const TcpStoreOptions& options) : options_(options), port_(options.port) {
  if (options.host.empty()) fail_invalid("argument 'host' is empty");
  if (options.timeout.count() <= 0)
    fail_invalid("argument 'timeout_ms' is ", options.timeout.count(), "; it must be > 0");
  if (!options.is_server && options.port == 0) fail_invalid("argument 'port' is 0; a client needs the server's port");
  set_default_timeout(options.timeout);
  if (options.is_server) {
    server_ = std::make_unique<TcpStoreServer>(options.host, options.port, options.token);
    port_ = server_->port();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  connect(net::Clock::now() + options.timeout);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

// The greeting: each side proves it knows the job token (see tcp_protocol.h).
void TcpStore::connect(net::Clock::time_point deadline) {
  fd_ = net::connect_to(options_.host, port_, deadline);
  std::string client_nonce = random_nonce();
  wire::Request hello;
  hello.command = Command::kHello;
  hello.keys.push_back(client_nonce);
  Reply r = exchange(wire::encode_request(hello), deadline, "store greeting");
  std::string answer(r.payload.begin(), r.payload.end());
  if (r.status != ReplyStatus::kOk || answer.size() != wire::kNonceBytes + wire::kProofBytes) {
    disconnect();
    fail(StatusCode::kRemote, "the server at ", options_.host, ":", port_,
         " did not answer the greeting as a dparallel store does (status ", static_cast<int>(r.status), ", ",
         answer.size(), " bytes)");
  }
  std::string server_nonce = answer.substr(0, wire::kNonceBytes);
  if (!wire::equal_in_constant_time(answer.substr(wire::kNonceBytes),
                                    wire::server_proof(options_.token, client_nonce, server_nonce))) {
    disconnect();
    fail(StatusCode::kRemote, "the store at ", options_.host, ":", port_,
         " does not know this client's job token (DP_STORE_TOKEN): the tokens differ, or it is another job's "
         "store; not trusted");
  }
  wire::Request proof;
  proof.command = Command::kProof;
  proof.keys.push_back(wire::client_proof(options_.token, client_nonce, server_nonce));
  r = exchange(wire::encode_request(proof), deadline, "store greeting");
  if (r.status != ReplyStatus::kOk) {
    disconnect();
    fail(StatusCode::kRemote, "the store at ", options_.host, ":", port_,
         " refused this client: its job token (DP_STORE_TOKEN) does not match the server's");
  }
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
TcpStore::Reply TcpStore::exchange(const std::vector<uint8_t>& frame, net::Clock::time_point deadline,
                                   const char* what) {
  Reply r;
  try {
    net::send_all(fd_, frame.data(), frame.size(), deadline, what);
    uint32_t size = 0;
    net::recv_all(fd_, &size, 4, deadline, what);
    if (size == 0 || size > wire::kMaxBodyBytes) {
      fail(StatusCode::kIo, what, ": malformed reply from the store (a ", size, "-byte frame); connection closed");
    }
    Bytes body(size);
    net::recv_all(fd_, body.data(), size, deadline, what);
    r = Reply{static_cast<ReplyStatus>(body[0]), Bytes(body.begin() + 1, body.end())};
  } catch (...) {
    disconnect();
    throw;
  }
  if (r.status == ReplyStatus::kError)
    fail(StatusCode::kIo, what, ": ", std::string(r.payload.begin(), r.payload.end()));
  return r;
}

TcpStore::Reply TcpStore::request(const std::vector<uint8_t>& frame, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = net::Clock::now() + std::min(default_timeout(), ReplyDeadlineCap::current());
  // A connection closed by an earlier timeout is opened again: one late reply must not lose the store.
  if (fd_ < 0) connect(deadline);
  return exchange(frame, deadline, what);
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  wire::Request r;
  r.command = Command::kSet;
  r.keys.push_back(key);
  r.value = value;
  if (key.size() > wire::kMaxKeyBytes || value.size() > wire::kMaxValueBytes) {
    fail_invalid("store key (", key.size(), " bytes) or value (", value.size(), " bytes) exceeds the limit (",
                 wire::kMaxKeyBytes, " and ", wire::kMaxValueBytes, " bytes)");
  }
  request(wire::encode_request(r), "store set");
}

Bytes TcpStore::get(const std::string& key, Millis timeout) {
  wire::Request r;
  r.command = Command::kGet;
  r.keys.push_back(key);
  std::vector<uint8_t> frame = wire::encode_request(r);
  Bytes value;
  bool found = false;
  try {
    ReplyDeadlineCap cap(timeout);  // one deadline for every request of this call
    found = poll_until(
        [&] {
          Reply reply = request(frame, "store get");
          if (reply.status != ReplyStatus::kOk) return false;
          value = std::move(reply.payload);
          return true;
        },
        timeout);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;  // a request cut off by the deadline is a plain timeout
  }
  if (!found) fail(StatusCode::kTimeout, "store get of key '", key, "' timed out after ", timeout.count(), " ms");
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  wire::Request r;
  r.command = Command::kAdd;
  r.keys.push_back(key);
  r.delta = delta;
  Reply reply = request(wire::encode_request(r), "store add");
  if (reply.payload.size() != 8) fail(StatusCode::kIo, "store add: malformed reply from the store");
  int64_t value = 0;
  std::memcpy(&value, reply.payload.data(), 8);
  return value;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  wire::Request r;
  r.command = Command::kCheck;
  r.keys = keys;
  return request(wire::encode_request(r), "store check").status == ReplyStatus::kOk;
}

}  // namespace dparallel::dist
