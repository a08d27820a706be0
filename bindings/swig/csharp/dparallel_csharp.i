// C#: namespace DParallel. Handles are IDisposable (SWIG's finalizers stay
// as a safety net), methods are PascalCase, a failing status throws
// DParallelException through SWIG's pending-exception mechanism, tensors are
// viewed through an IntPtr or a Span<float>, and float[] arrays are pinned
// for their one copy. The hand-written partial classes are in
// bindings/csharp/src.

%include <arrays_csharp.i>

%begin %{
#define DPSWIG_CLOSED "disposed"
#define DPSWIG_CLOSE_CALL "Dispose()"
%}

// Sizes and indices as ulong, not SWIG's default uint: tensors pass 4 GiB.
%apply unsigned long long { size_t };
%apply const unsigned long long & { const size_t & };

%{
#include <mutex>
#include <thread>

#include "dpswig_stream.hpp"
#include "dpswig_tensor.hpp"

typedef void(SWIGSTDCALL *DParallelExceptionCallback)(int code, const char *message);
static DParallelExceptionCallback dparallel_exception_callback = nullptr;

extern "C" SWIGEXPORT void SWIGSTDCALL DParallelRegisterExceptionCallback(DParallelExceptionCallback callback) {
  dparallel_exception_callback = callback;
}

typedef void(SWIGSTDCALL *DParallelHostCallback)(void *handle, int libraryThread);
static DParallelHostCallback dparallel_host_callback = nullptr;

extern "C" SWIGEXPORT void SWIGSTDCALL DParallelRegisterHostCallback(DParallelHostCallback callback) {
  dparallel_host_callback = callback;
}

namespace dpswig {
/* An Action queued on a stream, as a GCHandle that DeviceStream.RunHost
 * frees. It says whether it runs on a library thread (not the launching
 * one), which the C# side must mark for Mono. */
class CSharpHostCall : public HostCall {
 public:
  explicit CSharpHostCall(void *handle) : handle_(handle), launcher_(std::this_thread::get_id()) {}
  void run() override { dparallel_host_callback(handle_, std::this_thread::get_id() != launcher_ ? 1 : 0); }

 private:
  void *handle_;
  std::thread::id launcher_;
};

/* GCHandles of pinned arrays that no tensor uses any more. The last tensor
 * may go on any thread, a library thread included, where no managed code
 * may run: the C# side frees them on its own threads (Tensor.FreeUnpinned). */
static std::mutex &unpinnedMutex() {
  static std::mutex *mu = new std::mutex();
  return *mu;
}
static std::vector<void *> &unpinned() {
  static std::vector<void *> *handles = new std::vector<void *>();
  return *handles;
}
class CSharpPinned : public HostMemory {
 public:
  explicit CSharpPinned(void *handle) : handle_(handle) {}
  ~CSharpPinned() override {
    if (handle_ == nullptr) return;
    std::lock_guard<std::mutex> lock(unpinnedMutex());
    unpinned().push_back(handle_);
  }
  /* No tensor was made: the caller frees the handle itself. */
  void disarm() { handle_ = nullptr; }

 private:
  void *handle_;
};
}  // namespace dpswig

%}

%pragma(csharp) imclasscode=%{
  protected class DParallelExceptionHelper {
    public delegate void ExceptionDelegate(int code, string message);
    static ExceptionDelegate callback = new ExceptionDelegate(SetPending);

    [global::System.Runtime.InteropServices.DllImport("$dllimport", EntryPoint="DParallelRegisterExceptionCallback")]
    public static extern void DParallelRegisterExceptionCallback(ExceptionDelegate callback);

    static void SetPending(int code, string message) {
      SWIGPendingException.Set(new DParallelException(code, message));
    }

    static DParallelExceptionHelper() {
      DParallelRegisterExceptionCallback(callback);
    }
  }
  protected static DParallelExceptionHelper dparallelExceptionHelper = new DParallelExceptionHelper();

  protected class DParallelHostHelper {
    public delegate void HostDelegate(global::System.IntPtr handle, int libraryThread);
    static HostDelegate callback = new HostDelegate(DeviceStream.RunHost);

    [global::System.Runtime.InteropServices.DllImport("$dllimport", EntryPoint="DParallelRegisterHostCallback")]
    public static extern void DParallelRegisterHostCallback(HostDelegate callback);

    static DParallelHostHelper() {
      DParallelRegisterHostCallback(callback);
    }
  }
  protected static DParallelHostHelper dparallelHostHelper = new DParallelHostHelper();
  // The library's threads end at exit (ProcessExit.cs).
  internal static readonly bool shutdownAtExit = ProcessExit.Register();
%}

