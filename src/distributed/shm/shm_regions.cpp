// The shared-memory backend's regions: memory past the segment's own bytes
// in its file, every rank's part of a region mapped by every rank, so that
// an all_reduce of a tensor inside one reads the other ranks' values where
// they are (no staging copies through the slots).
//
// create_region is a collective: rank 0 picks a free entry of the control
// block's region table and reserves the file range (a released region's,
// where it fits), every rank maps it, and every rank learns whether all
// did. A region's memory goes back to the system once the last rank
// unmaps it; its entry is free again then.
//
// all_reduce on a tensor in a region: each rank publishes where its tensor
// lies (RegionSpot) before the header exchange; when every rank's tensor
// lies at the same spot of the same region, each rank folds its part of
// the tensor, in rank order, from every rank's memory into its own and
// writes each reduced piece into every other rank's memory while it is in
// cache. A last barrier keeps a rank from returning (and changing its
// tensor) while another still reads or writes it. Otherwise the call takes
// the slots' path (shm_collectives.cpp). A coalesced all_reduce of tensors
// in one region (a dp_ddp's gradients there) takes the same path when every
// rank's lie at the same places, whatever their order: it reduces the
// concatenation of their runs.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>

#include "core/allocator.h"
#include "core/error.h"
#include "core/process_origin.h"
#include "distributed/reduce_ops.h"
#include "distributed/shm/shm_backend.h"

namespace dparallel::dist::shm {

namespace {

// Region parts start on pages of their own.
constexpr size_t kRegionAlign = 4096;

// The region table's lock, across processes. Its holders do no system
// calls; a holder that died inside is outwaited, so a wait is bounded.
class TableLock {
 public:
  explicit TableLock(Control* control) : word_(control->regions_lock) {
    for (int spins = 0; word_.exchange(1, std::memory_order_acquire) != 0; ++spins) {
      if (spins > 1000000) {
        locked_ = false;
        return;
      }
      std::this_thread::yield();
    }
  }
  ~TableLock() {
    if (locked_) word_.store(0, std::memory_order_release);
  }
  TableLock(const TableLock&) = delete;
  TableLock& operator=(const TableLock&) = delete;
  bool locked() const { return locked_; }

 private:
  std::atomic<uint32_t>& word_;
  bool locked_ = true;
};

}  // namespace

struct RegionRegistry {
  struct Mapped {
    uint64_t file_offset = 0;  // the region's
    size_t part = 0;           // bytes per rank
    uint8_t* base = nullptr;   // rank 0's part; rank r's is base + r * part
  };
  std::mutex mutex;
  std::map<uint8_t*, Mapped> by_own_part;  // keyed by this rank's part
};

namespace {

// Drops one rank's hold on region entry `index`; the last rank's drop gives
// the memory back, then the entry.
void drop_region_hold(ShmSegment& segment, size_t index, uint64_t file_offset, size_t bytes) {
  auto* control = reinterpret_cast<Control*>(segment.data());
  RegionEntry& entry = control->regions[index];
  if (entry.mapped.fetch_sub(1) != 1) return;
  const bool released = segment.release(file_offset, bytes);
  TableLock lock(control);
  // Memory that could not be released keeps its entry, so that it is not
  // reserved twice.
  if (lock.locked() && released) entry.used = 0;
}

class ShmRegion : public SharedRegion {
 public:
  ShmRegion(std::shared_ptr<ShmSegment> segment, std::shared_ptr<RegionRegistry> regions, size_t entry,
            uint64_t file_offset, size_t part, uint8_t* base, int32_t rank, int32_t world, Device device)
      : segment_(std::move(segment)),
        regions_(std::move(regions)),
        entry_(entry),
        file_offset_(file_offset),
        part_(part),
        base_(base),
        rank_(rank),
        world_(world),
        device_(device) {
    // This rank's part is memory its tensors hold, as if allocated.
    if (base_ != nullptr) count_outside_memory(device_, part_);
  }
  ~ShmRegion() override {
    if (!origin_.is_current()) {
      // A forked child's copy (its tensors outlived the fork): the table
      // and the counts are the parent's, and so is the memory. Only the
      // child's mapping goes.
      if (base_ != nullptr) ::munmap(base_, part_ * static_cast<size_t>(world_));
      return;
    }
    if (base_ != nullptr) {
      uncount_outside_memory(device_, part_);
      {
        std::lock_guard<std::mutex> lock(regions_->mutex);
        regions_->by_own_part.erase(own_part());
      }
      ::munmap(base_, part_ * static_cast<size_t>(world_));
    }
    drop_region_hold(*segment_, entry_, file_offset_, part_ * static_cast<size_t>(world_));
  }
  uint8_t* data() const override { return own_part(); }
  size_t bytes() const override { return part_; }
  uint8_t* all_parts() const override { return base_; }

