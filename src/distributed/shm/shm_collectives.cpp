// The shared-memory backend's collectives (the segment: shm_setup.cpp).
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
// Waiting: a barrier spins (up to 2 ms while the peers usually come within
// that, else 4 us: spin_budget.h), then sleeps on a futex on the shared
// arrival counter, waking at least every kSleepSlice to check the deadline,
// whether another rank gave up, and whether a peer's process is gone
// (pidfds, which also see a zombie as gone). A rank that shares its CPU with
// another rank (as each last arrived) sleeps at once: the other could not
// run while it spins; after kSharedWaitsBeforeMove such waits in a row the
// higher of the two moves to another CPU (move_off_shared_cpu). It never
// calls sched_yield: under EEVDF every call
// moves the caller's deadline a time slice later, so yielding beside a busy
// task hands that task whole slices (about 1.4 ms per 4 KiB all_reduce on
// the busy 2-core reference machine, bench/RESULTS.md).
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "distributed/background_calls.h"
#include "distributed/call_header.h"
#include "distributed/reduce_ops.h"
#include "distributed/shm/shm_backend.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dparallel::dist::shm {

namespace {

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");  // a hint to the core, not sched_yield
#else
  __asm__ __volatile__("" ::: "memory");
#endif
}

// True once the wrapping counter `value` has reached `target`.
bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000000) * 1000);
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// [begin, end) of `a` and `b` overlap.
bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

void ShmBackend::all_reduce(const Tensor& tensor, ReduceOp op) {
  const std::vector<Tensor> tensors{tensor};
  Pieces pieces(tensors);
  Call o = begin_call(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, &tensor);
  all_reduce_pieces(o, pieces, tensors, tensor.dtype(), op);
}

void ShmBackend::all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op) {
  if (tensors.size() == 1) return all_reduce(tensors[0], op);
  Pieces pieces(tensors);
  Call o = begin_call(CallKind::kAllReduce, tensors[0].dtype(),
                      static_cast<int64_t>(pieces.bytes() / tensors[0].element_size()), op, -1, &tensors[0]);
  o.pieces = tensors.size();
  all_reduce_pieces(o, pieces, tensors, tensors[0].dtype(), op);
}

void ShmBackend::broadcast(const Tensor& tensor, int32_t root) {
  const size_t nbytes = tensor.nbytes();
  auto* data = static_cast<uint8_t*>(tensor.data());
  Call o = begin_call(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, &tensor);
  // The root writes the whole set: every rank's slots are contiguous.
  const size_t block = layout_.slot * static_cast<size_t>(size());
  size_t offset = 0;
  do {
    const size_t len = std::min(block, nbytes - offset);
    if (rank() == root) copy_bytes(slot(0), data + offset, len);
    if (offset == 0) {
      exchange_headers(o);
    } else {
      arrive_and_wait(o);
    }
    if (rank() != root) copy_bytes(data + offset, slot(0), len);
    next_round();
    offset += len;
  } while (offset < nbytes);
}

void ShmBackend::all_gather(const Tensor& input, const std::vector<Tensor>& outputs) {
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
  // It may meet an all_gather_runs, which compares spots: a rank of that
  // call whose segment lies in a region stages it after the headers, and
  // every rank meets it there.
  publish_spot(RegionSpot{});
  size_t offset = 0;
  do {
    const size_t len = std::min(layout_.slot, nbytes - offset);
    copy_bytes(slot(rank()), in + offset, len);
    if (offset == 0) {
      exchange_headers(o);
      if (any_spot_published()) arrive_and_wait(o);
    } else {
      arrive_and_wait(o);
    }
    for (int32_t q = 0; q < size(); ++q) {
      auto* out = static_cast<uint8_t*>(outputs[static_cast<size_t>(q)].data());
      if (out + offset != in + offset) copy_bytes(out + offset, slot(q), len);
    }
    next_round();
    offset += len;
  } while (offset < nbytes);
}

