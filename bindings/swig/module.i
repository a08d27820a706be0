// Modules: trees of named parameters, buffers and children.
%{
#include "dpswig_module.hpp"
%}
%newobject dpswig::Module::parameter;
%newobject dpswig::Module::getParameter;
%newobject dpswig::Module::getBuffer;
%newobject dpswig::Module::getModule;
%newobject dpswig::Module::grad;
%newobject dpswig::Module::buffer;
%newobject dpswig::ModuleList::get;
%ignore dpswig::Module::Module(dp_module*, bool);
%ignore dpswig::moduleArg;

%include "dpswig_module.hpp"

%template(ModuleVector) std::vector<dpswig::Module*>;
