// The TCP store under hostile or stalled peers: slow readers,
// unauthenticated floods, descriptor exhaustion, stalled or untrusted
// servers, malformed replies. Every test is bounded in time and leaves no
// process behind.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "distributed/store/greeting.h"
#include "distributed/store/tcp_protocol.h"
#include "distributed/store/tcp_store.h"
#include "test_util.h"

namespace {

using Clock = std::chrono::steady_clock;
using dparallel::dist::TcpStore;
using dparallel::dist::TcpStoreOptions;
using dparallel::dist::TcpStoreServerLimits;
namespace greeting = dparallel::dist::greeting;
namespace wire = dparallel::dist::wire;

struct StoreDeleter {
  void operator()(dp_store* s) const { dp_store_destroy(s); }
};
using StorePtr = std::unique_ptr<dp_store, StoreDeleter>;

StorePtr tcp_store(uint16_t port, int is_server, int32_t timeout_ms) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", port, is_server ? 1 : 2, is_server, timeout_ms), DP_OK)
      << dp_last_error();
  return StorePtr(s);
}

// A server with limits of the test's choosing.
std::unique_ptr<TcpStore> server_with(const TcpStoreServerLimits& limits) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.is_server = true;
  options.timeout = std::chrono::milliseconds(20000);
  options.limits = limits;
  return std::make_unique<TcpStore>(options);
}

uint16_t port_of(dp_store* s) {
  uint16_t port = 0;
  EXPECT_EQ(dp_store_tcp_port(s, &port), DP_OK) << dp_last_error();
  return port;
}

// A connection to the loopback server, from the loopback address `from` when given.
int raw_connect(uint16_t port, const char* from = nullptr) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (from != nullptr) {
    sockaddr_in source{};
    source.sin_family = AF_INET;
    ::inet_pton(AF_INET, from, &source.sin_addr);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&source), sizeof(source)), 0) << std::strerror(errno);
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  return fd;
}

using wire::put_le32;

// A request frame: command byte and one string.
std::vector<uint8_t> frame(uint8_t command, const std::string& text) {
  std::vector<uint8_t> body{command};
  put_le32(body, static_cast<uint32_t>(text.size()));
  body.insert(body.end(), text.begin(), text.end());
  std::vector<uint8_t> out;
  put_le32(out, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<uint8_t> get_frame(const std::string& key) {
  wire::Request get;
  get.command = wire::Command::kGet;
  get.keys = {key};
  return wire::encode_request(get);
}

// True when the peer closed `fd` within `limit`, reading (and dropping) what it sent.
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

// True when the peer closed or reset `fd` within `limit`, without reading
// from it: reading would count as progress for a client that never reads.
bool hung_up_within(int fd, std::chrono::milliseconds limit) {
  for (auto end = Clock::now() + limit; Clock::now() < end;) {
    pollfd p{fd, POLLRDHUP, 0};
    if (::poll(&p, 1, 50) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) return true;
  }
  return false;
}

// Connects and greets like a store client with an empty job token.
int greeted_connect(uint16_t port, int rcvbuf = 0, const char* from = nullptr) {
  int fd = raw_connect(port, from);
  if (rcvbuf > 0) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  std::string client_nonce(wire::kNonceBytes, 'c');
  std::vector<uint8_t> hello = frame(1, client_nonce);
  EXPECT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  uint8_t answer[4 + 1 + wire::kNonceBytes + wire::kProofBytes];
  EXPECT_EQ(::recv(fd, answer, sizeof(answer), MSG_WAITALL), static_cast<ssize_t>(sizeof(answer)));
  std::string server_nonce(reinterpret_cast<char*>(answer) + 5, wire::kNonceBytes);
  std::vector<uint8_t> proof = frame(6, greeting::client_proof("", client_nonce, server_nonce));
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
    std::string server_nonce(wire::kNonceBytes, 's');
    std::string payload =
        answer != nullptr ? *answer : server_nonce + greeting::server_proof(token, client_nonce, server_nonce);
    send_reply(fd, payload);
    if (answer != nullptr) return fd;
    std::vector<uint8_t> proof = read_frame(fd);
    received_.insert(received_.end(), proof.begin(), proof.end());
    send_reply(fd, "");
    // The client's join as a worker: an add, then a set.
    (void)read_frame(fd);
    send_reply(fd, std::string("\1\0\0\0\0\0\0\0", 8));
    (void)read_frame(fd);
    send_reply(fd, "");
    return fd;
  }
  // Accepts one connection within `limit` and closes it: after reading its
  // hello (the client sees the connection closed), or at once (reset, when
  // the hello is there unread). False on none.
  bool accept_and_close(std::chrono::milliseconds limit, bool read_hello) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(limit.count())) <= 0) return false;
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return false;
    if (read_hello) (void)read_frame(fd);
    ::close(fd);
    return true;
  }
  static void send_reply(int fd, const std::string& payload) {
    std::vector<uint8_t> out;
    put_le32(out, static_cast<uint32_t>(payload.size() + 1));
    out.push_back(0);  // kOk
    out.insert(out.end(), payload.begin(), payload.end());
    EXPECT_EQ(::send(fd, out.data(), out.size(), MSG_NOSIGNAL), static_cast<ssize_t>(out.size()));
  }
  // Every byte the greeted clients sent during their greetings.
  const std::vector<uint8_t>& received() const { return received_; }
  // One whole frame, its length included; empty when the peer closed.
  static std::vector<uint8_t> read_frame(int fd) {
    uint8_t header[4];
    if (::recv(fd, header, 4, MSG_WAITALL) != 4) return {};
    uint32_t size = wire::frame_body_size(header);
    if (size > (1u << 20)) return {};
    std::vector<uint8_t> frame(4 + size);
    std::memcpy(frame.data(), header, 4);
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
int slow_reader_of(TcpStore& server, size_t bytes) {
  server.set("big", dparallel::dist::Bytes(bytes, 7));
  int slow = greeted_connect(server.port(), 4096);
  std::vector<uint8_t> get = get_frame("big");
  EXPECT_EQ(::send(slow, get.data(), get.size(), 0), static_cast<ssize_t>(get.size()));
  return slow;
}

// A client of `server` (a TcpStore made by server_with).
std::unique_ptr<TcpStore> client_of(const TcpStore& server) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.port = server.port();
  options.timeout = std::chrono::milliseconds(20000);
  return std::make_unique<TcpStore>(options);
}

