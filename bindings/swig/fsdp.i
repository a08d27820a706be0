// fully_shard: an Fsdp per module, children first, and the state dicts of
// sharded modules.
%{
#include "dpswig_fsdp.hpp"
%}
%newobject dpswig::Fsdp::shard;
%newobject dpswig::Fsdp::shardGrad;
%newobject dpswig::Fsdp::fullStateDict;

%include "dpswig_fsdp.hpp"
