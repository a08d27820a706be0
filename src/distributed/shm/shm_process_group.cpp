// The shared-memory backend for the ranks of one host.
//
// Rank 0 creates the segment (segment.h), an anonymous file, and hands its
// descriptor to the others through a door whose name and secret only the
// store carries; nothing of it outlives the ranks. The segment holds a
// control block, every rank's pid, and two sets of slots: per rank a call
// header and `slot` bytes of data. Collectives run in rounds; round k uses
// set k % 2. Each round, every rank writes its part into its own slot, then
// all meet at a barrier, then read the others' slots. A rank writes set k % 2
// again only in round k + 2, after the barrier of round k + 1, which no rank
// reaches before it has read everything of round k.
//
// The first barrier of a collective also swaps the call headers
// (call_header.h), and every rank checks them before it reads any data, so
// mismatched or refused calls fail alike on every rank after one barrier.
//
// all_reduce: small payloads go whole into each slot and every rank reduces
// all slots in rank order (one barrier). Larger ones go in blocks of a slot's
// size: every rank owns a part of each block, reduces it over the ranks in
// rank order into its own slot (its own input read in place), and after a
// second barrier every rank copies the owners' results: a reduce-scatter and
// an all-gather through the segment, every rank reading and writing at once.
// One owner computes each element, so all ranks get the same bits, run to run.
// reduce_scatter works like the first half; broadcast and all_gather copy
// through the slots in one barrier per round.
//
// Waiting: a barrier spins briefly, then sleeps on a futex on the shared
// arrival counter, waking at least every kSleepSlice to check the deadline,
// whether another rank gave up, and whether a peer's process is gone
// (pidfds, which also see a zombie as gone).
#include "distributed/shm/shm_process_group.h"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>
#include <vector>

#include "core/error.h"
#include "distributed/call_header.h"
#include "distributed/reduce_ops.h"
#include "distributed/shm/segment.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x31736d5370645f64ULL;  // "d_dpSms1"
constexpr size_t kLine = 64;
// Data bytes per rank and set: large enough that a barrier per block costs
// little, small enough that a round's slots stay in the last-level cache.
constexpr size_t kSlotBytes = size_t(1) << 20;
constexpr size_t kMinSlotBytes = size_t(64) << 10;
// Both sets of every rank's slots stay within this; more ranks, smaller slots.
constexpr size_t kSegmentDataBudget = size_t(64) << 20;
// all_reduce payloads up to this are reduced whole by every rank.
constexpr size_t kSmallAllReduceBytes = size_t(32) << 10;
// Reductions run over pieces of this size, so that a piece stays in cache
// while every rank's contribution is folded into it.
constexpr size_t kPieceBytes = size_t(16) << 10;
// How long a barrier spins, then spins yielding the core (a peer waiting for
// this core runs at once), before it sleeps; and how long it sleeps at most
// between checks of the deadline, the other ranks' failures and their pids.
constexpr std::chrono::microseconds kSpin{4};
constexpr std::chrono::microseconds kYieldingSpin{50};
constexpr Millis kSleepSlice{50};
// Beyond this many ranks a round's piece per rank would not fill a cache line.
constexpr int32_t kMaxRanks = 1024;

