// The shared-memory group with its ranks as threads of this process (one
// file store): all_reduce_coalesced reads and writes the pieces in place,
// as one all_reduce of their concatenation, across rounds and parts.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "distributed/background_calls.h"
#include "distributed/process_group.h"
#include "distributed/shm/shm_backend.h"
#include "distributed/shm/shm_process_group.h"
#include "distributed/store/file_store.h"
#include "distributed/store/tcp_store.h"

namespace dparallel::dist {
namespace {

// Runs body(group) on `world` ranks, each a thread with its own group.
void run_ranks(int32_t world, const std::function<void(ProcessGroup&)>& body, Millis timeout = Millis(60000)) {
  char dir_template[] = "/tmp/dp_shm_group_XXXXXX";
  std::string dir = ::mkdtemp(dir_template);
  std::string path = dir + "/store";
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ProcessGroupOptions options;
        options.rank = r;
        options.world_size = world;
        options.store = std::make_shared<FileStore>(path, world);
        options.timeout = timeout;
        auto group = create_process_group(options);
        EXPECT_STREQ(group->backend_name(), "shm");
        body(*group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

float value(int32_t rank, size_t i) { return static_cast<float>(rank + 1) + static_cast<float>(i % 5); }

// Pieces of these sizes (elements): empty ones, small ones, and ones that
// cross the 1 MiB rounds and the ranks' parts of a round.
const std::vector<int64_t> kSizes = {3, 0, 100000, 1, 262144, 77777, 0, 400001, 5};

std::vector<Tensor> pieces(int32_t rank) {
  std::vector<Tensor> tensors;
  size_t at = 0;
  for (int64_t n : kSizes) {
    Tensor t = Tensor::empty(DType::kFloat32, {n}, Device{DeviceType::kCpu, 0});
    auto* p = static_cast<float*>(t.data());
    for (int64_t i = 0; i < n; ++i) p[i] = value(rank, at + static_cast<size_t>(i));
    at += static_cast<size_t>(n);
    tensors.push_back(t);
  }
  return tensors;
}

void expect_sums(const std::vector<Tensor>& tensors, int32_t world, bool average) {
  size_t at = 0;
  for (const Tensor& t : tensors) {
    const auto* p = static_cast<const float*>(t.data());
    for (int64_t i = 0; i < t.numel(); ++i, ++at) {
      float want = 0;
      for (int32_t r = 0; r < world; ++r) want += value(r, at);
      if (average) want /= static_cast<float>(world);
      if (p[i] != want) {
        ADD_FAILURE() << "element " << at << ": got " << p[i] << ", want " << want;
        return;
      }
    }
  }
}

class ShmGroup : public ::testing::TestWithParam<int32_t> {};

TEST_P(ShmGroup, AllReduceCoalescedReducesThePiecesInPlaceAsOneTensor) {
  const int32_t world = GetParam();
  run_ranks(world, [&](ProcessGroup& group) {
    auto tensors = pieces(group.rank());
    std::vector<const void*> where;
    for (const Tensor& t : tensors) where.push_back(t.data());
    group.all_reduce_coalesced(tensors, ReduceOp::kSum, false);
    expect_sums(tensors, world, false);
    for (size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(tensors[i].data(), where[i]);
    auto averaged = pieces(group.rank());
    group.all_reduce_coalesced(averaged, ReduceOp::kAvg, true)->wait();
    expect_sums(averaged, world, true);
  });
}

// One rank's coalesced call meets the others' all_reduce of the concatenation.
TEST_P(ShmGroup, AllReduceCoalescedMatchesAnAllReduceOfTheConcatenation) {
  const int32_t world = GetParam();
  run_ranks(world, [&](ProcessGroup& group) {
    auto tensors = pieces(group.rank());
    if (group.rank() == 0) {
      group.all_reduce_coalesced(tensors, ReduceOp::kSum, false);
    } else {
      int64_t total = 0;
      for (int64_t n : kSizes) total += n;
      Tensor flat = Tensor::empty(DType::kFloat32, {total}, Device{DeviceType::kCpu, 0});
      size_t at = 0;
      for (const Tensor& t : tensors) {
        if (t.nbytes() > 0) std::memcpy(static_cast<uint8_t*>(flat.data()) + at, t.data(), t.nbytes());
        at += t.nbytes();
      }
      group.all_reduce(flat, ReduceOp::kSum, false);
      at = 0;
      for (const Tensor& t : tensors) {
        if (t.nbytes() > 0) std::memcpy(t.data(), static_cast<uint8_t*>(flat.data()) + at, t.nbytes());
        at += t.nbytes();
      }
    }
    expect_sums(tensors, world, false);
    // Another total on one rank is the same verdict as for all_reduce.
    if (world == 1) return;
    auto fewer = pieces(group.rank());
    if (group.rank() == world - 1) fewer.pop_back();
    try {
      group.all_reduce_coalesced(fewer, ReduceOp::kSum, false);
      ADD_FAILURE() << "totals that differ passed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("differ across ranks"), std::string::npos) << e.what();
    }
  });
}

uint64_t calls_in_regions(const ProcessGroup& group) {
  return dynamic_cast<const shm::ShmBackend&>(group.backend()).calls_in_regions();
}

// A float tensor of n elements at `offset` bytes into this rank's part of `region`.
Tensor in_region(const std::shared_ptr<SharedRegion>& region, size_t offset, int64_t n) {
  auto storage = Storage::wrap(Device{DeviceType::kCpu, 0}, region->data(), region->bytes(), [region](void*) {});
  return Tensor::wrap(storage, offset, DType::kFloat32, {n});
}

void fill(const Tensor& t, int32_t rank) {
  auto* p = static_cast<float*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value(rank, static_cast<size_t>(i));
}

void expect_reduced(const Tensor& t, int32_t world, bool average) {
  const auto* p = static_cast<const float*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) {
    float want = 0;
    for (int32_t r = 0; r < world; ++r) want += value(r, static_cast<size_t>(i));
    if (average) want /= static_cast<float>(world);
    if (p[i] != want) {
      ADD_FAILURE() << "element " << i << " of " << t.numel() << ": got " << p[i] << ", want " << want;
      return;
    }
  }
}

// 700001 floats: more than a slot (1 MiB) per rank part, and parts that do
// not divide evenly.
constexpr int64_t kRegionElements = 700001;

TEST_P(ShmGroup, AllReduceInARegionReadsTheOtherRanksMemoryWhereItIs) {
  const int32_t world = GetParam();
  run_ranks(world, [&](ProcessGroup& group) {
    auto region = group.create_region(4 << 20);
    ASSERT_NE(region, nullptr);
    EXPECT_GE(region->bytes(), size_t{4} << 20);
    Tensor t = in_region(region, 4096, kRegionElements);
    fill(t, group.rank());
    group.all_reduce(t, ReduceOp::kSum, false);
    expect_reduced(t, world, false);
    fill(t, group.rank());
    group.all_reduce(t, ReduceOp::kAvg, false);
    expect_reduced(t, world, true);
    EXPECT_EQ(calls_in_regions(group), 2u);
    // Small tensors take the slots: nothing to gain there.
    Tensor small = in_region(region, 0, 100);
    fill(small, group.rank());
    group.all_reduce(small, ReduceOp::kSum, false);
    expect_reduced(small, world, false);
    EXPECT_EQ(calls_in_regions(group), 2u);
  });
}

// A coalesced all_reduce of tensors in a region (a dp_ddp's gradients
// there), lying alike on every rank, reads and writes them in place, in
// whatever order they are named and with gaps between them; where one
// rank's lie elsewhere, every rank takes the slots, with the same result.
TEST_P(ShmGroup, CoalescedAllReduceOfTensorsInARegionReducesThemInPlace) {
  const int32_t world = GetParam();
  run_ranks(world, [&](ProcessGroup& group) {
    auto region = group.create_region(4 << 20);
    ASSERT_NE(region, nullptr);
    const int64_t third = kRegionElements / 3;
    Tensor span = in_region(region, 4096, 3 * third);
    auto piece = [&](int64_t k) { return span.view_at(static_cast<size_t>(k * third) * 4, DType::kFloat32, {third}); };
    fill(span, group.rank());
    group.all_reduce_coalesced({piece(1), piece(2), piece(0)}, ReduceOp::kAvg, false);
    expect_reduced(span, world, true);
    EXPECT_EQ(calls_in_regions(group), 1u);
    std::vector<Tensor> apart{piece(2), piece(0)};
    for (const Tensor& t : apart) fill(t, group.rank());
    group.all_reduce_coalesced(apart, ReduceOp::kSum, false);
    for (const Tensor& t : apart) expect_reduced(t, world, false);
    EXPECT_EQ(calls_in_regions(group), 2u);
    if (world == 1) return;
    Tensor privately = Tensor::empty(DType::kFloat32, {third}, Device{DeviceType::kCpu, 0});
    std::vector<Tensor> mixed{piece(2), group.rank() == world - 1 ? privately : piece(0)};
    for (const Tensor& t : mixed) fill(t, group.rank());
    group.all_reduce_coalesced(mixed, ReduceOp::kSum, false);
    for (const Tensor& t : mixed) expect_reduced(t, world, false);
    EXPECT_EQ(calls_in_regions(group), 2u);
  });
}

// An all_gather_runs whose sources lie in a region as they lie in the
// segment (a dp_fsdp's shards there), alike on every rank, copies the
// other ranks' runs straight from their memory; where one rank's sources
// lie elsewhere, every rank goes through the slots, with the same result.
TEST_P(ShmGroup, AllGatherRunsFromARegionReadTheOtherRanksSegmentsWhereTheyLie) {
  const int32_t world = GetParam();
  run_ranks(world, [&](ProcessGroup& group) {
    auto region = group.create_region(4 << 20);
    ASSERT_NE(region, nullptr);
    // Two runs of a 3 MiB segment with a gap, more than a slot's worth.
    const int64_t first = 400000, second = 200001;
    const size_t second_at = 2u << 20, segment = 3u << 20;
    auto gather = [&](bool private_sources) {
      Tensor a = in_region(region, 0, first), b = in_region(region, second_at, second);
      if (private_sources) {
        a = Tensor::empty(DType::kFloat32, {first}, Device{DeviceType::kCpu, 0});
        b = Tensor::empty(DType::kFloat32, {second}, Device{DeviceType::kCpu, 0});
      }
      fill(a, group.rank());
      fill(b, group.rank() + 7);
      std::vector<std::vector<SegmentRun>> places(static_cast<size_t>(world));
      std::vector<Tensor> got_a, got_b;
      for (int32_t q = 0; q < world; ++q) {
        got_a.push_back(Tensor::empty(DType::kFloat32, {first}, Device{DeviceType::kCpu, 0}));
        got_b.push_back(Tensor::empty(DType::kFloat32, {second}, Device{DeviceType::kCpu, 0}));
        if (q == group.rank()) continue;
        places[static_cast<size_t>(q)] = {SegmentRun{0, got_a.back()}, SegmentRun{second_at, got_b.back()}};
      }
      group.all_gather_runs(segment, {SegmentRun{0, a}, SegmentRun{second_at, b}}, places, false);
      for (int32_t q = 0; q < world; ++q) {
        if (q == group.rank()) continue;
        Tensor want_a = Tensor::empty(DType::kFloat32, {first}, Device{DeviceType::kCpu, 0});
        Tensor want_b = Tensor::empty(DType::kFloat32, {second}, Device{DeviceType::kCpu, 0});
        fill(want_a, q);
        fill(want_b, q + 7);
        EXPECT_EQ(std::memcmp(got_a[static_cast<size_t>(q)].data(), want_a.data(), want_a.nbytes()), 0) << q;
        EXPECT_EQ(std::memcmp(got_b[static_cast<size_t>(q)].data(), want_b.data(), want_b.nbytes()), 0) << q;
      }
    };
    gather(false);
    EXPECT_EQ(calls_in_regions(group), 1u);
    if (world == 1) return;
    gather(group.rank() == world - 1);
    EXPECT_EQ(calls_in_regions(group), 1u);
    // The last rank makes a plain all_gather of the same bytes instead: the
    // others' runs still land where they are named, and it gets their segments.
    if (group.rank() != world - 1) {
      gather(false);
      return;
    }
    Tensor mine = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(segment)}, Device{DeviceType::kCpu, 0});
    Tensor a = mine.view_at(0, DType::kFloat32, {first}), b = mine.view_at(second_at, DType::kFloat32, {second});
    fill(a, group.rank());
    fill(b, group.rank() + 7);
    Tensor all = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(segment) * world}, Device{DeviceType::kCpu, 0});
    std::vector<Tensor> outputs;
    for (int32_t q = 0; q < world; ++q) {
      outputs.push_back(all.view_at(static_cast<size_t>(q) * segment, DType::kUInt8, {static_cast<int64_t>(segment)}));
    }
    group.all_gather(mine, outputs, false);
    for (int32_t q = 0; q + 1 < world; ++q) {
      Tensor want = Tensor::empty(DType::kFloat32, {first}, Device{DeviceType::kCpu, 0});
      fill(want, q);
      EXPECT_EQ(std::memcmp(outputs[static_cast<size_t>(q)].data(), want.data(), want.nbytes()), 0) << q;
    }
  });
}

