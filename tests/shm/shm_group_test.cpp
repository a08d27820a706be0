// The shared-memory group with its ranks as threads of this process (one
// file store): all_reduce_coalesced reads and writes the pieces in place,
// as one all_reduce of their concatenation, across rounds and parts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "distributed/process_group.h"
#include "distributed/store/file_store.h"

namespace dparallel::dist {
namespace {

// Runs body(group) on `world` ranks, each a thread with its own group.
void run_ranks(int32_t world, const std::function<void(ProcessGroup&)>& body) {
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
        options.timeout = Millis(60000);
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmGroup, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int32_t>& world) {
                           return std::to_string(world.param) + "Ranks";
                         });

}  // namespace
}  // namespace dparallel::dist
