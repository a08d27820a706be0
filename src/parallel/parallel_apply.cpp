#include "parallel/parallel_apply.h"

#include <exception>
#include <future>

#include "core/device_worker.h"
#include "core/error.h"
#include "core/stream.h"

namespace dparallel {

namespace {

thread_local bool t_inside_replica_forward = false;

}  // namespace

void check_not_inside_replica_forward(const char* what) {
  if (t_inside_replica_forward) {
    fail(StatusCode::kState, what, " was called from inside a replica's forward, which would deadlock");
  }
}

InsideReplicaForward::InsideReplicaForward() : previous_(t_inside_replica_forward) { t_inside_replica_forward = true; }
InsideReplicaForward::~InsideReplicaForward() { t_inside_replica_forward = previous_; }

std::vector<Tensor> parallel_apply(const std::vector<std::shared_ptr<Module>>& replicas,
                                   const std::vector<Tensor>& inputs, const std::vector<Device>& devices,
                                   const ReplicaForward& fn) {
  if (replicas.size() != inputs.size()) {
    fail_invalid(replicas.size(), " replicas but ", inputs.size(), " inputs");
  }
  if (!devices.empty() && devices.size() != replicas.size()) {
    fail_invalid(replicas.size(), " replicas but ", devices.size(), " devices");
  }
  check_not_inside_replica_forward("parallel_apply");
  const size_t n = replicas.size();
  std::vector<Device> targets = devices;
  if (targets.empty()) {
    for (const Tensor& input : inputs) targets.push_back(input.device());
    check_distinct_devices(targets, "inputs", "are both on");
  } else {
    check_distinct_devices(targets, "devices");
  }
  std::vector<Tensor> outputs(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::function<void()>> works;
  works.reserve(n);
  // Callbacks queue their work on the caller's current streams, as
  // torch's parallel_apply runs each replica under the caller's stream.
  const CurrentStreams streams = capture_current_streams();
  for (size_t i = 0; i < n; ++i) {
    works.emplace_back([&, i, device = targets[i]] {
      InsideReplicaForward inside;
      CurrentStreamsScope caller_streams(streams);
      try {
        outputs[i] = fn(i, replicas[i], inputs[i], device);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  // Replicas may wait on each other, so they must all run at once. Queued one
  // device at a time, two concurrent calls could interleave in opposite
  // orders on two devices, each replica then waiting on a peer queued behind
  // the other call's: a deadlock. Submitted together, the replicas hold the
  // same place in every device's queue, so the earliest call always runs
  // whole, and the persistent per-device workers (a callback's thread-local
  // state, its current device) stay as they are.
  std::vector<std::future<void>> done = run_on_devices(targets, std::move(works));
  for (auto& f : done) f.wait();  // every replica finishes before anything is reported
  for (size_t i = 0; i < n; ++i) {
    try {
      done[i].get();  // a device that could not be made current: the replica did not run
    } catch (...) {
      if (!errors[i]) errors[i] = std::current_exception();
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      fail(e.code(), "replica ", i, ": ", e.what());
    }
  }
  return outputs;
}

}  // namespace dparallel
