// The shared memory that the ranks of a job on one host map: an anonymous
// file (memfd) that has no name anywhere, so nothing is left behind whenever
// and however its ranks die. Its creator hands the file descriptor to the
// other ranks through a SegmentDoor: an abstract unix socket (gone with its
// process) that serves only processes of this user that present the job's
// secret, which only the store carries.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
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

  // A new segment of `bytes`, its memory reserved so that running out fails
  // here (kOutOfMemory: no memory, or past the file-size limit; kIo for
  // other failures) rather than as SIGBUS later, and mapped. Its descriptor stays
  // open (fd()) until close_fd(): to be handed out, and for reserve() and
  // map_range().
  static ShmSegment create(size_t bytes);
  // Maps the segment behind `fd`, which it takes over (and keeps open, as
  // create does); kIo unless that is a regular file of `bytes`.
  static ShmSegment map_received(int fd, size_t bytes);

  // Reserves [offset, offset + bytes) of the file (growing it where that
  // lies past its end): kOutOfMemory when there is no room (nor under the
  // file-size limit, RLIMIT_FSIZE). Needs fd().
  void reserve(size_t offset, size_t bytes) const;
  // Returns [offset, offset + bytes) of the file to the system; false when
  // the file cannot (its size stays).
  bool release(size_t offset, size_t bytes) const noexcept;
  // Maps [offset, offset + bytes) of the file (kIo on failure); munmap it.
  uint8_t* map_range(size_t offset, size_t bytes) const;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  void close_fd() noexcept;

 private:
  ShmSegment(uint8_t* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// 32 hex digits from the kernel's random source.
std::string random_hex128();

// The creator's end: listens on the abstract socket "dparallel-<name>".
class SegmentDoor {
 public:
  using Clock = std::chrono::steady_clock;

  explicit SegmentDoor(const std::string& name);
  ~SegmentDoor();
  SegmentDoor(const SegmentDoor&) = delete;
  SegmentDoor& operator=(const SegmentDoor&) = delete;

  // Hands `fd` to `count` peers that present `secret`, one connection at a
  // time; a connection of another user or with a wrong secret is closed
  // and not counted. False when the deadline came first. `between`, when
  // given, runs at least every 100 ms while it waits (it may throw: a
  // peer that can no longer come).
  bool serve(int fd, const std::string& secret, int count, Clock::time_point deadline,
             const std::function<void()>& between = {});

  // A peer's end: the descriptor the door at `name` hands out for `secret`.
  // kRemote when no door is there or it closed without handing one out,
  // kTimeout at the deadline.
  static int fetch(const std::string& name, const std::string& secret, Clock::time_point deadline);

 private:
  int listener_ = -1;
};

}  // namespace dparallel::dist
