// The TCP store's server: one thread polling every connection, never
// blocking on any of them. Replies queue per client and go out as its socket
// accepts them; gets and waits are held until their keys appear or their
// time is up. The limits keep one client, or many, from taking it down.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "distributed/store/greeting.h"
#include "distributed/store/store.h"
#include "distributed/store/tcp_protocol.h"

namespace dparallel::dist {

struct TcpStoreServerLimits {
  // A client greeting beyond this many greeted ones evicts the greeted client
  // idle the longest. Connections that have not greeted never evict one.
  size_t max_clients = 1024;
  // An ungreeted connection beyond this many closes a stalled one, else one
  // of the address holding the most of them, else itself.
  size_t max_ungreeted = 64;
  Millis greeting_deadline{10000};
  // An ungreeted connection silent this long has stalled; one holding part
  // of a message has at once: a real client sends each message whole.
  Millis greeting_idle_limit{250};
  // A client whose pending replies make no progress for this long is closed.
  Millis stall_limit{5000};
  // A request begun must arrive whole within this.
  Millis frame_deadline{30000};
  // Past this much pending output, a client's requests wait unread.
  size_t output_cap = 1u << 20;
};

class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, uint16_t port, std::string token, const TcpStoreServerLimits& limits);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  uint16_t port() const { return port_; }

 private:
  using Clock = std::chrono::steady_clock;
  // A get or wait the server holds until its keys exist or its deadline.
  struct Held {
    wire::Command command;
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };
  struct Client {
    explicit Client(const std::string& token) : greeting(token) {}
    std::vector<uint8_t> in;  // received, not yet processed
    std::vector<uint8_t> out;
    size_t out_sent = 0;
    greeting::ServerGreeting greeting;
    bool greeted = false;
    bool closing = false;  // close once `out` is sent (a refusal)
    std::optional<Held> held;
    // Keys set once this connection closes (kSetOnClose), unless the server closes it to make room.
    std::vector<std::pair<std::string, Bytes>> close_notices;
    std::string peer;
    std::string address;                                       // the peer's host: its share of the ungreeted slots
    Clock::time_point since;                                   // accepted; the greeting deadline counts from here
    Clock::time_point last_input;                              // the last byte received, or the accept
    Clock::time_point last_progress;                           // last time pending output moved
    Clock::time_point last_request;                            // for evicting the client idle the longest
    Clock::time_point frame_since = Clock::time_point::max();  // the first byte of an unfinished request
    size_t pending() const { return out.size() - out_sent; }
  };
  void run();
  void accept_clients();
  void make_room_for_ungreeted(int newcomer);
  bool make_room_for_greeted(const Client& newcomer);
  // `notify`: set the client's close notices: when the peer closed or
  // broke the connection, not when the server closes it (to make room, at a
  // deadline, for a malformed message), since the client may live on.
  void close_client(int fd, bool notify = true);
  bool flush(Client& client, int fd);
  bool read_input(Client& client, int fd);
  bool process(Client& client, bool* changed);
  bool handle(Client& client, const wire::Request& request, bool* changed);
  void reply(Client& client, wire::ReplyStatus status, const Bytes& payload);
  bool can_process(const Client& client) const;
  void answer_held(Client& client, Clock::time_point now);
  void log(const std::string& peer, const std::string& message);

  std::string host_;
  std::string token_;
  TcpStoreServerLimits limits_;
  uint16_t port_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::map<int, Client> clients_;
  std::map<std::string, Bytes> data_;
  bool notices_set_ = false;  // a close set keys: the held requests may be answerable
  Clock::time_point accept_paused_until_{};
  // Rate limit of the log: lines in the current window, and those left out.
  Clock::time_point log_window_{};
  size_t log_lines_ = 0, log_dropped_ = 0;
};

}  // namespace dparallel::dist