struct Control {
  alignas(kLine) std::atomic<uint32_t> mapped;    // ranks that mapped the segment
  alignas(kLine) std::atomic<uint32_t> arrivals;  // barrier arrivals, all ranks together (wraps)
  alignas(kLine) std::atomic<uint32_t> sleepers;  // ranks asleep on `arrivals`
  alignas(kLine) std::atomic<int32_t> aborted;    // 0, or 1 + the rank that gave up first
  int32_t world;
  uint64_t magic;
  uint64_t total_bytes;
  uint64_t slot_bytes;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Where things are in a segment for `world` ranks.
struct Layout {
  Layout(int32_t world, size_t slot_bytes) : slot(slot_bytes) {
    auto ranks = static_cast<size_t>(world);
    pids = align_up(sizeof(Control), kLine);
    headers = align_up(pids + sizeof(std::atomic<int32_t>) * ranks, kLine);
    data = align_up(headers + 2 * ranks * sizeof(CallHeader), 4096);
    total = data + 2 * ranks * slot;
  }
  size_t pids;
  size_t headers;
  size_t data;
  size_t slot;
  size_t total;
};

size_t slot_bytes_for(int32_t world) {
  size_t budget = kSegmentDataBudget / (2 * static_cast<size_t>(world));
  return std::max(kMinSlotBytes, std::min(kSlotBytes, budget / 4096 * 4096));
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// True once the wrapping counter `value` has reached `target`.
bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, Millis timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

Millis left_until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<Millis>(deadline - Clock::now()), Millis(1));
}

// [begin, end) of `a` and `b` overlap.
bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// Tensors of one dtype seen as their concatenation: byte offsets into it.
class Pieces {
 public:
  explicit Pieces(const std::vector<Tensor>& tensors) {
    size_t at = 0;
    for (const Tensor& t : tensors) {
      if (t.nbytes() == 0) continue;
      data_.push_back(static_cast<uint8_t*>(t.data()));
      begin_.push_back(at);
      at += t.nbytes();
    }
    bytes_ = at;
  }
  size_t bytes() const { return bytes_; }

  // Calls f(data, offset, len) for each piece's share of [begin, end).
  template <typename F>
  void each(size_t begin, size_t end, F&& f) const {
    if (begin >= end) return;
    size_t i = static_cast<size_t>(std::upper_bound(begin_.begin(), begin_.end(), begin) - begin_.begin()) - 1;
    for (; i < data_.size() && begin_[i] < end; ++i) {
      size_t piece_end = i + 1 < begin_.size() ? begin_[i + 1] : bytes_;
      size_t from = std::max(begin, begin_[i]), to = std::min(end, piece_end);
      if (from < to) f(data_[i] + (from - begin_[i]), from, to - from);
    }
  }
  // Copies bytes [at, at + len) of the concatenation to `to`, or from `from` into them.
  void copy_out(uint8_t* to, size_t at, size_t len) const {
    each(at, at + len, [&](uint8_t* data, size_t offset, size_t n) { std::memcpy(to + (offset - at), data, n); });
  }
  void copy_in(size_t at, const uint8_t* from, size_t len) const {
    each(at, at + len, [&](uint8_t* data, size_t offset, size_t n) { std::memcpy(data, from + (offset - at), n); });
  }

 private:
  std::vector<uint8_t*> data_;
  std::vector<size_t> begin_;  // each piece's offset in the concatenation
  size_t bytes_ = 0;
};

class ShmProcessGroup : public ProcessGroup {
 public:
  // `pids`: every rank's pid, when known before the segment exists (the
  // host exchange), so that a rank that dies before it maps the segment is
  // seen at once; empty: learnt from the segment once every rank mapped it.
  ShmProcessGroup(const ProcessGroupOptions& options, std::string prefix, const std::vector<int32_t>& pids)
      : ProcessGroup(options.rank, options.world_size, options.device, options.timeout),
        store_(options.store),
        prefix_(std::move(prefix)),
        layout_(options.world_size, slot_bytes_for(options.world_size)) {
    pidfds_.assign(static_cast<size_t>(size()), -1);
    try {
      set_up(pids);
    } catch (...) {
      close_pidfds();
      throw;
    }
  }

  ~ShmProcessGroup() override {
    drain();
    close_pidfds();
  }

 private:
  void close_pidfds() noexcept {
    for (int& fd : pidfds_) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }

