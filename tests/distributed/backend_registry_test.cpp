// The backend registry (one row per DP_BACKEND_* value, found by value and by
// name, availability refused with the row's reason, the cross-host leg chosen
// by what the rows offer) and what each backend's groups say they offer
// (BackendCapabilities), on groups whose ranks are threads of this process.
#include "distributed/backend_registry.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "device/cuda/cuda_runtime.h"
#include "distributed/process_group.h"
#include "distributed/shm/shm_backend.h"
#include "distributed/shm/shm_process_group.h"
#include "distributed/store/file_store.h"
#include "dparallel/dp_dist.h"

namespace dparallel::dist {
namespace {

const Device kCpu{DeviceType::kCpu, 0};

// The C header's values, by their names.
const std::map<std::string, int32_t> kCValues = {
    {"DP_BACKEND_AUTO", DP_BACKEND_AUTO}, {"DP_BACKEND_GLOO", DP_BACKEND_GLOO}, {"DP_BACKEND_NCCL", DP_BACKEND_NCCL},
    {"DP_BACKEND_SHM", DP_BACKEND_SHM},   {"DP_BACKEND_MPI", DP_BACKEND_MPI},
};

TEST(BackendRegistry, EveryCValueHasExactlyOneRowUnderItsName) {
  const std::vector<BackendEntry>& rows = backend_registry();
  EXPECT_EQ(rows.size(), kCValues.size());
  for (const auto& [request, value] : kCValues) {
    size_t found = 0;
    for (const BackendEntry& row : rows) {
      if (static_cast<int32_t>(row.choice) != value) continue;
      ++found;
      EXPECT_STREQ(row.request, request.c_str());
    }
    EXPECT_EQ(found, 1U) << request;
  }
}

TEST(BackendRegistry, NamesAndValuesRoundTrip) {
  std::set<std::string> names;
  for (const BackendEntry& row : backend_registry()) {
    EXPECT_TRUE(names.insert(row.name).second) << "two rows named " << row.name;
    const BackendEntry* by_value = find_backend(row.choice);
    ASSERT_NE(by_value, nullptr) << row.request;
    EXPECT_EQ(by_value, &row);
    const BackendEntry* by_name = find_backend_named(row.name);
    ASSERT_NE(by_name, nullptr) << row.name;
    EXPECT_EQ(by_name->choice, row.choice);
  }
  EXPECT_EQ(find_backend_named("shm+gloo"), nullptr);  // composed, not a row
  EXPECT_EQ(find_backend_named(""), nullptr);
  EXPECT_EQ(find_backend(static_cast<BackendChoice>(7)), nullptr);
}

TEST(BackendRegistry, OnlyAutoHasNoFactory) {
  for (const BackendEntry& row : backend_registry()) {
    EXPECT_EQ(row.make == nullptr, row.choice == BackendChoice::kAuto) << row.request;
  }
}

TEST(BackendRegistry, NcclOnAMissingGpuIsRefusedSayingWhy) {
  const Device missing{DeviceType::kCuda, cuda::device_count() + 1};
  const BackendEntry& nccl = *find_backend(BackendChoice::kNccl);
  try {
    check_available(nccl, missing);
    FAIL() << "NCCL on " << to_string(missing) << " was available";
  } catch (const Error& e) {
    // kDevice where NCCL was built in, kUnsupported where it was not.
    EXPECT_TRUE(e.code() == StatusCode::kDevice || e.code() == StatusCode::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
  }
}

TEST(BackendRegistry, GroupCreationRefusesAnUnavailableBackendWithItsReason) {
  char dir_template[] = "/tmp/dp_backend_registry_XXXXXX";
  std::string dir = ::mkdtemp(dir_template);
  ProcessGroupOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.backend = BackendChoice::kNccl;
  options.device = Device{DeviceType::kCuda, cuda::device_count() + 1};
  options.store = std::make_shared<FileStore>(dir + "/store", 1);
  options.timeout = Millis(60000);
  std::string expected;
  try {
    check_available(*find_backend(BackendChoice::kNccl), options.device);
  } catch (const Error& e) {
    expected = e.what();
  }
  try {
    create_process_group(options);
    ADD_FAILURE() << "a group over NCCL on " << to_string(options.device) << " was made";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == StatusCode::kDevice || e.code() == StatusCode::kUnsupported) << e.what();
    EXPECT_EQ(std::string(e.what()), expected);
  }
  options.store.reset();
  ::unlink((dir + "/store").c_str());
  ::rmdir(dir.c_str());
}

TEST(BackendRegistry, CrossHostLegOnCpuIsTheFirstRowThatCrossesHosts) {
  const BackendEntry& cross = cross_host_backend(kCpu);
  EXPECT_EQ(cross.choice, BackendChoice::kGloo);
  EXPECT_TRUE(cross.crosses_hosts);
  EXPECT_FALSE(find_backend(BackendChoice::kShm)->crosses_hosts);
}

TEST(BackendRegistry, OptionsNameTheBackendsThatRunOnTheDevice) {
  ProcessGroupOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.backend = BackendChoice::kGloo;
  options.device = Device{DeviceType::kCuda, 0};
  try {
    check_process_group_options(options);
    FAIL() << "Gloo on cuda:0 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(
        std::string(e.what()).find("the Gloo backend works on cpu tensors; use DP_BACKEND_AUTO or DP_BACKEND_NCCL"),
        std::string::npos)
        << e.what();
  }
  options.backend = static_cast<BackendChoice>(7);
  try {
    check_process_group_options(options);
    FAIL() << "backend 7 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(
                  "DP_BACKEND_AUTO, DP_BACKEND_GLOO, DP_BACKEND_NCCL, DP_BACKEND_SHM or DP_BACKEND_MPI"),
              std::string::npos)
        << e.what();
  }
}

