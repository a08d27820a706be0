// Trains a small tanh MLP with its forward and backward written in Java, on
// two logical CPU devices (replica sets, dataParallel, parallelApply) or one
// process per rank under dp-run (DDP, with the default and a Java comm
// hook), and checks parity with plain single-device training. Also pins
// that exceptions thrown in callbacks surface in the caller, that bad
// arguments raise DParallelException naming the argument, that zero-copy
// views keep the tensor's memory alive after the tensor is closed or
// collected, and that every handle answers isClosed() after close().
//
//   java -cp dparallel.jar:. DParallelTest data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles
//   dp-run -n 2 java -cp dparallel.jar:. DParallelTest ddp
import java.io.IOException;
import java.lang.ref.PhantomReference;
import java.lang.ref.Reference;
import java.lang.ref.ReferenceQueue;
import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.function.BooleanSupplier;
import java.util.concurrent.atomic.AtomicInteger;
import org.dparallel.*;
import org.dparallel.Module;

public class DParallelTest {
  static final int LAYERS = 3, WIDTH = 8, BATCH = 24, STEPS = 6;
  static final float LR = 0.5f;
  // Observed differences are ~1e-8 (summation order); a learning rate 0.1%
  // off already moves parameters by ~3e-5.
  static final double RTOL = 1e-5, ATOL = 1e-6;

  static void fail(String message) {
    System.err.println("FAIL: " + message);
    System.exit(1);
  }

  static void expect(boolean ok, String message) {
    if (!ok) fail(message);
  }

  // ---- deterministic data (splitmix64) ----
  static long state;

  static float uniform() {
    long z = (state += 0x9e3779b97f4a7c15L);
    z = (z ^ (z >>> 30)) * 0xbf58476d1ce4e5b9L;
    z = (z ^ (z >>> 27)) * 0x94d049bb133111ebL;
    z = z ^ (z >>> 31);
    return (float) ((z >>> 11) * (1.0 / 9007199254740992.0)) - 0.5f;
  }

  static float[][] initialWeights(boolean bias) {
    float[][] out = new float[LAYERS][bias ? WIDTH : WIDTH * WIDTH];
    for (float[] layer : out) {
      for (int i = 0; i < layer.length; ++i) layer[i] = uniform() * (bias ? 0.2f : 1.2f / (float) Math.sqrt(WIDTH));
    }
    return out;
  }

  /** Rows of [x | y] for step `step`, BATCH x 2*WIDTH. */
  static float[] batch(int step) {
    state = 1000 + step;
    float[] rows = new float[BATCH * 2 * WIDTH];
    for (int i = 0; i < rows.length; ++i) rows[i] = uniform();
    return rows;
  }

  static String weightName(int l) {
    return "fc" + l + ".weight";
  }

  static String biasName(int l) {
    return "fc" + l + ".bias";
  }

  /** Layer-done callback of the backward: where an autograd hook would tell DDP. */
  interface LayerDone {
    void done(int layer);
  }

