// Checks where dparallel.jar loaded its native libraries from, and that
// Library.shutdown() ends the library's threads, which start again on next
// use. Each mode first runs dataParallel with a Java forward and checks its
// output.
//
//   java -cp dparallel.jar:. PackageTest bundled <prefix>       the jar's copies, extracted outside
//                                                              <prefix> and deleted once loaded
//   java -Djava.library.path=<libdir> -cp dparallel.jar:. PackageTest library-path <libdir>
//   java -Dorg.dparallel.library=<libdir>/libdparallel_jni.so -cp dparallel.jar:. PackageTest library-path <libdir>
//   java -cp dparallel.jar:. PackageTest shutdown
//   java -cp dparallel.jar:. PackageTest exit-in-forward      exits with status 3
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;
import java.util.stream.Stream;
import org.dparallel.*;
import org.dparallel.Module;

public class PackageTest {
  static void expect(boolean ok, String message) {
    if (!ok) {
      System.err.println("FAIL: " + message);
      System.exit(1);
    }
  }

  /** The file /proc/self/maps shows for the mapped library `name` (or name.*, its versioned file). */
  static String mapped(String name) throws IOException {
    for (String line : Files.readAllLines(Paths.get("/proc/self/maps"))) {
      int slash = line.indexOf('/');
      if (slash < 0) continue;
      String file = line.substring(slash);
      String bare = file.endsWith(" (deleted)") ? file.substring(0, file.length() - 10) : file;
      String base = Paths.get(bare).getFileName().toString();
      if (base.equals(name) || base.startsWith(name + ".")) return file;
    }
    return null;
  }

  /** Names of this process's threads that the library made (dp-dev, dp-pool, dp-stream). */
  static List<String> libraryThreads() throws IOException {
    List<String> names = new ArrayList<>();
    try (Stream<Path> tasks = Files.list(Paths.get("/proc/self/task"))) {
      for (Path task : (Iterable<Path>) tasks::iterator) {
        String name;
        try {
          name = Files.readString(task.resolve("comm")).trim();
        } catch (IOException ended) {
          continue;
        }
        if (name.startsWith("dp-")) names.add(name);
      }
    }
    return names;
  }

  /** Doubles x on cpu:0 and cpu:1 with a Java forward; checks the gathered output. */
  static void dataParallel() {
    try (Module model = new Module(); Tensor x = Tensor.of(new float[] {1, 2, 3, 4, 5, 6, 7, 8}, 4, 2)) {
      ForwardFunction twice = new ForwardFunction() {
        @Override
        public Tensor forward(long i, Module replica, Tensor in, Device d) {
          java.nio.FloatBuffer v = in.floats();
          for (int k = 0; k < v.capacity(); ++k) v.put(k, 2 * v.get(k));
          return in;
        }
      };
      try (Tensor y = Parallel.dataParallel(model, x, Device.list("cpu:0,cpu:1"), new Device("cpu:0"), 0, twice)) {
        float[] got = y.toArray();
        for (int k = 0; k < 8; ++k) expect(got[k] == 2 * (k + 1), "element " + k + " of the output is " + got[k]);
      }
    }
  }

  public static void main(String[] args) throws IOException {
    String mode = args.length > 0 ? args[0] : "";
    dataParallel();
    String jni = mapped("libdparallel_jni.so"), lib = mapped("libdparallel.so.0");
    expect(jni != null && lib != null, "libdparallel_jni.so and libdparallel.so.0 are mapped: " + jni + ", " + lib);
    switch (mode) {
      case "bundled": {
        String prefix = Paths.get(args[1]).toRealPath().toString();
        for (String file : new String[] {jni, lib}) {
          expect(!file.startsWith(prefix + "/"), file + " comes from the jar, not from " + prefix);
          expect(file.endsWith(" (deleted)"), file + " was deleted once loaded");
        }
        Path dir = Paths.get(jni.substring(0, jni.length() - 10)).getParent();
        expect(dir.equals(Paths.get(lib.substring(0, lib.length() - 10)).getParent()),
            "both libraries come from one folder: " + jni + ", " + lib);
        expect(!Files.exists(dir), "the folder the jar's libraries went to is gone: " + dir);
        break;
      }
      case "library-path": {
        Path dir = Paths.get(args[1]).toRealPath();
        expect(Paths.get(jni).equals(dir.resolve("libdparallel_jni.so").toRealPath()),
            "libdparallel_jni.so comes from java.library.path: " + jni);
        expect(Paths.get(lib).equals(dir.resolve("libdparallel.so.0").toRealPath()),
            "libdparallel.so.0 comes from beside it: " + lib);
        break;
      }
      case "shutdown": {
        expect(libraryThreads().stream().anyMatch(n -> n.startsWith("dp-dev")),
            "dataParallel started device workers: " + libraryThreads());
        Library.shutdown();
        expect(libraryThreads().isEmpty(), "no library thread is left after shutdown(): " + libraryThreads());
        Library.shutdown();
        dataParallel();
        expect(!libraryThreads().isEmpty(), "dataParallel after shutdown() starts the workers again");
        break;
      }
      case "exit-in-forward": {
        // System.exit from a forward, on a library worker: the shutdown hook
        // must not wait for that worker, and the status is kept.
        try (Module model = new Module(); Tensor x = Tensor.of(new float[] {1, 2, 3, 4}, 2, 2)) {
          ForwardFunction exits = new ForwardFunction() {
            @Override
            public Tensor forward(long i, Module replica, Tensor in, Device d) {
              if (i == 1) System.exit(3);
              return in;
            }
          };
          Parallel.dataParallel(model, x, Device.list("cpu:0,cpu:1"), new Device("cpu:0"), 0, exits).close();
        }
        expect(false, "dataParallel returned although its forward called System.exit");
        break;
      }
      default:
        expect(false, "unknown mode '" + mode + "'");
    }
    System.out.println("OK " + mode);
  }
}
