package org.dparallel;

/** Checks of handle arguments, before their pointer goes to native code. */
final class Args {
  private Args() {}

  /** A handle that must be given and open. */
  static long present(long pointer, Object handle, String name) {
    if (handle == null) throw new DParallelException(Status.INVALID, "invalid argument: '" + name + "' is null");
    if (pointer == 0) throw new DParallelException(Status.STATE, "invalid state: '" + name + "' is closed");
    return pointer;
  }

  /** A string that must be given. */
  static String text(String value, String name) {
    if (value == null) throw new DParallelException(Status.INVALID, "invalid argument: '" + name + "' is null");
    return value;
  }

  /** A handle that may be null (an empty slot) but not closed. */
  static long nullable(long pointer, Object handle, String name) {
    if (handle != null && pointer == 0) {
      throw new DParallelException(Status.STATE, "invalid state: '" + name + "' is closed");
    }
    return pointer;
  }
}