// Runs body(rank, group) on `world` ranks, each a thread with the group `make` makes.
void run_ranks(int32_t world, const std::function<std::unique_ptr<ProcessGroup>(const ProcessGroupOptions&)>& make,
               const std::function<void(int32_t, ProcessGroup&)>& body) {
  char dir_template[] = "/tmp/dp_backend_caps_XXXXXX";
  std::string dir = ::mkdtemp(dir_template);
  std::string path = dir + "/store";
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ProcessGroupOptions options;
        options.rank = r;
        options.world_size = world;
        options.store = std::make_shared<FileStore>(path, world);
        options.timeout = Millis(60000);
        std::unique_ptr<ProcessGroup> group = make(options);
        body(r, *group);
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

std::function<std::unique_ptr<ProcessGroup>(const ProcessGroupOptions&)> asking_for(BackendChoice choice) {
  return [choice](const ProcessGroupOptions& given) {
    ProcessGroupOptions options = given;
    options.backend = choice;
    return create_process_group(options);
  };
}

TEST(BackendCapabilities, ShmOffersRegionsInPlaceRunsAndHostCoreTransfers) {
  run_ranks(2, asking_for(BackendChoice::kShm), [](int32_t, ProcessGroup& group) {
    EXPECT_STREQ(group.backend_name(), "shm");
    const BackendCapabilities caps = group.capabilities();
    EXPECT_TRUE(caps.shared_regions);
    EXPECT_TRUE(caps.in_place_runs);
    EXPECT_TRUE(caps.transfers_on_host_cores);
    EXPECT_FALSE(caps.transfer_stream);
    EXPECT_FALSE(caps.control_stream);
    EXPECT_EQ(caps.tensor_device, DeviceType::kCpu);
    EXPECT_EQ(caps.threads, ThreadModel::kCallerWaits);
    // The capability is the service: a region comes back.
    EXPECT_NE(group.create_region(4096), nullptr);
  });
}

TEST(BackendCapabilities, GlooOffersNoRegionsNorInPlaceRuns) {
  run_ranks(2, asking_for(BackendChoice::kGloo), [](int32_t, ProcessGroup& group) {
    EXPECT_STREQ(group.backend_name(), "gloo");
    const BackendCapabilities caps = group.capabilities();
    EXPECT_FALSE(caps.shared_regions);
    EXPECT_FALSE(caps.in_place_runs);
    EXPECT_FALSE(caps.transfers_on_host_cores);
    EXPECT_FALSE(caps.transfer_stream);
    EXPECT_FALSE(caps.control_stream);
    EXPECT_EQ(caps.tensor_device, DeviceType::kCpu);
    EXPECT_EQ(caps.threads, ThreadModel::kCallerWaits);
    EXPECT_EQ(group.create_region(4096), nullptr);
  });
}

// A shared-memory group in a job across hosts spins briefly at its waits:
// its peers wait on the network with the cores a long spin would take.
TEST(BackendCapabilities, ShmGroupOfAJobAcrossHostsSpinsBrieflyAndOneOfASingleHostLong) {
  for (bool paced : {true, false}) {
    auto make = [paced](const ProcessGroupOptions& asked) {
      ProcessGroupOptions options = asked;
      options.network_paced = paced;
      return create_shm_process_group(options, paced ? "paced/" : "unpaced/");
    };
    run_ranks(2, make, [paced](int32_t rank, ProcessGroup& group) {
      const auto* backend = dynamic_cast<const shm::ShmBackend*>(&group.backend());
      ASSERT_NE(backend, nullptr);
      EXPECT_EQ(backend->network_paced(), paced);
      Tensor t = Tensor::empty(DType::kFloat32, {3}, kCpu);
      for (int i = 0; i < 3; ++i) static_cast<float*>(t.data())[i] = static_cast<float>(rank + 1);
      group.all_reduce(t, ReduceOp::kSum, false);
      EXPECT_EQ(static_cast<float*>(t.data())[2], 3.0F);
    });
  }
}

// Two hosts of two ranks: the local leg from the shm row, the cross leg the
// registry picks for cpu; the composed group offers neither leg's extras.
TEST(BackendCapabilities, HierarchicalComposesItsLegsAndOffersNoRegions) {
  const BackendEntry& local = *find_backend(BackendChoice::kShm);
  const BackendEntry& cross = cross_host_backend(kCpu);
  auto make = [&](const ProcessGroupOptions& options) {
    HostLayout layout;
    layout.hosts = 2;
    layout.local_size = 2;
    layout.host = options.rank / 2;
    layout.local_rank = options.rank % 2;
    return make_process_group(options, [&](CallSite& site) {
      return create_hierarchical_backend(site, options, "hier-test/", layout, local, cross);
    });
  };
  run_ranks(4, make, [](int32_t rank, ProcessGroup& group) {
    EXPECT_STREQ(group.backend_name(), "shm+gloo");
    const BackendCapabilities caps = group.capabilities();
    EXPECT_FALSE(caps.shared_regions);
    EXPECT_FALSE(caps.in_place_runs);
    EXPECT_FALSE(caps.transfers_on_host_cores);
    EXPECT_EQ(caps.tensor_device, DeviceType::kCpu);
    EXPECT_EQ(group.create_region(4096), nullptr);
    // Both legs carry a collective: 1 + 2 + 3 + 4 on every rank.
    Tensor t = Tensor::empty(DType::kFloat32, {5}, kCpu);
    auto* p = static_cast<float*>(t.data());
    for (int i = 0; i < 5; ++i) p[i] = static_cast<float>(rank + 1);
    group.all_reduce(t, ReduceOp::kSum, false);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(p[i], 10.0F) << "element " << i;
  });
}

}  // namespace
}  // namespace dparallel::dist