// Where the ranks' tensors do not all lie at one spot, every rank takes the
// slots, with the same result.
TEST_P(ShmGroup, AllReduceWhereATensorLiesElsewhereTakesTheSlotsOnEveryRank) {
  const int32_t world = GetParam();
  if (world == 1) GTEST_SKIP() << "needs another rank";
  run_ranks(world, [&](ProcessGroup& group) {
    auto region = group.create_region(4 << 20);
    ASSERT_NE(region, nullptr);
    const bool last = group.rank() == world - 1;
    Tensor privately = Tensor::empty(DType::kFloat32, {kRegionElements}, Device{DeviceType::kCpu, 0});
    Tensor t = last ? privately : in_region(region, 4096, kRegionElements);
    fill(t, group.rank());
    group.all_reduce(t, ReduceOp::kSum, false);
    expect_reduced(t, world, false);
    Tensor shifted = in_region(region, last ? 8192 : 4096, kRegionElements);
    fill(shifted, group.rank());
    group.all_reduce(shifted, ReduceOp::kSum, false);
    expect_reduced(shifted, world, false);
    EXPECT_EQ(calls_in_regions(group), 0u);
  });
}

// This rank's part of a region counts as memory its device's tensors hold
// (dp_device_memory_stats) from its creation until the last tensor over it
// goes. One rank alone, so that nothing else allocates meanwhile.
// A peer stalled past the timeout amid a region all-reduce (here rank 1,
// through DP_TEST_SHM_STALL) pushes its part late. The rank that gave up
// keeps what it held when its call failed: the late pushes land in pages it
// no longer maps.
TEST(ShmRegionFailure, APeerPushingAfterTheTimeoutLeavesTheRankThatGaveUpAlone) {
  ::setenv("DP_TEST_SHM_STALL", "1:7000", 1);
  std::atomic<bool> late_rank_done{false};
  run_ranks(
      2,
      [&](ProcessGroup& group) {
        auto region = group.create_region(4 << 20);
        ASSERT_NE(region, nullptr);
        Tensor t = in_region(region, 4096, kRegionElements);
        fill(t, group.rank());
        StatusCode code = StatusCode::kOk;
        try {
          group.all_reduce(t, ReduceOp::kSum, false);
        } catch (const Error& e) {
          code = e.code();
        }
        if (group.rank() == 1) {
          late_rank_done = true;
          return;
        }
        EXPECT_EQ(code, StatusCode::kTimeout);
        const auto* p = static_cast<const float*>(t.data());
        const std::vector<float> at_failure(p, p + t.numel());
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!late_rank_done && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        EXPECT_TRUE(late_rank_done);
        EXPECT_EQ(std::vector<float>(p, p + t.numel()), at_failure) << "a late push reached this rank's tensor";
        // This rank's part is its own now: reading and writing it still work.
        fill(t, 0);
        EXPECT_EQ(p[kRegionElements - 1], value(0, kRegionElements - 1));
      },
      Millis(3000));
  ::unsetenv("DP_TEST_SHM_STALL");
}

