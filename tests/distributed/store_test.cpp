// Stores through the C ABI: both kinds, timeouts, the job token, malformed
// clients; and process-group argument checks that need no peers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

struct StoreDeleter {
  void operator()(dp_store* s) const { dp_store_destroy(s); }
};
using StorePtr = std::unique_ptr<dp_store, StoreDeleter>;

std::string temp_path() {
  char path[] = "/tmp/dp_store_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  ::unlink(path);
  return path;
}

// A server of world size 1: its create does not wait for the clients made after it.
StorePtr tcp_server(int32_t timeout_ms = 5000) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", 0, 1, 1, timeout_ms), DP_OK) << dp_last_error();
  return StorePtr(s);
}

uint16_t port_of(dp_store* s) {
  uint16_t port = 0;
  EXPECT_EQ(dp_store_tcp_port(s, &port), DP_OK) << dp_last_error();
  return port;
}

StorePtr tcp_client(uint16_t port, int32_t timeout_ms = 5000) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", port, 2, 0, timeout_ms), DP_OK) << dp_last_error();
  return StorePtr(s);
}

std::string get_string(dp_store* s, const char* key) {
  char buf[256];
  size_t len = 0;
  EXPECT_EQ(dp_store_get(s, key, buf, sizeof(buf), &len), DP_OK) << dp_last_error();
  return std::string(buf, len);
}

// set, get, add, wait as c10d's stores do them, seen from two handles.
void exercise_contract(dp_store* a, dp_store* b) {
  DP_ASSERT_OK(dp_store_set(a, "greeting", "hello", 5));
  EXPECT_EQ(get_string(b, "greeting"), "hello");
  DP_ASSERT_OK(dp_store_set(b, "greeting", "bye", 3));
  EXPECT_EQ(get_string(a, "greeting"), "bye");
  DP_ASSERT_OK(dp_store_set(a, "empty", nullptr, 0));
  EXPECT_EQ(get_string(b, "empty"), "");
  size_t len = 0;
  DP_ASSERT_OK(dp_store_get(b, "greeting", nullptr, 0, &len));
  EXPECT_EQ(len, 3u);
  char small[2];
  EXPECT_EQ(dp_store_get(b, "greeting", small, sizeof(small), &len), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("3 bytes"), std::string::npos) << dptest::last_error();

  int64_t v = 0;
  DP_ASSERT_OK(dp_store_add(a, "counter", 5, &v));
  EXPECT_EQ(v, 5);
  DP_ASSERT_OK(dp_store_add(b, "counter", -2, &v));
  EXPECT_EQ(v, 3);
  EXPECT_EQ(get_string(a, "counter"), "3");
  EXPECT_EQ(dp_store_add(a, "greeting", 1, &v), DP_EIO) << "add on a non-integer value";

  // get and wait block until another thread sets the key.
  std::thread setter([b] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    dp_store_set(b, "late", "x", 1);
  });
  EXPECT_EQ(get_string(a, "late"), "x");
  setter.join();
  const char* keys[] = {"greeting", "late", "counter"};
  DP_EXPECT_OK(dp_store_wait(a, keys, 3, 1000));

  // The wait's own timeout bounds it, not the store's 60 s.
  DP_ASSERT_OK(dp_store_set_timeout(a, 60000));
  const char* missing[] = {"greeting", "never"};
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(dp_store_wait(a, missing, 2, 100), DP_ETIMEOUT);
  EXPECT_NE(dptest::last_error().find("'never'"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dptest::last_error().find("'greeting'"), std::string::npos) << dptest::last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  DP_ASSERT_OK(dp_store_set_timeout(a, 100));
  EXPECT_EQ(dp_store_get(a, "never", nullptr, 0, &len), DP_ETIMEOUT);
  EXPECT_NE(dptest::last_error().find("never"), std::string::npos) << dptest::last_error();
}

