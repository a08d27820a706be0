// The shared-memory segment: an anonymous file, handed to the job's other
// ranks through a door that serves only this user's processes with the
// job's secret.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <set>
#include <string>
#include <thread>

#include "core/error.h"
#include "distributed/backend_choice.h"
#include "distributed/shm/segment.h"
#include "distributed/shm/shm_process_group.h"

namespace dparallel::dist {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point in_seconds(int s) { return Clock::now() + std::chrono::seconds(s); }

// The error `f` raises: its code, and its message in *message.
template <typename F>
StatusCode code_of(F&& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

TEST(ShmSegment, SecretsAreRandomHex) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string hex = random_hex128();
    ASSERT_EQ(hex.size(), 32u) << hex;
    EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
    seen.insert(hex);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(ShmSegment, HasNoNameAnywhereAndIsSharedThroughItsDescriptor) {
  ShmSegment created = ShmSegment::create(8192);
  ASSERT_GE(created.fd(), 0);
  char link[256] = {0};
  ASSERT_GT(::readlink(("/proc/self/fd/" + std::to_string(created.fd())).c_str(), link, sizeof(link) - 1), 0);
  EXPECT_EQ(std::string(link).rfind("/memfd:", 0), 0u) << link << ": not an anonymous file";
  ShmSegment received = ShmSegment::map_received(::dup(created.fd()), 8192);
  created.close_fd();
  EXPECT_EQ(created.fd(), -1);
  std::memcpy(created.data() + 100, "hello", 5);
  EXPECT_EQ(std::memcmp(received.data() + 100, "hello", 5), 0);
  EXPECT_EQ(received.data()[8191], 0);
}

TEST(ShmSegment, MapReceivedRefusesOtherSizesAndOtherFiles) {
  ShmSegment created = ShmSegment::create(4096);
  std::string message;
  EXPECT_EQ(code_of([&] { ShmSegment::map_received(::dup(created.fd()), 8192); }, &message), StatusCode::kIo);
  EXPECT_NE(message.find("4096 bytes, not 8192"), std::string::npos) << message;
  int pipes[2];
  ASSERT_EQ(::pipe(pipes), 0);
  EXPECT_EQ(code_of([&] { ShmSegment::map_received(pipes[0], 4096); }, &message), StatusCode::kIo);
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
  ::close(pipes[1]);
}

TEST(SegmentDoor, HandsTheSegmentToPeersWithTheSecretOnly) {
  ShmSegment created = ShmSegment::create(4096);
  std::string name = random_hex128(), secret = random_hex128();
  SegmentDoor door(name);
  bool served = false;
  std::thread server([&] { served = door.serve(created.fd(), secret, 2, in_seconds(60)); });
  // A wrong secret gets nothing and is not counted.
  std::string message;
  EXPECT_EQ(code_of([&] { SegmentDoor::fetch(name, random_hex128(), in_seconds(60)); }, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("without handing it out"), std::string::npos) << message;
  ShmSegment a = ShmSegment::map_received(SegmentDoor::fetch(name, secret, in_seconds(60)), 4096);
  ShmSegment b = ShmSegment::map_received(SegmentDoor::fetch(name, secret, in_seconds(60)), 4096);
  server.join();
  EXPECT_TRUE(served);
  created.data()[7] = 42;
  EXPECT_EQ(a.data()[7], 42);
  EXPECT_EQ(b.data()[7], 42);
}

TEST(SegmentDoor, ASilentConnectionDoesNotHoldTheDoorForTheOthers) {
  ShmSegment created = ShmSegment::create(4096);
  std::string name = random_hex128(), secret = random_hex128();
  SegmentDoor door(name);
  bool served = false;
  std::thread server([&] { served = door.serve(created.fd(), secret, 1, in_seconds(60)); });
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::string path = "dparallel-" + name;
  std::memcpy(address.sun_path + 1, path.data(), path.size());
  int silent = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(::connect(silent, reinterpret_cast<const sockaddr*>(&address),
                      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size())),
            0);
  ShmSegment a = ShmSegment::map_received(SegmentDoor::fetch(name, secret, in_seconds(60)), 4096);
  server.join();
  EXPECT_TRUE(served);
  ::close(silent);
}

TEST(SegmentDoor, NoDoorIsARemoteErrorAndAnUnservedDoorTimesOut) {
  std::string message;
  EXPECT_EQ(code_of([&] { SegmentDoor::fetch(random_hex128(), random_hex128(), in_seconds(60)); }, &message),
            StatusCode::kRemote);
  EXPECT_NE(message.find("rank 0 exited"), std::string::npos) << message;
  std::string name = random_hex128();
  SegmentDoor door(name);  // listens, but nobody serves
  EXPECT_EQ(code_of([&] { SegmentDoor::fetch(name, random_hex128(), Clock::now() + std::chrono::milliseconds(300)); },
                    &message),
            StatusCode::kTimeout);
  ShmSegment created = ShmSegment::create(4096);
  EXPECT_FALSE(door.serve(created.fd(), random_hex128(), 1, Clock::now() + std::chrono::milliseconds(300)))
      << "nobody came: the deadline ends the serving";
}

TEST(ShmHostKey, DpHostIdOverridesTheBootIdAndHostNameOnly) {
  auto none = [](const char*) -> const char* { return nullptr; };
  auto pretend = [](const char* name) -> const char* {
    return std::strcmp(name, "DP_HOST_ID") == 0 ? "pretend-host" : nullptr;
  };
  std::string real = host_key(none);
  EXPECT_NE(real.find("boot:"), std::string::npos) << real;
  EXPECT_EQ(real, host_key(none));
  std::string pretended = host_key(pretend);
  EXPECT_EQ(pretended.rfind("id:pretend-host/", 0), 0u) << pretended;
  EXPECT_EQ(pretended.find("boot:"), std::string::npos) << pretended;
  // The namespaces the process shares with others on this machine stay in the key.
  EXPECT_EQ(pretended.substr(pretended.find("/net:")), real.substr(real.find("/net:")));
  EXPECT_NE(real.find("pid:["), std::string::npos) << real;
}

}  // namespace
}  // namespace dparallel::dist
