#include "module/replicate.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "comm/comm.h"
#include "core/error.h"

namespace dparallel {

namespace {

// Every parameter and buffer of `module`, parameters first, listed once.
struct TensorList {
  std::vector<std::string> names;
  std::vector<Tensor> values;
};

TensorList tensors_of(const Module& module) {
  TensorList list;
  for (const NamedParameter& p : module.named_parameters()) {
    list.names.push_back(*p.name);
    list.values.push_back(p.parameter->value());
  }
  for (const NamedBuffer& b : module.named_buffers()) {
    list.names.push_back(*b.name);
    list.values.push_back(b.slot->value);
  }
  return list;
}

Device source_device(const TensorList& list, const Device& fallback) {
  if (list.values.empty()) return fallback;
  const Device& source = list.values[0].device();
  for (size_t i = 1; i < list.values.size(); ++i) {
    if (list.values[i].device() != source) {
      fail_invalid("the module is on more than one device: \"", list.names[0], "\" is on ", to_string(source),
                   " but \"", list.names[i], "\" is on ", to_string(list.values[i].device()));
    }
  }
  return source;
}

// copies[d][t]: tensor t for a replica on devices[d]; the source's own tensor
// where devices[d] is its device.
std::vector<std::vector<Tensor>> copies_for(const TensorList& list, const Device& source,
                                            const std::vector<Device>& devices) {
  std::vector<Device> targets{source};
  std::vector<size_t> slot(devices.size(), 0);
  for (size_t d = 0; d < devices.size(); ++d) {
    if (devices[d] != source) {
      slot[d] = targets.size();
      targets.push_back(devices[d]);
    }
  }
  std::vector<std::vector<Tensor>> broadcast(targets.size(), list.values);
  if (targets.size() > 1) broadcast = comm::broadcast_coalesced(list.values, targets, comm::kDefaultBufferSize);
  // Coalescing gives zero-byte tensors views at one offset, which would make
  // distinct tensors one identity (listed once) in a replica: give each its own.
  for (size_t k = 1; k < targets.size(); ++k) {
    for (size_t t = 0; t < list.values.size(); ++t) {
      const Tensor& v = list.values[t];
      if (v.nbytes() == 0) broadcast[k][t] = Tensor::empty(v.dtype(), v.shape(), targets[k]);
    }
  }
  std::vector<std::vector<Tensor>> out;
  for (size_t d = 0; d < devices.size(); ++d) out.push_back(broadcast[slot[d]]);
  return out;
}

// replicate(), with each replica's tensors (the module's listing order) in *tensors.
std::vector<ModulePtr> replicate_listing(Module& module, const std::vector<Device>& devices, bool detach,
                                         std::vector<std::vector<Tensor>>* tensors);

}  // namespace

std::vector<ModulePtr> replicate(Module& module, const std::vector<Device>& devices, bool detach) {
  return replicate_listing(module, devices, detach, nullptr);
}

namespace {

std::vector<ModulePtr> replicate_listing(Module& module, const std::vector<Device>& devices, bool detach,
                                         std::vector<std::vector<Tensor>>* tensors) {
  if (devices.empty()) return {};
  const std::vector<NamedModule> modules = module.named_modules();
  const std::vector<NamedParameter> parameters = module.named_parameters();
  const std::vector<NamedBuffer> buffers = module.named_buffers();
  const TensorList list = tensors_of(module);
  const Device source = source_device(list, devices[0]);
  const std::vector<std::vector<Tensor>> copies = copies_for(list, source, devices);

  std::unordered_map<const Module*, size_t> module_index;
  for (size_t i = 0; i < modules.size(); ++i) module_index[modules[i].module] = i;
  std::unordered_map<const Parameter*, size_t> parameter_index;
  for (size_t i = 0; i < parameters.size(); ++i) parameter_index[parameters[i].parameter.get()] = i;
  std::map<TensorIdentity, size_t> buffer_index;
  for (size_t i = 0; i < buffers.size(); ++i) buffer_index[identity_of(buffers[i].slot->value)] = parameters.size() + i;

  std::vector<ModulePtr> out;
  for (size_t d = 0; d < devices.size(); ++d) {
    std::vector<ModulePtr> replica_modules;
    for (size_t i = 0; i < modules.size(); ++i) replica_modules.push_back(std::make_shared<Module>());
    std::vector<std::shared_ptr<Parameter>> replica_parameters;
    for (size_t i = 0; i < parameters.size(); ++i) {
      bool requires_grad = parameters[i].parameter->requires_grad() && !detach;
      replica_parameters.push_back(std::make_shared<Parameter>(copies[d][i], requires_grad));
    }
    for (size_t i = 0; i < modules.size(); ++i) {
      const Module& original = *modules[i].module;
      Module& replica = *replica_modules[i];
      for (const auto& p : original.parameter_slots()) {
        replica.add_parameter_slot(p.name,
                                   p.parameter ? replica_parameters[parameter_index.at(p.parameter.get())] : nullptr);
      }
      for (const BufferSlot& b : original.buffer_slots()) {
        BufferSlot copy = b;
        if (b.value.defined()) copy.value = copies[d][buffer_index.at(identity_of(b.value))];
        copy.requires_grad = b.requires_grad && !detach;
        replica.add_buffer_slot(std::move(copy));
      }
      for (const auto& c : original.child_slots()) {
        replica.add_child_slot(c.name, c.module ? replica_modules[module_index.at(c.module.get())] : nullptr);
      }
    }
    out.push_back(replica_modules[0]);
  }
  if (tensors != nullptr) *tensors = copies;
  return out;
}

}  // namespace

void reduce_gradients(const std::vector<ModulePtr>& replicas, Module& target) {
  const std::vector<NamedParameter> expected = target.named_parameters();
  std::vector<std::vector<NamedParameter>> lists;
  for (size_t r = 0; r < replicas.size(); ++r) {
    lists.push_back(replicas[r]->named_parameters());
    const std::vector<NamedParameter>& got = lists.back();
    if (got.size() != expected.size()) {
      fail_invalid("replicas[", r, "] has ", got.size(), " parameters but the target has ", expected.size());
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const Tensor& a = got[i].parameter->value();
      const Tensor& b = expected[i].parameter->value();
      if (*got[i].name != *expected[i].name || a.shape() != b.shape() || a.dtype() != b.dtype()) {
        fail_invalid("replicas[", r, "] parameter ", i, " is \"", *got[i].name, "\" (", dtype_name(a.dtype()), " ",
                     shape_string(a.shape()), ") but the target's is \"", *expected[i].name, "\" (",
                     dtype_name(b.dtype()), " ", shape_string(b.shape()), ")");
      }
    }
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!expected[i].parameter->requires_grad()) continue;
    std::vector<Tensor> grads;
    for (const auto& list : lists) {
      Tensor g = list[i].parameter->grad_if_allocated();
      if (g.defined() && list[i].parameter->requires_grad()) grads.push_back(g);
    }
    if (grads.empty()) continue;
    Tensor sum = expected[i].parameter->grad();
    grads.insert(grads.begin(), sum);
    comm::reduce_add_into(sum, grads);
  }
}

