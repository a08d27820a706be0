#include "module/module.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <map>
#include <tuple>

#include "core/error.h"

namespace dparallel {

namespace {

// Bumped by every registration anywhere, so that a parent notices a change in
// a descendant without knowing its parents.
std::atomic<uint64_t> g_structure_generation{0};

// Live parameters by tensor identity, for weight tying across modules.
struct ParameterRegistry {
  std::mutex mutex;
  std::map<TensorIdentity, std::weak_ptr<Parameter>> by_identity;
};

ParameterRegistry& registry() {
  static auto* instance = new ParameterRegistry();  // outlives every Parameter
  return *instance;
}

// The offset of the first byte that breaks UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing past U+10FFFF), or npos.
size_t invalid_utf8_at(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
    if (c < 0x80)
      length = 1;
    else if (c >= 0xC2 && c <= 0xDF)
      length = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) low = 0xA0;
      if (c == 0xED) high = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) low = 0x90;
      if (c == 0xF4) high = 0x8F;
    } else {
      return i;
    }
    for (size_t k = 1; k < length; ++k) {
      if (i + k >= n) return i + k;
      const unsigned char lo = k == 1 ? low : 0x80, hi = k == 1 ? high : 0xBF;
      if (p[i + k] < lo || p[i + k] > hi) return i + k;
    }
    i += length;
  }
  return std::string::npos;
}

}  // namespace

bool TensorIdentity::operator<(const TensorIdentity& other) const {
  return std::tie(memory, offset, device_type, device_index, dtype, shape) <
         std::tie(other.memory, other.offset, other.device_type, other.device_index, other.dtype, other.shape);
}

TensorIdentity identity_of(const Tensor& tensor) {
  const Device device = tensor.device();
  if (tensor.nbytes() == 0) {
    return TensorIdentity{tensor.storage().get(), tensor.storage_offset(), device.type,
                          device.index,           tensor.dtype(),          tensor.shape()};
  }
  return TensorIdentity{tensor.data(), 0, device.type, device.index, tensor.dtype(), tensor.shape()};
}

std::shared_ptr<Parameter> Parameter::shared_for(const Tensor& value, bool requires_grad) {
  ParameterRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto& slot = reg.by_identity[identity_of(value)];
  if (auto existing = slot.lock()) {
    if (existing->requires_grad() != requires_grad) {
      fail_invalid("this tensor (", value.describe(),
                   ") is already a parameter with requires_grad=", existing->requires_grad(),
                   "; it cannot be registered again with requires_grad=", requires_grad);
    }
    return existing;
  }
  auto created = std::make_shared<Parameter>(value, requires_grad);
  created->registered_ = true;
  slot = created;
  return created;
}

Parameter::~Parameter() {
  if (!registered_) return;
  ParameterRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.by_identity.find(identity_of(value_));
  if (it != reg.by_identity.end() && it->second.expired()) reg.by_identity.erase(it);
}

namespace {

std::atomic<uint64_t> g_assignments{0};

}  // namespace

uint64_t Parameter::assignments() { return g_assignments.load(std::memory_order_acquire); }

void Parameter::set_value(const Tensor& value) {
  ParameterRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  if (registered_) {
    auto old = reg.by_identity.find(identity_of(value_));
    if (old != reg.by_identity.end()) {
      auto held = old->second.lock();
      if (!held || held.get() == this) reg.by_identity.erase(old);
    }
    auto& slot = reg.by_identity[identity_of(value)];
    if (slot.expired()) slot = weak_from_this();
  }
  value_ = value;
}

std::shared_ptr<ParameterSharding> Parameter::sharding() const {
  std::lock_guard<std::mutex> lock(grad_mutex_);
  return std::dynamic_pointer_cast<ParameterSharding>(owner_.lock());
}

