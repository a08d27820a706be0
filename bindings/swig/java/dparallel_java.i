// Java: package org.dparallel. Handles are AutoCloseable (finalizers stay
// as a safety net), a failing status throws DParallelException, tensors are
// viewed through direct ByteBuffers, and the library's worker threads are
// attached to the JVM as daemons once, on their first callback.

%begin %{
#define SWIG_JAVA_ATTACH_CURRENT_THREAD_AS_DAEMON
#define SWIG_JAVA_NO_DETACH_CURRENT_THREAD
%}

// NativeLibrary.java finds the JNI library (a path, java.library.path or
// the jar) and ends the library's threads at exit.
%pragma(java) jniclasscode=%{
  static {
    NativeLibrary.load();
  }
%}

%{
#include <jni.h>
#include "dpswig_common.hpp"

/* DParallelException's class, looked up once through the class loader that
 * loaded this library: a FindClass on one of the library's worker threads
 * (a callback's failing call) would only see the system class loader. */
static jclass dpswig_exception_class = nullptr;
static jmethodID dpswig_exception_ctor = nullptr;

extern "C" JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM *vm, void *) {
  JNIEnv *jenv = nullptr;
  if (vm->GetEnv((void **)&jenv, JNI_VERSION_1_6) != JNI_OK) return JNI_ERR;
  jclass cls = jenv->FindClass("org/dparallel/DParallelException");
  if (cls == nullptr) return JNI_ERR;
  dpswig_exception_class = (jclass)jenv->NewGlobalRef(cls);
  dpswig_exception_ctor = jenv->GetMethodID(cls, "<init>", "(ILjava/lang/String;)V");
  jenv->DeleteLocalRef(cls);
  return dpswig_exception_class != nullptr && dpswig_exception_ctor != nullptr ? JNI_VERSION_1_6 : JNI_ERR;
}

static void dpswig_java_throw(JNIEnv *jenv, int code, const char *message) {
  jstring text = jenv->NewStringUTF(message);
  if (text == nullptr) return; /* OutOfMemoryError is pending */
  jobject error = jenv->NewObject(dpswig_exception_class, dpswig_exception_ctor, (jint)code, text);
  if (error != nullptr) jenv->Throw((jthrowable)error);
}

namespace dpswig {
/* A Java float[] read or written with one copy (Get/SetFloatArrayRegion). */
class JavaFloatArray : public FloatSource, public FloatSink {
 public:
  JavaFloatArray() : env_(nullptr), array_(nullptr) {}
  JavaFloatArray(JNIEnv *env, jfloatArray array) : env_(env), array_(array) {}
  size_t size() const override { return (size_t)env_->GetArrayLength(array_); }
  void read(float *dst) const override { env_->GetFloatArrayRegion(array_, 0, (jsize)size(), dst); }
  void write(const float *src) override { env_->SetFloatArrayRegion(array_, 0, (jsize)size(), src); }

 private:
  JNIEnv *env_;
  jfloatArray array_;
};
}  // namespace dpswig
%}

%exception {
  try {
    $action
  } catch (const dpswig::Error &e) {
    dpswig_java_throw(jenv, e.code(), e.what());
    return $null;
  } catch (const std::exception &e) {
    SWIG_JavaThrowException(jenv, SWIG_JavaRuntimeException, e.what());
    return $null;
  }
}

// A call on a closed handle (its native object deleted by close()) throws
// instead of dereferencing null.
%typemap(check) SWIGTYPE *self %{
  if (!$1) {
    dpswig_java_throw(jenv, DP_ESTATE, "invalid state: the object is closed");
    return $null;
  }
%}

// float[] in and out, one copy.
%typemap(jni) const dpswig::FloatSource &, dpswig::FloatSink & "jfloatArray"
%typemap(jtype) const dpswig::FloatSource &, dpswig::FloatSink & "float[]"
%typemap(jstype) const dpswig::FloatSource &, dpswig::FloatSink & "float[]"
%typemap(javain) const dpswig::FloatSource &, dpswig::FloatSink & "$javainput"
%typemap(in) const dpswig::FloatSource & (dpswig::JavaFloatArray array), dpswig::FloatSink & (dpswig::JavaFloatArray array) {
  if ($input == nullptr) {
    dpswig_java_throw(jenv, DP_EINVAL, "invalid argument: 'values' is null");
    return $null;
  }
  array = dpswig::JavaFloatArray(jenv, $input);
  $1 = &array;
}
%ignore dpswig::Tensor::copyFrom(const float *, size_t);
%ignore dpswig::Tensor::copyTo(float *, size_t) const;

