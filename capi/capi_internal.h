// What every capi/ file shares: the handle structs, the guard macros that
// keep exceptions inside, and argument checks whose errors name the argument.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "capi/struct_fields.h"
#include "core/device.h"
#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "dparallel/dp_base.h"
#include "dparallel/dp_tensor.h"
#include "module/module.h"
#include "module/replicate.h"

// Handles carry a tag so that a handle of another type is refused. A destroyed
// handle is undefined behaviour (dp_base.h); the tag is cleared on destroy only
// to make such misuse likelier to be caught.
constexpr uint64_t kTensorTag = 0x6470'7465'6e73'6f72ull;  // "dptensor"

// A borrowed handle is lent to a callback for the call only: destroying it
// there is refused (it would free what the library still uses).
struct dp_tensor {
  uint64_t tag = kTensorTag;
  // Mutable: a gradient handle follows its parameter's gradient when it moves.
  mutable dparallel::Tensor tensor;
  bool borrowed = false;
  // From dp_module_grad: the parameter whose gradient this handle names.
  std::weak_ptr<dparallel::Parameter> grad_of;
};

constexpr uint64_t kModuleTag = 0x6470'6d6f'6475'6c65ull;      // "dpmodule"
constexpr uint64_t kReplicaSetTag = 0x6470'7265'706c'7365ull;  // "dpreplse"

struct dp_module {
  uint64_t tag = kModuleTag;
  std::shared_ptr<dparallel::Module> module;
  bool borrowed = false;
};

struct dp_replica_set {
  uint64_t tag = kReplicaSetTag;
  std::unique_ptr<dparallel::ReplicaSet> set;
};

