// Runs a forward on every replica at once, each on its device's persistent
// worker thread (torch.nn.parallel.parallel_apply).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "module/module.h"

namespace dparallel {

// Runs one replica's forward on `input` and returns its output; failures are
// exceptions.
using ReplicaForward = std::function<Tensor(size_t index, const std::shared_ptr<Module>& replica, const Tensor& input,
                                            const Device& device)>;

// outputs[i] = fn(i, replicas[i], inputs[i], devices[i]) on the worker of
// devices[i] (each input's own device when `devices` is empty). All run to
// completion; then the first failure in replica order is rethrown with
// "replica i: " in front of its message. Two replicas on one device are
// kInvalidArgument (they would run one after the other on its one worker, so
// replicas that wait on each other would deadlock). Calling it from inside
// `fn` is kState (it would wait on its own worker). Concurrent calls from
// other threads, over any of the same devices in any order, all finish when
// every fn waits only on replicas of its own call (see run_on_devices).
std::vector<Tensor> parallel_apply(const std::vector<std::shared_ptr<Module>>& replicas,
                                   const std::vector<Tensor>& inputs, const std::vector<Device>& devices,
                                   const ReplicaForward& fn);

// Throws kState when called from inside a ReplicaForward; `what` names the
// refused call. Entry points check it before they change anything.
void check_not_inside_replica_forward(const char* what);

// Marks the calling thread as running a ReplicaForward for its lifetime.
class InsideReplicaForward {
 public:
  InsideReplicaForward();
  ~InsideReplicaForward();
  InsideReplicaForward(const InsideReplicaForward&) = delete;
  InsideReplicaForward& operator=(const InsideReplicaForward&) = delete;

 private:
  bool previous_;
};

}  // namespace dparallel
