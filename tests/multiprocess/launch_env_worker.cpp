// One rank of a launch test: joins a cpu group from whatever launcher's
// variables it was started with (dp_process_group_create_from_env), checks an
// all_reduce of rank + 1 and prints "rank R of W: <scenario> passed".
//   group      just that.
//   host-port  plays the program's own framework on MASTER_ADDR:MASTER_PORT
//              too, as torch.distributed's env:// would, under dp-run: rank 0
//              listens there before the group is made, and once the group
//              works every other rank connects and sends its rank. The store
//              is at DP_STORE_PORT, which must differ.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "dparallel/dp_dist.h"

namespace {

[[noreturn]] void die(const std::string& what) {
  std::printf("failed: %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) die(std::string(name) + " is not set");
  return value;
}

sockaddr_in master_address() {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(env("MASTER_PORT").c_str())));
  if (::inet_pton(AF_INET, env("MASTER_ADDR").c_str(), &addr.sin_addr) != 1) die("MASTER_ADDR is not an IPv4 address");
  return addr;
}

// The host framework's server: listening on MASTER_PORT (no SO_REUSEADDR:
// nobody else may hold the port).
int listen_on_master_port() {
  sockaddr_in addr = master_address();
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 64) != 0) {
    die("cannot listen on MASTER_PORT " + env("MASTER_PORT") + ": " + std::strerror(errno));
  }
  return fd;
}

// Rank 0 takes a connection from every other rank, each sending its rank.
void accept_every_other_rank(int listener, int32_t world) {
  std::set<int32_t> seen;
  while (static_cast<int32_t>(seen.size()) < world - 1) {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 60000) != 1) die("no connection on MASTER_PORT within 60 s");
    int fd = ::accept(listener, nullptr, nullptr);
    int32_t peer = -1;
    if (fd < 0 || ::recv(fd, &peer, sizeof(peer), MSG_WAITALL) != static_cast<ssize_t>(sizeof(peer))) {
      die("a connection on MASTER_PORT sent no rank");
    }
    ::close(fd);
    seen.insert(peer);
  }
  if (*seen.begin() != 1 || *seen.rbegin() != world - 1) die("the ranks on MASTER_PORT are not 1..world-1");
}

void send_rank_to_master_port(int32_t rank) {
  sockaddr_in addr = master_address();
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::send(fd, &rank, sizeof(rank), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(rank))) {
    die(std::string("cannot reach MASTER_PORT: ") + std::strerror(errno));
  }
  ::close(fd);
}

void check_all_reduce(dp_process_group* pg) {
  const int32_t rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  float value = static_cast<float>(rank + 1);
  int64_t shape[1] = {1};
  dp_tensor* t = nullptr;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  if (dp_tensor_create(&t, DP_FLOAT32, 1, shape, cpu) != DP_OK ||
      dp_tensor_copy_from_host(t, &value, sizeof value) != DP_OK || dp_pg_all_reduce(pg, t, DP_SUM) != DP_OK ||
      dp_tensor_copy_to_host(t, &value, sizeof value) != DP_OK) {
    die(std::string("all_reduce: ") + dp_last_error());
  }
  dp_tensor_destroy(t);
  if (value != static_cast<float>(world * (world + 1) / 2)) die("all_reduce summed to " + std::to_string(value));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  if (scenario != "group" && scenario != "host-port") die("usage: launch_env_worker group|host-port");
  const bool host_port = scenario == "host-port";
  int listener = -1;
  if (host_port) {
    if (env("DP_STORE_PORT") == env("MASTER_PORT")) die("DP_STORE_PORT is MASTER_PORT");
    if (env("RANK") == "0") listener = listen_on_master_port();
  }
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.timeout_ms = 60000;
  dp_process_group* pg = nullptr;
  if (dp_process_group_create_from_env(&pg, &opts) != DP_OK) die(std::string("create: ") + dp_last_error());
  check_all_reduce(pg);
  const int32_t rank = dp_process_group_rank(pg), world = dp_process_group_size(pg);
  if (host_port) {
    if (rank == 0) {
      accept_every_other_rank(listener, world);
      ::close(listener);
    } else {
      send_rank_to_master_port(rank);
    }
    if (dp_pg_barrier(pg) != DP_OK) die(std::string("barrier: ") + dp_last_error());
  }
  dp_process_group_destroy(pg);
  std::printf("rank %d of %d: %s passed", rank, world, scenario.c_str());
  if (host_port)
    std::printf(" (store port %s, master port %s)", env("DP_STORE_PORT").c_str(), env("MASTER_PORT").c_str());
  std::printf("\n");
  return 0;
}
