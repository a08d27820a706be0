package org.dparallel;

/** The DDP custom comm hook: {@link #reduce} leaves in {@code bucket} what the gradients should hold,
 * typically by collectives on {@code pg}. It runs on the library's worker thread; {@code pg} and
 * {@code bucket} are valid only during the call. Whatever it throws is rethrown, as is, by
 * {@link Ddp#finishBackward()} on the caller's thread. */
public abstract class CommHook extends CommHookBase {
  private final PendingThrowable pending = new PendingThrowable();

  public abstract void reduce(ProcessGroup pg, long bucketIndex, Tensor bucket) throws Exception;

  @Override
  protected final boolean invoke(ProcessGroup pg, long bucketIndex, Tensor bucket) {
    try {
      reduce(pg, bucketIndex, bucket);
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