namespace dparallel::capi {

// Records the message of the exception being handled for this thread and
// returns its status; `function` prefixes the message.
dp_status handle_exception(const char* function) noexcept;
void set_last_error(const std::string& message) noexcept;
// True when `handle` may be destroyed; otherwise records why not (it is
// borrowed for a callback) as `function`'s last error.
template <typename Handle>
bool destroy_allowed(const Handle* handle, const char* function) noexcept {
  if (!handle->borrowed) return true;
  set_last_error(std::string(function) +
                 ": the handle is lent to a callback for the call only; it was not destroyed (the library frees it)");
  return false;
}

[[noreturn]] inline void null_argument(const char* name) { fail_invalid("argument '", name, "' is NULL"); }

template <typename T>
void require_arg(const T* pointer, const char* name) {
  if (pointer == nullptr) null_argument(name);
}

// An entry point's handle out-parameter, first thing: it must not be NULL,
// and *out is NULL from here until the call succeeds (dp_base.h).
template <typename Handle>
void clear_out(Handle** out, const char* name) {
  require_arg(out, name);
  *out = nullptr;
}

// A stream of the library's besides the library stream that reads the
// host's tensors (a process group's transfer stream: transfer_stream_of).
struct OtherStream {
  Device device;
  void* stream = nullptr;
};

// Runs `work`, an entry point's device work on `devices`, in the host's
// stream order (core/stream.h): after the work on the host's current
// streams (on the library stream and on `also`), and those streams following
// it once it returned. Returns what `work` returns.
template <typename Work>
std::invoke_result_t<Work&> in_stream_order(const std::vector<Device>& devices, Work&& work, OtherStream also = {}) {
  StreamOrder order(devices);
  if (also.stream != nullptr) order.also_order(also.device, also.stream);
  if constexpr (std::is_void_v<std::invoke_result_t<Work&>>) {
    work();
    order.finish();
  } else {
    std::invoke_result_t<Work&> result = work();
    order.finish();
    return result;
  }
}

const Tensor& tensor_arg(const dp_tensor* handle, const std::string& name);
// An array argument of `count` tensors, each checked ("tensors[2] is NULL").
std::vector<Tensor> tensors_arg(const dp_tensor* const* handles, size_t count, const char* name);
Device device_arg(const dp_device& device, const std::string& name);
std::vector<Device> devices_arg(const dp_device* devices, size_t count, const char* name);
DType dtype_arg(int32_t dtype, const char* name);
Shape shape_arg(int32_t ndim, const int64_t* shape, const char* name);

// A new handle owning a reference to `tensor`.
dp_tensor* new_tensor_handle(Tensor tensor);
// A handle on `parameter`'s gradient that follows it when its storage
// moves (a dp_ddp's bucket views, dp_module_set_grad).
dp_tensor* new_grad_handle(const std::shared_ptr<Parameter>& parameter);
// Fills out[0..n) with new handles, all or none.
void export_tensors(const std::vector<Tensor>& tensors, dp_tensor** out);

const std::shared_ptr<Module>& module_arg(const dp_module* handle, const std::string& name);
std::vector<std::shared_ptr<Module>> modules_arg(const dp_module* const* handles, size_t count, const char* name);
ReplicaSet& replica_set_arg(const dp_replica_set* handle, const char* name);
dp_module* new_module_handle(std::shared_ptr<Module> module);
// Fills out[0..n) with new handles, all or none.
void export_modules(const std::vector<std::shared_ptr<Module>>& modules, dp_module** out);
std::string string_arg(const char* text, const char* name);

// Whether KnownFields<Struct> lists every field: in order, without overlap,
// the last one ending where only tail padding is left.
template <typename Struct>
constexpr bool fields_cover_struct() {
  size_t end = 0;
  for (const FieldSpan& f : KnownFields<Struct>::kFields) {
    if (f.begin < end) return false;
    end = f.end;
  }
  return end <= sizeof(Struct) && sizeof(Struct) - end < alignof(Struct);
}

// kInvalidArgument unless `struct_size` is one a header of Struct can have
// (struct_size_text introduces it in the message, `fix` ends the message):
// at least a size_t, and ending on no field this library knows; anything
// past our last field is a newer header's.
template <typename Struct>
void check_struct_size(size_t struct_size, const char* struct_size_text, const char* fix) {
  static_assert(fields_cover_struct<Struct>(), "KnownFields must list every field of the struct");
  if (struct_size < sizeof(size_t)) fail_invalid(struct_size_text, " ", struct_size, "; ", fix);
  for (const FieldSpan& f : KnownFields<Struct>::kFields) {
    if (struct_size > f.begin && struct_size < f.end) {
      fail_invalid(struct_size_text, " ", struct_size, ", which ends inside field '", f.name, "' of ",
                   KnownFields<Struct>::kName, " (bytes ", f.begin, " to ", f.end, "); ", fix);
    }
  }
}

// dp_<name>_options_init: writes exactly `struct_size` bytes at `opts` (the
// caller's sizeof, older or newer than ours): our defaults, zeros past the
// fields we know, and struct_size itself, so that the create call reads only
// what the caller has. `defaults` must have static storage: its padding is
// then zero, and no uninitialised byte reaches the caller.
template <typename Options>
void options_init(Options* opts, size_t struct_size, const Options& defaults) {
  require_arg(opts, "opts");
  const std::string fix = std::string("pass sizeof(") + KnownFields<Options>::kName + ")";
  check_struct_size<Options>(struct_size, "argument 'struct_size' is", fix.c_str());
  auto* bytes = reinterpret_cast<unsigned char*>(opts);
  const size_t known = std::min(struct_size, sizeof(Options));
  std::memcpy(bytes, &defaults, known);
  std::memset(bytes + known, 0, struct_size - known);
  std::memcpy(bytes, &struct_size, sizeof(size_t));
}

// The caller's options as far as its struct goes (its struct_size, from an
// older or newer header), `defaults` past them.
template <typename Options>
Options read_options(const Options* opts, const Options& defaults, const char* init_macro) {
  Options o = defaults;
  if (opts == nullptr) return o;
  const std::string fix = std::string("initialise it with ") + init_macro;
  check_struct_size<Options>(opts->struct_size, "argument 'opts' has struct_size", fix.c_str());
  std::memcpy(&o, opts, std::min(opts->struct_size, sizeof(o)));
  return o;
}

// Writes `full` into the caller's stats struct `out` as far as its
// struct_size goes (a struct_size that ends inside a field is refused).
template <typename Stats>
void write_stats(Stats* out, Stats full) {
  require_arg(out, "out");
  const std::string fix = std::string("set it to sizeof(") + KnownFields<Stats>::kName + ")";
  check_struct_size<Stats>(out->struct_size, "argument 'out' has struct_size", fix.c_str());
  full.struct_size = out->struct_size;
  std::memcpy(out, &full, std::min(out->struct_size, sizeof(full)));
}

// The devices a call touches, for its StreamOrder: the tensors', then `more`.
std::vector<Device> devices_of(const std::vector<Tensor>& tensors, const std::vector<Device>& more = {});
// The devices of a module's parameters and buffers, then `more`.
std::vector<Device> module_devices(const Module& module, const std::vector<Device>& more = {});

inline dp_device to_c(const Device& device) { return dp_device{static_cast<int32_t>(device.type), device.index}; }

}  // namespace dparallel::capi

#define DP_API_BEGIN try {
#define DP_API_END                                        \
  return DP_OK;                                           \
  }                                                       \
  catch (...) {                                           \
    return ::dparallel::capi::handle_exception(__func__); \
  }
// For entry points that return a value rather than a status.
#define DP_API_END_VALUE(fallback)                 \
  }                                                \
  catch (...) {                                    \
    ::dparallel::capi::handle_exception(__func__); \
    return fallback;                               \
  }
