// The shared-memory backend's parts (shm_setup.cpp: the segment and its
// door; shm_collectives.cpp: the collectives through it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "distributed/backend.h"
#include "distributed/reduce_ops.h"
#include "distributed/shm/segment.h"
#include "distributed/shm/shm_process_group.h"
#include "distributed/shm/spin_budget.h"

namespace dparallel::dist::shm {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x32736d5370645f64ULL;  // "d_dpSms2"
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
// How long a barrier sleeps at most (after its spin, spin_budget.h) between
// checks of the deadline, the other ranks' failures and their pids.
constexpr Millis kSleepSlice{50};
// How often a background wait that no thread awaits looks whether one does
// (arrive_and_wait).
constexpr std::chrono::microseconds kAwaitPoll{100};
// Waits in a row beside another rank on one CPU before the higher rank moves.
constexpr uint32_t kSharedWaitsBeforeMove = 64;

// Regions (create_region) live past the segment's own bytes in its file;
// their table is in the control block. At most this many at once.
constexpr size_t kMaxRegions = 64;

struct RegionEntry {
  std::atomic<uint32_t> mapped;  // ranks that map it: the last to unmap it releases its memory
  uint32_t used;                 // 1 from its creation until its memory is released
  uint64_t offset;               // in the file
  uint64_t bytes;                // every rank's part together
};

struct Control {
  alignas(kLine) std::atomic<uint32_t> mapped;    // ranks that mapped the segment
  alignas(kLine) std::atomic<uint32_t> arrivals;  // barrier arrivals, all ranks together (wraps)
  alignas(kLine) std::atomic<uint32_t> sleepers;  // ranks asleep on `arrivals`
  alignas(kLine) std::atomic<int32_t> aborted;    // 0, or 1 + the rank that gave up first
  int32_t world;
  uint64_t magic;
  uint64_t total_bytes;
  uint64_t slot_bytes;
  // create_region: rank 0's choice, read by every rank between two barriers.
  int32_t region_choice;  // the entry, or -1: none (region_error says why)
  char region_error[160];
  alignas(kLine) std::atomic<uint32_t> region_failures;  // ranks that could not map the new region
  std::atomic<uint32_t> regions_lock;                    // guards `regions` across processes (a spin lock)
  RegionEntry regions[kMaxRegions];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

inline size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A tensor in a region: the region's place in the file (0: not in one) and
// the tensor's offset in this rank's part of it.
struct RegionSpot {
  uint64_t region = 0;
  uint64_t offset = 0;
  bool operator==(const RegionSpot& o) const { return region == o.region && offset == o.offset; }
};

// Where an all_reduce's data lies in one region: the runs (offset into this
// rank's part, bytes) in call order, and the spot every rank compares: for
// one tensor where it starts, for several a fingerprint of their runs (top
// bit set, so that it never equals a tensor's offset).
struct RegionPlacement {
  RegionSpot spot;
  std::vector<std::pair<size_t, size_t>> runs;
};

// Where things are in a segment for `world` ranks.
struct Layout {
  Layout(int32_t world, size_t slot_bytes) : slot(slot_bytes) {
    auto ranks = static_cast<size_t>(world);
    pids = align_up(sizeof(Control), kLine);
    cpus = align_up(pids + sizeof(std::atomic<int32_t>) * ranks, kLine);
    headers = align_up(cpus + sizeof(std::atomic<int32_t>) * ranks, kLine);
    spots = align_up(headers + 2 * ranks * sizeof(CallHeader), kLine);
    data = align_up(spots + 2 * ranks * sizeof(RegionSpot), 4096);
    total = data + 2 * ranks * slot;
  }
  size_t pids;
  size_t cpus;  // per rank: 1 + the CPU it last arrived at a barrier on, 0 before
  size_t headers;
  size_t spots;  // per set and rank: where this call's tensor lies in a region
  size_t data;
  size_t slot;
  size_t total;
};

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

// The regions this rank maps (shm_regions.cpp); they may outlive the backend.
struct RegionRegistry;

// Data bytes per rank and set for a segment of `world` ranks.
size_t slot_bytes_for(int32_t world);
// Wakes every rank asleep on `word`, in any process.
void futex_wake(std::atomic<uint32_t>* word);

class ShmBackend : public Backend, private RegionService {
 public:
  // `pids`: every rank's pid, when known before the segment exists (the
  // host exchange), so that a rank that dies before it maps the segment is
  // seen at once; empty: learnt from the segment once every rank mapped it.
  ShmBackend(CallSite& site, const ProcessGroupOptions& options, std::string prefix, const std::vector<int32_t>& pids);
  ~ShmBackend() override;
  // Whether its waits spin briefly (ProcessGroupOptions::network_paced).
  bool network_paced() const { return spin_budget_.network_paced(); }
  void abort(const std::string& why) noexcept override;
  void all_reduce(const Tensor& tensor, ReduceOp op) override;
  // In place: the same collective as an all_reduce of the concatenation.
  void all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op) override;
  void broadcast(const Tensor& tensor, int32_t root) override;
  void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override;
  // Straight from the sources into the slot, and from the other ranks'
  // slots into the places: no contiguous scratch.
  void all_gather_runs(size_t segment, const std::vector<SegmentRun>& sources,
                       const std::vector<std::vector<SegmentRun>>& places) override;
  // Every rank's part is gathered from its runs straight into the slot;
  // this rank's own is read where it lies; an accumulated result is added
  // piece by piece while in cache.
  void reduce_scatter_runs(const std::vector<std::vector<SegmentRun>>& parts, const Tensor& output, ReduceOp op,
                           bool accumulate) override;
  void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override;
  void barrier() override;
  RegionService* regions() override { return this; }
  const char* name() const override { return "shm"; }
  // all_reduce calls that read the other ranks' memory in a region.
  uint64_t calls_in_regions() const { return calls_in_regions_; }
  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.shared_regions = true;
    caps.in_place_runs = true;
    caps.transfers_on_host_cores = true;
    return caps;
  }
  // Swaps headers with every rank at this round's barrier.
  void swap_headers(Call& o) override {
    std::memcpy(header_slot(rank()), &o.header, sizeof(CallHeader));
    arrive_and_wait(o);
  }
  CallHeader received_header(int32_t r) override {
    CallHeader h;
    std::memcpy(&h, header_slot(r), sizeof(CallHeader));
    return h;
  }
  // Every rank fails here alike, so all stay in step.
  void after_failed_verdict() override { next_round(); }

