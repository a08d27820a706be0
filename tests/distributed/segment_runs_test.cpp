// ProcessGroup::all_gather_runs and reduce_scatter_runs: each rank's segment
// or part made of runs of other tensors, on shared memory (straight through
// the slots) and on Gloo (the backends' contiguous scratch), paired with the
// plain collectives on other ranks, and their argument checks.
#include <gtest/gtest.h>
#include <unistd.h>

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

const Device kCpu{DeviceType::kCpu, 0};

void run_ranks(BackendChoice backend, int32_t world, const std::function<void(ProcessGroup&)>& body) {
  char dir_template[] = "/tmp/dp_segment_runs_XXXXXX";
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
        options.backend = backend;
        options.store = std::make_shared<FileStore>(path, world);
        options.timeout = Millis(60000);
        body(*create_process_group(options));
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

Tensor floats(const std::vector<float>& values) {
  Tensor t = Tensor::empty(DType::kFloat32, {static_cast<int64_t>(values.size())}, kCpu);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(float));
  return t;
}

std::vector<float> read(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * sizeof(float));
  return v;
}

SegmentRun run(size_t offset, const Tensor& t) {
  return SegmentRun{offset, t.view_at(0, DType::kUInt8, {static_cast<int64_t>(t.nbytes())})};
}

class SegmentRuns : public ::testing::TestWithParam<BackendChoice> {};

// A segment of 3 MiB + 40 bytes (several shm rounds): rank r's floats r*1000
// + i at bytes [16, 16 + 4n) and a second run near the end, a gap between.
// Rank 1 makes a plain all_gather of the same bytes, and sees the gaps as
// whatever its peers' runs left there; the others see only the runs.
TEST_P(SegmentRuns, AllGatherRunsLandWhereTheyAreNamedAndPairWithAPlainAllGather) {
  const size_t segment = (3u << 20) + 40;
  const int64_t n = (1 << 18) + 3, tail = 5;
  const size_t tail_at = segment - tail * sizeof(float);
  run_ranks(GetParam(), 3, [&](ProcessGroup& g) {
    auto mine = [&](int32_t r, int64_t count, float base) {
      std::vector<float> v(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = base + static_cast<float>(r * 1000 + i);
      return v;
    };
    if (g.rank() == 1) {
      Tensor whole = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(segment)}, kCpu);
      std::memcpy(static_cast<uint8_t*>(whole.data()) + 16, mine(1, n, 0).data(), static_cast<size_t>(n) * 4);
      std::memcpy(static_cast<uint8_t*>(whole.data()) + tail_at, mine(1, tail, 0.5f).data(), tail * 4);
      Tensor gathered = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(segment) * 3}, kCpu);
      std::vector<Tensor> outputs;
      for (size_t q = 0; q < 3; ++q) {
        outputs.push_back(gathered.view_at(q * segment, DType::kUInt8, {static_cast<int64_t>(segment)}));
      }
      g.all_gather(whole, outputs, false);
      for (int32_t q : {0, 2}) {
        std::vector<float> got(static_cast<size_t>(n));
        std::memcpy(got.data(), static_cast<uint8_t*>(outputs[static_cast<size_t>(q)].data()) + 16, got.size() * 4);
        EXPECT_EQ(got, mine(q, n, 0)) << "rank " << q;
      }
      return;
    }
    Tensor head = floats(mine(g.rank(), n, 0)), end = floats(mine(g.rank(), tail, 0.5f));
    std::vector<std::vector<SegmentRun>> places(3);
    std::vector<Tensor> heads, ends;
    for (int32_t q = 0; q < 3; ++q) {
      heads.push_back(Tensor::zeros(DType::kFloat32, {n}, kCpu));
      ends.push_back(Tensor::zeros(DType::kFloat32, {tail}, kCpu));
      if (q == g.rank()) continue;
      places[static_cast<size_t>(q)] = {run(16, heads.back()), run(tail_at, ends.back())};
    }
    g.all_gather_runs(segment, {run(16, head), run(tail_at, end)}, places, false);
    for (int32_t q = 0; q < 3; ++q) {
      if (q == g.rank()) continue;
      EXPECT_EQ(read(heads[static_cast<size_t>(q)]), mine(q, n, 0)) << "rank " << q;
      EXPECT_EQ(read(ends[static_cast<size_t>(q)]), mine(q, tail, 0.5f)) << "rank " << q;
    }
  });
}

