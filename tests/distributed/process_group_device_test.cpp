// The base class's tensor checks, on a stand-in group: tensors on another
// device than the group's (another GPU, another logical cpu:i) never reach
// the backend's transfer; the call is refused instead. Wrapped
// host memory labelled cuda stands in for GPU memory; nothing reads it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/process_group.h"

namespace dparallel::dist {
namespace {

class CountingGroup : public ProcessGroup {
 public:
  explicit CountingGroup(Device device = Device{DeviceType::kCuda, 0}) : ProcessGroup(0, 2, device, Millis(1000)) {}
  ~CountingGroup() override { drain(); }
  const char* backend_name() const override { return device().is_cuda() ? "nccl" : "gloo"; }
  int runs = 0;

 protected:
  DeviceType tensor_device_type() const override { return device().type; }
  void run_all_reduce(const Tensor&, ReduceOp) override { ++runs; }
  void run_broadcast(const Tensor&, int32_t) override { ++runs; }
  void run_all_gather(const Tensor&, const std::vector<Tensor>&) override { ++runs; }
  void run_reduce_scatter(const std::vector<Tensor>&, const Tensor&, ReduceOp) override { ++runs; }
  void run_barrier() override { ++runs; }
  // The peer agrees with every header; a refusal comes back as the verdict.
  void swap_headers(Call& call) override {
    refusals += call.header.refused != 0 ? 1 : 0;
    mine_ = call.header;
  }
  CallHeader received_header(int32_t r) override {
    CallHeader h = mine_;
    h.rank = r;
    return h;
  }

 public:
  int refusals = 0;

 private:
  CallHeader mine_{};
};

float g_memory[64];

Tensor on(DeviceType type, int32_t index) {
  return Tensor::wrap(Storage::wrap(Device{type, index}, g_memory, sizeof g_memory, nullptr), 0, DType::kFloat32, {16});
}

// The message of the invalid-argument error `call` raises ("" if none).
template <typename F>
std::string invalid(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(ProcessGroupDevice, TensorOnAnotherGpuIsRejectedNamingTheArgumentAndBothGpus) {
  CountingGroup group;
  Tensor other = on(DeviceType::kCuda, 1);
  std::string m = invalid([&] { group.all_reduce(other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("all_reduce: argument 'tensor'"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda:1"), std::string::npos) << m;
  EXPECT_NE(m.find("is on cuda:0"), std::string::npos) << m;
  m = invalid([&] { group.broadcast(other, 0, true); });
  EXPECT_NE(m.find("broadcast: argument 'tensor'"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
  group.barrier(false);  // after the queued (async) refusal
  EXPECT_EQ(group.refusals, 2);
}

TEST(ProcessGroupDevice, TensorOnAnotherLogicalCpuIsRefused) {
  CountingGroup group(Device{DeviceType::kCpu, 0});
  Tensor other = on(DeviceType::kCpu, 1), mine = on(DeviceType::kCpu, 0);
  std::string m = invalid([&] { group.all_reduce(other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("all_reduce: argument 'tensor' is float32 16 on cpu:1"), std::string::npos) << m;
  EXPECT_NE(m.find("gloo process group is on cpu:0"), std::string::npos) << m;
  m = invalid([&] { group.all_gather(mine, {mine, other}, false); });
  EXPECT_NE(m.find("'outputs[1]' is float32 16 on cpu:1"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
  EXPECT_EQ(group.refusals, 2);
  group.all_reduce(mine, ReduceOp::kSum, false);
  EXPECT_EQ(group.runs, 1);
}

TEST(ProcessGroupDevice, OneOutputOrInputOnAnotherGpuIsNamedByIndex) {
  CountingGroup group;
  Tensor mine = on(DeviceType::kCuda, 0), other = on(DeviceType::kCuda, 3);
  std::string m = invalid([&] { group.all_gather(mine, {mine, other}, false); });
  EXPECT_NE(m.find("'outputs[1]'"), std::string::npos) << m;
  m = invalid([&] { group.reduce_scatter({other, mine}, mine, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("'inputs[0]'"), std::string::npos) << m;
  m = invalid([&] { group.reduce_scatter({mine, mine}, other, ReduceOp::kSum, false); });
  EXPECT_NE(m.find("'output'"), std::string::npos) << m;
  EXPECT_EQ(group.runs, 0);
}

TEST(ProcessGroupDevice, CpuTensorOnACudaGroupIsRejected) {
  CountingGroup group;
  std::string m = invalid([&] { group.all_reduce(on(DeviceType::kCpu, 0), ReduceOp::kSum, false); });
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
