// The MPI backend (DP_BACKEND_MPI) with Open MPI and with MPICH: ranks of
// mpi_worker started by each implementation's mpirun, and processes that
// never ask for MPI never map it. A test skips when its implementation's
// mpirun or library is missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "process_util.h"

namespace {

struct Implementation {
  const char* name;
  const char* launcher;  // found on PATH
  const char* library;   // DP_MPI_LIBRARY
  std::vector<std::string> options;
  std::vector<std::string> env;
};

// Names the parameter in test output.
void PrintTo(const Implementation& impl, std::ostream* out) { *out << impl.name; }

// Under the sanitizers, LeakSanitizer is off in MPI's processes: Open MPI and
// MPICH leave allocations at exit from modules they have unloaded by then,
// so their stacks name no module and no suppression can tell them from
// ours. AddressSanitizer's other checks and UBSan still run.
const std::string kNoLeakCheck = "LSAN_OPTIONS=detect_leaks=0";

const Implementation kOpenMpi{"OpenMpi",
                              "mpirun.openmpi",
                              "libmpi.so.40",
                              {"--oversubscribe"},
                              {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"}};
const Implementation kMpich{"Mpich", "mpirun.mpich", "libmpich.so.12", {}, {}};

// `program` on PATH, or "".
std::string on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

std::string scratch_dir() {
  char dir_template[] = "/tmp/dp_mpi_XXXXXX";
  return ::mkdtemp(dir_template);
}

// Runs `argv` as one process (mpirun, or a worker on its own) and returns its exit and output.
dptest::RankExit run_one(const std::string& dir, const std::vector<std::string>& argv,
                         const std::vector<std::string>& env) {
  dptest::RankJob job;
  job.name = argv.back();
  job.dir = dir;
  job.argv = argv;
  job.world = 1;
  job.torchrun_env = false;
  job.env = [&](int) { return env; };
  job.drop_inherited = [](const std::string& entry) {
    for (const char* name : {"DP_MPI_LIBRARY=", "OMPI_", "PMI_", "DP_SHM=", "DP_HOST_ID="}) {
      if (entry.rfind(name, 0) == 0) return true;
    }
    return false;
  };
  job.limit = std::chrono::seconds(100);
  return dptest::run_rank_processes(job).at(0);
}

void remove_dir(const std::string& dir) {
  if (std::system(("rm -rf '" + dir + "'").c_str()) != 0) ADD_FAILURE() << "could not remove " << dir;
}

bool skipped(const dptest::RankExit& exit) { return exit.output.find("skip: ") != std::string::npos; }

void expect_ranks_passed(const dptest::RankExit& exit, const char* scenario, int world) {
  for (int r = 0; r < world; ++r) {
    std::string line = "rank " + std::to_string(r) + ": " + scenario + " passed";
    EXPECT_NE(exit.output.find(line), std::string::npos) << "no '" << line << "' in:\n" << exit.output;
  }
  EXPECT_EQ(exit.exit_code, 0) << exit.output;
}

class MpiBackendTest : public ::testing::TestWithParam<Implementation> {
 protected:
  // The implementation's mpirun running `world` ranks of `scenario`.
  dptest::RankExit under_mpirun(const char* scenario, int world) {
    const Implementation& impl = GetParam();
    std::string launcher = on_path(impl.launcher);
    if (launcher.empty()) return {77, std::string("skip: no ") + impl.launcher + " on PATH"};
    std::string dir = scratch_dir();
    std::vector<std::string> argv = {launcher};
    argv.insert(argv.end(), impl.options.begin(), impl.options.end());
    for (const char* word : {"-np", "", DP_MPI_WORKER, scenario}) argv.emplace_back(word);
    argv[argv.size() - 3] = std::to_string(world);
    argv.push_back(dir + "/store");
    std::vector<std::string> env = impl.env;
    env.push_back(std::string("DP_MPI_LIBRARY=") + impl.library);
    env.push_back(kNoLeakCheck);
    dptest::RankExit exit = run_one(dir, argv, env);
    remove_dir(dir);
    return exit;
  }
};

TEST_P(MpiBackendTest, EveryCollectiveOfEveryDtypeAndOpOnTwoRanks) {
  dptest::RankExit exit = under_mpirun("collectives", 2);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "collectives", 2);
}

TEST_P(MpiBackendTest, ACallOnlyOneRankMakesTimesOutNamingItWithoutAHang) {
  dptest::RankExit exit = under_mpirun("timeout", 2);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "timeout", 2);
}

TEST_P(MpiBackendTest, FullyShardOverMpiGathersTheShardsAndAveragesTheGradients) {
  dptest::RankExit exit = under_mpirun("fsdp", 2);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "fsdp", 2);
}

TEST_P(MpiBackendTest, EveryCollectiveOnThreeRanks) {
  dptest::RankExit exit = under_mpirun("collectives", 3);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "collectives", 3);
}

// DP_CROSS_HOST=mpi: MPI as the leg across hosts of the hierarchical backend.
TEST_P(MpiBackendTest, AutoOnTwoHostsWithCrossHostMpiIsSharedMemoryPlusMpiAndRunsEveryCollective) {
  dptest::RankExit exit = under_mpirun("hierarchical", 4);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "hierarchical", 4);
}

// Initialised by the host: used at MPI_THREAD_MULTIPLE, refused below
// SERIALIZED, and never finalised by dparallel.
TEST_P(MpiBackendTest, MpiTheHostInitialisedRunsAtThreadMultipleAndStaysTheHostsToFinalise) {
  dptest::RankExit exit = under_mpirun("host_init_multiple", 2);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "host_init_multiple", 2);
}