%exception {
  try {
    $action
  } catch (const dpswig::Error &e) {
    dparallel_exception_callback(e.code(), e.what());
    return $null;
  } catch (const std::exception &e) {
    SWIG_CSharpSetPendingException(SWIG_CSharpApplicationException, e.what());
    return $null;
  }
}

// A handle argument is checked before its pointer leaves C#: a disposed
// one is Status.STATE and a missing reference Status.INVALID, each naming
// the argument (a disposed one would otherwise pass as null, an empty slot).
%typemap(csin) SWIGTYPE & "Args.Present($csclassname.getCPtr($csinput), $csinput, \"$csinput\")"
%typemap(csin) SWIGTYPE * "Args.Nullable($csclassname.getCPtr($csinput), $csinput, \"$csinput\")"

// PascalCase, except the lowercase methods std_vector.i's C# code calls
// (ours named like them are renamed one by one). The internal *Raw calls
// keep their names.
// A call on a disposed handle throws instead of dereferencing null.
%typemap(check) SWIGTYPE *self %{
  if (!$1) {
    dparallel_exception_callback(DP_ESTATE, "invalid state: the object is disposed");
    return $null;
  }
%}

%rename("%(firstuppercase)s", %$isfunction, notregexmatch$name="^(size|capacity|reserve|getitem|getitemcopy|setitem)$") "";
%rename("%(firstuppercase)s", %$isvariable) "";
%rename(Size) dpswig::TensorList::size;
%rename(Size) dpswig::ModuleList::size;
%rename(Size) dpswig::ReplicaSet::size;
%rename(Size) dpswig::ProcessGroup::size;
// A method named Device would hide the Device type inside Tensor.
%rename(GetDevice) dpswig::Tensor::device;
%rename(GetDevice) dpswig::Stream::device;
%csmethodmodifiers dpswig::Device::toString "public override";

// float[] in and out: pinned by the marshaller (float is blittable), one copy.
%apply float INPUT[] { const float *values }
%apply float OUTPUT[] { float *values }
%csmethodmodifiers dpswig::Tensor::copyFrom(const float *, size_t) "internal";
%csmethodmodifiers dpswig::Tensor::copyTo(float *, size_t) const "internal";
%rename(CopyFromRaw) dpswig::Tensor::copyFrom(const float *, size_t);
%rename(CopyToRaw) dpswig::Tensor::copyTo(float *, size_t) const;
%ignore dpswig::Tensor::copyFrom(const FloatSource &);
%ignore dpswig::Tensor::copyTo(FloatSink &) const;

// The tensor's memory as an IntPtr, valid while the tensor is referenced
// and not disposed; AsMemory() (Partials.cs) owns a viewReference instead.
%csmethodmodifiers dpswig::Tensor::viewReference "internal";
%typemap(ctype) dpswig::HostBytes "void *"
%typemap(imtype) dpswig::HostBytes "global::System.IntPtr"
%typemap(cstype) dpswig::HostBytes "global::System.IntPtr"
%typemap(out) dpswig::HostBytes %{ $result = $1.data; %}
%typemap(csout, excode=SWIGEXCODE) dpswig::HostBytes {
    global::System.IntPtr ret = $imcall;$excode
    return ret;
  }
%rename(Data) dpswig::Tensor::hostBytes;