TEST(FileStore, KeepsTheStoreContract) {
  std::string path = temp_path();
  dp_store *a = nullptr, *b = nullptr;
  DP_ASSERT_OK(dp_store_create_file(&a, path.c_str(), 2));
  DP_ASSERT_OK(dp_store_create_file(&b, path.c_str(), 2));
  exercise_contract(a, b);
  dp_store_destroy(a);
  EXPECT_EQ(::access(path.c_str(), F_OK), 0) << "one user left: the file stays";
  dp_store_destroy(b);
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the last user removes the file";
}

TEST(FileStore, ALockHeldElsewhereTimesOutNamingThePath) {
  std::string path = temp_path();
  dp_store* s = nullptr;
  ASSERT_EQ(dp_store_create_file(&s, path.c_str(), 1), DP_OK) << dp_last_error();
  StorePtr store(s);
  DP_ASSERT_OK(dp_store_set_timeout(store.get(), 1000));
  int holder = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(::flock(holder, LOCK_EX), 0);  // another open file description: as another process would
  auto result = std::async(std::launch::async, [&] {
    dp_status st = dp_store_set(store.get(), "k", "v", 1);
    return std::make_pair(st, dptest::last_error());
  });
  bool done = result.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  ::flock(holder, LOCK_UN);  // frees a call stuck on the lock, so the test ends either way
  ::close(holder);
  auto [status, error] = result.get();
  EXPECT_TRUE(done) << "the call waited on the lock past its timeout";
  EXPECT_EQ(status, DP_ETIMEOUT);
  EXPECT_NE(error.find(path), std::string::npos) << error;
}

// PyTorch's FileStore semantics: the last set wins, on this handle and on every other.
TEST(FileStore, TheLastSetWinsOnEveryHandle) {
  std::string path = temp_path();
  dp_store *a = nullptr, *b = nullptr;
  DP_ASSERT_OK(dp_store_create_file(&a, path.c_str(), 2));
  DP_ASSERT_OK(dp_store_create_file(&b, path.c_str(), 2));
  StorePtr first(a), second(b);
  DP_ASSERT_OK(dp_store_set(a, "k", "old", 3));
  EXPECT_EQ(get_string(a, "k"), "old");
  EXPECT_EQ(get_string(b, "k"), "old");
  DP_ASSERT_OK(dp_store_set(a, "k", "new", 3));
  EXPECT_EQ(get_string(a, "k"), "new") << "the same handle";
  EXPECT_EQ(get_string(b, "k"), "new") << "another handle";
  int64_t v = 0;
  DP_ASSERT_OK(dp_store_add(b, "n", 1, &v));
  EXPECT_EQ(get_string(a, "n"), "1");
  DP_ASSERT_OK(dp_store_add(b, "n", 1, &v));
  EXPECT_EQ(get_string(a, "n"), "2");
}

TEST(FileStore, RefusesAFifoWithoutBlocking) {
  std::string path = temp_path();
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  auto result = std::async(std::launch::async, [&] {
    dp_store* s = nullptr;
    dp_status st = dp_store_create_file(&s, path.c_str(), 1);
    dp_store_destroy(s);
    return std::make_pair(st, dptest::last_error());
  });
  bool done = result.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  if (!done) {
    int unblock = ::open(path.c_str(), O_RDWR | O_NONBLOCK);  // frees an open stuck on the FIFO
    result.wait();
    ::close(unblock);
  }
  auto [status, error] = result.get();
  ::unlink(path.c_str());
  EXPECT_TRUE(done) << "creating the store blocked on the FIFO";
  EXPECT_EQ(status, DP_EINVAL);
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("regular file"), std::string::npos) << error;
}

TEST(FileStore, AddWrapsLikeTheTcpStore) {
  std::string path = temp_path();
  dp_store* s = nullptr;
  ASSERT_EQ(dp_store_create_file(&s, path.c_str(), 1), DP_OK) << dp_last_error();
  StorePtr store(s);
  int64_t v = 0;
  DP_ASSERT_OK(dp_store_add(store.get(), "n", INT64_MAX, &v));
  DP_ASSERT_OK(dp_store_add(store.get(), "n", 1, &v));
  EXPECT_EQ(v, INT64_MIN);
}