TEST(TcpStoreServer, ACloseNoticeIsSetWhenItsClientsConnectionClosesAndNotBefore) {
  std::unique_ptr<TcpStore> server = server_with({});
  std::unique_ptr<TcpStore> leaving = client_of(*server);
  std::unique_ptr<TcpStore> watching = client_of(*server);
  ASSERT_TRUE(leaving->set_on_close("job/gone/1", {'x'}));
  ASSERT_TRUE(leaving->set_on_close("job/gone/1", {'y'}));  // registered again: the last value wins
  leaving->set("job/alive/1", {'1'});
  EXPECT_FALSE(watching->check({"job/gone/1"}));
  // Held by the server until the close sets the key.
  auto gone = std::async(std::launch::async, [&] { return watching->get("job/gone/1", std::chrono::seconds(60)); });
  leaving.reset();
  EXPECT_EQ(gone.get(), (dparallel::dist::Bytes{'y'}));
}

// A notice set by a connection that closed while its process lived on (its
// own request timed out) no longer holds once the process registers again.
TEST(TcpStoreServer, RegisteringACloseNoticeAgainClearsTheKeyAnEarlierConnectionSet) {
  std::unique_ptr<TcpStore> server = server_with({});
  std::unique_ptr<TcpStore> first = client_of(*server);
  first->set_on_close("job/gone/2", {});
  first.reset();
  std::unique_ptr<TcpStore> watching = client_of(*server);
  ASSERT_TRUE(watching->check({"job/gone/2"}));
  std::unique_ptr<TcpStore> again = client_of(*server);
  again->set_on_close("job/gone/2", {});
  EXPECT_FALSE(watching->check({"job/gone/2"}));
  again.reset();
  EXPECT_EQ(watching->get("job/gone/2", std::chrono::seconds(60)), dparallel::dist::Bytes{});
}

