// Replication, parallel_apply, data_parallel and replica sets. The forward
// is a director class; each language derives its public ForwardFunction from
// ForwardFunctionBase, catching the host's exceptions on the worker thread,
// and wraps the *Raw calls to rethrow them on the caller's.
%{
#include "dpswig_parallel.hpp"
%}
%feature("director") dpswig::ForwardFunction;
%rename(ForwardFunctionBase) dpswig::ForwardFunction;
%ignore dpswig::functionArg;
%rename(dataParallelRaw) dpswig::dataParallel;
%rename(parallelApplyRaw) dpswig::parallelApply;
%rename(applyRaw) dpswig::ReplicaSet::apply;
%newobject dpswig::dataParallel;
%newobject dpswig::parallelApply;
%newobject dpswig::replicate;
%newobject dpswig::ReplicaSet::replica;
%newobject dpswig::ReplicaSet::apply;

%include "dpswig_parallel.hpp"
