// dp_shutdown as Parallel.shutdown() (Java) / Parallel.Shutdown() (C#): ends
// the library's device workers, compute pool and async default streams once
// their work is done; they start again on next use. The bindings call it at
// exit (java/NativeLibrary.java, csharp/ProcessExit.cs).
%{
namespace dpswig {
inline void shutdown() { check(dp_shutdown()); }
}  // namespace dpswig
%}
namespace dpswig {
void shutdown();
}
