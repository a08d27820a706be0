// The front's tensor checks, over a stand-in backend: tensors on another
// device than the group's (another GPU, another logical cpu:i) never reach
// the backend's transfer; the call is refused instead. Wrapped
// host memory labelled cuda stands in for GPU memory; nothing reads it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/process_group.h"
#include "error_util.h"

namespace dparallel::dist {
namespace {

struct Counts {
  int runs = 0;
  int refusals = 0;
};

// Counts the collectives that reach it; every peer agrees with every header.
class CountingBackend : public Backend {
 public:
  CountingBackend(CallSite& site, Counts& counts) : Backend(site), counts_(counts) {}
  const char* name() const override { return device().is_cuda() ? "nccl" : "gloo"; }
  BackendCapabilities capabilities() const override {
    BackendCapabilities caps;
    caps.tensor_device = device().type;
    return caps;
  }
  void all_reduce(const Tensor&, ReduceOp) override { ++counts_.runs; }
  void broadcast(const Tensor&, int32_t) override { ++counts_.runs; }
  void all_gather(const Tensor&, const std::vector<Tensor>&) override { ++counts_.runs; }
  void reduce_scatter(const std::vector<Tensor>&, const Tensor&, ReduceOp) override { ++counts_.runs; }
  void barrier() override { ++counts_.runs; }
  // A refusal comes back as the verdict.
  void swap_headers(Call& call) override {
    counts_.refusals += call.header.refused != 0 ? 1 : 0;
    mine_ = call.header;
  }
  CallHeader received_header(int32_t r) override {
    CallHeader h = mine_;
    h.rank = r;
    return h;
  }

 private:
  Counts& counts_;
  CallHeader mine_{};
};

// Rank 0 of 2 on `device`.
class CountingGroup : public Counts {
 public:
  explicit CountingGroup(Device device = Device{DeviceType::kCuda, 0})
      : group_(0, 2, device, Millis(1000),
               [this](CallSite& site) { return std::make_unique<CountingBackend>(site, *this); }) {}
  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op, bool async) {
    return group_.all_reduce(tensor, op, async);
  }
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int32_t root, bool async) {
    return group_.broadcast(tensor, root, async);
  }
  std::shared_ptr<Work> all_gather(const Tensor& input, const std::vector<Tensor>& outputs, bool async) {
    return group_.all_gather(input, outputs, async);
  }
  std::shared_ptr<Work> reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op,
                                       bool async) {
    return group_.reduce_scatter(inputs, output, op, async);
  }
  std::shared_ptr<Work> barrier(bool async) { return group_.barrier(async); }

 private:
  ProcessGroup group_;
};

float g_memory[64];

Tensor on(DeviceType type, int32_t index) {
  return Tensor::wrap(Storage::wrap(Device{type, index}, g_memory, sizeof g_memory, nullptr), 0, DType::kFloat32, {16});
}

TEST(ProcessGroupDevice, TensorOnAnotherGpuIsRejectedNamingTheArgumentAndBothGpus) {
  CountingGroup group;
  Tensor other = on(DeviceType::kCuda, 1);
  std::string m = dptest::invalid_argument_error_of([&] { group.all_reduce(other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("all_reduce: argument 'tensor'"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda:1"), std::string::npos) << m;
  EXPECT_NE(m.find("is on cuda:0"), std::string::npos) << m;
  m = dptest::invalid_argument_error_of([&] { group.broadcast(other, 0, true); });
  EXPECT_NE(m.find("broadcast: argument 'tensor'"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
  group.barrier(false);  // after the queued (async) refusal
  EXPECT_EQ(group.refusals, 2);
}

TEST(ProcessGroupDevice, TensorOnAnotherLogicalCpuIsRefused) {
  CountingGroup group(Device{DeviceType::kCpu, 0});
  Tensor other = on(DeviceType::kCpu, 1), mine = on(DeviceType::kCpu, 0);
  std::string m = dptest::invalid_argument_error_of([&] { group.all_reduce(other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("all_reduce: argument 'tensor' is float32 16 on cpu:1"), std::string::npos) << m;
  EXPECT_NE(m.find("gloo process group is on cpu:0"), std::string::npos) << m;
  m = dptest::invalid_argument_error_of([&] { group.all_gather(mine, {mine, other}, false); });
  EXPECT_NE(m.find("'outputs[1]' is float32 16 on cpu:1"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
  EXPECT_EQ(group.refusals, 2);
  group.all_reduce(mine, ReduceOp::kSum, false);
  EXPECT_EQ(group.runs, 1);
}

TEST(ProcessGroupDevice, OneOutputOrInputOnAnotherGpuIsNamedByIndex) {
  CountingGroup group;
  Tensor mine = on(DeviceType::kCuda, 0), other = on(DeviceType::kCuda, 3);
  std::string m = dptest::invalid_argument_error_of([&] { group.all_gather(mine, {mine, other}, false); });
  EXPECT_NE(m.find("'outputs[1]'"), std::string::npos) << m;
  m = dptest::invalid_argument_error_of([&] { group.reduce_scatter({other, mine}, mine, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("'inputs[0]'"), std::string::npos) << m;
  m = dptest::invalid_argument_error_of([&] { group.reduce_scatter({mine, mine}, other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("'output'"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
}

TEST(ProcessGroupDevice, CpuTensorOnACudaGroupIsRejected) {
  CountingGroup group;
  std::string m =
      dptest::invalid_argument_error_of([&] { group.all_reduce(on(DeviceType::kCpu, 0), ReduceOp::kSum, false); });
  EXPECT_NE(m.find("works on cuda tensors"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
}

TEST(ProcessGroupDevice, TensorsOnTheGroupsGpuRun) {
  CountingGroup group;
  Tensor mine = on(DeviceType::kCuda, 0);
  group.all_reduce(mine, ReduceOp::kAvg, false);
  group.all_gather(mine, {mine, mine}, false);
  group.reduce_scatter({mine, mine}, mine, ReduceOp::kMax, false);
  group.broadcast(mine, 1, true)->wait();
  EXPECT_EQ(group.runs, 4);
}

}  // namespace
}  // namespace dparallel::dist
