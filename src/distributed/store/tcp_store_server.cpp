#include "distributed/store/tcp_store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "distributed/store/socket.h"

namespace dparallel::dist {

using wire::Command;
using wire::ReplyStatus;

namespace {

constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
// Connections accepted per round: enough to keep a flood from filling the
// listen backlog (where real clients' connections would be dropped).
constexpr int kAcceptsPerRound = 256;
// The log prints at most this many lines per window, then counts the rest.
constexpr size_t kLogLinesPerWindow = 20;
constexpr auto kLogWindow = std::chrono::seconds(10);
// The most a greeted client may have buffered: one whole request.
constexpr size_t kMaxInputBytes = 4 + static_cast<size_t>(wire::kMaxBodyBytes);

Bytes le64_bytes(int64_t v) {
  Bytes out;
  wire::put_le64(out, static_cast<uint64_t>(v));
  return out;
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, std::string token,
                               const TcpStoreServerLimits& limits)
    : host_(host), token_(std::move(token)), limits_(limits) {
  listen_fd_ = net::listen_on(host, port, &port_);
  // accept_clients() takes what is waiting, never blocking once it is all taken.
  ::fcntl(listen_fd_, F_SETFL, ::fcntl(listen_fd_, F_GETFL) | O_NONBLOCK);
  if (::pipe2(wake_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    fail(StatusCode::kIo, "cannot create the store server's wake pipe: ", std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char byte = 0;
  while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  for (auto& entry : clients_) ::close(entry.first);
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void TcpStoreServer::log(const std::string& peer, const std::string& message) {
  auto now = Clock::now();
  if (now - log_window_ >= kLogWindow) {
    if (log_dropped_ > 0) {
      std::fprintf(stderr, "dparallel store server %s:%u: %zu more client messages not logged\n", host_.c_str(), port_,
                   log_dropped_);
    }
    log_window_ = now;
    log_lines_ = log_dropped_ = 0;
  }
  if (log_lines_ >= kLogLinesPerWindow) {
    ++log_dropped_;
    return;
  }
  ++log_lines_;
  std::fprintf(stderr, "dparallel store server %s:%u: client %s: %s%s\n", host_.c_str(), port_, peer.c_str(),
               message.c_str(), log_lines_ == kLogLinesPerWindow ? " (further messages are counted, not logged)" : "");
}

bool TcpStoreServer::can_process(const Client& client) const {
  return !client.closing && !client.held && client.pending() <= limits_.output_cap;
}

void TcpStoreServer::run() {
  std::vector<pollfd> fds;
  std::vector<int> doomed;
  bool more = false;  // buffered requests left to process: poll without waiting
  for (;;) {
    auto now = Clock::now();
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    bool listening = now >= accept_paused_until_;
    fds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});
    Clock::time_point next = listening ? Clock::time_point::max() : accept_paused_until_;
    for (auto& [fd, client] : clients_) {
      short events = POLLRDHUP;
      size_t input_cap = client.greeted ? kMaxInputBytes : 4 + wire::kMaxGreetingBytes;
      if (can_process(client) && client.in.size() < input_cap) events |= POLLIN;
      if (client.pending() > 0) {
        events |= POLLOUT;
        next = std::min(next, client.last_progress + limits_.stall_limit);
      }
      if (!client.greeted) next = std::min(next, client.since + limits_.greeting_deadline);
      if (client.held) next = std::min(next, client.held->deadline);
      if (client.frame_since != Clock::time_point::max()) {
        next = std::min(next, client.frame_since + limits_.frame_deadline);
      }
      fds.push_back({fd, events, 0});
    }
    int wait_ms = -1;
    if (more) {
      wait_ms = 0;
    } else if (next != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
      wait_ms = static_cast<int>(std::clamp<long long>(left, 0, 60000));
    }
    int rc = ::poll(fds.data(), fds.size(), wait_ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents != 0) return;
    now = Clock::now();
    doomed.clear();
    // Input and output first; requests after, so that a set answers the gets held for it in the same round.
    for (size_t i = 2; i < fds.size(); ++i) {
      int fd = fds[i].fd;
      auto it = clients_.find(fd);
      if (it == clients_.end()) continue;  // evicted this round, by a client that greeted
      Client& client = it->second;
      bool keep = true;
      if (fds[i].revents & POLLOUT) keep = flush(client, fd);
      if (keep && (fds[i].revents & POLLIN)) keep = read_input(client, fd);
      // The peer is gone, or sends while we do not read (POLLIN not asked): it will never read the answers.
      if (keep && (fds[i].revents & (POLLHUP | POLLERR))) keep = false;
      if (keep && (fds[i].revents & POLLRDHUP) && !(fds[i].events & POLLIN)) keep = false;
      if (!keep) doomed.push_back(fd);
    }
    for (int fd : doomed) close_client(fd);
    doomed.clear();
    bool changed = true;
    while (changed) {
      changed = false;
      for (auto& [fd, client] : clients_) {
        answer_held(client, now);
        if (!process(client, &changed)) doomed.push_back(fd);
      }
      for (int fd : doomed) close_client(fd, false);  // closed by the server: the client may live on
      doomed.clear();
      changed = changed || std::exchange(notices_set_, false);
    }
    // After the reads, so that room is made by what each connection has sent.
    if (fds[1].revents & POLLIN) accept_clients();
    more = false;
    for (auto& [fd, client] : clients_) {
      bool keep = client.pending() == 0 || flush(client, fd);
      if (keep && client.closing && client.pending() == 0) keep = false;
      if (keep && !client.greeted && now - client.since >= limits_.greeting_deadline) {
        log(client.peer, "refused: no greeting within the greeting deadline");
        keep = false;
      }
      if (keep && client.frame_since != Clock::time_point::max() &&
          now - client.frame_since >= limits_.frame_deadline) {
        log(client.peer, "closed: a request did not arrive whole within the frame deadline");
        keep = false;
      }
      if (keep && client.pending() > 0 && now - client.last_progress >= limits_.stall_limit) {
        log(client.peer, "closed: it stopped reading its replies");
        linger reset{1, 0};  // drop the unsent output now instead of leaving it queued in the kernel
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
        keep = false;
      }
      if (!keep) {
        doomed.push_back(fd);
        continue;
      }
      // Requests buffered while the output was over the cap can go on now.
      if (can_process(client) && client.in.size() >= 4) {
        uint32_t size = wire::frame_body_size(client.in.data());
        if (client.in.size() - 4 >= size) more = true;
      }
    }
    for (int fd : doomed) close_client(fd, false);
    more = more || notices_set_;
  }
}

void TcpStoreServer::accept_clients() {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors: the listener stays readable, so stop polling it for a while.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        accept_paused_until_ = Clock::now() + kAcceptBackoff;
      }
      return;
    }
    Client& client = clients_.emplace(fd, Client(token_)).first->second;
    client.peer = net::peer_name(fd);
    client.address = client.peer.substr(0, client.peer.rfind(':'));
    client.since = client.last_progress = client.last_request = client.last_input = Clock::now();
    // A real client's greeting is usually here already: reading it now lets
    // the room be made by what the newcomer sent.
    bool changed = false;
    if (!read_input(client, fd) || !process(client, &changed) || !flush(client, fd)) {
      close_client(fd);
      continue;
    }
    make_room_for_ungreeted(fd);
  }
}

// Under a flood of connections that never greet, a real client must keep its
// slot while it greets. It sends each message whole and at once, so the
// first to go is a connection holding part of a message, then one silent
// past the idle limit; of these, the one quiet the longest. Failing that, an
// address holding more slots than the newcomer's gives one up (a flood from
// one host does not lock out the others); failing that, the newcomer goes,
// and a real client tries again.
void TcpStoreServer::make_room_for_ungreeted(int newcomer) {
  auto now = Clock::now();
  size_t ungreeted = 0;
  int partial = -1, silent = -1;
  auto quieter = [&](int fd, int than) {
    return than < 0 || clients_.at(fd).last_input < clients_.at(than).last_input;
  };
  for (auto& [fd, client] : clients_) {
    if (client.greeted) continue;
    ++ungreeted;
    if (!client.in.empty()) {
      if (quieter(fd, partial)) partial = fd;
    } else if (now - client.last_input >= limits_.greeting_idle_limit && quieter(fd, silent)) {
      silent = fd;
    }
  }
  if (ungreeted <= limits_.max_ungreeted) return;
  int victim = partial >= 0 ? partial : silent;
  const char* why = partial >= 0 ? "it sent part of a message and stopped" : "it has sent nothing for a while";
  if (victim < 0) {
    // Counted only now: most newcomers under a flood find a stalled victim first.
    std::map<std::string, size_t> per_address;
    for (auto& [fd, client] : clients_) {
      if (!client.greeted) ++per_address[client.address];
    }
    auto most = std::max_element(per_address.begin(), per_address.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    if (most->second > per_address[clients_.at(newcomer).address]) {
      for (auto& [fd, client] : clients_) {
        if (!client.greeted && client.address == most->first && quieter(fd, victim)) victim = fd;
      }
      why = "its address holds the most of them";
    }
  }
  if (victim < 0) {
    victim = newcomer;
    why = "none has stalled; it may try again";
  }
  log(clients_.at(victim).peer, str_cat(victim == newcomer ? "refused: " : "closed: ", limits_.max_ungreeted,
                                        " connections have not greeted and ", why));
  close_client(victim);
}

// A client that has greeted takes the place of the greeted one idle the
// longest when all places are taken; false when every one is busy.
bool TcpStoreServer::make_room_for_greeted(const Client& newcomer) {
  size_t greeted = 0;
  int idlest = -1;
  for (auto& [fd, client] : clients_) {
    if (!client.greeted || &client == &newcomer) continue;
    ++greeted;
    if (!client.held && client.pending() == 0 && client.in.empty() &&
        (idlest < 0 || client.last_request < clients_.at(idlest).last_request)) {
      idlest = fd;
    }
  }
  if (greeted < limits_.max_clients) return true;
  if (idlest < 0) {
    log(newcomer.peer, str_cat("refused: ", limits_.max_clients, " clients are connected and all are busy"));
    return false;
  }
  log(clients_.at(idlest).peer, str_cat("closed: ", limits_.max_clients,
                                        " clients are connected; the one idle the longest goes to let a new one in"));
  close_client(idlest, false);
  return true;
}

// Closing twice is harmless: the second finds nothing (the number may be another's by then).
void TcpStoreServer::close_client(int fd, bool notify) {
  auto it = clients_.find(fd);
  if (it == clients_.end()) return;
  if (notify) {
    for (auto& [key, value] : it->second.close_notices) data_[key] = std::move(value);
    notices_set_ = notices_set_ || !it->second.close_notices.empty();
  }
  ::close(fd);
  clients_.erase(it);
}

bool TcpStoreServer::flush(Client& client, int fd) {
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

// Reads what is there, up to one request's worth; false closes the connection.
bool TcpStoreServer::read_input(Client& client, int fd) {
  size_t cap = client.greeted ? kMaxInputBytes : 4 + wire::kMaxGreetingBytes;
  if (client.in.size() >= cap) return true;
  uint8_t chunk[65536];
  ssize_t n = ::recv(fd, chunk, std::min(sizeof(chunk), cap - client.in.size()), MSG_DONTWAIT);
  if (n == 0) {
    bool changed = false;
    process(client, &changed);  // what it sent before leaving still counts
    return false;
  }
  if (n < 0) return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK;
  client.in.insert(client.in.end(), chunk, chunk + n);
  client.last_input = Clock::now();
  return true;
}

// Answers buffered requests while the client may have more; false closes the connection.
bool TcpStoreServer::process(Client& client, bool* changed) {
  size_t offset = 0;
  bool keep = true;
  while (keep && can_process(client)) {
    size_t left = client.in.size() - offset;
    // Before the greeting, a frame longer than a greeting is refused as soon as its length arrives.
    if (!client.greeted && left >= 4) {
      uint32_t size = wire::frame_body_size(client.in.data() + offset);
      if (size > wire::kMaxGreetingBytes) {
        log(client.peer, "refused: the first message (" + std::to_string(size) + " bytes) is not a greeting");
        return false;
      }
    }
    wire::Request request;
    size_t consumed = 0;
    std::string error;
    auto result = wire::parse_request(client.in.data() + offset, left, &request, &consumed, &error);
    if (result == wire::ParseResult::kNeedMore) break;
    if (result == wire::ParseResult::kMalformed) {
      log(client.peer, "malformed message (" + error + "); connection closed");
      return false;
    }
    offset += consumed;
    client.last_request = Clock::now();
    keep = handle(client, request, changed);
  }
  if (offset > 0) client.in.erase(client.in.begin(), client.in.begin() + static_cast<std::ptrdiff_t>(offset));
  // The frame deadline runs only while an unfinished request is being read.
  bool whole = client.in.size() >= 4 && client.in.size() - 4 >= wire::frame_body_size(client.in.data());
  if (client.in.empty() || whole || !can_process(client)) {
    client.frame_since = Clock::time_point::max();
  } else if (offset > 0 || client.frame_since == Clock::time_point::max()) {
    client.frame_since = Clock::now();
  }
  return keep;
}

void TcpStoreServer::reply(Client& client, ReplyStatus status, const Bytes& payload) {
  std::vector<uint8_t> frame = wire::encode_reply(status, payload);
  if (client.pending() == 0) {
    client.out = std::move(frame);
    client.out_sent = 0;
    client.last_progress = Clock::now();
  } else {
    client.out.insert(client.out.end(), frame.begin(), frame.end());
  }
}

void TcpStoreServer::answer_held(Client& client, Clock::time_point now) {
  if (!client.held) return;
  Held& held = *client.held;
  std::vector<std::string> missing;
  for (const std::string& key : held.keys) {
    if (data_.count(key) == 0) missing.push_back(key);
  }
  if (missing.empty()) {
    reply(client, ReplyStatus::kOk, held.command == Command::kGet ? data_.at(held.keys[0]) : Bytes());
  } else if (now >= held.deadline) {
    reply(client, ReplyStatus::kTimeout, held.command == Command::kWait ? wire::encode_keys(missing) : Bytes());
  } else {
    return;
  }
  client.held.reset();
}

bool TcpStoreServer::handle(Client& client, const wire::Request& request, bool* changed) {
  if (!client.greeted) {
    wire::Reply answer;
    std::string why;
    switch (client.greeting.on_request(request, &answer, &why)) {
      case greeting::ServerGreeting::Step::kAnswer:
        reply(client, answer.status, answer.payload);
        return true;
      case greeting::ServerGreeting::Step::kGreeted:
        if (!make_room_for_greeted(client)) return false;
        client.greeted = true;
        reply(client, answer.status, answer.payload);
        return true;
      case greeting::ServerGreeting::Step::kRefused:
        log(client.peer, why);
        client.closing = true;
        reply(client, answer.status, answer.payload);
        return true;
      case greeting::ServerGreeting::Step::kDrop:
        log(client.peer, why);
        return false;
    }
    return false;
  }
  switch (request.command) {
    case Command::kHello:
    case Command::kProof:
      reply(client, ReplyStatus::kOk, {});
      return true;
    case Command::kSet:
      data_[request.keys[0]] = request.value;
      *changed = true;
      reply(client, ReplyStatus::kOk, {});
      return true;
    case Command::kSetOnClose: {
      auto same = std::find_if(client.close_notices.begin(), client.close_notices.end(),
                               [&](const auto& notice) { return notice.first == request.keys[0]; });
      if (same != client.close_notices.end()) {
        same->second = request.value;
      } else if (client.close_notices.size() >= wire::kMaxCloseNotices) {
        std::string text = str_cat("this connection already holds ", wire::kMaxCloseNotices, " close notices");
        reply(client, ReplyStatus::kError, Bytes(text.begin(), text.end()));
        return true;
      } else {
        client.close_notices.emplace_back(request.keys[0], request.value);
      }
      // The registrant lives: a notice an earlier connection of its set
      // (closed by a timeout of its own) no longer holds.
      if (data_.erase(request.keys[0]) != 0) *changed = true;
      reply(client, ReplyStatus::kOk, {});
      return true;
    }
    case Command::kGet:
    case Command::kWait:
      client.held = Held{request.command, request.keys, Clock::now() + Millis(request.timeout_ms)};
      answer_held(client, Clock::now());
      return true;
    case Command::kAdd: {
      const std::string& key = request.keys[0];
      auto it = data_.find(key);
      int64_t value = 0;
      if (it != data_.end()) {
        try {
          value = parse_counter(it->second, key);
        } catch (const Error& e) {
          std::string text = e.what();
          reply(client, ReplyStatus::kError, Bytes(text.begin(), text.end()));
          return true;
        }
      }
      // Wraps like the other stores' integers rather than overflowing.
      value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(request.delta));
      data_[key] = format_counter(value);
      *changed = true;
      reply(client, ReplyStatus::kOk, le64_bytes(value));
      return true;
    }
    case Command::kNumKeys:
      reply(client, ReplyStatus::kOk, le64_bytes(static_cast<int64_t>(data_.size())));
      return true;
    case Command::kErase: {
      bool existed = data_.erase(request.keys[0]) != 0;
      reply(client, existed ? ReplyStatus::kOk : ReplyStatus::kNotFound, {});
      return true;
    }
    case Command::kCheck: {
      bool all = true;
      for (const std::string& k : request.keys) all = all && data_.count(k) != 0;
      reply(client, all ? ReplyStatus::kOk : ReplyStatus::kNotFound, {});
      return true;
    }
  }
  return false;
}

}  // namespace dparallel::dist
