// In-process collectives across devices: broadcast, scatter, gather,
// reduce-add (functions of the module class).
%{
#include "dpswig_comm.hpp"
%}
%newobject dpswig::broadcast;
%newobject dpswig::scatter;
%newobject dpswig::gather;
%newobject dpswig::reduceAdd;
%newobject dpswig::broadcastCoalesced;
%newobject dpswig::reduceAddCoalesced;

%include "dpswig_comm.hpp"