  // Opens a pidfd on rank r's process `pid` (kGoneWhenWatched when none is left).
  void watch_peer(int32_t r, int32_t pid) {
    int fd = pidfd_open(pid);
    // Without pidfds (an old kernel), a dead peer is noticed at the deadline only.
    pidfds_[static_cast<size_t>(r)] = fd < 0 && errno == ESRCH ? kGoneWhenWatched : fd;
  }

  // The watched peers whose processes are gone, by rank: one poll of their pidfds.
  std::vector<int32_t> exited_peers() const {
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

  // kRemote naming every watched peer whose process is gone.
  void check_peers_alive(const std::vector<int32_t>& pids) {
    std::string gone;
    for (int32_t r : exited_peers()) {
      bool mapped = pid_word_if_mapped(r) != 0;
      gone += str_cat(gone.empty() ? "" : ", ", "rank ", r, " (pid ", pids[static_cast<size_t>(r)], ") exited ",
                      mapped ? "after" : "before", " it mapped the segment");
    }
    if (!gone.empty())
      fail(StatusCode::kRemote, "setting up shared memory on rank ", rank(), " of ", size(), ": ", gone);
  }

  // Rank r's pid in the segment, or 0 before this rank mapped it or r did.
  int32_t pid_word_if_mapped(int32_t r) const { return segment_.data() == nullptr ? 0 : pid_word(r)->load(); }

  void set_up(std::vector<int32_t> pids) {
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
      // The others fail with this reason instead of waiting for the door.
      auto tell_others = [&](const Error& e) {
        std::string why = str_cat("!", e.what());
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
        segment_ = ShmSegment::create(layout_.total);
        door = std::make_unique<SegmentDoor>(name);
      } catch (const Error& e) {
        tell_others(e);
        throw;
      }
      auto* control = new (segment_.data()) Control{};
      control->magic = kMagic;
      control->total_bytes = layout_.total;
      control->slot_bytes = layout_.slot;
      control->world = size();
      for (int32_t r = 0; r < size(); ++r) new (pid_word(r)) std::atomic<int32_t>(0);
      std::atomic_thread_fence(std::memory_order_release);
      std::string value = name + " " + secret;
      store_->set(key, Bytes(value.begin(), value.end()));
      // A peer that never comes is named by the wait below, at the deadline.
      door->serve(segment_.fd(), secret, size() - 1, deadline, check_alive);
      segment_.close_fd();
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
      if (!door.empty() && door[0] == '!') {
        fail(StatusCode::kIo, "rank 0 could not set up shared memory for the ranks on this host: ", door.substr(1));
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
      segment_ = ShmSegment::map_received(fd, layout_.total);
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

 public:
  const char* backend_name() const override { return "shm"; }

  void abort(const std::string& why) noexcept override {
    mark_broken(why);
    if (size() > 1) tell_peers_this_rank_gave_up();
  }

 protected:
  DeviceType tensor_device_type() const override { return DeviceType::kCpu; }

  void run_all_reduce(const Tensor& tensor, ReduceOp op) override {
    Pieces pieces({tensor});
    Call o = begin_call(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, &tensor);
    all_reduce(o, pieces, tensor.dtype(), op);
  }

  // In place: the same collective as an all_reduce of the concatenation.
  void run_all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op) override {
    if (tensors.size() == 1) return run_all_reduce(tensors[0], op);
    Pieces pieces(tensors);
    Call o = begin_call(CallKind::kAllReduce, tensors[0].dtype(),
                        static_cast<int64_t>(pieces.bytes() / tensors[0].element_size()), op, -1, &tensors[0]);
    o.pieces = tensors.size();
    all_reduce(o, pieces, tensors[0].dtype(), op);
  }

  void run_broadcast(const Tensor& tensor, int32_t root) override {
    const size_t nbytes = tensor.nbytes();
    auto* data = static_cast<uint8_t*>(tensor.data());
    Call o = begin_call(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, &tensor);
    // The root writes the whole set: every rank's slots are contiguous.
    const size_t block = layout_.slot * static_cast<size_t>(size());
    size_t offset = 0;
    do {
      const size_t len = std::min(block, nbytes - offset);
      if (rank() == root) copy(slot(0), data + offset, len);
      if (offset == 0) {
        exchange_headers(o);
      } else {
        barrier(o);
      }
      if (rank() != root) copy(data + offset, slot(0), len);
      next_round();
      offset += len;
    } while (offset < nbytes);
  }

  void run_all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    const size_t nbytes = input.nbytes();
    auto* in = static_cast<const uint8_t*>(input.data());
    // An input that overlaps an output other than its own (exactly) would be
    // overwritten before it is all sent: send a copy, made before the call
    // starts (failing after the header exchange would leave the others waiting).
    std::vector<uint8_t> copied;
    for (int32_t q = 0; q < size(); ++q) {
      const Tensor& out = outputs[static_cast<size_t>(q)];
      bool own = q == rank() && out.data() == input.data();
      if (!own && overlap(out.data(), out.nbytes(), in, nbytes)) {
        copied.assign(in, in + nbytes);
        in = copied.data();
        break;
      }
    }
    Call o = begin_call(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input);
    size_t offset = 0;
    do {
      const size_t len = std::min(layout_.slot, nbytes - offset);
      copy(slot(rank()), in + offset, len);
      if (offset == 0) {
        exchange_headers(o);
      } else {
        barrier(o);
      }
      for (int32_t q = 0; q < size(); ++q) {
        auto* out = static_cast<uint8_t*>(outputs[static_cast<size_t>(q)].data());
        if (out + offset != in + offset) copy(out + offset, slot(q), len);
      }
      next_round();
      offset += len;
    } while (offset < nbytes);
  }

  void run_reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    const size_t esize = output.element_size();
    const auto n = static_cast<size_t>(output.numel());
    const size_t nbytes = output.nbytes();
    const auto ranks = static_cast<size_t>(size());
    auto* out = static_cast<uint8_t*>(output.data());
    ReduceFn fn = reduce_function(output.dtype(), op);
    // Inputs the output overlaps (other than exactly this rank's own part,
    // which is read just before it is written) are copied first; see all_gather.
    std::vector<const uint8_t*> in(ranks);
    for (size_t q = 0; q < ranks; ++q) in[q] = static_cast<const uint8_t*>(inputs[q].data());
    std::vector<uint8_t> copied;
    for (size_t q = 0; q < ranks; ++q) {
      bool own = q == static_cast<size_t>(rank()) && in[q] == out;
      if (!own && overlap(in[q], nbytes, out, nbytes)) {
        copied.resize(nbytes * ranks);
        for (size_t p = 0; p < ranks; ++p) {
          copy(copied.data() + p * nbytes, in[p], nbytes);
          in[p] = copied.data() + p * nbytes;
        }
        break;
      }
    }
    const bool in_place_late = in[static_cast<size_t>(rank())] == out && rank() >= 2;
    Call o = begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
    // Each round carries a piece of every rank's part, piece q at q * piece.
    const size_t align = std::max<size_t>(1, kLine / esize);
    const size_t piece_elems = std::max(align, layout_.slot / ranks / esize / align * align);
    const size_t piece = piece_elems * esize;
    size_t start = 0;
    do {
      const size_t count = std::min(piece_elems, n - start);
      const size_t len = count * esize, offset = start * esize;
      uint8_t* mine = slot(rank());
      for (size_t q = 0; q < ranks; ++q) {
        if (q != static_cast<size_t>(rank())) copy(mine + q * piece, in[q] + offset, len);
      }
      if (start == 0) {
        exchange_headers(o);
      } else {
        barrier(o);
      }
      const size_t my_piece = static_cast<size_t>(rank()) * piece;
      // Folded straight into the output, unless the output is this rank's
      // own input and the fold would write it before reading it (rank >= 2).
      uint8_t* result = in_place_late ? mine + my_piece : out + offset;
      fold(
          fn, result, [&](int32_t q) { return q == rank() ? in[static_cast<size_t>(q)] + offset : slot(q) + my_piece; },
          count, esize);
      if (op == ReduceOp::kAvg) divide_in_place(output.dtype(), result, count, size());
      if (in_place_late) copy(out + offset, result, len);
      next_round();
      start += count;
    } while (start < n);
  }

