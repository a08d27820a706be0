// A host function that calls the library on the stream it runs on: every
// call that orders after that stream would wait for the host function
// itself, so each is refused with DP_ESTATE instead of hanging. Run once as
// is and once with DP_CPU_ASYNC=1 (the async/ prefix), where the legacy
// default stream is a queue too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "group_util.h"
#include "module/module_test_util.h"
#include "test_util.h"

using dptest::cpu;
using dptest::make;
using dptest::TensorPtr;
using dptest::values;

namespace {

bool cpu_async() {
  const char* text = std::getenv("DP_CPU_ASYNC");
  return text != nullptr && std::strcmp(text, "1") == 0;
}

// One call made from inside a host function, and what it returned.
struct HostCall {
  void* stream = nullptr;  // made current inside the host function when set
  std::function<dp_status()> call;
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  dp_status status = DP_OK;
  std::string error;
};

void run_host_call(void* data) {
  auto* c = static_cast<HostCall*>(data);
  dp_status set = c->stream != nullptr ? dp_set_current_stream(cpu(0), c->stream) : DP_OK;
  dp_status status = set == DP_OK ? c->call() : set;
  std::string error = status == DP_OK ? "" : dp_last_error();
  if (c->stream != nullptr) dp_set_current_stream(cpu(0), nullptr);
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    c->status = status;
    c->error = error;
    c->done = true;
  }
  c->finished.notify_all();
}

// Queues `call` as a host function on `stream` (NULL: the legacy default)
// and waits for it. A call that waits for its own stream never comes back
// and its stream's thread is stuck for good, so the process ends there.
dp_status call_in_host_function(const char* name, void* stream, bool make_current,
                                const std::function<dp_status()>& call, std::string* error) {
  HostCall c;
  c.stream = make_current ? stream : nullptr;
  c.call = call;
  dp_status launched = dp_stream_launch_host_func(cpu(0), stream, run_host_call, &c);
  if (launched != DP_OK) {
    *error = dp_last_error();
    return launched;
  }
  std::unique_lock<std::mutex> lock(c.mutex);
  if (!c.finished.wait_for(lock, std::chrono::seconds(60), [&] { return c.done; })) {
    std::fprintf(stderr, "%s called from a host function on its own stream never returned\n", name);
    std::fflush(stderr);
    std::_Exit(3);
  }
  *error = c.error;
  return c.status;
}

class HostFunctionOnItsStream : public ::testing::Test {
 protected:
  void SetUp() override {
    pg_ = group_.get();
    ASSERT_NE(pg_, nullptr);
    x_ = make<float>({16}, std::vector<float>(16, 2.0f));
    module_ = dptest::new_module();
    weight_ = make<float>({8}, std::vector<float>(8, 1.0f));
    DP_ASSERT_OK(dp_module_register_parameter(module_.get(), "w", weight_.get(), 1));
    DP_ASSERT_OK(dp_ddp_create(&ddp_, module_.get(), pg_, nullptr));
  }
  void TearDown() override {
    dp_ddp_destroy(ddp_);
    module_.reset();
  }

  // Every call that orders after the current stream of cpu:0, by name; what
  // they need is made here, outside the host function.
  std::vector<std::pair<const char*, std::function<dp_status()>>> ordered_calls() {
    return {
        {"dp_tensor_copy_from_host",
         [this] { return dp_tensor_copy_from_host(x_.get(), host_.data(), host_.size() * sizeof(float)); }},
        {"dp_tensor_copy_to_host",
         [this] { return dp_tensor_copy_to_host(x_.get(), host_.data(), host_.size() * sizeof(float)); }},
        {"dp_tensor_to_device",
         [this] {
           dp_tensor* moved = nullptr;
           dp_status st = dp_tensor_to_device(&moved, x_.get(), cpu(1));
           dp_tensor_destroy(moved);
           return st;
         }},
        {"dp_broadcast",
         [this] {
           dp_device devices[] = {cpu(0), cpu(1)};
           dp_tensor* out[2] = {};
           dp_status st = dp_broadcast(x_.get(), devices, 2, out);
           dp_tensor_destroy(out[0]);
           dp_tensor_destroy(out[1]);
           return st;
         }},
        {"dp_pg_all_reduce", [this] { return dp_pg_all_reduce(pg_, x_.get(), DP_SUM); }},
        {"dp_module_zero_grad", [this] { return dp_module_zero_grad(module_.get()); }},
        {"dp_ddp_pre_forward", [this] { return dp_ddp_pre_forward(ddp_); }},
        {"dp_ddp_create",
         [this, w = std::make_shared<TensorPtr>(make<float>({4}, std::vector<float>(4, 1.0f)))] {
           dptest::ModulePtr m = dptest::new_module();
           dp_status st = dp_module_register_parameter(m.get(), "w", w->get(), 1);
           dp_ddp* ddp = nullptr;
           if (st == DP_OK) st = dp_ddp_create(&ddp, m.get(), pg_, nullptr);
           dp_ddp_destroy(ddp);
           return st;
         }},
        {"dp_fsdp_create",
         [this, w = std::make_shared<TensorPtr>(make<float>({4}, std::vector<float>(4, 1.0f)))] {
           dptest::ModulePtr m = dptest::new_module();
           dp_status st = dp_module_register_parameter(m.get(), "w", w->get(), 1);
           dp_fsdp* fsdp = nullptr;
           if (st == DP_OK) st = dp_fsdp_create(&fsdp, m.get(), pg_, nullptr);
           dp_fsdp_destroy(fsdp);
           return st;
         }},
    };
  }