TEST(TcpStoreServer, CloseNoticesBeyondTheLimitAndOversizedValuesAreRefusedNamingTheLimit) {
  std::unique_ptr<TcpStore> server = server_with({});
  std::unique_ptr<TcpStore> client = client_of(*server);
  for (size_t i = 0; i < wire::kMaxCloseNotices; ++i) client->set_on_close("n/" + std::to_string(i), {});
  try {
    client->set_on_close("n/one-more", {});
    ADD_FAILURE() << "a notice past the limit was taken";
  } catch (const dparallel::Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(wire::kMaxCloseNotices) + " close notices"), std::string::npos)
        << e.what();
  }
  client->set_on_close("n/0", {'z'});  // one already held may still change
  try {
    client->set_on_close("n/big", dparallel::dist::Bytes(wire::kMaxCloseValueBytes + 1));
    ADD_FAILURE() << "an oversized value was taken";
  } catch (const dparallel::Error& e) {
    EXPECT_EQ(e.code(), dparallel::StatusCode::kInvalidArgument);
  }
  client->set("still", {'1'});  // the connection is still good
  client.reset();
  std::unique_ptr<TcpStore> after = client_of(*server);
  EXPECT_TRUE(after->check({"n/0", "n/255"}));
  EXPECT_FALSE(after->check({"n/one-more"}));
  EXPECT_EQ(after->get("n/0", std::chrono::seconds(10)), (dparallel::dist::Bytes{'z'}));
}

TEST(TcpStoreServer, AClientThatStopsReadingABigReplyDoesNotStallTheOthers) {
  TcpStoreServerLimits limits;
  limits.stall_limit = std::chrono::seconds(600);  // the slow client stays for the whole test
  auto server = server_with(limits);
  int slow = slow_reader_of(*server, 32u << 20);
  StorePtr other = tcp_store(server->port(), 0, 20000);
  ASSERT_NE(other, nullptr);
  // A server waiting on the slow client would time these out (20 s, well before its stall limit).
  for (int i = 0; i < 5; ++i) DP_ASSERT_OK(dp_store_set(other.get(), "k", "v", 1)) << "request " << i;
  auto start = Clock::now();
  server.reset();  // destroying the server with output still pending does not wait for the stall limit
  EXPECT_LT(ms_since(start), 300000.0);
  ::close(slow);
}

TEST(TcpStoreServer, AClientThatNeverReadsIsClosedAfterTheStallLimit) {
  TcpStoreServerLimits limits;
  limits.stall_limit = std::chrono::seconds(2);
  auto server = server_with(limits);
  int slow = slow_reader_of(*server, 8u << 20);
  EXPECT_TRUE(hung_up_within(slow, std::chrono::seconds(60)));
  ::close(slow);
}

// The VmRSS of this process, in bytes.
size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  size_t kb = 0;
  while (f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %zu kB", &kb) == 1) break;
  }
  if (f != nullptr) std::fclose(f);
  return kb * 1024;
}

// Many requests in one packet from a client that reads nothing: the
// server answers them only as the client reads, so its memory stays flat.
TEST(TcpStoreServer, PipelinedGetsFromAClientThatDoesNotReadQueueAtMostTheOutputCap) {
  TcpStoreServerLimits limits;
  limits.stall_limit = std::chrono::seconds(600);
  auto server = server_with(limits);
  constexpr size_t kValue = 1u << 20, kGets = 300;
  server->set("big", dparallel::dist::Bytes(kValue, 7));
  int fd = greeted_connect(server->port());
  std::vector<uint8_t> gets;
  for (size_t i = 0; i < kGets; ++i) {
    std::vector<uint8_t> one = get_frame("big");
    gets.insert(gets.end(), one.begin(), one.end());
  }
  size_t before = resident_bytes();
  ASSERT_EQ(::send(fd, gets.data(), gets.size(), 0), static_cast<ssize_t>(gets.size()));
  // The old server queued every reply at once (300 MiB); give it time to try.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  size_t grown = resident_bytes() - std::min(before, resident_bytes());
  EXPECT_LT(grown, size_t(64) << 20) << "the server queued " << (grown >> 20) << " MiB for one client";
  // Nothing is lost: every reply comes as the client reads.
  std::vector<uint8_t> reply(5 + kValue);
  size_t got = 0;
  for (; got < kGets; ++got) {
    if (::recv(fd, reply.data(), reply.size(), MSG_WAITALL) != static_cast<ssize_t>(reply.size())) break;
    if (reply[4] != 0 || wire::frame_body_size(reply.data()) != kValue + 1) break;
  }
  EXPECT_EQ(got, kGets);
  ::close(fd);
}

