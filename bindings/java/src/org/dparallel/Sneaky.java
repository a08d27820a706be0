package org.dparallel;

/** Rethrows a callback's exception unchanged, checked ones included. */
final class Sneaky {
  private Sneaky() {}

  @SuppressWarnings("unchecked")
  static <T extends Throwable> RuntimeException rethrow(Throwable t) throws T {
    throw (T) t;
  }
}
