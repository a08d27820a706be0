// The TCP store under hostile or stalled peers: slow readers,
// unauthenticated floods, descriptor exhaustion, stalled or untrusted
// servers, malformed replies. Every test is bounded in time and leaves no
// process behind.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "distributed/store/tcp_protocol.h"
#include "test_util.h"

namespace {

using Clock = std::chrono::steady_clock;

struct StoreDeleter {
  void operator()(dp_store* s) const { dp_store_destroy(s); }
};
using StorePtr = std::unique_ptr<dp_store, StoreDeleter>;

StorePtr tcp_store(uint16_t port, int is_server, int32_t timeout_ms) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", port, 2, is_server, timeout_ms), DP_OK) << dp_last_error();
  return StorePtr(s);
}

uint16_t port_of(dp_store* s) {
  uint16_t port = 0;
  EXPECT_EQ(dp_store_tcp_port(s, &port), DP_OK) << dp_last_error();
  return port;
}

int raw_connect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  return fd;
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  std::memcpy(b, &v, 4);
  out.insert(out.end(), b, b + 4);
}

// A request frame: command byte and one string.
std::vector<uint8_t> frame(uint8_t command, const std::string& text) {
  std::vector<uint8_t> body{command};
  put_u32(body, static_cast<uint32_t>(text.size()));
  body.insert(body.end(), text.begin(), text.end());
  std::vector<uint8_t> out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

// True when the peer closed `fd` within `limit`.
bool closed_within(int fd, std::chrono::milliseconds limit) {
  auto end = Clock::now() + limit;
  char buf[4096];
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// Connects and greets like a store client with an empty job token.
int greeted_connect(uint16_t port, int rcvbuf = 0) {
  int fd = raw_connect(port);
  if (rcvbuf > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  std::string client_nonce(dparallel::dist::wire::kNonceBytes, 'c');
  std::vector<uint8_t> hello = frame(1, client_nonce);
  EXPECT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  uint8_t answer[4 + 1 + dparallel::dist::wire::kNonceBytes + dparallel::dist::wire::kProofBytes];
  EXPECT_EQ(::recv(fd, answer, sizeof(answer), MSG_WAITALL), static_cast<ssize_t>(sizeof(answer)));
  std::string server_nonce(reinterpret_cast<char*>(answer) + 5, dparallel::dist::wire::kNonceBytes);
  std::vector<uint8_t> proof = frame(6, dparallel::dist::wire::client_proof("", client_nonce, server_nonce));
  EXPECT_EQ(::send(fd, proof.data(), proof.size(), 0), static_cast<ssize_t>(proof.size()));
  uint8_t ok[5];
  EXPECT_EQ(::recv(fd, ok, sizeof(ok), MSG_WAITALL), 5);
  EXPECT_EQ(ok[4], 0);
  return fd;
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// A loopback listener that greets like a store server, then misbehaves as told.
class FakeServer {
 public:
  FakeServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 8), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~FakeServer() {
    for (int fd : conns_) ::close(fd);
    ::close(fd_);
  }
  uint16_t port() const { return port_; }
  // Accepts one connection within `limit` and answers its greeting as a
  // store knowing `token` would; -1 on none. `answer`, when set, replaces
  // the first reply's payload (a server that proves nothing).
  int accept_and_greet(std::chrono::milliseconds limit, const std::string& token = "",
                       const std::string* answer = nullptr) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) <= 0) return -1;
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return -1;
    conns_.push_back(fd);
    std::vector<uint8_t> hello = read_frame(fd);
    received_.insert(received_.end(), hello.begin(), hello.end());
    std::string client_nonce(hello.size() > 9 ? hello.begin() + 9 : hello.end(), hello.end());
    std::string server_nonce(dparallel::dist::wire::kNonceBytes, 's');
    std::string payload = answer != nullptr
                              ? *answer
                              : server_nonce + dparallel::dist::wire::server_proof(token, client_nonce, server_nonce);
    send_reply(fd, payload);
    if (answer != nullptr) return fd;
    std::vector<uint8_t> proof = read_frame(fd);
    received_.insert(received_.end(), proof.begin(), proof.end());
    send_reply(fd, "");
    return fd;
  }
  static void send_reply(int fd, const std::string& payload) {
    std::vector<uint8_t> out;
    put_u32(out, static_cast<uint32_t>(payload.size() + 1));
    out.push_back(0);  // kOk
    out.insert(out.end(), payload.begin(), payload.end());
    EXPECT_EQ(::send(fd, out.data(), out.size(), MSG_NOSIGNAL), static_cast<ssize_t>(out.size()));
  }
  // Every byte the greeted clients sent during their greetings.
  const std::vector<uint8_t>& received() const { return received_; }
  // One whole frame, its length included; empty when the peer closed.
  static std::vector<uint8_t> read_frame(int fd) {
    uint32_t size = 0;
    if (::recv(fd, &size, 4, MSG_WAITALL) != 4 || size > (1u << 20)) return {};
    std::vector<uint8_t> frame(4 + size);
    std::memcpy(frame.data(), &size, 4);
    if (::recv(fd, frame.data() + 4, size, MSG_WAITALL) != static_cast<ssize_t>(size)) return {};
    return frame;
  }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::vector<int> conns_;
  std::vector<uint8_t> received_;
};

