// The launcher's environment read through an EnvLookup: which launcher's
// variables win, where the default store is, and hostile values refused.
#include "distributed/launch_env.h"

#include <gtest/gtest.h>

#include <map>
#include <ostream>
#include <string>

#include "distributed/rendezvous.h"
#include "error_util.h"

namespace dparallel::dist {
namespace {

using dptest::contains;
using Vars = std::map<std::string, std::string>;

EnvLookup lookup_in(const Vars& vars) {
  return [&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

const Vars kTorchrun = {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}};
const Vars kOpenMpi = {
    {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}};
const Vars kPmi = {{"PMI_RANK", "3"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "1"}};
const Vars kSlurm = {{"SLURM_PROCID", "5"},
                     {"SLURM_NTASKS", "16"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_JOB_NODELIST", "node[003-005,010],gpu7"},
                     {"SLURM_JOB_ID", "123456"}};

// The later parts' values win.
Vars merged(std::initializer_list<Vars> parts) {
  Vars all;
  for (const Vars& part : parts) {
    for (const auto& [name, value] : part) all[name] = value;
  }
  return all;
}

const Vars kMaster = {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};

LaunchEnv read(const Vars& vars, bool need_store = true) { return read_launch_env(lookup_in(vars), need_store); }

std::string invalid(const Vars& vars, bool need_store = true) {
  return dptest::invalid_argument_error_of([&] { read(vars, need_store); });
}

TEST(LaunchEnv, ReadsEachLaunchersOwnVariables) {
  LaunchEnv torchrun = read(merged({kTorchrun, kMaster}));
  EXPECT_STREQ(torchrun.launcher->name, "torchrun");
  EXPECT_EQ(torchrun.rank, 1);
  EXPECT_EQ(torchrun.world_size, 4);
  EXPECT_EQ(torchrun.local_rank, 1);
  LaunchEnv ompi = read(merged({kOpenMpi, kMaster}));
  EXPECT_STREQ(ompi.launcher->name, "Open MPI");
  EXPECT_EQ(ompi.rank, 2);
  EXPECT_EQ(ompi.world_size, 8);
  EXPECT_EQ(ompi.local_rank, 0);
  LaunchEnv pmi = read(merged({kPmi, kMaster}));
  EXPECT_STREQ(pmi.launcher->name, "MPICH or Intel MPI");
  EXPECT_EQ(pmi.rank, 3);
  EXPECT_EQ(pmi.world_size, 6);
  EXPECT_EQ(pmi.local_rank, 1);
  LaunchEnv slurm = read(kSlurm);
  EXPECT_STREQ(slurm.launcher->name, "Slurm");
  EXPECT_EQ(slurm.rank, 5);
  EXPECT_EQ(slurm.world_size, 16);
  EXPECT_EQ(slurm.local_rank, 1);
}

TEST(LaunchEnv, FirstFoundWinsInTheOrderTorchrunOpenMpiPmiSlurm) {
  EXPECT_STREQ(read(merged({kTorchrun, kOpenMpi, kPmi, kSlurm, kMaster})).launcher->name, "torchrun");
  EXPECT_STREQ(read(merged({kOpenMpi, kPmi, kSlurm, kMaster})).launcher->name, "Open MPI");
  EXPECT_STREQ(read(merged({kPmi, kSlurm, kMaster})).launcher->name, "MPICH or Intel MPI");
  EXPECT_EQ(read(merged({kPmi, kSlurm, kMaster})).rank, 3);
  // Found by the world-size variable alone too; then the rank's is missing.
  EXPECT_TRUE(contains(invalid({{"PMI_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}),
                       "environment variable PMI_RANK is not set"));
  // An empty variable does not hide the launcher after it.
  LaunchEnv slurm = read(merged({{{"RANK", ""}, {"WORLD_SIZE", ""}}, kSlurm}));
  EXPECT_STREQ(slurm.launcher->name, "Slurm");
}

TEST(LaunchEnv, LocalRankIdOfPmiIsOptionalButCheckedWhenSet) {
  Vars pmi = merged({kPmi, kMaster});
  pmi.erase("MPI_LOCALRANKID");
  EXPECT_EQ(read(pmi).local_rank, -1);
  pmi["MPI_LOCALRANKID"] = "x";
  EXPECT_TRUE(contains(invalid(pmi), "environment variable MPI_LOCALRANKID is 'x'; it must be an integer in 0..5"));
  Vars slurm = kSlurm;
  slurm.erase("SLURM_LOCALID");
  EXPECT_TRUE(contains(invalid(slurm), "environment variable SLURM_LOCALID is not set (srun sets"));
}

TEST(LaunchEnv, SlurmStoreIsOnTheFirstHostOfTheNodelistAtAPortFromTheJobId) {
  StoreAddress store = read(kSlurm).store;
  EXPECT_EQ(store.host, "node003");
  EXPECT_EQ(store.host_from, "the first host of SLURM_JOB_NODELIST");
  EXPECT_EQ(store.port, 20000 + 123456 % 10000);
  EXPECT_EQ(store.port_from, "SLURM_JOB_ID");
  // A step's own nodes and id.
  Vars step = merged({{{"SLURM_STEP_NODELIST", "gpu[12-13]"}, {"SLURM_STEP_ID", "2"}}, kSlurm});
  store = read(step).store;
  EXPECT_EQ(store.host, "gpu12");
  EXPECT_EQ(store.host_from, "the first host of SLURM_STEP_NODELIST");
  EXPECT_EQ(store.port, 20000 + 3456 + 2);
  EXPECT_EQ(store.port_from, "SLURM_JOB_ID and SLURM_STEP_ID");
  // The port stays in 20000..29999 for any job and step.
  step["SLURM_JOB_ID"] = "9999";
  step["SLURM_STEP_ID"] = "1";
  EXPECT_EQ(read(step).store.port, 20000);
  step["SLURM_JOB_ID"] = "9223372036854775807";
  step["SLURM_STEP_ID"] = "4294967294";
  EXPECT_EQ(read(step).store.port, 20000 + (5807 + 7294) % 10000);
}

TEST(LaunchEnv, ExplicitMasterAddrAndPortWinOverSlurmsDefaults) {
  StoreAddress store = read(merged({kMaster, kSlurm})).store;
  EXPECT_EQ(store.host, "10.0.0.1");
  EXPECT_EQ(store.host_from, "MASTER_ADDR");
  EXPECT_EQ(store.port, 29500);
  EXPECT_EQ(store.port_from, "MASTER_PORT");
  // Each one on its own.
  Vars port_only = merged({{{"MASTER_PORT", "31000"}}, kSlurm});
  EXPECT_EQ(read(port_only).store.host, "node003");
  EXPECT_EQ(read(port_only).store.port, 31000);
}

TEST(LaunchEnv, DpStoreAddrAndPortWinOverMasterAddrAndPort) {
  Vars vars = merged({{{"DP_STORE_ADDR", "10.0.0.2"}, {"DP_STORE_PORT", "29501"}}, kMaster, kTorchrun});
  StoreAddress store = read(vars).store;
  EXPECT_EQ(store.host, "10.0.0.2");
  EXPECT_EQ(store.port, 29501);
  EXPECT_EQ(store.host_from, "DP_STORE_ADDR");
  EXPECT_EQ(store.port_from, "DP_STORE_PORT");
  vars.erase("DP_STORE_ADDR");
  store = read(vars).store;
  EXPECT_EQ(store.host, "10.0.0.1");
  EXPECT_EQ(store.port, 29501);
  // Over Slurm's defaults too, and without MASTER_ADDR and MASTER_PORT.
  store = read(merged({{{"DP_STORE_PORT", "29502"}}, kSlurm})).store;
  EXPECT_EQ(store.host, "node003");
  EXPECT_EQ(store.port, 29502);
  // Malformed, it is refused rather than passed over.
  vars["DP_STORE_PORT"] = "0";
  EXPECT_TRUE(contains(invalid(vars), "environment variable DP_STORE_PORT is '0'; it must be an integer in 1..65535"));
}

TEST(LaunchEnv, OnlySlurmGetsDefaultsForTheStore) {
  // mpirun in a Slurm allocation: its rank 0 need not be on the first node.
  Vars ompi = merged({kOpenMpi, {{"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_JOB_ID", "7"}}});
  EXPECT_TRUE(contains(invalid(ompi), "environment variable MASTER_ADDR is not set (Open MPI's mpirun sets"));
  ompi["MASTER_ADDR"] = "n1";
  EXPECT_TRUE(contains(invalid(ompi), "environment variable MASTER_PORT is not set"));
  EXPECT_EQ(read(ompi, false).rank, 2);
}

TEST(LaunchEnv, PmiVariablesThatSrunSetItselfGetSlurmsDefaultsForTheStore) {
  // srun --mpi=pmi2: PMI_RANK and PMI_SIZE are SLURM_PROCID and SLURM_NTASKS.
  Vars srun = merged({kSlurm, {{"PMI_RANK", "5"}, {"PMI_SIZE", "16"}}});
  LaunchEnv env = read(srun);
  EXPECT_STREQ(env.launcher->name, "MPICH or Intel MPI");
  EXPECT_EQ(env.store.host, "node003");
  EXPECT_EQ(env.store.port, 23456);
  // mpiexec inside an allocation: its ranks carry the Slurm variables of the
  // step that started its daemons, which do not agree.
  Vars mpiexec = merged({kSlurm, {{"PMI_RANK", "5"}, {"PMI_SIZE", "32"}}});
  EXPECT_TRUE(contains(invalid(mpiexec), "environment variable MASTER_ADDR is not set (MPICH's"));
}

TEST(LaunchEnv, SlurmWithoutNodelistOrJobIdNamesWhatIsMissing) {
  Vars slurm = kSlurm;
  slurm.erase("SLURM_JOB_NODELIST");
  EXPECT_TRUE(
      contains(invalid(slurm),
               "environment variable MASTER_ADDR is not set, and environment variable SLURM_JOB_NODELIST is not set"));
  slurm = kSlurm;
  slurm.erase("SLURM_JOB_ID");
  EXPECT_TRUE(contains(
      invalid(slurm), "environment variable MASTER_PORT is not set, and environment variable SLURM_JOB_ID is not set"));
  slurm = kSlurm;
  slurm["SLURM_JOB_NODELIST"] = "node[3-";
  EXPECT_TRUE(contains(invalid(slurm), "environment variable SLURM_JOB_NODELIST is 'node[3-', not a host list"));
  slurm = kSlurm;
  slurm["SLURM_JOB_ID"] = "12ab";
  EXPECT_TRUE(contains(invalid(slurm), "environment variable SLURM_JOB_ID is '12ab'"));
  slurm = kSlurm;
  slurm["SLURM_STEP_ID"] = "-1";
  EXPECT_TRUE(contains(invalid(slurm), "environment variable SLURM_STEP_ID is '-1'"));
  // Not needed without a store to find.
  EXPECT_EQ(read(slurm, false).rank, 5);
}

struct Hostile {
  const char* name;
  const char* value;
  const char* why;
};

void PrintTo(const Hostile& h, std::ostream* os) { *os << h.name << "='" << h.value << "'"; }

class LaunchEnvHostile : public ::testing::TestWithParam<Hostile> {};

TEST_P(LaunchEnvHostile, IsInvalidNamingTheVariable) {
  const Hostile h = GetParam();
  Vars vars = merged({kSlurm, {{"SLURM_STEP_ID", "0"}}});
  vars[h.name] = h.value;
  const std::string why = invalid(vars);
  EXPECT_TRUE(contains(why, std::string("environment variable ") + h.name + " " + h.why)) << why;
}

INSTANTIATE_TEST_SUITE_P(
    Values, LaunchEnvHostile,
    ::testing::Values(Hostile{"SLURM_NTASKS", "", "is empty"},
                      Hostile{"SLURM_NTASKS", "0", "is '0'; it must be an integer in 1..2147483647"},
                      Hostile{"SLURM_NTASKS", "99999999999999999999999", "is '99999999999999999999999'"},
                      Hostile{"SLURM_NTASKS", "2147483648", "is '2147483648'"},
                      Hostile{"SLURM_NTASKS", "-16", "is '-16'"}, Hostile{"SLURM_NTASKS", "16 ", "is '16 '"},
                      Hostile{"SLURM_NTASKS", " 16", "is ' 16'"}, Hostile{"SLURM_NTASKS", "+16", "is '+16'"},
                      Hostile{"SLURM_NTASKS", "0x10", "is '0x10'"}, Hostile{"SLURM_PROCID", "", "is empty"},
                      Hostile{"SLURM_PROCID", "16", "is '16'; it must be an integer in 0..15"},
                      Hostile{"SLURM_PROCID", "-1", "is '-1'; it must be an integer in 0..15"},
                      Hostile{"SLURM_LOCALID", "16", "is '16'; it must be an integer in 0..15"},
                      Hostile{"SLURM_LOCALID", "", "is empty"}, Hostile{"SLURM_JOB_ID", "", "is empty"},
                      Hostile{"SLURM_JOB_ID", "99999999999999999999", "is '99999999999999999999'"},
                      Hostile{"SLURM_STEP_ID", "batch", "is 'batch'"}, Hostile{"SLURM_JOB_NODELIST", "", "is empty"},
                      Hostile{"SLURM_JOB_NODELIST", "a,,b", "is 'a,,b', not a host list"},
                      Hostile{"MASTER_PORT", "65536", "is '65536'; it must be an integer in 1..65535"},
                      Hostile{"MASTER_PORT", "port", "is 'port'"}, Hostile{"DP_STORE_PORT", "-5", "is '-5'"}));

TEST(LaunchEnv, EmptySlurmVariablesWithNoFallbackAreNamed) {
  // An empty MASTER_ADDR falls back to SLURM_JOB_NODELIST, as an unset one does.
  Vars slurm = merged({kSlurm, {{"SLURM_JOB_NODELIST", ""}, {"MASTER_ADDR", ""}}});
  EXPECT_TRUE(contains(invalid(slurm), "MASTER_ADDR is empty, and environment variable SLURM_JOB_NODELIST is empty"));
  slurm = merged({kSlurm, {{"SLURM_JOB_ID", ""}, {"MASTER_PORT", ""}}});
  EXPECT_TRUE(contains(invalid(slurm), "MASTER_PORT is empty, and environment variable SLURM_JOB_ID is empty"));
  slurm = merged({kSlurm, {{"MASTER_ADDR", ""}}});
  EXPECT_EQ(read(slurm).store.host, "node003");
}

TEST(LaunchEnv, NoLauncherNamesEveryLaunchersVariables) {
  const std::string why = invalid({});
  EXPECT_TRUE(contains(why, "environment variable WORLD_SIZE is not set (no launcher's variables are set")) << why;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    EXPECT_TRUE(contains(why, name)) << why;
  }
  EXPECT_EQ(find_launcher(lookup_in({})), nullptr);
}

TEST(Rendezvous, OptionsLeftUnsetAreFilledFromTheLauncherFound) {
  ProcessGroupOptions options;
  options.world_size = 16;
  std::string from;
  resolve_rank(options, RankSource::kOptions, lookup_in(kSlurm), &from);
  EXPECT_EQ(options.rank, 5);
  EXPECT_EQ(options.world_size, 16);
  EXPECT_EQ(from, "rank from SLURM_PROCID (Slurm), world size from the options");
  options.rank = -1;
  options.world_size = 2;
  std::string why = dptest::invalid_argument_error_of(
      [&] { resolve_rank(options, RankSource::kOptions, lookup_in(kSlurm), nullptr); });
  EXPECT_TRUE(contains(why, "SLURM_PROCID is '5'; it must be an integer in 0..1")) << why;
}

TEST(Rendezvous, DebugLineSaysWhichLaunchersVariablesWereUsed) {
  ProcessGroupOptions options;
  std::string from;
  Vars vars = merged({kSlurm, {{"DP_STORE_PORT", "29502"}}});
  resolve_rank(options, RankSource::kLaunchEnv, lookup_in(vars), &from);
  EXPECT_EQ(rendezvous_line(options, from, lookup_in(vars)),
            "dparallel: rank 5 of 16: rank from SLURM_PROCID (Slurm), world size from SLURM_NTASKS (Slurm); "
            "store: a TCP store at node003:29502 served by rank 0 (host from the first host of SLURM_JOB_NODELIST, "
            "port from DP_STORE_PORT)");
}

}  // namespace
}  // namespace dparallel::dist
