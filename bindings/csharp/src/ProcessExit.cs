using System;

namespace DParallel {

// Mono, once Main returns, waits for the threads it has seen, and the
// library's device workers are among them once a callback ran there (Mono
// attaches them as background threads, which it aborts and then waits for:
// a thread blocked in native code never ends). ProcessExit fires after the
// foreground threads are joined and before that wait, so ending the
// library's threads there lets Mono exit.
static class ProcessExit {
  internal static bool Register() {
    AppDomain.CurrentDomain.ProcessExit += (sender, e) => {
      try {
        Library.Shutdown();
      } catch (DParallelException) {
        // Status.STATE: Environment.Exit called in a callback, on a worker.
      }
    };
    return true;
  }
}

}
