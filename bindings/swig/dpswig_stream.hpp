// dparallel's SWIG layer: streams (PyTorch's current-stream contract).
#ifndef DPARALLEL_BINDINGS_SWIG_STREAM_HPP
#define DPARALLEL_BINDINGS_SWIG_STREAM_HPP

#include <memory>

#include "dpswig_common.hpp"

namespace dpswig {

// Host work queued on a stream: run() once, on a host thread, after the
// work queued before it; deleted right after. run() must not throw (each
// language catches its host code's exceptions for synchronize()).
class HostCall {
 public:
  virtual ~HostCall() {}
  virtual void run() = 0;
};
// A HostCall the language side made, handed over by launchHostFunc.
struct HostCallArg {
  std::unique_ptr<HostCall> call;
};

// A queue of device work: a cudaStream_t for cuda, a queue run by a thread
// of its own for cpu.
class Stream {
 public:
  // A new stream of `device` (for cuda a non-blocking cudaStream_t);
  // close() waits for its queued work, then frees it.
  explicit Stream(const Device& device) : device_(device), owned_(true) { check(dp_stream_create(device.raw(), &s_)); }
  // A stream the host made (a cudaStream_t of that GPU, or a pointer() of
  // another Stream; null: the legacy default stream). close() leaves it be.
  static Stream* wrap(const Device& device, NativePointer stream) { return new Stream(device, stream, false); }
  // This thread's current stream for `device`, or null when none is set.
  static Stream* current(const Device& device) {
    void* s = nullptr;
    check(dp_get_current_stream(device.raw(), &s));
    return s != nullptr ? new Stream(device, s, false) : nullptr;
  }
  // No current stream for `device` on this thread: calls complete before
  // they return again.
  static void clearCurrent(const Device& device) { check(dp_set_current_stream(device.raw(), nullptr)); }
  // No call is in flight when the object itself goes.
  ~Stream() {
    if (owned_ && !closed_) dp_stream_destroy(device_.raw(), s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  // Frees an owned stream once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    if (owned_) dp_stream_destroy(device_.raw(), s_);
    closed_ = true;
  }
  Device device() const { return device_; }
  NativePointer pointer() const { return handle().get(); }
  // Later calls on this thread that touch tensors on the stream's device
  // queue their work on it, after what it holds.
  void makeCurrent() { check(dp_set_current_stream(device_.raw(), handle())); }
  // Returns once the work queued so far is done.
  void synchronize() { check(dp_stream_synchronize(device_.raw(), handle())); }
  // Queues `fn` after the work queued so far; work queued after it waits
  // for it. On a cpu device's legacy default stream it runs before this
  // returns.
  void launchHostFunc(HostCallArg& fn) {
    if (!fn.call) fail_argument("'fn' is null");
    HostCall* call = fn.call.get();
    check(dp_stream_launch_host_func(device_.raw(), handle(), &runHostCall, call));
    fn.call.release();  // runHostCall deletes it
  }
  bool isClosed() const { return gate_.isShut(); }

  // The stream, held for one call (`arg`: the argument's name). A wrapped
  // legacy default stream is null, so the slot is the stream object itself.
  Lease<void> handle(const char* arg = nullptr) const {
    Lease<const Stream> self = gate_.hold(self_, "stream", arg);
    return Lease<void>(std::move(self), s_);
  }

 private:
  Stream(const Device& device, void* s, bool owned) : device_(device), s_(s), owned_(owned) {}
  static void runHostCall(void* call) {
    CallbackScope scope;
    std::unique_ptr<HostCall> owned(static_cast<HostCall*>(call));
    owned->run();
  }
  mutable Gate gate_;
  const Stream* const self_ = this;
  Device device_;
  void* s_ = nullptr;
  bool owned_ = true;
  bool closed_ = false;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_STREAM_HPP
