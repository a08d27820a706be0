using System;

namespace DParallel {

/// <summary>The optimizer inside backward
/// (<see cref="DdpOptions.SetOnBucketReduced"/>): <see cref="Reduced"/>
/// runs on the library's worker thread as soon as bucket
/// <c>bucketIndex</c>'s averaged gradients are final in the module's
/// gradients, while later buckets still reduce, typically to step those
/// parameters. Every managed parameter is reported exactly once per synced
/// iteration (unused ones too: <see cref="Ddp.ParameterUsed"/> tells them
/// apart), never in a no-sync one. <c>ddp</c> is valid only during the call
/// and answers reads (ParameterUsed, NumBuckets, BucketParameters,
/// LastStats); its other calls throw. Whatever it throws is rethrown, as
/// is, by <see cref="Ddp.FinishBackward"/> (or <see cref="Ddp.Join"/>) on
/// the caller's thread; the gradients are averaged all the same.</summary>
public abstract class BucketReduced : BucketReducedBase {
  readonly PendingException pending = new PendingException();

  public abstract void Reduced(Ddp ddp, ulong bucketIndex, ulong[] parameterIndices);

  public sealed override bool Invoke(Ddp ddp, ulong bucketIndex, SizeVector parameters) {
    HookThread.MarkBackground();
    try {
      var indices = new ulong[parameters.Count];
      parameters.CopyTo(indices);
      Reduced(ddp, bucketIndex, indices);
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
