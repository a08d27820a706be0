import org.dparallel.*;
import org.dparallel.Module;

public class App {
  public static void main(String[] args) {
    try (Module model = new Module(); Tensor x = Tensor.of(new float[] {1, 2, 3, 4, 5, 6, 7, 8}, 4, 2)) {
      ForwardFunction twice = new ForwardFunction() {  // runs on each device's worker thread
        @Override public Tensor forward(long i, Module replica, Tensor in, Device d) {
          java.nio.FloatBuffer v = in.floats();          // zero-copy view of this replica's chunk
          for (int k = 0; k < v.capacity(); ++k) v.put(k, 2 * v.get(k));
          return in; } };                                // a throw here is rethrown below, as is
      try (Tensor y = Parallel.dataParallel(model, x, Device.list("cpu:0,cpu:1"), new Device("cpu:0"), 0, twice)) {
        System.out.println(java.util.Arrays.toString(y.toArray())); } }  // DParallelException on failure
  }
}