  void run_barrier() override {
    Call o = begin_call(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr);
    exchange_headers(o);
    next_round();
  }

  // Swaps headers with every rank at this round's barrier.
  void swap_headers(Call& o) override {
    std::memcpy(header_slot(rank()), &o.header, sizeof(CallHeader));
    barrier(o);
  }
  CallHeader received_header(int32_t r) override {
    CallHeader h;
    std::memcpy(&h, header_slot(r), sizeof(CallHeader));
    return h;
  }
  void after_failed_verdict() override { next_round(); }  // every rank fails here alike, so all stay in step

 private:
  // all_reduce of `pieces` (see the file's comment).
  void all_reduce(Call& o, const Pieces& pieces, DType dtype, ReduceOp op) {
    const size_t esize = dtype_size(dtype);
    const size_t nbytes = pieces.bytes();
    const size_t n = nbytes / esize;
    ReduceFn fn = reduce_function(dtype, op);
    if (nbytes <= std::min(kSmallAllReduceBytes, layout_.slot)) {
      pieces.copy_out(slot(rank()), 0, nbytes);
      exchange_headers(o);
      pieces.each(0, nbytes, [&](uint8_t* data, size_t at, size_t len) {
        fold(
            fn, data, [&](int32_t q) { return slot(q) + at; }, len / esize, esize);
        if (op == ReduceOp::kAvg) divide_in_place(dtype, data, len / esize, size());
      });
      next_round();
      return;
    }
    const size_t block = layout_.slot / esize;                // elements per round
    const size_t align = std::max<size_t>(1, kLine / esize);  // parts start on cache lines
    for (size_t start = 0; start < n; start += block) {
      const size_t count = std::min(block, n - start);
      const size_t part = align_up((count + static_cast<size_t>(size()) - 1) / static_cast<size_t>(size()), align);
      auto part_begin = [&](int32_t q) { return std::min(count, part * static_cast<size_t>(q)) * esize; };
      auto part_end = [&](int32_t q) { return std::min(count, part * static_cast<size_t>(q + 1)) * esize; };
      const size_t in = start * esize;  // the block's offset in the pieces
      uint8_t* mine = slot(rank());
      const size_t my_begin = part_begin(rank()), my_end = part_end(rank());
      // This rank's own part is read where it is, by this rank alone.
      pieces.copy_out(mine, in, my_begin);
      pieces.copy_out(mine + my_end, in + my_end, count * esize - my_end);
      if (start == 0) {
        exchange_headers(o);
      } else {
        barrier(o);
      }
      pieces.each(in + my_begin, in + my_end, [&](uint8_t* data, size_t at, size_t len) {
        uint8_t* result = mine + (at - in);
        fold(
            fn, result, [&](int32_t q) { return q == rank() ? data : slot(q) + (at - in); }, len / esize, esize);
        if (op == ReduceOp::kAvg) divide_in_place(dtype, result, len / esize, size());
        copy(data, result, len);
      });
      barrier(o);
      for (int32_t q = 0; q < size(); ++q) {
        if (q != rank()) pieces.copy_in(in + part_begin(q), slot(q) + part_begin(q), part_end(q) - part_begin(q));
      }
      next_round();
    }
  }

