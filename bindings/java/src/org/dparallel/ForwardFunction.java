package org.dparallel;

import java.util.concurrent.atomic.AtomicReference;

/** The host's forward for {@link Parallel#dataParallel}, {@link Parallel#parallelApply} and
 * {@link ReplicaSet#apply}. {@link #forward} runs on the library's worker thread of {@code device}, one
 * replica per thread at once; {@code replica} and {@code input} are valid only during the call. Whatever it
 * throws is kept and rethrown, as is, by the call that ran it, on the caller's thread. */
public abstract class ForwardFunction extends ForwardFunctionBase {
  private final AtomicReference<Throwable> pending = new AtomicReference<>();

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
      pending.compareAndSet(null, t);
      return null;
    }
  }

  static void clear(ForwardFunction fn) {
    if (fn != null) fn.pending.set(null);
  }

  /** The exception to throw for {@code e}: the forward's own, when it threw. */
  static RuntimeException surface(ForwardFunction fn, DParallelException e) {
    Throwable t = fn == null ? null : fn.pending.getAndSet(null);
    if (t == null) return e;
    t.addSuppressed(e);
    return Sneaky.<RuntimeException>rethrow(t);
  }
}
