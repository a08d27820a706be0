#include "parallel/data_parallel.h"

#include "comm/comm.h"
#include "core/error.h"

namespace dparallel {

namespace {

// Whether every tensor of the module is on `device` (a tensor-less one is anywhere).
bool module_is_on(const Module& module, const Device& device) {
  for (const NamedParameter& p : module.named_parameters()) {
    if (p.parameter->value().device() != device) return false;
  }
  for (const NamedBuffer& b : module.named_buffers()) {
    if (b.slot->value.device() != device) return false;
  }
  return true;
}

Tensor to_device(const Tensor& tensor, const Device& device) {
  return tensor.device() == device ? tensor : tensor.to(device);
}

// torch.nn.parallel.gather: outputs that are all 0-d (scalar losses) become a
// vector with one element per replica.
Tensor gather_outputs(const std::vector<Tensor>& outputs, int32_t dim, const Device& output_device) {
  bool all_scalars = !outputs.empty();
  for (const Tensor& t : outputs) all_scalars = all_scalars && t.ndim() == 0;
  if (!all_scalars) return comm::gather(outputs, dim, output_device);
  std::vector<Tensor> vectors;
  vectors.reserve(outputs.size());
  for (const Tensor& t : outputs) vectors.push_back(t.view({1}));
  return comm::gather(vectors, 0, output_device);
}

}  // namespace

Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input, std::vector<Device> devices,
                     const Device& output_device, int32_t dim, const ReplicaForward& fn) {
  check_not_inside_replica_forward("data_parallel");
  if (devices.empty()) fail_invalid("argument 'ndevices' is 0: data_parallel needs at least one device");
  check_distinct_devices(devices, "devices");
  if (devices.size() == 1) {
    if (!module_is_on(*module, devices[0])) {
      fail_invalid("with one device the module runs in place, so it must be on ", to_string(devices[0]));
    }
    Tensor output;
    {
      InsideReplicaForward inside;  // nested calls are refused here too, as on the workers
      output = fn(0, module, to_device(input, devices[0]), devices[0]);
    }
    return to_device(output, output_device);
  }
  std::vector<Tensor> chunks = comm::scatter(input, devices, {}, dim);
  devices.resize(chunks.size());
  std::vector<std::shared_ptr<Module>> replicas = replicate(*module, devices, false);
  std::vector<Tensor> outputs = parallel_apply(replicas, chunks, devices, fn);
  // Gather before touching the module's gradients, so that a failed call leaves them as they were.
  Tensor gathered = gather_outputs(outputs, dim, output_device);
  reduce_gradients(replicas, *module);
  return gathered;
}

Tensor replica_set_apply(ReplicaSet& set, const Tensor& input, int32_t dim, const Device& output_device,
                         const ReplicaForward& fn) {
  check_not_inside_replica_forward("replica_set_apply");  // before set_active: a refused call changes nothing
  std::vector<Tensor> chunks = comm::scatter(input, set.devices(), {}, dim);
  std::vector<std::shared_ptr<Module>> replicas(set.replicas().begin(),
                                                set.replicas().begin() + static_cast<std::ptrdiff_t>(chunks.size()));
  std::vector<Device> devices(set.devices().begin(),
                              set.devices().begin() + static_cast<std::ptrdiff_t>(chunks.size()));
  set.set_active(chunks.size());
  std::vector<Tensor> outputs = parallel_apply(replicas, chunks, devices, fn);
  return gather_outputs(outputs, dim, output_device);
}

}  // namespace dparallel
