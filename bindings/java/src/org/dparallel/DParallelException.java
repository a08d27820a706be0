package org.dparallel;

/** A dparallel call failed: {@link #getCode()} is its negative status (see {@link Status}), the message is the
 * library's {@code dp_last_error()}, which names the offending argument. */
public class DParallelException extends RuntimeException {
  private static final long serialVersionUID = 1L;
  private final int code;

  public DParallelException(int code, String message) {
    super(message);
    this.code = code;
  }

  /** The status code, one of the {@link Status} constants. */
  public int getCode() {
    return code;
  }
}
