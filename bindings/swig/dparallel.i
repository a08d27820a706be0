// dparallel for Java and C#: one SWIG module, one interface per handle
// family. The language folders hold what differs between languages
// (exceptions, buffers, AutoCloseable/IDisposable, the callbacks' catch).
%module(directors="1") Parallel

#if defined(SWIGJAVA)
%include "java/dparallel_java.i"
#elif defined(SWIGCSHARP)
%include "csharp/dparallel_csharp.i"
#endif

%include "common.i"
%include "shutdown.i"
%include "tensor.i"
%include "comm.i"
%include "module.i"
%include "parallel.i"
%include "dist.i"
%include "ddp.i"