// Native addresses (DLPack tensors, CUDA streams, device memory) as IntPtr.
%typemap(ctype) dpswig::NativePointer "void *"
%typemap(imtype) dpswig::NativePointer "global::System.IntPtr"
%typemap(cstype) dpswig::NativePointer "global::System.IntPtr"
%typemap(in) dpswig::NativePointer %{ $1 = $input; %}
%typemap(out) dpswig::NativePointer %{ $result = $1; %}
%typemap(csin) dpswig::NativePointer "$csinput"
%typemap(csout, excode=SWIGEXCODE) dpswig::NativePointer {
    global::System.IntPtr ret = $imcall;$excode
    return ret;
  }

// Host functions on streams: DeviceStream.LaunchHostFunc (Partials.cs)
// passes a GCHandle of its work; on failure it frees the handle itself.
%ignore dpswig::Stream::launchHostFunc;
%ignore dpswig::Stream::synchronize;
%csmethodmodifiers dpswig::Stream::launchHostFuncRaw "internal";
%csmethodmodifiers dpswig::Stream::synchronizeRaw "internal";
%typemap(csclassmodifiers) dpswig::Stream "public partial class"
%extend dpswig::Stream {
  void launchHostFuncRaw(dpswig::NativePointer work) {
    dpswig::HostCallArg fn;
    fn.call.reset(new dpswig::CSharpHostCall(work));
    $self->launchHostFunc(fn);
  }
  void synchronizeRaw() { $self->synchronize(); }
}

// Tensors over pinned arrays (Tensor.FromArray in Partials.cs): the
// GCHandle `pin` is queued for the C# side to free once the last tensor
// over the array is gone; on failure the caller frees it.
%ignore dpswig::Tensor::fromHost;
%newobject dpswig::Tensor::fromPinnedRaw;
%csmethodmodifiers dpswig::Tensor::fromPinnedRaw "internal";
%csmethodmodifiers dpswig::Tensor::takeUnpinnedRaw "internal";
%extend dpswig::Tensor {
  static dpswig::Tensor *fromPinnedRaw(dpswig::NativePointer data, size_t size, const std::vector<long long> &shape,
                                       int dtype, const dpswig::Device &device, dpswig::NativePointer pin) {
    dpswig::HostBuffer buffer;
    buffer.data = data;
    buffer.size = size;
    dpswig::CSharpPinned *pinned = new dpswig::CSharpPinned(pin);
    buffer.keep.reset(pinned);
    try {
      return dpswig::Tensor::fromHost(buffer, shape, dtype, device);
    } catch (...) {
      if (buffer.keep) pinned->disarm();
      throw;
    }
  }
  /* One GCHandle to free, or null. */
  static dpswig::NativePointer takeUnpinnedRaw() {
    std::lock_guard<std::mutex> lock(dpswig::unpinnedMutex());
    if (dpswig::unpinned().empty()) return nullptr;
    void *handle = dpswig::unpinned().back();
    dpswig::unpinned().pop_back();
    return handle;
  }
}

// Calls that run host callbacks are wrapped in the partial classes, which
// rethrow the callbacks' exceptions.
%csmethodmodifiers dpswig::dataParallel "internal";
%csmethodmodifiers dpswig::parallelApply "internal";
%csmethodmodifiers dpswig::ReplicaSet::apply "internal";
%csmethodmodifiers dpswig::Ddp::finishBackward "internal";
%csmethodmodifiers dpswig::Ddp::withHook "internal";
%csmethodmodifiers dpswig::Ddp::create "internal";
%csmethodmodifiers dpswig::Ddp::join "internal";
%csmethodmodifiers dpswig::DdpOptions::setOnBucketReduced "internal";
%csmethodmodifiers dpswig::BucketReduced::BucketReduced "internal";
%typemap(csclassmodifiers) dpswig::BucketReduced "public abstract class"
%typemap(csclassmodifiers) dpswig::DdpOptions "public partial class"
// Host callbacks derive from ForwardFunction and CommHook, which catch what
// the host code throws (an exception must not unwind through the library's
// threads); the bases cannot be derived outside the assembly.
%csmethodmodifiers dpswig::ForwardFunction::ForwardFunction "internal";
%csmethodmodifiers dpswig::CommHook::CommHook "internal";
%typemap(csclassmodifiers) dpswig::ForwardFunction "public abstract class"
%typemap(csclassmodifiers) dpswig::CommHook "public abstract class"
%typemap(csclassmodifiers) dpswig::Tensor "public partial class"
%typemap(csclassmodifiers) dpswig::ReplicaSet "public partial class"
%typemap(csclassmodifiers) dpswig::Ddp "public partial class"
%typemap(csclassmodifiers) dpswig::Device "public partial class"
%typemap(csclassmodifiers) dpswig::DeviceMesh "public partial class"
%pragma(csharp) moduleclassmodifiers="public partial class"