namespace {

// Copies the bytes of `runs` that fall in the segment's window [at, at +
// len) between the runs' views and `window` (the window's first byte).
void copy_window(const std::vector<SegmentRun>& runs, size_t at, size_t len, uint8_t* window, bool into_window) {
  for (const SegmentRun& run : runs) {
    const size_t begin = std::max(at, run.offset);
    const size_t end = std::min(at + len, run.offset + run.view.nbytes());
    if (begin >= end) continue;
    auto* view = static_cast<uint8_t*>(run.view.data()) + (begin - run.offset);
    if (into_window) {
      copy_bytes(window + (begin - at), view, end - begin);
    } else {
      copy_bytes(view, window + (begin - at), end - begin);
    }
  }
}

// The bytes [at, at + len) of the part that `runs` make up, where one run
// holds them all; null where they are spread over runs or partly zeros.
const uint8_t* window_in_one_run(const std::vector<SegmentRun>& runs, size_t at, size_t len) {
  for (const SegmentRun& run : runs) {
    if (run.offset <= at && at + len <= run.offset + run.view.nbytes()) {
      return static_cast<const uint8_t*>(run.view.data()) + (at - run.offset);
    }
  }
  return nullptr;
}

// `window` = the bytes [at, at + len) of the part that `runs` (in order,
// not overlapping) make up, zeros where no run covers it.
void fill_window(const std::vector<SegmentRun>& runs, size_t at, size_t len, uint8_t* window) {
  size_t filled = at;
  for (const SegmentRun& run : runs) {
    const size_t begin = std::max(at, run.offset);
    const size_t end = std::min(at + len, run.offset + run.view.nbytes());
    if (begin >= end) continue;
    if (begin > filled) std::memset(window + (filled - at), 0, begin - filled);
    copy_bytes(window + (begin - at), static_cast<const uint8_t*>(run.view.data()) + (begin - run.offset), end - begin);
    filled = end;
  }
  if (at + len > filled) std::memset(window + (filled - at), 0, at + len - filled);
}

}  // namespace

void ShmBackend::all_gather_in_region(Call& o, size_t segment, const std::vector<std::vector<SegmentRun>>& places,
                                      const RegionSpot& spot) {
  for (int32_t q = 0; q < size(); ++q) {
    if (q != rank()) {
      copy_window(places[static_cast<size_t>(q)], 0, segment, region_part(spot.region, q) + spot.offset, false);
    }
  }
  // Nobody changes its segment while another still reads it.
  arrive_and_wait(o);
  next_round();
  ++calls_in_regions_;
}

size_t ShmBackend::scatter_piece_elements(size_t esize) const {
  const size_t align = std::max<size_t>(1, kLine / esize);
  return std::max(align, layout_.slot / static_cast<size_t>(size()) / esize / align * align);
}

void ShmBackend::reduce_scatter_runs(const std::vector<std::vector<SegmentRun>>& parts, const Tensor& output,
                                     ReduceOp op, bool accumulate) {
  const size_t esize = output.element_size();
  const auto n = static_cast<size_t>(output.numel());
  const auto ranks = static_cast<size_t>(size());
  auto* out = static_cast<uint8_t*>(output.data());
  ReduceFn fn = reduce_function(output.dtype(), op);
  Call o = begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
  // As reduce_scatter. This rank's own piece is read where it is when one
  // run holds it, else it goes in its slot too.
  const size_t piece_elems = scatter_piece_elements(esize);
  const size_t piece = piece_elems * esize;
  const auto me = static_cast<size_t>(rank());
  size_t start = 0;
  do {
    const size_t count = std::min(piece_elems, n - start);
    const size_t len = count * esize, offset = start * esize;
    uint8_t* mine = slot(rank());
    const uint8_t* own = window_in_one_run(parts[me], offset, len);
    for (size_t q = 0; q < ranks; ++q) {
      if (q != me || own == nullptr) fill_window(parts[q], offset, len, mine + q * piece);
    }
    if (own == nullptr) own = mine + me * piece;
    if (start == 0) {
      exchange_headers(o);
    } else {
      arrive_and_wait(o);
    }
    const size_t my_piece = me * piece;
    auto source = [&](int32_t q) { return q == rank() ? own : slot(q) + my_piece; };
    if (accumulate) {
      fold_into(fn, op, output.dtype(), out + offset, source, count);
    } else {
      fold(fn, op, output.dtype(), out + offset, source, count, [](size_t, size_t) {});
    }
    next_round();
    start += count;
  } while (start < n);
}

void ShmBackend::all_gather_runs(size_t segment, const std::vector<SegmentRun>& sources,
                                 const std::vector<std::vector<SegmentRun>>& places) {
  const Tensor* described = sources.empty() ? nullptr : &sources.front().view;
  Call o =
      begin_call(CallKind::kAllGather, DType::kUInt8, static_cast<int64_t>(segment), ReduceOp::kSum, -1, described);
  // A segment laid out in a region as it is sent (a dp_fsdp's shards):
  // where every rank's is at the same spot, the others read it there.
  const RegionSpot spot = segment_spot(sources);
  publish_spot(spot);
  size_t offset = 0;
  do {
    const size_t len = std::min(layout_.slot, segment - offset);
    if (offset > 0 || spot.region == 0) copy_window(sources, offset, len, slot(rank()), true);
    if (offset > 0) {
      arrive_and_wait(o);
    } else {
      exchange_headers(o);
      if (any_spot_published()) {
        if (same_spot_everywhere()) return all_gather_in_region(o, segment, places, spot);
        // Some rank's segment lies elsewhere: every rank meets the staging.
        if (spot.region != 0) copy_window(sources, offset, len, slot(rank()), true);
        arrive_and_wait(o);
      }
    }
    for (int32_t q = 0; q < size(); ++q) copy_window(places[static_cast<size_t>(q)], offset, len, slot(q), false);
    next_round();
    offset += len;
  } while (offset < segment);
}