TEST(TcpStoreServer, ARequestNotArrivedWholeIsClosedAtTheFrameDeadline) {
  TcpStoreServerLimits limits;
  limits.frame_deadline = std::chrono::seconds(2);
  auto server = server_with(limits);
  int fd = greeted_connect(server->port());
  std::vector<uint8_t> start;
  put_le32(start, 48u << 20);  // a set of 48 MiB, of which only the start comes
  start.insert(start.end(), {2, 1, 0, 0, 0, 'k'});
  ASSERT_EQ(::send(fd, start.data(), start.size(), 0), static_cast<ssize_t>(start.size()));
  EXPECT_TRUE(hung_up_within(fd, std::chrono::seconds(60)));
  ::close(fd);
}

// Without a token anyone may greet; idle greeted connections filling every
// slot must not keep a rank out.
TEST(TcpStoreServer, IdleGreetedClientsCannotLockOutARank) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < 4096) {
    limit.rlim_cur = std::min<rlim_t>(4096, limit.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  if (limit.rlim_cur < 2200) GTEST_SKIP() << "needs 2200 descriptors; the limit is " << limit.rlim_cur;
  StorePtr server = tcp_store(0, 1, 20000);
  uint16_t port = port_of(server.get());
  std::vector<int> idle;
  for (int i = 0; i < 1024; ++i) idle.push_back(greeted_connect(port));
  StorePtr rank = tcp_store(port, 0, 20000);
  ASSERT_NE(rank, nullptr) << "a well-behaved rank was locked out";
  DP_EXPECT_OK(dp_store_set(rank.get(), "k", "v", 1));
  // The server's own handle was idle the longest: it was closed, and comes back on its next call.
  size_t len = 0;
  DP_EXPECT_OK(dp_store_get(server.get(), "k", nullptr, 0, &len));
  EXPECT_EQ(len, 1u);
  for (int fd : idle) ::close(fd);
}

// Captures what this process writes to stderr while it lives.
class StderrCapture {
 public:
  StderrCapture() {
    char path[] = "/tmp/dp_stderr_XXXXXX";
    file_ = ::mkstemp(path);
    ::unlink(path);
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(file_, 2);
  }
  ~StderrCapture() { restore(); }
  std::string restore() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      ::dup2(saved_, 2);
      ::close(saved_);
      saved_ = -1;
    }
    std::string text;
    char buf[4096];
    ssize_t n = 0;
    for (off_t at = 0; (n = ::pread(file_, buf, sizeof(buf), at)) > 0; at += n)
      text.append(buf, static_cast<size_t>(n));
    return text;
  }

 private:
  int file_ = -1;
  int saved_ = -1;
};

TEST(TcpStoreServer, LogsRefusedClientsAtARateLimit) {
  StorePtr server = tcp_store(0, 1, 20000);
  uint16_t port = port_of(server.get());
  StderrCapture capture;
  for (int i = 0; i < 100; ++i) {
    int fd = raw_connect(port);
    std::vector<uint8_t> not_a_greeting = frame(6, "x");
    ASSERT_EQ(::send(fd, not_a_greeting.data(), not_a_greeting.size(), 0), static_cast<ssize_t>(not_a_greeting.size()));
    EXPECT_TRUE(closed_within(fd, std::chrono::seconds(20)));
    ::close(fd);
  }
  std::string log = capture.restore();
  size_t lines = 0, refused = 0;
  for (size_t at = 0; (at = log.find("dparallel store server", at)) != std::string::npos; ++at) ++lines;
  for (size_t at = 0; (at = log.find("refused: the first message was not a greeting", at)) != std::string::npos; ++at) {
    ++refused;
  }
  EXPECT_GE(refused, 1u) << log;
  EXPECT_LE(lines, 21u) << "100 refusals, not rate-limited:\n" << log;
}

TEST(TcpStoreServer, RefusesALongFrameBeforeTheGreetingAsSoonAsItsLengthArrives) {
  TcpStoreServerLimits limits;
  limits.greeting_deadline = std::chrono::seconds(600);  // only the length can close it within the test
  auto server = server_with(limits);
  int fd = raw_connect(server->port());
  std::vector<uint8_t> size;
  put_le32(size, 64u << 20);  // within the limit of a set, far over a greeting
  ASSERT_EQ(::send(fd, size.data(), 4, 0), 4);
  EXPECT_TRUE(closed_within(fd, std::chrono::seconds(60)));
  ::close(fd);
}

