using System;
using System.Reflection;
using System.Runtime.ExceptionServices;
using System.Threading;

namespace DParallel {

/// <summary>The host's forward for <see cref="Parallel.DataParallel"/>,
/// <see cref="Parallel.ParallelApply"/> and <see cref="ReplicaSet.Apply"/>.
/// <see cref="Forward"/> runs on the library's worker thread of
/// <c>device</c>, one replica per thread at once; <c>replica</c> and
/// <c>input</c> are valid only during the call. Whatever it throws is kept
/// and rethrown, as is, by the call that ran it, on the caller's thread
/// (an exception must not unwind through the library's threads).</summary>
public abstract class ForwardFunction : ForwardFunctionBase {
  Exception pending;

  /// <summary>Returns the output: a new tensor (the library takes it over)
  /// or <c>input</c>.</summary>
  public abstract Tensor Forward(ulong index, Module replica, Tensor input, Device device);

  public sealed override Tensor Invoke(ulong index, Module replica, Tensor input, Device device) {
    try {
      Tensor output = Forward(index, replica, input, device);
      if (output == null) throw new NullReferenceException("ForwardFunction.Forward returned null for replica " + index);
      // The library takes the returned tensor over: it must not be disposed.
      if (output.IsClosed()) {
        throw new InvalidOperationException("ForwardFunction.Forward returned a disposed tensor for replica " + index);
      }
      return output;
    } catch (Exception e) {
      Interlocked.CompareExchange(ref pending, e, null);
      return null;
    }
  }

  internal static void Clear(ForwardFunction fn) {
    if (fn != null) Interlocked.Exchange(ref fn.pending, null);
  }

  /// <summary>Rethrows the forward's own exception, if it threw.</summary>
  internal static void Surface(ForwardFunction fn) {
    Exception e = fn == null ? null : Interlocked.Exchange(ref fn.pending, null);
    if (e != null) ExceptionDispatchInfo.Capture(e).Throw();
  }
}

static class HookThread {
  // Mono attaches a library thread on its first callback, as a background
  // thread, and after ProcessExit aborts its background threads and waits
  // for them to end. The device workers a ForwardFunction runs on end in
  // ProcessExit (dp_shutdown, see ProcessExit.cs), but a comm hook runs on a
  // thread of its Ddp, which ends only when the Ddp is disposed: a program
  // returning from Main with one open would wait forever. Mono's "don't
  // manage" flag (what it sets on its own service threads) leaves the hook's
  // thread out of that wait; no public API does. Elsewhere (no such field)
  // this does nothing.
  const long DontManage = 1;
  static readonly FieldInfo internalThread =
      typeof(Thread).GetField("internal_thread", BindingFlags.NonPublic | BindingFlags.Instance);
  static readonly FieldInfo flags = internalThread?.FieldType.GetField("flags", BindingFlags.NonPublic | BindingFlags.Instance);
  [ThreadStatic] static bool marked;

  internal static void LeaveOutOfExitWait() {
    if (marked) return;
    marked = true;
    Thread t = Thread.CurrentThread;
    if (!t.IsBackground) t.IsBackground = true;
    if (flags == null || flags.FieldType != typeof(IntPtr)) return;
    object it = internalThread.GetValue(t);
    if (it == null) return;
    long value = ((IntPtr)flags.GetValue(it)).ToInt64();
    flags.SetValue(it, new IntPtr(value | DontManage));
  }
}

/// <summary>The DDP custom comm hook: <see cref="Reduce"/> leaves in
/// <c>bucket</c> what the gradients should hold, typically by collectives on
/// <c>pg</c>. It runs on the library's worker thread; <c>pg</c> and
/// <c>bucket</c> are valid only during the call. Whatever it throws is
/// rethrown, as is, by <see cref="Ddp.FinishBackward"/>.</summary>
public abstract class CommHook : CommHookBase {
  Exception pending;

  public abstract void Reduce(ProcessGroup pg, ulong bucketIndex, Tensor bucket);

  public sealed override bool Invoke(ProcessGroup pg, ulong bucketIndex, Tensor bucket) {
    HookThread.LeaveOutOfExitWait();
    try {
      Reduce(pg, bucketIndex, bucket);
      return true;
    } catch (Exception e) {
      Interlocked.CompareExchange(ref pending, e, null);
      return false;
    }
  }

  internal void Clear() {
    Interlocked.Exchange(ref pending, null);
  }

  internal void Surface() {
    Exception e = Interlocked.Exchange(ref pending, null);
    if (e != null) ExceptionDispatchInfo.Capture(e).Throw();
  }
}

}
