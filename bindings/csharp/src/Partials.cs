using System;

namespace DParallel {

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

public partial class Ddp {
  // The hook stays reachable while this Ddp lives.
  CommHook hookRef;

  /// <summary>DDP with a custom comm hook, implemented in C#.</summary>
  public Ddp(Module module, ProcessGroup pg, DdpOptions options, CommHook hook)
      : this(Adopt(withHookRaw(module, pg, options, hook)), true) {
    hookRef = hook;
  }

  static IntPtr Adopt(Ddp ddp) {
    ddp.swigCMemOwn = false;
    return getCPtr(ddp).Handle;
  }

  /// <summary>Waits for every bucket; the module's gradients then hold the
  /// average over the ranks. An exception the comm hook threw is rethrown
  /// here.</summary>
  public void FinishBackward() {
    hookRef?.Clear();
    try {
      finishBackwardRaw();
    } catch (DParallelException) {
      hookRef?.Surface();
      throw;
    }
  }
}

}