bool ReplicaSet::Layout::operator==(const Layout& other) const {
  auto same = [](const TensorIdentity& a, const TensorIdentity& b) { return !(a < b) && !(b < a); };
  return parameters == other.parameters &&
         std::equal(buffers.begin(), buffers.end(), other.buffers.begin(), other.buffers.end(), same);
}

ReplicaSet::Layout ReplicaSet::layout_of(const Module& module) {
  Layout layout;
  for (const NamedParameter& p : module.named_parameters()) layout.parameters.push_back(p.parameter.get());
  for (const NamedBuffer& b : module.named_buffers()) layout.buffers.push_back(identity_of(b.slot->value));
  return layout;
}

ReplicaSet::ReplicaSet(ModulePtr module, std::vector<Device> devices)
    : module_(std::move(module)), devices_(std::move(devices)) {
  if (devices_.empty()) fail_invalid("argument 'ndevices' is 0: a replica set needs at least one device");
  check_distinct_devices(devices_, "devices");
  replicas_ = replicate_listing(*module_, devices_, false, &tensors_);
  source_layout_ = layout_of(*module_);
  for (size_t r = 0; r < replicas_.size(); ++r) {
    replica_layouts_.push_back(layout_of(*replicas_[r]));
    const size_t listed = replica_layouts_[r].parameters.size() + replica_layouts_[r].buffers.size();
    if (listed != tensors_[r].size()) {
      fail(StatusCode::kInternal, "replica ", r, " lists ", listed, " tensors but the module ", tensors_[r].size());
    }
  }
  active_ = replicas_.size();
}

const ModulePtr& ReplicaSet::replica(size_t index) const {
  if (index >= replicas_.size()) {
    fail_invalid("argument 'index' is ", index, " but the replica set has ", replicas_.size(), " replicas");
  }
  return replicas_[index];
}

void ReplicaSet::sync() {
  if (!(layout_of(*module_) == source_layout_)) {
    fail(StatusCode::kState,
         "the module's parameters or buffers changed since the replica set was made; make a new one");
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (!(layout_of(*replicas_[r]) == replica_layouts_[r])) {
      fail(StatusCode::kState, "replica ", r,
           "'s parameters or buffers changed since the replica set was made; make a new one");
    }
  }
  const TensorList source = tensors_of(*module_);
  for (size_t t = 0; t < source.values.size(); ++t) {
    std::vector<Tensor> outputs;
    for (const std::vector<Tensor>& copies : tensors_) outputs.push_back(copies.at(t));
    comm::broadcast_into(source.values[t], outputs);
  }
  // Layouts are unchanged, so the listings line up index by index.
  const std::vector<NamedParameter> parameters = module_->named_parameters();
  const std::vector<NamedBuffer> buffers = module_->named_buffers();
  for (const ModulePtr& replica : replicas_) {
    const std::vector<NamedParameter> replica_parameters = replica->named_parameters();
    const std::vector<NamedBuffer> replica_buffers = replica->named_buffers();
    for (size_t i = 0; i < parameters.size(); ++i) {
      replica_parameters[i].parameter->set_requires_grad(parameters[i].parameter->requires_grad());
    }
    for (size_t i = 0; i < buffers.size(); ++i) replica_buffers[i].slot->requires_grad = buffers[i].slot->requires_grad;
  }
}

void ReplicaSet::reduce_gradients() {
  std::vector<ModulePtr> active(replicas_.begin(), replicas_.begin() + static_cast<std::ptrdiff_t>(active_));
  dparallel::reduce_gradients(active, *module_);
  for (const ModulePtr& replica : active) replica->zero_grad();
}

}  // namespace dparallel
