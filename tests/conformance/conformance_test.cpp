// The conformance suite: every scenario of conformance_worker is written once
// and run over each backend (backends.h), as real processes on this host:
// Conformance/gloo.*, Conformance/shm.*, Conformance/hierarchical.* (two
// pretend hosts) and Conformance/nccl.* (one GPU per rank; skipped without
// enough of them). "PerHost" counts the ranks on each host. Each run is
// bounded in time and every process started is reaped before the test ends.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "backends.h"
#include "dparallel/dparallel.h"
#include "ranks.h"

namespace {

using dptest::Backend;
using dptest::RankExit;

struct TypeNames {
  template <typename T>
  static std::string GetName(int) {
    return dptest::backend_name(T::kBackend);
  }
};

// One busy loop per core while it lives.
class CpuHog {
 public:
  CpuHog() {
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < (cores > 0 ? cores : 2); ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // ends with the test, however it ends
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

// Whether a scenario runs on GPUs too, or only on cpu tensors and processes.
enum class Where { kAnyDevice, kCpuOnly };

template <typename T>
class Conformance : public ::testing::Test {
 protected:
  static constexpr Backend kBackend = T::kBackend;

  // The ranks of a job with `per_host` on each host, running `scenarios`
  // (comma-separated) with `argument`.
  static dptest::Ranks ranks(const std::string& scenarios, int per_host, const std::string& argument = "") {
    dptest::Ranks run;
    // DP_CONFORMANCE_WORKER in the environment: the worker where a copied
    // build put it (tests/gpu/check.sh runs a bundle moved to a GPU machine).
    const char* worker = std::getenv("DP_CONFORMANCE_WORKER");
    run.program = worker != nullptr && *worker != '\0' ? worker : DP_CONFORMANCE_WORKER;
    run.arguments = scenarios + " " + argument;
    run.world = dptest::world_size(kBackend, per_host);
    run.limit = std::chrono::seconds(200);
    run.env[-1] = {std::string("DP_TEST_BACKEND=") + dptest::backend_name(kBackend)};
    return run;
  }

  // Skips where the backend cannot run the job (then the test ends there).
  static void skip_unless_runnable(int world, Where where) {
    if (kBackend != Backend::kNccl) return;
    if (where == Where::kCpuOnly) GTEST_SKIP() << "not a nccl scenario (cpu tensors or processes only)";
    DP_SKIP_UNLESS_AVAILABLE(kBackend, world);
  }

  static void expect_passes(const dptest::Ranks& run, Where where = Where::kAnyDevice) {
    skip_unless_runnable(run.world, where);
    if (::testing::Test::IsSkipped()) return;
    dptest::expect_all_passed(dptest::run_ranks(run));
  }

  // The victim, killed or stopped (then killed once the others are done),
  // exits by SIGKILL; every other rank passed its checks.
  static void expect_survivors_fail_cleanly(dptest::Ranks run, int victim, bool stops = false) {
    skip_unless_runnable(run.world, Where::kAnyDevice);
    if (::testing::Test::IsSkipped()) return;
    if (stops) run.stopped_rank = victim;
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
};

TYPED_TEST_SUITE(Conformance, dptest::BackendTypes, TypeNames);

TYPED_TEST(Conformance, EveryCollectiveOpDtypeAndSizeSyncAndAsyncWithTwoRanksPerHost) {
  this->expect_passes(this->ranks("collectives,async,in_place", 2));
}

TYPED_TEST(Conformance, EveryCollectiveOpDtypeAndSizeSyncAndAsyncWithThreeRanksPerHostOverAFileStore) {
  auto run = this->ranks("collectives,async,in_place", 3);
  run.file_store = true;
  this->expect_passes(run);
}

TYPED_TEST(Conformance, CallsThatDifferAcrossRanksFailEveryRankThenAnOutOfStepRankBreaksTheGroupWithTwoRanksPerHost) {
  this->expect_passes(this->ranks("mismatch,out_of_step", 2));
}

TYPED_TEST(Conformance, CallsThatDifferAcrossRanksFailEveryRankThenAnOutOfStepRankBreaksTheGroupWithThreeRanksPerHost) {
  this->expect_passes(this->ranks("mismatch,out_of_step", 3));
}

// Without the refusal in the header exchange, the other ranks' call would
// pair with the refusing rank's next one, or wait for the whole timeout.
TYPED_TEST(Conformance, BadHandlesAreRefusedLocallyAndRefusedCallsFailEveryRankAtOnceWithTwoRanksPerHost) {
  this->expect_passes(this->ranks("bad_handles,refuse", 2));
}

TYPED_TEST(Conformance, RefusedCallsOfTheStoreServingRankFailEveryRankAtOnceWithThreeRanksPerHost) {
  this->expect_passes(this->ranks("refuse", 3, "0"));
}

// On shared memory a dead peer is seen by its pid: the survivors fail within
// half of their 60 s timeout. Elsewhere they must fail by their timeout.
TYPED_TEST(Conformance, RankKilledMidAllReduceFailsTheOthersWithTwoRanksPerHost) {
  auto run = this->ranks("die", 2);
  this->expect_survivors_fail_cleanly(run, run.world - 1);
}

TYPED_TEST(Conformance, StoreServingRankKilledMidAllReduceFailsTheOthersWithThreeRanksPerHost) {
  this->expect_survivors_fail_cleanly(this->ranks("die", 3, "0"), 0);
}

TYPED_TEST(Conformance, RankKilledMidReduceScatterFailsTheOthersWithThreeRanksPerHost) {
  auto run = this->ranks("die_reduce_scatter", 3);
  this->expect_survivors_fail_cleanly(run, run.world - 1);
}

// A stopped rank is alive: the others wait for it until their timeout.
TYPED_TEST(Conformance, RankStoppedMidAllReduceTimesTheOthersOutWithThreeRanksPerHost) {
  auto run = this->ranks("stop", 3);
  this->expect_survivors_fail_cleanly(run, run.world - 1, true);
}

TYPED_TEST(Conformance, RankStoppedMidReduceScatterTimesTheOthersOutWithTwoRanksPerHost) {
  auto run = this->ranks("stop_reduce_scatter", 2);
  this->expect_survivors_fail_cleanly(run, run.world - 1, true);
}

// Waiting that only spins would starve the rank it waits for when every
// core is busy; spinning, then sleeping, keeps the collectives going.
TYPED_TEST(Conformance, CollectivesStayRightBesideABusyLoopOnEveryCore) {
  CpuHog hog;
  this->expect_passes(this->ranks("hog_loop", 2), Where::kCpuOnly);
}

TYPED_TEST(Conformance, OutOfMemoryBeforeTheTransferLeavesTheGroupInStep) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer aborts on an impossible allocation instead of throwing";
#else
  this->expect_passes(this->ranks("oom", 2));
#endif
}

TYPED_TEST(Conformance, ForkedChildIsRefusedEveryCallOnTheInheritedGroupAndTheParentsStayRight) {
  this->expect_passes(this->ranks("fork", 2), Where::kCpuOnly);
}

TYPED_TEST(Conformance, ThreadsTakingTurnsOnOneGroupAndAsyncThenSyncFromOneThreadAreAllowed) {
  this->expect_passes(this->ranks("thread_handover", 2), Where::kCpuOnly);
}

TYPED_TEST(Conformance, CallFromASecondThreadWhileOneIsInFlightIsEstateAndEveryRankFailsAtOnce) {
  this->expect_passes(this->ranks("thread_overlap", 2), Where::kCpuOnly);
}

TYPED_TEST(Conformance, FourThreadsHammeringOneGroupEndInErrorsThatSaySoNotAHang) {
  this->expect_passes(this->ranks("threads", 2), Where::kCpuOnly);
}

}  // namespace