// Every handle: Dispose() releases the native handle once the calls in
// flight on it have returned (each call holds a lease on it, so a Dispose
// on one thread never frees what a call on another uses), and a call after
// it throws DParallelException (Status.STATE). The native object itself, a
// few bytes, is deleted by the finalizer: no call can be on its way into it
// then. IsClosed() reads the proxy too, so it answers on any object.
%define DP_CSHARP_CLOSEABLE(CLASS)
%csmethodmodifiers CLASS::close "private";
%csmethodmodifiers CLASS::isClosed "private";
%typemap(csdispose) CLASS %{
  ~$csclassname() {
    Dispose(false);
  }

  /// <summary>Releases the native handle, once the calls in flight on it
  /// (from other threads) have returned; a second call does nothing. Inside
  /// a callback, while a call on this object is in flight (maybe the one
  /// running the callback), it throws DParallelException (Status.STATE)
  /// instead of waiting.</summary>
  public void Dispose() {
    if (swigCPtr.Handle != global::System.IntPtr.Zero) closeRaw();
  }
%}
%extend CLASS {
%proxycode %{
  /// <summary>Whether this object is disposed: its other calls then throw
  /// DParallelException (Status.STATE).</summary>
  public bool IsClosed() {
    return swigCPtr.Handle == global::System.IntPtr.Zero || isClosedRaw();
  }
%}
}
%enddef
DP_CSHARP_CLOSEABLE(dpswig::Tensor)
DP_CSHARP_CLOSEABLE(dpswig::TensorList)
DP_CSHARP_CLOSEABLE(dpswig::Module)
DP_CSHARP_CLOSEABLE(dpswig::ModuleList)
DP_CSHARP_CLOSEABLE(dpswig::ReplicaSet)
DP_CSHARP_CLOSEABLE(dpswig::Store)
DP_CSHARP_CLOSEABLE(dpswig::ProcessGroup)
DP_CSHARP_CLOSEABLE(dpswig::DeviceMesh)
DP_CSHARP_CLOSEABLE(dpswig::Work)
DP_CSHARP_CLOSEABLE(dpswig::Ddp)
DP_CSHARP_CLOSEABLE(dpswig::Stream)
DP_CSHARP_CLOSEABLE(dpswig::Fsdp)
// Disposing an Fsdp is collective: from the finalizer it would run at
// another moment on each rank, so one collected undisposed stays open, and
// says so.
%typemap(csdisposing, methodname="Dispose", methodmodifiers="protected", parameters="bool disposing") dpswig::Fsdp {
    lock(this) {
      if (swigCPtr.Handle != global::System.IntPtr.Zero) {
        if (!disposing && !isClosedRaw()) {
          // A finalizer must not throw: as the runtime shuts down, the
          // console's streams may be closed already (the process is ending,
          // so the warning is moot then).
          try {
            global::System.Console.Error.WriteLine("dparallel: an Fsdp was collected without Dispose(); it stays open (disposing is collective)");
          } catch (global::System.Exception) {
          }
          return;
        }
        if (swigCMemOwn) {
          swigCMemOwn = false;
          $imcall;
        }
        swigCPtr = new global::System.Runtime.InteropServices.HandleRef(null, global::System.IntPtr.Zero);
      }
    }
  }
