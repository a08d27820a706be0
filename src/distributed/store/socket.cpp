#include "distributed/store/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "core/error.h"

namespace dparallel::dist::net {

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};

std::unique_ptr<addrinfo, AddrInfoDeleter> resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) fail_invalid("cannot resolve host '", host, "': ", gai_strerror(rc));
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(result);
}

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// Waits for `events` on fd; false on deadline.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) fail(StatusCode::kIo, "poll failed: ", std::strerror(errno));
  }
}

}  // namespace

int listen_on(const std::string& host, uint16_t port, uint16_t* bound_port) {
  auto info = resolve(host, port);
  int last_errno = 0;
  for (addrinfo* ai = info.get(); ai != nullptr; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // A deep backlog (the kernel caps it at net.core.somaxconn) rides out a
    // flood while the server is busy, instead of dropping real clients' handshakes.
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 4096) == 0) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
      *bound_port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
      return fd;
    }
    last_errno = errno;
    ::close(fd);
  }
  fail(StatusCode::kIo, "cannot listen on ", host, ":", port, ": ", std::strerror(last_errno));
}

int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline) {
  auto info = resolve(host, port);
  auto pause = std::chrono::milliseconds(5);
  int last_errno = 0;
  for (;;) {
    for (addrinfo* ai = info.get(); ai != nullptr; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) continue;
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS && wait_for(fd, POLLOUT, deadline)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err == 0 ? EINPROGRESS : err;
      }
      if (rc == 0) {
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      last_errno = errno;
      ::close(fd);
    }
    if (Clock::now() + pause >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  fail(StatusCode::kTimeout, "connecting to ", host, ":", port, ": ",
       last_errno == EINPROGRESS ? "no answer" : std::strerror(last_errno));
}

void send_all(int fd, const void* data, size_t size, Clock::time_point deadline, const char* what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_for(fd, POLLOUT, deadline)) fail(StatusCode::kTimeout, what, ": send timed out");
      continue;
    }
    fail(StatusCode::kRemote, what, ": connection lost: ", std::strerror(errno));
  }
}

void recv_all(int fd, void* data, size_t size, Clock::time_point deadline, const char* what) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    if (!wait_for(fd, POLLIN, deadline)) fail(StatusCode::kTimeout, what, ": no reply before the timeout");
    ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    fail(StatusCode::kRemote, what, ": connection closed by the peer",
         n < 0 ? std::string(": ") + std::strerror(errno) : std::string());
  }
}

std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "unknown peer";
  char host[NI_MAXHOST] = {0}, port[NI_MAXSERV] = {0};
  if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), port, sizeof(port),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "unknown peer";
  }
  return std::string(host) + ":" + port;
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  return host == "::1";
}

}  // namespace dparallel::dist::net