  /** Forward and backward of the MLP (tanh after every layer but the last, MSE over fullBatch rows) over
   * `n` rows of `rows` from row `first`; writes into gw/gb this part's gradient times `world` and returns
   * its part of the loss. */
  static double forwardBackward(float[][] w, float[][] b, float[][] gw, float[][] gb, float[] rows, int first, int n,
                                int fullBatch, int world, LayerDone layerDone) {
    final int W = WIDTH, L = LAYERS, ld = 2 * W;
    float[][] act = new float[L][n * W];
    for (int l = 0; l < L; ++l) {
      for (int r = 0; r < n; ++r) {
        for (int j = 0; j < W; ++j) {
          float s = 0;
          for (int k = 0; k < W; ++k) {
            float in = l == 0 ? rows[(first + r) * ld + k] : act[l - 1][r * W + k];
            s += in * w[l][j * W + k];
          }
          float v = s + b[l][j];
          act[l][r * W + j] = l < L - 1 ? (float) Math.tanh(v) : v;
        }
      }
    }
    double loss = 0;
    float[] dz = new float[n * W];
    float scale = 2.0f * world / (float) (fullBatch * W);
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < W; ++j) {
        float diff = act[L - 1][r * W + j] - rows[(first + r) * ld + W + j];
        loss += (double) diff * diff;
        dz[r * W + j] = diff * scale;
      }
    }
    for (int l = L - 1; l >= 0; --l) {
      for (int j = 0; j < W; ++j) {
        for (int k = 0; k < W; ++k) {
          float s = 0;
          for (int r = 0; r < n; ++r) {
            float in = l == 0 ? rows[(first + r) * ld + k] : act[l - 1][r * W + k];
            s += dz[r * W + j] * in;
          }
          gw[l][j * W + k] = s;
        }
        float s = 0;
        for (int r = 0; r < n; ++r) s += dz[r * W + j];
        gb[l][j] = s;
      }
      if (layerDone != null) layerDone.done(l);
      if (l == 0) break;
      float[] da = new float[n * W];
      for (int r = 0; r < n; ++r) {
        for (int k = 0; k < W; ++k) {
          float s = 0;
          for (int j = 0; j < W; ++j) s += dz[r * W + j] * w[l][j * W + k];
          float a = act[l - 1][r * W + k];
          da[r * W + k] = s * (1.0f - a * a);
        }
      }
      dz = da;
    }
    return loss / (double) (fullBatch * W);
  }

  /** Plain single-device training on full batches: the reference. */
  static float[][][] reference() {
    state = 7;
    float[][] w = initialWeights(false), b = initialWeights(true);
    float[][] gw = new float[LAYERS][WIDTH * WIDTH], gb = new float[LAYERS][WIDTH];
    for (int step = 0; step < STEPS; ++step) {
      forwardBackward(w, b, gw, gb, batch(step), 0, BATCH, BATCH, 1, null);
      for (int l = 0; l < LAYERS; ++l) {
        for (int i = 0; i < w[l].length; ++i) w[l][i] -= LR * gw[l][i];
        for (int i = 0; i < b[l].length; ++i) b[l][i] -= LR * gb[l][i];
      }
    }
    return new float[][][] {w, b};
  }

  static Module buildModel() {
    state = 7;
    float[][] w = initialWeights(false), b = initialWeights(true);
    Module model = new Module();
    for (int l = 0; l < LAYERS; ++l) {
      try (Module layer = new Module(); Tensor weight = Tensor.of(w[l], WIDTH, WIDTH); Tensor bias = Tensor.of(b[l], WIDTH)) {
        layer.registerParameter("weight", weight);
        layer.registerParameter("bias", bias);
        model.registerModule("fc" + l, layer);
      }
    }
    return model;
  }

  static float[] read(Module m, String name) {
    try (Tensor t = m.getParameter(name)) {
      return t.toArray();
    }
  }

  /** Reads the parameters through zero-copy views. */
  static void loadParams(Module m, float[][] w, float[][] b) {
    for (int l = 0; l < LAYERS; ++l) {
      try (Tensor tw = m.getParameter(weightName(l)); Tensor tb = m.getParameter(biasName(l))) {
        tw.floats().get(w[l]);
        tb.floats().get(b[l]);
      }
    }
  }

  static void sgd(Module m) {
    for (int l = 0; l < LAYERS; ++l) {
      for (String name : new String[] {weightName(l), biasName(l)}) {
        try (Tensor p = m.getParameter(name); Tensor g = m.grad(name)) {
          FloatBuffer pv = p.floats(), gv = g.floats();
          for (int i = 0; i < pv.capacity(); ++i) pv.put(i, pv.get(i) - LR * gv.get(i));
        }
      }
    }
  }

  static void checkParity(Module m, String what) {
    float[][][] ref = reference();
    double worst = 0;
    int bad = 0;
    for (int l = 0; l < LAYERS; ++l) {
      for (int part = 0; part < 2; ++part) {
        float[] got = read(m, part == 0 ? weightName(l) : biasName(l));
        float[] want = ref[part][l];
        for (int i = 0; i < want.length; ++i) {
          double diff = Math.abs((double) got[i] - want[i]);
          if (!(diff <= ATOL + RTOL * Math.abs(want[i]))) ++bad;
          worst = Math.max(worst, diff);
        }
      }
    }
    System.out.printf("%s: parity with single-device training: max |difference| %.3g, %d values off%n", what, worst, bad);
    expect(bad == 0, what + ": parameters differ from single-device training");
  }

  /** The replica's forward and backward, in Java, reading the replica's parameters and writing its
   * gradients through direct buffers; returns the loss as a 1-element tensor on the replica's device. */
  static class Step extends ForwardFunction {
    final AtomicInteger calls = new AtomicInteger();
    volatile boolean onCallerThread;
    final Thread caller = Thread.currentThread();

    @Override
    public Tensor forward(long index, Module replica, Tensor input, Device device) {
      calls.incrementAndGet();
      if (Thread.currentThread() == caller) onCallerThread = true;
      long[] shape = input.shapeArray();
      int n = (int) shape[0];
      float[] rows = new float[n * 2 * WIDTH];
      input.floats().get(rows);
      float[][] w = new float[LAYERS][WIDTH * WIDTH], b = new float[LAYERS][WIDTH];
      float[][] gw = new float[LAYERS][WIDTH * WIDTH], gb = new float[LAYERS][WIDTH];
      loadParams(replica, w, b);
      double loss = forwardBackward(w, b, gw, gb, rows, 0, n, BATCH, 1, null);
      for (int l = 0; l < LAYERS; ++l) {
        try (Tensor tw = replica.grad(weightName(l)); Tensor tb = replica.grad(biasName(l))) {
          tw.floats().put(gw[l]);
          tb.floats().put(gb[l]);
        }
      }
      Tensor out = new Tensor(device, 1);
      out.floats().put(0, (float) loss);
      return out;
    }
  }

  static Tensor inputFor(int step) {
    return Tensor.of(batch(step), BATCH, 2 * WIDTH);
  }

  static void dataParallel() {
    DeviceList devices = Device.list("cpu:0,cpu:1");
    Device cpu0 = new Device("cpu:0");
    Step step = new Step();
    try (Module model = buildModel(); ReplicaSet set = new ReplicaSet(model, devices)) {
      for (int s = 0; s < STEPS; ++s) {
        try (Tensor input = inputFor(s)) {
          model.zeroGrad();
          Tensor losses;
          if (s % 3 == 0) {
            set.sync();
            losses = set.apply(input, 0, cpu0, step);
            set.reduceGradients();
          } else if (s % 3 == 1) {
            losses = Parallel.dataParallel(model, input, devices, cpu0, 0, step);
          } else {
            // parallelApply over fresh replicas and the scattered halves;
            // the losses gathered, and summed with reduceAdd.
            try (ModuleList replicas = Parallel.replicate(model, devices, false);
                 TensorList chunks = Parallel.scatter(input, devices, 0);
                 Module r0 = replicas.get(0); Module r1 = replicas.get(1);
                 Tensor in0 = chunks.get(0); Tensor in1 = chunks.get(1)) {
              expect(chunks.size() == 2 && in1.device().toString().equals("cpu:1"), "scatter puts chunk 1 on cpu:1");
              ModuleVector mv = new ModuleVector();
              mv.add(r0);
              mv.add(r1);
              TensorVector tv = new TensorVector();
              tv.add(in0);
              tv.add(in1);
              try (TensorList outs = Parallel.parallelApply(mv, tv, new DeviceList(), step);
                   Tensor o0 = outs.get(0); Tensor o1 = outs.get(1)) {
                expect(outs.size() == 2, "parallelApply gives one output per replica");
                expect(o1.device().toString().equals("cpu:1"), "replica 1's output is on cpu:1, not " + o1.device().toString());
                TensorVector ov = new TensorVector();
                ov.add(o0);
                ov.add(o1);
                try (Tensor sum = Parallel.reduceAdd(ov, cpu0)) {
                  losses = Parallel.gather(ov, 0, cpu0);
                  float[] l = losses.toArray();
                  expect(sum.toArray()[0] == l[0] + l[1], "reduceAdd sums what gather concatenates");
                }
              }
              Parallel.reduceGradients(mv, model);
            }
          }
          if (losses != null) {
            expect(losses.numel() == 2, "one loss per replica, got " + losses.numel());
            float[] l = losses.toArray();
            System.out.printf("step %d loss %.6f%n", s + 1, l[0] + l[1]);
            losses.close();
          }
          sgd(model);
        }
      }
      try (Tensor t = Tensor.of(new float[] {1, 2, 3}, 3); TensorList copies = Parallel.broadcast(t, devices);
           Tensor c1 = copies.get(1)) {
        expect(c1.device().toString().equals("cpu:1") && c1.toArray()[2] == 3, "broadcast copies to cpu:1");
      }
      expect(step.calls.get() == 2 * STEPS, "the forward ran once per replica and step: " + step.calls.get());
      expect(!step.onCallerThread, "the forward ran on the library's worker threads, not the caller's");
      checkParity(model, "data-parallel on cpu:0,cpu:1");
    }
  }

  static void forwardThrows() {
    DeviceList devices = Device.list("cpu:0,cpu:1");
    Device cpu0 = new Device("cpu:0");
    try (Module model = buildModel(); ReplicaSet set = new ReplicaSet(model, devices); Tensor input = inputFor(0)) {
      ForwardFunction throwing = new ForwardFunction() {
        @Override
        public Tensor forward(long index, Module replica, Tensor in, Device device) {
          if (index == 1) throw new IllegalStateException("forward failed on replica " + index);
          return in;
        }
      };
      try {
        set.apply(input, 0, cpu0, throwing);
        fail("ReplicaSet.apply returned although the forward threw");
      } catch (IllegalStateException e) {
        expect(e.getMessage().equals("forward failed on replica 1"), "the forward's own exception surfaces: " + e);
        expect(e.getSuppressed().length == 1 && e.getSuppressed()[0] instanceof DParallelException
                   && ((DParallelException) e.getSuppressed()[0]).getCode() == Status.USER,
               "the library's DP_EUSER is attached to it");
        System.out.println("ReplicaSet.apply rethrew: " + e);
      }
      ForwardFunction checked = new ForwardFunction() {
        @Override
        public Tensor forward(long index, Module replica, Tensor in, Device device) throws IOException {
          throw new IOException("checked failure in replica " + index);
        }
      };
      try {
        Parallel.dataParallel(model, input, devices, cpu0, 0, checked).close();
        fail("dataParallel returned although the forward threw");
      } catch (Exception e) {
        expect(e instanceof IOException, "a checked exception surfaces as itself, not " + e);
        System.out.println("dataParallel rethrew: " + e);
      }
      // A failing call inside the forward throws DParallelException on the
      // worker thread; it surfaces in the caller like any other exception.
      ForwardFunction badName = new ForwardFunction() {
        @Override
        public Tensor forward(long index, Module replica, Tensor in, Device device) {
          replica.getParameter("no.such.parameter").close();
          return in;
        }
      };
      try {
        set.apply(input, 0, cpu0, badName).close();
        fail("ReplicaSet.apply returned although the forward's call failed");
      } catch (DParallelException e) {
        expect(e.getCode() == Status.INVALID && e.getMessage().contains("no.such.parameter"),
               "the worker thread's DParallelException surfaces: " + e.getMessage());
        System.out.println("ReplicaSet.apply rethrew: " + e.getMessage());
      }
      // Returning a tensor that try-with-resources already closed is caught.
      ForwardFunction closes = new ForwardFunction() {
        @Override
        public Tensor forward(long index, Module replica, Tensor in, Device device) {
          try (Tensor out = new Tensor(device, 1)) {
            return out;
          }
        }
      };
      try {
        set.apply(input, 0, cpu0, closes).close();
        fail("ReplicaSet.apply returned although the forward returned a closed tensor");
      } catch (IllegalStateException e) {
        expect(e.getMessage().contains("closed tensor"), "a closed output is refused: " + e.getMessage());
        System.out.println("ReplicaSet.apply rethrew: " + e.getMessage());
      }
      // The library and the set stay usable.
      try (Tensor out = set.apply(input, 0, cpu0, new Step())) {
        expect(out.numel() == 2, "apply works after a failed forward");
      }
    }
  }

  // ---- view lifetime ----

  static float[] distinctValues(int n, int seed) {
    float[] out = new float[n];
    for (int i = 0; i < n; ++i) out[i] = seed * 100000 + i + 0.5f;
    return out;
  }

  /** floats() of a tensor that nothing references once this returns. */
  static FloatBuffer floatsOfDroppedTensor(float[] values, ReferenceQueue<Tensor> collected, List<Reference<Tensor>> refs) {
    Tensor t = Tensor.of(values, values.length);
    refs.add(new PhantomReference<>(t, collected));
    return t.floats();
  }

  /** buffer() of a tensor that nothing references once this returns. */
  static ByteBuffer bufferOfDroppedTensor(float[] values, ReferenceQueue<Tensor> collected, List<Reference<Tensor>> refs) {
    Tensor t = Tensor.of(values, values.length);
    refs.add(new PhantomReference<>(t, collected));
    return t.buffer();
  }

  /** Collects until `count` tensors were finalized (their phantom references come after the finalizer). */
  static void awaitCollected(ReferenceQueue<Tensor> collected, int count) throws InterruptedException {
    long deadline = System.nanoTime() + 30_000_000_000L;
    for (int seen = 0; seen < count;) {
      System.gc();
      byte[][] pressure = new byte[32][];
      for (int i = 0; i < pressure.length; ++i) pressure[i] = new byte[1 << 16];
      for (Reference<? extends Tensor> r = collected.remove(50); r != null; r = collected.poll()) ++seen;
      expect(System.nanoTime() < deadline, "the dropped tensors were collected within 30 s (" + seen + " of " + count + ")");
    }
  }

  /** Tensors of `n` elements filled with `fill`: what would take over freed memory of that size. */
  static List<Tensor> reuseCandidates(int n, float fill) {
    float[] values = new float[n];
    java.util.Arrays.fill(values, fill);
    List<Tensor> out = new ArrayList<>();
    for (int i = 0; i < 16; ++i) out.add(Tensor.of(values, n));
    return out;
  }

  /** `view` still holds `want`; writing through it changes none of `others`. */
  static void checkViewOwnsMemory(String what, FloatBuffer view, float[] want, List<Tensor> others, float fill) {
    expect(view.capacity() == want.length, what + ": capacity " + view.capacity());
    for (int i = 0; i < want.length; ++i) {
      if (view.get(i) != want[i]) fail(what + ": element " + i + " reads " + view.get(i) + ", not " + want[i]);
    }
    for (int i = 0; i < want.length; ++i) view.put(i, -want[i]);
    for (Tensor other : others) {
      float[] got = other.toArray();
      for (int i = 0; i < got.length; ++i) {
        if (got[i] != fill) fail(what + ": a write through the view landed in another tensor (element " + i + ")");
      }
    }
    for (int i = 0; i < want.length; ++i) {
      if (view.get(i) != -want[i]) fail(what + ": element " + i + " does not keep what was written");
    }
  }

  /** A view made by floats() or buffer() keeps the tensor's memory: after the tensor is collected without
   * close(), or closed while the view is in use, and after new tensors of the same size were made. */
  static void viewOutlivesTensor() throws InterruptedException {
    // Under and over 64 KiB: a malloc block, and one of the allocator's cache, which hands a freed block to
    // the next tensor of its size.
    int[] sizes = {1000, 40000};
    ReferenceQueue<Tensor> collected = new ReferenceQueue<>();
    List<Reference<Tensor>> refs = new ArrayList<>();
    List<float[]> wants = new ArrayList<>();
    List<FloatBuffer> views = new ArrayList<>();
    List<String> names = new ArrayList<>();
    for (int k = 0; k < sizes.length; ++k) {
      float[] a = distinctValues(sizes[k], 2 * k + 1), b = distinctValues(sizes[k], 2 * k + 2);
      wants.add(a);
      views.add(floatsOfDroppedTensor(a, collected, refs));
      names.add("floats() of a dropped tensor of " + sizes[k]);
      wants.add(b);
      views.add(bufferOfDroppedTensor(b, collected, refs).asFloatBuffer());
      names.add("buffer() of a dropped tensor of " + sizes[k]);
    }
    awaitCollected(collected, refs.size());
    for (int k = 0; k < sizes.length; ++k) {
      List<Tensor> others = reuseCandidates(sizes[k], -1);
      for (int v = 2 * k; v < 2 * k + 2; ++v) checkViewOwnsMemory(names.get(v), views.get(v), wants.get(v), others, -1);
      for (Tensor t : others) t.close();
    }
    for (int n : sizes) {
      float[] want = distinctValues(n, 7);
      Tensor t = Tensor.of(want, n);
      FloatBuffer view = t.floats();
      t.close();
      expect(t.isClosed(), "close() closes the tensor although a view of it is in use");
      List<Tensor> others = reuseCandidates(n, -3);
      checkViewOwnsMemory("floats() of a closed tensor of " + n, view, want, others, -3);
      for (Tensor o : others) o.close();
    }
    System.out.println("views of " + views.size() + " collected and 2 closed tensors kept their memory");
    // The views' own references go when the views do; the library stays sound.
    views.clear();
    for (int i = 0; i < 3; ++i) {
      System.gc();
      Thread.sleep(20);
    }
    try (Tensor t = Tensor.of(distinctValues(40000, 9), 40000)) {
      expect(t.toArray()[1] == 900001.5f, "a new tensor after the views are gone holds its values");
    }
  }

  // ---- closed handles ----

  /** `handle` is open; after close() isClosed() is true (not a throw), a second close() does nothing and
   * `use` throws DParallelException with Status.STATE. */
  static void checkCloses(String what, AutoCloseable handle, BooleanSupplier isClosed, Runnable use) throws Exception {
    expect(!isClosed.getAsBoolean(), what + " is open after it is made");
    use.run();
    handle.close();
    expect(isClosed.getAsBoolean(), what + ".isClosed() after close()");
    handle.close();
    expect(isClosed.getAsBoolean(), what + ".isClosed() after a second close()");
    try {
      use.run();
      fail("a call on a closed " + what + " returned");
    } catch (DParallelException e) {
      expect(e.getCode() == Status.STATE, "a closed " + what + " is Status.STATE: " + e.getMessage());
    }
  }

  static void closedHandles() throws Exception {
    DeviceList devices = Device.list("cpu:0,cpu:1");
    Device cpu0 = new Device("cpu:0");
    Tensor tensor = Tensor.of(new float[] {1, 2, 3, 4}, 4);
    checkCloses("Tensor", tensor, tensor::isClosed, tensor::numel);
    try (Tensor input = Tensor.of(new float[] {1, 2, 3, 4}, 4)) {
      TensorList chunks = Parallel.scatter(input, devices, 0);
      checkCloses("TensorList", chunks, chunks::isClosed, () -> chunks.get(0).close());
    }
    Module module = new Module();
    checkCloses("Module", module, module::isClosed, module::numParameters);
    try (Module model = buildModel()) {
      ModuleList replicas = Parallel.replicate(model, devices, false);
      checkCloses("ModuleList", replicas, replicas::isClosed, () -> replicas.get(0).close());
      ReplicaSet set = new ReplicaSet(model, devices);
      checkCloses("ReplicaSet", set, set::isClosed, set::sync);
      Store store = Store.tcp("127.0.0.1", 0, 1, true, 10000);
      ProcessGroup pg = ProcessGroup.create(store, 0, 1, cpu0, 10000);
      try (Tensor t = Tensor.of(new float[] {1, 2}, 2)) {
        Work work = pg.allReduceAsync(t, ReduceOp.SUM);
        checkCloses("Work", work, work::isClosed, work::waitFor);
      }
      Ddp ddp = new Ddp(model, pg, new DdpOptions());
      checkCloses("Ddp", ddp, ddp::isClosed, ddp::numBuckets);
      checkCloses("ProcessGroup", pg, pg::isClosed, pg::rank);
      checkCloses("Store", store, store::isClosed, store::port);
    }
    System.out.println("every handle answers isClosed() after close()");
  }

  /** `call` fails with Status.INVALID and a message that contains `naming` (the argument, or the bad name). */
  static void expectInvalid(Runnable call, String naming) {
    try {
      call.run();
      fail("no exception; expected one naming " + naming);
    } catch (DParallelException e) {
      expect(e.getCode() == Status.INVALID, "code " + e.getCode() + " is Status.INVALID");
      expect(e.getMessage().contains(naming), "the message names " + naming + ": " + e.getMessage());
      System.out.println("DParallelException: " + e.getMessage());
    }
  }

  static void badArgument() {
    expectInvalid(() -> new Device("gpu:0"), "'text'");
    expectInvalid(() -> new Tensor(4, -2).close(), "'shape[1]'");
    try (Tensor t = new Tensor(2, 3)) {
      expectInvalid(() -> t.copyFrom(new float[5]), "'values'");
      expectInvalid(() -> t.copyFrom(null), "'values'");
    }
    try (Module m = new Module(); Tensor t = new Tensor(3)) {
      m.registerParameter("w", t);
      expectInvalid(() -> m.registerParameter("w", t), "'name'");
      expectInvalid(() -> m.getParameter("nope").close(), "\"nope\"");
    }
    expectInvalid(() -> Parallel.dataParallel(new Module(), new Tensor(2), Device.list("cpu:0"), new Device(), 0, null), "'fn'");
    // A closed handle throws, it does not crash.
    Tensor closed = new Tensor(2);
    closed.close();
    try {
      closed.numel();
      fail("a call on a closed tensor returned");
    } catch (DParallelException e) {
      expect(e.getCode() == Status.STATE, "a closed handle is Status.STATE: " + e.getMessage());
      System.out.println("DParallelException: " + e.getMessage());
    }
  }

  /** A TCP store served and used in this process; a missing key times out. */
  static void store() {
    try (Store server = Store.tcp("127.0.0.1", 0, 1, true, 10000)) {
      int port = server.port();
      expect(port > 0, "the server picked a free port: " + port);
      try (Store client = Store.tcp("127.0.0.1", port, 1, false, 10000)) {
        server.set("greeting", "hello");
        expect(client.get("greeting").equals("hello"), "the client reads what the server set");
        expect(client.add("counter", 5) == 5 && server.add("counter", 2) == 7, "add counts across handles");
        StringVector keys = new StringVector();
        keys.add("greeting");
        keys.add("counter");
        client.waitFor(keys, 1000);
        client.setTimeout(200);
        try {
          client.get("missing");
          fail("get of a missing key returned");
        } catch (DParallelException e) {
          expect(e.getCode() == Status.TIMEOUT, "a missing key times out: " + e.getMessage());
          System.out.println("DParallelException: " + e.getMessage());
        }
      }
    }
  }

  /** One rank of DDP training: rows [lo, hi) of every batch; the gradients are averaged across ranks. */
  static void ddp() {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000); Module model = buildModel()) {
      int rank = pg.rank(), world = pg.size();
      int lo = BATCH * rank / world, hi = BATCH * (rank + 1) / world;
      AtomicInteger hookCalls = new AtomicInteger();
      CommHook average = new CommHook() {
        @Override
        public void reduce(ProcessGroup group, long bucketIndex, Tensor bucket) {
          hookCalls.incrementAndGet();
          group.allReduce(bucket, ReduceOp.SUM);
          FloatBuffer v = bucket.floats();
          for (int i = 0; i < v.capacity(); ++i) v.put(i, v.get(i) / group.size());
        }
      };
      DdpOptions options = new DdpOptions();
      options.setFirstBucketCapMb(1e-4); // several buckets, reduced while the backward goes on
      options.setBucketCapMb(1e-4);
      Ddp ddp = new Ddp(model, pg, options);
      float[][] w = new float[LAYERS][WIDTH * WIDTH], b = new float[LAYERS][WIDTH];
      float[][] gw = new float[LAYERS][WIDTH * WIDTH], gb = new float[LAYERS][WIDTH];
      for (int s = 0; s < STEPS; ++s) {
        if (s == STEPS / 2) {
          // The second half of the steps reduces through the Java hook.
          ddp.close();
          ddp = new Ddp(model, pg, options, average);
        }
        final Ddp d = ddp;
        d.preForward();
        loadParams(model, w, b);
        double loss = forwardBackward(w, b, gw, gb, batch(s), lo, hi - lo, BATCH, world, layer -> {
          try (Tensor tw = model.grad(weightName(layer)); Tensor tb = model.grad(biasName(layer))) {
            tw.floats().put(gw[layer]);
            tb.floats().put(gb[layer]);
          }
          d.markGradReady(weightName(layer));
          d.markGradReady(biasName(layer));
        });
        d.finishBackward();
        sgd(model);
        if (rank == 0) System.out.printf("step %d loss part %.6f%n", s + 1, loss);
      }
      expect(hookCalls.get() > 0, "the Java comm hook ran");
      System.out.printf("rank %d: %d buckets, the Java hook ran %d times%n", rank, ddp.numBuckets(), hookCalls.get());
      ddp.close();
      checkParity(model, "DDP rank " + rank + " of " + world);

      // Collectives of the group, from Java.
      try (Tensor t = new Tensor(cpu0, 3)) {
        t.floats().put(new float[] {rank + 1, 10 * (rank + 1), rank == 0 ? 7 : 0});
        try (Work work = pg.allReduceAsync(t, ReduceOp.SUM)) {
          work.waitFor();
          expect(work.test(), "the work is done after waitFor");
        }
        float[] sum = t.toArray();
        expect(sum[0] == world * (world + 1) / 2f && sum[1] == 10 * sum[0], "all-reduce sums: " + sum[0] + ", " + sum[1]);
        pg.broadcast(t, 0);
        expect(t.toArray()[2] == 7, "broadcast from rank 0");
        pg.barrier();
      }

      // A hook that throws: finishBackward rethrows it on every rank.
      CommHook throwing = new CommHook() {
        @Override
        public void reduce(ProcessGroup group, long bucketIndex, Tensor bucket) {
          throw new UnsupportedOperationException("hook refused bucket " + bucketIndex);
        }
      };
      try (Ddp bad = new Ddp(model, pg, options, throwing)) {
        bad.preForward();
        for (int l = LAYERS - 1; l >= 0; --l) {
          bad.markGradReady(weightName(l));
          bad.markGradReady(biasName(l));
        }
        try {
          bad.finishBackward();
          fail("finishBackward returned although the hook threw");
        } catch (UnsupportedOperationException e) {
          expect(e.getMessage().startsWith("hook refused bucket"), "the hook's own exception surfaces: " + e);
          System.out.println("rank " + rank + ": finishBackward rethrew: " + e);
        }
      }
    }
  }

  public static void main(String[] args) throws Exception {
    String mode = args.length > 0 ? args[0] : "";
    switch (mode) {
      case "data-parallel":
        dataParallel();
        break;
      case "forward-throws":
        forwardThrows();
        break;
      case "bad-argument":
        badArgument();
        break;
      case "ddp":
        ddp();
        break;
      case "store":
        store();
        break;
      case "view-outlives-tensor":
        viewOutlivesTensor();
        break;
      case "closed-handles":
        closedHandles();
        break;
      default:
        fail("usage: DParallelTest data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles|ddp");
    }
    System.gc();
    System.out.println("OK " + mode);
  }
}
