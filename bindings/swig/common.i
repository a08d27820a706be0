// Errors, constants and devices. Handles are closed through the language's
// own close()/Dispose(), so the C++ close() and the raw handle accessors stay
// hidden everywhere.
%{
#include "dpswig_common.hpp"
%}
%include <std_string.i>
// A null string argument is Status.INVALID naming it (SWIG's own check
// says only "null string").
#if defined(SWIGJAVA)
%typemap(javain) const std::string & "Args.text($javainput, \"$javainput\")"
#elif defined(SWIGCSHARP)
%typemap(csin) const std::string & "Args.Text($csinput, \"$csinput\")"
#endif
%include <std_vector.i>
%include <stdint.i>

%ignore dpswig::Error;
%ignore dpswig::check;
%ignore dpswig::fail_argument;
%ignore dpswig::rawDevices;
%ignore dpswig::PendingException;
%ignore dpswig::CallbackScope;
%ignore dpswig::Gate;
%ignore dpswig::Lease;
%ignore dpswig::TensorArgs;
%ignore dpswig::ModuleArgs;
%ignore dpswig::FloatSource;
%ignore dpswig::FloatSink;
%ignore dpswig::HostBytes;
%ignore dpswig::Device::raw;
%ignore dpswig::Device::fromRaw;
%ignore dpswig::MemoryStats::MemoryStats;
// close() waits for the calls in flight; each language's close()/Dispose()
// calls it as closeRaw.
%rename(closeRaw) *::close;
%ignore *::handle;
%ignore *::release;
%ignore *::handles;
%ignore *::trampoline;
%ignore *::rethrowPending;
// Each language's isClosed()/IsClosed() answers on a closed proxy too; the
// C++ one (the handle was handed to the library) is its native half.
%rename(isClosedRaw) *::isClosed;

%include "dpswig_common.hpp"

%template(DeviceList) std::vector<dpswig::Device>;
%template(LongVector) std::vector<long long>;
%template(StringVector) std::vector<std::string>;
%template(SizeVector) std::vector<size_t>;
