// Modules: a tree of named parameters, buffers and child modules, listed the
// way torch.nn.Module's named_parameters() and named_buffers() list them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace dparallel {

class Parameter;

// What holds a parameter: a dp_ddp or a dp_fsdp. A parameter has at most
// one live owner; another's claim is refused (Parameter::claim) until the
// owner releases it or ends.
class ParameterOwner {
 public:
  virtual ~ParameterOwner() = default;
  // For messages: "dp_ddp" or "dp_fsdp".
  virtual const char* owner_kind() const = 0;
};

// An owner that holds a parameter sharded (a dp_fsdp): the slot may hold
// this rank's shard rather than the full parameter.
class ParameterSharding : public ParameterOwner {
 public:
  // Empty when the gradient of the parameter's current value may be taken
  // (the value is the full parameter); else why not.
  virtual std::string grad_refusal(const Parameter& parameter) const = 0;
  // dp_module_zero_grad: the shard's gradient too.
  virtual void zero_shard_grad(const Parameter& parameter) = 0;
};

// One parameter, shared by every slot that holds it: registering the same
// tensor twice (weight tying) yields one Parameter, one gradient.
class Parameter : public std::enable_shared_from_this<Parameter> {
 public:
  Parameter(const Tensor& value, bool requires_grad) : value_(value), requires_grad_(requires_grad) {}
  ~Parameter();
  Parameter(const Parameter&) = delete;
  Parameter& operator=(const Parameter&) = delete;

  // The parameter registered for `value` if one lives, else a new one.
  static std::shared_ptr<Parameter> shared_for(const Tensor& value, bool requires_grad);

  const Tensor& value() const { return value_; }
  // A dp_fsdp swaps the full parameter and this rank's shard (from the
  // host's thread, between its uses of the module). Tying by identity
  // follows the new value.
  void set_value(const Tensor& value);
  // The live owner that holds this parameter sharded, or null.
  std::shared_ptr<ParameterSharding> sharding() const;
  // The live owner's owner_kind(), or null when none holds it.
  const char* owner_kind() const;
  // Makes `owner` this parameter's: "" when it is now (or already was), else
  // the owner_kind() of the live owner that holds it.
  std::string claim(const std::shared_ptr<ParameterOwner>& owner);
  // Lets go of the parameter when `owner` holds it.
  void release(const ParameterOwner* owner);
  bool requires_grad() const { return requires_grad_; }
  void set_requires_grad(bool requires_grad) { requires_grad_ = requires_grad; }
  // The gradient, allocated zeroed on first use. kState when a sharding
  // holds only this rank's rows of the parameter (grad_refusal).
  Tensor grad();
  // The gradient if allocated, else an undefined tensor.
  Tensor grad_if_allocated() const;
  // Makes `grad` (this parameter's dtype, shape and device) the gradient: the
  // DDP reducer's bucket views.
  void set_grad(const Tensor& grad);
  void zero_grad();
  // Counts every set_grad of a gradient, on any parameter: a reducer checks
  // again that its parameters' memory lies apart only after one moves
  // (set_value moves only values a dp_fsdp holds, which no reducer does).
  static uint64_t assignments();

 private:
  Tensor value_;
  bool requires_grad_;
  bool registered_ = false;
  mutable std::mutex grad_mutex_;
  Tensor grad_;
  std::weak_ptr<ParameterOwner> owner_;  // guarded by grad_mutex_
};

struct BufferSlot {
  std::string name;
  Tensor value;  // undefined for a NULL slot
  bool persistent = true;
  bool requires_grad = false;
};

class Module;

struct NamedParameter {
  const std::string* name;  // interned in the module that listed it
  std::shared_ptr<Parameter> parameter;
};
struct NamedBuffer {
  const std::string* name;
  BufferSlot* slot;
};
// A parameter or a buffer found by name: exactly one of the two is set.
struct NamedTensorSlot {
  std::shared_ptr<Parameter> parameter;
  BufferSlot* buffer = nullptr;
};
struct NamedModule {
  std::string name;  // "" for the root
  Module* module;
};

