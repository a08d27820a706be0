// Runs with DP_NUM_CPU_DEVICES=4 in its environment (see CMakeLists.txt);
// ctest runs each test in a process of its own, so tests may set variables.
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "group_util.h"
#include "test_util.h"

using namespace dptest;

TEST(CpuDeviceLimit, EnvironmentVariableSetsTheNumberOfLogicalDevices) {
  int32_t n = 0;
  DP_ASSERT_OK(dp_device_count(DP_DEVICE_CPU, &n));
  EXPECT_EQ(n, 4);
  const int64_t dims[] = {1};
  dp_tensor* t = nullptr;
  DP_EXPECT_OK(dp_tensor_create(&t, DP_FLOAT32, 1, dims, cpu(3)));
  dp_tensor_destroy(t);
  t = nullptr;
  EXPECT_EQ(dp_tensor_create(&t, DP_FLOAT32, 1, dims, cpu(4)), DP_EINVAL);
  EXPECT_NE(last_error().find("only 4 logical CPU devices"), std::string::npos) << last_error();
}

namespace {

// A one-rank group on `device`, over a file store of its own.
SingleRankGroup single_rank_group(dp_device device) {
  return SingleRankGroup(GroupOptions{DP_BACKEND_AUTO, 20000, device});
}

// A port that was free a moment ago.
uint16_t free_port() {
  dp_store* probe = nullptr;
  EXPECT_EQ(dp_store_create_tcp(&probe, "127.0.0.1", 0, 1, 1, 5000), DP_OK) << dp_last_error();
  uint16_t port = 0;
  EXPECT_EQ(dp_store_tcp_port(probe, &port), DP_OK) << dp_last_error();
  dp_store_destroy(probe);
  return port;
}

void clear_launch_env() {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                        "SLURM_NTASKS", "DP_STORE_ADDR", "DP_STORE_PORT"}) {
    ::unsetenv(v);
  }
}

// A one-rank group whose options name no store: the default store at
// MASTER_ADDR (loopback) and a free MASTER_PORT, set here.
GroupPtr one_rank_group_over_the_default_store() {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.timeout_ms = 20000;
  dp_process_group* raw = nullptr;
  EXPECT_EQ(dp_process_group_create(&raw, &o), DP_OK) << dp_last_error();
  return GroupPtr(raw);
}

}  // namespace

// cpu:i is a logical device of its own: a group on cpu:0 refuses cpu:1 tensors.
TEST(ProcessGroupCpuDevice, TensorOnAnotherLogicalCpuIsInvalidNamingBothDevices) {
  SingleRankGroup pg = single_rank_group(cpu(0));
  ASSERT_NE(pg.get(), nullptr);
  auto other = make<float>({4}, {1, 2, 3, 4}, cpu(1));
  EXPECT_EQ(dp_pg_all_reduce(pg.get(), other.get(), DP_SUM), DP_EINVAL);
  EXPECT_NE(last_error().find("argument 'tensor' is float32 4 on cpu:1"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("process group is on cpu:0"), std::string::npos) << last_error();
  auto mine = make<float>({4}, {1, 2, 3, 4}, cpu(0));
  dp_tensor* outs[1] = {other.get()};
  EXPECT_EQ(dp_pg_all_gather(pg.get(), mine.get(), outs, 1), DP_EINVAL);
  EXPECT_NE(last_error().find("'outputs[0]' is float32 4 on cpu:1"), std::string::npos) << last_error();
  DP_EXPECT_OK(dp_pg_all_reduce(pg.get(), mine.get(), DP_SUM));
  EXPECT_EQ(values<float>(mine.get()), (std::vector<float>{1, 2, 3, 4}));

  SingleRankGroup pg2 = single_rank_group(cpu(2));
  ASSERT_NE(pg2.get(), nullptr);
  EXPECT_EQ(dp_pg_broadcast(pg2.get(), mine.get(), 0), DP_EINVAL);
  EXPECT_NE(last_error().find("process group is on cpu:2"), std::string::npos) << last_error();
  auto on_two = make<int32_t>({2}, {5, 6}, cpu(2));
  DP_EXPECT_OK(dp_pg_broadcast(pg2.get(), on_two.get(), 0));
}

// The header promises only MASTER_ADDR and MASTER_PORT for the default store.
TEST(ProcessGroupEnv, CreateWithoutAStoreNeedsOnlyMasterAddrAndPort) {
  clear_launch_env();
  GroupPtr pg = one_rank_group_over_the_default_store();
  ASSERT_NE(pg, nullptr);
  EXPECT_EQ(dp_process_group_size(pg.get()), 1);
  DP_EXPECT_OK(dp_pg_barrier(pg.get()));
}

TEST(ProcessGroupEnv, OptionsRankAndWorldSizeWinOverTheEnvironment) {
  clear_launch_env();
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "8", 1);
  GroupPtr pg = one_rank_group_over_the_default_store();
  ASSERT_NE(pg, nullptr);
  EXPECT_EQ(dp_process_group_rank(pg.get()), 0);
  EXPECT_EQ(dp_process_group_size(pg.get()), 1);
}

