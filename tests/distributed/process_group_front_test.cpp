// The process-group front over a scripted backend that only moves headers:
// sequence numbers, the verdict on the peers' headers, refusals, and the
// failure of a transfer, all decided by the front whatever the backend.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/call_header.h"
#include "distributed/process_group.h"
#include "distributed/store/file_store.h"

namespace dparallel::dist {
namespace {

constexpr int32_t kWorld = 3;

// What the scripted backend does and saw: the peers' headers are
// `peer(mine, r)`; a swap may fail its transfer instead, through the
// front's fail_call.
struct Script {
  std::function<CallHeader(const CallHeader& mine, int32_t r)> peer = [](const CallHeader& mine, int32_t r) {
    CallHeader h = mine;
    h.rank = r;
    h.refused = 0;
    h.reason[0] = '\0';
    return h;
  };
  StatusCode transfer_failure = StatusCode::kOk;  // kOk: the swap succeeds
  std::vector<CallHeader> sent;                   // every header this rank swapped
  std::vector<uint64_t> ran;                      // the collectives that passed the verdict
  int failed_verdicts = 0;
};

// A backend that only moves headers, as `script` says.
class ScriptedBackend : public Backend {
 public:
  ScriptedBackend(CallSite& site, Script& script) : Backend(site), script_(script) {}

  const char* name() const override { return "scripted"; }
  BackendCapabilities capabilities() const override { return {}; }
  void report_to(std::shared_ptr<Store> store) { set_failure_reports(std::move(store), "front/"); }

  void swap_headers(Call& call) override {
    script_.sent.push_back(call.header);
    if (script_.transfer_failure != StatusCode::kOk) {
      fail_call(call, script_.transfer_failure, "scripted: the link went down");
    }
    received_.assign(1, call.header);
    for (int32_t r = 1; r < kWorld; ++r) received_.push_back(script_.peer(call.header, r));
  }
  CallHeader received_header(int32_t r) override { return received_[static_cast<size_t>(r)]; }
  void after_failed_verdict() override { ++script_.failed_verdicts; }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    run(begin_call(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, &tensor));
  }
  void broadcast(const Tensor& tensor, int32_t root) override {
    run(begin_call(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, &tensor));
  }
  void all_gather(const Tensor& input, const std::vector<Tensor>&) override {
    run(begin_call(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input));
  }
  void reduce_scatter(const std::vector<Tensor>&, const Tensor& output, ReduceOp op) override {
    run(begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output));
  }
  void barrier() override { run(begin_call(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr)); }

 private:
  void run(Call call) {
    exchange_headers(call);
    script_.ran.push_back(call.header.seq);
  }

  Script& script_;
  std::vector<CallHeader> received_;
};

// Rank 0 of kWorld: the front over a scripted backend.
class ScriptedGroup : public Script {
 public:
  ScriptedGroup()
      : group_(0, kWorld, Device{DeviceType::kCpu, 0}, Millis(60000), [this](CallSite& site) {
          auto backend = std::make_unique<ScriptedBackend>(site, *this);
          backend_ = backend.get();
          return backend;
        }) {}

  void report_to(std::shared_ptr<Store> store) { backend_->report_to(std::move(store)); }
  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op, bool async) {
    return group_.all_reduce(tensor, op, async);
  }
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int32_t root, bool async) {
    return group_.broadcast(tensor, root, async);
  }
  std::shared_ptr<Work> barrier(bool async) { return group_.barrier(async); }

 private:
  ScriptedBackend* backend_ = nullptr;
  ProcessGroup group_;
};

