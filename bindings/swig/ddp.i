// DistributedDataParallel. The custom comm hook is a director class; each
// language derives its public CommHook from CommHookBase and wraps
// finishBackwardRaw to rethrow the hook's exception on the caller's thread.
%{
#include "dpswig_ddp.hpp"
%}
%feature("director") dpswig::CommHook;
%rename(CommHookBase) dpswig::CommHook;
%rename(finishBackwardRaw) dpswig::Ddp::finishBackward;
%rename(withHookRaw) dpswig::Ddp::withHook;
%newobject dpswig::Ddp::withHook;
%ignore dpswig::DdpOptions::ignoredModules_;
%ignore dpswig::DdpOptions::ignoredParameters_;

%include "dpswig_ddp.hpp"