// A greeted client with a tiny receive buffer that asks for a `bytes` value and reads nothing.
int slow_reader_of(dp_store* server, size_t bytes) {
  std::vector<uint8_t> big(bytes, 7);
  EXPECT_EQ(dp_store_set(server, "big", big.data(), big.size()), DP_OK) << dp_last_error();
  int slow = greeted_connect(port_of(server), 4096);
  std::vector<uint8_t> get = frame(3, "big");
  EXPECT_EQ(::send(slow, get.data(), get.size(), 0), static_cast<ssize_t>(get.size()));
  return slow;
}

TEST(TcpStoreServer, AClientThatStopsReadingABigReplyDoesNotStallTheOthers) {
  StorePtr server = tcp_store(0, 1, 5000);
  uint16_t port = port_of(server.get());
  int slow = slow_reader_of(server.get(), 32u << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server is now sending the big reply

  StorePtr other = tcp_store(port, 0, 1000);
  ASSERT_NE(other, nullptr);
  for (int i = 0; i < 5; ++i) {
    auto start = Clock::now();
    DP_ASSERT_OK(dp_store_set(other.get(), "k", "v", 1));
    EXPECT_LT(ms_since(start), 500.0) << "request " << i << " waited on the slow client";
  }
  auto start = Clock::now();
  server.reset();  // destroying the server with output still pending is prompt
  EXPECT_LT(ms_since(start), 1000.0);
  ::close(slow);
}

TEST(TcpStoreServer, AClientThatNeverReadsIsClosedAfterTheStallLimit) {
  StorePtr server = tcp_store(0, 1, 5000);
  int slow = slow_reader_of(server.get(), 8u << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(7000));  // past the 5 s stall limit
  pollfd p{slow, POLLIN, 0};
  bool closed = false;
  char buf[65536];
  // Drains what was sent; the server must have closed the connection.
  for (auto end = Clock::now() + std::chrono::seconds(3); Clock::now() < end && !closed;) {
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(slow, buf, sizeof(buf), MSG_DONTWAIT);
    closed = n == 0 || (n < 0 && errno == ECONNRESET);
  }
  EXPECT_TRUE(closed);
  ::close(slow);
}

TEST(TcpStoreServer, RefusesALongFrameBeforeTheGreetingAsSoonAsItsLengthArrives) {
  StorePtr server = tcp_store(0, 1, 5000);
  int fd = raw_connect(port_of(server.get()));
  uint32_t size = 64u << 20;  // within the limit of a set, far over a greeting
  ASSERT_EQ(::send(fd, &size, 4, 0), 4);
  EXPECT_TRUE(closed_within(fd, std::chrono::milliseconds(1000)));
  ::close(fd);
}

TEST(TcpStoreServer, IdleClientsThatNeverGreetCannotLockOutARank) {
  StorePtr server = tcp_store(0, 1, 5000);
  uint16_t port = port_of(server.get());
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(raw_connect(port));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all accepted
  StorePtr client = tcp_store(port, 0, 2000);                   // one more: the oldest idle one goes
  ASSERT_NE(client, nullptr);
  DP_EXPECT_OK(dp_store_set(client.get(), "k", "v", 1));
  EXPECT_TRUE(closed_within(idle.front(), std::chrono::milliseconds(1000)));
  for (int fd : idle) ::close(fd);
}

// Runs `body` in a child process, which exits with its result; bounded by `limit`.
int run_in_child(const std::function<int()>& body, std::chrono::seconds limit) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  for (auto end = Clock::now() + limit; Clock::now() < end;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return 101;
}

TEST(TcpStoreServer, BacksOffWhenAcceptRunsOutOfDescriptors) {
  int ports[2];
  ASSERT_EQ(::pipe(ports), 0);
  int conns[2];
  ASSERT_EQ(::pipe(conns), 0);
  std::thread client([&] {
    uint16_t port = 0;
    if (::read(ports[0], &port, 2) != 2) return;
    std::vector<int> fds;
    for (int i = 0; i < 8; ++i) fds.push_back(raw_connect(port));
    char done = 0;
    (void)!::read(conns[0], &done, 1);  // the child has measured
    for (int fd : fds) ::close(fd);
  });
  int result = run_in_child(
      [&] {
        dp_store* server = nullptr;
        if (dp_store_create_tcp(&server, "127.0.0.1", 0, 2, 1, 3000) != DP_OK) return 2;
        uint16_t port = 0;
        dp_store_tcp_port(server, &port);
        // No descriptor left for accept().
        int highest = 0;
        if (DIR* dir = ::opendir("/proc/self/fd")) {
          while (dirent* e = ::readdir(dir)) highest = std::max(highest, std::atoi(e->d_name));
          ::closedir(dir);
        }
        rlimit low{static_cast<rlim_t>(highest + 1), static_cast<rlim_t>(highest + 1)};
        ::setrlimit(RLIMIT_NOFILE, &low);
        while (::dup(0) >= 0) {
        }
        if (::write(ports[1], &port, 2) != 2) return 3;
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        rusage r0{}, r1{};
        ::getrusage(RUSAGE_SELF, &r0);
        std::this_thread::sleep_for(std::chrono::seconds(1));
        ::getrusage(RUSAGE_SELF, &r1);
        double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) +
                     (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e6;
        std::fprintf(stderr, "server CPU over 1 s while accept() fails: %.3f s\n", cpu);
        return cpu < 0.3 ? 0 : 1;  // spinning takes the whole second
      },
      std::chrono::seconds(20));
  char done = 1;
  (void)!::write(conns[1], &done, 1);
  client.join();
  for (int fd : {ports[0], ports[1], conns[0], conns[1]}) ::close(fd);
  EXPECT_EQ(result, 0);
}

TEST(TcpStoreClient, WaitReturnsAtItsOwnTimeoutWhenTheServerStalls) {
  FakeServer fake;
  dp_store* c = nullptr;
  std::thread greeter([&] { fake.accept_and_greet(std::chrono::milliseconds(5000)); });
  dp_status created = dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 6000);
  greeter.join();
  ASSERT_EQ(created, DP_OK) << dptest::last_error();
  StorePtr store(c);
  const char* keys[] = {"never", "nor-this"};
  auto start = Clock::now();
  EXPECT_EQ(dp_store_wait(store.get(), keys, 2, 500), DP_ETIMEOUT);
  EXPECT_LT(ms_since(start), 1500.0) << "the store's 6 s request timeout was used";
  std::string error = dptest::last_error();
  EXPECT_NE(error.find("'never'"), std::string::npos) << error;
  EXPECT_NE(error.find("'nor-this'"), std::string::npos) << error;
}

