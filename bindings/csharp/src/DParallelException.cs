namespace DParallel {

/// <summary>A dparallel call failed: <see cref="Code"/> is its negative status
/// (see <see cref="Status"/>), the message is the library's dp_last_error(),
/// which names the offending argument.</summary>
public class DParallelException : global::System.Exception {
  public int Code { get; }

  public DParallelException(int code, string message) : base(message) {
    Code = code;
  }
}

}
