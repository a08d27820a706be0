// fully_shard: an Fsdp per module, children first, and the state dicts of
// sharded modules.
%{
#include "dpswig_fsdp.hpp"
%}
%newobject dpswig::Fsdp::shard;
%newobject dpswig::Fsdp::shardGrad;

%include "dpswig_fsdp.hpp"
