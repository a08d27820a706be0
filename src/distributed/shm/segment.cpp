#include "distributed/shm/segment.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <thread>
#include <utility>

#include "core/error.h"

namespace dparallel::dist {

namespace {

using Clock = SegmentDoor::Clock;

// How long the door waits for one connection's secret: a connection that
// sends nothing must not hold the door for the others until the deadline.
constexpr std::chrono::milliseconds kSecretWait{2000};

// posix_fallocate, with SIGXFSZ held back: past the file-size limit
// (RLIMIT_FSIZE) the kernel sends it to this thread, and its default
// action ends the process. Blocked here (in this thread only: the host's
// disposition and other threads stay as they are), the call returns EFBIG;
// the signal it raised is then taken off, so it never arrives later. One
// already pending before the call is left to the host.
int reserve_within_file_limit(int fd, off_t offset, off_t bytes) {
  sigset_t xfsz, previous, pending;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  pthread_sigmask(SIG_BLOCK, &xfsz, &previous);
  sigemptyset(&pending);
  sigpending(&pending);
  const bool pending_before = sigismember(&pending, SIGXFSZ) == 1;
  int rc = ::posix_fallocate(fd, offset, bytes);
  if (rc == EFBIG && !pending_before) {
    const timespec no_wait{0, 0};
    while (sigtimedwait(&xfsz, nullptr, &no_wait) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return rc;
}

// Why reserving `bytes` more bytes (up to `end`) failed with `rc`.
std::string reserve_failure(int rc, size_t end) {
  if (rc != EFBIG) return std::strerror(rc);
  rlimit limit{};
  ::getrlimit(RLIMIT_FSIZE, &limit);
  return str_cat("the shared-memory file would reach ", end, " bytes, past this process's file-size limit (",
                 "RLIMIT_FSIZE, ulimit -f) of ", static_cast<unsigned long long>(limit.rlim_cur), " bytes");
}

StatusCode reserve_failure_code(int rc) {
  return rc == ENOSPC || rc == ENOMEM || rc == EFBIG ? StatusCode::kOutOfMemory : StatusCode::kIo;
}

// Maps `bytes` of `fd`; on failure closes it and fails.
uint8_t* map_shared(int fd, size_t bytes) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (data == MAP_FAILED) {
    int error = errno;
    ::close(fd);
    fail(StatusCode::kIo, "mapping ", bytes, " bytes of shared memory failed: ", std::strerror(error));
  }
  return static_cast<uint8_t*>(data);
}

int millis_until(Clock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

// Waits until `fd` has `events` or the deadline passes; false at the deadline.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int ms = millis_until(deadline);
    if (ms <= 0) return false;
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// The abstract address "\0dparallel-<name>" (no file; gone with its socket).
socklen_t door_address(const std::string& name, sockaddr_un& address) {
  std::string path = "dparallel-" + name;
  address = sockaddr_un{};
  address.sun_family = AF_UNIX;
  if (path.size() + 1 > sizeof(address.sun_path)) fail(StatusCode::kInternal, "door name too long: ", name);
  std::memcpy(address.sun_path + 1, path.data(), path.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
}

// Reads exactly `n` bytes by the deadline.
bool read_exactly(int fd, char* out, size_t n, Clock::time_point deadline) {
  size_t got = 0;
  while (got < n) {
    if (!wait_for(fd, POLLIN, deadline)) return false;
    ssize_t r = ::recv(fd, out + got, n - got, MSG_DONTWAIT);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

// One byte with room for one descriptor beside it (SCM_RIGHTS); msghdr
// points into the object itself, so it is neither copied nor moved.
struct FdMessage {
  FdMessage() {
    message.msg_iov = &io;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;

  char byte = 'd';
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
};

bool same_secret(const char* a, const std::string& b) {
  unsigned char diff = 0;  // every byte compared: the time says nothing of where they differ
  for (size_t i = 0; i < b.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string random_hex128() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(StatusCode::kIo, "getrandom failed: ", std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (uint8_t b : bytes) {
    hex += kHex[b >> 4];
    hex += kHex[b & 15];
  }
  return hex;
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) ::munmap(data_, size_);
  close_fd();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    close_fd();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void ShmSegment::close_fd() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

ShmSegment ShmSegment::create(size_t bytes) {
  int fd = ::memfd_create("dparallel-shm", MFD_CLOEXEC);
  if (fd < 0) {
    fail(StatusCode::kIo, "creating shared memory (memfd_create) failed: ", std::strerror(errno),
         " (DP_SHM=0 makes the ranks on one host use Gloo instead)");
  }
  int rc = reserve_within_file_limit(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    ::close(fd);
    fail(reserve_failure_code(rc), "reserving ", bytes, " bytes of shared memory failed: ", reserve_failure(rc, bytes),
         " (DP_SHM=0 makes the ranks on one host use Gloo instead)");
  }
  return ShmSegment(map_shared(fd, bytes), bytes, fd);
}

ShmSegment ShmSegment::map_received(int fd, size_t bytes) {
  struct stat st {};
  std::string wrong;
  if (::fstat(fd, &st) != 0) {
    wrong = str_cat("fstat failed: ", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    wrong = "it is not a regular file";
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    wrong = str_cat("it is ", st.st_size, " bytes, not ", bytes);
  }
  if (!wrong.empty()) {
    ::close(fd);
    fail(StatusCode::kIo, "the shared memory rank 0 handed out is not this job's segment: ", wrong);
  }
  return ShmSegment(map_shared(fd, bytes), bytes, fd);
}

void ShmSegment::reserve(size_t offset, size_t bytes) const {
  int rc = reserve_within_file_limit(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (rc != 0) {
    fail(reserve_failure_code(rc), "reserving ", bytes,
         " more bytes of shared memory failed: ", reserve_failure(rc, offset + bytes));
  }
}

bool ShmSegment::release(size_t offset, size_t bytes) const noexcept {
  return ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                     static_cast<off_t>(bytes)) == 0;
}

uint8_t* ShmSegment::map_range(size_t offset, size_t bytes) const {
  void* data =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, static_cast<off_t>(offset));
  if (data == MAP_FAILED) {
    fail(StatusCode::kIo, "mapping ", bytes, " bytes of shared memory failed: ", std::strerror(errno));
  }
  return static_cast<uint8_t*>(data);
}

SegmentDoor::SegmentDoor(const std::string& name) {
  sockaddr_un address{};
  socklen_t length = door_address(name, address);
  listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener_ < 0) fail(StatusCode::kIo, "creating the shared-memory door socket failed: ", std::strerror(errno));
  if (::bind(listener_, reinterpret_cast<const sockaddr*>(&address), length) != 0 || ::listen(listener_, 128) != 0) {
    int error = errno;
    ::close(listener_);
    listener_ = -1;
    fail(StatusCode::kIo, "opening the shared-memory door failed: ", std::strerror(error));
  }
}

SegmentDoor::~SegmentDoor() {
  if (listener_ >= 0) ::close(listener_);
}

bool SegmentDoor::serve(int fd, const std::string& secret, int count, Clock::time_point deadline,
                        const std::function<void()>& between) {
  constexpr auto kBetween = std::chrono::milliseconds(100);
  int served = 0;
  while (served < count) {
    if (between) between();
    if (!wait_for(listener_, POLLIN, std::min(deadline, Clock::now() + kBetween))) {
      if (Clock::now() >= deadline) return false;
      continue;
    }
    int peer = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (peer < 0) continue;  // gone again, or interrupted
    ucred cred{};
    socklen_t cred_length = sizeof(cred);
    std::string presented(secret.size(), '\0');
    bool ok = ::getsockopt(peer, SOL_SOCKET, SO_PEERCRED, &cred, &cred_length) == 0 && cred.uid == ::geteuid() &&
              read_exactly(peer, presented.data(), secret.size(), std::min(deadline, Clock::now() + kSecretWait)) &&
              same_secret(presented.data(), secret);
    if (ok) {
      FdMessage out;
      cmsghdr* header = CMSG_FIRSTHDR(&out.message);
      header->cmsg_level = SOL_SOCKET;
      header->cmsg_type = SCM_RIGHTS;
      header->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
      ok = ::sendmsg(peer, &out.message, MSG_NOSIGNAL) == 1;
    }
    ::close(peer);
    if (ok) ++served;
  }
  return true;
}

int SegmentDoor::fetch(const std::string& name, const std::string& secret, Clock::time_point deadline) {
  sockaddr_un address{};
  socklen_t length = door_address(name, address);
  int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (sock < 0) fail(StatusCode::kIo, "creating a socket failed: ", std::strerror(errno));
  auto fail_closed = [&](StatusCode code, const std::string& why) {
    ::close(sock);
    fail(code, "receiving the shared-memory segment from rank 0 failed: ", why);
  };
  // A full backlog refuses a non-blocking connect with EAGAIN: try again.
  while (::connect(sock, reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    if (errno == EINTR) continue;
    if (errno != EAGAIN) {
      fail_closed(StatusCode::kRemote, str_cat("no door to connect to (", std::strerror(errno),
                                               "): rank 0 exited, or runs in another network namespace"));
    }
    if (Clock::now() >= deadline) fail_closed(StatusCode::kTimeout, "rank 0's door stayed full until the deadline");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (::send(sock, secret.data(), secret.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(secret.size())) {
    fail_closed(StatusCode::kRemote, str_cat("sending the job's secret failed: ", std::strerror(errno)));
  }
  if (!wait_for(sock, POLLIN, deadline)) fail_closed(StatusCode::kTimeout, "rank 0 did not answer by the deadline");
  FdMessage in;
  ssize_t n = ::recvmsg(sock, &in.message, MSG_CMSG_CLOEXEC);
  ::close(sock);
  // A descriptor that came is taken (and closed again on any failure); room
  // for one only: the kernel closes any more that a peer sent.
  cmsghdr* header = n >= 0 ? CMSG_FIRSTHDR(&in.message) : nullptr;
  int fd = -1;
  if (header != nullptr && header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS &&
      header->cmsg_len == CMSG_LEN(sizeof(int))) {
    std::memcpy(&fd, CMSG_DATA(header), sizeof(int));
  }
  if (n != 1 || fd < 0) {
    if (fd >= 0) ::close(fd);
    fail(StatusCode::kRemote,
         "receiving the shared-memory segment from rank 0 failed: rank 0 closed the connection without handing it "
         "out (it exited, or refused this process: another user, or not this job's secret)");
  }
  return fd;
}

}  // namespace dparallel::dist
