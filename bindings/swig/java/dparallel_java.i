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

#include "dpswig_stream.hpp"
#include "dpswig_tensor.hpp"

namespace dpswig {
/* The JNIEnv of this thread, attached as a daemon when it is a library
 * thread the JVM has not seen; detached again by the destructor then, so
 * that the thread never ends attached. */
class JavaThreadEnv {
 public:
  explicit JavaThreadEnv(JavaVM *vm) : vm_(vm), env_(nullptr), attached_(false) {
    jint got = vm_->GetEnv((void **)&env_, JNI_VERSION_1_6);
    if (got == JNI_EDETACHED) {
      attached_ = vm_->AttachCurrentThreadAsDaemon((void **)&env_, nullptr) == JNI_OK;
      if (!attached_) env_ = nullptr;
    } else if (got != JNI_OK) {
      env_ = nullptr; /* the JVM is going away */
    }
  }
  ~JavaThreadEnv() {
    if (attached_) vm_->DetachCurrentThread();
  }
  JNIEnv *env() const { return env_; }

 private:
  JavaVM *vm_;
  JNIEnv *env_;
  bool attached_;
};

/* A Runnable queued on a stream (DeviceStream.launchHostFunc, which wraps
 * the host's so that it never throws). */
class JavaHostCall : public HostCall {
 public:
  JavaHostCall(JNIEnv *env, jobject runnable) : vm_(nullptr), ref_(nullptr), run_(nullptr) {
    jclass cls = env->GetObjectClass(runnable);
    run_ = env->GetMethodID(cls, "run", "()V");
    env->DeleteLocalRef(cls);
    if (run_ != nullptr && env->GetJavaVM(&vm_) == JNI_OK) ref_ = env->NewGlobalRef(runnable);
  }
  ~JavaHostCall() override {
    if (ref_ == nullptr) return;
    JavaThreadEnv thread(vm_);
    if (thread.env() != nullptr) thread.env()->DeleteGlobalRef(ref_);
  }
  void run() override {
    JavaThreadEnv thread(vm_);
    JNIEnv *env = thread.env();
    if (env == nullptr) return;
    env->CallVoidMethod(ref_, run_);
    if (env->ExceptionCheck()) env->ExceptionClear();
  }
  bool ok() const { return ref_ != nullptr; }

 private:
  JavaVM *vm_;
  jobject ref_;
  jmethodID run_;
};

/* A direct ByteBuffer that tensors are made over: a global reference keeps
 * it (and so its memory) alive until the last tensor over it is destroyed,
 * on whatever thread that is. */
class JavaBufferRef : public HostMemory {
 public:
  JavaBufferRef(JNIEnv *env, jobject buffer) : vm_(nullptr), ref_(nullptr) {
    if (env->GetJavaVM(&vm_) == JNI_OK) ref_ = env->NewGlobalRef(buffer);
  }
  ~JavaBufferRef() override {
    if (ref_ == nullptr) return;
    JavaThreadEnv thread(vm_);
    if (thread.env() != nullptr) thread.env()->DeleteGlobalRef(ref_);
  }
  bool ok() const { return ref_ != nullptr; }

