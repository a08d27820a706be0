using System;
using System.Threading;

namespace DParallel {

public partial class DeviceMesh {
  /// <summary>The group's ranks row-major over <c>shape</c>, the dimensions
  /// named <c>names</c> (none: "dim0", "dim1", ...). Collective over
  /// <c>pg</c>.</summary>
  public static DeviceMesh Create(ProcessGroup pg, int[] shape, params string[] names) {
    return Create(pg, new IntVector(shape), new StringVector(names));
  }
}

public partial class Tensor {
  /// <summary>A float32 tensor of the given shape (zeros) on cpu:0.</summary>
  public Tensor(params long[] shape) : this(new LongVector(shape)) {}

  /// <summary>A float32 tensor of the given shape (zeros) on <c>device</c>.</summary>
  public Tensor(Device device, params long[] shape) : this(new LongVector(shape), device) {}

  /// <summary>A float32 cpu tensor holding a copy of <c>values</c>.</summary>
  public static Tensor Of(float[] values, params long[] shape) {
    var t = new Tensor(shape);
    try {
      t.CopyFrom(values);
    } catch {
      t.Dispose();
      throw;
    }
    return t;
  }

  /// <summary>Copies exactly Numel() values in (one copy from the pinned array).</summary>
  public void CopyFrom(float[] values) {
    if (values == null) throw new DParallelException(Status.INVALID, "invalid argument: 'values' is null");
    CopyFromRaw(values, (ulong)values.Length);
  }

  /// <summary>Copies exactly Numel() values out (one copy into the pinned array).</summary>
  public void CopyTo(float[] values) {
    if (values == null) throw new DParallelException(Status.INVALID, "invalid argument: 'values' is null");
    CopyToRaw(values, (ulong)values.Length);
  }

  /// <summary>A new array with the tensor's values.</summary>
  public float[] ToArray() {
    var output = new float[checked((int)Numel())];
    CopyTo(output);
    return output;
  }

  /// <summary>The tensor's memory as floats, without a copy (cpu float32
  /// tensors). A Span roots nothing: it is valid only while this tensor is
  /// referenced and not disposed (inside its <c>using</c>, or before a
  /// <c>GC.KeepAlive(tensor)</c> after the Span's last use). For a view
  /// that may outlive the tensor, use <see cref="AsMemory"/>.</summary>
  public unsafe Span<float> AsSpan() {
    if (Dtype() != DType.FLOAT32) throw new DParallelException(Status.INVALID, "invalid argument: AsSpan() needs a float32 tensor");
    return new Span<float>((void*)Data(), checked((int)Numel()));
  }

  /// <summary>The tensor's memory as floats, without a copy (cpu float32
  /// tensors), owning a reference to it: valid after this tensor is
  /// disposed or collected, while the Memory (or one sliced from it) is
  /// referenced. Its <c>.Span</c> is valid while the Memory is.</summary>
  public Memory<float> AsMemory() {
    if (Dtype() != DType.FLOAT32) throw new DParallelException(Status.INVALID, "invalid argument: AsMemory() needs a float32 tensor");
    return new TensorMemory(ViewReference()).Memory;
  }

  /// <summary>A cpu tensor over <c>array</c>'s own memory, without a copy:
  /// the library reads and writes the array in place. The array stays
  /// pinned (and alive) while any tensor or module slot over it lives; after
  /// that the next FromArray or FreeUnpinned() unpins it (a later garbage
  /// collection usually does too).
  /// The shape's elements must fit in the array.</summary>
  public static Tensor FromArray<T>(T[] array, params long[] shape) where T : struct {
    return FromArray(array, new Device(), shape);
  }

  /// <summary>As <see cref="FromArray{T}(T[], long[])"/>, on the cpu device
  /// <c>device</c>.</summary>
  public static Tensor FromArray<T>(T[] array, Device device, params long[] shape) where T : struct {
    if (array == null) throw new DParallelException(Status.INVALID, "invalid argument: 'array' is null");
    if (device == null) throw new DParallelException(Status.INVALID, "invalid argument: 'device' is null");
    if (!device.IsCpu()) {
      throw new DParallelException(Status.INVALID, "invalid argument: 'device' must be a cpu device for an array, not " + device);
    }
    int dtype = DTypeOf(typeof(T));
    FreeUnpinned();
    Unpinner.Start();
    var pin = System.Runtime.InteropServices.GCHandle.Alloc(array, System.Runtime.InteropServices.GCHandleType.Pinned);
    try {
      ulong bytes = (ulong)array.LongLength * DType.ElementSize(dtype);
      return FromPinnedRaw(pin.AddrOfPinnedObject(), bytes, new LongVector(shape), dtype, device,
                           System.Runtime.InteropServices.GCHandle.ToIntPtr(pin));
    } catch {
      pin.Free();
      throw;
    }
  }

