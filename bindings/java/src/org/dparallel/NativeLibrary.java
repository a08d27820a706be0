package org.dparallel;

import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.Locale;

/**
 * Loads libdparallel_jni (and the libdparallel it links) once, from the first
 * place that has it: the file named by the system property
 * {@code org.dparallel.library}, {@code java.library.path}, or the copies
 * this jar carries under {@code native/<os>-<arch>/}. Then registers a
 * shutdown hook that ends the library's own threads at exit.
 */
final class NativeLibrary {
  private NativeLibrary() {}

  // In load order: the JNI library's NEEDED entry is libdparallel's SONAME,
  // which the dynamic linker then finds already loaded.
  private static final String[] BUNDLED = {"libdparallel.so.0", "libdparallel_jni.so"};

  private static boolean loaded;

  static synchronized void load() {
    if (loaded) return;
    String path = System.getProperty("org.dparallel.library");
    if (path != null) {
      System.load(path);
    } else {
      try {
        System.loadLibrary("dparallel_jni");
      } catch (UnsatisfiedLinkError notOnPath) {
        try {
          loadBundled();
        } catch (IOException | UnsatisfiedLinkError e) {
          notOnPath.addSuppressed(e);
          throw notOnPath;
        }
      }
    }
    loaded = true;
    registerShutdownHook();
  }

  /** "linux-x86_64", the folder of this platform's libraries in the jar. */
  static String platform() {
    String os = System.getProperty("os.name", "").toLowerCase(Locale.ROOT);
    String arch = System.getProperty("os.arch", "").toLowerCase(Locale.ROOT);
    if (os.startsWith("linux")) os = "linux";
    if (arch.equals("amd64") || arch.equals("x86-64")) arch = "x86_64";
    if (arch.equals("arm64")) arch = "aarch64";
    return os + "-" + arch;
  }

  // Extracted to a private folder (createTempDirectory makes it owner-only),
  // loaded by absolute path, then deleted: a loaded library stays mapped.
  private static void loadBundled() throws IOException {
    String folder = "/native/" + platform() + "/";
    if (NativeLibrary.class.getResource(folder + BUNDLED[BUNDLED.length - 1]) == null) {
      throw new UnsatisfiedLinkError("this jar carries no libraries for " + platform());
    }
    Path dir = Files.createTempDirectory("dparallel-");
    Path[] files = new Path[BUNDLED.length];
    try {
      for (int i = 0; i < BUNDLED.length; ++i) {
        files[i] = dir.resolve(BUNDLED[i]);
        try (InputStream in = NativeLibrary.class.getResourceAsStream(folder + BUNDLED[i])) {
          if (in == null) throw new UnsatisfiedLinkError("the jar lacks " + folder + BUNDLED[i]);
          Files.copy(in, files[i], StandardCopyOption.REPLACE_EXISTING);
        }
      }
      for (Path file : files) System.load(file.toAbsolutePath().toString());
    } finally {
      for (Path file : files) {
        if (file != null && !deleted(file)) file.toFile().deleteOnExit();
      }
      if (!deleted(dir)) dir.toFile().deleteOnExit();
    }
  }

  private static boolean deleted(Path file) {
    try {
      Files.deleteIfExists(file);
      return true;
    } catch (IOException e) {
      return false;
    }
  }

  // The library's device workers, compute pool and async streams end before
  // the JVM exits instead of running on while exit() tears the process down.
  // Not when a callback called System.exit: its worker waits for this hook,
  // and the shutdown would wait for the worker. The wait is bounded all the
  // same, in case a callback waits on the thread that is exiting.
  private static final long SHUTDOWN_WAIT_MS = 10_000;

  private static void registerShutdownHook() {
    Thread hook = new Thread(() -> {
      if (callbackIsExiting()) return;
      Thread shutdown = new Thread(NativeLibrary::shutdownQuietly, "dparallel-shutdown");
      shutdown.setDaemon(true);
      shutdown.start();
      try {
        shutdown.join(SHUTDOWN_WAIT_MS);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }, "dparallel-exit");
    try {
      Runtime.getRuntime().addShutdownHook(hook);
    } catch (IllegalStateException shuttingDown) {
      // Loaded by another shutdown hook: too late to add one.
    }
  }

  /** Whether a thread inside a callback (a SWIG director up-call) is in Runtime.exit. */
  private static boolean callbackIsExiting() {
    for (StackTraceElement[] stack : Thread.getAllStackTraces().values()) {
      boolean exiting = false;
      for (StackTraceElement frame : stack) {
        if (frame.getClassName().equals("java.lang.Shutdown")) exiting = true;
        if (exiting && frame.getClassName().equals("org.dparallel.ParallelJNI")
            && frame.getMethodName().startsWith("SwigDirector_")) {
          return true;
        }
      }
    }
    return false;
  }

  private static void shutdownQuietly() {
    try {
      Library.shutdown();
    } catch (RuntimeException e) {
      // Nothing to report to at exit.
    }
  }
}