  Control* control() const { return reinterpret_cast<Control*>(segment_.data()); }
  std::atomic<int32_t>* pid_word(int32_t r) const {
    return reinterpret_cast<std::atomic<int32_t>*>(segment_.data() + layout_.pids) + r;
  }
  uint8_t* header_slot(int32_t r) const {
    size_t index = static_cast<size_t>(set()) * static_cast<size_t>(size()) + static_cast<size_t>(r);
    return segment_.data() + layout_.headers + index * sizeof(CallHeader);
  }
  // Rank r's data slot in this round's set.
  uint8_t* slot(int32_t r) const {
    size_t index = static_cast<size_t>(set()) * static_cast<size_t>(size()) + static_cast<size_t>(r);
    return segment_.data() + layout_.data + index * layout_.slot;
  }
  int set() const { return static_cast<int>(round_ & 1); }
  void next_round() { ++round_; }

  static void copy(void* to, const void* from, size_t bytes) {
    if (bytes > 0) std::memcpy(to, from, bytes);
  }

  // out = the reduction of source(0), source(1), ... in rank order, n
  // elements, piece by piece so that each piece stays in cache.
  template <typename Source>
  void fold(ReduceFn fn, uint8_t* out, Source&& source, size_t n, size_t esize) const {
    const size_t step = std::max<size_t>(1, kPieceBytes / esize);
    for (size_t at = 0; at < n; at += step) {
      const size_t m = std::min(step, n - at);
      const size_t offset = at * esize;
      if (size() == 1) {
        const uint8_t* only = source(0) + offset;
        if (only != out + offset) std::memmove(out + offset, only, m * esize);
        continue;
      }
      fn(out + offset, source(0) + offset, source(1) + offset, m);
      for (int32_t q = 2; q < size(); ++q) fn(out + offset, out + offset, source(q) + offset, m);
    }
  }