TEST_P(MpiBackendTest, MpiTheHostInitialisedAtThreadFunneledIsRefusedNamingTheLevel) {
  dptest::RankExit exit = under_mpirun("host_init_funneled", 2);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "host_init_funneled", 2);
}

TEST_P(MpiBackendTest, RanksThatAreNotOneMpiJobAreRefusedOnEveryRank) {
  // Two processes started apart from mpirun: each is an MPI world of its own.
  std::string dir = scratch_dir();
  dptest::RankJob job;
  job.name = "not_one_job";
  job.dir = dir;
  job.argv = {DP_MPI_WORKER, "not_one_job", dir + "/store"};
  job.world = 2;
  const std::string library = std::string("DP_MPI_LIBRARY=") + GetParam().library;
  job.env = [&](int) { return std::vector<std::string>{library, kNoLeakCheck}; };
  job.drop_inherited = [](const std::string& entry) {
    return entry.rfind("OMPI_", 0) == 0 || entry.rfind("PMI_", 0) == 0 || entry.rfind("DP_MPI_LIBRARY=", 0) == 0;
  };
  job.limit = std::chrono::seconds(100);
  std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  remove_dir(dir);
  if (skipped(exits.at(0))) GTEST_SKIP() << exits[0].output;
  for (size_t r = 0; r < exits.size(); ++r) {
    std::string line = "rank " + std::to_string(r) + ": not_one_job passed";
    EXPECT_NE(exits[r].output.find(line), std::string::npos) << exits[r].output;
    EXPECT_EQ(exits[r].exit_code, 0) << exits[r].output;
  }
}

TEST_P(MpiBackendTest, AnMpiGroupMapsTheLibraryItLoaded) {
  // The check the next test relies on sees a mapped MPI library.
  std::string dir = scratch_dir();
  dptest::RankExit exit =
      run_one(dir, {DP_MPI_WORKER, "mpi_mapped", dir + "/store"},
              {std::string("DP_MPI_LIBRARY=") + GetParam().library, "RANK=0", "WORLD_SIZE=1", kNoLeakCheck});
  remove_dir(dir);
  if (skipped(exit)) GTEST_SKIP() << exit.output;
  expect_ranks_passed(exit, "mpi_mapped", 1);
}

INSTANTIATE_TEST_SUITE_P(Mpi, MpiBackendTest, ::testing::Values(kOpenMpi, kMpich),
                         [](const ::testing::TestParamInfo<Implementation>& param) { return param.param.name; });

TEST(MpiLoading, AGlooGroupMapsNoMpiLibrary) {
  std::string dir = scratch_dir();
  dptest::RankExit exit = run_one(dir, {DP_MPI_WORKER, "no_mpi", dir + "/store"}, {"RANK=0", "WORLD_SIZE=1"});
  remove_dir(dir);
  expect_ranks_passed(exit, "no_mpi", 1);
}

// Four processes on two pretend hosts asking for AUTO, DP_CROSS_HOST set by `cross_host(r)`.
std::vector<dptest::RankExit> cross_host_job(const std::function<std::string(int)>& cross_host,
                                             const std::string& expect) {
  std::string dir = scratch_dir();
  dptest::RankJob job;
  job.name = "cross_host_refused";
  job.dir = dir;
  job.argv = {DP_MPI_WORKER, "cross_host_refused", dir + "/store"};
  job.world = 4;
  job.env = [&](int r) {
    std::vector<std::string> vars = {"DP_TEST_EXPECT=" + expect};
    if (!cross_host(r).empty()) vars.push_back("DP_CROSS_HOST=" + cross_host(r));
    return vars;
  };
  job.drop_inherited = [](const std::string& entry) {
    return entry.rfind("DP_CROSS_HOST=", 0) == 0 || entry.rfind("DP_SHM=", 0) == 0 ||
           entry.rfind("DP_HOST_ID=", 0) == 0;
  };
  job.limit = std::chrono::seconds(100);
  std::vector<dptest::RankExit> exits = dptest::run_rank_processes(job);
  remove_dir(dir);
  return exits;
}

void expect_every_rank_passed(const std::vector<dptest::RankExit>& exits, const char* scenario) {
  for (size_t r = 0; r < exits.size(); ++r) {
    std::string line = "rank " + std::to_string(r) + ": " + scenario + " passed";
    EXPECT_NE(exits[r].output.find(line), std::string::npos) << exits[r].output;
    EXPECT_EQ(exits[r].exit_code, 0) << exits[r].output;
  }
}

TEST(CrossHost, ABackendThatDoesNotCrossHostsIsRefusedNamingTheOnesThatDo) {
  auto exits = cross_host_job([](int) { return "shm"; }, "DP_CROSS_HOST is 'shm'; it must name a backend");
  expect_every_rank_passed(exits, "cross_host_refused");
}

TEST(CrossHost, RanksThatSetItDifferentlyAreRefusedAsAskingForDifferentBackends) {
  auto exits = cross_host_job([](int r) { return r == 0 ? "mpi" : ""; },
                              "rank 0 asks for DP_BACKEND_AUTO+DP_CROSS_HOST=mpi, rank 1 asks for DP_BACKEND_AUTO");
  expect_every_rank_passed(exits, "cross_host_refused");
}

}  // namespace