TEST(ShmRegionMemory, ThisRanksPartCountsAsInUseWhileHeld) {
  const Device cpu{DeviceType::kCpu, 0};
  run_ranks(1, [&](ProcessGroup& group) {
    const MemoryUsage before = memory_usage(cpu);
    auto region = group.create_region(3 << 20);
    ASSERT_NE(region, nullptr);
    const size_t part = region->bytes();
    EXPECT_GE(part, size_t{3} << 20);
    EXPECT_EQ(memory_usage(cpu).in_use, before.in_use + part);
    EXPECT_GE(memory_usage(cpu).peak, before.in_use + part);
    Tensor view = in_region(region, 0, 16);
    region.reset();
    EXPECT_EQ(memory_usage(cpu).in_use, before.in_use + part) << "a tensor over it still holds it";
    view = Tensor();
    EXPECT_EQ(memory_usage(cpu).in_use, before.in_use);
  });
}

TEST_P(ShmGroup, RegionsComeAndGoWithoutRunningOutAndOutliveTheirGroup) {
  const int32_t world = GetParam();
  std::vector<std::shared_ptr<SharedRegion>> kept(static_cast<size_t>(world));
  run_ranks(world, [&](ProcessGroup& group) {
    // Far more than the table's entries: released ones are taken again.
    for (int i = 0; i < 3 * static_cast<int>(shm::kMaxRegions); ++i) {
      auto region = group.create_region(size_t{1} << 20);
      ASSERT_NE(region, nullptr) << "region " << i;
    }
    kept[static_cast<size_t>(group.rank())] = group.create_region(size_t{1} << 20);
    Tensor t = in_region(kept[static_cast<size_t>(group.rank())], 0, 200000);
    fill(t, group.rank());
    group.all_reduce(t, ReduceOp::kSum, false);
  });
  for (int32_t r = 0; r < world; ++r) {
    Tensor t = in_region(kept[static_cast<size_t>(r)], 0, 200000);
    expect_reduced(t, world, false);
    std::memset(t.data(), 0, t.nbytes());  // still mapped, and writable
  }
}

