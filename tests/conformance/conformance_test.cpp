// The conformance suite: every scenario of conformance_worker is written once
// and run over each backend (backend.h), as real processes on this host:
// Conformance/gloo.*, Conformance/shm.*, Conformance/hierarchical.* (two
// pretend hosts) and Conformance/nccl.* (one GPU per rank; skipped without
// enough of them). "PerHost" counts the ranks on each host. Each run is
// bounded in time and every process started is reaped before the test ends.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "dparallel/dparallel.h"
#include "ranks.h"

namespace {

using dptest::Backend;
using dptest::RankExit;

struct Gloo {
  static constexpr Backend kBackend = Backend::kGloo;
};
struct Shm {
  static constexpr Backend kBackend = Backend::kShm;
};
struct Hierarchical {
  static constexpr Backend kBackend = Backend::kHierarchical;
};
struct Nccl {
  static constexpr Backend kBackend = Backend::kNccl;
};

struct BackendNames {
  template <typename T>
  static std::string GetName(int) {
    return dptest::backend_name(T::kBackend);
  }
};

int gpus() {
  int32_t n = 0;
  return dp_device_count(DP_DEVICE_CUDA, &n) == DP_OK ? n : 0;
}

// One busy loop per core while it lives.
class CpuHog {
 public:
  CpuHog() {
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < (cores > 0 ? cores : 2); ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        for (volatile unsigned long spin = 0;; spin = spin + 1) {
        }
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~CpuHog() {
    for (pid_t pid : pids_) ::kill(pid, SIGKILL);
    for (pid_t pid : pids_) ::waitpid(pid, nullptr, 0);
  }
  CpuHog(const CpuHog&) = delete;
  CpuHog& operator=(const CpuHog&) = delete;

 private:
  std::vector<pid_t> pids_;
};

template <typename T>
class Conformance : public ::testing::Test {
 protected:
  static constexpr Backend kBackend = T::kBackend;

  // The ranks of a job with `per_host` on each host, running `scenarios`
  // (comma-separated) with `argument`; skips when NCCL lacks GPUs for them.
  dptest::Ranks ranks(const std::string& scenarios, int per_host, const std::string& argument = "") {
    dptest::Ranks run;
    run.program = DP_CONFORMANCE_WORKER;
    run.arguments = scenarios + " " + argument;
    run.world = dptest::world_size(kBackend, per_host);
    run.limit = std::chrono::seconds(200);
    run.env[-1] = {std::string("DP_TEST_BACKEND=") + dptest::backend_name(kBackend)};
    return run;
  }

  // Skips where the backend cannot run the job; true when it can.
  bool runnable(int world, bool cpu_only = false) {
    if (kBackend != Backend::kNccl) return true;
    if (cpu_only) {
      skip_reason_ = "not a nccl scenario (cpu tensors or processes only)";
    } else if (gpus() < world) {
      skip_reason_ = "needs " + std::to_string(world) + " GPUs (one per rank), found " + std::to_string(gpus());
    } else {
      return true;
    }
    return false;
  }

  void expect_passed(const dptest::Ranks& run) { dptest::expect_all_passed(dptest::run_ranks(run)); }

  // The victim exits by SIGKILL (killed, or stopped and then killed); every
  // other rank passed its checks.
  void expect_survivors_failed_cleanly(const dptest::Ranks& run, int victim) {
    std::vector<RankExit> results = dptest::run_ranks(run);
    ASSERT_EQ(results.size(), static_cast<size_t>(run.world));
    for (size_t r = 0; r < results.size(); ++r) {
      if (static_cast<int>(r) == victim) {
        EXPECT_EQ(results[r].exit_code, 128 + SIGKILL) << "victim rank " << r << " output:\n" << results[r].output;
      } else {
        EXPECT_EQ(results[r].exit_code, 0) << "survivor rank " << r << " output:\n" << results[r].output;
      }
    }
  }

