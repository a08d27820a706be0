// fully_shard: an Fsdp per module, children first, and the state dicts of
// sharded modules.
%{
#include "dpswig_fsdp.hpp"
%}
%newobject dpswig::Fsdp::shard;
%newobject dpswig::Fsdp::shardGrad;
%newobject dpswig::Fsdp::fullStateDict;
%newobject dpswig::Fsdp::saveShardedStateDictAsync;

%include "dpswig_fsdp.hpp"