TEST(TcpStoreServer, IdleClientsThatNeverGreetCannotLockOutARank) {
  TcpStoreServerLimits limits;
  limits.greeting_deadline = std::chrono::seconds(600);  // only eviction can close them within the test
  auto server = server_with(limits);
  uint16_t port = server->port();
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(raw_connect(port));
  StorePtr client = tcp_store(port, 0, 20000);  // one more: the oldest idle one goes
  ASSERT_NE(client, nullptr);
  DP_EXPECT_OK(dp_store_set(client.get(), "k", "v", 1));
  EXPECT_TRUE(closed_within(idle.front(), std::chrono::seconds(60)));
  for (int fd : idle) ::close(fd);
}

// A child process that floods a loopback port the way a hostile peer does:
// connections as fast as it can make them, each sending one byte and then
// nothing, at most `max_open` of them open (the oldest closed first). Forked
// when made, before the test starts any thread; it floods once given the
// port, and stops when destroyed (or on its own after a while, or with the
// test's process).
class Flooder {
 public:
  explicit Flooder(size_t max_open) {
    int port[2], progress[2];
    EXPECT_EQ(::pipe2(port, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(progress, O_CLOEXEC), 0);
    pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(0);
      ::close(port[1]);
      ::close(progress[0]);
      uint16_t to = 0;
      if (::read(port[0], &to, sizeof(to)) != sizeof(to)) ::_exit(0);
      ::_exit(flood(to, max_open, progress[1]));
    }
    ::close(port[0]);
    ::close(progress[1]);
    port_ = port[1];
    progress_ = progress[0];
  }
  ~Flooder() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    ::close(port_);
    ::close(progress_);
  }
  void start(uint16_t port) { EXPECT_EQ(::write(port_, &port, sizeof(port)), static_cast<ssize_t>(sizeof(port))); }
  // Waits until the flood has made `count` connections in all; false past `limit`.
  bool made_at_least(uint64_t count, std::chrono::milliseconds limit) {
    for (auto end = Clock::now() + limit; made_ < count;) {
      if (Clock::now() >= end) return false;
      pollfd p{progress_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      uint64_t made = 0;
      ssize_t n = ::read(progress_, &made, sizeof(made));
      if (n <= 0) return false;  // the flood is over
      if (n == sizeof(made)) made_ = made;
    }
    return true;
  }

 private:
  static constexpr int kBatch = 64;
  static constexpr auto kLongest = std::chrono::seconds(110);  // within ctest's timeout of a test

  // Writes how many connections it has made to `progress` after each batch.
  static int flood(uint16_t port, size_t max_open, int progress) {
    ::fcntl(progress, F_SETFL, O_NONBLOCK);  // a full pipe skips a report, never stalls the flood
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = std::min<rlim_t>(std::max<rlim_t>(limit.rlim_cur, 4096), limit.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &limit);
    max_open = std::min<size_t>(max_open, limit.rlim_cur - kBatch - 16);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::vector<int> open(max_open, -1);
    size_t oldest = 0;
    uint64_t made = 0;
    const char byte = 'x';
    for (auto end = Clock::now() + kLongest; Clock::now() < end;) {
      pollfd batch[kBatch];
      int n = 0;
      for (int i = 0; i < kBatch; ++i) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) break;
        if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EINPROGRESS) {
          batch[n++] = {fd, POLLOUT, 0};
        } else {
          ::close(fd);
        }
      }
      ::poll(batch, n, 20);
      for (int i = 0; i < n; ++i) {
        int fd = batch[i].fd, error = 0;
        socklen_t len = sizeof(error);
        bool up = (batch[i].revents & POLLOUT) && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 &&
                  error == 0 && ::send(fd, &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1;
        if (!up) {
          ::close(fd);
          continue;
        }
        if (open[oldest] >= 0) ::close(open[oldest]);
        open[oldest] = fd;
        oldest = (oldest + 1) % open.size();
        ++made;
      }
      (void)!::write(progress, &made, sizeof(made));
    }
    return 0;
  }

  pid_t pid_ = -1;
  int port_ = -1, progress_ = -1;
  uint64_t made_ = 0;
};

// The number of descriptors this process has open.
size_t open_descriptors() {
  size_t count = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(dir)) count += e->d_name[0] != '.';
    ::closedir(dir);
  }
  return count;
}