 private:
  // rank 0 reserves every rank's part in the segment's file (reusing a
  // released region's place where it fits); every rank maps them all.
  std::shared_ptr<SharedRegion> create_region(size_t bytes) override;
  // Rank r's pid in the segment, or 0 before this rank mapped it or r did.
  int32_t pid_word_if_mapped(int32_t r) const {
    return segment_ == nullptr || segment_->data() == nullptr ? 0 : pid_word(r)->load();
  }
  // all_reduce of `pieces`, the bytes of `tensors` (see the file's comment).
  void all_reduce_pieces(Call& o, const Pieces& pieces, const std::vector<Tensor>& tensors, DType dtype, ReduceOp op);
  // Where `t` lies in a region of this group, or {} (not in one).
  RegionSpot spot_of(const Tensor& t) const;
  // Where `tensors` lie, when all lie in one region of this group.
  RegionPlacement placement_of(const std::vector<Tensor>& tensors) const;
  // Publishes this call's spot (after the header exchange every rank reads
  // all of them) and tells whether every rank's tensor lies at that spot.
  void publish_spot(const RegionSpot& spot) { *spot_word(rank()) = spot; }
  bool same_spot_everywhere() const;
  bool any_spot_published() const;
  // all_reduce of data placed alike in one region on every rank, after the
  // header exchange: each rank folds its part of the runs' concatenation
  // straight from the others' memory and writes the result into everyone's:
  // no staging copies.
  void all_reduce_in_region(Call& o, const RegionPlacement& placement, DType dtype, ReduceOp op);
  void reduce_in_region(Call& o, const RegionPlacement& placement, DType dtype, ReduceOp op);
  // Rank q's part of this group's region at `region` (its file offset).
  uint8_t* region_part(uint64_t region, int32_t q) const;
  // After a failure amid a region all-reduce: this rank's part becomes
  // private memory holding what it holds now, so that a peer still pushing
  // (stalled past the timeout, resumed later) writes into pages this rank no
  // longer maps. The region leaves the table: no later call reduces in it.
  void detach_own_part(uint64_t region) noexcept;
  // Where `sources` lie in one region exactly as in the segment (the
  // segment's start as the spot's offset), or {}.
  RegionSpot segment_spot(const std::vector<SegmentRun>& sources) const;
  // all_gather_runs of segments at the same spot of one region on every
  // rank, after the header exchange: each rank copies the others' runs
  // straight from their memory.
  void all_gather_in_region(Call& o, size_t segment, const std::vector<std::vector<SegmentRun>>& places,
                            const RegionSpot& spot);
  void close_pidfds() noexcept;
  // Opens a pidfd on rank r's process `pid` (kGoneWhenWatched when none is left).
  void watch_peer(int32_t r, int32_t pid);
  // The watched peers whose processes are gone, by rank: one poll of their pidfds.
  std::vector<int32_t> exited_peers() const;
  // kRemote naming every watched peer whose process is gone.
  void check_peers_alive(const std::vector<int32_t>& pids);
  void set_up(std::vector<int32_t> pids);
  // out = the reduction of source(0), source(1), ... in rank order, n
  // elements, piece by piece so that each piece stays in cache; each piece
  // is divided by the world size for kAvg, then handed to
  // done(byte offset, bytes) while it is still in cache.
  template <typename Source, typename Done>
  void fold(ReduceFn fn, ReduceOp op, DType dtype, uint8_t* out, Source&& source, size_t n, Done&& done) const;
  // out += what fold computes, each piece added while in cache.
  template <typename Source>
  void fold_into(ReduceFn fn, ReduceOp op, DType dtype, uint8_t* out, Source&& source, size_t n) const;
  // Arrives at the next barrier and returns once every rank has.
  void arrive_and_wait(Call& o);
  // Publishes the CPU this rank runs on (layout_.cpus).
  void publish_cpu();
  // The lowest other rank that last arrived on this rank's CPU, or -1:
  // spinning would only keep it off the CPU (the ranks are not bound to CPUs).
  int32_t rank_sharing_cpu() const;
  // Moves this thread to another CPU it may run on, once: its affinity
  // without this CPU, then at once the whole of it again. A waking rank
  // runs where the rank that woke it ran, so two ranks that take turns on
  // one CPU otherwise stay there while the other CPUs run other work
  // (bench/RESULTS.md; Open MPI binds its ranks to cores instead).
  void move_off_shared_cpu();
  // Fails the collective when a peer's process is gone, another rank gave
  // up (a dead peer, the likelier cause, is named first), or the deadline
  // passed, unless `arrived()` says the barrier was reached meanwhile.
  template <typename Arrived>
  void check_peers(Call& o, Arrived&& arrived);
  // Marks the group broken for every rank (the first to give up is named)
  // and wakes the ones asleep in a barrier.
  void tell_peers_this_rank_gave_up() noexcept;
  // Tells the other ranks that this one gives up (the group is broken for
  // all), then fails naming the ranks that did not report the failure.
  [[noreturn]] void give_up(const Call& o, bool timed_out, const std::string& cause);
  Control* control() const { return reinterpret_cast<Control*>(segment_->data()); }
  std::atomic<int32_t>* pid_word(int32_t r) const {
    return reinterpret_cast<std::atomic<int32_t>*>(segment_->data() + layout_.pids) + r;
  }
  std::atomic<int32_t>* cpu_word(int32_t r) const {
    return reinterpret_cast<std::atomic<int32_t>*>(segment_->data() + layout_.cpus) + r;
  }
  RegionSpot* spot_word(int32_t r) const {
    size_t index = static_cast<size_t>(set()) * static_cast<size_t>(size()) + static_cast<size_t>(r);
    return reinterpret_cast<RegionSpot*>(segment_->data() + layout_.spots) + index;
  }
  uint8_t* header_slot(int32_t r) const {
    size_t index = static_cast<size_t>(set()) * static_cast<size_t>(size()) + static_cast<size_t>(r);
    return segment_->data() + layout_.headers + index * sizeof(CallHeader);
  }
  // Rank r's data slot in this round's set.
  uint8_t* slot(int32_t r) const {
    size_t index = static_cast<size_t>(set()) * static_cast<size_t>(size()) + static_cast<size_t>(r);
    return segment_->data() + layout_.data + index * layout_.slot;
  }
  int set() const { return static_cast<int>(round_ & 1); }
  void next_round() { ++round_; }
  // A reduce_scatter's round carries a piece of every rank's part (piece q
  // at q * piece in a slot): its elements, cache-line aligned.
  size_t scatter_piece_elements(size_t esize) const;

