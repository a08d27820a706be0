// A component that runs collectives of its own on a process group from a
// thread of its own (DDP's comm lane). While it is at work, the host's own
// calls on the group are refused at once on the calling rank: they would
// pair with the component's calls on some rank.
#pragma once

#include <string>

namespace dparallel::dist {

class CallGate {
 public:
  virtual ~CallGate() = default;
  // Whether the calling thread is the component's own (never refused).
  virtual bool owns_this_thread() const = 0;
  // Non-empty: why a host call made now is refused. Called under the
  // group's lock: it must not call back into the group.
  virtual std::string refuse_host_call() = 0;
};

}  // namespace dparallel::dist
