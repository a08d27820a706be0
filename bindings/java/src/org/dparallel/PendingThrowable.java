package org.dparallel;

import java.util.concurrent.atomic.AtomicReference;

/** The first throwable a callback threw on a library thread, kept until the caller's thread rethrows it. */
final class PendingThrowable {
  private final AtomicReference<Throwable> first = new AtomicReference<>();

  void keep(Throwable t) {
    first.compareAndSet(null, t);
  }

  void clear() {
    first.set(null);
  }

  /** The exception to throw for {@code e}: the callback's own, with {@code e} suppressed, when it threw. */
  RuntimeException surface(DParallelException e) {
    Throwable t = first.getAndSet(null);
    if (t == null) return e;
    t.addSuppressed(e);
    return Sneaky.<RuntimeException>rethrow(t);
  }
}
