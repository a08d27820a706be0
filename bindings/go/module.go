package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import "unsafe"

// Module is a tree of named parameters and child modules. A replica handed
// to a forward callback is the library's: valid during the call only.
type Module struct {
	lib      *Library
	h        *C.dp_module
	borrowed bool
	lease    lease // the calls in flight; Close waits for them
}

// NewModule makes an empty module.
func (l *Library) NewModule() (*Module, error) {
	var h *C.dp_module
	err := l.call("dp_module_create", func(api *C.dp_api) C.dp_status { return C.dpgo_module_create(api, &h) })
	if err != nil {
		return nil, err
	}
	return &Module{lib: l, h: h}, nil
}

// call is lib.call on a module that may be nil, holding its handle (Close
// waits); on a closed module it is a StatusState error.
func (m *Module) call(op string, f func(api *C.dp_api) C.dp_status) error {
	if m == nil {
		return nilReceiver(op, "m", "*Module")
	}
	return held(&m.lease, op, "module", func() error { return m.lib.call(op, f) })
}

// use is lib.use, holding the module's handle.
func (m *Module) use(op string, f func(api *C.dp_api)) error {
	return held(&m.lease, op, "module", func() error { return m.lib.use(op, f) })
}

// arg holds the module as the argument `name` of op until the returned
// function runs; a closed one is an invalid argument.
func (m *Module) arg(op, name string) (func(), error) { return heldArg(&m.lease, op, name, "module") }

// Close drops this reference once the calls in flight on it (from other
// goroutines) have returned; the tree lives while any handle to it does.
// Inside a callback, while a call on this module runs, the reference is
// dropped when that call returns.
func (m *Module) Close() {
	if m == nil || m.borrowed {
		return
	}
	shutHandle(&m.lease, m.lib, "dp_module_destroy", &m.h, func(api *C.dp_api, h *C.dp_module) {
		C.dpgo_module_destroy(api, h)
	})
}

// RegisterParameter adds a parameter; the module holds its own reference to
// value, which the caller still closes.
func (m *Module) RegisterParameter(name string, value *Tensor, requiresGrad bool) error {
	var h *C.dp_tensor
	if value != nil {
		// nil registers an empty slot; a closed tensor is a mistake.
		done, err := value.arg("dp_module_register_parameter", "value")
		if err != nil {
			return err
		}
		defer done()
		h = value.h
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	rg := C.int(0)
	if requiresGrad {
		rg = 1
	}
	return m.call("dp_module_register_parameter", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_register_parameter(api, m.h, cname, h, rg)
	})
}

// RegisterModule adds child under name.
func (m *Module) RegisterModule(name string, child *Module) error {
	var h *C.dp_module
	if child != nil {
		done, err := child.arg("dp_module_register_module", "child")
		if err != nil {
			return err
		}
		defer done()
		h = child.h
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return m.call("dp_module_register_module", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_register_module(api, m.h, cname, h)
	})
}

// NumParameters counts the tree's parameters, each shared tensor once; 0 on
// a closed module or library.
func (m *Module) NumParameters() (n int) {
	if m == nil {
		return 0
	}
	m.use("dp_module_num_parameters", func(api *C.dp_api) { n = int(C.dpgo_module_num_parameters(api, m.h)) })
	return n
}

// ParameterNames lists the dotted names in registration order, depth first.
func (m *Module) ParameterNames() ([]string, error) {
	return m.names("dp_module_parameter_at",
		func(api *C.dp_api) C.size_t { return C.dpgo_module_num_parameters(api, m.h) },
		func(api *C.dp_api, i C.size_t, name **C.char, h **C.dp_tensor) C.dp_status {
			return C.dpgo_module_parameter_at(api, m.h, i, name, h)
		})
}

// names lists the names `at` gives for every index below `count`.
func (m *Module) names(op string, count func(*C.dp_api) C.size_t,
	at func(*C.dp_api, C.size_t, **C.char, **C.dp_tensor) C.dp_status) ([]string, error) {
	var names []string
	err := m.call(op, func(api *C.dp_api) C.dp_status {
		n := int(count(api))
		names = make([]string, 0, n)
		for i := 0; i < n; i++ {
			var name *C.char
			var h *C.dp_tensor
			if s := at(api, C.size_t(i), &name, &h); s != 0 {
				return s
			}
			names = append(names, C.GoString(name))
			C.dpgo_tensor_destroy(api, h)
		}
		return 0
	})
	if err != nil {
		return nil, err
	}
	return names, nil
}

// Parameter is a new reference to the parameter at the dotted name; it
// shares the module's storage.
func (m *Module) Parameter(name string) (*Tensor, error) {
	return m.tensorNamed("dp_module_get_parameter", name,
		func(api *C.dp_api, cname *C.char, h **C.dp_tensor) C.dp_status {
			return C.dpgo_module_get_parameter(api, m.h, cname, h)
		})
}