TEST_P(ShmGroup, RegionsOfDifferentSizesFailOnEveryRankNamingTheSizes) {
  const int32_t world = GetParam();
  if (world == 1) GTEST_SKIP() << "needs another rank";
  run_ranks(world, [&](ProcessGroup& group) {
    const size_t bytes = group.rank() == world - 1 ? 8192 : 4096;
    try {
      group.create_region(bytes);
      ADD_FAILURE() << "sizes that differ passed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("differ across ranks"), std::string::npos) << e.what();
    }
    auto region = group.create_region(4096);
    EXPECT_NE(region, nullptr) << "the group stays usable";
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmGroup, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int32_t>& world) {
                           return std::to_string(world.param) + "Ranks";
                         });

double thread_cpu_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Two ranks that take turns on one CPU: the higher one moves off it (where
// to is the scheduler's, so not checked) and leaves its affinity as it was.
TEST(ShmBarrier, RankSharingACpuKeepsItsAffinityWhenItMoves) {
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof all, &all), 0);
  if (CPU_COUNT(&all) < 2) GTEST_SKIP() << "needs 2 CPUs";
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  // One element per rank, not bits of one word: the ranks write at once.
  std::vector<char> kept(2, 0);
  run_ranks(2, [&](ProcessGroup& group) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    // Pinned, both wait beside each other without moving (one CPU allowed).
    ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
    for (int i = 0; i < 200; ++i) group.barrier(false);
    ASSERT_EQ(::sched_setaffinity(0, sizeof all, &all), 0);
    for (int i = 0; i < 200; ++i) group.barrier(false);
    cpu_set_t now;
    ASSERT_EQ(::sched_getaffinity(0, sizeof now, &now), 0);
    kept[static_cast<size_t>(group.rank())] = CPU_EQUAL(&now, &all) ? 1 : 0;
  });
  EXPECT_TRUE(kept[0] != 0);
  EXPECT_TRUE(kept[1] != 0);
}