TEST(ProcessGroupEnv, EnvironmentFillsOnlyWhatTheOptionsLeaveUnset) {
  clear_launch_env();
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;  // rank and world size -1
  o.timeout_ms = 20000;
  dp_process_group* raw = nullptr;
  EXPECT_EQ(dp_process_group_create(&raw, &o), DP_EINVAL);
  EXPECT_NE(last_error().find("world size is unset (-1) in the options and environment variable WORLD_SIZE is not set"),
            std::string::npos)
      << last_error();
  o.world_size = 1;
  EXPECT_EQ(dp_process_group_create(&raw, &o), DP_EINVAL);
  EXPECT_NE(last_error().find("environment variable RANK is not set"), std::string::npos) << last_error();
  ::setenv("RANK", "1", 1);
  EXPECT_EQ(dp_process_group_create(&raw, &o), DP_EINVAL);
  EXPECT_NE(last_error().find("RANK is '1'; it must be an integer in 0..0"), std::string::npos) << last_error();
  EXPECT_EQ(raw, nullptr);
  ::setenv("RANK", "0", 1);
  DP_ASSERT_OK(dp_process_group_create(&raw, &o));
  GroupPtr pg(raw);
  EXPECT_EQ(dp_process_group_rank(pg.get()), 0);
  DP_EXPECT_OK(dp_pg_barrier(pg.get()));
}

// dp-run's store variables win: MASTER_ADDR:MASTER_PORT is left to the host's
// own framework, here a listening server on a port and an address this host
// cannot serve on (TEST-NET-1), either of which would fail the store.
TEST(ProcessGroupEnv, DefaultStoreIsAtDpStoreAddrAndPortNotMasterAddrAndPort) {
  clear_launch_env();
  dp_store* host_framework = nullptr;
  DP_ASSERT_OK(dp_store_create_tcp(&host_framework, "127.0.0.1", 0, 1, 1, 5000));
  uint16_t taken = 0;
  DP_ASSERT_OK(dp_store_tcp_port(host_framework, &taken));
  ::setenv("MASTER_ADDR", "192.0.2.1", 1);
  ::setenv("MASTER_PORT", std::to_string(taken).c_str(), 1);
  ::setenv("DP_STORE_ADDR", "127.0.0.1", 1);
  ::setenv("DP_STORE_PORT", std::to_string(free_port()).c_str(), 1);
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = 0;
  o.world_size = 1;
  o.timeout_ms = 20000;
  dp_process_group* raw = nullptr;
  EXPECT_EQ(dp_process_group_create(&raw, &o), DP_OK) << dp_last_error();
  GroupPtr pg(raw);
  if (pg != nullptr) {
    DP_EXPECT_OK(dp_pg_barrier(pg.get()));
  }
  pg.reset();
  // And the store's port alone: the address comes from MASTER_ADDR.
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::unsetenv("DP_STORE_ADDR");
  ::setenv("DP_STORE_PORT", std::to_string(free_port()).c_str(), 1);
  raw = nullptr;
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  EXPECT_EQ(dp_process_group_create_from_env(&raw, &o), DP_OK) << dp_last_error();
  dp_process_group_destroy(raw);
  dp_store_destroy(host_framework);
  clear_launch_env();
}