// A free loopback port below the ephemeral range: the flood takes the source
// ports of its connections from that range, and would take this one too.
uint16_t free_port_below_the_ephemeral_range() {
  unsigned low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  std::mt19937 pick(std::random_device{}());
  for (int attempt = 0; attempt < 100 && low > 11000; ++attempt) {
    auto port = static_cast<uint16_t>(10000 + pick() % (low - 10000));
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (free) return port;
  }
  return 0;
}

// One rank of a job over the TCP store: it joins, publishes its key, waits
// for everyone's, and reads its neighbour's; rank 0 serves until all are
// done. Empty on success, else what failed.
std::string run_store_rank(uint16_t port, int rank, int ranks, int32_t timeout_ms) {
  dp_store* s = nullptr;
  if (dp_store_create_tcp(&s, "127.0.0.1", port, ranks, rank == 0, timeout_ms) != DP_OK) {
    return "create: " + dptest::last_error();
  }
  StorePtr store(s);
  std::string key = "rank/" + std::to_string(rank);
  if (dp_store_set(s, key.c_str(), "here", 4) != DP_OK) return "set: " + dptest::last_error();
  std::vector<std::string> keys;
  for (int r = 0; r < ranks; ++r) keys.push_back("rank/" + std::to_string(r));
  std::vector<const char*> names;
  for (const std::string& k : keys) names.push_back(k.c_str());
  if (dp_store_wait(s, names.data(), names.size(), timeout_ms) != DP_OK) return "wait: " + dptest::last_error();
  char value[8];
  size_t len = 0;
  if (dp_store_get(s, keys[(rank + 1) % ranks].c_str(), value, sizeof(value), &len) != DP_OK) {
    return "get: " + dptest::last_error();
  }
  if (std::string(value, len) != "here") return "get: a wrong value";
  std::string done = "done/" + std::to_string(rank);
  if (dp_store_set(s, done.c_str(), "", 0) != DP_OK) return "set done: " + dptest::last_error();
  if (rank == 0) {
    for (std::string& k : keys) k.replace(0, 4, "done");
    if (dp_store_wait(s, names.data(), names.size(), timeout_ms) != DP_OK) {
      return "wait for the others to be done: " + dptest::last_error();
    }
  }
  return "";
}

// The flood: a peer opening connections as fast as it can, each
// sending one byte, hundreds open. Every rank, rank 0's own client included,
// must greet and form the job within its timeout.
TEST(TcpStoreServer, AJobWithATokenFormsUnderAFloodOfOneByteConnections) {
  uint16_t port = free_port_below_the_ephemeral_range();
  if (port == 0) GTEST_SKIP() << "no free port below the ephemeral range";
  Flooder flood(900);
  flood.start(port);  // refused until rank 0 listens; flooded from then on
  ::setenv("DP_STORE_TOKEN", "flood-test-token", 1);
  constexpr int kRanks = 4;
  constexpr int32_t kTimeoutMs = 60000;
  size_t descriptors_before = open_descriptors();
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> ranks;
  ranks.emplace_back([&] { errors[0] = run_store_rank(port, 0, kRanks, kTimeoutMs); });
  // The others come once the flood has reached the server.
  bool flooded = flood.made_at_least(2000, std::chrono::milliseconds(kTimeoutMs / 2));
  for (int r = 1; r < kRanks; ++r)
    ranks.emplace_back([&, r] { errors[r] = run_store_rank(port, r, kRanks, kTimeoutMs); });
  // The server keeps what the flood leaves it bounded: its ungreeted slots, the ranks, and their clients.
  size_t descriptors_during = open_descriptors();
  for (std::thread& t : ranks) t.join();
  ::unsetenv("DP_STORE_TOKEN");
  EXPECT_TRUE(flooded) << "the flood did not reach the server";
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_LE(descriptors_during, descriptors_before + TcpStoreServerLimits().max_ungreeted + 2 * kRanks + 16);
}

