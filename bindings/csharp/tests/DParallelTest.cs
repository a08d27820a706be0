// Trains a small tanh MLP with its forward and backward written in C#, on
// two logical CPU devices (replica sets, DataParallel, ParallelApply) or one
// process per rank under dp-run (DDP, with the default and a C# comm hook),
// and checks parity with plain single-device training. Also pins that
// exceptions thrown in callbacks surface in the caller, that bad arguments
// raise DParallelException naming the argument, that AsMemory() views keep
// the tensor's memory alive after the tensor is disposed or collected, and
// that every handle answers IsClosed() after Dispose(), and that Dispose()
// racing calls on other threads never crashes (dispose-races). The rest: fully_shard
// on every rank against single-process training, with its state dicts
// (fsdp); tensors over pinned arrays, DLPack, coalesced collectives, memory
// stats and shutdown (tensors); streams and host functions (streams); the
// process group's collectives (collectives); join with uneven inputs, the
// optimizer inside backward, parameterUsed and bucket plans (ddp-extras).
//
//   mono DParallelTest.exe data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles|dispose-races|tensors|streams
//   dp-run -n 2 mono DParallelTest.exe ddp|fsdp|fsdp-views|collectives|ddp-extras
using System;
using System.Collections.Generic;
using System.IO;
using System.Linq;
using System.Threading;
using DParallel;

public static class DParallelTest {
  const int LAYERS = 3, WIDTH = 8, BATCH = 24, STEPS = 6;
  const float LR = 0.5f;
  // Observed differences are ~1e-8 (summation order); a learning rate 0.1%
  // off already moves parameters by ~3e-5.
  const double RTOL = 1e-5, ATOL = 1e-6;

  static void Fail(string message) {
    Console.Error.WriteLine("FAIL: " + message);
    Environment.Exit(1);
  }

  static void Expect(bool ok, string message) {
    if (!ok) Fail(message);
  }

  // ---- deterministic data (splitmix64) ----
  static ulong state;

  static float Uniform() {
    ulong z = (state += 0x9e3779b97f4a7c15UL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9UL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebUL;
    z = z ^ (z >> 31);
    return (float)((z >> 11) * (1.0 / 9007199254740992.0)) - 0.5f;
  }

  static float[][] InitialWeights(bool bias) {
    var output = new float[LAYERS][];
    for (int l = 0; l < LAYERS; ++l) {
      output[l] = new float[bias ? WIDTH : WIDTH * WIDTH];
      for (int i = 0; i < output[l].Length; ++i) output[l][i] = Uniform() * (bias ? 0.2f : 1.2f / (float)Math.Sqrt(WIDTH));
    }
    return output;
  }

  static float[][] Zeros(int n) {
    var output = new float[LAYERS][];
    for (int l = 0; l < LAYERS; ++l) output[l] = new float[n];
    return output;
  }

  /// Rows of [x | y] for step `step`, BATCH x 2*WIDTH.
  static float[] Batch(int step) {
    state = (ulong)(1000 + step);
    var rows = new float[BATCH * 2 * WIDTH];
    for (int i = 0; i < rows.Length; ++i) rows[i] = Uniform();
    return rows;
  }

  static string WeightName(int l) { return "fc" + l + ".weight"; }
  static string BiasName(int l) { return "fc" + l + ".bias"; }

  /// Forward and backward of the MLP (tanh after every layer but the last,
  /// MSE over fullBatch rows) over `n` rows of `rows` from row `first`;
  /// writes into gw/gb this part's gradient times `world`, calls layerDone
  /// after each layer's gradients, and returns its part of the loss.
  static double ForwardBackward(float[][] w, float[][] b, float[][] gw, float[][] gb, float[] rows, int first, int n,
                                int fullBatch, int world, Action<int> layerDone) {
    const int W = WIDTH, L = LAYERS, ld = 2 * WIDTH;
    var act = new float[L][];
    for (int l = 0; l < L; ++l) {
      act[l] = new float[n * W];
      for (int r = 0; r < n; ++r) {
        for (int j = 0; j < W; ++j) {
          float s = 0;
          for (int k = 0; k < W; ++k) {
            float input = l == 0 ? rows[(first + r) * ld + k] : act[l - 1][r * W + k];
            s += input * w[l][j * W + k];
          }
          float v = s + b[l][j];
          act[l][r * W + j] = l < L - 1 ? (float)Math.Tanh(v) : v;
        }
      }
    }
    double loss = 0;
    var dz = new float[n * W];
    float scale = 2.0f * world / (float)(fullBatch * W);
    for (int r = 0; r < n; ++r) {
      for (int j = 0; j < W; ++j) {
        float diff = act[L - 1][r * W + j] - rows[(first + r) * ld + W + j];
        loss += (double)diff * diff;
        dz[r * W + j] = diff * scale;
      }
    }
    for (int l = L - 1; l >= 0; --l) {
      for (int j = 0; j < W; ++j) {
        for (int k = 0; k < W; ++k) {
          float s = 0;
          for (int r = 0; r < n; ++r) {
            float input = l == 0 ? rows[(first + r) * ld + k] : act[l - 1][r * W + k];
            s += dz[r * W + j] * input;
          }
          gw[l][j * W + k] = s;
        }
        float sb = 0;
        for (int r = 0; r < n; ++r) sb += dz[r * W + j];
        gb[l][j] = sb;
      }
      layerDone?.Invoke(l);
      if (l == 0) break;
      var da = new float[n * W];
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
    return loss / (double)(fullBatch * W);
  }

  /// Plain single-device training on full batches: the reference.
  static float[][][] Reference() {
    state = 7;
    float[][] w = InitialWeights(false), b = InitialWeights(true);
    float[][] gw = Zeros(WIDTH * WIDTH), gb = Zeros(WIDTH);
    for (int step = 0; step < STEPS; ++step) {
      ForwardBackward(w, b, gw, gb, Batch(step), 0, BATCH, BATCH, 1, null);
      for (int l = 0; l < LAYERS; ++l) {
        for (int i = 0; i < w[l].Length; ++i) w[l][i] -= LR * gw[l][i];
        for (int i = 0; i < b[l].Length; ++i) b[l][i] -= LR * gb[l][i];
      }
    }
    return new[] { w, b };
  }

  static Module BuildModel() {
    state = 7;
    float[][] w = InitialWeights(false), b = InitialWeights(true);
    var model = new Module();
    for (int l = 0; l < LAYERS; ++l) {
      using (var layer = new Module())
      using (var weight = Tensor.Of(w[l], WIDTH, WIDTH))
      using (var bias = Tensor.Of(b[l], WIDTH)) {
        layer.RegisterParameter("weight", weight);
        layer.RegisterParameter("bias", bias);
        model.RegisterModule("fc" + l, layer);
      }
    }
    return model;
  }

  /// Reads the parameters through zero-copy spans.
  static void LoadParams(Module m, float[][] w, float[][] b) {
    for (int l = 0; l < LAYERS; ++l) {
      using (var tw = m.GetParameter(WeightName(l)))
      using (var tb = m.GetParameter(BiasName(l))) {
        tw.AsSpan().CopyTo(w[l]);
        tb.AsSpan().CopyTo(b[l]);
      }
    }
  }

  static void StoreGrads(Module m, int l, float[][] gw, float[][] gb) {
    using (var tw = m.Grad(WeightName(l)))
    using (var tb = m.Grad(BiasName(l))) {
      new Span<float>(gw[l]).CopyTo(tw.AsSpan());
      new Span<float>(gb[l]).CopyTo(tb.AsSpan());
    }
  }

  static void Sgd(Module m) {
    for (int l = 0; l < LAYERS; ++l) {
      foreach (string name in new[] { WeightName(l), BiasName(l) }) {
        using (var p = m.GetParameter(name))
        using (var g = m.Grad(name)) {
          Span<float> pv = p.AsSpan(), gv = g.AsSpan();
          for (int i = 0; i < pv.Length; ++i) pv[i] -= LR * gv[i];
        }
      }
    }
  }

  static void CheckParity(Module m, string what) {
    float[][][] reference = Reference();
    double worst = 0;
    int bad = 0;
    for (int l = 0; l < LAYERS; ++l) {
      for (int part = 0; part < 2; ++part) {
        float[] got;
        using (var t = m.GetParameter(part == 0 ? WeightName(l) : BiasName(l))) got = t.ToArray();
        float[] want = reference[part][l];
        for (int i = 0; i < want.Length; ++i) {
          double diff = Math.Abs((double)got[i] - want[i]);
          if (!(diff <= ATOL + RTOL * Math.Abs(want[i]))) ++bad;
          worst = Math.Max(worst, diff);
        }
      }
    }
    Console.WriteLine("{0}: parity with single-device training: max |difference| {1:G3}, {2} values off", what, worst, bad);
    Expect(bad == 0, what + ": parameters differ from single-device training");
  }

  /// The replica's forward and backward, in C#, reading the replica's
  /// parameters and writing its gradients through spans; returns the loss as
  /// a 1-element tensor on the replica's device.
  class Step : ForwardFunction {
    public int Calls;
    public volatile bool OnCallerThread;
    readonly Thread caller = Thread.CurrentThread;

    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      Interlocked.Increment(ref Calls);
      if (Thread.CurrentThread == caller) OnCallerThread = true;
      int n = (int)input.ShapeArray()[0];
      var rows = input.ToArray();
      float[][] w = Zeros(WIDTH * WIDTH), b = Zeros(WIDTH), gw = Zeros(WIDTH * WIDTH), gb = Zeros(WIDTH);
      LoadParams(replica, w, b);
      double loss = ForwardBackward(w, b, gw, gb, rows, 0, n, BATCH, 1, null);
      for (int l = 0; l < LAYERS; ++l) StoreGrads(replica, l, gw, gb);
      var output = new Tensor(device, 1);
      Span<float> value = output.AsSpan();
      value[0] = (float)loss;
      return output;
    }
  }

  static void RunDataParallel() {
    DeviceList devices = Device.List("cpu:0,cpu:1");
    var cpu0 = new Device("cpu:0");
    var step = new Step();
    using (var model = BuildModel())
    using (var set = new ReplicaSet(model, devices)) {
      for (int s = 0; s < STEPS; ++s) {
        using (var input = Tensor.Of(Batch(s), BATCH, 2 * WIDTH)) {
          model.ZeroGrad();
          Tensor losses = null;
          if (s % 3 == 0) {
            set.Sync();
            losses = set.Apply(input, 0, cpu0, step);
            set.ReduceGradients();
          } else if (s % 3 == 1) {
            losses = Parallel.DataParallel(model, input, devices, cpu0, 0, step);
          } else {
            // ParallelApply over fresh replicas and the scattered halves;
            // the losses gathered, and summed with ReduceAdd.
            using (var replicas = Parallel.Replicate(model, devices))
            using (var chunks = Parallel.Scatter(input, devices, 0))
            using (var r0 = replicas.Get(0))
            using (var r1 = replicas.Get(1))
            using (var in0 = chunks.Get(0))
            using (var in1 = chunks.Get(1)) {
              Expect(chunks.Size() == 2 && in1.GetDevice().ToString() == "cpu:1", "Scatter puts chunk 1 on cpu:1");
              var mv = new ModuleVector { r0, r1 };
              var tv = new TensorVector { in0, in1 };
              using (var outs = Parallel.ParallelApply(mv, tv, new DeviceList(), step))
              using (var o0 = outs.Get(0))
              using (var o1 = outs.Get(1)) {
                Expect(outs.Size() == 2, "ParallelApply gives one output per replica");
                Expect(o1.GetDevice().ToString() == "cpu:1", "replica 1's output is on cpu:1, not " + o1.GetDevice());
                var ov = new TensorVector { o0, o1 };
                using (var sum = Parallel.ReduceAdd(ov, cpu0)) {
                  losses = Parallel.Gather(ov, 0, cpu0);
                  float[] l = losses.ToArray();
                  Expect(sum.ToArray()[0] == l[0] + l[1], "ReduceAdd sums what Gather concatenates");
                }
              }
              Parallel.ReduceGradients(mv, model);
            }
          }
          if (losses != null) {
            Expect(losses.Numel() == 2, "one loss per replica, got " + losses.Numel());
            float[] l = losses.ToArray();
            Console.WriteLine("step {0} loss {1:F6}", s + 1, l[0] + l[1]);
            losses.Dispose();
          }
          Sgd(model);
        }
      }
      using (var t = Tensor.Of(new float[] { 1, 2, 3 }, 3))
      using (var copies = Parallel.Broadcast(t, devices))
      using (var c1 = copies.Get(1)) {
        Expect(c1.GetDevice().ToString() == "cpu:1" && c1.ToArray()[2] == 3, "Broadcast copies to cpu:1");
      }
      Expect(step.Calls == 2 * STEPS, "the forward ran once per replica and step: " + step.Calls);
      Expect(!step.OnCallerThread, "the forward ran on the library's worker threads, not the caller's");
      CheckParity(model, "data-parallel on cpu:0,cpu:1");
    }
  }

  class Throwing : ForwardFunction {
    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      if (index == 1) throw new InvalidOperationException("forward failed on replica " + index);
      return input;
    }
  }

