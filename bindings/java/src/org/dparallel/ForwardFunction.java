package org.dparallel;

/** The host's forward for {@link Parallel#dataParallel}, {@link Parallel#parallelApply} and
 * {@link ReplicaSet#apply}. {@link #forward} runs on the library's worker thread of {@code device}, one
 * replica per thread at once; {@code replica} and {@code input} are valid only during the call. Whatever it
 * throws is kept and rethrown, as is, by the call that ran it, on the caller's thread. */
public abstract class ForwardFunction extends ForwardFunctionBase {
  private final PendingThrowable pending = new PendingThrowable();

  /** Returns the output: a new tensor (the library takes it over and closes this object) or {@code input}. */
  public abstract Tensor forward(long index, Module replica, Tensor input, Device device) throws Exception;

  @Override
  protected final Tensor invoke(long index, Module replica, Tensor input, Device device) {
    try {
      Tensor out = forward(index, replica, input, device);
      if (out == null) throw new NullPointerException("ForwardFunction.forward returned null for replica " + index);
      // The library takes the returned tensor over: it must still be open.
      if (out.isClosed()) {
        throw new IllegalStateException("ForwardFunction.forward returned a closed tensor for replica " + index);
      }
      return out;
    } catch (Throwable t) {
      pending.keep(t);
      return null;
    }
  }

  static void clear(ForwardFunction fn) {
    if (fn != null) fn.pending.clear();
  }

  /** The exception to throw for {@code e}: the forward's own, when it threw. */
  static RuntimeException surface(ForwardFunction fn, DParallelException e) {
    return fn == null ? e : fn.pending.surface(e);
  }
}
