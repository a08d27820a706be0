// The shared-memory backend for the ranks of one host: its segment.
//
// Rank 0 creates the segment (segment.h), an anonymous file, and hands its
// descriptor to the others through a door whose name and secret only the
// store carries; nothing of it outlives the ranks. The segment holds a
// control block, every rank's pid and CPU, and two sets of slots: per rank a
// call header and `slot` bytes of data. Collectives run in rounds; round k
// uses set k % 2. Each round, every rank writes its part into its own slot, then
// all meet at a barrier, then read the others' slots. A rank writes set k % 2
// again only in round k + 2, after the barrier of round k + 1, which no rank
// reaches before it has read everything of round k.
//
// Setting up: rank 0 creates and serves the segment; every rank maps it,
// writes its pid, and waits until all have, watching its peers' pids.
#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <new>
#include <thread>

#include "core/error.h"
#include "distributed/process_group.h"
#include "distributed/shm/shm_backend.h"

namespace dparallel::dist {

namespace shm {

namespace {

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

size_t slot_bytes_for(int32_t world) {
  size_t budget = kSegmentDataBudget / (2 * static_cast<size_t>(world));
  return std::max(kMinSlotBytes, std::min(kSlotBytes, budget / 4096 * 4096));
}

ShmBackend::ShmBackend(CallSite& site, const ProcessGroupOptions& options, std::string prefix,
                       const std::vector<int32_t>& pids)
    : Backend(site),
      store_(options.store),
      prefix_(std::move(prefix)),
      layout_(options.world_size, slot_bytes_for(options.world_size)) {
  pidfds_.assign(static_cast<size_t>(size()), -1);
  if (options.network_paced) spin_budget_.set_network_paced();
  try {
    set_up(pids);
  } catch (...) {
    close_pidfds();
    throw;
  }
}

ShmBackend::~ShmBackend() { close_pidfds(); }

void ShmBackend::close_pidfds() noexcept {
  for (int& fd : pidfds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void ShmBackend::watch_peer(int32_t r, int32_t pid) {
  int fd = pidfd_open(pid);
  // Without pidfds (an old kernel), a dead peer is noticed at the deadline only.
  pidfds_[static_cast<size_t>(r)] = fd < 0 && errno == ESRCH ? kGoneWhenWatched : fd;
}

std::vector<int32_t> ShmBackend::exited_peers() const {
  std::vector<pollfd> fds;
  std::vector<int32_t> polled, gone;
  for (int32_t r = 0; r < size(); ++r) {
    int fd = pidfds_[static_cast<size_t>(r)];
    if (fd == kGoneWhenWatched) gone.push_back(r);
    if (fd < 0) continue;
    fds.push_back(pollfd{fd, POLLIN, 0});
    polled.push_back(r);
  }
  if (!fds.empty() && ::poll(fds.data(), fds.size(), 0) > 0) {
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) gone.push_back(polled[i]);
    }
  }
  std::sort(gone.begin(), gone.end());
  return gone;
}

void ShmBackend::check_peers_alive(const std::vector<int32_t>& pids) {
  std::string gone;
  for (int32_t r : exited_peers()) {
    bool mapped = pid_word_if_mapped(r) != 0;
    gone += str_cat(gone.empty() ? "" : ", ", "rank ", r, " (pid ", pids[static_cast<size_t>(r)], ") exited ",
                    mapped ? "after" : "before", " it mapped the segment");
  }
  if (!gone.empty()) fail(StatusCode::kRemote, "setting up shared memory on rank ", rank(), " of ", size(), ": ", gone);
}

void ShmBackend::set_up(std::vector<int32_t> pids) {
  auto deadline = Clock::now() + timeout();
  ReplyDeadlineCap cap(timeout());
  set_failure_reports(store_, prefix_);
  const bool pids_known = pids.size() == static_cast<size_t>(size());
  if (pids_known) {
    for (int32_t r = 0; r < size(); ++r) {
      if (r != rank()) watch_peer(r, pids[static_cast<size_t>(r)]);
    }
    check_peers_alive(pids);
  }
  auto check_alive = [&] {
    if (pids_known) check_peers_alive(pids);
  };
  std::string key = prefix_ + "shm_segment";
  if (rank() == 0) {
    // The others fail with this reason instead of waiting for the door
    // ('~': no room for the segment, which they fail with alike).
    auto tell_others = [&](const Error& e) {
      std::string why = str_cat(e.code() == StatusCode::kOutOfMemory ? "~" : "!", e.what());
      try {
        store_->set(key, Bytes(why.begin(), why.end()));
      } catch (const Error&) {
        // They time out instead.
      }
    };
    std::unique_ptr<SegmentDoor> door;
    std::string name = random_hex128();
    std::string secret = random_hex128();
    try {
      segment_ = std::make_shared<ShmSegment>(ShmSegment::create(layout_.total));
      door = std::make_unique<SegmentDoor>(name);
    } catch (const Error& e) {
      tell_others(e);
      throw;
    }
    auto* control = new (segment_->data()) Control{};
    control->magic = kMagic;
    control->total_bytes = layout_.total;
    control->slot_bytes = layout_.slot;
    control->world = size();
    for (int32_t r = 0; r < size(); ++r) {
      new (pid_word(r)) std::atomic<int32_t>(0);
      new (cpu_word(r)) std::atomic<int32_t>(0);
    }
    std::atomic_thread_fence(std::memory_order_release);
    std::string value = name + " " + secret;
    store_->set(key, Bytes(value.begin(), value.end()));
    // A peer that never comes is named by the wait below, at the deadline.
    // The descriptor stays open: create_region grows the file.
    door->serve(segment_->fd(), secret, size() - 1, deadline, check_alive);
  } else {
    // Rank 0's door, once it is up; with the pids, rank 0's death ends the wait.
    auto pause = std::chrono::milliseconds(1);
    while (pids_known && !store_->check({key}) && Clock::now() < deadline) {
      check_alive();
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    Bytes value = store_->get(key, left_until(deadline));
    std::string door(value.begin(), value.end());
    if (!door.empty() && (door[0] == '!' || door[0] == '~')) {
      fail(door[0] == '~' ? StatusCode::kOutOfMemory : StatusCode::kIo,
           "rank 0 could not set up shared memory for the ranks on this host: ", door.substr(1));
    }
    if (door.size() != 65 || door[32] != ' ' || door.find_first_not_of("0123456789abcdef ") != std::string::npos) {
      fail(StatusCode::kIo, "the store holds no shared-memory door under '", key, "'");
    }
    int fd = -1;
    try {
      fd = SegmentDoor::fetch(door.substr(0, 32), door.substr(33), deadline);
    } catch (const Error& e) {
      // Rank 0 closes its door when it gives up on a peer that died: name that peer.
      if (e.code() == StatusCode::kRemote) check_alive();
      throw;
    }
    segment_ = std::make_shared<ShmSegment>(ShmSegment::map_received(fd, layout_.total));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (control()->magic != kMagic || control()->total_bytes != layout_.total ||
        control()->slot_bytes != layout_.slot || control()->world != size()) {
      fail(StatusCode::kIo, "the shared-memory segment rank 0 handed out has another layout than this rank expects");
    }
  }
  pid_word(rank())->store(static_cast<int32_t>(::getpid()), std::memory_order_release);
  control()->mapped.fetch_add(1);
  // Every rank waits until all have mapped it, so that each knows every pid.
  auto pause = std::chrono::microseconds(50);
  while (control()->mapped.load() < static_cast<uint32_t>(size())) {
    check_alive();
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int32_t r = 0; r < size(); ++r) {
        if (pid_word(r)->load() == 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      fail(StatusCode::kTimeout, "setting up shared memory on rank ", rank(), " of ", size(), " timed out after ",
           timeout().count(), " ms: rank(s) ", missing, " did not map the segment");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  // Every rank has read the door (and its secret) by now.
  if (rank() == 0) forget_keys(*store_, {key});
  if (pids_known) return;
  pids.assign(static_cast<size_t>(size()), 0);
  for (int32_t r = 0; r < size(); ++r) {
    pids[static_cast<size_t>(r)] = pid_word(r)->load();
    if (r != rank()) watch_peer(r, pids[static_cast<size_t>(r)]);
  }
  check_peers_alive(pids);
}

void ShmBackend::abort(const std::string& /*why*/) noexcept {
  if (size() > 1) tell_peers_this_rank_gave_up();
}

void ShmBackend::tell_peers_this_rank_gave_up() noexcept {
  int32_t none = 0;
  control()->aborted.compare_exchange_strong(none, rank() + 1);
  futex_wake(&control()->arrivals);
}

}  // namespace shm

std::unique_ptr<Backend> create_shm_backend(CallSite& site, const ProcessGroupOptions& options,
                                            const std::string& prefix, const std::vector<int32_t>& pids) {
  return std::make_unique<shm::ShmBackend>(site, options, prefix, pids);
}

std::unique_ptr<ProcessGroup> create_shm_process_group(const ProcessGroupOptions& options, const std::string& prefix,
                                                       const std::vector<int32_t>& pids) {
  return make_process_group(options, [&](CallSite& site) { return create_shm_backend(site, options, prefix, pids); });
}

}  // namespace dparallel::dist
