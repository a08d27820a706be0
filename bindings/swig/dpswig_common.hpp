// dparallel's SWIG layer: C++ classes over the C ABI that SWIG turns into
// Java and C# classes. One class per handle; a failing dp_status becomes a
// dpswig::Error (code and dp_last_error()), which each language's typemaps
// turn into its DParallelException. Host callbacks (forward functions, comm
// hooks) are director classes: the language side catches its own exceptions
// and keeps them for the caller's thread (see java/ and csharp/), so nothing
// is ever thrown through the library's worker threads.
//
// This header: errors, constants, devices, host memory views, the library's
// own threads.
#ifndef DPARALLEL_BINDINGS_SWIG_COMMON_HPP
#define DPARALLEL_BINDINGS_SWIG_COMMON_HPP

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

// Before dparallel.h: with a DLPack 0.x header, dp_dlpack.h then defines
// DLManagedTensorVersioned (dpswig_tensor.hpp reads its deleter).
#include <dlpack/dlpack.h>

#include "dparallel/dparallel.h"

// A released handle and the call that releases it, in the language's own
// terms (C# says "disposed" and "Dispose()").
#if !defined(DPSWIG_CLOSED) && !defined(SWIG)
#define DPSWIG_CLOSED "closed"
#define DPSWIG_CLOSE_CALL "close()"
#endif

namespace dpswig {

class Error : public std::exception {
 public:
  Error(int code, std::string message) : code_(code), message_(std::move(message)) {}
  int code() const { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  int code_;
  std::string message_;
};

inline void check(dp_status status) {
  if (status < 0) {
    const char* message = dp_last_error();
    throw Error(status, std::string(dp_status_string(status)) + ": " + (message != nullptr ? message : ""));
  }
}

inline void fail_argument(const char* message) { throw Error(DP_EINVAL, std::string("invalid argument: ") + message); }

// Status codes, dtypes, reduce ops and comm hooks as constants of the
// language side's classes.
struct Status {
  static const int OK = DP_OK;
  static const int INVALID = DP_EINVAL;
  static const int NO_MEMORY = DP_ENOMEM;
  static const int DEVICE = DP_EDEVICE;
  static const int TIMEOUT = DP_ETIMEOUT;
  static const int REMOTE = DP_EREMOTE;
  static const int USER = DP_EUSER;
  static const int IO = DP_EIO;
  static const int STATE = DP_ESTATE;
  static const int UNSUPPORTED = DP_EUNSUPPORTED;
  static const int INTERNAL = DP_EINTERNAL;
  static std::string name(int code) { return dp_status_string(code); }
};
struct DType {
  static const int FLOAT32 = DP_FLOAT32;
  static const int FLOAT64 = DP_FLOAT64;
  static const int FLOAT16 = DP_FLOAT16;
  static const int BFLOAT16 = DP_BFLOAT16;
  static const int INT8 = DP_INT8;
  static const int UINT8 = DP_UINT8;
  static const int INT32 = DP_INT32;
  static const int INT64 = DP_INT64;
  static const int BOOL = DP_BOOL;
  // Bytes per element of `dtype`.
  static size_t elementSize(int dtype) {
    size_t n = dp_dtype_size(dtype);
    if (n == 0) throw Error(DP_EINVAL, "invalid argument: 'dtype' " + std::to_string(dtype) + " is not a DType");
    return n;
  }
};
// A native address (a DLManagedTensor, a CUDA stream, device memory): long in
// Java, IntPtr in C#.
typedef void* NativePointer;

struct Library {
  // Ends the threads the library keeps for itself (device workers, the
  // compute pool, async default streams) once they ran what they hold; a
  // later call that needs them starts them again. Not from inside a
  // callback the library runs.
  static void shutdown() { check(dp_shutdown()); }
};
inline std::string lastError() { return dp_last_error(); }
inline unsigned versionNumber() { return dp_version_number(); }

// What the library allocated for a device's tensors, in bytes: in use now,
// the most in use at once since the last reset, and freed blocks kept for
// reuse (all devices together). Memory lent by the host is not counted.
class MemoryStats {
 public:
  long long allocatedBytes() const { return static_cast<long long>(s_.allocated_bytes); }
  long long peakAllocatedBytes() const { return static_cast<long long>(s_.peak_allocated_bytes); }
  long long cachedBytes() const { return static_cast<long long>(s_.cached_bytes); }
  explicit MemoryStats(const dp_memory_stats& s) : s_(s) {}

