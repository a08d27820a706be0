// The TCP store: rank 0 serves (a thread polling every connection), every
// rank is a client. The server binds only to the address it is given. With a
// job token, a client that does not present it is refused and logged.
#pragma once

#include <memory>
#include <mutex>

#include "distributed/store/store.h"

namespace dparallel::dist {

class TcpStoreServer;

struct TcpStoreOptions {
  std::string host;
  uint16_t port = 0;        // server: 0 picks a free port
  bool is_server = false;
  Millis timeout{300000};   // connecting, and each request's reply
  std::string token;        // empty: no token
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

 private:
  struct Reply;
  Reply request(const std::vector<uint8_t>& frame, const char* what);

  TcpStoreOptions options_;
  uint16_t port_ = 0;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request in flight per client
  int fd_ = -1;
};

}  // namespace dparallel::dist