 private:
  uint8_t* own_part() const { return base_ == nullptr ? nullptr : base_ + part_ * static_cast<size_t>(rank_); }

  std::shared_ptr<ShmSegment> segment_;
  std::shared_ptr<RegionRegistry> regions_;
  size_t entry_;
  uint64_t file_offset_;
  size_t part_;
  uint8_t* base_;
  int32_t rank_, world_;
  Device device_;
  ProcessOrigin origin_;
};

}  // namespace

std::shared_ptr<SharedRegion> ShmBackend::create_region(size_t bytes) {
  if (regions_ == nullptr) regions_ = std::make_shared<RegionRegistry>();
  const size_t part = align_up(bytes, kRegionAlign);
  const size_t total = part * static_cast<size_t>(size());
  // The header's numel: every rank must ask for the same size.
  Call o = begin_call(CallKind::kBarrier, DType::kUInt8, static_cast<int64_t>(bytes), ReduceOp::kSum, -1, nullptr);
  exchange_headers(o);
  Control* c = control();
  if (rank() == 0) {
    c->region_failures.store(0);
    c->region_choice = -1;
    std::string error;
    TableLock lock(c);
    if (!lock.locked()) {
      error = "the region table stayed locked (a rank died while it changed it)";
    } else {
      // Past the segment's own bytes and every region in use; a free entry
      // whose released range is large enough is taken again.
      uint64_t end = align_up(layout_.total, kRegionAlign);
      int32_t reuse = -1, fresh = -1;
      for (size_t i = 0; i < kMaxRegions; ++i) {
        const RegionEntry& e = c->regions[i];
        if (e.bytes > 0) end = std::max<uint64_t>(end, e.offset + e.bytes);
        if (e.used != 0) continue;
        if (e.bytes >= total && reuse < 0) reuse = static_cast<int32_t>(i);
        if (e.bytes == 0 && fresh < 0) fresh = static_cast<int32_t>(i);
      }
      int32_t chosen = reuse >= 0 ? reuse : fresh;
      if (chosen < 0) {
        error = str_cat("all ", kMaxRegions, " region entries are in use");
      } else {
        RegionEntry& e = c->regions[chosen];
        const uint64_t offset = reuse >= 0 ? e.offset : end;
        try {
          segment_->reserve(offset, total);
          e.offset = offset;
          e.bytes = std::max<uint64_t>(e.bytes, total);
          e.used = 1;
          e.mapped.store(static_cast<uint32_t>(size()));
          c->region_choice = chosen;
        } catch (const Error& err) {
          error = err.what();
        }
      }
    }
    std::snprintf(c->region_error, sizeof(c->region_error), "%s", error.c_str());
  }
  arrive_and_wait(o);
  const int32_t chosen = c->region_choice;
  if (chosen < 0) {
    next_round();  // first: building the message may throw
    fail(StatusCode::kOutOfMemory, "no shared-memory region of ", bytes,
         " bytes per rank: ", std::string(c->region_error, strnlen(c->region_error, sizeof(c->region_error))));
  }
  const RegionEntry& entry = c->regions[chosen];
  const uint64_t offset = entry.offset;
  uint8_t* base = nullptr;
  try {
    base = segment_->map_range(offset, total);
  } catch (...) {  // its Error, or the bad_alloc of building one
    c->region_failures.fetch_add(1);
  }
  // All this rank could still fail on comes before the last arrival, so
  // that every rank gives the same answer (and all go to the next round).
  std::shared_ptr<ShmRegion> region;
  try {
    // Holds this rank's count in the entry from here on, mapped or not.
    region = std::make_shared<ShmRegion>(segment_, regions_, static_cast<size_t>(chosen), offset, part, base, rank(),
                                         size(), device());
    if (base != nullptr) {
      std::lock_guard<std::mutex> lock(regions_->mutex);
      regions_->by_own_part[region->data()] = RegionRegistry::Mapped{offset, part, base};
    }
  } catch (const std::exception&) {
    c->region_failures.fetch_add(1);
  }
  // Where nothing holds this rank's count, it goes however this ends (a
  // peer gone at the last arrival included).
  struct DropUnheld {
    ShmSegment* segment;  // null: the region object holds it
    uint8_t* base;
    size_t entry, total;
    uint64_t offset;
    ~DropUnheld() {
      if (segment == nullptr) return;
      if (base != nullptr) ::munmap(base, total);
      drop_region_hold(*segment, entry, offset, total);
    }
  } drop_unheld{region == nullptr ? segment_.get() : nullptr, base, static_cast<size_t>(chosen), total, offset};
  arrive_and_wait(o);
  const uint32_t failures = c->region_failures.load();
  next_round();
  if (failures != 0) {
    // Every rank drops it alike; the last one releases the memory.
    region.reset();
    fail(StatusCode::kOutOfMemory, "no shared-memory region of ", bytes, " bytes per rank: ", failures,
         " rank(s) could not map it or keep track of it");
  }
  return region;
}

RegionSpot ShmBackend::spot_of(const Tensor& t) const {
  if (regions_ == nullptr || t.nbytes() == 0) return {};
  auto* p = static_cast<uint8_t*>(t.data());
  std::lock_guard<std::mutex> lock(regions_->mutex);
  auto it = regions_->by_own_part.upper_bound(p);
  if (it == regions_->by_own_part.begin()) return {};
  --it;
  const size_t at = static_cast<size_t>(p - it->first);
  if (at + t.nbytes() > it->second.part) return {};
  return RegionSpot{it->second.file_offset, at};
}

bool ShmBackend::same_spot_everywhere() const {
  const RegionSpot mine = *spot_word(rank());
  if (mine.region == 0) return false;
  for (int32_t r = 0; r < size(); ++r) {
    if (!(*spot_word(r) == mine)) return false;
  }
  return true;
}

bool ShmBackend::any_spot_published() const {
  for (int32_t r = 0; r < size(); ++r) {
    if (spot_word(r)->region != 0) return true;
  }
  return false;
}

RegionPlacement ShmBackend::placement_of(const std::vector<Tensor>& tensors) const {
  RegionPlacement placement;
  if (tensors.size() == 1) {
    placement.spot = spot_of(tensors[0]);
    if (placement.spot.region != 0) placement.runs.emplace_back(placement.spot.offset, tensors[0].nbytes());
    return placement;
  }
  uint64_t region = 0;
  uint64_t fingerprint = 14695981039346656037ull;  // FNV-1a over the runs
  auto mix = [&](uint64_t v) {
    for (int byte = 0; byte < 8; ++byte) {
      fingerprint = (fingerprint ^ ((v >> (8 * byte)) & 0xff)) * 1099511628211ull;
    }
  };
  for (const Tensor& t : tensors) {
    if (t.nbytes() == 0) continue;
    const RegionSpot spot = spot_of(t);
    if (spot.region == 0 || (region != 0 && spot.region != region)) return {};
    region = spot.region;
    placement.runs.emplace_back(spot.offset, t.nbytes());
    mix(spot.offset);
    mix(t.nbytes());
  }
  if (region == 0) return {};
  // Overlapping tensors would be written by one rank while another reads
  // them: the slots' path copies them apart.
  std::vector<std::pair<size_t, size_t>> sorted = placement.runs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 1; k < sorted.size(); ++k) {
    if (sorted[k - 1].first + sorted[k - 1].second > sorted[k].first) return {};
  }
  placement.spot = RegionSpot{region, fingerprint | (uint64_t{1} << 63)};
  return placement;
}