// The error a call raises, or kOk; its message in *message.
template <typename F>
StatusCode status_of(F&& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

Tensor floats(int64_t n) { return Tensor::empty(DType::kFloat32, {n}, Device{DeviceType::kCpu, 0}); }

TEST(ProcessGroupFront, NumbersEveryCollectiveInIssueOrderAcrossKinds) {
  ScriptedGroup g;
  Tensor t = floats(8);
  g.all_reduce(t, ReduceOp::kSum, false);
  g.broadcast(t, 2, false);
  g.barrier(true)->wait();
  g.all_reduce(t, ReduceOp::kMax, true)->wait();
  EXPECT_EQ(g.ran, (std::vector<uint64_t>{1, 2, 3, 4}));
  ASSERT_EQ(g.sent.size(), 4u);
  EXPECT_EQ(g.sent[1].kind, static_cast<uint32_t>(CallKind::kBroadcast));
  EXPECT_EQ(g.sent[1].root, 2);
  EXPECT_EQ(g.sent[3].op, static_cast<int32_t>(ReduceOp::kMax));
  EXPECT_EQ(g.failed_verdicts, 0);
}

TEST(ProcessGroupFront, APeerWithAnotherSizeFailsEveryCollectiveAliveAndTheGroupStaysUsable) {
  ScriptedGroup g;
  g.peer = [](const CallHeader& mine, int32_t r) {
    CallHeader h = mine;
    h.rank = r;
    if (r == 2) h.numel = mine.numel + 1;
    return h;
  };
  Tensor t = floats(8);
  std::string message;
  EXPECT_EQ(status_of([&] { g.all_reduce(t, ReduceOp::kSum, false); }, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 2"), std::string::npos) << message;
  EXPECT_EQ(g.failed_verdicts, 1);
  EXPECT_TRUE(g.ran.empty());
  g.peer = [](const CallHeader& mine, int32_t r) {
    CallHeader h = mine;
    h.rank = r;
    return h;
  };
  g.all_reduce(t, ReduceOp::kSum, false);
  EXPECT_EQ(g.ran, (std::vector<uint64_t>{2}));
}

TEST(ProcessGroupFront, APeerOutOfStepBreaksTheGroup) {
  ScriptedGroup g;
  g.peer = [](const CallHeader& mine, int32_t r) {
    CallHeader h = mine;
    h.rank = r;
    if (r == 1) h.seq = mine.seq + 1;
    return h;
  };
  Tensor t = floats(4);
  std::string message;
  EXPECT_EQ(status_of([&] { g.all_reduce(t, ReduceOp::kSum, false); }, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
  EXPECT_EQ(status_of([&] { g.barrier(false); }), StatusCode::kState);
}

TEST(ProcessGroupFront, ARefusedCallTakesItsNumberAndTellsThePeers) {
  ScriptedGroup g;
  Tensor flags = Tensor::empty(DType::kBool, {4}, Device{DeviceType::kCpu, 0});
  std::string message;
  EXPECT_EQ(status_of([&] { g.all_reduce(flags, ReduceOp::kAvg, false); }, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("DP_AVG"), std::string::npos) << message;
  ASSERT_EQ(g.sent.size(), 1u);
  EXPECT_NE(g.sent[0].refused, 0u);
  EXPECT_EQ(g.sent[0].seq, 1u);
  EXPECT_NE(std::string(g.sent[0].reason).find("DP_AVG"), std::string::npos);
  Tensor t = floats(4);
  g.all_reduce(t, ReduceOp::kSum, false);
  EXPECT_EQ(g.ran, (std::vector<uint64_t>{2}));
}

TEST(ProcessGroupFront, AFailedTransferNamesTheCallItsTensorAndTheRanksThatDidNotReport) {
  std::string path = str_cat(::testing::TempDir(), "front_store_", ::getpid());
  auto store = std::make_shared<FileStore>(path, 1);
  ScriptedGroup g;
  g.report_to(store);
  g.transfer_failure = StatusCode::kRemote;
  Tensor t = floats(8);
  std::string message;
  EXPECT_EQ(status_of([&] { g.all_reduce(t, ReduceOp::kSum, false); }, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("all_reduce of " + t.describe() +
                         " (collective #1) on rank 0 of 3 failed: rank(s) 1, 2 did "
                         "not arrive"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("; scripted: the link went down"), std::string::npos) << message;
  EXPECT_TRUE(store->check({"front/failed/1/0"})) << "this rank reported its failure";
  g.transfer_failure = StatusCode::kOk;
  EXPECT_EQ(status_of([&] { g.barrier(false); }, &message), StatusCode::kState);
  EXPECT_NE(message.find("unusable"), std::string::npos) << message;
}

TEST(ProcessGroupFront, ATimedOutTransferSaysHowLongItWaited) {
  ScriptedGroup g;
  g.transfer_failure = StatusCode::kTimeout;
  std::string message;
  EXPECT_EQ(status_of([&] { g.barrier(false); }, &message), StatusCode::kTimeout);
  EXPECT_NE(message.find("barrier of no tensor (collective #1) on rank 0 of 3 timed out after 60000 ms"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace dparallel::dist
