// Streams: created on a device, made current per thread, or wrapped from
// the host's own (CUDA stream handles as addresses).
%{
#include "dpswig_stream.hpp"
%}
// DeviceStream: Stream would clash with System.IO.Stream and java.util.stream.Stream.
%rename(DeviceStream) dpswig::Stream;
%newobject dpswig::Stream::wrap;
%newobject dpswig::Stream::current;
%ignore dpswig::HostCall;
%ignore dpswig::HostCallArg;
#if defined(SWIGJAVA)
%rename(launchHostFuncRaw) dpswig::Stream::launchHostFunc;
%rename(synchronizeRaw) dpswig::Stream::synchronize;
#endif

%include "dpswig_stream.hpp"
