package org.dparallel;

import java.util.concurrent.atomic.AtomicReference;

/** The DDP custom comm hook: {@link #reduce} leaves in {@code bucket} what the gradients should hold,
 * typically by collectives on {@code pg}. It runs on the library's worker thread; {@code pg} and
 * {@code bucket} are valid only during the call. Whatever it throws is rethrown, as is, by
 * {@link Ddp#finishBackward()} on the caller's thread. */
public abstract class CommHook extends CommHookBase {
  private final AtomicReference<Throwable> pending = new AtomicReference<>();

  public abstract void reduce(ProcessGroup pg, long bucketIndex, Tensor bucket) throws Exception;

  @Override
  protected final boolean invoke(ProcessGroup pg, long bucketIndex, Tensor bucket) {
    try {
      reduce(pg, bucketIndex, bucket);
      return true;
    } catch (Throwable t) {
      pending.compareAndSet(null, t);
      return false;
    }
  }

  void clearPending() {
    pending.set(null);
  }

  RuntimeException surface(DParallelException e) {
    Throwable t = pending.getAndSet(null);
    if (t == null) return e;
    t.addSuppressed(e);
    return Sneaky.<RuntimeException>rethrow(t);
  }
}
