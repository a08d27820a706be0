// DistributedDataParallel. The custom comm hook and the optimizer inside
// backward are director classes; each language derives its public CommHook
// and BucketReduced from CommHookBase and BucketReducedBase, and its Ddp
// constructors and finishBackward/join rethrow their exceptions on the
// caller's thread.
%{
#include "dpswig_ddp.hpp"
%}
%feature("director") dpswig::CommHook;
%feature("director") dpswig::BucketReduced;
%rename(CommHookBase) dpswig::CommHook;
%rename(BucketReducedBase) dpswig::BucketReduced;
%rename(finishBackwardRaw) dpswig::Ddp::finishBackward;
%rename(joinRaw) dpswig::Ddp::join;
%rename(createRaw) dpswig::Ddp::create;
%rename(withHookRaw) dpswig::Ddp::withHook;
%rename(setOnBucketReducedRaw) dpswig::DdpOptions::setOnBucketReduced;
%newobject dpswig::Ddp::create;
%newobject dpswig::Ddp::withHook;
%ignore dpswig::Ddp::Ddp(dp_ddp*, bool);
%ignore dpswig::DdpStats::DdpStats;
%ignore dpswig::DdpOptions::ignoredModules_;
%ignore dpswig::DdpOptions::ignoredParameters_;
%ignore dpswig::DdpOptions::onBucketReduced_;

%include "dpswig_ddp.hpp"

%template(DdpVector) std::vector<dpswig::Ddp*>;