  /// <summary>A tensor over <c>nbytes</c> bytes at <c>data</c> (host memory
  /// for a cpu device, device memory for cuda), without a copy; the caller
  /// keeps that memory alive while any tensor over it lives.</summary>
  public static Tensor FromPointer(IntPtr data, ulong nbytes, int dtype, Device device, params long[] shape) {
    return FromPointer(data, nbytes, new LongVector(shape), dtype, device);
  }

  static int DTypeOf(Type t) {
    if (t == typeof(float)) return DType.FLOAT32;
    if (t == typeof(double)) return DType.FLOAT64;
    if (t == typeof(sbyte)) return DType.INT8;
    if (t == typeof(byte)) return DType.UINT8;
    if (t == typeof(int)) return DType.INT32;
    if (t == typeof(long)) return DType.INT64;
    throw new DParallelException(Status.INVALID,
                                 "invalid argument: 'array' has elements of " + t.Name + "; FromArray takes float, double, sbyte, byte, int or long");
  }

  /// <summary>Unpins the arrays of FromArray that no tensor uses any
  /// more (also done by FromArray and on garbage collection).</summary>
  public static void FreeUnpinned() {
    for (IntPtr h = TakeUnpinnedRaw(); h != IntPtr.Zero; h = TakeUnpinnedRaw()) {
      System.Runtime.InteropServices.GCHandle.FromIntPtr(h).Free();
    }
  }

  // Frees the released pins on the finalizer thread after each collection:
  // it finalizes, then makes a new instance for the next collection.
  sealed class Unpinner {
    static int started;

    internal static void Start() {
      if (Interlocked.Exchange(ref started, 1) == 0) new Unpinner();
    }

    ~Unpinner() {
      if (Environment.HasShutdownStarted) return;
      FreeUnpinned();
      new Unpinner();
    }
  }

  public long[] ShapeArray() {
    LongVector v = Shape();
    var output = new long[v.Count];
    v.CopyTo(output);
    return output;
  }
}

// The memory behind Tensor.AsMemory(): it holds its own Tensor reference to
// the storage, which that Tensor's finalizer drops once no Memory refers to
// this manager. Dispose does nothing: the manager is never handed out, and
// releasing early would leave those Memory values dangling.
sealed unsafe class TensorMemory : System.Buffers.MemoryManager<float> {
  readonly Tensor storage;
  readonly IntPtr data;
  readonly int length;

  internal TensorMemory(Tensor storage) {
    this.storage = storage;
    data = this.storage.Data();
    length = checked((int)this.storage.Numel());
  }

  public override Span<float> GetSpan() {
    return new Span<float>((void*)data, length);
  }

  // Native memory never moves; the handle keeps this manager, and so the
  // storage, reachable until it is disposed.
  public override System.Buffers.MemoryHandle Pin(int elementIndex = 0) {
    if (elementIndex < 0 || elementIndex > length) throw new ArgumentOutOfRangeException(nameof(elementIndex));
    return new System.Buffers.MemoryHandle((float*)data + elementIndex, default(System.Runtime.InteropServices.GCHandle), this);
  }

  public override void Unpin() {}

  protected override void Dispose(bool disposing) {}
}

public partial class DeviceStream {
  // The first exception a host function threw, for Synchronize().
  Exception hostPending;

  // What LaunchHostFunc queues: the host's work and the stream to report to.
  sealed class HostWork {
    internal Action Fn;
    internal DeviceStream Stream;
  }

  /// <summary>Queues <c>fn</c> after the work queued so far: it runs once,
  /// on a host thread (on a cpu device's legacy default stream, before this
  /// returns); work queued after it waits for it. What it throws is
  /// rethrown by the next <see cref="Synchronize"/>.</summary>
  public void LaunchHostFunc(Action fn) {
    if (fn == null) throw new DParallelException(Status.INVALID, "invalid argument: 'fn' is null");
    var handle = System.Runtime.InteropServices.GCHandle.Alloc(new HostWork { Fn = fn, Stream = this });
    try {
      LaunchHostFuncRaw(System.Runtime.InteropServices.GCHandle.ToIntPtr(handle));
    } catch {
      handle.Free();
      throw;
    }
  }

  /// <summary>Returns once the work queued so far is done; rethrows what a
  /// host function queued here threw.</summary>
  public void Synchronize() {
    SynchronizeRaw();
    Exception e = Interlocked.Exchange(ref hostPending, null);
    if (e != null) System.Runtime.ExceptionServices.ExceptionDispatchInfo.Capture(e).Throw();
  }

  internal static void RunHost(IntPtr handle, int libraryThread) {
    if (libraryThread != 0) HookThread.MarkBackground();
    var h = System.Runtime.InteropServices.GCHandle.FromIntPtr(handle);
    var work = (HostWork)h.Target;
    h.Free();
    try {
      work.Fn();
    } catch (Exception e) {
      Interlocked.CompareExchange(ref work.Stream.hostPending, e, null);
    }
  }
}

public partial class Device {
  public override bool Equals(object other) {
    return other is Device d && Equals(d);
  }