  // Arrives at the next barrier and returns once every rank has.
  void barrier(Call& o) {
    if (size() == 1) return;
    ++barriers_;
    const uint32_t target = barriers_ * static_cast<uint32_t>(size());
    auto& arrivals = control()->arrivals;
    if (arrivals.fetch_add(1) + 1 == target) {
      if (control()->sleepers.load() != 0) futex_wake(&arrivals);
      return;
    }
    const auto start = Clock::now();
    for (uint32_t i = 1;; ++i) {
      if (reached(arrivals.load(std::memory_order_acquire), target)) return;
      cpu_relax();
      if (i % 64 == 0 && Clock::now() - start >= kSpin) break;
    }
    while (Clock::now() - start < kYieldingSpin) {
      if (reached(arrivals.load(std::memory_order_acquire), target)) return;
      sched_yield();
    }
    for (;;) {
      // A peer may arrive and exit at once: its arrival counts, so it is
      // checked first, and again when a peer is seen gone.
      if (reached(arrivals.load(std::memory_order_acquire), target)) return;
      check_peers(o, [&] { return reached(arrivals.load(std::memory_order_acquire), target); });
      if (reached(arrivals.load(std::memory_order_acquire), target)) return;
      control()->sleepers.fetch_add(1);
      uint32_t seen = arrivals.load();
      if (!reached(seen, target)) futex_wait(&arrivals, seen, std::min(kSleepSlice, left_until(o.deadline)));
      control()->sleepers.fetch_sub(1);
      if (reached(arrivals.load(std::memory_order_acquire), target)) return;
    }
  }

  // Fails the collective when a peer's process is gone, another rank gave
  // up (a dead peer, the likelier cause, is named first), or the deadline
  // passed, unless `arrived()` says the barrier was reached meanwhile.
  template <typename Arrived>
  void check_peers(Call& o, Arrived&& arrived) {
    // Read first: a rank that gave up because a peer died did so after the
    // death, which the pidfds then show too.
    int32_t aborted = control()->aborted.load();
    std::vector<int32_t> exited = exited_peers();
    if (!exited.empty()) {
      if (arrived()) return;
      std::string ranks, gone;
      for (int32_t r : exited) {
        ranks += str_cat(ranks.empty() ? "" : ", ", r);
        gone += str_cat(gone.empty() ? "" : ", ", "rank ", r, " (pid ", pid_word(r)->load(), ")");
      }
      // Who is missing is known: no waiting for the others' failure reports.
      tell_peers_this_rank_gave_up();
      fail_call_knowing(o, StatusCode::kRemote, str_cat("rank(s) ", ranks, " exited"),
                        str_cat("shm: the process of ", gone, " on this host is gone"));
    }
    if (aborted != 0 && !arrived()) give_up(o, false, str_cat("rank ", aborted - 1, " gave up on the group first"));
    if (Clock::now() >= o.deadline && !arrived())
      give_up(o, true, "a rank did not arrive at the collective's barrier in time");
  }

