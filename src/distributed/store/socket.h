// Blocking TCP helpers with deadlines, shared by the store's client and server.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dparallel::dist::net {

using Clock = std::chrono::steady_clock;

// A listening socket bound to `host` (not to every interface) and `port`
// (0: any free one); returns the fd and writes the bound port.
int listen_on(const std::string& host, uint16_t port, uint16_t* bound_port);
// Connects to host:port, retrying refused connections until `deadline`.
int connect_to(const std::string& host, uint16_t port, Clock::time_point deadline);
// Writes everything or throws kRemote (peer gone) / kTimeout.
void send_all(int fd, const void* data, size_t size, Clock::time_point deadline, const char* what);
// Reads exactly `size` bytes or throws kRemote (closed) / kTimeout.
void recv_all(int fd, void* data, size_t size, Clock::time_point deadline, const char* what);
std::string peer_name(int fd);
bool is_loopback_host(const std::string& host);

}  // namespace dparallel::dist::net