// A rank that waits for a late one spins (up to 2 ms after barriers met
// quickly), then sleeps: half a second of waiting costs it little CPU, on
// an idle or a busy machine alike.
TEST(ShmBarrier, RankWaitingForALateRankSleeps) {
  double waiting_cpu_ms = -1;
  run_ranks(2, [&](ProcessGroup& group) {
    for (int i = 0; i < 100; ++i) group.barrier(false);
    if (group.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      group.barrier(false);
      return;
    }
    double before = thread_cpu_ms();
    group.barrier(false);
    waiting_cpu_ms = thread_cpu_ms() - before;
  });
  EXPECT_GE(waiting_cpu_ms, 0);
  EXPECT_LT(waiting_cpu_ms, 50) << "rank 0 used this much CPU (ms) while it waited 500 ms";
}

// A thread that runs collectives in the background (a comm lane) does not
// spin for a late peer while no thread awaits its work: it would take the
// CPU from the host computing beside it. Rank 1 comes 1 ms late to each of
// 40 barriers, within the 2 ms a foreground wait spins; rank 0's background
// thread sleeps through them, until a thread awaits it. May_spin follows
// the marks and the Awaited scopes.
TEST(ShmBarrier, BackgroundWaitNobodyAwaitsSleepsInsteadOfSpinning) {
  EXPECT_TRUE(BackgroundCalls::may_spin()) << "a thread never marked is a host thread";
  double waiting_cpu_ms = -1;
  bool spins_unawaited = true, spins_awaited = false;
  run_ranks(2, [&](ProcessGroup& group) {
    for (int i = 0; i < 20; ++i) group.barrier(false);
    if (group.rank() == 1) {
      for (int i = 0; i < 40; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        group.barrier(false);
      }
      return;
    }
    BackgroundCalls::mark_this_thread();
    spins_unawaited = BackgroundCalls::may_spin();
    double before = thread_cpu_ms();
    for (int i = 0; i < 40; ++i) group.barrier(false);
    waiting_cpu_ms = thread_cpu_ms() - before;
    std::thread host([&] {
      BackgroundCalls::Awaited awaited;
      std::thread lane([&] {
        BackgroundCalls::mark_this_thread();
        spins_awaited = BackgroundCalls::may_spin();
      });
      lane.join();
    });
    host.join();
  });
  EXPECT_FALSE(spins_unawaited);
  EXPECT_TRUE(spins_awaited);
  EXPECT_GE(waiting_cpu_ms, 0);
  EXPECT_LT(waiting_cpu_ms, 20) << "rank 0's background thread used this much CPU (ms) over 40 waits of about 1 ms";
}