TEST(FileStore, RejectsBadArguments) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_file(&s, nullptr, 1), DP_EINVAL);
  EXPECT_EQ(dp_store_create_file(&s, "/tmp/x", 0), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("world_size"), std::string::npos);
  EXPECT_EQ(dp_store_create_file(&s, "/nonexistent-dir/store", 1), DP_EIO);
  EXPECT_NE(dptest::last_error().find("/nonexistent-dir/store"), std::string::npos);
  EXPECT_EQ(s, nullptr);
  uint16_t port = 0;
  std::string path = temp_path();
  DP_ASSERT_OK(dp_store_create_file(&s, path.c_str(), 1));
  EXPECT_EQ(dp_store_tcp_port(s, &port), DP_EINVAL);
  EXPECT_EQ(dp_store_set(s, "", "x", 1), DP_EINVAL);
  EXPECT_EQ(dp_store_set(s, "k", nullptr, 1), DP_EINVAL);
  dp_store_destroy(s);
  dp_store_destroy(nullptr);
}

TEST(TcpStore, KeepsTheStoreContract) {
  StorePtr server = tcp_server();
  ASSERT_NE(server, nullptr);
  StorePtr client = tcp_client(port_of(server.get()));
  ASSERT_NE(client, nullptr);
  exercise_contract(client.get(), server.get());
}

