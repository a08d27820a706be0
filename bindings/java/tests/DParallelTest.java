// Trains a small tanh MLP with its forward and backward written in Java, on
// two logical CPU devices (replica sets, dataParallel, parallelApply) or one
// process per rank under dp-run (DDP, with the default and a Java comm
// hook), and checks parity with plain single-device training. Also pins
// that exceptions thrown in callbacks surface in the caller, that bad
// arguments raise DParallelException naming the argument, that zero-copy
// views keep the tensor's memory alive after the tensor is closed or
// collected, that every handle answers isClosed() after close(), and that
// close() racing calls on other threads never crashes (close-races). The
// rest: DLPack, tensors over direct buffers, coalesced collectives, memory
// stats and shutdown (tensors); streams and host functions (streams); the
// process group's collectives on shm and Gloo (collectives); DDP with
// uneven inputs and join (join); the optimizer inside backward, gradients
// in the host's own buffers, static graphs, parameterUsed, bucket plans and
// stats (ddp-extras); fully_shard against single-process training and its
// state dicts, with copies (fsdp) and with views of the shards (fsdp-views).
//
//   java -cp dparallel.jar:. DParallelTest data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles|close-races|tensors|streams
//   dp-run -n 2 java -cp dparallel.jar:. DParallelTest ddp|collectives|join|ddp-extras|fsdp|fsdp-views
import java.io.IOException;
import java.lang.ref.PhantomReference;
import java.lang.ref.Reference;
import java.lang.ref.ReferenceQueue;
import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.lang.ref.WeakReference;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
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

  // ---- close() racing calls on other threads ----

  /** A call on a closed object: DParallelException, Status.STATE, saying it is closed. */
  static boolean isClosedError(Throwable e) {
    return e instanceof DParallelException && ((DParallelException) e).getCode() == Status.STATE
        && e.getMessage().contains("closed");
  }

  /** `rounds` times: `callers` threads call `use` on a new object from `make` until it is closed, while this
   * thread closes it once every caller has made a call. Nothing crashes; a call racing close() either
   * completes or throws the closed error, and every call that starts after close() returned throws it. */
  static <T extends AutoCloseable> void raceClose(String what, int rounds, int callers,
                                                  java.util.function.Supplier<T> make,
                                                  java.util.function.Consumer<T> use) throws Exception {
    for (int round = 0; round < rounds; ++round) {
      T handle = make.get();
      java.util.concurrent.CountDownLatch called = new java.util.concurrent.CountDownLatch(callers);
      java.util.concurrent.atomic.AtomicBoolean closed = new java.util.concurrent.atomic.AtomicBoolean();
      java.util.concurrent.atomic.AtomicReference<Throwable> wrong = new java.util.concurrent.atomic.AtomicReference<>();
      Thread[] threads = new Thread[callers];
      for (int i = 0; i < callers; ++i) {
        threads[i] = new Thread(() -> {
          boolean counted = false;
          try {
            while (true) {
              boolean afterClose = closed.get();
              try {
                use.accept(handle);
              } catch (RuntimeException e) {
                if (!isClosedError(e)) wrong.compareAndSet(null, e);
                return;
              }
              if (afterClose) {
                wrong.compareAndSet(null, new AssertionError("a call that started after close() returned"));
                return;
              }
              if (!counted) {
                counted = true;
                called.countDown();
              }
            }
          } catch (Throwable t) {
            wrong.compareAndSet(null, t);
          } finally {
            if (!counted) called.countDown();
          }
        });
        threads[i].start();
      }
      called.await();
      handle.close();
      closed.set(true);
      for (Thread t : threads) t.join();
      if (wrong.get() != null) {
        wrong.get().printStackTrace();
        fail(what + ", round " + round + ": a caller racing close() got " + wrong.get());
      }
      try {
        use.accept(handle);
        fail(what + ": a call after close() returned");
      } catch (RuntimeException e) {
        expect(isClosedError(e), what + ": a call after close() is the closed error, not " + e);
      }
    }
    System.out.println(what + ": close() raced calls on " + callers + " threads " + rounds + " times");
  }

  /** A forward that closes the replica set running it. */
  static class ClosesItsSet extends ForwardFunction {
    ReplicaSet set;

    @Override
    public Tensor forward(long index, Module replica, Tensor input, Device device) {
      set.close();
      return input;
    }
  }

  static void closeRaces() throws Exception {
    Device cpu0 = new Device("cpu:0");
    DeviceList devices = Device.list("cpu:0,cpu:1");
    // The thousand-round race, on the cheapest handle, then every other kind.
    raceClose("Tensor", 1000, 3, () -> Tensor.of(new float[] {1, 2, 3, 4}, 4), t -> {
      float[] out = new float[4];
      t.copyTo(out);
      if (t.numel() != 4 || out[3] != 4) throw new AssertionError("a racing call read wrong values");
    });
    raceClose("Module", 300, 3, DParallelTest::buildModel, m -> {
      if (m.numParameters() != 2 * LAYERS) throw new AssertionError("a racing call saw the wrong parameters");
      m.getParameter("fc0.bias").close();
    });
    try (Tensor input = Tensor.of(new float[] {1, 2, 3, 4}, 4); Module model = buildModel();
         Tensor grad = Tensor.of(new float[] {1, 2}, 2)) {
      raceClose("TensorList", 100, 3, () -> Parallel.scatter(input, devices, 0), l -> l.get(1).close());
      raceClose("ModuleList", 50, 3, () -> Parallel.replicate(model, devices, false), l -> l.get(1).close());
      raceClose("ReplicaSet", 50, 3, () -> new ReplicaSet(model, devices), ReplicaSet::sync);
      raceClose("DeviceStream", 100, 3, () -> new DeviceStream(cpu0), DeviceStream::synchronize);
      raceClose("Store", 30, 3, () -> Store.tcp("127.0.0.1", 0, 1, true, 10000), s -> s.add("k", 1));
      try (Store store = Store.tcp("127.0.0.1", 0, 1, true, 10000)) {
        // Collectives are one thread's at a time; the group's reads are anyone's.
        raceClose("ProcessGroup", 30, 3, () -> ProcessGroup.create(store, 0, 1, cpu0, 10000), pg -> {
          if (pg.rank() != 0 || pg.size() != 1) throw new AssertionError("a racing call read the wrong rank");
        });
        try (ProcessGroup pg = ProcessGroup.create(store, 0, 1, cpu0, 10000)) {
          raceClose("Work", 100, 3, () -> pg.allReduceAsync(grad, ReduceOp.SUM), Work::waitFor);
          raceClose("Ddp", 50, 3, () -> new Ddp(model, pg, new DdpOptions()), d -> d.lastStats());
          try (Module plain = buildModel()) {
            raceClose("Fsdp", 30, 3, () -> new Fsdp(plain, pg), f -> f.parameterName(0));
          }
        }
      }
      // A handle argument closed under a call: the call holds it too.
      raceClose("Tensor as an argument", 300, 3, () -> Tensor.of(new float[] {1, 2}, 2), t -> {
        try (Module m = new Module()) {
          m.registerParameter("w", t);
        }
      });
      // Inside a callback, closing the object whose call runs it would wait for itself: refused instead.
      try (ReplicaSet set = new ReplicaSet(model, devices)) {
        ClosesItsSet fn = new ClosesItsSet();
        fn.set = set;
        try (Tensor in = Tensor.of(new float[] {1, 2, 3, 4}, 4, 1)) {
          set.apply(in, 0, cpu0, fn).close();
          fail("close() inside the set's own forward returned");
        } catch (DParallelException e) {
          expect(e.getCode() == Status.STATE && e.getMessage().contains("inside a callback"),
                 "close() inside the forward of the object's own call is Status.STATE: " + e.getMessage());
        }
        expect(!set.isClosed(), "the refused close() leaves the set open");
        set.sync();
      }
    }
    System.out.println("close() racing calls never crashed; calls after it threw the closed error");
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
    // Nor does it pass as null, an empty slot, when it is an argument: the
    // gradient stays.
    try (Module m = new Module(); Tensor w = Tensor.of(new float[] {1, 2}, 2)) {
      m.registerParameter("w", w);
      try (Tensor g = m.grad("w")) {
        g.copyFrom(new float[] {9, 9});
      }
      try {
        m.setGrad("w", closed);
        fail("setGrad took a closed tensor");
      } catch (DParallelException e) {
        expect(e.getCode() == Status.STATE && e.getMessage().contains("'grad' is closed"), e.getMessage());
      }
      try (Tensor g = m.grad("w")) {
        expect(g.toArray()[0] == 9, "the gradient stayed: " + g.toArray()[0]);
      }
    }
    expectInvalid(() -> Parallel.reduceAddCoalesced(null, 2, new Device()).close(), "'inputs' is null");
    try (Module m = new Module()) {
      expectInvalid(() -> m.grad(null).close(), "'dottedName' is null");
    }
    // A buffer in the JVM's default (big-endian) order would be read byte-swapped.
    expectInvalid(() -> Tensor.fromBuffer(java.nio.ByteBuffer.allocateDirect(8), DType.FLOAT32, 2).close(), "'buffer'");
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

  // ---- tensors: DLPack, host buffers, coalesced collectives, memory, shutdown ----

  static void expectValues(String what, float[] got, float[] want) {
    expect(Arrays.equals(got, want), what + ": " + Arrays.toString(got) + ", not " + Arrays.toString(want));
  }

  /** A tensor over a fresh direct buffer, registered in `m`; only the module refers to it afterwards. */
  static WeakReference<ByteBuffer> parameterOverDroppedBuffer(Module m, float[] values) {
    ByteBuffer buf = ByteBuffer.allocateDirect(values.length * 4).order(ByteOrder.nativeOrder());
    buf.asFloatBuffer().put(values);
    try (Tensor t = Tensor.fromBuffer(buf, DType.FLOAT32, values.length)) {
      m.registerParameter("w", t);
    }
    return new WeakReference<>(buf);
  }

  static void collect(int rounds) throws InterruptedException {
    for (int i = 0; i < rounds; ++i) {
      System.gc();
      byte[][] pressure = new byte[32][];
      for (int k = 0; k < pressure.length; ++k) pressure[k] = new byte[1 << 16];
      Thread.sleep(10);
    }
  }

  static void tensors() throws InterruptedException {
    expect(DType.elementSize(DType.FLOAT32) == 4 && DType.elementSize(DType.BFLOAT16) == 2
               && DType.elementSize(DType.INT64) == 8 && DType.elementSize(DType.BOOL) == 1,
           "DType.elementSize gives the bytes per element");
    expectInvalid(() -> DType.elementSize(99), "'dtype'");

    // DLPack: out and back in, the same memory.
    float[] v = distinctValues(6, 3);
    Tensor t = Tensor.of(v, 2, 3);
    long address = t.toDlpack();
    expect(address != 0, "toDlpack gives an address");
    Tensor u = Tensor.fromDlpack(address);
    expect(Arrays.equals(u.shapeArray(), new long[] {2, 3}) && u.dtype() == DType.FLOAT32, "the DLPack tensor keeps shape and dtype");
    expectValues("the DLPack tensor's values", u.toArray(), v);
    t.floats().put(4, 42f);
    expect(u.toArray()[4] == 42f, "a write through the original is seen through the DLPack tensor: zero copy");
    t.close();
    v[4] = 42f;
    expectValues("the DLPack tensor after the original is closed", u.toArray(), v);
    u.close();
    try (Tensor w = Tensor.of(v, 6)) {
      Tensor.deleteDlpack(w.toDlpack());
      expectValues("a tensor whose export was deleted", w.toArray(), v);
    }
    expectInvalid(() -> Tensor.fromDlpack(0), "'address'");
    // DLPack 1.x: in place, or copied when exported read-only.
    try (Tensor x = Tensor.of(v, 2, 3)) {
      try (Tensor inPlace = Tensor.fromDlpackVersioned(x.toDlpackVersioned(false));
           Tensor copied = Tensor.fromDlpackVersioned(x.toDlpackVersioned(true))) {
        x.floats().put(0, 17f);
        expect(inPlace.toArray()[0] == 17f, "a versioned DLPack tensor shares the original's memory");
        expect(copied.toArray()[0] == v[0], "a read-only versioned DLPack tensor is a copy");
      }
      Tensor.deleteDlpackVersioned(x.toDlpackVersioned(true));
    }
    expectInvalid(() -> Tensor.fromDlpackVersioned(0), "'address'");

    // A tensor over a direct buffer: both see each other's writes.
    ByteBuffer buf = ByteBuffer.allocateDirect(6 * 4).order(ByteOrder.nativeOrder());
    try (Tensor b = Tensor.fromBuffer(buf, DType.FLOAT32, 2, 3)) {
      buf.asFloatBuffer().put(new float[] {1, 2, 3, 4, 5, 6});
      expectValues("the tensor over the buffer", b.toArray(), new float[] {1, 2, 3, 4, 5, 6});
      b.copyFrom(new float[] {6, 5, 4, 3, 2, 1});
      expect(buf.getFloat(0) == 6 && buf.getFloat(20) == 1, "the buffer holds what was copied into the tensor");
    }
    expectInvalid(() -> Tensor.fromBuffer(ByteBuffer.allocate(24), DType.FLOAT32, 6).close(), "'buffer'");
    expectInvalid(() -> Tensor.fromBuffer(ByteBuffer.allocateDirect(8), DType.FLOAT32, 6).close(), "'buffer'");
    expectInvalid(() -> Tensor.fromBuffer(ByteBuffer.allocateDirect(8).asReadOnlyBuffer(), DType.FLOAT32, 2).close(), "'buffer'");
    // The module keeps the buffer alive; closing the module lets it go. 4 MiB: freed memory is unmapped.
    float[] big = distinctValues(1 << 20, 1);
    Module m = new Module();
    WeakReference<ByteBuffer> weak = parameterOverDroppedBuffer(m, big);
    collect(5);
    expect(weak.get() != null, "the module's parameter keeps its direct buffer reachable");
    expectValues("the parameter over a dropped buffer", read(m, "w"), big);
    m.close();
    long deadline = System.nanoTime() + 30_000_000_000L;
    while (weak.get() != null) {
      expect(System.nanoTime() < deadline, "the buffer is collected once no tensor is over it");
      collect(1);
    }
    System.out.println("DLPack round trip and tensors over direct buffers share memory");

    // Coalesced collectives across cpu:0 and cpu:1.
    DeviceList devices = Device.list("cpu:0,cpu:1");
    Device cpu0 = new Device("cpu:0");
    try (Tensor x = Tensor.of(new float[] {1, 2, 3}, 3); Tensor y = Tensor.of(new float[] {4, 5}, 2)) {
      TensorVector both = new TensorVector();
      both.add(x);
      both.add(y);
      try (TensorList copies = Parallel.broadcastCoalesced(both, devices, 0); Tensor x1 = copies.get(2); Tensor y1 = copies.get(3)) {
        expect(copies.size() == 4, "broadcastCoalesced gives devices x tensors outputs, not " + copies.size());
        expect(x1.device().toString().equals("cpu:1"), "item 2 is tensor 0 on cpu:1");
        expectValues("tensor 0 on cpu:1", x1.toArray(), new float[] {1, 2, 3});
        expectValues("tensor 1 on cpu:1", y1.toArray(), new float[] {4, 5});
        TensorVector inputs = new TensorVector();
        inputs.add(x);
        inputs.add(y);
        inputs.add(x1);
        inputs.add(y1);
        try (TensorList sums = Parallel.reduceAddCoalesced(inputs, 2, cpu0, 0); Tensor sx = sums.get(0); Tensor sy = sums.get(1)) {
          expect(sums.size() == 2, "reduceAddCoalesced gives one sum per tensor");
          expectValues("the sum of tensor 0", sx.toArray(), new float[] {2, 4, 6});
          expectValues("the sum of tensor 1", sy.toArray(), new float[] {8, 10});
        }
        inputs.remove(3);
        expectInvalid(() -> Parallel.reduceAddCoalesced(inputs, 2, cpu0, 0).close(), "'inputs'");
      }
    }

    // Buffers by index.
    try (Module model = new Module(); Module child = new Module(); Tensor mean = Tensor.of(new float[] {7, 8}, 2)) {
      child.registerBuffer("running_mean", mean);
      model.registerModule("bn", child);
      expect(model.numBuffers() == 1 && model.bufferName(0).equals("bn.running_mean"), "buffer 0 is bn.running_mean");
      try (Tensor b0 = model.buffer(0)) {
        expectValues("buffer 0", b0.toArray(), new float[] {7, 8});
      }
      expectInvalid(() -> model.buffer(1).close(), "1");
    }

    // Memory stats count a 4 MiB tensor.
    final long bytes = 4L << 20;
    MemoryStats before = cpu0.memoryStats();
    Tensor held = new Tensor(cpu0, bytes / 4);
    MemoryStats during = cpu0.memoryStats();
    expect(during.allocatedBytes() - before.allocatedBytes() >= bytes, "allocatedBytes counts the new tensor: "
                                                                          + before.allocatedBytes() + " -> " + during.allocatedBytes());
    expect(during.peakAllocatedBytes() >= during.allocatedBytes(), "the peak is at least what is in use");
    held.close();
    MemoryStats after = cpu0.memoryStats();
    expect(after.allocatedBytes() <= during.allocatedBytes() - bytes, "closing the tensor gives its bytes back");
    expect(after.peakAllocatedBytes() >= during.allocatedBytes(), "the peak remembers the tensor");
    cpu0.resetPeakMemory();
    MemoryStats reset = cpu0.memoryStats();
    expect(reset.peakAllocatedBytes() < during.allocatedBytes(), "resetPeakMemory forgets the tensor");
    System.out.printf("memory: %d -> %d -> %d bytes allocated%n", before.allocatedBytes(), during.allocatedBytes(), after.allocatedBytes());

    // Shutdown ends the library's threads; they start again when needed.
    Library.shutdown();
    Library.shutdown();
    try (Tensor x = Tensor.of(new float[] {1, 2}, 2); TensorList copies = Parallel.broadcast(x, devices); Tensor c = copies.get(1)) {
      expectValues("a copy to cpu:1 after shutdown", c.toArray(), new float[] {1, 2});
    }
  }

  // ---- streams ----

  static void streams() {
    Device cpu0 = new Device("cpu:0");
    expect(DeviceStream.current(cpu0) == null, "no current stream at first");
    DeviceStream s = new DeviceStream(cpu0);
    expect(s.pointer() != 0 && s.device().toString().equals("cpu:0"), "a new cpu stream");
    List<Integer> seen = Collections.synchronizedList(new ArrayList<>());
    Thread caller = Thread.currentThread();
    Thread[] ranOn = new Thread[1];
    s.launchHostFunc(() -> seen.add(1));
    s.launchHostFunc(() -> {
      seen.add(2);
      ranOn[0] = Thread.currentThread();
    });
    s.synchronize();
    expect(seen.equals(Arrays.asList(1, 2)), "host functions ran in order: " + seen);
    expect(ranOn[0] != null && ranOn[0] != caller, "a host function runs on the stream's thread");
    s.launchHostFunc(() -> {
      throw new IllegalStateException("host function failed");
    });
    try {
      s.synchronize();
      fail("synchronize returned although a host function threw");
    } catch (IllegalStateException e) {
      expect(e.getMessage().equals("host function failed"), "the host function's exception surfaces: " + e);
    }
    s.synchronize();
    s.makeCurrent();
    try (DeviceStream current = DeviceStream.current(cpu0)) {
      expect(current != null && current.pointer() == s.pointer(), "makeCurrent makes it this thread's current stream");
    }
    try (Tensor t = Tensor.of(new float[] {1, 2, 3}, 3); Tensor copy = t.to(cpu0)) {
      s.synchronize();
      expectValues("a copy queued on the current stream", copy.toArray(), new float[] {1, 2, 3});
    }
    DeviceStream.clearCurrent(cpu0);
    expect(DeviceStream.current(cpu0) == null, "clearCurrent leaves no current stream");
    DeviceStream wrapped = DeviceStream.wrap(cpu0, s.pointer());
    wrapped.close();
    s.synchronize();  // closing a wrapped stream leaves the stream be
    expectInvalid(() -> s.launchHostFunc(null), "'fn'");
    s.close();
    expect(s.isClosed(), "a closed stream says so");
    try {
      s.synchronize();
      fail("synchronize on a closed stream returned");
    } catch (DParallelException e) {
      expect(e.getCode() == Status.STATE, "a closed stream is Status.STATE");
    }
    System.out.println("streams: host functions, current streams, wrapped streams");
  }

  // ---- the process group's collectives ----

  static void runCollectives(ProcessGroup pg) {
    int rank = pg.rank(), world = pg.size();
    try (Tensor in = Tensor.of(new float[] {rank + 1, 10 * (rank + 1)}, 2)) {
      List<Tensor> outs = new ArrayList<>();
      TensorVector tv = new TensorVector();
      for (int r = 0; r < world; ++r) {
        outs.add(new Tensor(2));
        tv.add(outs.get(r));
      }
      pg.allGather(in, tv);
      for (int r = 0; r < world; ++r) expectValues(pg.backend() + " allGather output " + r, outs.get(r).toArray(), new float[] {r + 1, 10 * (r + 1)});
      for (Tensor o : outs) o.copyFrom(new float[] {0, 0});
      try (Work w = pg.allGatherAsync(in, tv)) {
        w.waitFor();
      }
      for (int r = 0; r < world; ++r) expectValues(pg.backend() + " allGatherAsync output " + r, outs.get(r).toArray(), new float[] {r + 1, 10 * (r + 1)});
      for (Tensor o : outs) o.close();
    }
    // Rank r's input j holds 100 r + j: output = sum over r of (100 r + rank).
    List<Tensor> ins = new ArrayList<>();
    TensorVector iv = new TensorVector();
    for (int j = 0; j < world; ++j) {
      ins.add(Tensor.of(new float[] {100 * rank + j, 1}, 2));
      iv.add(ins.get(j));
    }
    float want = 0;
    for (int r = 0; r < world; ++r) want += 100 * r + rank;
    try (Tensor out = new Tensor(2)) {
      pg.reduceScatter(iv, out, ReduceOp.SUM);
      expectValues(pg.backend() + " reduceScatter", out.toArray(), new float[] {want, world});
      out.copyFrom(new float[] {0, 0});
      try (Work w = pg.reduceScatterAsync(iv, out, ReduceOp.MAX)) {
        w.waitFor();
      }
      expectValues(pg.backend() + " reduceScatterAsync max", out.toArray(), new float[] {100 * (world - 1) + rank, 1});
    }
    for (Tensor t : ins) t.close();
    try (Tensor t = Tensor.of(new float[] {rank, -rank}, 2)) {
      try (Work w = pg.broadcastAsync(t, world - 1)) {
        w.waitFor();
        expect(w.test(), "the broadcast is done after waitFor");
      }
      expectValues(pg.backend() + " broadcastAsync from the last rank", t.toArray(), new float[] {world - 1, 1 - world});
    }
    try (Work w = pg.barrierAsync()) {
      w.waitFor();
    }
    try (Tensor in = new Tensor(2)) {
      TensorVector one = new TensorVector();
      one.add(in);
      expectInvalid(() -> pg.allGather(in, one), "'noutputs'");
    }
  }

  static void collectives() {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000)) {
      int rank = pg.rank(), world = pg.size();
      runCollectives(pg);
      // A second group over a file store, asking for Gloo.
      String path = System.getProperty("java.io.tmpdir") + "/dparallel-java-gloo-" + System.getenv("MASTER_PORT");
      if (rank == 0) new java.io.File(path).delete();
      pg.barrier();
      try (Store store = Store.file(path, world); ProcessGroup gloo = ProcessGroup.create(store, rank, world, cpu0, 60000, Backend.GLOO)) {
        expect(gloo.backend().equals("gloo"), "Backend.GLOO runs gloo, not " + gloo.backend());
        runCollectives(gloo);
      }
      System.out.println("rank " + rank + ": collectives on " + pg.backend() + " and gloo");
    }
  }

  // ---- DDP additions, on a flat module of three parameters ----

  static final String[] FLAT = {"a", "b", "c"};
  static final int[] FLAT_NUMEL = {4, 3, 2};
  static final float FLAT_LR = 0.25f;

  static Module flatModule() {
    Module m = new Module();
    for (int p = 0; p < FLAT.length; ++p) {
      float[] v = new float[FLAT_NUMEL[p]];
      for (int k = 0; k < v.length; ++k) v[k] = k;
      try (Tensor t = Tensor.of(v, v.length)) {
        m.registerParameter(FLAT[p], t);
      }
    }
    return m;
  }

  static DdpOptions bucketPerParameter() {
    DdpOptions o = new DdpOptions();
    o.setBucketCapMb(4 / 1048576.0);
    o.setFirstBucketCapMb(4 / 1048576.0);
    return o;
  }

  static float[] flatParams(Module m) {
    float[] out = new float[9];
    int at = 0;
    for (String name : FLAT) {
      float[] v = read(m, name);
      System.arraycopy(v, 0, out, at, v.length);
      at += v.length;
    }
    return out;
  }

  static void setFlatGrad(Module m, int p, float[] values) {
    try (Tensor g = m.grad(FLAT[p])) {
      g.copyFrom(values);
    }
  }

  static void sgdParameter(Module m, int p, float[] grad) {
    try (Tensor w = m.getParameter(FLAT[p])) {
      FloatBuffer wv = w.floats();
      for (int k = 0; k < grad.length; ++k) wv.put(k, wv.get(k) - FLAT_LR * grad[k]);
    }
  }

  static float joinGrad(int r, int i, int p, int k) {
    return (r + 1) * (i + 2) + p + k;
  }

  /** Each iteration i averages (over the initial world size) the gradients of the ranks with more than i
   * batches; in the end every rank holds what the rank with the most batches holds. */
  static float[] joinReference(int[] batches) {
    int world = batches.length, most = 0;
    for (int b : batches) most = Math.max(most, b);
    float[] out = new float[9];
    int at = 0;
    for (int p = 0; p < 3; ++p) {
      for (int k = 0; k < FLAT_NUMEL[p]; ++k) {
        double value = k;
        for (int i = 0; i < most; ++i) {
          double sum = 0;
          for (int r = 0; r < world; ++r) {
            if (batches[r] > i) sum += joinGrad(r, i, p, k);
          }
          value -= FLAT_LR * sum / world;
        }
        out[at++] = (float) value;
      }
    }
    return out;
  }

  /** Rank 0 has more batches than the others, which join once theirs run out. */
  static void join() {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000); Module m = flatModule()) {
      int rank = pg.rank(), world = pg.size();
      int[] batches = new int[world];
      for (int r = 0; r < world; ++r) batches[r] = r == 0 ? 4 : 2;
      try (Ddp ddp = new Ddp(m, pg, bucketPerParameter())) {
        for (int i = 0; i < batches[rank]; ++i) {
          ddp.preForward();
          for (int p = 0; p < 3; ++p) {
            float[] g = new float[FLAT_NUMEL[p]];
            for (int k = 0; k < g.length; ++k) g[k] = joinGrad(rank, i, p, k);
            setFlatGrad(m, p, g);
          }
          for (String name : new String[] {"c", "b", "a"}) ddp.markGradReady(name);
          ddp.finishBackward();
          for (int p = 0; p < 3; ++p) {
            try (Tensor g = m.grad(FLAT[p])) {
              sgdParameter(m, p, g.toArray());
            }
          }
        }
        Ddp.join(ddp);
      }
      float[] got = flatParams(m), want = joinReference(batches);
      for (int k = 0; k < want.length; ++k) {
        expect(Math.abs(got[k] - want[k]) <= 1e-5f * (1 + Math.abs(want[k])),
               "rank " + rank + " value " + k + " is " + got[k] + " after join, expected " + want[k]);
      }
      // Every rank holds the same parameters.
      try (Tensor mine = Tensor.of(got, got.length)) {
        List<Tensor> outs = new ArrayList<>();
        TensorVector tv = new TensorVector();
        for (int r = 0; r < world; ++r) {
          outs.add(new Tensor(got.length));
          tv.add(outs.get(r));
        }
        pg.allGather(mine, tv);
        for (int r = 0; r < world; ++r) expectValues("rank " + r + "'s parameters after join", outs.get(r).toArray(), got);
        for (Tensor o : outs) o.close();
      }
      System.out.println("rank " + rank + ": " + batches[rank] + " batches, joined: " + Arrays.toString(got));
    }
  }

  static final int INSIDE = 0, AFTER = 1, HOST_BUFFERS = 2, STATIC = 3;

  /** Four iterations (the second without sync) of the flat module under `mode`: SGD inside backward
   * (onBucketReduced), after finishBackward, after finishBackward with the gradients in the host's own direct
   * buffers (setGrad) marked on a cpu stream, or after finishBackward with a static graph. */
  static float[] trainFlat(ProcessGroup pg, int mode) {
    int rank = pg.rank();
    Device cpu0 = new Device("cpu:0");
    try (Module m = flatModule(); DeviceStream stream = new DeviceStream(cpu0)) {
      DdpOptions o = bucketPerParameter();
      int[] reported = new int[3];
      boolean[] allUsed = {true};
      if (mode == INSIDE) {
        o.setOnBucketReduced(new BucketReduced() {
          @Override
          public void reduced(Ddp ddp, long bucketIndex, long[] parameters) {
            for (long p : parameters) {
              ++reported[(int) p];
              allUsed[0] &= ddp.parameterUsed(p);
              try (Tensor g = m.grad(FLAT[(int) p])) {
                sgdParameter(m, (int) p, g.toArray());
              }
            }
          }
        });
      }
      o.setStaticGraph(mode == STATIC);
      ByteBuffer[] host = new ByteBuffer[3];
      if (mode == HOST_BUFFERS) {
        for (int p = 0; p < 3; ++p) {
          host[p] = ByteBuffer.allocateDirect(4 * FLAT_NUMEL[p]).order(ByteOrder.nativeOrder());
          try (Tensor g = Tensor.fromBuffer(host[p], DType.FLOAT32, FLAT_NUMEL[p])) {
            m.setGrad(FLAT[p], g);
          }
        }
      }
      try (Ddp ddp = new Ddp(m, pg, o)) {
        for (int it = 0; it < 4; ++it) {
          boolean synced = it != 1;
          ddp.setRequiresGradientSync(synced);
          ddp.preForward();
          for (int p = 0; p < 3; ++p) {
            float[] g = new float[FLAT_NUMEL[p]];
            for (int k = 0; k < g.length; ++k) g[k] = (rank + 1) * (it + 1) + p + 0.5f * k;
            if (mode == HOST_BUFFERS) {
              host[p].asFloatBuffer().put(g);
            } else {
              setFlatGrad(m, p, g);
            }
          }
          for (int p = 2; p >= 0; --p) {
            if (mode == HOST_BUFFERS) {
              ddp.markGradReady(p, stream);
            } else {
              ddp.markGradReady(FLAT[p]);
            }
          }
          ddp.finishBackward();
          if (mode == INSIDE || !synced) continue;
          for (int p = 0; p < 3; ++p) {
            float[] g;
            try (Tensor gt = m.grad(FLAT[p])) {
              g = gt.toArray();
            }
            if (mode == HOST_BUFFERS) {
              float[] own = new float[FLAT_NUMEL[p]];
              host[p].asFloatBuffer().get(own);
              expectValues("the averaged gradient in the host's own buffer", own, g);
            }
            sgdParameter(m, p, g);
          }
        }
        if (mode == INSIDE) {
          expect(Arrays.equals(reported, new int[] {3, 3, 3}), "each parameter reported once per synced iteration: " + Arrays.toString(reported));
          expect(allUsed[0], "every parameter counts as used without findUnusedParameters");
        }
        DdpStats stats = ddp.lastStats();
        expect(stats.numBuckets() == ddp.numBuckets() && ddp.numBuckets() == 3, "the stats' bucket count is the plan's: " + stats.numBuckets());
        expect(stats.backwardMs() >= 0 && stats.reduceMs() >= 0 && stats.exposedMs() >= 0
                   && stats.exposedMs() <= stats.reduceMs(), "the stats' times are consistent");
      }
      if (mode == HOST_BUFFERS) {
        m.zeroGrad();
        expect(host[0].getFloat(0) == 0 && host[2].getFloat(4) == 0, "zeroGrad writes the host's own buffers");
      }
      return flatParams(m);
    }
  }

  static void ddpExtras() {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000)) {
      int rank = pg.rank();
      // The optimizer inside backward matches the step after finishBackward, as do gradients in the host's
      // own buffers and a static graph.
      float[] inside = trainFlat(pg, INSIDE), after = trainFlat(pg, AFTER);
      float[] hostBuffers = trainFlat(pg, HOST_BUFFERS), staticGraph = trainFlat(pg, STATIC);
      expectValues("SGD inside backward against after finishBackward", inside, after);
      expectValues("gradients in the host's buffers against the module's", hostBuffers, after);
      expectValues("a static graph against a dynamic one", staticGraph, after);
      try (Module fresh = flatModule()) {
        expect(!Arrays.equals(after, flatParams(fresh)), "the steps moved the parameters");
      }

      // parameterUsed: "c" is marked on no rank.
      try (Module m = flatModule()) {
        DdpOptions o = bucketPerParameter();
        o.setFindUnusedParameters(true);
        try (Ddp ddp = new Ddp(m, pg, o)) {
          try {
            ddp.parameterUsed(0);
            fail("parameterUsed before any iteration returned");
          } catch (DParallelException e) {
            expect(e.getCode() == Status.STATE, "parameterUsed before any iteration is Status.STATE: " + e.getMessage());
          }
          setFlatGrad(m, 0, new float[] {1, 1, 1, 1});
          setFlatGrad(m, 1, new float[] {1, 1, 1});
          ddp.markGradReady("b");
          ddp.markGradReady("a");
          ddp.finishBackward();
          expect(ddp.parameterUsed(0) && ddp.parameterUsed(1) && !ddp.parameterUsed(2), "a and b are used, c is not");
          expectInvalid(() -> ddp.parameterUsed(3), "3");
        }
      }

      // The plan's text, fed back through the option, gives the same plan.
      try (Module m = flatModule()) {
        String plan;
        long[][] buckets = new long[3][];
        try (Ddp ddp = new Ddp(m, pg, bucketPerParameter())) {
          for (int p = 2; p >= 0; --p) ddp.markGradReady(FLAT[p]);
          ddp.finishBackward();
          plan = ddp.bucketPlan();
          for (int b = 0; b < 3; ++b) buckets[b] = ddp.bucketParameterArray(b);
        }
        expect(plan.contains("bucket float32"), "the plan lists float32 buckets: " + plan);
        DdpOptions o = new DdpOptions();  // default caps: the plan alone makes the 3 buckets
        o.setBucketPlan(plan);
        try (Ddp ddp = new Ddp(m, pg, o)) {
          expect(ddp.bucketPlan().equals(plan), "the plan fed back is the plan: " + ddp.bucketPlan());
          expect(ddp.numBuckets() == 3, "the plan fed back has 3 buckets");
          for (int b = 0; b < 3; ++b) expect(Arrays.equals(ddp.bucketParameterArray(b), buckets[b]), "bucket " + b + " keeps its parameters");
        }
        o.setBucketPlan("bucket float32 a b nope\n");
        expectInvalid(() -> new Ddp(m, pg, o).close(), "nope");
      }

      // The callback's exception surfaces in finishBackward, the library's Status.USER attached.
      try (Module m = flatModule()) {
        DdpOptions o = bucketPerParameter();
        o.setOnBucketReduced(new BucketReduced() {
          @Override
          public void reduced(Ddp ddp, long bucketIndex, long[] parameters) throws IOException {
            throw new IOException("step failed in bucket " + bucketIndex);
          }
        });
        try (Ddp ddp = new Ddp(m, pg, o)) {
          for (int p = 2; p >= 0; --p) ddp.markGradReady(FLAT[p]);
          try {
            ddp.finishBackward();
            fail("finishBackward returned although onBucketReduced threw");
          } catch (Exception e) {
            expect(e instanceof IOException && e.getMessage().startsWith("step failed in bucket"), "the callback's own exception surfaces: " + e);
            expect(e.getSuppressed().length == 1 && ((DParallelException) e.getSuppressed()[0]).getCode() == Status.USER,
                   "the library's Status.USER is attached to it");
          }
        }
      }

      // rebind: each rank goes on over a group of its own (split by rank), the plan kept; the average
      // over one rank is its own gradient.
      try (Module m = flatModule(); Ddp ddp = new Ddp(m, pg, bucketPerParameter())) {
        for (int p = 2; p >= 0; --p) ddp.markGradReady(FLAT[p]);
        ddp.finishBackward();
        String plan = ddp.bucketPlan();
        try (ProcessGroup alone = pg.split(rank, 0)) {
          ddp.rebind(alone);
        }
        expect(ddp.bucketPlan().equals(plan), "rebind keeps the plan: " + ddp.bucketPlan());
        for (int p = 0; p < FLAT.length; ++p) {
          float[] own = new float[FLAT_NUMEL[p]];
          Arrays.fill(own, rank + p + 0.5f);
          setFlatGrad(m, p, own);
          ddp.markGradReady(FLAT[p]);
        }
        ddp.finishBackward();
        for (int p = 0; p < FLAT.length; ++p) {
          float[] own = new float[FLAT_NUMEL[p]];
          Arrays.fill(own, rank + p + 0.5f);
          try (Tensor g = m.grad(FLAT[p])) {
            expectValues("gradient " + FLAT[p] + " after the rebind onto a group of one", g.toArray(), own);
          }
        }
      }
      System.out.println("rank " + rank + ": optimizer inside backward, host buffers, static graph, parameterUsed, plans, rebind");
    }
  }

  // ---- fully_shard: 3 x Linear(3, 3) in `linears` (each sharded, then
  // the whole), `proj` under a Ddp; SGD on the shards ----

  static final int DIM = 3, FROWS = 4, FSTEPS = 4;
  static final double FLR = 0.2;
  static final String[] F_WEIGHTS = {"linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight"};

  static float fInitial(int layer, int k, float skew) {
    return 0.3f * (float) Math.sin(1.7f * (layer * 9 + k) + 0.4f) + skew;
  }

  static void fBatch(int step, int rows, double[] x, double[] t) {
    for (int k = 0; k < rows * DIM; ++k) {
      x[k] = Math.cos(0.37 * k + 0.91 * step);
      t[k] = 0.5 * Math.sin(0.53 * k - 0.29 * step);
    }
  }

  /** y = x W^T over `rows` rows. */
  static double[] fLinear(double[] x, float[] w, int rows) {
    double[] y = new double[rows * DIM];
    for (int b = 0; b < rows; ++b) {
      for (int o = 0; o < DIM; ++o) {
        double sum = 0;
        for (int i = 0; i < DIM; ++i) sum += x[b * DIM + i] * w[o * DIM + i];
        y[b * DIM + o] = sum;
      }
    }
    return y;
  }

  /** Fills g with dy^T x and returns dx = dy W. */
  static double[] fLinearBackward(double[] dy, double[] x, float[] w, double[] g, int rows) {
    double[] dx = new double[rows * DIM];
    for (int b = 0; b < rows; ++b) {
      for (int o = 0; o < DIM; ++o) {
        for (int i = 0; i < DIM; ++i) {
          g[o * DIM + i] += dy[b * DIM + o] * x[b * DIM + i];
          dx[b * DIM + i] += dy[b * DIM + o] * w[o * DIM + i];
        }
      }
    }
    return dx;
  }

  /** Single-process training on the whole batch: the reference weights. */
  static float[][] fReference(int world) {
    int rows = FROWS * world;
    float[][] w = new float[4][DIM * DIM];
    for (int l = 0; l < 4; ++l) {
      for (int k = 0; k < DIM * DIM; ++k) w[l][k] = fInitial(l, k, 0);
    }
    for (int s = 0; s < FSTEPS; ++s) {
      double[] x = new double[rows * DIM], t = new double[rows * DIM];
      fBatch(s, rows, x, t);
      double[][] h = new double[5][];
      h[0] = x;
      for (int l = 0; l < 4; ++l) h[l + 1] = fLinear(h[l], w[l], rows);
      double[] dy = new double[rows * DIM];
      for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - t[k]) / rows;
      double[][] g = new double[4][DIM * DIM];
      for (int l = 3; l >= 0; --l) dy = fLinearBackward(dy, h[l], w[l], g[l], rows);
      for (int l = 0; l < 4; ++l) {
        for (int k = 0; k < DIM * DIM; ++k) w[l][k] -= (float) (FLR * g[l][k]);
      }
    }
    return w;
  }

  static final class Toy implements AutoCloseable {
    final Module root = new Module(), linears = new Module();
    final Module[] layer = new Module[4];
    final Fsdp[] fsdp = new Fsdp[3];
    Fsdp fsdpLinears;
    Ddp ddp;

    Toy(float skew) {
      for (int l = 0; l < 4; ++l) {
        float[] v = new float[DIM * DIM];
        for (int k = 0; k < v.length; ++k) v[k] = fInitial(l, k, skew);
        layer[l] = new Module();
        try (Tensor w = Tensor.of(v, DIM, DIM)) {
          layer[l].registerParameter("weight", w);
        }
        if (l < 3) linears.registerModule(Integer.toString(l), layer[l]);
      }
      root.registerModule("linears", linears);
      root.registerModule("proj", layer[3]);
    }

    /** Children first; every rank in the same order. */
    void shard(ProcessGroup pg, boolean initSync, boolean withDdp, boolean views) {
      FsdpOptions o = new FsdpOptions();
      o.setInitSync(initSync);
      o.setFullParamsAsViews(views);
      for (int l = 0; l < 3; ++l) fsdp[l] = new Fsdp(layer[l], pg, o);
      fsdpLinears = new Fsdp(linears, pg);
      if (withDdp) ddp = new Ddp(root, pg, new DdpOptions());
    }

    @Override
    public void close() {
      if (ddp != null) ddp.close();
      if (fsdpLinears != null) fsdpLinears.close();
      for (int l = 2; l >= 0; --l) {
        if (fsdp[l] != null) fsdp[l].close();
      }
      for (Module m : layer) m.close();
      linears.close();
      root.close();
    }
  }

  static void addGrad(Module m, String name, double[] delta) {
    try (Tensor g = m.grad(name)) {
      FloatBuffer v = g.floats();
      for (int k = 0; k < v.capacity(); ++k) v.put(k, v.get(k) + (float) delta[k]);
    }
  }

  static void sgdStep(Tensor param, Tensor grad) {
    FloatBuffer v = param.floats(), g = grad.floats();
    for (int k = 0; k < v.capacity(); ++k) v.put(k, v.get(k) - (float) FLR * g.get(k));
  }

  static void fTrainStep(Toy toy, int step, int rank, int world) {
    int rows = FROWS, global = FROWS * world;
    double[] allX = new double[global * DIM], allT = new double[global * DIM];
    fBatch(step, global, allX, allT);
    double[][] h = new double[5][];
    h[0] = Arrays.copyOfRange(allX, rank * rows * DIM, (rank + 1) * rows * DIM);
    float[][] w = new float[4][];
    // Forward: unshard with the next layer prefetched, reshard after.
    toy.fsdpLinears.unshard();
    toy.fsdp[0].unshard();
    for (int l = 0; l < 3; ++l) {
      if (l + 1 < 3) toy.fsdp[l + 1].unshard(true);
      toy.fsdp[l].waitUnshard();
      w[l] = read(toy.root, F_WEIGHTS[l]);
      h[l + 1] = fLinear(h[l], w[l], rows);
      toy.fsdp[l].reshard();
    }
    toy.ddp.preForward();
    w[3] = read(toy.root, F_WEIGHTS[3]);
    h[4] = fLinear(h[3], w[3], rows);
    double[] dy = new double[rows * DIM];
    for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - allT[rank * rows * DIM + k]) / rows;
    // Backward: proj through the Ddp, the linears through their Fsdp.
    for (int l = 3; l >= 0; --l) {
      double[] g = new double[DIM * DIM];
      if (l < 3) {
        if (l == 2) toy.fsdp[2].unshard();
        if (l > 0) toy.fsdp[l - 1].unshard(true);
        toy.fsdp[l].waitUnshard();
        w[l] = read(toy.root, F_WEIGHTS[l]);
      }
      dy = fLinearBackward(dy, h[l], w[l], g, rows);
      addGrad(toy.root, F_WEIGHTS[l], g);
      if (l == 3) {
        toy.ddp.markGradReady(F_WEIGHTS[3]);
      } else if (l == 2) {
        toy.fsdp[l].postBackward();
      } else {
        // The per-parameter mark runs postBackward; layer 0's explicit one
        // after it is a no-op.
        toy.fsdp[l].markGradReady("weight");
        if (l == 0) toy.fsdp[l].postBackward();
      }
    }
    toy.fsdpLinears.postBackward();
    for (int l = 0; l < 3; ++l) toy.fsdp[l].finishBackward();
    toy.fsdpLinears.finishBackward();
    toy.ddp.finishBackward();
    // SGD on the shards and on proj.
    for (int l = 0; l < 3; ++l) {
      try (Tensor shard = toy.fsdp[l].shard(0); Tensor grad = toy.fsdp[l].shardGrad(0)) {
        sgdStep(shard, grad);
      }
    }
    try (Tensor p = toy.root.getParameter(F_WEIGHTS[3]); Tensor g = toy.root.grad(F_WEIGHTS[3])) {
      sgdStep(p, g);
    }
    toy.root.zeroGrad();
  }

  /** Weight `l` as the module holds it unsharded (collective for the linears). */
  static float[] sharedWeights(Toy toy, int l) {
    if (l < 3) toy.fsdp[l].unshard();
    float[] w = read(toy.root, F_WEIGHTS[l]);
    if (l < 3) toy.fsdp[l].reshard();
    return w;
  }

  static void expectShardedWeights(Toy toy, float[][] expected, String what) {
    for (int l = 0; l < 3; ++l) toy.fsdp[l].unshard();
    for (int l = 0; l < 4; ++l) {
      float[] got = read(toy.root, F_WEIGHTS[l]);
      expect(got.length == DIM * DIM, what + ": " + F_WEIGHTS[l] + " has " + got.length + " elements");
      for (int k = 0; k < DIM * DIM; ++k) {
        expect(Math.abs(got[k] - expected[l][k]) <= 2e-5f * (1 + Math.abs(expected[l][k])),
               what + ": " + F_WEIGHTS[l] + "[" + k + "] is " + got[k] + ", expected " + expected[l][k]);
      }
    }
    for (int l = 0; l < 3; ++l) toy.fsdp[l].reshard();
  }

  /**
   * Whether a write to layer 0's full weight (this rank's first element)
   * reached this rank's shard: it does with views, not with copies. dp_fsdp.h
   * tells hosts not to write full parameters with views; this write is safe
   * all the same, as only this rank's rows change, nobody reads them
   * meanwhile, and the shard is restored between barriers (no rank holds the
   * layer unsharded then).
   */
  static void expectFullWeightsAreViews(Toy toy, ProcessGroup pg, int start, boolean views) {
    float before;
    try (Tensor shard = toy.fsdp[0].shard(0)) {
      before = shard.floats().get(0);
    }
    toy.fsdp[0].unshard();
    try (Tensor full = toy.root.getParameter(F_WEIGHTS[0])) {
      FloatBuffer v = full.floats();
      v.put(start * DIM, v.get(start * DIM) + 1);
    }
    toy.fsdp[0].reshard();
    pg.barrier();
    try (Tensor shard = toy.fsdp[0].shard(0)) {
      FloatBuffer v = shard.floats();
      expect((v.get(0) != before) == views, "with fullParamsAsViews " + views + ", a write to the full weight "
          + (views ? "reaches" : "does not reach") + " the shard (" + before + " became " + v.get(0) + ")");
      v.put(0, before);
    }
    pg.barrier();
  }

  static void fsdp(boolean views) throws IOException {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000)) {
      int rank = pg.rank(), world = pg.size();
      float[][] expected = fReference(world);
      java.nio.file.Path dir = java.nio.file.Paths.get(System.getProperty("java.io.tmpdir"),
          "dparallel-java-fsdp-" + System.getenv("MASTER_PORT"));
      String full = dir.resolve("full.safetensors").toString(), folder = dir.resolve("sharded").toString();
      if (rank == 0) java.nio.file.Files.createDirectories(dir);
      try (Toy toy = new Toy(0.05f * rank)) {  // init sync: rank 0's values
        toy.shard(pg, true, true, views);
        // torch.chunk's split of the 3 rows.
        int chunk = (DIM + world - 1) / world, start = Math.min(chunk * rank, DIM), count = Math.min(chunk, DIM - start);
        for (int l = 0; l < 3; ++l) {
          expect(toy.fsdp[l].numParameters() == 1 && toy.fsdp[l].parameterName(0).equals("weight"),
                 "each linear's Fsdp holds its weight");
          try (Tensor shard = toy.fsdp[l].shard(0)) {
            long[] shape = shard.shapeArray();
            expect(shape.length == 2 && shape[0] == count && shape[1] == DIM,
                   "rank " + rank + " keeps " + count + " rows of " + F_WEIGHTS[l] + ", not " + Arrays.toString(shape));
          }
        }
        expect(toy.fsdpLinears.numParameters() == 0, "the Fsdp over the linears finds every parameter held by a child's");
        expect(toy.ddp.numBuckets() == 1, "the Ddp on the root manages proj alone");
        expectFullWeightsAreViews(toy, pg, start, views);
        for (int s = 0; s < FSTEPS; ++s) fTrainStep(toy, s, rank, world);
        expectShardedWeights(toy, expected, "rank " + rank + " after training");
        System.out.println("rank " + rank + ": fully_shard training matches single-process training on the whole batch");

        // The full state dict in memory: on every rank, or on rank 1 alone.
        try (Module state = Fsdp.fullStateDict(toy.root, pg, -1)) {
          for (int l = 0; l < 4; ++l) {
            expectValues("the in-memory full state dict's " + F_WEIGHTS[l], read(state, F_WEIGHTS[l]),
                         sharedWeights(toy, l));
          }
        }
        Module onRankOne = Fsdp.fullStateDict(toy.root, pg, world - 1);
        expect((onRankOne != null) == (rank == world - 1), "the in-memory full state dict is on its root rank only");
        if (onRankOne != null) onRankOne.close();

        pg.barrier();  // the folder exists
        Fsdp.saveFullStateDict(toy.root, pg, full);
        Fsdp.saveShardedStateDict(toy.root, pg, folder);
        pg.barrier();
        try (Toy other = new Toy(1 + rank)) {
          other.shard(pg, false, false, false);
          Fsdp.loadFullStateDict(other.root, full);
          expectShardedWeights(other, expected, "rank " + rank + " after loading the full state dict");
        }
        try (Toy other = new Toy(3 + rank)) {
          other.shard(pg, false, false, false);
          Fsdp.loadShardedStateDict(other.root, folder);
          expectShardedWeights(other, expected, "rank " + rank + " after loading the sharded state dict");
        }
        // In the background: the Work reports the save; it loads as the synchronous one.
        try (Work saving = Fsdp.saveShardedStateDictAsync(toy.root, pg, folder + "-async")) {
          saving.waitFor();
          expect(saving.test(), "the background save is done once waited for");
        }
        try (Toy other = new Toy(5 + rank)) {
          other.shard(pg, false, false, false);
          Fsdp.loadShardedStateDict(other.root, folder + "-async");
          expectShardedWeights(other, expected, "rank " + rank + " after loading the background save");
        }
      }
      pg.barrier();
      if (rank == 0) {
        try (java.util.stream.Stream<java.nio.file.Path> walk = java.nio.file.Files.walk(dir)) {
          walk.sorted(Collections.reverseOrder()).forEach(p -> p.toFile().delete());
        }
      }
      System.out.println("rank " + rank + ": full and sharded state dicts load back");
    }
  }

  // Subgroups and meshes on the ranks of one host: a split that reverses
  // the ranks, one that rank 0 alone joins, the 1-D and by-host meshes, and
  // a mesh's group that outlives the mesh's close().
  static void mesh() {
    Device cpu0 = new Device("cpu:0");
    try (ProcessGroup pg = ProcessGroup.fromEnv(cpu0, 60000)) {
      int rank = pg.rank(), world = pg.size();
      expect(pg.localRank() == rank && pg.localSize() == world && pg.numHosts() == 1,
          "one host: local rank " + pg.localRank() + " of " + pg.localSize() + " on " + pg.numHosts() + " host(s)");
      try (ProcessGroup reversed = pg.split(0, -rank)) {
        expect(reversed.rank() == world - 1 - rank && reversed.size() == world, "split by key -rank: rank " + reversed.rank());
        try (Tensor t = Tensor.of(new float[] {rank}, 1)) {
          reversed.broadcast(t, 0);
          expectValues("broadcast from the reversed group's rank 0", t.toArray(), new float[] {world - 1});
        }
      }
      ProcessGroup alone = pg.split(rank == 0 ? 7 : -1, 0);
      expect((alone != null) == (rank == 0), "a negative color joins no group");
      if (alone != null) {
        expect(alone.size() == 1, "rank 0 alone: size " + alone.size());
        alone.close();
      }
      try (ProcessGroup again = pg.shrink()) {
        expect(again.rank() == rank && again.size() == world && again.lostRanks().toIntArray().length == 0,
            "a shrink with no rank lost: rank " + again.rank() + " of " + again.size());
        try (Tensor t = Tensor.of(new float[] {rank + 1}, 1)) {
          again.allReduce(t);
          expectValues("all_reduce over the shrunk group", t.toArray(), new float[] {world * (world + 1) / 2});
        }
      }
      try (DeviceMesh mesh = DeviceMesh.create(pg, new int[] {world}, "dp")) {
        expect(mesh.ndim() == 1 && mesh.dimName(0).equals("dp"), "a 1-D mesh named dp");
        expect(java.util.Arrays.equals(mesh.shape().toIntArray(), new int[] {world}), "the mesh's shape");
        expect(java.util.Arrays.equals(mesh.coordinate().toIntArray(), new int[] {rank}), "this rank's coordinate");
        expectInvalid(() -> mesh.group("tp"), "'tp'");
        ProcessGroup dp = mesh.group("dp");
        mesh.close();
        try (Tensor t = Tensor.of(new float[] {rank + 1}, 1)) {
          dp.allReduce(t, ReduceOp.SUM);
          expectValues("all_reduce over the mesh's group after the mesh's close", t.toArray(), new float[] {world * (world + 1) / 2});
        }
        dp.close();
      }
      expectInvalid(() -> DeviceMesh.create(pg, new int[] {world + 1}), "'shape'");
      try (DeviceMesh hosts = DeviceMesh.byHost(pg); ProcessGroup local = hosts.group("local"); ProcessGroup across = hosts.group("host")) {
        expect(java.util.Arrays.equals(hosts.shape().toIntArray(), new int[] {1, world}), "by host: one row of " + world);
        expect(local.size() == world && local.backend().equals("shm"), "the local group is this host's, on shm: " + local.backend());
        expect(across.size() == 1, "one host: the host group is this rank alone");
        // HSDP on the by-host mesh: shards over "local", rank 0's values (init_sync).
        try (Module m = new Module(); Tensor w = Tensor.of(new float[] {rank, 1, 2, 3}, 4)) {
          m.registerParameter("w", w);
          try (Fsdp f = new Fsdp(m, hosts); Tensor shard = f.shard(0)) {
            expectValues("the shard on the mesh's local group", shard.toArray(), new float[] {2 * rank, 2 * rank + 1});
          }
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
      case "tensors":
        tensors();
        break;
      case "close-races":
        closeRaces();
        break;
      case "streams":
        streams();
        break;
      case "collectives":
        collectives();
        break;
      case "join":
        join();
        break;
      case "ddp-extras":
        ddpExtras();
        break;
      case "fsdp":
        fsdp(false);
        break;
      case "fsdp-views":
        fsdp(true);
        break;
      case "mesh":
        mesh();
        break;
      default:
        fail("usage: DParallelTest data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles|close-races|tensors|streams|ddp|collectives|join|ddp-extras|fsdp|fsdp-views|mesh");
    }
    System.gc();
    System.out.println("OK " + mode);
  }
}