  std::shared_ptr<Store> store_;
  std::string prefix_;
  Layout layout_;
  // Shared with the regions, which keep its descriptor and table alive.
  std::shared_ptr<ShmSegment> segment_;
  std::shared_ptr<RegionRegistry> regions_;
  uint64_t calls_in_regions_ = 0;
  // By rank; -1 for this rank and unknown pids, kGoneWhenWatched for a
  // process gone before its pidfd was opened.
  std::vector<int> pidfds_;
  static constexpr int kGoneWhenWatched = -2;
  uint64_t round_ = 0;
  uint32_t barriers_ = 0;  // wraps, as the shared arrival counter does
  SpinBudget spin_budget_;
  int32_t published_cpu_ = 0;  // this rank's word in layout_.cpus
  uint32_t shared_waits_ = 0;  // waits in a row that began beside another rank
};

template <typename Source, typename Done>
inline void ShmBackend::fold(ReduceFn fn, ReduceOp op, DType dtype, uint8_t* out, Source&& source, size_t n,
                             Done&& done) const {
  const size_t esize = dtype_size(dtype);
  const size_t step = std::max<size_t>(1, kPieceBytes / esize);
  // Two ranks' float average in one pass instead of a sum and a division.
  const ReduceFn halved = op == ReduceOp::kAvg && size() == 2 ? average_of_two_function(dtype) : nullptr;
  for (size_t at = 0; at < n; at += step) {
    const size_t m = std::min(step, n - at);
    const size_t offset = at * esize;
    if (size() == 1) {
      const uint8_t* only = source(0) + offset;
      if (only != out + offset) std::memmove(out + offset, only, m * esize);
    } else if (halved != nullptr) {
      halved(out + offset, source(0) + offset, source(1) + offset, m);
    } else {
      fn(out + offset, source(0) + offset, source(1) + offset, m);
      for (int32_t q = 2; q < size(); ++q) fn(out + offset, out + offset, source(q) + offset, m);
      if (op == ReduceOp::kAvg) divide_in_place(dtype, out + offset, m, size());
    }
    done(offset, m * esize);
  }
}

template <typename Source>
inline void ShmBackend::fold_into(ReduceFn fn, ReduceOp op, DType dtype, uint8_t* out, Source&& source,
                                  size_t n) const {
  alignas(64) uint8_t piece[kPieceBytes];
  const size_t esize = dtype_size(dtype);
  const size_t step = std::max<size_t>(1, kPieceBytes / esize);
  const ReduceFn add = reduce_function(dtype, ReduceOp::kSum);
  for (size_t at = 0; at < n; at += step) {
    const size_t m = std::min(step, n - at);
    const size_t offset = at * esize;
    fold(
        fn, op, dtype, piece, [&](int32_t q) { return source(q) + offset; }, m, [](size_t, size_t) {});
    add(out + offset, out + offset, piece, m);
  }
}

}  // namespace dparallel::dist::shm