TEST(TcpStore, ClientRetriesUntilTheServerStarts) {
  StorePtr probe = tcp_server();
  uint16_t port = port_of(probe.get());
  probe.reset();  // the port is free again
  dp_store* client = nullptr;
  dp_status client_status = DP_EINTERNAL;
  std::thread t([&] { client_status = dp_store_create_tcp(&client, "127.0.0.1", port, 2, 0, 5000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  dp_store* server = nullptr;
  DP_ASSERT_OK(dp_store_create_tcp(&server, "127.0.0.1", port, 2, 1, 5000));
  t.join();
  EXPECT_EQ(client_status, DP_OK);
  DP_EXPECT_OK(dp_store_set(client, "k", "v", 1));
  EXPECT_EQ(get_string(server, "k"), "v");
  dp_store_destroy(client);
  dp_store_destroy(server);
}

TEST(TcpStore, ClientWithoutServerTimesOut) {
  StorePtr probe = tcp_server();
  uint16_t port = port_of(probe.get());
  probe.reset();
  dp_store* client = nullptr;
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(dp_store_create_tcp(&client, "127.0.0.1", port, 2, 0, 1000), DP_ETIMEOUT);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_NE(dptest::last_error().find(std::to_string(port)), std::string::npos) << dptest::last_error();
  EXPECT_EQ(client, nullptr);
}

TEST(TcpStore, BindsOnlyToTheAddressGiven) {
  StorePtr server = tcp_server();
  uint16_t port = port_of(server.get());
  dp_store* other = nullptr;
  // 127.0.0.2 is loopback too, but the server is bound to 127.0.0.1 only.
  EXPECT_EQ(dp_store_create_tcp(&other, "127.0.0.2", port, 2, 0, 300), DP_ETIMEOUT);
  EXPECT_EQ(other, nullptr);
}

TEST(TcpStore, RefusesAClientWithoutTheJobToken) {
  ::setenv("DP_STORE_TOKEN", "secret-1", 1);
  StorePtr server = tcp_server();
  StorePtr good = tcp_client(port_of(server.get()));
  ASSERT_NE(good, nullptr);
  ::unsetenv("DP_STORE_TOKEN");
  dp_store* bad = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&bad, "127.0.0.1", port_of(server.get()), 2, 0, 2000), DP_EREMOTE);
  EXPECT_NE(dptest::last_error().find("DP_STORE_TOKEN"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(bad, nullptr);
  ::setenv("DP_STORE_TOKEN", "wrong", 1);
  EXPECT_EQ(dp_store_create_tcp(&bad, "127.0.0.1", port_of(server.get()), 2, 0, 2000), DP_EREMOTE);
  ::unsetenv("DP_STORE_TOKEN");
  DP_EXPECT_OK(dp_store_set(good.get(), "still", "fine", 4));
  EXPECT_EQ(get_string(server.get(), "still"), "fine");
}

int raw_connect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// True when the server closed `fd` within a second.
bool closed_by_server(int fd) {
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[64];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

TEST(TcpStore, MalformedOrOversizedMessagesCloseThatConnectionOnly) {
  StorePtr server = tcp_server();
  uint16_t port = port_of(server.get());
  StorePtr client = tcp_client(port);

  int oversized = raw_connect(port);
  uint32_t huge = 0xffffffffu;
  ASSERT_EQ(::send(oversized, &huge, 4, 0), 4);
  EXPECT_TRUE(closed_by_server(oversized));
  ::close(oversized);

  int garbage = raw_connect(port);
  const uint8_t frame[] = {3, 0, 0, 0, 0x7f, 1, 2};  // unknown command 0x7f
  ASSERT_EQ(::send(garbage, frame, sizeof(frame), 0), static_cast<ssize_t>(sizeof(frame)));
  EXPECT_TRUE(closed_by_server(garbage));
  ::close(garbage);

  int truncated = raw_connect(port);
  const uint8_t hello[] = {5, 0, 0, 0, 1, 200, 0, 0, 0};  // a greeting whose token overruns the frame
  ASSERT_EQ(::send(truncated, hello, sizeof(hello), 0), static_cast<ssize_t>(sizeof(hello)));
  EXPECT_TRUE(closed_by_server(truncated));
  ::close(truncated);

  int half = raw_connect(port);
  ASSERT_EQ(::send(half, frame, 3, 0), 3);  // an incomplete frame left open

  DP_EXPECT_OK(dp_store_set(client.get(), "alive", "yes", 3));
  EXPECT_EQ(get_string(server.get(), "alive"), "yes");
  ::close(half);
}

// Limits are the caller's error, found before anything is sent; the connection stays usable.
TEST(TcpStore, KeyLimitsAreInvalidArgumentsNamingTheLimit) {
  StorePtr server = tcp_server();
  StorePtr client = tcp_client(port_of(server.get()));
  std::string long_key(4097, 'k');
  size_t len = 0;
  int64_t v = 0;
  const char* long_keys[] = {long_key.c_str()};
  EXPECT_EQ(dp_store_set(client.get(), long_key.c_str(), "v", 1), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("4096"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_store_get(client.get(), long_key.c_str(), nullptr, 0, &len), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("4096 bytes"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_store_add(client.get(), long_key.c_str(), 1, &v), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("4096 bytes"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_store_wait(client.get(), long_keys, 1, 1000), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("4096 bytes"), std::string::npos) << dptest::last_error();
  std::vector<std::string> names;
  for (int i = 0; i < 5000; ++i) names.push_back("key" + std::to_string(i));
  std::vector<const char*> many;
  for (const std::string& n : names) many.push_back(n.c_str());
  EXPECT_EQ(dp_store_wait(client.get(), many.data(), many.size(), 1000), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("5000 keys"), std::string::npos) << dptest::last_error();
  EXPECT_NE(dptest::last_error().find("4096 keys"), std::string::npos) << dptest::last_error();
  DP_EXPECT_OK(dp_store_set(client.get(), "after", "ok", 2));
  EXPECT_EQ(get_string(client.get(), "after"), "ok");
}

// world_size as PyTorch's TCPStore has it: the server's create waits for that many workers.
TEST(TcpStore, TheServerWaitsForWorldSizeWorkers) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", 0, 3, 1, 1000), DP_ETIMEOUT);
  EXPECT_EQ(s, nullptr);
  EXPECT_NE(dptest::last_error().find("world_size 3"), std::string::npos) << dptest::last_error();
  EXPECT_NE(dptest::last_error().find("1 joined"), std::string::npos) << dptest::last_error();

  StorePtr probe = tcp_server();
  uint16_t port = port_of(probe.get());
  probe.reset();  // the port is free again
  dp_store* clients[2] = {nullptr, nullptr};
  dp_status statuses[2] = {DP_EINTERNAL, DP_EINTERNAL};
  std::vector<std::thread> workers;
  for (int i = 0; i < 2; ++i) {
    workers.emplace_back([&, i] { statuses[i] = dp_store_create_tcp(&clients[i], "127.0.0.1", port, 3, 0, 20000); });
  }
  dp_status server_status = dp_store_create_tcp(&s, "127.0.0.1", port, 3, 1, 20000);
  for (auto& w : workers) w.join();
  StorePtr server(s), c0(clients[0]), c1(clients[1]);
  EXPECT_EQ(server_status, DP_OK) << dp_last_error();
  EXPECT_EQ(statuses[0], DP_OK);
  EXPECT_EQ(statuses[1], DP_OK);
  int64_t joined = 0;
  DP_EXPECT_OK(dp_store_add(server.get(), "__dp_store/joined", 0, &joined));
  EXPECT_EQ(joined, 3);
}

TEST(TcpStore, RejectsBadArguments) {
  dp_store* s = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&s, nullptr, 1, 1, 0, 100), DP_EINVAL);
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", 0, 1, 0, 100), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("port"), std::string::npos);
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", 1, 0, 0, 100), DP_EINVAL);
  EXPECT_EQ(dp_store_create_tcp(&s, "127.0.0.1", 1, 1, 0, 0), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("timeout_ms"), std::string::npos);
  EXPECT_EQ(dp_store_create_tcp(&s, "no-such-host.invalid", 1, 1, 0, 100), DP_EINVAL);
  EXPECT_EQ(s, nullptr);
  EXPECT_EQ(dp_store_set(nullptr, "k", "v", 1), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'store'"), std::string::npos);
}

// ---- process-group arguments ----

struct GroupDeleter {
  void operator()(dp_process_group* g) const { dp_process_group_destroy(g); }
};
using GroupPtr = std::unique_ptr<dp_process_group, GroupDeleter>;

// Groups on a file store of their own; rank 0 of `world_size`.
class ProcessGroupTest : public ::testing::Test {
 protected:
  void TearDown() override {
    dp_store_destroy(store_);
    ::unlink(path_.c_str());
  }
  dp_process_group_options options(int32_t world_size) {
    if (store_ == nullptr) {
      EXPECT_EQ(dp_store_create_file(&store_, path_.c_str(), world_size), DP_OK) << dp_last_error();
    }
    dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
    opts.store = store_;
    opts.rank = 0;
    opts.world_size = world_size;
    return opts;
  }
  std::string path_ = temp_path();
  dp_store* store_ = nullptr;
};

TEST_F(ProcessGroupTest, RejectsBadWorldSizeRankAndBackend) {
  dp_process_group_options opts = options(1);
  dp_process_group* pg = nullptr;
  opts.world_size = 0;
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("world_size' is 0"), std::string::npos) << dptest::last_error();
  opts.world_size = 2;
  opts.rank = 2;
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("rank' is 2"), std::string::npos) << dptest::last_error();
  opts.rank = -1;
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  opts.rank = 0;
  opts.backend = 7;
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("backend"), std::string::npos);
  opts.backend = DP_BACKEND_GLOO;
  opts.device = dptest::cuda(0);
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  opts.backend = DP_BACKEND_AUTO;
  opts.timeout_ms = 0;
  opts.device = dptest::cpu(0);
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_EINVAL);
  EXPECT_EQ(pg, nullptr);
  EXPECT_EQ(dp_process_group_create(&pg, nullptr), DP_EINVAL);
  EXPECT_EQ(dp_process_group_rank(nullptr), -1);
  EXPECT_EQ(dp_process_group_size(nullptr), -1);
  EXPECT_EQ(dp_pg_barrier(nullptr), DP_EINVAL);
  dp_process_group_destroy(nullptr);
  dp_work_destroy(nullptr);
}

// Rank 0 alone of 3: the error names both ranks that never came, asked
// after the group's time is spent.
TEST_F(ProcessGroupTest, CreateTimesOutNamingThePeersThatNeverJoin) {
  dp_process_group_options opts = options(3);
  opts.timeout_ms = 1000;
  DP_ASSERT_OK(dp_store_set_timeout(store_, 60000));  // the group's timeout must bound it, not the store's
  dp_process_group* pg = nullptr;
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_ETIMEOUT);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(pg, nullptr);
  const std::string error = dp_last_error();
  EXPECT_NE(error.find("rank(s) 1, 2 did not join"), std::string::npos) << error;
}