// Each rank's part of 300000 floats is two runs with a gap (zeros); rank 2
// makes a plain reduce_scatter of the same parts. Every rank gets the
// average of its part over the ranks.
TEST_P(SegmentRuns, ReduceScatterRunsAverageEveryRanksPartsGapsAsZeros) {
  const int64_t part = 300000, first = 1000, gap = 7, second = part - first - gap - 9;
  run_ranks(GetParam(), 3, [&](ProcessGroup& g) {
    auto value = [](int32_t rank, int32_t q, int64_t i) { return static_cast<float>((rank + 1) * 3 + q + i % 11); };
    auto part_values = [&](int32_t rank, int32_t q) {
      std::vector<float> v(static_cast<size_t>(part), 0.0f);
      for (int64_t i = 0; i < first; ++i) v[static_cast<size_t>(i)] = value(rank, q, i);
      for (int64_t i = first + gap; i < first + gap + second; ++i) v[static_cast<size_t>(i)] = value(rank, q, i);
      return v;
    };
    Tensor output = Tensor::empty(DType::kFloat32, {part}, kCpu);
    std::vector<Tensor> keep;
    if (g.rank() == 2) {
      std::vector<Tensor> inputs;
      for (int32_t q = 0; q < 3; ++q) inputs.push_back(floats(part_values(2, q)));
      g.reduce_scatter(inputs, output, ReduceOp::kAvg, false);
    } else {
      std::vector<std::vector<SegmentRun>> parts(3);
      for (int32_t q = 0; q < 3; ++q) {
        std::vector<float> v = part_values(g.rank(), q);
        keep.push_back(floats(std::vector<float>(v.begin(), v.begin() + first)));
        Tensor a = keep.back();
        keep.push_back(floats(std::vector<float>(v.begin() + first + gap, v.begin() + first + gap + second)));
        Tensor b = keep.back();
        parts[static_cast<size_t>(q)] = {SegmentRun{0, a}, SegmentRun{static_cast<size_t>(first + gap) * 4, b}};
      }
      g.reduce_scatter_runs(parts, output, ReduceOp::kAvg, false);
    }
    std::vector<float> expected(static_cast<size_t>(part), 0.0f);
    for (int32_t r = 0; r < 3; ++r) {
      std::vector<float> v = part_values(r, g.rank());
      for (size_t i = 0; i < v.size(); ++i) expected[i] += v[i];
    }
    for (float& e : expected) e /= 3.0f;
    std::vector<float> got = read(output);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-5) << "element " << i;
  });
}

// With `accumulate` the average lands on top of what the output held. Each
// rank's part of 700001 floats (several shm rounds) is one run, read where
// it lies, except rank 1's own, which ends 3 floats short (the rest zeros);
// every rank ends with its old values plus the average, bit for bit what
// a plain reduce_scatter and an addition give.
TEST_P(SegmentRuns, ReduceScatterRunsAccumulateAddsTheAverageToTheOutput) {
  const int64_t part = 700001;
  run_ranks(GetParam(), 2, [&](ProcessGroup& g) {
    auto value = [](int32_t rank, int32_t q, int64_t i) {
      return static_cast<float>(rank * 7 + q) + static_cast<float>(i % 97) / 8.0f;
    };
    auto covered = [&](int32_t q) { return q == 1 ? part - 3 : part; };
    std::vector<Tensor> keep;
    std::vector<std::vector<SegmentRun>> parts(2);
    for (int32_t q = 0; q < 2; ++q) {
      std::vector<float> v(static_cast<size_t>(covered(q)));
      for (size_t i = 0; i < v.size(); ++i) v[i] = value(g.rank(), q, static_cast<int64_t>(i));
      keep.push_back(floats(v));
      parts[static_cast<size_t>(q)] = {SegmentRun{0, keep.back()}};
    }
    std::vector<float> old(static_cast<size_t>(part));
    for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<float>(i % 13) - 6.0f + 0.25f;
    Tensor output = floats(old);
    g.reduce_scatter_runs(parts, output, ReduceOp::kAvg, false, true);
    std::vector<float> got = read(output);
    ASSERT_EQ(got.size(), old.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const auto at = static_cast<int64_t>(i);
      float sum = 0.0f;
      for (int32_t r = 0; r < 2; ++r) sum += at < covered(g.rank()) ? value(r, g.rank(), at) : 0.0f;
      ASSERT_EQ(got[i], old[i] + sum / 2.0f) << "element " << i;
    }
  });
}

// Runs outside the segment or part, overlapping runs, runs of another
// dtype or overlapping the output are refused by name on the calling rank,
// and the other ranks' matching calls fail naming it; the group stays usable.
TEST_P(SegmentRuns, BadRunsAreRefusedNamingTheRunAndTheGroupStaysUsable) {
  run_ranks(GetParam(), 2, [&](ProcessGroup& g) {
    Tensor t = floats({1, 2, 3, 4});
    auto refused = [&](const std::function<void()>& call, const std::string& needle) {
      try {
        call();
        ADD_FAILURE() << "not refused: " << needle;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "[" << e.what() << "]";
      }
    };
    std::vector<std::vector<SegmentRun>> none(2);
    refused([&] { g.all_gather_runs(8, {run(0, t)}, none, false); }, "sources[0] covers bytes 0 to 16 of a 8-byte");
    Tensor out = floats({0, 0, 0, 0});
    std::vector<std::vector<SegmentRun>> overlapping(2);
    overlapping[1] = {SegmentRun{0, t}, SegmentRun{4, t.view_at(0, DType::kFloat32, {1})}};
    refused([&] { g.reduce_scatter_runs(overlapping, out, ReduceOp::kSum, false); }, "parts[1][1]");
    std::vector<std::vector<SegmentRun>> into_output(2);
    into_output[0] = {SegmentRun{0, out}};
    refused([&] { g.reduce_scatter_runs(into_output, out, ReduceOp::kSum, false); }, "overlaps argument 'output'");
    // Still in step: a plain all_reduce works.
    Tensor one = floats({static_cast<float>(g.rank() + 1)});
    g.all_reduce(one, ReduceOp::kSum, false);
    EXPECT_EQ(read(one), std::vector<float>{3});
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, SegmentRuns, ::testing::Values(BackendChoice::kShm, BackendChoice::kGloo),
                         [](const ::testing::TestParamInfo<BackendChoice>& param) {
                           return param.param == BackendChoice::kShm ? std::string("shm") : std::string("gloo");
                         });

}  // namespace
}  // namespace dparallel::dist
