// The TCP store: rank 0 serves (a thread polling every connection), every
// rank is a client. The server binds only to the address it is given. With a
// job token, a client that does not present it is refused and logged.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <mutex>

#include "distributed/store/socket.h"
#include "distributed/store/store.h"

namespace dparallel::dist {

class TcpStoreServer;

struct TcpStoreOptions {
  std::string host;
  uint16_t port = 0;  // server: 0 picks a free port
  bool is_server = false;
  Millis timeout{300000};  // connecting, and each request's reply (capped by the call's own timeout)
  std::string token;       // empty: no token
};

class TcpStore : public Store {
 public:
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  // The port served or connected to.
  uint16_t port() const { return port_; }
  // This end's address of the connection to the server (ss_family AF_UNSPEC
  // when not connected): the address peers can reach this host on.
  sockaddr_storage local_address();

 private:
  struct Reply;
  Reply request(const std::vector<uint8_t>& frame, const char* what);
  // Callers hold mutex_.
  Reply exchange(const std::vector<uint8_t>& frame, net::Clock::time_point deadline, const char* what);
  void connect(net::Clock::time_point deadline);
  void disconnect();

  TcpStoreOptions options_;
  uint16_t port_ = 0;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request in flight per client
  int fd_ = -1;
};

}  // namespace dparallel::dist