  std::string skip_reason_;
};

using Backends = ::testing::Types<Gloo, Shm, Hierarchical, Nccl>;
TYPED_TEST_SUITE(Conformance, Backends, BackendNames);

#define RUNNABLE_OR_SKIP(...) \
  if (!this->runnable(__VA_ARGS__)) GTEST_SKIP() << this->skip_reason_

TYPED_TEST(Conformance, EveryCollectiveOpDtypeAndSizeSyncAndAsyncWithTwoRanksPerHost) {
  auto run = this->ranks("collectives,async,in_place", 2);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, EveryCollectiveOpDtypeAndSizeSyncAndAsyncWithThreeRanksPerHostOverAFileStore) {
  auto run = this->ranks("collectives,async,in_place", 3);
  run.file_store = true;
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, CallsThatDifferAcrossRanksFailEveryRankThenAnOutOfStepRankBreaksTheGroupWithTwoRanksPerHost) {
  auto run = this->ranks("mismatch,out_of_step", 2);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, CallsThatDifferAcrossRanksFailEveryRankThenAnOutOfStepRankBreaksTheGroupWithThreeRanksPerHost) {
  auto run = this->ranks("mismatch,out_of_step", 3);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

// Without the refusal in the header exchange, the other ranks' call would
// pair with the refusing rank's next one, or wait for the whole timeout.
TYPED_TEST(Conformance, BadHandlesAreRefusedLocallyAndRefusedCallsFailEveryRankAtOnceWithTwoRanksPerHost) {
  auto run = this->ranks("bad_handles,refuse", 2);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, RefusedCallsOfTheStoreServingRankFailEveryRankAtOnceWithThreeRanksPerHost) {
  auto run = this->ranks("refuse", 3, "0");
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
}

// On shared memory a dead peer is seen by its pid: the survivors fail within
// half of their 60 s timeout. Elsewhere they must fail by their timeout.
TYPED_TEST(Conformance, RankKilledMidAllReduceFailsTheOthersWithTwoRanksPerHost) {
  auto run = this->ranks("die", 2);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_survivors_failed_cleanly(run, run.world - 1);
}

TYPED_TEST(Conformance, StoreServingRankKilledMidAllReduceFailsTheOthersWithThreeRanksPerHost) {
  auto run = this->ranks("die", 3, "0");
  RUNNABLE_OR_SKIP(run.world);
  this->expect_survivors_failed_cleanly(run, 0);
}

TYPED_TEST(Conformance, RankKilledMidReduceScatterFailsTheOthersWithThreeRanksPerHost) {
  auto run = this->ranks("die_reduce_scatter", 3);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_survivors_failed_cleanly(run, run.world - 1);
}

// A stopped rank is alive: the others wait for it until their timeout.
TYPED_TEST(Conformance, RankStoppedMidAllReduceTimesTheOthersOutWithThreeRanksPerHost) {
  auto run = this->ranks("stop", 3);
  run.stopped_rank = run.world - 1;
  RUNNABLE_OR_SKIP(run.world);
  this->expect_survivors_failed_cleanly(run, run.world - 1);
}

TYPED_TEST(Conformance, RankStoppedMidReduceScatterTimesTheOthersOutWithTwoRanksPerHost) {
  auto run = this->ranks("stop_reduce_scatter", 2);
  run.stopped_rank = run.world - 1;
  RUNNABLE_OR_SKIP(run.world);
  this->expect_survivors_failed_cleanly(run, run.world - 1);
}

// Waiting that only spins would starve the rank it waits for when every
// core is busy; spinning, then sleeping, keeps the collectives going.
TYPED_TEST(Conformance, CollectivesStayRightBesideABusyLoopOnEveryCore) {
  auto run = this->ranks("hog_loop", 2);
  RUNNABLE_OR_SKIP(run.world, true);
  CpuHog hog;
  this->expect_passed(run);
}

TYPED_TEST(Conformance, OutOfMemoryBeforeTheTransferLeavesTheGroupInStep) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer aborts on an impossible allocation instead of throwing";
#else
  auto run = this->ranks("oom", 2);
  RUNNABLE_OR_SKIP(run.world);
  this->expect_passed(run);
#endif
}

TYPED_TEST(Conformance, ForkedChildIsRefusedEveryCallOnTheInheritedGroupAndTheParentsStayRight) {
  auto run = this->ranks("fork", 2);
  RUNNABLE_OR_SKIP(run.world, true);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, ThreadsTakingTurnsOnOneGroupAndAsyncThenSyncFromOneThreadAreAllowed) {
  auto run = this->ranks("thread_handover", 2);
  RUNNABLE_OR_SKIP(run.world, true);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, CallFromASecondThreadWhileOneIsInFlightIsEstateAndEveryRankFailsAtOnce) {
  auto run = this->ranks("thread_overlap", 2);
  RUNNABLE_OR_SKIP(run.world, true);
  this->expect_passed(run);
}

TYPED_TEST(Conformance, FourThreadsHammeringOneGroupEndInErrorsThatSaySoNotAHang) {
  auto run = this->ranks("threads", 2);
  RUNNABLE_OR_SKIP(run.world, true);
  this->expect_passed(run);
}

}  // namespace