void ShmBackend::reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) {
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
        copy_bytes(copied.data() + p * nbytes, in[p], nbytes);
        in[p] = copied.data() + p * nbytes;
      }
      break;
    }
  }
  const bool in_place_late = in[static_cast<size_t>(rank())] == out && rank() >= 2;
  Call o = begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
  const size_t piece_elems = scatter_piece_elements(esize);
  const size_t piece = piece_elems * esize;
  size_t start = 0;
  do {
    const size_t count = std::min(piece_elems, n - start);
    const size_t len = count * esize, offset = start * esize;
    uint8_t* mine = slot(rank());
    for (size_t q = 0; q < ranks; ++q) {
      if (q != static_cast<size_t>(rank())) copy_bytes(mine + q * piece, in[q] + offset, len);
    }
    if (start == 0) {
      exchange_headers(o);
    } else {
      arrive_and_wait(o);
    }
    const size_t my_piece = static_cast<size_t>(rank()) * piece;
    // Folded straight into the output, unless the output is this rank's
    // own input and the fold would write it before reading it (rank >= 2).
    uint8_t* result = in_place_late ? mine + my_piece : out + offset;
    fold(
        fn, op, output.dtype(), result,
        [&](int32_t q) { return q == rank() ? in[static_cast<size_t>(q)] + offset : slot(q) + my_piece; }, count,
        [&](size_t at, size_t bytes) {
          if (in_place_late) std::memcpy(out + offset + at, result + at, bytes);
        });
    next_round();
    start += count;
  } while (start < n);
}

void ShmBackend::barrier() {
  Call o = begin_call(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr);
  exchange_headers(o);
  next_round();
}