// Ranks as forked processes of a fresh test process (no threads yet), each
// told every rank's pid before it creates the group; rank `victim` exits
// instead. The survivors must fail with kRemote naming it, long before
// their 60 s timeout, whether they wait for the door (victim 0) or for the
// victim to map the segment. Returns "" or what went wrong.
std::string survivors_fail_at_once_when_a_rank_exits_before_mapping(int32_t world, int32_t victim) {
  char dir_template[] = "/tmp/dp_shm_setup_XXXXXX";
  std::string dir = ::mkdtemp(dir_template);
  std::string path = dir + "/store";
  std::vector<pid_t> children;
  std::vector<int> pid_pipes, result_pipes;
  for (int32_t r = 0; r < world; ++r) {
    int to_child[2], from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return "pipe failed";
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(to_child[1]);
      ::close(from_child[0]);
      std::vector<int32_t> pids(static_cast<size_t>(world));
      size_t want = pids.size() * sizeof(int32_t);
      if (::read(to_child[0], pids.data(), want) != static_cast<ssize_t>(want)) ::_exit(2);
      if (r == victim) ::_exit(0);
      std::string outcome;
      auto start = std::chrono::steady_clock::now();
      try {
        ProcessGroupOptions options;
        options.rank = r;
        options.world_size = world;
        options.store = std::make_shared<FileStore>(path, world);
        options.timeout = Millis(60000);
        create_shm_process_group(options, "setup/", pids);
        outcome = "created the group";
      } catch (const Error& e) {
        outcome = str_cat(static_cast<int>(e.code()), " ", e.what());
      }
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      outcome = str_cat(static_cast<int64_t>(ms), " ms: ", outcome);
      if (::write(from_child[1], outcome.data(), outcome.size()) < 0) ::_exit(3);
      ::_exit(0);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    children.push_back(pid);
    pid_pipes.push_back(to_child[1]);
    result_pipes.push_back(from_child[0]);
  }
  std::vector<int32_t> pids(children.begin(), children.end());
  for (int fd : pid_pipes) {
    if (::write(fd, pids.data(), pids.size() * sizeof(int32_t)) < 0) return "write failed";
    ::close(fd);
  }
  std::string problems;
  for (int32_t r = 0; r < world; ++r) {
    std::string outcome;
    char buf[4096];
    for (ssize_t n; (n = ::read(result_pipes[static_cast<size_t>(r)], buf, sizeof(buf))) > 0;) outcome.append(buf, n);
    ::close(result_pipes[static_cast<size_t>(r)]);
    int status = 0;
    ::waitpid(children[static_cast<size_t>(r)], &status, 0);
    if (r == victim) continue;
    std::string named = str_cat("rank ", victim, " (pid ", pids[static_cast<size_t>(victim)], ") exited");
    long ms = std::atol(outcome.c_str());
    bool remote = outcome.find(str_cat(" ms: ", static_cast<int>(StatusCode::kRemote), " ")) != std::string::npos;
    if (!remote || outcome.find(named) == std::string::npos || ms > 30000) {
      problems += str_cat("rank ", r, ": ", outcome, "\n");
    }
  }
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
  return problems;
}

