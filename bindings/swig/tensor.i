// Tensors: created on a device, read and written in place (the language
// folders map hostBytes() to a direct buffer or a pointer) or from arrays.
%{
#include "dpswig_tensor.hpp"
%}
%newobject dpswig::Tensor::to;
%newobject dpswig::Tensor::share;
%newobject dpswig::Tensor::viewReference;
%newobject dpswig::TensorList::get;
%ignore dpswig::Tensor::Tensor(dp_tensor*, bool);
%newobject dpswig::Tensor::fromHost;
%newobject dpswig::Tensor::fromPointer;
%newobject dpswig::Tensor::fromDlpack;
%newobject dpswig::Tensor::fromDlpackVersioned;
%ignore dpswig::tensorArg;
%ignore dpswig::HostMemory;
%ignore dpswig::HostBuffer;
%ignore dpswig::Tensor::releaseHost;

%include "dpswig_tensor.hpp"

%template(TensorVector) std::vector<dpswig::Tensor*>;