TEST(TcpStoreClient, AWaitTimeoutDoesNotLoseTheStore) {
  StorePtr server = tcp_store(0, 1, 5000);
  StorePtr client = tcp_store(port_of(server.get()), 0, 5000);
  const char* key = "later";
  EXPECT_EQ(dp_store_wait(client.get(), &key, 1, 100), DP_ETIMEOUT);
  EXPECT_NE(dptest::last_error().find("'later'"), std::string::npos) << dptest::last_error();
  DP_ASSERT_OK(dp_store_set(server.get(), "later", "x", 1));
  DP_EXPECT_OK(dp_store_wait(client.get(), &key, 1, 1000));
}

TEST(TcpStoreClient, AMalformedReplyClosesTheConnection) {
  FakeServer fake;
  dp_store* c = nullptr;
  int conn = -1;
  std::thread greeter([&] { conn = fake.accept_and_greet(std::chrono::milliseconds(5000)); });
  dp_status created = dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 2000);
  greeter.join();
  ASSERT_EQ(created, DP_OK) << dptest::last_error();
  ASSERT_GE(conn, 0);
  StorePtr store(c);
  std::thread answer([&] {
    (void)FakeServer::read_frame(conn);
    const uint8_t empty[] = {0, 0, 0, 0};  // a zero-length reply frame
    ::send(conn, empty, sizeof(empty), MSG_NOSIGNAL);
  });
  EXPECT_EQ(dp_store_set(store.get(), "k", "v", 1), DP_EIO);
  answer.join();
  EXPECT_NE(dptest::last_error().find("malformed"), std::string::npos) << dptest::last_error();
  EXPECT_TRUE(closed_within(conn, std::chrono::milliseconds(1000)));
}

TEST(TcpStoreClient, TrustsNoServerThatCannotProveItKnowsTheToken) {
  ::setenv("DP_STORE_TOKEN", "job-token", 1);
  for (const std::string& answer : {std::string(), std::string(48, 'x')}) {  // no proof; a wrong one
    FakeServer fake;
    std::thread greeter([&] { fake.accept_and_greet(std::chrono::milliseconds(5000), "job-token", &answer); });
    dp_store* c = nullptr;
    EXPECT_EQ(dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 2000), DP_EREMOTE);
    greeter.join();
    EXPECT_EQ(c, nullptr);
    dp_store_destroy(c);
  }
  EXPECT_NE(dptest::last_error().find("DP_STORE_TOKEN"), std::string::npos) << dptest::last_error();
  ::unsetenv("DP_STORE_TOKEN");
}

TEST(TcpStoreClient, NeverSendsTheTokenItself) {
  ::setenv("DP_STORE_TOKEN", "job-token-never-on-the-wire", 1);
  FakeServer fake;
  std::thread greeter([&] { fake.accept_and_greet(std::chrono::milliseconds(5000), "job-token-never-on-the-wire"); });
  dp_store* c = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 2000), DP_OK) << dp_last_error();
  greeter.join();
  dp_store_destroy(c);
  ::unsetenv("DP_STORE_TOKEN");
  std::string wire(fake.received().begin(), fake.received().end());
  EXPECT_FALSE(wire.empty());
  EXPECT_EQ(wire.find("job-token-never-on-the-wire"), std::string::npos);
}

}  // namespace
