// Stores, process groups and their async work.
%{
#include "dpswig_dist.hpp"
%}
%newobject dpswig::Store::tcp;
%newobject dpswig::Store::file;
%newobject dpswig::ProcessGroup::fromEnv;
%newobject dpswig::ProcessGroup::create;
%newobject dpswig::ProcessGroup::allReduceAsync;
%newobject dpswig::ProcessGroup::broadcastAsync;
%newobject dpswig::ProcessGroup::allGatherAsync;
%newobject dpswig::ProcessGroup::reduceScatterAsync;
%newobject dpswig::ProcessGroup::barrierAsync;
%newobject dpswig::ProcessGroup::split;
%newobject dpswig::DeviceMesh::create;
%newobject dpswig::DeviceMesh::byHost;
%newobject dpswig::DeviceMesh::group;
%ignore dpswig::mutableArgs;
%ignore dpswig::Work::Work(dp_work*);
%ignore dpswig::ProcessGroup::ProcessGroup(dp_process_group*, bool);
%ignore dpswig::ProcessGroup::ProcessGroup(dp_process_group*, std::shared_ptr<void>);

%template(IntVector) std::vector<int>;

%include "dpswig_dist.hpp"