  class ThrowingIo : ForwardFunction {
    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      throw new IOException("I/O failure in replica " + index);
    }
  }

  class BadName : ForwardFunction {
    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      replica.GetParameter("no.such.parameter").Dispose();
      return input;
    }
  }

  class Disposes : ForwardFunction {
    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      using (var output = new Tensor(device, 1)) return output;
    }
  }

  static void ForwardThrows() {
    DeviceList devices = Device.List("cpu:0,cpu:1");
    var cpu0 = new Device("cpu:0");
    using (var model = BuildModel())
    using (var set = new ReplicaSet(model, devices))
    using (var input = Tensor.Of(Batch(0), BATCH, 2 * WIDTH)) {
      try {
        set.Apply(input, 0, cpu0, new Throwing());
        Fail("ReplicaSet.Apply returned although the forward threw");
      } catch (InvalidOperationException e) {
        Expect(e.Message == "forward failed on replica 1", "the forward's own exception surfaces: " + e);
        Console.WriteLine("ReplicaSet.Apply rethrew: " + e.GetType().Name + ": " + e.Message);
      }
      try {
        Parallel.DataParallel(model, input, devices, cpu0, 0, new ThrowingIo()).Dispose();
        Fail("DataParallel returned although the forward threw");
      } catch (IOException e) {
        Console.WriteLine("DataParallel rethrew: " + e.GetType().Name + ": " + e.Message);
      }
      // A failing call inside the forward throws DParallelException on the
      // worker thread; it surfaces in the caller like any other exception.
      try {
        set.Apply(input, 0, cpu0, new BadName()).Dispose();
        Fail("ReplicaSet.Apply returned although the forward's call failed");
      } catch (DParallelException e) {
        Expect(e.Code == Status.INVALID && e.Message.Contains("no.such.parameter"),
               "the worker thread's DParallelException surfaces: " + e.Message);
        Console.WriteLine("ReplicaSet.Apply rethrew: " + e.Message);
      }
      // Returning a tensor that `using` already disposed is caught.
      try {
        set.Apply(input, 0, cpu0, new Disposes()).Dispose();
        Fail("ReplicaSet.Apply returned although the forward returned a disposed tensor");
      } catch (InvalidOperationException e) {
        Expect(e.Message.Contains("disposed tensor"), "a disposed output is refused: " + e.Message);
        Console.WriteLine("ReplicaSet.Apply rethrew: " + e.Message);
      }
      // The library and the set stay usable.
      using (var output = set.Apply(input, 0, cpu0, new Step())) {
        Expect(output.Numel() == 2, "Apply works after a failed forward");
      }
    }
  }

  // ---- view lifetime ----

  static float[] DistinctValues(int n, int seed) {
    var output = new float[n];
    for (int i = 0; i < n; ++i) output[i] = seed * 100000 + i + 0.5f;
    return output;
  }

  class DroppedView {
    public string Name;
    public float[] Want;
    public Memory<float> View;
    public WeakReference Tensor;
  }

  /// AsMemory() views of tensors that nothing references once this returns:
  /// made on a thread of their own, so that no stale slot of this stack
  /// (which Mono scans conservatively) keeps a tensor alive.
  static List<DroppedView> ViewsOfDroppedTensors(int[] sizes) {
    var views = new List<DroppedView>();
    var maker = new Thread(() => {
      for (int k = 0; k < sizes.Length; ++k) {
        float[] a = DistinctValues(sizes[k], 2 * k + 1), b = DistinctValues(sizes[k], 2 * k + 2);
        var ta = Tensor.Of(a, sizes[k]);
        views.Add(new DroppedView { Name = "AsMemory() of a dropped tensor of " + sizes[k], Want = a,
                                    View = ta.AsMemory(), Tensor = new WeakReference(ta) });
        // A slice keeps the whole view's reference.
        var tb = Tensor.Of(new float[sizes[k] + 1], sizes[k] + 1);
        Memory<float> whole = tb.AsMemory();
        b.CopyTo(whole.Span.Slice(1));
        views.Add(new DroppedView { Name = "a slice of AsMemory() of a dropped tensor of " + sizes[k], Want = b,
                                    View = whole.Slice(1), Tensor = new WeakReference(tb) });
      }
    });
    maker.Start();
    maker.Join();
    return views;
  }

  /// Collects until every tensor is unreachable and finalized.
  static void AwaitCollected(List<DroppedView> views) {
    var deadline = DateTime.UtcNow.AddSeconds(30);
    while (views.Exists(v => v.Tensor.IsAlive)) {
      GC.Collect();
      GC.WaitForPendingFinalizers();
      Expect(DateTime.UtcNow < deadline, "the dropped tensors were collected within 30 s");
    }
    GC.Collect();
    GC.WaitForPendingFinalizers();
  }

  /// Tensors of `n` elements filled with `fill`: what would take over freed
  /// memory of that size.
  static List<Tensor> ReuseCandidates(int n, float fill) {
    var values = new float[n];
    for (int i = 0; i < n; ++i) values[i] = fill;
    var output = new List<Tensor>();
    for (int i = 0; i < 16; ++i) output.Add(Tensor.Of(values, n));
    return output;
  }

  /// `view` still holds `want`; writing through it changes none of `others`.
  static void CheckViewOwnsMemory(string what, Memory<float> view, float[] want, List<Tensor> others, float fill) {
    Span<float> v = view.Span;
    Expect(v.Length == want.Length, what + ": length " + v.Length);
    for (int i = 0; i < want.Length; ++i) {
      if (v[i] != want[i]) Fail(what + ": element " + i + " reads " + v[i] + ", not " + want[i]);
    }
    for (int i = 0; i < want.Length; ++i) v[i] = -want[i];
    foreach (Tensor other in others) {
      float[] got = other.ToArray();
      for (int i = 0; i < got.Length; ++i) {
        if (got[i] != fill) Fail(what + ": a write through the view landed in another tensor (element " + i + ")");
      }
    }
    for (int i = 0; i < want.Length; ++i) {
      if (v[i] != -want[i]) Fail(what + ": element " + i + " does not keep what was written");
    }
  }

  /// An AsMemory() view keeps the tensor's memory: after the tensor is
  /// collected without Dispose(), or disposed while the view is in use, and
  /// after new tensors of the same size were made.
  static void ViewOutlivesTensor() {
    // Under and over 64 KiB: a malloc block, and one of the allocator's
    // cache, which hands a freed block to the next tensor of its size.
    int[] sizes = { 1000, 40000 };
    List<DroppedView> views = ViewsOfDroppedTensors(sizes);
    AwaitCollected(views);
    foreach (int n in sizes) {
      List<Tensor> others = ReuseCandidates(n, -1);
      foreach (DroppedView v in views.FindAll(v => v.Want.Length == n)) CheckViewOwnsMemory(v.Name, v.View, v.Want, others, -1);
      foreach (Tensor t in others) t.Dispose();
    }
    foreach (int n in sizes) {
      float[] want = DistinctValues(n, 7);
      var t = Tensor.Of(want, n);
      Memory<float> view = t.AsMemory();
      t.Dispose();
      Expect(t.IsClosed(), "Dispose() disposes the tensor although a view of it is in use");
      List<Tensor> others = ReuseCandidates(n, -3);
      CheckViewOwnsMemory("AsMemory() of a disposed tensor of " + n, view, want, others, -3);
      foreach (Tensor o in others) o.Dispose();
    }
    Console.WriteLine("views of {0} collected and 2 disposed tensors kept their memory", views.Count);
    // The views' own references go when the views do; the library stays sound.
    views.Clear();
    for (int i = 0; i < 3; ++i) {
      GC.Collect();
      GC.WaitForPendingFinalizers();
    }
    using (var t = Tensor.Of(DistinctValues(40000, 9), 40000)) {
      Expect(t.ToArray()[1] == 900001.5f, "a new tensor after the views are gone holds its values");
    }
  }

  // ---- closed handles ----

  /// `handle` is open; after Dispose() IsClosed() is true (not a throw), a
  /// second Dispose() does nothing and `use` throws DParallelException with
  /// Status.STATE.
  static void CheckCloses(string what, IDisposable handle, Func<bool> isClosed, Action use) {
    Expect(!isClosed(), what + " is open after it is made");
    use();
    handle.Dispose();
    Expect(isClosed(), what + ".IsClosed() after Dispose()");
    handle.Dispose();
    Expect(isClosed(), what + ".IsClosed() after a second Dispose()");
    try {
      use();
      Fail("a call on a disposed " + what + " returned");
    } catch (DParallelException e) {
      Expect(e.Code == Status.STATE, "a disposed " + what + " is Status.STATE: " + e.Message);
    }
  }

  static void ClosedHandles() {
    DeviceList devices = Device.List("cpu:0,cpu:1");
    var cpu0 = new Device("cpu:0");
    var tensor = Tensor.Of(new float[] { 1, 2, 3, 4 }, 4);
    CheckCloses("Tensor", tensor, tensor.IsClosed, () => tensor.Numel());
    using (var input = Tensor.Of(new float[] { 1, 2, 3, 4 }, 4)) {
      TensorList chunks = Parallel.Scatter(input, devices, 0);
      CheckCloses("TensorList", chunks, chunks.IsClosed, () => chunks.Get(0).Dispose());
    }
    var module = new Module();
    CheckCloses("Module", module, module.IsClosed, () => module.NumParameters());
    using (Module model = BuildModel()) {
      ModuleList replicas = Parallel.Replicate(model, devices, false);
      CheckCloses("ModuleList", replicas, replicas.IsClosed, () => replicas.Get(0).Dispose());
      var set = new ReplicaSet(model, devices);
      CheckCloses("ReplicaSet", set, set.IsClosed, set.Sync);
      Store store = Store.Tcp("127.0.0.1", 0, 1, true, 10000);
      ProcessGroup pg = ProcessGroup.Create(store, 0, 1, cpu0, 10000);
      using (var t = Tensor.Of(new float[] { 1, 2 }, 2)) {
        Work work = pg.AllReduceAsync(t, ReduceOp.SUM);
        CheckCloses("Work", work, work.IsClosed, work.WaitFor);
      }
      var ddp = new Ddp(model, pg, new DdpOptions());
      CheckCloses("Ddp", ddp, ddp.IsClosed, () => ddp.NumBuckets());
      CheckCloses("ProcessGroup", pg, pg.IsClosed, () => pg.Rank());
      CheckCloses("Store", store, store.IsClosed, () => store.Port());
    }
    Console.WriteLine("every handle answers IsClosed() after Dispose()");
  }

  // ---- Dispose() racing calls on other threads ----

  /// A call on a disposed object: DParallelException, Status.STATE, saying so.
  static bool IsDisposedError(Exception e) {
    return e is DParallelException d && d.Code == Status.STATE && d.Message.Contains("disposed");
  }

  /// `rounds` times: `callers` threads call `use` on a new object from
  /// `make` until it is disposed, while this thread disposes it once every
  /// caller has made a call. Nothing crashes; a call racing Dispose() either
  /// completes or throws the disposed error, and every call that starts
  /// after Dispose() returned throws it.
  static void RaceDispose<T>(string what, int rounds, int callers, Func<T> make, Action<T> use) where T : IDisposable {
    for (int round = 0; round < rounds; ++round) {
      T handle = make();
      var called = new CountdownEvent(callers);
      int disposed = 0;
      Exception wrong = null;
      var threads = new Thread[callers];
      for (int i = 0; i < callers; ++i) {
        threads[i] = new Thread(() => {
          bool counted = false;
          try {
            while (true) {
              bool afterDispose = Volatile.Read(ref disposed) != 0;
              try {
                use(handle);
              } catch (Exception e) {
                if (!IsDisposedError(e)) Interlocked.CompareExchange(ref wrong, e, null);
                return;
              }
              if (afterDispose) {
                Interlocked.CompareExchange(ref wrong, new InvalidOperationException("a call that started after Dispose() returned"), null);
                return;
              }
              if (!counted) {
                counted = true;
                called.Signal();
              }
            }
          } catch (Exception e) {
            Interlocked.CompareExchange(ref wrong, e, null);
          } finally {
            if (!counted) called.Signal();
          }
        });
        threads[i].Start();
      }
      called.Wait();
      handle.Dispose();
      Volatile.Write(ref disposed, 1);
      foreach (Thread t in threads) t.Join();
      if (wrong != null) Fail(what + ", round " + round + ": a caller racing Dispose() got " + wrong);
      try {
        use(handle);
        Fail(what + ": a call after Dispose() returned");
      } catch (Exception e) {
        Expect(IsDisposedError(e), what + ": a call after Dispose() is the disposed error, not " + e);
      }
    }
    Console.WriteLine("{0}: Dispose() raced calls on {1} threads {2} times", what, callers, rounds);
  }

  /// A forward that disposes the replica set running it.
  class DisposesItsSet : ForwardFunction {
    internal ReplicaSet Set;
    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      Set.Dispose();
      return input;
    }
  }

  static void DisposeRaces() {
    var cpu0 = new Device("cpu:0");
    DeviceList devices = Device.List("cpu:0,cpu:1");
    // The thousand-round race, on the cheapest handle, then every other kind.
    RaceDispose("Tensor", 1000, 3, () => Tensor.Of(new float[] { 1, 2, 3, 4 }, 4), t => {
      var output = new float[4];
      t.CopyTo(output);
      if (t.Numel() != 4 || output[3] != 4) throw new InvalidOperationException("a racing call read wrong values");
    });
    RaceDispose("Module", 300, 3, BuildModel, m => {
      if (m.NumParameters() != 2 * LAYERS) throw new InvalidOperationException("a racing call saw the wrong parameters");
      m.GetParameter("fc0.bias").Dispose();
    });
    using (var input = Tensor.Of(new float[] { 1, 2, 3, 4 }, 4))
    using (Module model = BuildModel())
    using (var grad = Tensor.Of(new float[] { 1, 2 }, 2)) {
      RaceDispose("TensorList", 100, 3, () => Parallel.Scatter(input, devices, 0), l => l.Get(1).Dispose());
      RaceDispose("ModuleList", 50, 3, () => Parallel.Replicate(model, devices, false), l => l.Get(1).Dispose());
      RaceDispose("ReplicaSet", 50, 3, () => new ReplicaSet(model, devices), s => s.Sync());
      RaceDispose("DeviceStream", 100, 3, () => new DeviceStream(cpu0), s => s.Synchronize());
      RaceDispose("Store", 30, 3, () => Store.Tcp("127.0.0.1", 0, 1, true, 10000), s => s.Add("k", 1));
      using (Store store = Store.Tcp("127.0.0.1", 0, 1, true, 10000)) {
        // Collectives are one thread's at a time; the group's reads are anyone's.
        RaceDispose("ProcessGroup", 30, 3, () => ProcessGroup.Create(store, 0, 1, cpu0, 10000), pg => {
          if (pg.Rank() != 0 || pg.Size() != 1) throw new InvalidOperationException("a racing call read the wrong rank");
        });
        using (ProcessGroup pg = ProcessGroup.Create(store, 0, 1, cpu0, 10000)) {
          RaceDispose("Work", 100, 3, () => pg.AllReduceAsync(grad, ReduceOp.SUM), w => w.WaitFor());
          RaceDispose("Ddp", 50, 3, () => new Ddp(model, pg, new DdpOptions()), d => d.LastStats());
          using (Module plain = BuildModel()) {
            RaceDispose("Fsdp", 30, 3, () => new Fsdp(plain, pg), f => f.ParameterName(0));
          }
        }
      }
      // A handle argument disposed under a call: the call holds it too.
      RaceDispose("Tensor as an argument", 300, 3, () => Tensor.Of(new float[] { 1, 2 }, 2), t => {
        using (var m = new Module()) m.RegisterParameter("w", t);
      });
      // Inside a callback, disposing the object whose call runs it would
      // wait for itself: refused instead.
      using (var set = new ReplicaSet(model, devices))
      using (var rows = Tensor.Of(new float[] { 1, 2, 3, 4 }, 4, 1)) {
        try {
          set.Apply(rows, 0, cpu0, new DisposesItsSet { Set = set }).Dispose();
          Fail("Dispose() inside the set's own forward returned");
        } catch (DParallelException e) {
          Expect(e.Code == Status.STATE && e.Message.Contains("inside a callback"),
                 "Dispose() inside the forward of the object's own call is Status.STATE: " + e.Message);
        }
        Expect(!set.IsClosed(), "the refused Dispose() leaves the set open");
        set.Sync();
      }
    }
    Console.WriteLine("Dispose() racing calls never crashed; calls after it threw the disposed error");
  }

  /// `call` fails with Status.INVALID and a message that contains `naming`.
  static void ExpectInvalid(Action call, string naming) {
    try {
      call();
      Fail("no exception; expected one naming " + naming);
    } catch (DParallelException e) {
      Expect(e.Code == Status.INVALID, "code " + e.Code + " is Status.INVALID");
      Expect(e.Message.Contains(naming), "the message names " + naming + ": " + e.Message);
      Console.WriteLine("DParallelException: " + e.Message);
    }
  }

  static void BadArgument() {
    ExpectInvalid(() => new Device("gpu:0"), "'text'");
    ExpectInvalid(() => new Tensor(4, -2).Dispose(), "'shape[1]'");
    using (var t = new Tensor(2, 3)) {
      ExpectInvalid(() => t.CopyFrom(new float[5]), "'values'");
      ExpectInvalid(() => t.CopyFrom(null), "'values'");
    }
    using (var m = new Module())
    using (var t = new Tensor(3)) {
      m.RegisterParameter("w", t);
      ExpectInvalid(() => m.RegisterParameter("w", t), "'name'");
      ExpectInvalid(() => m.GetParameter("nope").Dispose(), "\"nope\"");
    }
    ExpectInvalid(() => Parallel.DataParallel(new Module(), new Tensor(2), Device.List("cpu:0"), new Device(), 0, null),
                  "'fn'");
    // A disposed handle throws, it does not crash.
    var disposed = new Tensor(2);
    disposed.Dispose();
    try {
      disposed.Numel();
      Fail("a call on a disposed tensor returned");
    } catch (DParallelException e) {
      Expect(e.Code == Status.STATE, "a disposed handle is Status.STATE: " + e.Message);
      Console.WriteLine("DParallelException: " + e.Message);
    }
    // Nor does it pass as null, an empty slot, when it is an argument: the
    // gradient stays.
    using (var m = new Module())
    using (var w = Tensor.Of(new float[] { 1, 2 }, 2)) {
      m.RegisterParameter("w", w);
      using (var g = m.Grad("w")) g.CopyFrom(new float[] { 9, 9 });
      try {
        m.SetGrad("w", disposed);
        Fail("SetGrad took a disposed tensor");
      } catch (DParallelException e) {
        Expect(e.Code == Status.STATE && e.Message.Contains("'grad' is disposed"), e.Message);
      }
      using (var g = m.Grad("w")) Expect(g.ToArray()[0] == 9, "the gradient stayed: " + g.ToArray()[0]);
    }
    ExpectInvalid(() => Parallel.ReduceAddCoalesced(null, 2, new Device()).Dispose(), "'inputs' is null");
    using (var m = new Module()) ExpectInvalid(() => m.Grad(null).Dispose(), "'dottedName' is null");
  }

  /// A TCP store served and used in this process; a missing key times out.
  static void RunStore() {
    using (var server = Store.Tcp("127.0.0.1", 0, 1, true, 10000)) {
      int port = server.Port();
      Expect(port > 0, "the server picked a free port: " + port);
      using (var client = Store.Tcp("127.0.0.1", port, 1, false, 10000)) {
        server.Set("greeting", "hello");
        Expect(client.Get("greeting") == "hello", "the client reads what the server set");
        Expect(client.Add("counter", 5) == 5 && server.Add("counter", 2) == 7, "add counts across handles");
        client.WaitFor(new StringVector { "greeting", "counter" }, 1000);
        client.SetTimeout(200);
        try {
          client.Get("missing");
          Fail("Get of a missing key returned");
        } catch (DParallelException e) {
          Expect(e.Code == Status.TIMEOUT, "a missing key times out: " + e.Message);
          Console.WriteLine("DParallelException: " + e.Message);
        }
      }
    }
  }

  class Average : CommHook {
    public int Calls;

    public override void Reduce(ProcessGroup group, ulong bucketIndex, Tensor bucket) {
      Interlocked.Increment(ref Calls);
      group.AllReduce(bucket, ReduceOp.SUM);
      Span<float> v = bucket.AsSpan();
      for (int i = 0; i < v.Length; ++i) v[i] /= group.Size();
    }
  }

  class Refusing : CommHook {
    public override void Reduce(ProcessGroup group, ulong bucketIndex, Tensor bucket) {
      throw new NotSupportedException("hook refused bucket " + bucketIndex);
    }
  }

  /// One rank of DDP training: rows [lo, hi) of every batch; the gradients
  /// are averaged across ranks.
  static void RunDdp() {
    var cpu0 = new Device("cpu:0");
    using (var pg = ProcessGroup.FromEnv(cpu0, 60000))
    using (var model = BuildModel()) {
      int rank = pg.Rank(), world = pg.Size();
      int lo = BATCH * rank / world, hi = BATCH * (rank + 1) / world;
      var average = new Average();
      var options = new DdpOptions();
      options.FirstBucketCapMb = 1e-4;  // several buckets, reduced while the backward goes on
      options.BucketCapMb = 1e-4;
      var ddp = new Ddp(model, pg, options);
      float[][] w = Zeros(WIDTH * WIDTH), b = Zeros(WIDTH), gw = Zeros(WIDTH * WIDTH), gb = Zeros(WIDTH);
      for (int s = 0; s < STEPS; ++s) {
        if (s == STEPS / 2) {
          // The second half of the steps reduces through the C# hook.
          ddp.Dispose();
          ddp = new Ddp(model, pg, options, average);
        }
        Ddp d = ddp;
        d.PreForward();
        LoadParams(model, w, b);
        double loss = ForwardBackward(w, b, gw, gb, Batch(s), lo, hi - lo, BATCH, world, layer => {
          StoreGrads(model, layer, gw, gb);
          d.MarkGradReady(WeightName(layer));
          d.MarkGradReady(BiasName(layer));
        });
        d.FinishBackward();
        Sgd(model);
        if (rank == 0) Console.WriteLine("step {0} loss part {1:F6}", s + 1, loss);
      }
      Expect(average.Calls > 0, "the C# comm hook ran");
      Console.WriteLine("rank {0}: {1} buckets, the C# hook ran {2} times", rank, ddp.NumBuckets(), average.Calls);
      ddp.Dispose();
      CheckParity(model, "DDP rank " + rank + " of " + world);

      // Collectives of the group, from C#.
      using (var t = Tensor.Of(new float[] { rank + 1, 10 * (rank + 1), rank == 0 ? 7 : 0 }, 3)) {
        using (var work = pg.AllReduceAsync(t, ReduceOp.SUM)) {
          work.WaitFor();
          Expect(work.Test(), "the work is done after WaitFor");
        }
        float[] sum = t.ToArray();
        Expect(sum[0] == world * (world + 1) / 2f && sum[1] == 10 * sum[0], "all-reduce sums: " + sum[0] + ", " + sum[1]);
        pg.Broadcast(t, 0);
        Expect(t.ToArray()[2] == 7, "broadcast from rank 0");
        pg.Barrier();
      }

      // A hook that throws: FinishBackward rethrows it on every rank.
      using (var bad = new Ddp(model, pg, options, new Refusing())) {
        bad.PreForward();
        for (int l = LAYERS - 1; l >= 0; --l) {
          bad.MarkGradReady(WeightName(l));
          bad.MarkGradReady(BiasName(l));
        }
        try {
          bad.FinishBackward();
          Fail("FinishBackward returned although the hook threw");
        } catch (NotSupportedException e) {
          Expect(e.Message.StartsWith("hook refused bucket"), "the hook's own exception surfaces: " + e);
          Console.WriteLine("rank {0}: FinishBackward rethrew: {1}", rank, e.Message);
        }
      }
    }
  }

  // ---- fully_shard: 3 x Linear(3, 3) in `linears` (each and the whole
  // sharded), then `proj` under a Ddp; SGD on the shards ----

  const int DIM = 3, FROWS = 4, FSTEPS = 4;
  const double FLR = 0.2;
  static readonly string[] FWeights = { "linears.0.weight", "linears.1.weight", "linears.2.weight", "proj.weight" };

  static float FInitial(int layer, int k, float skew) {
    return 0.3f * (float)Math.Sin(1.7f * (layer * 9 + k) + 0.4f) + skew;
  }

  static void FBatch(int step, int rows, double[] x, double[] t) {
    for (int k = 0; k < rows * DIM; ++k) {
      x[k] = Math.Cos(0.37 * k + 0.91 * step);
      t[k] = 0.5 * Math.Sin(0.53 * k - 0.29 * step);
    }
  }

  /// y = x W^T over `rows` rows.
  static void Linear(double[] x, float[] w, double[] y, int rows) {
    for (int b = 0; b < rows; ++b) {
      for (int o = 0; o < DIM; ++o) {
        double sum = 0;
        for (int i = 0; i < DIM; ++i) sum += x[b * DIM + i] * w[o * DIM + i];
        y[b * DIM + o] = sum;
      }
    }
  }

  /// g += dy^T x; dx = dy W.
  static void LinearBackward(double[] dy, double[] x, float[] w, double[] g, double[] dx, int rows) {
    for (int b = 0; b < rows; ++b) {
      for (int o = 0; o < DIM; ++o) {
        for (int i = 0; i < DIM; ++i) g[o * DIM + i] += dy[b * DIM + o] * x[b * DIM + i];
      }
    }
    for (int b = 0; b < rows; ++b) {
      for (int i = 0; i < DIM; ++i) {
        double sum = 0;
        for (int o = 0; o < DIM; ++o) sum += dy[b * DIM + o] * w[o * DIM + i];
        dx[b * DIM + i] = sum;
      }
    }
  }

  /// Single-process training on the whole batch: the reference weights.
  static float[][] FReference(int world) {
    int rows = FROWS * world;
    var w = new float[4][];
    for (int l = 0; l < 4; ++l) {
      w[l] = new float[DIM * DIM];
      for (int k = 0; k < DIM * DIM; ++k) w[l][k] = FInitial(l, k, 0);
    }
    for (int s = 0; s < FSTEPS; ++s) {
      double[] x = new double[rows * DIM], t = new double[rows * DIM], dy = new double[rows * DIM], dx = new double[rows * DIM];
      var h = new double[5][];
      for (int i = 0; i < 5; ++i) h[i] = new double[rows * DIM];
      var g = new double[4][];
      FBatch(s, rows, x, t);
      Array.Copy(x, h[0], x.Length);
      for (int l = 0; l < 4; ++l) Linear(h[l], w[l], h[l + 1], rows);
      for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - t[k]) / rows;
      for (int l = 3; l >= 0; --l) {
        g[l] = new double[DIM * DIM];
        LinearBackward(dy, h[l], w[l], g[l], dx, rows);
        Array.Copy(dx, dy, dy.Length);
      }
      for (int l = 0; l < 4; ++l) {
        for (int k = 0; k < DIM * DIM; ++k) w[l][k] -= (float)(FLR * g[l][k]);
      }
    }
    return w;
  }

  class Toy : IDisposable {
    public Module Root = new Module(), Linears = new Module();
    public Module[] Layer = new Module[4];
    public Fsdp[] Fsdp = new Fsdp[3];
    public Fsdp FsdpLinears;
    public Ddp Ddp;

    public Toy(float skew) {
      for (int l = 0; l < 4; ++l) {
        var v = new float[DIM * DIM];
        for (int k = 0; k < v.Length; ++k) v[k] = FInitial(l, k, skew);
        Layer[l] = new Module();
        using (var w = Tensor.Of(v, DIM, DIM)) Layer[l].RegisterParameter("weight", w);
        if (l < 3) Linears.RegisterModule(l.ToString(), Layer[l]);
      }
      Root.RegisterModule("linears", Linears);
      Root.RegisterModule("proj", Layer[3]);
    }

    /// Children first; every rank in the same order.
    public void Shard(ProcessGroup pg, bool initSync, bool ddp, bool views = false) {
      var o = new FsdpOptions();
      o.InitSync = initSync;
      o.FullParamsAsViews = views;
      for (int l = 0; l < 3; ++l) Fsdp[l] = new Fsdp(Layer[l], pg, o);
      FsdpLinears = new Fsdp(Linears, pg);
      if (ddp) Ddp = new Ddp(Root, pg, new DdpOptions());
    }

    public void Dispose() {
      Ddp?.Dispose();
      FsdpLinears?.Dispose();
      for (int l = 2; l >= 0; --l) Fsdp[l]?.Dispose();
      foreach (Module m in Layer) m.Dispose();
      Linears.Dispose();
      Root.Dispose();
    }
  }

  static float[] Param(Module m, string name) {
    using (var t = m.GetParameter(name)) return t.ToArray();
  }

  static void AddGrad(Module m, string name, double[] delta) {
    using (var g = m.Grad(name)) {
      Span<float> v = g.AsSpan();
      for (int k = 0; k < v.Length; ++k) v[k] += (float)delta[k];
    }
  }

  static void FTrainStep(Toy toy, int step, int rank, int world) {
    const int rows = FROWS;
    int global = FROWS * world;
    double[] allX = new double[global * DIM], allT = new double[global * DIM];
    double[] dy = new double[rows * DIM], dx = new double[rows * DIM];
    var h = new double[5][];
    for (int i = 0; i < 5; ++i) h[i] = new double[rows * DIM];
    var w = new float[4][];
    FBatch(step, global, allX, allT);
    Array.Copy(allX, rank * rows * DIM, h[0], 0, rows * DIM);
    // Forward: unshard with the next layer prefetched, reshard after.
    toy.FsdpLinears.Unshard();
    toy.Fsdp[0].Unshard();
    for (int l = 0; l < 3; ++l) {
      if (l + 1 < 3) toy.Fsdp[l + 1].Unshard(true);
      toy.Fsdp[l].WaitUnshard();
      w[l] = Param(toy.Root, FWeights[l]);
      Linear(h[l], w[l], h[l + 1], rows);
      toy.Fsdp[l].Reshard();
    }
    toy.Ddp.PreForward();
    w[3] = Param(toy.Root, FWeights[3]);
    Linear(h[3], w[3], h[4], rows);
    for (int k = 0; k < rows * DIM; ++k) dy[k] = (h[4][k] - allT[rank * rows * DIM + k]) / rows;
    // Backward: proj through the Ddp, the linears through their Fsdp.
    for (int l = 3; l >= 0; --l) {
      var g = new double[DIM * DIM];
      if (l < 3) {
        if (l == 2) toy.Fsdp[2].Unshard();
        if (l > 0) toy.Fsdp[l - 1].Unshard(true);
        toy.Fsdp[l].WaitUnshard();
        w[l] = Param(toy.Root, FWeights[l]);
      }
      LinearBackward(dy, h[l], w[l], g, dx, rows);
      AddGrad(toy.Root, FWeights[l], g);
      if (l == 3) {
        toy.Ddp.MarkGradReady(FWeights[3]);
      } else if (l == 2) {
        toy.Fsdp[l].PostBackward();
      } else {
        // The per-parameter mark runs PostBackward; layer 0's explicit one
        // after it is a no-op.
        toy.Fsdp[l].MarkGradReady("weight");
        if (l == 0) toy.Fsdp[l].PostBackward();
      }
      Array.Copy(dx, dy, dy.Length);
    }
    toy.FsdpLinears.PostBackward();
    for (int l = 0; l < 3; ++l) toy.Fsdp[l].FinishBackward();
    toy.FsdpLinears.FinishBackward();
    toy.Ddp.FinishBackward();
    // SGD on the shards and on proj.
    for (int l = 0; l < 3; ++l) {
      using (var shard = toy.Fsdp[l].Shard(0))
      using (var grad = toy.Fsdp[l].ShardGrad(0)) {
        Span<float> v = shard.AsSpan(), gv = grad.AsSpan();
        for (int k = 0; k < v.Length; ++k) v[k] -= (float)FLR * gv[k];
      }
    }
    using (var p = toy.Root.GetParameter(FWeights[3]))
    using (var g = toy.Root.Grad(FWeights[3])) {
      Span<float> v = p.AsSpan(), gv = g.AsSpan();
      for (int k = 0; k < v.Length; ++k) v[k] -= (float)FLR * gv[k];
    }
    toy.Root.ZeroGrad();
  }

  static void ExpectWeights(Module root, float[][] expected, string what) {
    for (int l = 0; l < 4; ++l) {
      float[] got = Param(root, FWeights[l]);
      Expect(got.Length == DIM * DIM, what + ": " + FWeights[l] + " has " + got.Length + " elements");
      for (int k = 0; k < DIM * DIM; ++k) {
        Expect(Math.Abs(got[k] - expected[l][k]) <= 2e-5f * (1 + Math.Abs(expected[l][k])),
               what + ": " + FWeights[l] + "[" + k + "] is " + got[k] + ", expected " + expected[l][k]);
      }
    }
  }

  static void ExpectShardedWeights(Toy toy, float[][] expected, string what) {
    for (int l = 0; l < 3; ++l) toy.Fsdp[l].Unshard();
    ExpectWeights(toy.Root, expected, what);
    for (int l = 0; l < 3; ++l) toy.Fsdp[l].Reshard();
  }

  // Whether a write to layer 0's full weight (this rank's first element)
  // reached this rank's shard: it does with views, not with copies. dp_fsdp.h
  // tells hosts not to write full parameters with views; this write is safe
  // all the same, as only this rank's rows change, nobody reads them
  // meanwhile, and the shard is restored between barriers (no rank holds the
  // layer unsharded then).
  static void ExpectFullWeightsAreViews(Toy toy, ProcessGroup pg, int start, bool views) {
    float before;
    using (var shard = toy.Fsdp[0].Shard(0)) before = shard.AsSpan()[0];
    toy.Fsdp[0].Unshard();
    using (var full = toy.Root.GetParameter(FWeights[0])) full.AsSpan()[start * DIM] += 1;
    toy.Fsdp[0].Reshard();
    pg.Barrier();
    using (var shard = toy.Fsdp[0].Shard(0)) {
      Span<float> v = shard.AsSpan();
      Expect((v[0] != before) == views, "with fullParamsAsViews " + views + ", a write to the full weight " +
             (views ? "reaches" : "does not reach") + " the shard (" + before + " became " + v[0] + ")");
      v[0] = before;
    }
    pg.Barrier();
  }

  static void RunFsdp(bool views) {
    var cpu0 = new Device("cpu:0");
    using (var pg = ProcessGroup.FromEnv(cpu0, 60000)) {
      int rank = pg.Rank(), world = pg.Size();
      float[][] expected = FReference(world);
      string stem = Path.Combine(Path.GetTempPath(), "dparallel-cs-fsdp-" + Environment.GetEnvironmentVariable("MASTER_PORT"));
      using (var toy = new Toy(0.05f * rank)) {  // init sync: rank 0's values
        toy.Shard(pg, true, true, views);
        // torch.chunk's split of the 3 rows.
        int chunk = (DIM + world - 1) / world, start = Math.Min(chunk * rank, DIM), count = Math.Min(chunk, DIM - start);
        for (int l = 0; l < 3; ++l) {
          Expect(toy.Fsdp[l].NumParameters() == 1 && toy.Fsdp[l].ParameterName(0) == "weight", "each linear's Fsdp holds its weight");
          using (var shard = toy.Fsdp[l].Shard(0)) {
            long[] shape = shard.ShapeArray();
            Expect(shape.Length == 2 && shape[0] == count && shape[1] == DIM,
                   "rank " + rank + " keeps " + count + " rows of " + FWeights[l] + ", not " + string.Join("x", shape));
          }
          using (var slot = toy.Root.GetParameter(FWeights[l])) {
            Expect(slot.ShapeArray()[0] == count, "the module's slot holds the shard once the Fsdp is made");
          }
        }
        Expect(toy.FsdpLinears.NumParameters() == 0, "the Fsdp over the linears finds every parameter held by a child's");
        Expect(toy.Ddp.NumBuckets() == 1, "the Ddp on the root manages proj alone");
        ExpectFullWeightsAreViews(toy, pg, start, views);
        for (int s = 0; s < FSTEPS; ++s) FTrainStep(toy, s, rank, world);
        ExpectShardedWeights(toy, expected, "rank " + rank + " after training");
        Console.WriteLine("rank {0}: fully_shard training matches single-process training on the whole batch", rank);

        // The full state dict in memory: on every rank, or on the last alone.
        using (var state = Fsdp.FullStateDict(toy.Root, pg, -1)) {
          ExpectWeights(state, expected, "the in-memory full state dict");
        }
        var onLast = Fsdp.FullStateDict(toy.Root, pg, world - 1);
        Expect((onLast != null) == (rank == world - 1), "the in-memory full state dict is on its root rank only");
        onLast?.Dispose();

        // The full state dict: rank 0 writes what Module.Save would for the
        // unsharded model; every rank loads its rows.
        string full = stem + ".safetensors", folder = stem + "-sharded";
        Fsdp.SaveFullStateDict(toy.Root, pg, full);
        pg.Barrier();
        using (var plain = new Toy(2)) {
          plain.Root.Load(full);
          ExpectWeights(plain.Root, expected, "the full state dict loaded into an unsharded model");
        }
        using (var other = new Toy(1 + rank)) {
          other.Shard(pg, false, false);
          Fsdp.LoadFullStateDict(other.Root, full);
          ExpectShardedWeights(other, expected, "rank " + rank + " after loading the full state dict");
        }
        // The sharded state dict: one file per rank.
        Fsdp.SaveShardedStateDict(toy.Root, pg, folder);
        pg.Barrier();
        using (var other = new Toy(3 + rank)) {
          other.Shard(pg, false, false);
          Fsdp.LoadShardedStateDict(other.Root, folder);
          ExpectShardedWeights(other, expected, "rank " + rank + " after loading the sharded state dict");
        }
        // In the background: the Work reports the save; it loads as the synchronous one.
        using (var saving = Fsdp.SaveShardedStateDictAsync(toy.Root, pg, folder + "-async")) {
          saving.WaitFor();
          Expect(saving.Test(), "the background save is done once waited for");
        }
        using (var other = new Toy(5 + rank)) {
          other.Shard(pg, false, false);
          Fsdp.LoadShardedStateDict(other.Root, folder + "-async");
          ExpectShardedWeights(other, expected, "rank " + rank + " after loading the background save");
        }
        pg.Barrier();
        if (rank == 0) {
          File.Delete(full);
          Directory.Delete(folder, true);
          Directory.Delete(folder + "-async", true);
        }
      }
      Console.WriteLine("rank {0}: full and sharded state dicts load back", rank);
    }
  }

  // ---- tensors: pinned arrays, DLPack, coalesced collectives, memory, shutdown ----

  static void ExpectValues(string what, float[] got, float[] want) {
    bool same = got.Length == want.Length;
    for (int i = 0; same && i < got.Length; ++i) same = got[i] == want[i];
    Expect(same, what + ": " + string.Join(",", got) + ", not " + string.Join(",", want));
  }

  /// A parameter over a pinned array that only the module refers to once
  /// this returns (made on a thread of its own: Mono scans stacks
  /// conservatively).
  static WeakReference ParameterOverDroppedArray(Module m, float[] values) {
    WeakReference weak = null;
    var maker = new Thread(() => {
      var array = (float[])values.Clone();
      using (var t = Tensor.FromArray(array, array.Length)) m.RegisterParameter("w", t);
      weak = new WeakReference(array);
    });
    maker.Start();
    maker.Join();
    return weak;
  }

  static void RunTensors() {
    Expect(DType.ElementSize(DType.FLOAT32) == 4 && DType.ElementSize(DType.FLOAT16) == 2 && DType.ElementSize(DType.INT64) == 8,
           "DType.ElementSize gives the bytes per element");
    ExpectInvalid(() => DType.ElementSize(99), "'dtype'");

    // A tensor over a pinned array: both see each other's writes.
    var array = new float[] { 1, 2, 3, 4, 5, 6 };
    using (var t = Tensor.FromArray(array, 2, 3)) {
      ExpectValues("the tensor over the array", t.ToArray(), array);
      t.CopyFrom(new float[] { 6, 5, 4, 3, 2, 1 });
      Expect(array[0] == 6 && array[5] == 1, "the array holds what was copied into the tensor");
      array[2] = 40;
      Expect(t.ToArray()[2] == 40, "the tensor sees a write to the array");
    }
    using (var t = Tensor.FromArray(new long[] { 7, 8 }, 2)) Expect(t.Dtype() == DType.INT64, "a long[] is an int64 tensor");
    ExpectInvalid(() => Tensor.FromArray(new float[3], 4).Dispose(), "'buffer'");
    ExpectInvalid(() => Tensor.FromArray(new short[3], 3).Dispose(), "'array'");
    ExpectInvalid(() => Tensor.FromArray((float[])null, 3).Dispose(), "'array'");
    // The module keeps the array alive and pinned; disposing it lets it go.
    float[] big = DistinctValues(1 << 20, 1);
    var m = new Module();
    WeakReference weak = ParameterOverDroppedArray(m, big);
    for (int i = 0; i < 3; ++i) {
      GC.Collect();
      GC.WaitForPendingFinalizers();
    }
    Expect(weak.IsAlive, "the module's parameter keeps its array alive");
    using (var w = m.GetParameter("w")) Expect(System.Linq.Enumerable.SequenceEqual(w.ToArray(), big), "the parameter over a dropped array keeps its values");
    m.Dispose();
    var deadline = DateTime.UtcNow.AddSeconds(30);
    while (weak.IsAlive) {
      Expect(DateTime.UtcNow < deadline, "the array is collected once no tensor is over it");
      Tensor.FreeUnpinned();
      GC.Collect();
      GC.WaitForPendingFinalizers();
    }

    // DLPack: out and back in, the same memory.
    float[] v = DistinctValues(6, 3);
    var original = Tensor.Of(v, 2, 3);
    IntPtr address = original.ToDlpack();
    Expect(address != IntPtr.Zero, "ToDlpack gives an address");
    var back = Tensor.FromDlpack(address);
    ExpectValues("the DLPack tensor", back.ToArray(), v);
    Span<float> originalValues = original.AsSpan();
    originalValues[4] = 42;
    Expect(back.ToArray()[4] == 42, "a write through the original is seen through the DLPack tensor: zero copy");
    original.Dispose();
    v[4] = 42;
    ExpectValues("the DLPack tensor after the original is disposed", back.ToArray(), v);
    back.Dispose();
    using (var t = Tensor.Of(v, 6)) Tensor.DeleteDlpack(t.ToDlpack());
    ExpectInvalid(() => Tensor.FromDlpack(IntPtr.Zero), "'address'");
    // DLPack 1.x: in place, or copied when exported read-only.
    using (var x = Tensor.Of(v, 2, 3)) {
      using (var inPlace = Tensor.FromDlpackVersioned(x.ToDlpackVersioned(false)))
      using (var copied = Tensor.FromDlpackVersioned(x.ToDlpackVersioned(true))) {
        Span<float> xs = x.AsSpan();
        xs[0] = 17;
        Expect(inPlace.ToArray()[0] == 17, "a versioned DLPack tensor shares the original's memory");
        Expect(copied.ToArray()[0] == v[0], "a read-only versioned DLPack tensor is a copy");
      }
      Tensor.DeleteDlpackVersioned(x.ToDlpackVersioned(true));
    }
    ExpectInvalid(() => Tensor.FromDlpackVersioned(IntPtr.Zero), "'address'");

    // Coalesced collectives across cpu:0 and cpu:1.
    DeviceList devices = Device.List("cpu:0,cpu:1");
    var cpu0 = new Device("cpu:0");
    using (var x = Tensor.Of(new float[] { 1, 2, 3 }, 3))
    using (var y = Tensor.Of(new float[] { 4, 5 }, 2))
    using (var copies = Parallel.BroadcastCoalesced(new TensorVector { x, y }, devices, 0))
    using (var x1 = copies.Get(2))
    using (var y1 = copies.Get(3)) {
      Expect(copies.Size() == 4 && x1.GetDevice().ToString() == "cpu:1", "BroadcastCoalesced puts item 2 on cpu:1");
      ExpectValues("tensor 1 on cpu:1", y1.ToArray(), new float[] { 4, 5 });
      using (var sums = Parallel.ReduceAddCoalesced(new TensorVector { x, y, x1, y1 }, 2, cpu0, 0))
      using (var sx = sums.Get(0))
      using (var sy = sums.Get(1)) {
        ExpectValues("the sum of tensor 0", sx.ToArray(), new float[] { 2, 4, 6 });
        ExpectValues("the sum of tensor 1", sy.ToArray(), new float[] { 8, 10 });
      }
      ExpectInvalid(() => Parallel.ReduceAddCoalesced(new TensorVector { x, y, x1 }, 2, cpu0, 0).Dispose(), "'inputs'");
    }

    // Buffers by index.
    using (var model = new Module())
    using (var mean = Tensor.Of(new float[] { 7, 8 }, 2)) {
      model.RegisterBuffer("running_mean", mean);
      Expect(model.NumBuffers() == 1 && model.BufferName(0) == "running_mean", "buffer 0 is running_mean");
      using (var b0 = model.Buffer(0)) ExpectValues("buffer 0", b0.ToArray(), new float[] { 7, 8 });
    }

    // Memory stats count a 4 MiB tensor.
    const long bytes = 4L << 20;
    MemoryStats before = cpu0.MemoryStats();
    var held = new Tensor(cpu0, bytes / 4);
    MemoryStats during = cpu0.MemoryStats();
    Expect(during.AllocatedBytes() - before.AllocatedBytes() >= bytes, "AllocatedBytes counts the new tensor");
    held.Dispose();
    MemoryStats after = cpu0.MemoryStats();
    Expect(after.AllocatedBytes() <= during.AllocatedBytes() - bytes, "disposing the tensor gives its bytes back");
    Expect(after.PeakAllocatedBytes() >= during.AllocatedBytes(), "the peak remembers the tensor");
    cpu0.ResetPeakMemory();
    Expect(cpu0.MemoryStats().PeakAllocatedBytes() < during.AllocatedBytes(), "ResetPeakMemory forgets the tensor");

    // Shutdown ends the library's threads; they start again when needed.
    Library.Shutdown();
    Library.Shutdown();
    using (var x = Tensor.Of(new float[] { 1, 2 }, 2))
    using (var copies = Parallel.Broadcast(x, devices))
    using (var c = copies.Get(1)) {
      ExpectValues("a copy to cpu:1 after Shutdown", c.ToArray(), new float[] { 1, 2 });
    }
    Console.WriteLine("pinned arrays, DLPack, coalesced collectives, buffers, memory stats, shutdown");
  }

  // ---- streams ----

  static void RunStreams() {
    var cpu0 = new Device("cpu:0");
    Expect(DeviceStream.Current(cpu0) == null, "no current stream at first");
    var s = new DeviceStream(cpu0);
    var seen = new List<int>();
    Thread caller = Thread.CurrentThread;
    Thread ranOn = null;
    s.LaunchHostFunc(() => { lock (seen) seen.Add(1); });
    s.LaunchHostFunc(() => {
      lock (seen) seen.Add(2);
      ranOn = Thread.CurrentThread;
    });
    s.Synchronize();
    Expect(seen.Count == 2 && seen[0] == 1 && seen[1] == 2, "host functions ran in order");
    Expect(ranOn != null && ranOn != caller, "a host function runs on the stream's thread");
    s.LaunchHostFunc(() => { throw new InvalidOperationException("host function failed"); });
    try {
      s.Synchronize();
      Fail("Synchronize returned although a host function threw");
    } catch (InvalidOperationException e) {
      Expect(e.Message == "host function failed", "the host function's exception surfaces: " + e.Message);
    }
    s.MakeCurrent();
    using (var current = DeviceStream.Current(cpu0)) Expect(current.Pointer() == s.Pointer(), "MakeCurrent makes it current");
    using (var t = Tensor.Of(new float[] { 1, 2, 3 }, 3))
    using (var copy = t.To(cpu0)) {
      s.Synchronize();
      ExpectValues("a copy queued on the current stream", copy.ToArray(), new float[] { 1, 2, 3 });
    }
    DeviceStream.ClearCurrent(cpu0);
    Expect(DeviceStream.Current(cpu0) == null, "ClearCurrent leaves no current stream");
    ExpectInvalid(() => s.LaunchHostFunc(null), "'fn'");
    s.Dispose();
    Expect(s.IsClosed(), "a disposed stream says so");
    Console.WriteLine("streams: host functions and current streams");
  }

  // ---- the process group's collectives ----

  // Subgroups and meshes on the ranks of one host: a split that reverses
  // the ranks, one that rank 0 alone joins, the 1-D and by-host meshes, and
  // a mesh's group that outlives the mesh's Dispose().
  static void RunMesh() {
    using (var pg = ProcessGroup.FromEnv(new Device("cpu:0"), 60000)) {
      int rank = pg.Rank(), world = pg.Size();
      Expect(pg.LocalRank() == rank && pg.LocalSize() == world && pg.NumHosts() == 1,
             "one host: local rank " + pg.LocalRank() + " of " + pg.LocalSize() + " on " + pg.NumHosts() + " host(s)");
      using (var reversed = pg.Split(0, -rank)) {
        Expect(reversed.Rank() == world - 1 - rank && reversed.Size() == world, "split by key -rank: rank " + reversed.Rank());
        using (var t = Tensor.Of(new float[] { rank }, 1)) {
          reversed.Broadcast(t, 0);
          Expect(t.ToArray()[0] == world - 1, "broadcast from the reversed group's rank 0: " + t.ToArray()[0]);
        }
      }
      ProcessGroup alone = pg.Split(rank == 0 ? 7 : -1, 0);
      Expect((alone != null) == (rank == 0), "a negative color joins no group");
      if (alone != null) {
        Expect(alone.Size() == 1, "rank 0 alone: size " + alone.Size());
        alone.Dispose();
      }
      using (var again = pg.Shrink()) {
        Expect(again.Rank() == rank && again.Size() == world && again.LostRanks().Count == 0,
            "a shrink with no rank lost: rank " + again.Rank() + " of " + again.Size());
        using (var t = Tensor.Of(new float[] { rank + 1 }, 1)) {
          again.AllReduce(t);
          Expect(t.ToArray()[0] == world * (world + 1) / 2, "all_reduce over the shrunk group: " + t.ToArray()[0]);
        }
      }
      using (var mesh = DeviceMesh.Create(pg, new[] { world }, "dp")) {
        Expect(mesh.Ndim() == 1 && mesh.DimName(0) == "dp", "a 1-D mesh named dp");
        Expect(mesh.Shape()[0] == world && mesh.Coordinate()[0] == rank, "the mesh's shape and this rank's coordinate");
        ExpectInvalid(() => mesh.Group("tp"), "'tp'");
        ProcessGroup dp = mesh.Group("dp");
        mesh.Dispose();
        using (var t = Tensor.Of(new float[] { rank + 1 }, 1)) {
          dp.AllReduce(t, ReduceOp.SUM);
          Expect(t.ToArray()[0] == world * (world + 1) / 2, "all_reduce over the mesh's group after the mesh's Dispose: " + t.ToArray()[0]);
        }
        dp.Dispose();
      }
      ExpectInvalid(() => DeviceMesh.Create(pg, new[] { world + 1 }), "'shape'");
      using (var hosts = DeviceMesh.ByHost(pg))
      using (var local = hosts.Group("local"))
      using (var across = hosts.Group("host")) {
        Expect(hosts.Shape()[0] == 1 && hosts.Shape()[1] == world, "by host: one row of " + world);
        Expect(local.Size() == world && local.Backend() == "shm", "the local group is this host's, on shm: " + local.Backend());
        Expect(across.Size() == 1, "one host: the host group is this rank alone");
        // HSDP on the by-host mesh: shards over "local", rank 0's values (init_sync).
        using (var m = new Module())
        using (var w = Tensor.Of(new float[] { rank, 1, 2, 3 }, 4)) {
          m.RegisterParameter("w", w);
          using (var f = new Fsdp(m, hosts))
          using (var shard = f.Shard(0)) {
            float[] got = shard.ToArray();
            Expect(got.Length == 2 && got[0] == 2 * rank && got[1] == 2 * rank + 1,
                   "the shard on the mesh's local group: " + string.Join(", ", got));
          }
        }
      }
    }
  }

  static void RunCollectives() {
    using (var pg = ProcessGroup.FromEnv(new Device("cpu:0"), 60000)) {
      int rank = pg.Rank(), world = pg.Size();
      using (var input = Tensor.Of(new float[] { rank + 1, 10 * (rank + 1) }, 2)) {
        var outs = new TensorVector();
        for (int r = 0; r < world; ++r) outs.Add(new Tensor(2));
        using (var w = pg.AllGatherAsync(input, outs)) w.WaitFor();
        for (int r = 0; r < world; ++r) ExpectValues("AllGather output " + r, outs[r].ToArray(), new float[] { r + 1, 10 * (r + 1) });
        pg.AllGather(input, outs);
        foreach (Tensor o in outs) o.Dispose();
      }
      var ins = new TensorVector();
      for (int j = 0; j < world; ++j) ins.Add(Tensor.Of(new float[] { 100 * rank + j }, 1));
      float want = 0;
      for (int r = 0; r < world; ++r) want += 100 * r + rank;
      using (var output = new Tensor(1)) {
        pg.ReduceScatter(ins, output, ReduceOp.SUM);
        Expect(output.ToArray()[0] == want, "ReduceScatter sums this rank's inputs: " + output.ToArray()[0]);
        using (var w = pg.ReduceScatterAsync(ins, output, ReduceOp.MIN)) w.WaitFor();
        Expect(output.ToArray()[0] == rank, "ReduceScatterAsync takes the minimum");
      }
      foreach (Tensor t in ins) t.Dispose();
      using (var t = Tensor.Of(new float[] { rank }, 1)) {
        using (var w = pg.BroadcastAsync(t, world - 1)) w.WaitFor();
        Expect(t.ToArray()[0] == world - 1, "BroadcastAsync from the last rank");
      }
      using (var w = pg.BarrierAsync()) w.WaitFor();
      Console.WriteLine("rank {0}: collectives on {1}", rank, pg.Backend());
    }
  }

  // ---- DDP additions: join, the optimizer inside backward, parameterUsed, plans ----

  static readonly string[] Flat = { "a", "b", "c" };
  static readonly int[] FlatNumel = { 4, 3, 2 };
  const float FlatLr = 0.25f;

  static Module FlatModule() {
    var m = new Module();
    for (int p = 0; p < 3; ++p) {
      var v = new float[FlatNumel[p]];
      for (int k = 0; k < v.Length; ++k) v[k] = k;
      using (var t = Tensor.Of(v, v.Length)) m.RegisterParameter(Flat[p], t);
    }
    return m;
  }

  static DdpOptions BucketPerParameter() {
    return new DdpOptions { BucketCapMb = 4 / 1048576.0, FirstBucketCapMb = 4 / 1048576.0 };
  }

  static float[] FlatParams(Module m) {
    var output = new List<float>();
    foreach (string name in Flat) output.AddRange(Param(m, name));
    return output.ToArray();
  }

  static void SetFlatGrad(Module m, int p, float[] values) {
    using (var g = m.Grad(Flat[p])) g.CopyFrom(values);
  }

  static void SgdParameter(Module m, int p) {
    using (var w = m.GetParameter(Flat[p]))
    using (var g = m.Grad(Flat[p])) {
      Span<float> wv = w.AsSpan(), gv = g.AsSpan();
      for (int k = 0; k < wv.Length; ++k) wv[k] -= FlatLr * gv[k];
    }
  }

  class StepInside : BucketReduced {
    public Module M;
    public int[] Reported = new int[3];

    public override void Reduced(Ddp ddp, ulong bucketIndex, ulong[] parameters) {
      foreach (ulong p in parameters) {
        ++Reported[p];
        if (!ddp.ParameterUsed(p)) throw new InvalidOperationException("parameter " + p + " unused");
        SgdParameter(M, (int)p);
      }
    }
  }

  class Failing : BucketReduced {
    public override void Reduced(Ddp ddp, ulong bucketIndex, ulong[] parameters) {
      throw new IOException("step failed in bucket " + bucketIndex);
    }
  }

  /// Rank r has 4 - 2 min(r, 1) batches; SGD inside backward or after.
  static float[] TrainFlat(ProcessGroup pg, bool inside) {
    int rank = pg.Rank();
    using (var m = FlatModule()) {
      var step = new StepInside { M = m };
      DdpOptions o = BucketPerParameter();
      if (inside) o.SetOnBucketReduced(step);
      using (var ddp = new Ddp(m, pg, o)) {
        int batches = rank == 0 ? 4 : 2;
        for (int i = 0; i < batches; ++i) {
          ddp.PreForward();
          for (int p = 0; p < 3; ++p) {
            var g = new float[FlatNumel[p]];
            for (int k = 0; k < g.Length; ++k) g[k] = (rank + 1) * (i + 2) + p + k;
            SetFlatGrad(m, p, g);
          }
          foreach (string name in new[] { "c", "b", "a" }) ddp.MarkGradReady(name);
          ddp.FinishBackward();
          if (!inside) for (int p = 0; p < 3; ++p) SgdParameter(m, p);
        }
        Ddp.Join(ddp);
        // Once per synced iteration of this rank's own (not those it stands in for after joining).
        if (inside) Expect(step.Reported[0] == batches && step.Reported[2] == batches, "each parameter reported once per synced iteration: " + step.Reported[0]);
        DdpStats stats = ddp.LastStats();
        Expect(stats.NumBuckets() == ddp.NumBuckets() && ddp.NumBuckets() == 3 && stats.ExposedMs() <= stats.ReduceMs(), "the stats match the plan");
      }
      return FlatParams(m);
    }
  }

  static void RunDdpExtras() {
    using (var pg = ProcessGroup.FromEnv(new Device("cpu:0"), 60000)) {
      int rank = pg.Rank(), world = pg.Size();
      float[] inside = TrainFlat(pg, true), after = TrainFlat(pg, false);
      ExpectValues("SGD inside backward against after FinishBackward, with a join", inside, after);
      // The join's reference: iteration i averages, over the initial world
      // size, the gradients of the ranks with more than i batches.
      var expected = new List<float>();
      for (int p = 0; p < 3; ++p) {
        for (int k = 0; k < FlatNumel[p]; ++k) {
          double value = k;
          for (int i = 0; i < 4; ++i) {
            double sum = 0;
            for (int r = 0; r < world; ++r) if ((r == 0 ? 4 : 2) > i) sum += (r + 1) * (i + 2) + p + k;
            value -= FlatLr * sum / world;
          }
          expected.Add((float)value);
        }
      }
      float[] want = expected.ToArray();
      for (int k = 0; k < want.Length; ++k) {
        Expect(Math.Abs(after[k] - want[k]) <= 1e-5f * (1 + Math.Abs(want[k])), "rank " + rank + " value " + k + " is " + after[k] + " after the join, expected " + want[k]);
      }

      using (var m = FlatModule()) {
        var o = BucketPerParameter();
        o.FindUnusedParameters = true;
        string plan;
        using (var ddp = new Ddp(m, pg, o)) {
          SetFlatGrad(m, 0, new float[] { 1, 1, 1, 1 });
          ddp.MarkGradReady("a");
          ddp.FinishBackward();
          Expect(ddp.ParameterUsed(0) && !ddp.ParameterUsed(1) && !ddp.ParameterUsed(2), "only a is used");
          plan = ddp.BucketPlan();
        }
        var again = new DdpOptions { BucketPlan = plan };
        using (var ddp = new Ddp(m, pg, again)) Expect(ddp.BucketPlan() == plan && ddp.NumBuckets() == 3, "the plan fed back is the plan");
        var failing = BucketPerParameter();
        failing.SetOnBucketReduced(new Failing());
        using (var ddp = new Ddp(m, pg, failing)) {
          foreach (string name in new[] { "c", "b", "a" }) ddp.MarkGradReady(name);
          try {
            ddp.FinishBackward();
            Fail("FinishBackward returned although the callback threw");
          } catch (IOException e) {
            Expect(e.Message.StartsWith("step failed in bucket"), "the callback's own exception surfaces: " + e.Message);
          }
        }
      }
      // Rebind: each rank goes on over a group of its own (split by rank),
      // the plan kept; the average over one rank is its own gradient.
      using (var m = FlatModule())
      using (var ddp = new Ddp(m, pg, BucketPerParameter())) {
        foreach (string name in new[] { "c", "b", "a" }) ddp.MarkGradReady(name);
        ddp.FinishBackward();
        string plan = ddp.BucketPlan();
        using (var alone = pg.Split(rank, 0)) ddp.Rebind(alone);
        Expect(ddp.BucketPlan() == plan, "Rebind keeps the plan: " + ddp.BucketPlan());
        for (int p = 0; p < Flat.Length; ++p) {
          SetFlatGrad(m, p, Enumerable.Repeat(rank + p + 0.5f, FlatNumel[p]).ToArray());
          ddp.MarkGradReady(Flat[p]);
        }
        ddp.FinishBackward();
        for (int p = 0; p < Flat.Length; ++p) {
          using (var g = m.Grad(Flat[p]))
            ExpectValues("gradient " + Flat[p] + " after the rebind onto a group of one", g.ToArray(),
                         Enumerable.Repeat(rank + p + 0.5f, FlatNumel[p]).ToArray());
        }
      }
      Console.WriteLine("rank {0}: join, optimizer inside backward, parameterUsed, plans, rebind", rank);
    }
  }

  public static int Main(string[] args) {
    string mode = args.Length > 0 ? args[0] : "";
    switch (mode) {
      case "data-parallel": RunDataParallel(); break;
      case "forward-throws": ForwardThrows(); break;
      case "bad-argument": BadArgument(); break;
      case "store": RunStore(); break;
      case "view-outlives-tensor": ViewOutlivesTensor(); break;
      case "closed-handles": ClosedHandles(); break;
      case "dispose-races": DisposeRaces(); break;
      case "ddp": RunDdp(); break;
      case "fsdp": RunFsdp(false); break;
      case "fsdp-views": RunFsdp(true); break;
      case "tensors": RunTensors(); break;
      case "streams": RunStreams(); break;
      case "collectives": RunCollectives(); break;
      case "ddp-extras": RunDdpExtras(); break;
      case "mesh": RunMesh(); break;
      default: Fail("usage: DParallelTest data-parallel|forward-throws|bad-argument|store|view-outlives-tensor|closed-handles|dispose-races|tensors|streams|ddp|fsdp|fsdp-views|collectives|ddp-extras|mesh"); break;
    }
    GC.Collect();
    GC.WaitForPendingFinalizers();
    Console.WriteLine("OK " + mode);
    return 0;
  }
}
