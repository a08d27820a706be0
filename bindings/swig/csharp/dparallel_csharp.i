// C#: namespace DParallel. Handles are IDisposable (SWIG's finalizers stay
// as a safety net), methods are PascalCase, a failing status throws
// DParallelException through SWIG's pending-exception mechanism, tensors are
// viewed through an IntPtr or a Span<float>, and float[] arrays are pinned
// for their one copy. The hand-written partial classes are in
// bindings/csharp/src.

%include <arrays_csharp.i>

// Sizes and indices as ulong, not SWIG's default uint: tensors pass 4 GiB.
%apply unsigned long long { size_t };
%apply const unsigned long long & { const size_t & };

%{
#include "dpswig_common.hpp"

typedef void(SWIGSTDCALL *DParallelExceptionCallback)(int code, const char *message);
static DParallelExceptionCallback dparallel_exception_callback = nullptr;

extern "C" SWIGEXPORT void SWIGSTDCALL DParallelRegisterExceptionCallback(DParallelExceptionCallback callback) {
  dparallel_exception_callback = callback;
}

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

// Calls that run host callbacks are wrapped in the partial classes, which
// rethrow the callbacks' exceptions.
%csmethodmodifiers dpswig::dataParallel "internal";
%csmethodmodifiers dpswig::parallelApply "internal";
%csmethodmodifiers dpswig::ReplicaSet::apply "internal";
%csmethodmodifiers dpswig::Ddp::finishBackward "internal";
%csmethodmodifiers dpswig::Ddp::withHook "internal";
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
%pragma(csharp) moduleclassmodifiers="public partial class"

// Every handle: IsClosed() reads the proxy, so it answers on a disposed
// object instead of throwing. CLOSED is the test, with the native half
// where the library can take the handle.
%csmethodmodifiers dpswig::Tensor::isClosed "private";
%csmethodmodifiers dpswig::Module::isClosed "private";
%define DP_CSHARP_CLOSEABLE(CLASS, CLOSED)
%extend CLASS {
%proxycode %{
  /// <summary>Whether this object is disposed: its other calls then throw
  /// DParallelException (Status.STATE).</summary>
  public bool IsClosed() {
    lock (this) {
      return CLOSED;
    }
  }
%}
}
%enddef
DP_CSHARP_CLOSEABLE(dpswig::Tensor, swigCPtr.Handle == global::System.IntPtr.Zero || isClosedRaw())
DP_CSHARP_CLOSEABLE(dpswig::TensorList, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::Module, swigCPtr.Handle == global::System.IntPtr.Zero || isClosedRaw())
DP_CSHARP_CLOSEABLE(dpswig::ModuleList, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::ReplicaSet, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::Store, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::ProcessGroup, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::Work, swigCPtr.Handle == global::System.IntPtr.Zero)
DP_CSHARP_CLOSEABLE(dpswig::Ddp, swigCPtr.Handle == global::System.IntPtr.Zero)
