package org.dparallel;

/** The optimizer inside backward ({@link DdpOptions#setOnBucketReduced}): {@link #reduced} runs on the library's
 * worker thread as soon as bucket {@code bucketIndex}'s averaged gradients are final in the module's gradients,
 * while later buckets still reduce, typically to step those parameters. Every managed parameter is reported
 * exactly once per synced iteration (unused ones too: {@link Ddp#parameterUsed} tells them apart), never in a
 * no-sync one. {@code ddp} is valid only during the call and answers reads (parameterUsed, numBuckets,
 * bucketParameters, lastStats); its other calls throw. Whatever it throws is rethrown, as is, by
 * {@link Ddp#finishBackward()} (or {@link Ddp#join}) on the caller's thread; the gradients are averaged all the
 * same. */
public abstract class BucketReduced extends BucketReducedBase {
  private final PendingThrowable pending = new PendingThrowable();

  public abstract void reduced(Ddp ddp, long bucketIndex, long[] parameterIndices) throws Exception;

  @Override
  protected final boolean invoke(Ddp ddp, long bucketIndex, SizeVector parameters) {
    try {
      long[] indices = new long[parameters.size()];
      for (int i = 0; i < indices.length; ++i) indices[i] = parameters.get(i);
      reduced(ddp, bucketIndex, indices);
      return true;
    } catch (Throwable t) {
      pending.keep(t);
      return false;
    }
  }

  void clearPending() {
    pending.clear();
  }

  RuntimeException surface(DParallelException e) {
    return pending.surface(e);
  }
}
