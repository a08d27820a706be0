// Scatter, replicate, parallel_apply, gather (the C++ frontend's
// torch::nn::parallel::data_parallel), and the same over kept replicas.
#pragma once

#include <memory>
#include <vector>

#include "module/replicate.h"
#include "parallel/parallel_apply.h"

namespace dparallel {

// One device: fn runs on the calling thread with the module itself (which must
// be on that device) and the input moved there. Several: the input is
// scattered along `dim` (fewer chunks use fewer devices), the module
// replicated, fn applied in parallel, the outputs gathered on
// `output_device` (all 0-d: a vector, one element per replica), and then the
// replicas' gradients reduced into the module's. Repeated devices are
// kInvalidArgument; a call from inside a ReplicaForward is kState.
Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input, std::vector<Device> devices,
                     const Device& output_device, int32_t dim, const ReplicaForward& fn);

// Scatter, parallel_apply over the set's replicas, gather (0-d outputs as
// above); the replicas are reused, and the set remembers how many took part.
Tensor replica_set_apply(ReplicaSet& set, const Tensor& input, int32_t dim, const Device& output_device,
                         const ReplicaForward& fn);

}  // namespace dparallel