// The owner is let go of after the lock: its last reference may end it,
// and its end releases its parameters.
const char* Parameter::owner_kind() const {
  std::shared_ptr<ParameterOwner> held;
  {
    std::lock_guard<std::mutex> lock(grad_mutex_);
    held = owner_.lock();
  }
  return held ? held->owner_kind() : nullptr;
}

std::string Parameter::claim(const std::shared_ptr<ParameterOwner>& owner) {
  std::shared_ptr<ParameterOwner> held;
  std::lock_guard<std::mutex> lock(grad_mutex_);
  held = owner_.lock();
  if (held && held != owner) return held->owner_kind();
  owner_ = owner;
  return "";
}

void Parameter::release(const ParameterOwner* owner) {
  std::shared_ptr<ParameterOwner> held;
  std::lock_guard<std::mutex> lock(grad_mutex_);
  held = owner_.lock();
  if (!held || held.get() == owner) owner_.reset();
}

Tensor Parameter::grad() {
  std::unique_lock<std::mutex> lock(grad_mutex_);
  if (auto sharding = std::dynamic_pointer_cast<ParameterSharding>(owner_.lock())) {
    lock.unlock();
    std::string refusal = sharding->grad_refusal(*this);
    if (!refusal.empty()) fail(StatusCode::kState, refusal);
    lock.lock();
  }
  if (!grad_.defined()) grad_ = Tensor::zeros(value_.dtype(), value_.shape(), value_.device());
  return grad_;
}

Tensor Parameter::grad_if_allocated() const {
  std::lock_guard<std::mutex> lock(grad_mutex_);
  return grad_;
}

void Parameter::set_grad(const Tensor& grad) {
  std::lock_guard<std::mutex> lock(grad_mutex_);
  grad_ = grad;
  if (grad.defined()) g_assignments.fetch_add(1, std::memory_order_acq_rel);  // none: nothing can overlap
}

void Parameter::zero_grad() {
  std::exception_ptr failed;
  try {
    if (auto held = sharding()) held->zero_shard_grad(*this);
  } catch (...) {
    failed = std::current_exception();  // the full gradient is zeroed all the same
  }
  Tensor grad = grad_if_allocated();
  if (grad.defined()) fill_zero(grad.data(), grad.device(), grad.nbytes());
  if (failed) std::rethrow_exception(failed);
}

Module::~Module() {
  // Children whose last reference this is give up their own children first,
  // so that each release below frees a module with none: no recursion per
  // level. Nothing else can take a new reference to a module whose only one
  // is held here (modules are never held weakly).
  std::vector<std::shared_ptr<Module>> pending;
  auto take_children = [&](Module& m) {
    for (ChildSlot& c : m.children_) {
      if (c.module) pending.push_back(std::move(c.module));
    }
    m.children_.clear();
  };
  take_children(*this);
  while (!pending.empty()) {
    std::shared_ptr<Module> m = std::move(pending.back());
    pending.pop_back();
    if (m.use_count() == 1) take_children(*m);
  }
}

void Module::check_new_name(const std::string& name) const {
  if (name.empty()) fail_invalid("argument 'name' is empty");
  if (name.find('.') != std::string::npos) fail_invalid("argument 'name' (\"", name, "\") must not contain '.'");
  // Checkpoint headers are JSON, which holds only UTF-8 names.
  if (size_t bad = invalid_utf8_at(name); bad != std::string::npos) {
    if (bad == name.size()) fail_invalid("argument 'name' is not valid UTF-8: it ends inside a multi-byte character");
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(static_cast<unsigned char>(name[bad])));
    fail_invalid("argument 'name' is not valid UTF-8: byte ", bad, " (", hex, ") of ", name.size(), " is malformed");
  }
  auto taken = [&](const auto& slots) {
    return std::any_of(slots.begin(), slots.end(), [&](const auto& s) { return s.name == name; });
  };
  if (taken(parameters_) || taken(buffers_) || taken(children_)) {
    fail_invalid("argument 'name': this module already has a parameter, buffer or child named \"", name, "\"");
  }
}