  public override int GetHashCode() {
    return Type() * 65599 + Index();
  }
}

public partial class Parallel {
  /// <summary><c>fn</c> over <c>devices</c>: scatter along <c>dim</c>,
  /// replicate, apply in parallel, reduce the replicas' gradients into
  /// <c>module</c>, gather on <c>outputDevice</c>.</summary>
  public static Tensor DataParallel(Module module, Tensor input, DeviceList devices, Device outputDevice, int dim,
                                    ForwardFunction fn) {
    ForwardFunction.Clear(fn);
    try {
      return dataParallelRaw(module, input, devices, outputDevice, dim, fn);
    } catch (DParallelException) {
      ForwardFunction.Surface(fn);
      throw;
    }
  }

  /// <summary>out[i] = fn(replicas[i], inputs[i]) in parallel; <c>devices</c>
  /// empty: each input's device.</summary>
  public static TensorList ParallelApply(ModuleVector replicas, TensorVector inputs, DeviceList devices,
                                         ForwardFunction fn) {
    ForwardFunction.Clear(fn);
    try {
      return parallelApplyRaw(replicas, inputs, devices, fn);
    } catch (DParallelException) {
      ForwardFunction.Surface(fn);
      throw;
    }
  }
}

public partial class ReplicaSet {
  /// <summary>Scatters <c>input</c> along <c>dim</c>, runs <c>fn</c> on every
  /// replica, gathers on <c>outputDevice</c>.</summary>
  public Tensor Apply(Tensor input, int dim, Device outputDevice, ForwardFunction fn) {
    ForwardFunction.Clear(fn);
    try {
      return applyRaw(input, dim, outputDevice, fn);
    } catch (DParallelException) {
      ForwardFunction.Surface(fn);
      throw;
    }
  }
}

public partial class DdpOptions {
  // The callback stays reachable while these options and every Ddp made
  // with them live.
  internal BucketReduced onBucketReducedRef;

  /// <summary>The optimizer inside backward (null: none): it runs as each
  /// bucket's averaged gradients are final.</summary>
  public void SetOnBucketReduced(BucketReduced callback) {
    setOnBucketReducedRaw(callback);
    onBucketReducedRef = callback;
  }

  public BucketReduced GetOnBucketReduced() {
    return onBucketReducedRef;
  }
}

public partial class Ddp {
  // The hook and the options' callback stay reachable while this Ddp lives.
  CommHook hookRef;
  BucketReduced reducedRef;

  /// <summary>Wraps <c>module</c> for data-parallel training over
  /// <c>pg</c>; every rank calls it with equal options.</summary>
  public Ddp(Module module, ProcessGroup pg, DdpOptions options) : this(Adopt(createRaw(module, pg, options)), true) {
    reducedRef = options.onBucketReducedRef;
  }

  /// <summary>DDP with a custom comm hook, implemented in C#.</summary>
  public Ddp(Module module, ProcessGroup pg, DdpOptions options, CommHook hook)
      : this(Adopt(withHookRaw(module, pg, options, hook)), true) {
    hookRef = hook;
    reducedRef = options.onBucketReducedRef;
  }

  static IntPtr Adopt(Ddp ddp) {
    ddp.swigCMemOwn = false;
    return getCPtr(ddp).Handle;
  }

  void ClearPending() {
    hookRef?.Clear();
    reducedRef?.Clear();
  }

  // Rethrows the hook's or the callback's own exception, when one threw.
  void SurfacePending() {
    hookRef?.Surface();
    reducedRef?.Surface();
  }

  /// <summary>Waits for every bucket; the module's gradients then hold the
  /// average over the ranks. An exception the comm hook or the
  /// onBucketReduced callback threw is rethrown here.</summary>
  public void FinishBackward() {
    ClearPending();
    try {
      finishBackwardRaw();
    } catch (DParallelException) {
      SurfacePending();
      throw;
    }
  }

  /// <summary>This rank has no more data: it stands in for the other
  /// ranks' iterations until every rank has joined; then every rank holds
  /// the parameters and buffers of the rank that ran the most synced
  /// iterations. Every rank passes the same Ddp, in the same order, after
  /// its last FinishBackward.</summary>
  public static void Join(params Ddp[] ddps) {
    if (ddps == null) throw new DParallelException(Status.INVALID, "invalid argument: 'ddps' is null");
    var v = new DdpVector();
    foreach (Ddp d in ddps) {
      v.Add(d);
      d?.ClearPending();
    }
    try {
      joinRaw(v);
    } catch (DParallelException) {
      foreach (Ddp d in ddps) d?.SurfacePending();
      throw;
    }
  }

  /// <summary>Bucket <c>bucket</c>'s managed-parameter indices.</summary>
  public ulong[] BucketParameterArray(ulong bucket) {
    SizeVector v = BucketParameters(bucket);
    var output = new ulong[v.Count];
    v.CopyTo(output);
    return output;
  }
}

}
