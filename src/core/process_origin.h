// The process an object was made in. A forked child inherits its parent's
// sockets, shared memory and locks, but none of its threads: an object that
// talks to peers or waits on its own threads must refuse to run there, or it
// would write on the parent's wire, or wait for a thread that does not exist.
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace dparallel {

// Grows by one in every child forked after the first ProcessOrigin was made
// (a pthread_atfork handler): comparing it costs no system call.
uint64_t fork_generation() noexcept;

class ProcessOrigin {
 public:
  ProcessOrigin() noexcept;

  pid_t pid() const noexcept { return pid_; }
  bool is_current() const noexcept { return generation_ == fork_generation(); }
  // kState naming `what`, the creating process and this one, unless this is it.
  void check(const char* what) const;

 private:
  pid_t pid_;
  uint64_t generation_;
};

}  // namespace dparallel