// A client between the two messages of its greeting has sent each whole:
// connections that sent one byte and stopped go before it, however many come.
TEST(TcpStoreServer, AFloodOfOneByteConnectionsDoesNotEvictAClientMidGreeting) {
  Flooder flood(900);
  TcpStoreServerLimits limits;
  limits.greeting_deadline = limits.greeting_idle_limit = std::chrono::seconds(600);  // it takes its time
  auto server = server_with(limits);
  int fd = raw_connect(server->port());
  std::string client_nonce(wire::kNonceBytes, 'c');
  std::vector<uint8_t> hello = frame(1, client_nonce);
  ASSERT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  uint8_t answer[4 + 1 + wire::kNonceBytes + wire::kProofBytes];
  ASSERT_EQ(::recv(fd, answer, sizeof(answer), MSG_WAITALL), static_cast<ssize_t>(sizeof(answer)));
  flood.start(server->port());
  // Past the listen backlog (4096 at most), many times the ungreeted slots:
  // "the oldest goes" closed this client long before.
  EXPECT_TRUE(flood.made_at_least(4096 + 16 * limits.max_ungreeted, std::chrono::seconds(60)));
  std::string server_nonce(reinterpret_cast<char*>(answer) + 5, wire::kNonceBytes);
  std::vector<uint8_t> proof = frame(6, greeting::client_proof("", client_nonce, server_nonce));
  ASSERT_EQ(::send(fd, proof.data(), proof.size(), MSG_NOSIGNAL), static_cast<ssize_t>(proof.size()));
  uint8_t ok[5] = {0, 0, 0, 0, 0xff};
  EXPECT_EQ(::recv(fd, ok, sizeof(ok), MSG_WAITALL), 5) << "the client was closed mid-greeting";
  EXPECT_EQ(ok[4], 0);
  ::close(fd);
}

