// Programs that run C# callbacks on the library's threads (which attaches
// those threads to Mono) and then return from Main: Mono must exit with
// Main's status instead of waiting for those threads forever.
//
//   mono ExitTest.exe forward     dataParallel with a C# forward on cpu:0,cpu:1
//   mono ExitTest.exe shutdown    the same, then Library.Shutdown() ends the
//                                 library's threads and the next call starts them
//   mono ExitTest.exe hook-open   a one-rank DDP step through a C# comm hook,
//                                 its Ddp, ProcessGroup and Store left open
//   mono ExitTest.exe fsdp-open   a one-rank Fsdp left undisposed: its
//                                 finalizer's warning must not fail the exit
using System;
using System.Collections.Generic;
using System.IO;
using System.Threading;
using DParallel;

static class ExitTest {
  static void Expect(bool ok, string message) {
    if (!ok) {
      Console.Error.WriteLine("FAIL: " + message);
      Environment.Exit(1);
    }
  }

  class Twice : ForwardFunction {
    public int Calls;

    public override Tensor Forward(ulong index, Module replica, Tensor input, Device device) {
      Interlocked.Increment(ref Calls);
      Span<float> v = input.AsSpan();
      for (int k = 0; k < v.Length; ++k) v[k] *= 2;
      return input;
    }
  }

  class Sum : CommHook {
    public int Calls;

    public override void Reduce(ProcessGroup pg, ulong bucketIndex, Tensor bucket) {
      Interlocked.Increment(ref Calls);
      pg.AllReduce(bucket, ReduceOp.SUM);
    }
  }

  static void DataParallel() {
    var twice = new Twice();
    using (var model = new Module())
    using (var x = Tensor.Of(new float[] { 1, 2, 3, 4, 5, 6, 7, 8 }, 4, 2))
    using (var y = Parallel.DataParallel(model, x, Device.List("cpu:0,cpu:1"), new Device("cpu:0"), 0, twice)) {
      float[] got = y.ToArray();
      for (int k = 0; k < 8; ++k) Expect(got[k] == 2 * (k + 1), "element " + k + " of the output is " + got[k]);
    }
    Expect(twice.Calls == 2, "the forward ran once per device, not " + twice.Calls + " times");
  }

  // Names of this process's threads that the library made (dp-dev, dp-pool, dp-stream).
  static List<string> LibraryThreads() {
    var names = new List<string>();
    foreach (string task in Directory.GetDirectories("/proc/self/task")) {
      string name;
      try {
        name = File.ReadAllText(Path.Combine(task, "comm")).Trim();
      } catch (IOException) {
        continue;  // the thread ended meanwhile
      }
      if (name.StartsWith("dp-")) names.Add(name);
    }
    return names;
  }

  static void HookOpen() {
    var cpu0 = new Device("cpu:0");
    var store = Store.Tcp("127.0.0.1", 0, 1, true, 10000);
    var pg = ProcessGroup.Create(store, 0, 1, cpu0, 10000);
    var model = new Module();
    model.RegisterParameter("w", Tensor.Of(new float[] { 1, 2 }, 2), true);
    var hook = new Sum();
    var ddp = new Ddp(model, pg, new DdpOptions(), hook);
    ddp.PreForward();
    model.Grad("w").CopyFrom(new float[] { 3, 4 });
    ddp.MarkGradReady("w");
    ddp.FinishBackward();
    Expect(hook.Calls > 0, "the C# comm hook ran");
    float[] g = model.Grad("w").ToArray();
    Expect(g[0] == 3 && g[1] == 4, "one rank's sum is its own gradient: " + g[0] + ", " + g[1]);
  }

  // Reachable still when Environment.Exit runs its finalizer.
  static Fsdp openFsdp;

  // A one-rank Fsdp left undisposed: its finalizer (which keeps it open,
  // since disposing is collective) runs while Mono shuts down.
  static void FsdpOpen() {
    var cpu0 = new Device("cpu:0");
    var store = Store.Tcp("127.0.0.1", 0, 1, true, 10000);
    var pg = ProcessGroup.Create(store, 0, 1, cpu0, 10000);
    var model = new Module();
    model.RegisterParameter("w", Tensor.Of(new float[] { 1, 2, 3, 4 }, 2, 2), true);
    openFsdp = new Fsdp(model, pg);
    openFsdp.Unshard();
    openFsdp.Reshard();
  }

  public static int Main(string[] args) {
    string mode = args.Length > 0 ? args[0] : "";
    switch (mode) {
      case "forward":
        DataParallel();
        break;
      case "shutdown":
        DataParallel();
        Expect(LibraryThreads().Exists(n => n.StartsWith("dp-dev")), "DataParallel started device workers: " + string.Join(", ", LibraryThreads()));
        Library.Shutdown();
        Expect(LibraryThreads().Count == 0, "no library thread is left after Shutdown(): " + string.Join(", ", LibraryThreads()));
        Library.Shutdown();
        DataParallel();
        Expect(LibraryThreads().Count > 0, "DataParallel after Shutdown() starts the workers again");
        break;
      case "hook-open":
        HookOpen();
        break;
      case "fsdp-open":
        FsdpOpen();
        // Environment.Exit runs the finalizers as Mono shuts down, after the
        // console's streams (opened here) are closed.
        Console.WriteLine("OK " + mode);
        Console.Error.WriteLine("exiting with an Fsdp open");
        Environment.Exit(0);
        break;
      default:
        Expect(false, "usage: ExitTest.exe forward|shutdown|hook-open|fsdp-open");
        break;
    }
    Console.WriteLine("OK " + mode);
    return 0;
  }
}
