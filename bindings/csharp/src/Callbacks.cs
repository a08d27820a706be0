using System;
using System.Runtime.ExceptionServices;
using System.Threading;

namespace DParallel {

/// The first exception a callback threw on a library thread, kept until
/// the caller's thread rethrows it.
sealed class PendingException {
  Exception first;

  internal void Keep(Exception e) {
    Interlocked.CompareExchange(ref first, e, null);
  }

  internal void Clear() {
    Interlocked.Exchange(ref first, null);
  }

  /// Rethrows the kept exception, with its stack trace, if there is one.
  internal void Rethrow() {
    Exception e = Interlocked.Exchange(ref first, null);
    if (e != null) ExceptionDispatchInfo.Capture(e).Throw();
  }
}

/// <summary>The host's forward for <see cref="Parallel.DataParallel"/>,
/// <see cref="Parallel.ParallelApply"/> and <see cref="ReplicaSet.Apply"/>.
/// <see cref="Forward"/> runs on the library's worker thread of
/// <c>device</c>, one replica per thread at once; <c>replica</c> and
/// <c>input</c> are valid only during the call. Whatever it throws is kept
/// and rethrown, as is, by the call that ran it, on the caller's thread
/// (an exception must not unwind through the library's threads).</summary>
public abstract class ForwardFunction : ForwardFunctionBase {
  readonly PendingException pending = new PendingException();

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
      pending.Keep(e);
      return null;
    }
  }

  internal static void Clear(ForwardFunction fn) {
    fn?.pending.Clear();
  }

  /// <summary>Rethrows the forward's own exception, if it threw.</summary>
  internal static void Surface(ForwardFunction fn) {
    fn?.pending.Rethrow();
  }
}

static class HookThread {
  // Mono attaches a library thread on its first callback, and at exit,
  // after ProcessExit, waits for the background threads it attached. The
  // device workers and idle comm lanes end in ProcessExit (dp_shutdown, see
  // ProcessExit.cs); a thread of a busy lane or of a stream ends with its
  // handle. Marked background, so that it never holds up the exit itself.
  [ThreadStatic] static bool marked;

  internal static void MarkBackground() {
    if (marked) return;
    marked = true;
    Thread t = Thread.CurrentThread;
    if (!t.IsBackground) t.IsBackground = true;
  }
}

/// <summary>The DDP custom comm hook: <see cref="Reduce"/> leaves in
/// <c>bucket</c> what the gradients should hold, typically by collectives on
/// <c>pg</c>. It runs on the library's worker thread; <c>pg</c> and
/// <c>bucket</c> are valid only during the call. Whatever it throws is
/// rethrown, as is, by <see cref="Ddp.FinishBackward"/>.</summary>
public abstract class CommHook : CommHookBase {
  readonly PendingException pending = new PendingException();

  public abstract void Reduce(ProcessGroup pg, ulong bucketIndex, Tensor bucket);

  public sealed override bool Invoke(ProcessGroup pg, ulong bucketIndex, Tensor bucket) {
    HookThread.MarkBackground();
    try {
      Reduce(pg, bucketIndex, bucket);
      return true;
    } catch (Exception e) {
      pending.Keep(e);
      return false;
    }
  }

  internal void Clear() {
    pending.Clear();
  }

  internal void Surface() {
    pending.Rethrow();
  }
}

}