void Module::structure_changed() { g_structure_generation.fetch_add(1); }

void Module::register_parameter(const std::string& name, const Tensor& value, bool requires_grad) {
  check_new_name(name);
  add_parameter_slot(name, value.defined() ? Parameter::shared_for(value, requires_grad) : nullptr);
}

void Module::register_buffer(const std::string& name, const Tensor& value, bool persistent) {
  check_new_name(name);
  add_buffer_slot(BufferSlot{name, value, persistent, false});
}

void Module::register_module(const std::string& name, std::shared_ptr<Module> child) {
  check_new_name(name);
  if (child && child->contains(this)) {
    fail_invalid("argument 'child' contains this module; registering it as \"", name, "\" would make a cycle");
  }
  add_child_slot(name, std::move(child));
}

void Module::add_parameter_slot(const std::string& name, std::shared_ptr<Parameter> parameter) {
  parameters_.push_back(ParameterSlot{name, std::move(parameter)});
  structure_changed();
}

void Module::add_buffer_slot(BufferSlot slot) {
  buffers_.push_back(std::move(slot));
  structure_changed();
}

void Module::add_child_slot(const std::string& name, std::shared_ptr<Module> child) {
  children_.push_back(ChildSlot{name, std::move(child)});
  structure_changed();
}

bool Module::contains(const Module* other) const {
  // Iterative with a visited set: shared children would make a plain
  // recursion exponential in the depth.
  std::vector<const Module*> stack{this};
  std::set<const Module*> visited{this};
  while (!stack.empty()) {
    const Module* m = stack.back();
    stack.pop_back();
    if (m == other) return true;
    for (const ChildSlot& c : m->children_) {
      if (c.module && visited.insert(c.module.get()).second) stack.push_back(c.module.get());
    }
  }
  return false;
}

std::vector<NamedModule> Module::named_modules() {
  std::vector<NamedModule> out{{"", this}};
  // Depth-first with an explicit stack; the first visit of a shared child names it.
  struct Pending {
    std::string name;
    Module* module;
    size_t depth;
  };
  std::vector<Pending> stack;
  std::set<const Module*> seen{this};
  auto push_children = [&](const std::string& prefix, Module* m, size_t depth) {
    for (auto it = m->children_.rbegin(); it != m->children_.rend(); ++it) {
      if (!it->module) continue;
      std::string name = prefix.empty() ? it->name : prefix + "." + it->name;
      if (depth > kMaxModuleDepth) {
        constexpr size_t kShown = 80;
        fail_invalid("the module tree is deeper than ", kMaxModuleDepth, " levels (at \"",
                     name.size() > kShown ? name.substr(0, kShown) + "..." : name, "\", ", depth,
                     " levels down); such a tree cannot be listed, saved or replicated");
      }
      stack.push_back(Pending{std::move(name), it->module.get(), depth});
    }
  };
  push_children("", this, 1);
  while (!stack.empty()) {
    Pending next = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(next.module).second) continue;
    out.push_back(NamedModule{next.name, next.module});
    push_children(next.name, next.module, next.depth + 1);
  }
  return out;
}

const std::string* Module::intern(const std::string& name) const { return &*names_.insert(name).first; }

std::shared_ptr<const Module::Listing> Module::listing() const {
  std::lock_guard<std::mutex> lock(listing_mutex_);
  uint64_t now = g_structure_generation.load();
  if (listing_ && listing_->generation == now) return listing_;
  auto fresh_listing = std::make_shared<Listing>();
  Listing& fresh = *fresh_listing;
  fresh.generation = now;
  std::set<const Parameter*> seen_parameters;
  std::set<TensorIdentity> seen_buffers;
  for (const NamedModule& nm : const_cast<Module*>(this)->named_modules()) {
    std::string prefix = nm.name.empty() ? "" : nm.name + ".";
    for (const ParameterSlot& p : nm.module->parameters_) {
      if (p.parameter && seen_parameters.insert(p.parameter.get()).second) {
        fresh.parameters.push_back(NamedParameter{intern(prefix + p.name), p.parameter});
      }
    }
    for (BufferSlot& b : nm.module->buffers_) {
      if (b.value.defined() && seen_buffers.insert(identity_of(b.value)).second) {
        fresh.buffers.push_back(NamedBuffer{intern(prefix + b.name), &b});
      }
    }
  }
  listing_ = std::move(fresh_listing);
  return listing_;
}