// Greeted clients are the ranks: a connection that has not greeted, however
// many come, never takes a greeted client's place.
TEST(TcpStoreServer, UngreetedConnectionsNeverEvictAGreetedClient) {
  TcpStoreServerLimits limits;
  limits.max_clients = 2;  // the server's own handle and one more
  auto server = server_with(limits);
  int greeted = greeted_connect(server->port());
  server->set("k", {1});  // the server's own handle is not the idlest greeted client
  std::vector<int> ungreeted;
  for (int i = 0; i < 100; ++i) {
    ungreeted.push_back(raw_connect(server->port()));
    ASSERT_EQ(::send(ungreeted.back(), "x", 1, 0), 1);
  }
  EXPECT_FALSE(hung_up_within(greeted, std::chrono::seconds(2)));
  // It is still served.
  wire::Request check;
  check.command = wire::Command::kCheck;
  check.keys = {"k"};
  std::vector<uint8_t> request = wire::encode_request(check);
  ASSERT_EQ(::send(greeted, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  uint8_t reply[5] = {0, 0, 0, 0, 0xff};
  EXPECT_EQ(::recv(greeted, reply, sizeof(reply), MSG_WAITALL), 5);
  EXPECT_EQ(reply[4], 0);
  for (int fd : ungreeted) ::close(fd);
  ::close(greeted);
}

// Connections from one host that take their time cannot keep another host's
// clients out; nor do they lose their slots to more of their own.
TEST(TcpStoreServer, TheAddressHoldingTheMostUngreetedSlotsGivesOneUpToAnotherAddress) {
  TcpStoreServerLimits limits;
  limits.max_ungreeted = 8;
  limits.greeting_deadline = limits.greeting_idle_limit = std::chrono::seconds(600);  // none stalls within the test
  auto server = server_with(limits);
  std::vector<int> slow;
  for (size_t i = 0; i < limits.max_ungreeted; ++i) slow.push_back(raw_connect(server->port(), "127.0.0.1"));
  int one_more = raw_connect(server->port(), "127.0.0.1");
  EXPECT_TRUE(closed_within(one_more, std::chrono::seconds(60))) << "no room was made for it";
  int other = greeted_connect(server->port(), 0, "127.0.0.2");
  EXPECT_TRUE(closed_within(slow.front(), std::chrono::seconds(60))) << "the idlest of 127.0.0.1 stays";
  for (size_t i = 1; i < slow.size(); ++i) EXPECT_FALSE(hung_up_within(slow[i], std::chrono::milliseconds(50)));
  for (int fd : slow) ::close(fd);
  ::close(one_more);
  ::close(other);
}

// Runs `body` in a child process, which exits with its result; bounded by `limit`.
// `after_fork` runs in the parent once the child exists: threads the test
// needs beside the child start there, since a child forked while another
// thread is starting may inherit a lock held mid-start (the sanitizers'
// allocator) and hang.
int run_in_child(const std::function<int()>& body, std::chrono::seconds limit,
                 const std::function<void()>& after_fork = {}) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  if (after_fork) after_fork();
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
  std::thread client;
  auto connect_clients = [&] {
    uint16_t port = 0;
    if (::read(ports[0], &port, 2) != 2) return;
    std::vector<int> fds;
    for (int i = 0; i < 8; ++i) fds.push_back(raw_connect(port));
    char done = 0;
    (void)!::read(conns[0], &done, 1);  // the child has measured
    for (int fd : fds) ::close(fd);
  };
  int result = run_in_child(
      [&] {
        dp_store* server = nullptr;
        if (dp_store_create_tcp(&server, "127.0.0.1", 0, 1, 1, 3000) != DP_OK) return 2;
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
      std::chrono::seconds(20), [&] { client = std::thread(connect_clients); });
  // A child that never sent the port leaves the client reading: EOF ends it.
  ::close(ports[1]);
  char done = 1;
  (void)!::write(conns[1], &done, 1);
  client.join();
  for (int fd : {ports[0], conns[0], conns[1]}) ::close(fd);
  EXPECT_EQ(result, 0);
}

TEST(TcpStoreClient, WaitReturnsAtItsOwnTimeoutWhenTheServerStalls) {
  FakeServer fake;
  dp_store* c = nullptr;
  std::thread greeter([&] { fake.accept_and_greet(std::chrono::milliseconds(5000)); });
  dp_status created = dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 60000);
  greeter.join();
  ASSERT_EQ(created, DP_OK) << dptest::last_error();
  StorePtr store(c);
  const char* keys[] = {"never", "nor-this"};
  auto start = Clock::now();
  EXPECT_EQ(dp_store_wait(store.get(), keys, 2, 1000), DP_ETIMEOUT);
  EXPECT_LT(ms_since(start), 30000.0) << "the store's 60 s request timeout was used";
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
  EXPECT_TRUE(closed_within(conn, std::chrono::seconds(20)));
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

// A server under a flood closes newcomers; the client tries again, with the
// connection closed after its hello or reset with the hello unread.
TEST(TcpStoreClient, AGreetingCutShortByTheServerIsRetriedUntilItSucceeds) {
  FakeServer fake;
  bool closed = false, reset = false;
  std::thread server([&] {
    closed = fake.accept_and_close(std::chrono::seconds(20), true);
    reset = closed && fake.accept_and_close(std::chrono::seconds(20), false);
    if (reset) fake.accept_and_greet(std::chrono::seconds(20));
  });
  dp_store* c = nullptr;
  dp_status created = dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 60000);
  std::string error = dptest::last_error();
  server.join();
  StorePtr store(c);
  EXPECT_TRUE(closed && reset);
  EXPECT_EQ(created, DP_OK) << error;
}

TEST(TcpStoreClient, ATimeoutAfterGreetingsCutShortSaysWhatEndedTheLastAttempt) {
  FakeServer fake;
  size_t descriptors_before = open_descriptors();
  std::atomic<bool> done{false};
  std::thread server([&] {
    while (!done) fake.accept_and_close(std::chrono::milliseconds(50), true);
  });
  dp_store* c = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&c, "127.0.0.1", fake.port(), 2, 0, 1500), DP_ETIMEOUT);
  std::string error = dptest::last_error();
  done = true;
  server.join();
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(error.find("closed by the peer"), std::string::npos) << error;
  EXPECT_NE(error.find("attempts"), std::string::npos) << error;
  EXPECT_NE(error.find(std::to_string(fake.port())), std::string::npos) << error;
  EXPECT_EQ(open_descriptors(), descriptors_before) << "an attempt's connection was left open";
}

TEST(TcpStoreClient, AWrongTokenFailsAtOnceWithoutRetrying) {
  ::setenv("DP_STORE_TOKEN", "the-job-token", 1);
  StorePtr server = tcp_store(0, 1, 20000);
  ::setenv("DP_STORE_TOKEN", "another-token", 1);
  dp_store* c = nullptr;
  auto start = Clock::now();
  EXPECT_EQ(dp_store_create_tcp(&c, "127.0.0.1", port_of(server.get()), 2, 0, 60000), DP_EREMOTE);
  double took = ms_since(start);
  ::unsetenv("DP_STORE_TOKEN");
  EXPECT_EQ(c, nullptr);
  EXPECT_NE(dptest::last_error().find("DP_STORE_TOKEN"), std::string::npos) << dptest::last_error();
  EXPECT_LT(took, 30000.0) << "retried a refusal until the timeout (60 s)";
}

}  // namespace
