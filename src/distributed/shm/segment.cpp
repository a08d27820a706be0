#include "distributed/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace dparallel::dist {

namespace {

// Maps `bytes` of `fd` and closes it; the mapping keeps the memory alive.
uint8_t* map_and_close(int fd, size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int error = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    fail(StatusCode::kIo, "mapping ", bytes, " bytes of the shared-memory segment ", name,
         " failed: ", std::strerror(error));
  }
  return static_cast<uint8_t*>(data);
}

}  // namespace

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

std::string ShmSegment::random_name() {
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
  std::string name = "/dparallel-";
  for (uint8_t b : bytes) {
    name += kHex[b >> 4];
    name += kHex[b & 15];
  }
  return name;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    fail(StatusCode::kIo, "creating the shared-memory segment ", name, " failed: ", std::strerror(errno),
         " (DP_SHM=0 makes the ranks on one host use Gloo instead)");
  }
  // A umask may only narrow 0600; fchmod pins it whatever the umask.
  int rc = ::fchmod(fd, 0600) == 0 ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) : errno;
  if (rc != 0) {
    ::close(fd);
    unlink(name);
    fail(StatusCode::kIo, "reserving ", bytes, " bytes of shared memory for ", name, " failed: ", std::strerror(rc),
         " (is /dev/shm full or small? DP_SHM=0 makes the ranks on one host use Gloo instead)");
  }
  try {
    return ShmSegment(map_and_close(fd, bytes, name), bytes);
  } catch (...) {
    unlink(name);
    throw;
  }
}

ShmSegment ShmSegment::attach(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) fail(StatusCode::kIo, "opening the shared-memory segment ", name, " failed: ", std::strerror(errno));
  struct stat st {};
  std::string wrong;
  if (::fstat(fd, &st) != 0) {
    wrong = str_cat("fstat failed: ", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0600) {
    wrong = str_cat("it is not a regular file of user ", ::geteuid(), " with mode 0600 (uid ", st.st_uid, ", mode ",
                    std::oct, st.st_mode & 07777, ")");
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    wrong = str_cat("it is ", st.st_size, " bytes, not ", bytes);
  }
  if (!wrong.empty()) {
    ::close(fd);
    fail(StatusCode::kIo, "the shared-memory segment ", name, " is not this job's: ", wrong);
  }
  return ShmSegment(map_and_close(fd, bytes, name), bytes);
}

void ShmSegment::unlink(const std::string& name) noexcept { ::shm_unlink(name.c_str()); }

}  // namespace dparallel::dist