void ShmBackend::all_reduce_pieces(Call& o, const Pieces& pieces, const std::vector<Tensor>& tensors, DType dtype,
                                   ReduceOp op) {
  const size_t esize = dtype_size(dtype);
  const size_t nbytes = pieces.bytes();
  const size_t n = nbytes / esize;
  ReduceFn fn = reduce_function(dtype, op);
  const bool small = nbytes <= std::min(kSmallAllReduceBytes, layout_.slot);
  // Tensors in a region: where every rank's are placed alike, the call
  // reads the others' memory where it is (shm_regions.cpp). Small payloads
  // gain nothing there and skip the lookup.
  const RegionPlacement placement = small ? RegionPlacement{} : placement_of(tensors);
  const RegionSpot spot = placement.spot;
  publish_spot(spot);
  if (small) {
    pieces.copy_out(slot(rank()), 0, nbytes);
    exchange_headers(o);
    pieces.each(0, nbytes, [&](uint8_t* data, size_t at, size_t len) {
      fold(
          fn, op, dtype, data, [&](int32_t q) { return slot(q) + at; }, len / esize, [](size_t, size_t) {});
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
    auto stage = [&] {
      pieces.copy_out(mine, in, my_begin);
      pieces.copy_out(mine + my_end, in + my_end, count * esize - my_end);
    };
    if (start > 0) {
      stage();
      arrive_and_wait(o);
    } else {
      // A rank whose tensor is in a region stages only when some rank's
      // tensor lies elsewhere, after the headers; every rank then meets it.
      if (spot.region == 0) stage();
      exchange_headers(o);
      if (any_spot_published()) {
        if (same_spot_everywhere()) return all_reduce_in_region(o, placement, dtype, op);
        if (spot.region != 0) stage();
        arrive_and_wait(o);
      }
    }
    pieces.each(in + my_begin, in + my_end, [&](uint8_t* data, size_t at, size_t len) {
      uint8_t* result = mine + (at - in);
      // Each reduced piece goes back into this rank's input while in cache.
      fold(
          fn, op, dtype, result, [&](int32_t q) { return q == rank() ? data : slot(q) + (at - in); }, len / esize,
          [&](size_t offset, size_t bytes) { std::memcpy(data + offset, result + offset, bytes); });
    });
    arrive_and_wait(o);
    for (int32_t q = 0; q < size(); ++q) {
      if (q != rank()) pieces.copy_in(in + part_begin(q), slot(q) + part_begin(q), part_end(q) - part_begin(q));
    }
    next_round();
  }
}

void ShmBackend::arrive_and_wait(Call& o) {
  if (size() == 1) return;
  ++barriers_;
  const uint32_t target = barriers_ * static_cast<uint32_t>(size());
  auto& arrivals = control()->arrivals;
  publish_cpu();
  if (arrivals.fetch_add(1) + 1 == target) {
    if (control()->sleepers.load() != 0) futex_wake(&arrivals);
    return;
  }
  const auto start = Clock::now();
  // A background wait nobody awaits says nothing about how long a spin
  // would bridge (its peer computes meanwhile): not recorded.
  const bool background_unawaited = !BackgroundCalls::may_spin();
  auto arrived = [&] {
    if (!reached(arrivals.load(std::memory_order_acquire), target)) return false;
    if (!background_unawaited) spin_budget_.record(Clock::now() - start);
    return true;
  };
  const int32_t beside = rank_sharing_cpu();
  if (beside < 0) {
    shared_waits_ = 0;
  } else if (++shared_waits_ >= kSharedWaitsBeforeMove && beside < rank()) {
    shared_waits_ = 0;
    move_off_shared_cpu();
  }
  auto spin_for = [&](Clock::duration spin) {
    const auto from = Clock::now();
    for (uint32_t i = 1; spin > Clock::duration::zero(); ++i) {
      if (arrived()) return true;
      cpu_relax();
      if (i % 64 == 0 && Clock::now() - from >= spin) break;
    }
    return false;
  };
  // A background wait that no thread awaits sleeps (background_calls.h),
  // looking every kAwaitPoll whether one does, to spin from then on.
  bool unawaited = beside < 0 && background_unawaited;
  if (spin_for(beside >= 0 || unawaited ? Clock::duration::zero() : spin_budget_.budget())) return;
  for (;;) {
    // A peer may arrive and exit at once: its arrival counts, so it is
    // checked first, and again when a peer is seen gone.
    if (arrived()) return;
    check_peers(o, [&] { return reached(arrivals.load(std::memory_order_acquire), target); });
    if (arrived()) return;
    // Unawaited, it wakes on its own timer, not the last arrival's wake-up,
    // which would run it on that rank's CPU, beside that rank's host.
    if (!unawaited) control()->sleepers.fetch_add(1);
    uint32_t seen = arrivals.load();
    const std::chrono::microseconds slice = unawaited ? kAwaitPoll : kSleepSlice;
    const std::chrono::microseconds left = left_until(o.deadline);
    if (!reached(seen, target)) futex_wait(&arrivals, seen, std::min(slice, left));
    if (!unawaited) control()->sleepers.fetch_sub(1);
    if (arrived()) return;
    if (unawaited && BackgroundCalls::may_spin()) {
      unawaited = false;
      if (spin_for(spin_budget_.budget())) return;
    }
  }
}

void ShmBackend::publish_cpu() {
  const int cpu = sched_getcpu();
  // Written only when it changes: the others read the words at every wait.
  if (cpu >= 0 && cpu + 1 != published_cpu_) {
    published_cpu_ = cpu + 1;
    cpu_word(rank())->store(published_cpu_, std::memory_order_relaxed);
  }
}

int32_t ShmBackend::rank_sharing_cpu() const {
  if (published_cpu_ == 0) return -1;
  for (int32_t r = 0; r < size(); ++r) {
    if (r != rank() && cpu_word(r)->load(std::memory_order_relaxed) == published_cpu_) return r;
  }
  return -1;
}

void ShmBackend::move_off_shared_cpu() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  // With fewer CPUs than ranks some must share; moving would only churn.
  if (CPU_COUNT(&allowed) < size()) return;
  cpu_set_t others = allowed;
  CPU_CLR(published_cpu_ - 1, &others);
  if (sched_setaffinity(0, sizeof others, &others) != 0) return;
  // Restored at once (the thread has moved by now), so it stays free to run
  // anywhere it could. Should its cpuset change in between so that this
  // fails, the thread keeps the mask without that one CPU.
  sched_setaffinity(0, sizeof allowed, &allowed);
}

template <typename Arrived>
void ShmBackend::check_peers(Call& o, Arrived&& arrived) {
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

void ShmBackend::give_up(const Call& o, bool timed_out, const std::string& cause) {
  tell_peers_this_rank_gave_up();
  fail_call(o, timed_out ? StatusCode::kTimeout : StatusCode::kRemote, "shm: " + cause);
}

}  // namespace dparallel::dist::shm