RegionSpot ShmBackend::segment_spot(const std::vector<SegmentRun>& sources) const {
  RegionSpot spot;
  for (const SegmentRun& run : sources) {
    if (run.view.nbytes() == 0) continue;
    const RegionSpot at = spot_of(run.view);
    if (at.region == 0 || at.offset < run.offset) return {};
    const RegionSpot start{at.region, at.offset - run.offset};
    if (spot.region != 0 && !(start == spot)) return {};
    spot = start;
  }
  return spot;
}

uint8_t* ShmBackend::region_part(uint64_t region, int32_t q) const {
  std::lock_guard<std::mutex> lock(regions_->mutex);
  for (const auto& [own, m] : regions_->by_own_part) {
    if (m.file_offset == region) return m.base + m.part * static_cast<size_t>(q);
  }
  fail(StatusCode::kInternal, "no mapped region at ", region);
}

void ShmBackend::detach_own_part(uint64_t region) noexcept {
  uint8_t* own = nullptr;
  size_t part = 0;
  std::lock_guard<std::mutex> lock(regions_->mutex);
  auto it = std::find_if(regions_->by_own_part.begin(), regions_->by_own_part.end(),
                         [&](const auto& entry) { return entry.second.file_offset == region; });
  if (it == regions_->by_own_part.end()) return;
  own = it->first;
  part = it->second.part;
  std::unique_ptr<uint8_t[]> kept(new (std::nothrow) uint8_t[part]);
  if (kept == nullptr) return;  // no memory for a copy: the part stays shared
  std::memcpy(kept.get(), own, part);
  // Parts start on pages of their own: only this rank's pages change.
  if (::mmap(own, part, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) return;
  std::memcpy(own, kept.get(), part);
  regions_->by_own_part.erase(it);
}

namespace {

// DP_TEST_SHM_STALL="rank:ms" (tests only): that rank stalls just before
// its part of a region all-reduce, as a stopped peer would.
void stall_for_tests(int32_t rank) {
  const char* text = std::getenv("DP_TEST_SHM_STALL");
  int stalled = -1;
  int ms = 0;
  if (text == nullptr || std::sscanf(text, "%d:%d", &stalled, &ms) != 2 || stalled != rank || ms <= 0) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace

void ShmBackend::all_reduce_in_region(Call& o, const RegionPlacement& placement, DType dtype, ReduceOp op) {
  try {
    reduce_in_region(o, placement, dtype, op);
  } catch (...) {
    detach_own_part(placement.spot.region);
    throw;
  }
  ++calls_in_regions_;
}

void ShmBackend::reduce_in_region(Call& o, const RegionPlacement& placement, DType dtype, ReduceOp op) {
  stall_for_tests(rank());
  std::vector<uint8_t*> parts(static_cast<size_t>(size()));
  for (int32_t q = 0; q < size(); ++q) parts[static_cast<size_t>(q)] = region_part(placement.spot.region, q);
  auto base = [&](int32_t q) { return parts[static_cast<size_t>(q)]; };
  const size_t esize = dtype_size(dtype);
  size_t total = 0;
  for (const auto& run : placement.runs) total += run.second;
  const size_t n = total / esize;
  const auto ranks = static_cast<size_t>(size());
  const size_t align = std::max<size_t>(1, kLine / esize);
  const size_t part = align_up((n + ranks - 1) / ranks, align);
  const size_t my_begin = std::min(n, part * static_cast<size_t>(rank())) * esize;
  const size_t my_end = std::min(n, part * static_cast<size_t>(rank() + 1)) * esize;
  ReduceFn fn = reduce_function(dtype, op);
  // Each reduced piece goes to every other rank's copy at once, from cache:
  // nobody reads this rank's part but this rank, so nothing waits between.
  auto push = [&](size_t at, const uint8_t* piece, size_t bytes) {
    for (int32_t q = 0; q < size(); ++q) {
      if (q != rank()) std::memcpy(base(q) + at, piece, bytes);
    }
  };
  // This rank's part of the runs' concatenation, run by run.
  size_t logical = 0;
  for (const auto& [offset, bytes] : placement.runs) {
    const size_t from = std::max(logical, my_begin), to = std::min(logical + bytes, my_end);
    logical += bytes;
    if (from >= to) continue;
    const size_t at = offset + (from - (logical - bytes));  // into each rank's part
    const size_t len = to - from;
    uint8_t* mine = base(rank()) + at;
    if (rank() < 2) {
      // In place: the fold reads this rank's own value at an element before
      // it writes there.
      fold(
          fn, op, dtype, mine, [&](int32_t q) { return base(q) + at; }, len / esize,
          [&](size_t done, size_t piece) { push(at + done, mine + done, piece); });
      continue;
    }
    // The fold writes sources 0 and 1's sum first: through this rank's slot.
    uint8_t* scratch = slot(rank());
    for (size_t done = 0; done < len; done += layout_.slot) {
      const size_t chunk = std::min(layout_.slot, len - done);
      fold(
          fn, op, dtype, scratch, [&](int32_t q) { return base(q) + at + done; }, chunk / esize,
          [&](size_t within, size_t piece) {
            std::memcpy(mine + done + within, scratch + within, piece);
            push(at + done + within, scratch + within, piece);
          });
    }
  }
  // Every part is everywhere once every rank has pushed its own.
  arrive_and_wait(o);
  next_round();
}

}  // namespace dparallel::dist::shm
