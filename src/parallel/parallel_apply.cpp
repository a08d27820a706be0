#include "parallel/parallel_apply.h"

#include <exception>
#include <future>

#include "core/device_worker.h"
#include "core/error.h"

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
  std::vector<std::future<void>> done;
  done.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const Device& device = targets[i];
    auto work = [&, i, device] {
      InsideReplicaForward inside;
      try {
        outputs[i] = fn(i, replicas[i], inputs[i], device);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    try {
      done.push_back(run_on_device(device, work));
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }
  for (auto& f : done) f.wait();  // every replica finishes before anything is reported
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
