#include "core/process_origin.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "core/error.h"

namespace dparallel {

namespace {
std::atomic<uint64_t> g_fork_generation{0};

void on_fork_in_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t fork_generation() noexcept { return g_fork_generation.load(std::memory_order_relaxed); }

ProcessOrigin::ProcessOrigin() noexcept : pid_(::getpid()) {
  static std::once_flag registered;
  std::call_once(registered, [] { ::pthread_atfork(nullptr, nullptr, on_fork_in_child); });
  generation_ = fork_generation();
}

void ProcessOrigin::check(const char* what) const {
  if (is_current()) return;
  fail(StatusCode::kState, what, " was created in process ", pid_, "; this is a forked child (pid ", ::getpid(),
       "), which must not use its parent's process groups, stores, dp_ddp or dp_fsdp (that would talk on the parent's "
       "connections): create new ones in the child");
}

}  // namespace dparallel
