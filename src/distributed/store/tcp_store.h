// The TCP store's client: every rank is one; rank 0 also runs the server
// (tcp_store_server.h). The server binds only to the address it is given.
// With a job token, a client that does not present it is refused and logged.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <mutex>

#include "distributed/store/socket.h"
#include "distributed/store/store.h"
#include "distributed/store/tcp_protocol.h"
#include "distributed/store/tcp_store_server.h"

namespace dparallel::dist {

struct TcpStoreOptions {
  std::string host;
  uint16_t port = 0;  // server: 0 picks a free port
  bool is_server = false;
  Millis timeout{300000};  // connecting, and each request's reply (capped by the call's own timeout)
  std::string token;       // empty: no token
  // > 0: every handle counts itself as a worker, and the server's creation
  // waits (up to `timeout`) until this many have; 0: nobody waits.
  int32_t world_size = 0;
  TcpStoreServerLimits limits;  // the server's
};

class TcpStore : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  // The server holds the request until the key appears or `timeout` passes.
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool erase(const std::string& key) override;
  int64_t num_keys() override;  // the server's own keys ("__dp_store/...") included
  // The server holds the request; a timeout names the keys it still misses.
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  // The server sets the key when this client's connection closes, and a
  // connection opened again registers every key again.
  bool set_on_close(const std::string& key, const Bytes& value) override;
  // The port served or connected to.
  uint16_t port() const { return port_; }
  // This end's address of the connection to the server (ss_family AF_UNSPEC
  // when not connected): the address peers can reach this host on.
  sockaddr_storage local_address();

 private:
  // One request and its reply; `hold` is how long the server may hold it.
  wire::Reply request(const wire::Request& request, const char* what, Millis hold = Millis(0));
  wire::Reply request_locked(const wire::Request& request, const char* what, Millis hold = Millis(0));
  // Callers hold mutex_.
  wire::Reply exchange(const std::vector<uint8_t>& frame, net::Clock::time_point deadline, const char* what);
  void connect(net::Clock::time_point deadline);
  // connect, then the close notices registered so far.
  void reconnect(net::Clock::time_point deadline);
  void disconnect();
  void join_workers();

  TcpStoreOptions options_;
  uint16_t port_ = 0;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request in flight per client
  int fd_ = -1;
  std::vector<wire::Request> close_notices_;  // kSetOnClose requests, sent again on a new connection
};

}  // namespace dparallel::dist
