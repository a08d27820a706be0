#include "distributed/store/tcp_store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"
#include "distributed/store/socket.h"
#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist {

using wire::Command;
using wire::ReplyStatus;

namespace {

Bytes to_bytes(int64_t v) {
  Bytes out(8);
  std::memcpy(out.data(), &v, 8);
  return out;
}

}  // namespace

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

 private:
  struct Client {
    std::vector<uint8_t> in;
    bool greeted = false;
    std::string peer;
  };

  void log(const std::string& peer, const std::string& message) {
    std::fprintf(stderr, "dparallel store server %s:%u: client %s: %s\n", host_.c_str(), port_, peer.c_str(),
                 message.c_str());
  }

  void run() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
      int rc = ::poll(fds.data(), fds.size(), -1);
      if (rc < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents != 0) return;
      if (fds[1].revents & POLLIN) accept_client();
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents != 0 && !serve(fds[i].fd)) close_client(fds[i].fd);
      }
    }
  }

  void accept_client() {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    timeval tv{2, 0};  // a client that stops reading its replies cannot stall the others for long
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    clients_[fd].peer = net::peer_name(fd);
  }

  void close_client(int fd) {
    ::close(fd);
    clients_.erase(fd);
  }

  // Reads what is there and answers every complete request; false closes the connection.
  bool serve(int fd) {
    Client& client = clients_.at(fd);
    uint8_t chunk[65536];
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) return errno == EINTR || errno == EAGAIN;
    client.in.insert(client.in.end(), chunk, chunk + n);
    size_t offset = 0;
    bool keep = true;
    while (keep) {
      wire::Request request;
      size_t consumed = 0;
      std::string error;
      auto result = wire::parse_request(client.in.data() + offset, client.in.size() - offset, &request, &consumed, &error);
      if (result == wire::ParseResult::kNeedMore) break;
      if (result == wire::ParseResult::kMalformed) {
        log(client.peer, "malformed message (" + error + "); connection closed");
        return false;
      }
      offset += consumed;
      keep = handle(fd, client, request);
    }
    client.in.erase(client.in.begin(), client.in.begin() + static_cast<std::ptrdiff_t>(offset));
    return keep;
  }

  bool reply(int fd, ReplyStatus status, const Bytes& payload) {
    std::vector<uint8_t> frame = wire::encode_reply(status, payload);
    const uint8_t* p = frame.data();
    size_t left = frame.size();
    while (left > 0) {
      ssize_t n = ::send(fd, p, left, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      left -= static_cast<size_t>(n);
    }
    return true;
  }

  bool handle(int fd, Client& client, const wire::Request& request) {
    if (!client.greeted) {
      if (request.command != Command::kHello) {
        log(client.peer, "refused: the first message was not a greeting");
        return false;
      }
      if (request.keys[0] != token_) {
        log(client.peer, "refused: job token mismatch (DP_STORE_TOKEN)");
        reply(fd, ReplyStatus::kRefused, {});
        return false;
      }
      client.greeted = true;
      return reply(fd, ReplyStatus::kOk, {});
    }
    switch (request.command) {
      case Command::kHello:
        return reply(fd, ReplyStatus::kOk, {});
      case Command::kSet:
        data_[request.keys[0]] = request.value;
        return reply(fd, ReplyStatus::kOk, {});
      case Command::kGet: {
        auto it = data_.find(request.keys[0]);
        if (it == data_.end()) return reply(fd, ReplyStatus::kNotFound, {});
        return reply(fd, ReplyStatus::kOk, it->second);
      }
      case Command::kAdd: {
        auto it = data_.find(request.keys[0]);
        int64_t value = 0;
        if (it != data_.end()) {
          try {
            value = parse_counter(it->second, request.keys[0]);
          } catch (const Error& e) {
            std::string text = e.what();
            return reply(fd, ReplyStatus::kError, Bytes(text.begin(), text.end()));
          }
        }
        // Wraps like the other stores' integers rather than overflowing.
        value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(request.delta));
        data_[request.keys[0]] = format_counter(value);
        return reply(fd, ReplyStatus::kOk, to_bytes(value));
      }
      case Command::kCheck: {
        bool all = true;
        for (const std::string& key : request.keys) all = all && data_.count(key) != 0;
        return reply(fd, all ? ReplyStatus::kOk : ReplyStatus::kNotFound, {});
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
};

struct TcpStore::Reply {
  ReplyStatus status;
  Bytes payload;
};

TcpStore::TcpStore(const TcpStoreOptions& options) : options_(options), port_(options.port) {
  if (options.host.empty()) fail_invalid("argument 'host' is empty");
  if (options.timeout.count() <= 0) fail_invalid("argument 'timeout_ms' is ", options.timeout.count(), "; it must be > 0");
  if (!options.is_server && options.port == 0) fail_invalid("argument 'port' is 0; a client needs the server's port");
  set_default_timeout(options.timeout);
  if (options.is_server) {
    server_ = std::make_unique<TcpStoreServer>(options.host, options.port, options.token);
    port_ = server_->port();
  }
  fd_ = net::connect_to(options.host, port_, net::Clock::now() + options.timeout);
  wire::Request hello;
  hello.command = Command::kHello;
  hello.keys.push_back(options.token);
  Reply r;
  try {
    r = request(wire::encode_request(hello), "store greeting");
  } catch (...) {
    ::close(fd_);
    throw;
  }
  if (r.status != ReplyStatus::kOk) {
    ::close(fd_);
    fail(StatusCode::kRemote, "the store at ", options.host, ":", port_,
         " refused this client: its job token (DP_STORE_TOKEN) does not match the server's");
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

TcpStore::Reply TcpStore::request(const std::vector<uint8_t>& frame, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fd_ < 0) fail(StatusCode::kRemote, what, ": the connection to the store was lost earlier");
  auto deadline = net::Clock::now() + std::min(default_timeout(), ReplyDeadlineCap::current());
  try {
    net::send_all(fd_, frame.data(), frame.size(), deadline, what);
    uint32_t size = 0;
    net::recv_all(fd_, &size, 4, deadline, what);
    if (size == 0 || size > wire::kMaxBodyBytes) fail(StatusCode::kIo, what, ": malformed reply from the store");
    Bytes body(size);
    net::recv_all(fd_, body.data(), size, deadline, what);
    Reply r{static_cast<ReplyStatus>(body[0]), Bytes(body.begin() + 1, body.end())};
    if (r.status == ReplyStatus::kError) fail(StatusCode::kIo, what, ": ", std::string(r.payload.begin(), r.payload.end()));
    return r;
  } catch (const Error& e) {
    if (e.code() != StatusCode::kIo) {  // a half-read reply leaves the stream unusable
      ::close(fd_);
      fd_ = -1;
    }
    throw;
  }
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
  bool found = poll_until(
      [&] {
        Reply reply = request(frame, "store get");
        if (reply.status != ReplyStatus::kOk) return false;
        value = std::move(reply.payload);
        return true;
      },
      timeout);
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