  dptest::SingleRankGroup group_;  // a one-rank group, gone after TearDown
  dp_process_group* pg_ = nullptr;
  TensorPtr x_;
  dptest::ModulePtr module_;
  TensorPtr weight_;
  dp_ddp* ddp_ = nullptr;
  std::vector<float> host_ = std::vector<float>(16, 5.0f);
};

TEST_F(HostFunctionOnItsStream, EveryCallOrderedAfterItsOwnCurrentStreamIsEstateNotAHang) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  for (const auto& [name, call] : ordered_calls()) {
    std::string error;
    EXPECT_EQ(call_in_host_function(name, s, true, call, &error), DP_ESTATE) << name << ": " << error;
    EXPECT_NE(error.find("would wait for the host function itself"), std::string::npos) << name << ": " << error;
  }
  DP_EXPECT_OK(dp_stream_synchronize(cpu(0), s));
  EXPECT_EQ(values<float>(x_.get()), std::vector<float>(16, 2.0f)) << "a refused call wrote nothing";
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), s));
}

TEST_F(HostFunctionOnItsStream, SynchronizingItsOwnStreamIsEstateNotAHang) {
  void* s = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  std::string error;
  EXPECT_EQ(call_in_host_function(
                "dp_stream_synchronize", s, false, [s] { return dp_stream_synchronize(cpu(0), s); }, &error),
            DP_ESTATE)
      << error;
  EXPECT_NE(error.find("wait for itself"), std::string::npos) << error;
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), s));
}

// On the legacy default stream, with no current stream: a queue of its own
// under DP_CPU_ASYNC=1 (refused), else the host function runs inline on the
// caller's thread and every call works.
TEST_F(HostFunctionOnItsStream, OnTheDefaultStreamEveryOrderedCallIsEstateWhenItIsAQueueAndWorksOtherwise) {
  for (const auto& [name, call] : ordered_calls()) {
    std::string error;
    dp_status status = call_in_host_function(name, nullptr, false, call, &error);
    if (cpu_async()) {
      EXPECT_EQ(status, DP_ESTATE) << name << ": " << error;
      EXPECT_NE(error.find("legacy default stream of cpu:0"), std::string::npos) << name << ": " << error;
    } else {
      EXPECT_EQ(status, DP_OK) << name << ": " << error;
    }
  }
  std::string error;
  dp_status status = call_in_host_function(
      "dp_stream_synchronize", nullptr, false, [] { return dp_stream_synchronize(cpu(0), nullptr); }, &error);
  EXPECT_EQ(status, cpu_async() ? DP_ESTATE : DP_OK) << error;
}

// A host function on one stream may still use the library on another.
TEST_F(HostFunctionOnItsStream, CallsOrderedAfterAnotherStreamStillWork) {
  void* s = nullptr;
  void* other = nullptr;
  DP_ASSERT_OK(dp_stream_create(cpu(0), &s));
  DP_ASSERT_OK(dp_stream_create(cpu(0), &other));
  std::string error;
  auto copy_on_other = [&] {
    dp_status st = dp_set_current_stream(cpu(0), other);
    if (st == DP_OK) st = dp_tensor_copy_from_host(x_.get(), host_.data(), host_.size() * sizeof(float));
    dp_set_current_stream(cpu(0), nullptr);
    return st;
  };
  EXPECT_EQ(call_in_host_function("dp_tensor_copy_from_host", s, false, copy_on_other, &error), DP_OK) << error;
  DP_EXPECT_OK(dp_stream_synchronize(cpu(0), other));
  EXPECT_EQ(values<float>(x_.get()), std::vector<float>(16, 5.0f));
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), s));
  DP_EXPECT_OK(dp_stream_destroy(cpu(0), other));
}

}  // namespace
