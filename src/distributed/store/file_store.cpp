#include "distributed/store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace dparallel::dist {

namespace {

constexpr const char* kFinishedKey = "__dp_file_store_finished";
constexpr uint32_t kMaxRecordPart = 1u << 30;
constexpr uint32_t kTombstone = 0xffffffffu;  // a value length that erases the key
constexpr Millis kCleanupLockBound{5000};     // a destructor waits no longer for the lock

[[noreturn]] void fail_errno(const std::string& what, const std::string& path) {
  fail(StatusCode::kIo, what, " '", path, "': ", std::strerror(errno));
}

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_errno("cannot write file store", path);
    p += n;
    size -= static_cast<size_t>(n);
  }
}

const char* file_type_name(mode_t mode) {
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISDIR(mode)) return "directory";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  if (S_ISSOCK(mode)) return "socket";
  return "special file";
}

uint32_t wire_u32(const uint8_t* p) {
  uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

// The file opened and exclusively locked for one operation.
class FileStore::Locked {
 public:
  // Waits for the lock until `timeout` passes: a stopped process holding it must not hang us.
  Locked(const std::string& path, Millis timeout) : path_(path) {
    // O_NONBLOCK: opening a FIFO or a device must not block before fstat refuses it.
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd_ < 0) fail_errno("cannot open file store", path);
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      int err = errno;
      ::close(fd_);
      errno = err;
      fail_errno("cannot stat file store", path);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      fail_invalid("file store path '", path, "' is not a regular file (it is a ", file_type_name(st.st_mode),
                   "); pass the path of a regular file or of none yet");
    }
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(200);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        ::close(fd_);
        fail_errno("cannot lock file store", path);
      }
      auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        ::close(fd_);
        fail(StatusCode::kTimeout, "cannot lock file store '", path, "' within ", timeout.count(),
             " ms: another process holds the lock (stopped or hung?)");
      }
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::microseconds(20000));
    }
  }
  ~Locked() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
  int fd() const { return fd_; }

 private:
  std::string path_;
  int fd_ = -1;
};

Millis FileStore::lock_timeout() const { return std::min(default_timeout(), ReplyDeadlineCap::current()); }

FileStore::FileStore(const std::string& path, int32_t world_size) : path_(path), world_size_(world_size) {
  if (path.empty()) fail_invalid("argument 'path' is empty");
  if (world_size <= 0) fail_invalid("argument 'world_size' is ", world_size, "; it must be >= 1");
  Locked file(path_, lock_timeout());  // fails now, with the path, if the file cannot be used
}

FileStore::~FileStore() {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    Locked file(path_, std::min(lock_timeout(), kCleanupLockBound));
    refresh(file.fd());
    auto it = cache_.find(kFinishedKey);
    int64_t finished = it == cache_.end() ? 0 : parse_counter(it->second, kFinishedKey);
    Bytes text = format_counter(finished + 1);
    append(file.fd(), kFinishedKey, &text);
    if (finished + 1 >= world_size_) ::unlink(path_.c_str());
  } catch (...) {
    // A store that cannot be cleaned up is left behind; destruction must not fail.
  }
}

void FileStore::refresh(int fd) {
  off_t end = ::lseek(fd, 0, SEEK_END);
  if (end < 0) fail_errno("cannot seek file store", path_);
  if (end < read_offset_) {  // the file was removed and recreated by a later job
    cache_.clear();
    read_offset_ = 0;
  }
  if (end == read_offset_) return;
  std::vector<uint8_t> data(static_cast<size_t>(end - read_offset_));
  size_t got = 0;
  while (got < data.size()) {
    ssize_t n = ::pread(fd, data.data() + got, data.size() - got, read_offset_ + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_errno("cannot read file store", path_);
    got += static_cast<size_t>(n);
  }
  size_t pos = 0;
  auto take_u32 = [&](uint32_t* v) {
    if (data.size() - pos < 4) return false;
    std::memcpy(v, data.data() + pos, 4);
    pos += 4;
    return *v <= kMaxRecordPart;
  };
  while (pos < data.size()) {
    size_t start = pos;
    uint32_t key_len = 0, value_len = 0;
    if (!take_u32(&key_len) || data.size() - pos < key_len) {
      pos = start;  // a record still being written by another process
      break;
    }
    std::string key(reinterpret_cast<const char*>(data.data() + pos), key_len);
    pos += key_len;
    if (data.size() - pos >= 4 && wire_u32(data.data() + pos) == kTombstone) {
      pos += 4;
      cache_.erase(key);
      continue;
    }
    if (!take_u32(&value_len) || data.size() - pos < value_len) {
      pos = start;
      break;
    }
    cache_[key] = Bytes(data.begin() + static_cast<std::ptrdiff_t>(pos),
                        data.begin() + static_cast<std::ptrdiff_t>(pos + value_len));
    pos += value_len;
  }
  read_offset_ += static_cast<off_t>(pos);
}

void FileStore::append(int fd, const std::string& key, const Bytes* value) {
  const size_t value_size = value == nullptr ? 0 : value->size();
  if (key.size() > kMaxRecordPart || value_size > kMaxRecordPart) fail_invalid("store key or value exceeds 1 GiB");
  std::vector<uint8_t> record(8 + key.size() + value_size);
  uint32_t key_len = static_cast<uint32_t>(key.size());
  uint32_t value_len = value == nullptr ? kTombstone : static_cast<uint32_t>(value_size);
  std::memcpy(record.data(), &key_len, 4);
  std::memcpy(record.data() + 4, key.data(), key.size());
  std::memcpy(record.data() + 4 + key.size(), &value_len, 4);
  if (value_size > 0) std::memcpy(record.data() + 8 + key.size(), value->data(), value_size);
  if (::lseek(fd, 0, SEEK_END) < 0) fail_errno("cannot seek file store", path_);
  write_all(fd, record.data(), record.size(), path_);
}

void FileStore::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());
  append(file.fd(), key, &value);
}

Bytes FileStore::get(const std::string& key, Millis timeout) {
  wait({key}, timeout);
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());  // the last set wins, whichever handle or process made it
  return cache_.at(key);
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());
  auto it = cache_.find(key);
  int64_t value = it == cache_.end() ? 0 : parse_counter(it->second, key);
  // Wraps like the TCP store's integers rather than overflowing.
  value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
  Bytes text = format_counter(value);
  append(file.fd(), key, &text);
  return value;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());  // the file may have been removed and recreated: keys seen before may be gone
  for (const std::string& key : keys) {
    if (cache_.count(key) == 0) return false;
  }
  return true;
}

bool FileStore::erase(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());
  if (cache_.count(key) == 0) return false;
  append(file.fd(), key, nullptr);
  cache_.erase(key);
  return true;
}

int64_t FileStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  Locked file(path_, lock_timeout());
  refresh(file.fd());
  return static_cast<int64_t>(cache_.size());
}

}  // namespace dparallel::dist