// The tensor's memory as a direct ByteBuffer in native byte order. JNI's
// buffer holds nothing alive: Tensor.buffer() takes it from a reference of
// its own (viewReference) that a Cleaner drops when the buffer goes.
%typemap(jni) dpswig::HostBytes "jobject"
%typemap(jtype) dpswig::HostBytes "java.nio.ByteBuffer"
%typemap(jstype) dpswig::HostBytes "java.nio.ByteBuffer"
%typemap(out) dpswig::HostBytes {
  static char empty;
  $result = jenv->NewDirectByteBuffer($1.data != nullptr ? $1.data : &empty, (jlong)$1.size);
}
%typemap(javaout) dpswig::HostBytes {
    return $jnicall.order(java.nio.ByteOrder.nativeOrder());
  }
%javamethodmodifiers dpswig::Tensor::hostBytes "private";
%javamethodmodifiers dpswig::Tensor::viewReference "private";

%javamethodmodifiers dpswig::dataParallel "";
%javamethodmodifiers dpswig::parallelApply "";
%javamethodmodifiers dpswig::ReplicaSet::apply "";
%javamethodmodifiers dpswig::Ddp::finishBackward "";
%javamethodmodifiers dpswig::ForwardFunction::invoke "protected";
%javamethodmodifiers dpswig::CommHook::invoke "protected";
// Host callbacks derive from ForwardFunction and CommHook (this package),
// which catch what the host code throws; the bases cannot be derived
// elsewhere.
%javamethodmodifiers dpswig::ForwardFunction::ForwardFunction "";
%javamethodmodifiers dpswig::CommHook::CommHook "";
%typemap(javaclassmodifiers) dpswig::ForwardFunction "public abstract class";
%typemap(javaclassmodifiers) dpswig::CommHook "public abstract class";

%javamethodmodifiers dpswig::Ddp::withHook "";

// Every handle: close() deletes the native object now, and isClosed() reads
// the proxy, so it answers on a closed object instead of throwing. CLOSED
// is the test, with the native half where the library can take the handle.
%javamethodmodifiers dpswig::Tensor::isClosed "private";
%javamethodmodifiers dpswig::Module::isClosed "private";
%define DP_JAVA_CLOSEABLE(CLASS, CLOSED)
%typemap(javainterfaces) CLASS "AutoCloseable"
%extend CLASS {
%proxycode %{
  /** Releases the native handle now (a second call does nothing); the finalizer is only a safety net. */
  @Override
  public void close() {
    delete();
  }

  /** Whether this object is closed: its other calls then throw DParallelException (Status.STATE). */
  public synchronized boolean isClosed() {
    return CLOSED;
  }
%}
}
%enddef
DP_JAVA_CLOSEABLE(dpswig::Tensor, swigCPtr == 0 || isClosedRaw())
DP_JAVA_CLOSEABLE(dpswig::TensorList, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::Module, swigCPtr == 0 || isClosedRaw())
DP_JAVA_CLOSEABLE(dpswig::ModuleList, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::ReplicaSet, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::Store, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::ProcessGroup, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::Work, swigCPtr == 0)
DP_JAVA_CLOSEABLE(dpswig::Ddp, swigCPtr == 0)