// Over a TCP store the group's deadline also bounds each reply: rank 1 of 3
// alone still names ranks 0 and 2 once its time is spent, and its store
// connection stays usable.
TEST(ProcessGroupCreate, ATimeoutOverATcpStoreNamesEveryRankThatNeverJoined) {
  StorePtr server = tcp_server();
  StorePtr client = tcp_client(port_of(server.get()));
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.store = client.get();
  opts.rank = 1;
  opts.world_size = 3;
  opts.timeout_ms = 1000;
  opts.device = dptest::cpu(0);
  dp_process_group* pg = nullptr;
  EXPECT_EQ(dp_process_group_create(&pg, &opts), DP_ETIMEOUT);
  EXPECT_EQ(pg, nullptr);
  const std::string error = dp_last_error();
  EXPECT_NE(error.find("rank(s) 0, 2 did not join"), std::string::npos) << error;
  EXPECT_EQ(dp_store_set(client.get(), "after", "x", 1), DP_OK) << dp_last_error();
  EXPECT_EQ(get_string(server.get(), "after"), "x");
}

// Leaving a healthy group waits for every rank to be leaving, through the
// store; a file store that served stale counters made that wait run to its
// 5 s bound.
TEST(ProcessGroup, DestroyingAHealthyGroupOverAFileStoreIsPrompt) {
  std::string path = temp_path();
  dp_process_group* groups[2] = {nullptr, nullptr};
  dp_status created[2] = {DP_EINTERNAL, DP_EINTERNAL};
  auto join = [&](int rank) {
    dp_store* store = nullptr;
    created[rank] = dp_store_create_file(&store, path.c_str(), 2);
    if (created[rank] != DP_OK) return;
    dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
    opts.store = store;
    opts.rank = rank;
    opts.world_size = 2;
    opts.timeout_ms = 20000;
    created[rank] = dp_process_group_create(&groups[rank], &opts);
    dp_store_destroy(store);
    if (created[rank] == DP_OK) created[rank] = dp_pg_barrier(groups[rank]);
  };
  std::thread other(join, 1);
  join(0);
  other.join();
  ASSERT_EQ(created[0], DP_OK) << dp_last_error();
  ASSERT_EQ(created[1], DP_OK);
  double seconds[2] = {0, 0};
  auto leave = [&](int rank) {
    auto start = std::chrono::steady_clock::now();
    dp_process_group_destroy(groups[rank]);
    seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::thread leaver(leave, 1);
  leave(0);
  leaver.join();
  // Half the 5 s bound: only the stale read waits that long; a healthy leave takes milliseconds.
  EXPECT_LT(seconds[0], 2.5);
  EXPECT_LT(seconds[1], 2.5);
  ::unlink(path.c_str());
}

TEST_F(ProcessGroupTest, NcclWithoutAGpuIsAnHonestError) {
  if (dptest::cuda_count() > 0) GTEST_SKIP() << "a GPU is present; the NCCL path is covered elsewhere";
  dp_process_group_options opts = options(1);
  opts.device = dptest::cuda(0);
  dp_process_group* pg = nullptr;
  dp_status s = dp_process_group_create(&pg, &opts);
  EXPECT_TRUE(s == DP_EDEVICE || s == DP_EUNSUPPORTED) << s << " " << dp_last_error();
  EXPECT_EQ(pg, nullptr);
}

TEST_F(ProcessGroupTest, SingleRankCollectivesCheckTheirArguments) {
  dp_process_group_options opts = options(1);
  opts.timeout_ms = 5000;
  dp_process_group* raw = nullptr;
  DP_ASSERT_OK(dp_process_group_create(&raw, &opts));
  dp_store_destroy(store_);  // the group holds its own reference
  store_ = nullptr;
  GroupPtr pg(raw);
  EXPECT_EQ(dp_process_group_rank(pg.get()), 0);
  EXPECT_EQ(dp_process_group_size(pg.get()), 1);
  EXPECT_STREQ(dp_process_group_backend(pg.get()), "shm");

  auto t = dptest::make<float>({4}, {1, 2, 3, 4});
  DP_EXPECT_OK(dp_pg_all_reduce(pg.get(), t.get(), DP_AVG));
  EXPECT_EQ(dptest::values<float>(t.get()), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(dp_pg_all_reduce(pg.get(), t.get(), 9), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'op' is 9"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_pg_broadcast(pg.get(), t.get(), 1), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'root' is 1"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(dp_pg_broadcast(pg.get(), t.get(), -1), DP_EINVAL);
  dp_tensor* outs[2] = {t.get(), t.get()};
  EXPECT_EQ(dp_pg_all_gather(pg.get(), t.get(), outs, 2), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("world size 1"), std::string::npos) << dptest::last_error();
  auto wrong = dptest::make<double>({4}, {});
  dp_tensor* wrong_out[1] = {wrong.get()};
  EXPECT_EQ(dp_pg_all_gather(pg.get(), t.get(), wrong_out, 1), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("outputs[0]"), std::string::npos) << dptest::last_error();
  const dp_tensor* ins[1] = {wrong.get()};
  EXPECT_EQ(dp_pg_reduce_scatter(pg.get(), ins, 1, t.get(), DP_SUM), DP_EINVAL);
  EXPECT_EQ(dp_pg_all_reduce(pg.get(), nullptr, DP_SUM), DP_EINVAL);
  dp_work* w = nullptr;
  EXPECT_EQ(dp_pg_all_reduce_async(pg.get(), t.get(), DP_SUM, nullptr), DP_EINVAL);
  DP_ASSERT_OK(dp_pg_all_reduce_async(pg.get(), t.get(), DP_MAX, &w));
  DP_EXPECT_OK(dp_work_wait(w));
  dp_work_destroy(w);
  DP_EXPECT_OK(dp_pg_barrier(pg.get()));
}

TEST(ProcessGroup, CreateFromEnvNamesTheMissingVariable) {
  const char* vars[] = {"RANK",        "WORLD_SIZE",    "LOCAL_RANK",    "MASTER_ADDR",
                        "MASTER_PORT", "DP_STORE_ADDR", "DP_STORE_PORT", "OMPI_COMM_WORLD_RANK",
                        "PMI_RANK",    "PMI_SIZE",      "SLURM_PROCID",  "SLURM_NTASKS"};
  for (const char* v : vars) ::unsetenv(v);
  dp_process_group* pg = nullptr;
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("WORLD_SIZE"), std::string::npos) << dptest::last_error();
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("MASTER_ADDR"), std::string::npos) << dptest::last_error();
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("MASTER_PORT"), std::string::npos) << dptest::last_error();
  ::setenv("MASTER_PORT", "99999", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("'99999'"), std::string::npos) << dptest::last_error();
  ::setenv("RANK", "1", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("RANK is '1'"), std::string::npos) << dptest::last_error();
  EXPECT_EQ(pg, nullptr);

  // A one-rank job from torchrun's variables, serving its own store.
  StorePtr probe = tcp_server();
  std::string port = std::to_string(port_of(probe.get()));
  probe.reset();
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_PORT", port.c_str(), 1);
  DP_ASSERT_OK(dp_process_group_create_from_env(&pg, nullptr));
  EXPECT_EQ(dp_process_group_size(pg), 1);
  DP_EXPECT_OK(dp_pg_barrier(pg));
  dp_process_group_destroy(pg);

  // mpirun's variables when RANK is absent.
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("LOCAL_RANK");
  ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "1", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&pg, nullptr), DP_EINVAL);
  EXPECT_NE(dptest::last_error().find("OMPI_COMM_WORLD_LOCAL_RANK"), std::string::npos) << dptest::last_error();
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  DP_ASSERT_OK(dp_process_group_create_from_env(&pg, nullptr));
  EXPECT_EQ(dp_process_group_rank(pg), 0);
  dp_process_group_destroy(pg);
  for (const char* v :
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    ::unsetenv(v);
  }
}

}  // namespace
