// Replication across devices (torch.nn.parallel.replicate) and the gradient
// reduction back into the original (data_parallel.h's ReduceAdd).
#pragma once

#include <memory>
#include <vector>

#include "core/device.h"
#include "module/module.h"

namespace dparallel {

using ModulePtr = std::shared_ptr<Module>;

// Replicas with the module's structure and names, one per device. Parameters
// and buffers are broadcast coalesced from the module's device; a replica on
// that device shares the module's storage, but every replica has its own
// Parameter objects and gradients. With `detach`, nothing in a replica
// requires grad; otherwise parameters and buffers keep their flag.
std::vector<ModulePtr> replicate(Module& module, const std::vector<Device>& devices, bool detach);

// target.grad += sum of the replicas' gradients, per parameter that requires
// grad in the target, counting replica gradients that are allocated and whose
// parameter requires grad. Structure, shapes and dtypes are checked first.
void reduce_gradients(const std::vector<ModulePtr>& replicas, Module& target);

// Replicas kept across steps.
class ReplicaSet {
 public:
  // Repeated devices are kInvalidArgument.
  ReplicaSet(ModulePtr module, std::vector<Device> devices);

  // Copies the module's current parameters and buffers, and their
  // requires_grad flags, into the replicas' existing storage. kState if the
  // module's or a replica's parameters or buffers changed.
  void sync();
  // Reduces the gradients of the replicas that took part in the latest
  // apply (all of them before the first) into the module's, then zeroes
  // those replicas' gradients (each step starts from fresh gradients, as
  // with torch's re-replication).
  void reduce_gradients();

  size_t size() const { return replicas_.size(); }
  const ModulePtr& module() const { return module_; }
  const ModulePtr& replica(size_t index) const;
  const std::vector<ModulePtr>& replicas() const { return replicas_; }
  const std::vector<Device>& devices() const { return devices_; }
  void set_active(size_t count) { active_ = count; }

 private:
  // What a module lists: its parameters' objects and its buffers' identities.
  struct Layout {
    std::vector<const Parameter*> parameters;
    std::vector<TensorIdentity> buffers;
    bool operator==(const Layout& other) const;
  };
  static Layout layout_of(const Module& module);

  ModulePtr module_;
  std::vector<Device> devices_;
  std::vector<ModulePtr> replicas_;
  // tensors_[r][t]: replica r's copy of the module's tensor t (parameters,
  // then buffers, as listed), kept from creation so that sync never relies on
  // a replica listing its tensors the way the module does.
  std::vector<std::vector<Tensor>> tensors_;
  Layout source_layout_;
  std::vector<Layout> replica_layouts_;
  size_t active_;
};

}  // namespace dparallel