// tensorNamed calls fn's getter for the tensor at the dotted name and
// wraps the new reference it returns (nil stays nil).
func (m *Module) tensorNamed(fn, name string, get func(*C.dp_api, *C.char, **C.dp_tensor) C.dp_status) (*Tensor, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var h *C.dp_tensor
	if err := m.call(fn, func(api *C.dp_api) C.dp_status { return get(api, cname, &h) }); err != nil {
		return nil, err
	}
	return m.lib.ownedTensor(h), nil
}

// Grad is a new reference to the parameter's gradient (allocated zeroed on
// first use, then the same storage every time).
func (m *Module) Grad(name string) (*Tensor, error) {
	return m.tensorNamed("dp_module_grad", name, func(api *C.dp_api, cname *C.char, h **C.dp_tensor) C.dp_status {
		return C.dpgo_module_grad(api, m.h, cname, h)
	})
}

// ZeroGrad fills every allocated gradient with zeros.
func (m *Module) ZeroGrad() error {
	return m.call("dp_module_zero_grad", func(api *C.dp_api) C.dp_status { return C.dpgo_module_zero_grad(api, m.h) })
}

// Save writes the state dict as a safetensors file; Load reads one back.
func (m *Module) Save(path string) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return m.call("dp_module_save", func(api *C.dp_api) C.dp_status { return C.dpgo_module_save(api, m.h, cpath) })
}

func (m *Module) Load(path string, strict bool) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	s := C.int(0)
	if strict {
		s = 1
	}
	return m.call("dp_module_load", func(api *C.dp_api) C.dp_status { return C.dpgo_module_load(api, m.h, cpath, s) })
}

// RegisterBuffer adds a buffer (state that is not trained: running
// statistics, say); a non-persistent one is replicated but not saved. The
// module holds its own reference to value.
func (m *Module) RegisterBuffer(name string, value *Tensor, persistent bool) error {
	var h *C.dp_tensor
	if value != nil {
		done, err := value.arg("dp_module_register_buffer", "value")
		if err != nil {
			return err
		}
		defer done()
		h = value.h
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return m.call("dp_module_register_buffer", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_register_buffer(api, m.h, cname, h, cbool(persistent))
	})
}

// NumBuffers counts the tree's buffers, each shared tensor once; 0 on a
// closed module or library.
func (m *Module) NumBuffers() (n int) {
	if m == nil {
		return 0
	}
	m.use("dp_module_num_buffers", func(api *C.dp_api) { n = int(C.dpgo_module_num_buffers(api, m.h)) })
	return n
}

// BufferNames lists the buffers' dotted names in listing order.
func (m *Module) BufferNames() ([]string, error) {
	return m.names("dp_module_buffer_at",
		func(api *C.dp_api) C.size_t { return C.dpgo_module_num_buffers(api, m.h) },
		func(api *C.dp_api, i C.size_t, name **C.char, h **C.dp_tensor) C.dp_status {
			return C.dpgo_module_buffer_at(api, m.h, i, name, h)
		})
}

// Buffer is a new reference to the buffer at the dotted name; nil for a
// slot registered empty.
func (m *Module) Buffer(name string) (*Tensor, error) {
	return m.tensorNamed("dp_module_get_buffer", name, func(api *C.dp_api, cname *C.char, h **C.dp_tensor) C.dp_status {
		return C.dpgo_module_get_buffer(api, m.h, cname, h)
	})
}

// Submodule is a new reference to the child at the dotted name ("" is the
// module itself); nil for a slot registered empty.
func (m *Module) Submodule(name string) (*Module, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var h *C.dp_module
	err := m.call("dp_module_get_module", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_get_module(api, m.h, cname, &h)
	})
	if err != nil || h == nil {
		return nil, err
	}
	return &Module{lib: m.lib, h: h}, nil
}

// SetRequiresGrad sets whether a parameter or buffer requires grad: DDP
// and FSDP reduce gradients only for parameters that do.
func (m *Module) SetRequiresGrad(name string, requiresGrad bool) error {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return m.call("dp_module_set_requires_grad", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_set_requires_grad(api, m.h, cname, cbool(requiresGrad))
	})
}

func (m *Module) RequiresGrad(name string) (bool, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var out C.int
	err := m.call("dp_module_requires_grad", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_requires_grad(api, m.h, cname, &out)
	})
	return out != 0, err
}

// SetGrad makes grad (same dtype, shape and device as the parameter) the
// parameter's gradient, e.g. a TensorFromBlob over the host's own gradient
// buffer; nil drops it. Between backwards only.
func (m *Module) SetGrad(name string, grad *Tensor) error {
	var h *C.dp_tensor
	if grad != nil {
		done, err := grad.arg("dp_module_set_grad", "grad")
		if err != nil {
			return err
		}
		defer done()
		h = grad.h
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return m.call("dp_module_set_grad", func(api *C.dp_api) C.dp_status {
		return C.dpgo_module_set_grad(api, m.h, cname, h)
	})
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}