 private:
  JavaVM *vm_;
  jobject ref_;
};

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

// A handle argument is checked before its pointer leaves Java: a closed one
// is Status.STATE and a missing reference Status.INVALID, each naming the
// argument (a closed one would otherwise pass as null, an empty slot).
%typemap(javain) SWIGTYPE & "Args.present($javaclassname.getCPtr($javainput), $javainput, \"$javainput\")"
%typemap(javain) SWIGTYPE * "Args.nullable($javaclassname.getCPtr($javainput), $javainput, \"$javainput\")"

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

// Native addresses (DLPack tensors, CUDA streams) as long.
%typemap(jni) dpswig::NativePointer "jlong"
%typemap(jtype) dpswig::NativePointer "long"
%typemap(jstype) dpswig::NativePointer "long"
%typemap(in) dpswig::NativePointer %{ $1 = (void *)(intptr_t)$input; %}
%typemap(out) dpswig::NativePointer %{ $result = (jlong)(intptr_t)$1; %}
%typemap(javain) dpswig::NativePointer "$javainput"
%typemap(javaout) dpswig::NativePointer {
    return $jnicall;
  }

// A direct ByteBuffer that a tensor is made over (Tensor.fromBuffer); the
// tensor keeps it alive.
%typemap(jni) dpswig::HostBuffer & "jobject"
%typemap(jtype) dpswig::HostBuffer & "java.nio.ByteBuffer"
%typemap(jstype) dpswig::HostBuffer & "java.nio.ByteBuffer"
%typemap(javain) dpswig::HostBuffer & "$javainput"
%typemap(in) dpswig::HostBuffer & (dpswig::HostBuffer held) {
  void *data = $input != nullptr ? jenv->GetDirectBufferAddress($input) : nullptr;
  jlong capacity = $input != nullptr ? jenv->GetDirectBufferCapacity($input) : -1;
  if (data == nullptr && capacity != 0) {
    dpswig_java_throw(jenv, DP_EINVAL, "invalid argument: 'buffer' is not a direct ByteBuffer");
    return $null;
  }
  dpswig::JavaBufferRef *ref = new dpswig::JavaBufferRef(jenv, $input);
  held.keep.reset(ref);
  if (!ref->ok()) {
    dpswig_java_throw(jenv, DP_ENOMEM, "out of memory: no global reference for 'buffer'");
    return $null;
  }
  held.data = data;
  held.size = (size_t)capacity;
  $1 = &held;
}
// A Runnable queued on a stream.
%typemap(jni) dpswig::HostCallArg & "jobject"
%typemap(jtype) dpswig::HostCallArg & "Runnable"
%typemap(jstype) dpswig::HostCallArg & "Runnable"
%typemap(javain) dpswig::HostCallArg & "$javainput"
%typemap(in) dpswig::HostCallArg & (dpswig::HostCallArg held) {
  if ($input == nullptr) {
    dpswig_java_throw(jenv, DP_EINVAL, "invalid argument: 'fn' is null");
    return $null;
  }
  dpswig::JavaHostCall *call = new dpswig::JavaHostCall(jenv, $input);
  held.call.reset(call);
  if (!call->ok()) {
    dpswig_java_throw(jenv, DP_ENOMEM, "out of memory: no global reference for 'fn'");
    return $null;
  }
  $1 = &held;
}
%javamethodmodifiers dpswig::Stream::launchHostFunc "private";
%javamethodmodifiers dpswig::Stream::synchronize "private";
%typemap(javacode) dpswig::Stream %{
  // The first exception a host function threw, for synchronize().
  private final java.util.concurrent.atomic.AtomicReference<Throwable> hostPending =
      new java.util.concurrent.atomic.AtomicReference<>();

  /** Queues {@code fn} after the work queued so far: it runs once, on a host thread (on a cpu device's legacy
   * default stream, before this returns); work queued after it waits for it. What it throws is rethrown by the
   * next {@link #synchronize()}. */
  public void launchHostFunc(Runnable fn) {
    if (fn == null) throw new DParallelException(Status.INVALID, "invalid argument: 'fn' is null");
    launchHostFuncRaw(() -> {
      try {
        fn.run();
      } catch (Throwable t) {
        hostPending.compareAndSet(null, t);
      }
    });
  }

  /** Returns once the work queued so far is done; rethrows what a host function queued here threw. */
  public void synchronize() {
    synchronizeRaw();
    Throwable t = hostPending.getAndSet(null);
    if (t != null) throw Sneaky.<RuntimeException>rethrow(t);
  }
%}
%javamethodmodifiers dpswig::Tensor::fromHost "";
%javamethodmodifiers dpswig::Tensor::fromPointer "";

// The tensor's memory as a direct ByteBuffer in native byte order. JNI's
// buffer holds nothing alive: Tensor.buffer() takes it from a reference of
// its own (viewReference) that a Cleaner drops when the buffer goes.
%typemap(jni) dpswig::HostBytes "jobject"
%typemap(jtype) dpswig::HostBytes "java.nio.ByteBuffer"
%typemap(jstype) dpswig::HostBytes "java.nio.ByteBuffer"
%typemap(out) dpswig::HostBytes {
  static char empty;
  if ($1.size > (size_t)INT32_MAX) {  // the JDK would wrap the capacity
    std::string why = "unsupported: a ByteBuffer holds at most 2147483647 bytes; this tensor has " + std::to_string($1.size) +
                      " (copy it out in parts, or use toDlpack)";
    dpswig_java_throw(jenv, DP_EUNSUPPORTED, why.c_str());
    return $null;
  }
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
%javamethodmodifiers dpswig::Ddp::create "";
%javamethodmodifiers dpswig::Ddp::join "";
%javamethodmodifiers dpswig::DdpOptions::setOnBucketReduced "";
%javamethodmodifiers dpswig::BucketReduced::invoke "protected";
%javamethodmodifiers dpswig::BucketReduced::BucketReduced "";
%typemap(javaclassmodifiers) dpswig::BucketReduced "public abstract class";

// Every handle: close() releases the native handle once the calls in
// flight on it have returned (each call holds a lease on it, so a close on
// one thread never frees what a call on another uses), and a call after it
// throws DParallelException (Status.STATE). The native object itself, a
// few bytes, stays until the proxy is collected: no call can be on its way
// into it then. delete() is for the finalizer alone.
%define DP_JAVA_CLOSEABLE(CLASS)
%typemap(javainterfaces) CLASS "AutoCloseable"
%javamethodmodifiers CLASS::close "private";
%javamethodmodifiers CLASS::isClosed "private";
%typemap(javadestruct, methodname="delete", methodmodifiers="protected synchronized", parameters="") CLASS {
    if (swigCPtr != 0) {
      if (swigCMemOwn) {
        swigCMemOwn = false;
        $jnicall;
      }
      swigCPtr = 0;
    }
  }
%extend CLASS {
%proxycode %{
  /** Releases the native handle, once the calls in flight on it (from other threads) have returned; a second
   * call does nothing. Inside a callback, while a call on this object is in flight (maybe the one running the
   * callback), it throws DParallelException (Status.STATE) instead of waiting. */
  @Override
  public void close() {
    if (swigCPtr != 0) closeRaw();
  }

  /** Whether this object is closed: its other calls then throw DParallelException (Status.STATE). */
  public boolean isClosed() {
    return swigCPtr == 0 || isClosedRaw();
  }
%}
}
%enddef
DP_JAVA_CLOSEABLE(dpswig::Tensor)
DP_JAVA_CLOSEABLE(dpswig::TensorList)
DP_JAVA_CLOSEABLE(dpswig::Module)
DP_JAVA_CLOSEABLE(dpswig::ModuleList)
DP_JAVA_CLOSEABLE(dpswig::ReplicaSet)
DP_JAVA_CLOSEABLE(dpswig::Store)
DP_JAVA_CLOSEABLE(dpswig::ProcessGroup)
DP_JAVA_CLOSEABLE(dpswig::DeviceMesh)
DP_JAVA_CLOSEABLE(dpswig::Work)
DP_JAVA_CLOSEABLE(dpswig::Ddp)
DP_JAVA_CLOSEABLE(dpswig::Stream)
DP_JAVA_CLOSEABLE(dpswig::Fsdp)
// Closing an Fsdp is collective: from the finalizer it would run at another
// moment on each rank, so one collected unclosed stays open, and says so.
%typemap(javafinalize) dpswig::Fsdp %{
  @SuppressWarnings("deprecation")
  protected void finalize() {
    if (swigCPtr == 0) return;
    if (isClosedRaw()) {
      delete();
    } else {
      System.err.println("dparallel: an Fsdp was collected without close(); it stays open (closing is collective)");
    }
  }
%}

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

  /** A tensor over {@code buffer}'s first bytes (from its start, whatever its position), without a copy: the
   * library reads and writes the buffer in place. {@code buffer} is direct and writable, in native byte order
   * for multi-byte dtypes; the tensor, and every tensor or module slot sharing its memory, keeps it alive. */
  public static Tensor fromBuffer(java.nio.ByteBuffer buffer, int dtype, long... shape) {
    return fromBuffer(buffer, dtype, new Device(), shape);
  }

  /** As {@link #fromBuffer(java.nio.ByteBuffer, int, long...)}, on the cpu device {@code device}. */
  public static Tensor fromBuffer(java.nio.ByteBuffer buffer, int dtype, Device device, long... shape) {
    if (buffer == null) throw new DParallelException(Status.INVALID, "invalid argument: 'buffer' is null");
    if (!buffer.isDirect()) {
      throw new DParallelException(Status.INVALID, "invalid argument: 'buffer' is not direct (ByteBuffer.allocateDirect)");
    }
    if (buffer.isReadOnly()) throw new DParallelException(Status.INVALID, "invalid argument: 'buffer' is read-only");
    if (DType.elementSize(dtype) > 1 && buffer.order() != java.nio.ByteOrder.nativeOrder()) {
      throw new DParallelException(Status.INVALID, "invalid argument: 'buffer' is " + buffer.order()
          + " but the tensor reads it in the native order: set buffer.order(ByteOrder.nativeOrder()) before writing it");
    }
    if (device == null) throw new DParallelException(Status.INVALID, "invalid argument: 'device' is null");
    if (!device.isCpu()) {
      throw new DParallelException(Status.INVALID, "invalid argument: 'device' must be a cpu device for a ByteBuffer, not " + device);
    }
    return fromHost(buffer, LongVector.of(shape), dtype, device);
  }

  /** A tensor over {@code nbytes} bytes at {@code address} (host memory for a cpu device, device memory for cuda),
   * without a copy; the caller keeps that memory alive while any tensor over it lives. */
  public static Tensor fromAddress(long address, long nbytes, int dtype, Device device, long... shape) {
    if (nbytes < 0) throw new DParallelException(Status.INVALID, "invalid argument: 'nbytes' is negative");
    return fromPointer(address, nbytes, LongVector.of(shape), dtype, device);
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

%typemap(javacode) std::vector<int> %{
  public static IntVector of(int... values) {
    IntVector v = new IntVector();
    for (int x : values) v.add(x);
    return v;
  }

  public int[] toIntArray() {
    int[] out = new int[size()];
    for (int i = 0; i < out.length; ++i) out[i] = get(i);
    return out;
  }
%}

%typemap(javacode) dpswig::DeviceMesh %{
  /** The group's ranks row-major over {@code shape}, the dimensions named {@code names} (none: "dim0", "dim1",
   * ...). Collective over {@code pg}. */
  public static DeviceMesh create(ProcessGroup pg, int[] shape, String... names) {
    StringVector list = new StringVector();
    for (String name : names) list.add(name);
    return create(pg, IntVector.of(shape), list);
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

%typemap(javacode) dpswig::DdpOptions %{
  // The callback stays reachable while these options and every Ddp made with them live.
  BucketReduced onBucketReducedRef;

  /** The optimizer inside backward (null: none): it runs as each bucket's averaged gradients are final. */
  public void setOnBucketReduced(BucketReduced callback) {
    setOnBucketReducedRaw(callback);
    onBucketReducedRef = callback;
  }

  public BucketReduced getOnBucketReduced() {
    return onBucketReducedRef;
  }
%}

%typemap(javacode) dpswig::Ddp %{
  // The hook and the options' callback stay reachable while this Ddp lives.
  private CommHook hookRef;
  private BucketReduced reducedRef;

  /** Wraps {@code module} for data-parallel training over {@code pg}; every rank calls it with equal options. */
  public Ddp(Module module, ProcessGroup pg, DdpOptions options) {
    this(adopt(createRaw(module, pg, options)), true);
    reducedRef = options.onBucketReducedRef;
  }

  /** DDP with a custom comm hook, implemented in Java. */
  public Ddp(Module module, ProcessGroup pg, DdpOptions options, CommHook hook) {
    this(adopt(withHookRaw(module, pg, options, hook)), true);
    hookRef = hook;
    reducedRef = options.onBucketReducedRef;
  }

  private static long adopt(Ddp ddp) {
    ddp.swigCMemOwn = false;
    return ddp.swigCPtr;
  }

  private void clearPending() {
    if (hookRef != null) hookRef.clearPending();
    if (reducedRef != null) reducedRef.clearPending();
  }

  /** The exception to throw for {@code e}: the hook's or the callback's own, when one threw. */
  private RuntimeException surface(DParallelException e) {
    RuntimeException out = hookRef != null ? hookRef.surface(e) : e;
    return out == e && reducedRef != null ? reducedRef.surface(e) : out;
  }

  /** Waits for every bucket; the module's gradients then hold the average over the ranks. An exception
   * the comm hook or the onBucketReduced callback threw is rethrown here. */
  public void finishBackward() {
    clearPending();
    try {
      finishBackwardRaw();
    } catch (DParallelException e) {
      throw surface(e);
    }
  }

  /** This rank has no more data: it stands in for the other ranks' iterations until every rank has joined;
   * then every rank holds the parameters and buffers of the rank that ran the most synced iterations. Every
   * rank passes the same Ddp, in the same order, after its last finishBackward. */
  public static void join(Ddp... ddps) {
    if (ddps == null) throw new DParallelException(Status.INVALID, "invalid argument: 'ddps' is null");
    DdpVector v = new DdpVector();
    for (Ddp d : ddps) {
      v.add(d);
      if (d != null) d.clearPending();
    }
    try {
      joinRaw(v);
    } catch (DParallelException e) {
      for (Ddp d : ddps) {
        RuntimeException own = d != null ? d.surface(e) : e;
        if (own != e) throw own;
      }
      throw e;
    }
  }

  /** The current bucket plan's managed-parameter indices, per bucket. */
  public long[] bucketParameterArray(long bucket) {
    SizeVector v = bucketParameters(bucket);
    long[] out = new long[v.size()];
    for (int i = 0; i < out.length; ++i) out[i] = v.get(i);
    return out;
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
