using System.Runtime.InteropServices;

namespace DParallel {

/// Checks of handle arguments, before their pointer goes to native code.
static class Args {
  /// A handle that must be given and not disposed.
  internal static HandleRef Present(HandleRef pointer, object handle, string name) {
    if (handle == null) throw new DParallelException(Status.INVALID, "invalid argument: '" + name + "' is null");
    if (pointer.Handle == global::System.IntPtr.Zero) {
      throw new DParallelException(Status.STATE, "invalid state: '" + name + "' is disposed");
    }
    return pointer;
  }

  /// A string that must be given.
  internal static string Text(string value, string name) {
    if (value == null) throw new DParallelException(Status.INVALID, "invalid argument: '" + name + "' is null");
    return value;
  }

  /// A handle that may be null (an empty slot) but not disposed.
  internal static HandleRef Nullable(HandleRef pointer, object handle, string name) {
    if (handle != null && pointer.Handle == global::System.IntPtr.Zero) {
      throw new DParallelException(Status.STATE, "invalid state: '" + name + "' is disposed");
    }
    return pointer;
  }
}

}