%typemap(javacode) dpswig::Tensor %{
  /** A tensor of the given shape (zeros), float32 on cpu:0. */
  public Tensor(long... shape) {
    this(LongVector.of(shape));
  }

  /** A float32 tensor of the given shape (zeros) on {@code device}. */
  public Tensor(Device device, long... shape) {
    this(LongVector.of(shape), device);
  }

  /** A float32 cpu tensor holding a copy of {@code values}. */
  public static Tensor of(float[] values, long... shape) {
    Tensor t = new Tensor(shape);
    try {
      t.copyFrom(values);
    } catch (RuntimeException e) {
      t.close();
      throw e;
    }
    return t;
  }

  // Drops the reference a view owns, once the view is unreachable; it must
  // not hold the view itself, or the view would never become unreachable.
  private static final class ViewRelease implements Runnable {
    private final long reference;

    ViewRelease(long reference) {
      this.reference = reference;
    }

    @Override
    public void run() {
      ParallelJNI.delete_Tensor(reference);
    }
  }

  private static final java.lang.ref.Cleaner VIEW_CLEANER = java.lang.ref.Cleaner.create();

  /** The tensor's memory as a direct ByteBuffer in native byte order, without a copy (cpu tensors). The
   * buffer owns a reference to the memory: it stays valid after this tensor is closed or collected, until
   * it and every buffer made from it (asFloatBuffer(), slice(), duplicate()) are unreachable. */
  public java.nio.ByteBuffer buffer() {
    Tensor owner = viewReference();
    java.nio.ByteBuffer view;
    try {
      view = owner.hostBytes();
    } catch (RuntimeException e) {
      owner.delete();
      throw e;
    }
    // From here the cleaner, not the owner object, deletes the reference.
    owner.swigCMemOwn = false;
    VIEW_CLEANER.register(view, new ViewRelease(owner.swigCPtr));
    return view;
  }

  /** The tensor's memory as floats, without a copy (cpu tensors); it stays valid as {@link #buffer()} does. */
  public java.nio.FloatBuffer floats() {
    return buffer().asFloatBuffer();
  }

  /** A new float[] with the tensor's values (one copy). */
  public float[] toArray() {
    float[] out = new float[Math.toIntExact(numel())];
    copyTo(out);
    return out;
  }

  public long[] shapeArray() {
    LongVector v = shape();
    long[] out = new long[v.size()];
    for (int i = 0; i < out.length; ++i) out[i] = v.get(i);
    return out;
  }
%}

%typemap(javacode) std::vector<long long> %{
  public static LongVector of(long... values) {
    LongVector v = new LongVector();
    for (long x : values) v.add(x);
    return v;
  }
%}

%typemap(javacode) dpswig::ReplicaSet %{
  /** Scatters {@code input} along {@code dim}, runs {@code fn} on every replica, gathers on {@code outputDevice}. */
  public Tensor apply(Tensor input, int dim, Device outputDevice, ForwardFunction fn) {
    ForwardFunction.clear(fn);
    try {
      return applyRaw(input, dim, outputDevice, fn);
    } catch (DParallelException e) {
      throw ForwardFunction.surface(fn, e);
    }
  }
%}

%typemap(javacode) dpswig::Ddp %{
  // The hook stays reachable while this Ddp lives.
  private CommHookBase hookRef;

  /** DDP with a custom comm hook, implemented in Java. */
  public Ddp(Module module, ProcessGroup pg, DdpOptions options, CommHook hook) {
    this(adopt(withHookRaw(module, pg, options, hook)), true);
    hookRef = hook;
  }

  private static long adopt(Ddp ddp) {
    ddp.swigCMemOwn = false;
    return ddp.swigCPtr;
  }

  /** Waits for every bucket; the module's gradients then hold the average over the ranks. An exception
   * the comm hook threw is rethrown here. */
  public void finishBackward() {
    if (hookRef instanceof CommHook) ((CommHook) hookRef).clearPending();
    try {
      finishBackwardRaw();
    } catch (DParallelException e) {
      if (hookRef instanceof CommHook) throw ((CommHook) hookRef).surface(e);
      throw e;
    }
  }
%}

%pragma(java) modulecode=%{
  /** {@code fn} over {@code devices}: scatter along {@code dim}, replicate, apply in parallel, reduce the
   * replicas' gradients into {@code module}, gather on {@code outputDevice}. */
  public static Tensor dataParallel(Module module, Tensor input, DeviceList devices, Device outputDevice, int dim,
                                    ForwardFunction fn) {
    ForwardFunction.clear(fn);
    try {
      return dataParallelRaw(module, input, devices, outputDevice, dim, fn);
    } catch (DParallelException e) {
      throw ForwardFunction.surface(fn, e);
    }
  }

  /** out[i] = fn(replicas[i], inputs[i]) in parallel; {@code devices} empty: each input's device. */
  public static TensorList parallelApply(ModuleVector replicas, TensorVector inputs, DeviceList devices,
                                         ForwardFunction fn) {
    ForwardFunction.clear(fn);
    try {
      return parallelApplyRaw(replicas, inputs, devices, fn);
    } catch (DParallelException e) {
      throw ForwardFunction.surface(fn, e);
    }
  }
%}
