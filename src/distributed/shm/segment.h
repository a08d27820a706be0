// A POSIX shared-memory segment that the ranks of a job on one host map.
// Private to the job: created with O_EXCL and mode 0600 under a name of
// random bytes that only the store carries, and unlinked as soon as every
// local rank has mapped it, so that no rank's death leaves it behind (except
// when every rank dies in the milliseconds between its creation and the last
// rank's mapping: then the name stays until it is removed or the host reboots).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dparallel::dist {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // "/dparallel-" and 32 hex digits from the kernel's random source.
  static std::string random_name();
  // Creates `name` (O_EXCL, mode 0600) of `bytes`, its memory reserved so
  // that a full /dev/shm fails here (kIo) rather than as SIGBUS later, and maps it.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Maps the existing `name`; kIo unless it is a regular file of this user's,
  // mode 0600 and `bytes` long.
  static ShmSegment attach(const std::string& name, size_t bytes);
  // Removes the name (the mappings stay); nothing when it is gone already.
  static void unlink(const std::string& name) noexcept;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  ShmSegment(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace dparallel::dist