// Deepest module tree that walks (listings, state dicts, saves, replicas)
// accept: a dotted name grows with depth, so deeper trees would make listing
// quadratic. Destruction and lookups by name work at any depth.
constexpr size_t kMaxModuleDepth = 1024;

class Module {
 public:
  struct ParameterSlot {
    std::string name;
    std::shared_ptr<Parameter> parameter;  // null for a NULL slot
  };
  struct ChildSlot {
    std::string name;
    std::shared_ptr<Module> module;  // null for a NULL slot
  };

  Module() = default;
  // Iterative: a chain of nested modules is torn down without recursing per level.
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // `value` may be undefined (a NULL slot). Names are non-empty, hold no '.',
  // and are unique among this module's parameters, buffers and children.
  void register_parameter(const std::string& name, const Tensor& value, bool requires_grad);
  void register_buffer(const std::string& name, const Tensor& value, bool persistent);
  // Refuses a child that contains this module (a cycle).
  void register_module(const std::string& name, std::shared_ptr<Module> child);

  // Modules in pre-order, each once (torch's named_modules()). A tree deeper
  // than kMaxModuleDepth is kInvalidArgument.
  std::vector<NamedModule> named_modules();
  // Every distinct parameter once, in registration order (torch's named_parameters()).
  std::vector<NamedParameter> named_parameters() const;
  std::vector<NamedBuffer> named_buffers() const;
  size_t num_parameters() const { return listing()->parameters.size(); }
  size_t num_buffers() const { return listing()->buffers.size(); }
  NamedParameter parameter_at(size_t index) const;
  NamedBuffer buffer_at(size_t index) const;

  // Lookups by dotted name; an unknown name throws kInvalidArgument naming
  // it. A NULL slot yields null / an undefined tensor.
  std::shared_ptr<Parameter> get_parameter(const std::string& dotted_name) const;
  BufferSlot& get_buffer(const std::string& dotted_name) const;
  std::shared_ptr<Module> get_module(const std::string& dotted_name) const;
  // A parameter or buffer that is not a NULL slot.
  NamedTensorSlot find_tensor(const std::string& dotted_name) const;

  void zero_grad();

  const std::vector<ParameterSlot>& parameter_slots() const { return parameters_; }
  const std::vector<BufferSlot>& buffer_slots() const { return buffers_; }
  std::vector<BufferSlot>& buffer_slots() { return buffers_; }
  const std::vector<ChildSlot>& child_slots() const { return children_; }

  // Builders for replicas: no name checks, no parameter sharing by identity.
  void add_parameter_slot(const std::string& name, std::shared_ptr<Parameter> parameter);
  void add_buffer_slot(BufferSlot slot);
  void add_child_slot(const std::string& name, std::shared_ptr<Module> child);

 private:
  struct Listing {
    uint64_t generation = ~uint64_t(0);
    std::vector<NamedParameter> parameters;
    std::vector<NamedBuffer> buffers;
  };

  void check_new_name(const std::string& name) const;
  bool contains(const Module* other) const;
  // Walks to the module that holds the last component of `dotted_name`.
  const Module& owner_of(const std::string& dotted_name, std::string* leaf) const;
  // A snapshot: a listing in use stays valid while another thread relists.
  std::shared_ptr<const Listing> listing() const;
  const std::string* intern(const std::string& name) const;
  void structure_changed();

  std::vector<ParameterSlot> parameters_;
  std::vector<BufferSlot> buffers_;
  std::vector<ChildSlot> children_;

  mutable std::mutex listing_mutex_;
  mutable std::shared_ptr<const Listing> listing_;
  mutable std::set<std::string> names_;  // node-based: pointers into it stay valid
};

// The key that makes two tensors "the same tensor": the memory they start
// at (so that two handles over one buffer, e.g. from_blob twice, are one
// tensor, as a tied weight is), device, dtype, shape. Empty tensors have no
// memory: their storage and offset tell them apart.
struct TensorIdentity {
  const void* memory;
  size_t offset;
  DeviceType device_type;
  int32_t device_index;
  DType dtype;
  Shape shape;
  bool operator<(const TensorIdentity& other) const;
};
TensorIdentity identity_of(const Tensor& tensor);

}  // namespace dparallel