 private:
  dp_memory_stats s_;
};

class Device {
 public:
  Device() : d_{DP_DEVICE_CPU, 0} {}
  // "cpu", "cpu:1", "cuda:0".
  explicit Device(const std::string& text) : d_{DP_DEVICE_CPU, 0} { check(dp_device_parse(text.c_str(), &d_)); }
  int type() const { return d_.type; }
  int index() const { return d_.index; }
  bool isCpu() const { return d_.type == DP_DEVICE_CPU; }
  std::string toString() const {
    char buf[64];
    check(dp_device_format(d_, buf, sizeof buf));
    return buf;
  }
  bool equals(const Device& other) const { return d_.type == other.d_.type && d_.index == other.d_.index; }
  // "cpu:0,cpu:1" as a list.
  static std::vector<Device> list(const std::string& commaSeparated) {
    std::vector<Device> out;
    size_t start = 0;
    while (start <= commaSeparated.size()) {
      size_t end = commaSeparated.find(',', start);
      if (end == std::string::npos) end = commaSeparated.size();
      out.emplace_back(commaSeparated.substr(start, end - start));
      start = end + 1;
    }
    return out;
  }
  static int count(int type) {
    int32_t n = 0;
    check(dp_device_count(type, &n));
    return n;
  }
  MemoryStats memoryStats() const {
    dp_memory_stats s{};
    s.struct_size = sizeof s;
    check(dp_device_memory_stats(d_, &s));
    return MemoryStats(s);
  }
  // The peak of memoryStats() starts again from what is in use now.
  void resetPeakMemory() const { check(dp_device_reset_peak_memory(d_)); }
  static const int CPU = DP_DEVICE_CPU;
  static const int CUDA = DP_DEVICE_CUDA;

  dp_device raw() const { return d_; }
  static Device fromRaw(dp_device d) {
    Device out;
    out.d_ = d;
    return out;
  }

 private:
  dp_device d_;
};

inline std::vector<dp_device> rawDevices(const std::vector<Device>& devices) {
  std::vector<dp_device> out;
  out.reserve(devices.size());
  for (const Device& d : devices) out.push_back(d.raw());
  return out;
}

// A range of host memory for the languages' zero-copy views.
struct HostBytes {
  void* data;
  size_t size;
};

// Where Java's float[] is read from and written to without a staging copy.
class FloatSource {
 public:
  virtual ~FloatSource() {}
  virtual size_t size() const = 0;
  virtual void read(float* dst) const = 0;
};
class FloatSink {
 public:
  virtual ~FloatSink() {}
  virtual size_t size() const = 0;
  virtual void write(const float* src) = 0;
};

// Marks this thread as running a host callback (a forward, a comm hook, a
// stream's host function) while it lives: a close() there may be one the
// call that runs the callback waits for.
class CallbackScope {
 public:
  CallbackScope() { ++depth(); }
  ~CallbackScope() { --depth(); }
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;
  static bool active() { return depth() > 0; }

 private:
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
};

class Gate;

// One call's hold on a handle: the handle stays valid (close() waits) until
// the lease goes. A temporary lease lives to the end of the full
// expression, so `check(dp_x(handle()))` holds it across the call.
template <class H>
class Lease {
 public:
  Lease(Gate* gate, H* h) : gate_(gate), h_(h) {}
  Lease(Lease&& other) noexcept : gate_(other.gate_), h_(other.h_) { other.gate_ = nullptr; }
  // Takes over `other`'s hold for another pointer the same object guards.
  template <class O>
  Lease(Lease<O>&& other, H* h) noexcept : gate_(other.gate_), h_(h) {
    other.gate_ = nullptr;
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  Lease& operator=(Lease&&) = delete;
  inline ~Lease();
  operator H*() const { return h_; }
  H* operator->() const { return h_; }
  H* get() const { return h_; }

 private:
  template <class>
  friend class Lease;
  Gate* gate_;
  H* h_;
};

// The calls in flight on one handle object, each holding a Lease. close()
// shuts the gate: it waits for those calls, then releases the handle, so a
// close on one thread never frees a handle under a call on another; a call
// after it throws Status.STATE.
class Gate {
 public:
  // A lease on `*slot` (read under the lock: close() clears it), or
  // Status.STATE once shut, naming `arg` when the handle is an argument.
  template <class H>
  Lease<H> hold(H* const& slot, const char* kind, const char* arg = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_ || slot == nullptr) {
      throw Error(DP_ESTATE, arg != nullptr ? "invalid state: '" + std::string(arg) + "' is " DPSWIG_CLOSED
                                            : "the " + std::string(kind) + " is " DPSWIG_CLOSED);
    }
    ++calls_;
    return Lease<H>(this, slot);
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--calls_ == 0) idle_.notify_all();
  }
  // Shuts the gate once the calls in flight are done: true for the first
  // close, false when it was shut already. From inside a callback while a
  // call is in flight it would wait for itself (the call waits for the
  // callback): Status.STATE then, and the gate stays open.
  bool shut() {
    std::unique_lock<std::mutex> lock(mu_);
    if (shut_) return false;
    if (calls_ > 0 && CallbackScope::active()) {
      throw Error(DP_ESTATE,
                  "invalid state: " DPSWIG_CLOSE_CALL
                  " inside a callback while a call on the same object is in flight (it would wait for itself); "
                  "call it after that call returns");
    }
    shut_ = true;
    idle_.wait(lock, [this] { return calls_ == 0; });
    return true;
  }
  bool isShut() const {
    std::lock_guard<std::mutex> lock(mu_);
    return shut_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable idle_;
  long calls_ = 0;
  bool shut_ = false;
};

template <class H>
Lease<H>::~Lease() {
  if (gate_ != nullptr) gate_->leave();
}

// Keeps the first C++ exception a callback raised on a worker thread, for
// the caller's thread to rethrow.
class PendingException {
 public:
  void set(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!e_) e_ = e;
  }
  void rethrow() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::swap(e, e_);
    }
    if (e) std::rethrow_exception(e);
  }

 private:
  std::mutex mu_;
  std::exception_ptr e_;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_COMMON_HPP