  // Marks the group broken for every rank (the first to give up is named)
  // and wakes the ones asleep in a barrier.
  void tell_peers_this_rank_gave_up() noexcept {
    int32_t none = 0;
    control()->aborted.compare_exchange_strong(none, rank() + 1);
    futex_wake(&control()->arrivals);
  }

  // Tells the other ranks that this one gives up (the group is broken for
  // all), then fails naming the ranks that did not report the failure.
  [[noreturn]] void give_up(const Call& o, bool timed_out, const std::string& cause) {
    tell_peers_this_rank_gave_up();
    fail_call(o, timed_out ? StatusCode::kTimeout : StatusCode::kRemote, "shm: " + cause);
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  Layout layout_;
  ShmSegment segment_;
  // By rank; -1 for this rank and unknown pids, kGoneWhenWatched for a
  // process gone before its pidfd was opened.
  std::vector<int> pidfds_;
  static constexpr int kGoneWhenWatched = -2;
  uint64_t round_ = 0;
  uint32_t barriers_ = 0;  // wraps, as the shared arrival counter does
};

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string host_key(const EnvLookup& lookup) {
  std::string host;
  const char* id = lookup("DP_HOST_ID");
  if (id != nullptr && *id != '\0') {
    host = str_cat("id:", id);
  } else {
    char name[256] = {0};
    if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
    host = str_cat("boot:", read_first_line("/proc/sys/kernel/random/boot_id"), "/host:", name);
  }
  // Ranks reach rank 0's door (an abstract socket) only in the same network
  // namespace, and see each other's pids only in the same pid namespace.
  char net_ns[64] = {0};
  if (::readlink("/proc/self/ns/net", net_ns, sizeof(net_ns) - 1) < 0) net_ns[0] = '\0';
  char pid_ns[64] = {0};
  if (::readlink("/proc/self/ns/pid", pid_ns, sizeof(pid_ns) - 1) < 0) pid_ns[0] = '\0';
  return str_cat(host, "/", net_ns, "/", pid_ns);
}

std::unique_ptr<ProcessGroup> create_shm_process_group(const ProcessGroupOptions& options, const std::string& prefix,
                                                       const std::vector<int32_t>& pids) {
  return std::make_unique<ShmProcessGroup>(options, prefix, pids);
}

namespace {

// The backend for `options` and the host entries of the ranks (`prefix`:
// where they were published).
std::unique_ptr<ProcessGroup> choose_cpu_process_group(const ProcessGroupOptions& options, std::string& prefix) {
  EnvLookup lookup = process_env();
  const char* shm = lookup("DP_SHM");
  bool wanted = shm == nullptr || std::strcmp(shm, "0") != 0;
  auto deadline = Clock::now() + options.timeout;
  const std::string mine_host = host_key(lookup);
  std::vector<std::string> hosts(static_cast<size_t>(options.world_size));
  std::vector<int32_t> pids(static_cast<size_t>(options.world_size));
  bool every_rank_wants_shm = wanted;
  {
    // Every rank publishes its host and whether it wants shared memory; all
    // read the same values, so all choose the same backend.
    ReplyDeadlineCap cap(options.timeout);
    int64_t generation = options.store->add(str_cat("dp/cpu_count/", options.rank), 1);
    prefix = str_cat("dp/cpu", generation, "/");
    // "<shm|gloo> <pid> <host key>"
    std::string mine = str_cat(wanted ? "shm " : "gloo ", ::getpid(), " ", mine_host);
    options.store->set(str_cat(prefix, "host/", options.rank), Bytes(mine.begin(), mine.end()));
    for (int32_t r = 0; r < options.world_size; ++r) {
      std::string theirs = mine;
      if (r != options.rank) {
        Bytes value = options.store->get(str_cat(prefix, "host/", r), left_until(deadline));
        theirs.assign(value.begin(), value.end());
      }
      size_t pid_at = theirs.find(' ');
      size_t host_at = pid_at == std::string::npos ? std::string::npos : theirs.find(' ', pid_at + 1);
      if (host_at == std::string::npos) fail(StatusCode::kRemote, "rank ", r, " published a malformed host entry");
      every_rank_wants_shm = every_rank_wants_shm && theirs.rfind("shm ", 0) == 0;
      pids[static_cast<size_t>(r)] = std::atoi(theirs.substr(pid_at + 1, host_at - pid_at - 1).c_str());
      hosts[static_cast<size_t>(r)] = theirs.substr(host_at + 1);
    }
  }
  if (!every_rank_wants_shm) return create_gloo_process_group(options);
  // The hosts in the order of their lowest ranks, and their ranks.
  std::vector<std::string> keys;
  std::vector<std::vector<int32_t>> members;
  for (int32_t r = 0; r < options.world_size; ++r) {
    auto it = std::find(keys.begin(), keys.end(), hosts[static_cast<size_t>(r)]);
    if (it == keys.end()) {
      keys.push_back(hosts[static_cast<size_t>(r)]);
      members.emplace_back();
      it = keys.end() - 1;
    }
    members[static_cast<size_t>(it - keys.begin())].push_back(r);
  }
  if (keys.size() == 1) {
    if (options.world_size <= kMaxRanks) return create_shm_process_group(options, prefix, pids);
    return create_gloo_process_group(options);
  }
  bool even = true;
  std::string counts;
  for (const auto& m : members) {
    even = even && m.size() == members[0].size();
    counts += str_cat(counts.empty() ? "" : ", ", m.size());
  }
  const auto local_size = static_cast<int32_t>(members[0].size());
  if (even && local_size >= 2 && local_size <= kMaxRanks) {
    HostLayout layout;
    layout.hosts = static_cast<int32_t>(keys.size());
    layout.local_size = local_size;
    for (size_t h = 0; h < members.size(); ++h) {
      for (size_t i = 0; i < members[h].size(); ++i) {
        if (members[h][i] == options.rank) {
          layout.host = static_cast<int32_t>(h);
          layout.local_rank = static_cast<int32_t>(i);
          for (int32_t member : members[h]) layout.local_pids.push_back(pids[static_cast<size_t>(member)]);
        }
      }
    }
    return create_hierarchical_process_group(options, prefix, layout);
  }
  // One rank per host has nothing to share; uneven hosts would leave some
  // local ranks without peers across hosts.
  if (!even && options.rank == 0) {
    std::fprintf(stderr,
                 "[dparallel] cpu process group: using Gloo for everything, not shared memory inside each host: "
                 "its %zu hosts run different numbers of ranks (%s), and the hierarchical path needs the same "
                 "number on every host\n",
                 keys.size(), counts.c_str());
  }
  return create_gloo_process_group(options);
}

}  // namespace

std::unique_ptr<ProcessGroup> create_cpu_process_group(const ProcessGroupOptions& options) {
  std::string prefix;
  std::unique_ptr<ProcessGroup> group = choose_cpu_process_group(options, prefix);
  // Every rank read the host entries before it could take part in creating the group.
  forget_keys(*options.store, {str_cat(prefix, "host/", options.rank)});
  return group;
}

}  // namespace dparallel::dist