TEST(ShmSetup, RankThatExitsBeforeMappingFailsTheOthersAtOnceNamingIt) {
  EXPECT_EQ(survivors_fail_at_once_when_a_rank_exits_before_mapping(3, 2), "");
}

TEST(ShmSetup, DoorKeepingRankThatExitsBeforeServingFailsTheOthersAtOnceNamingIt) {
  EXPECT_EQ(survivors_fail_at_once_when_a_rank_exits_before_mapping(3, 0), "");
}

// A finished rendezvous leaves nothing behind: creating and destroying
// groups over one store, shm and Gloo alike, keeps its key count constant
// after the first (only the per-rank generation counters stay).
void expect_no_keys_left_per_group(const char* dp_shm) {
  ::setenv("DP_SHM", dp_shm, 1);
  TcpStoreOptions server_options;
  server_options.host = "127.0.0.1";
  server_options.is_server = true;
  server_options.world_size = 1;
  server_options.timeout = Millis(60000);
  auto server = std::make_shared<TcpStore>(server_options);
  TcpStoreOptions client_options = server_options;
  client_options.is_server = false;
  client_options.port = server->port();
  auto client = std::make_shared<TcpStore>(client_options);
  std::vector<int64_t> counts;
  std::string error;
  for (int g = 0; g < 6 && error.empty(); ++g) {
    std::vector<std::thread> ranks;
    std::vector<std::string> errors(2);
    for (int32_t r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        try {
          ProcessGroupOptions options;
          options.rank = r;
          options.world_size = 2;
          options.store = r == 0 ? std::static_pointer_cast<Store>(server) : client;
          options.timeout = Millis(60000);
          auto group = create_process_group(options);
          group->barrier(false);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
    error = errors[0] + errors[1];
    counts.push_back(server->num_keys());
  }
  ::unsetenv("DP_SHM");
  ASSERT_EQ(error, "");
  for (size_t g = 1; g < counts.size(); ++g) EXPECT_EQ(counts[g], counts[0]) << "after group " << g + 1;
}

TEST(StoreKeys, ShmGroupsLeaveNoKeysBehind) { expect_no_keys_left_per_group("1"); }

TEST(StoreKeys, GlooGroupsLeaveNoKeysBehind) { expect_no_keys_left_per_group("0"); }

}  // namespace
}  // namespace dparallel::dist