std::vector<NamedParameter> Module::named_parameters() const { return listing()->parameters; }
std::vector<NamedBuffer> Module::named_buffers() const { return listing()->buffers; }

NamedParameter Module::parameter_at(size_t index) const {
  auto l = listing();
  if (index >= l->parameters.size()) {
    fail_invalid("argument 'index' is ", index, " but the module has ", l->parameters.size(), " parameters");
  }
  return l->parameters[index];
}

NamedBuffer Module::buffer_at(size_t index) const {
  auto l = listing();
  if (index >= l->buffers.size()) {
    fail_invalid("argument 'index' is ", index, " but the module has ", l->buffers.size(), " buffers");
  }
  return l->buffers[index];
}

const Module& Module::owner_of(const std::string& dotted_name, std::string* leaf) const {
  const Module* m = this;
  size_t start = 0;
  for (;;) {
    size_t dot = dotted_name.find('.', start);
    if (dot == std::string::npos) break;
    std::string part = dotted_name.substr(start, dot - start);
    auto it =
        std::find_if(m->children_.begin(), m->children_.end(), [&](const ChildSlot& c) { return c.name == part; });
    if (it == m->children_.end() || !it->module) {
      fail_invalid("no module \"", dotted_name.substr(0, dot), "\" on the way to \"", dotted_name, "\"");
    }
    m = it->module.get();
    start = dot + 1;
  }
  *leaf = dotted_name.substr(start);
  return *m;
}

std::shared_ptr<Parameter> Module::get_parameter(const std::string& dotted_name) const {
  std::string leaf;
  const Module& owner = owner_of(dotted_name, &leaf);
  for (const ParameterSlot& p : owner.parameters_) {
    if (p.name == leaf) return p.parameter;
  }
  fail_invalid("no parameter named \"", dotted_name, "\"");
}

BufferSlot& Module::get_buffer(const std::string& dotted_name) const {
  std::string leaf;
  const Module& owner = owner_of(dotted_name, &leaf);
  for (const BufferSlot& b : owner.buffers_) {
    if (b.name == leaf) return const_cast<BufferSlot&>(b);
  }
  fail_invalid("no buffer named \"", dotted_name, "\"");
}

std::shared_ptr<Module> Module::get_module(const std::string& dotted_name) const {
  std::string leaf;
  const Module& owner = owner_of(dotted_name, &leaf);
  for (const ChildSlot& c : owner.children_) {
    if (c.name == leaf) return c.module;
  }
  fail_invalid("no module named \"", dotted_name, "\"");
}

NamedTensorSlot Module::find_tensor(const std::string& dotted_name) const {
  std::string leaf;
  const Module& owner = owner_of(dotted_name, &leaf);
  for (const ParameterSlot& p : owner.parameters_) {
    if (p.name == leaf && p.parameter) return NamedTensorSlot{p.parameter, nullptr};
  }
  for (const BufferSlot& b : owner.buffers_) {
    if (b.name == leaf && b.value.defined()) return NamedTensorSlot{nullptr, const_cast<BufferSlot*>(&b)};
  }
  fail_invalid("no parameter or buffer named \"", dotted_name, "\"");
}

void Module::zero_grad() {
  // Every gradient is zeroed even when one fails (a dp_fsdp's post_backward
  // that failed); the first failure is then reported.
  std::exception_ptr failed;
  for (const NamedParameter& p : named_parameters()) {
    try {
      p.parameter->zero_grad();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace dparallel
