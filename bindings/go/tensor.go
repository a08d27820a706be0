package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime/cgo"
	"unsafe"
)

// DType is a tensor's element type.
type DType int32

const (
	Float32  DType = 0
	Float64  DType = 1
	Float16  DType = 2
	BFloat16 DType = 3
	Int8     DType = 4
	Uint8    DType = 5
	Int32    DType = 6
	Int64    DType = 7
	Bool     DType = 8
)

// Tensor is a reference to a dparallel tensor. Tensors handed to a forward
// callback are the library's: valid during the call only, and Close on them
// does nothing.
type Tensor struct {
	lib      *Library
	h        *C.dp_tensor
	borrowed bool
	lease    lease // the calls in flight; Close waits for them
}

// use and call run one entry point on the tensor's handle, which stays
// valid until they return (Close waits); on a closed tensor they are
// StatusState errors.
func (t *Tensor) use(op string, f func(api *C.dp_api)) error {
	return held(&t.lease, op, "tensor", func() error { return t.lib.use(op, f) })
}

func (t *Tensor) call(op string, f func(api *C.dp_api) C.dp_status) error {
	return held(&t.lease, op, "tensor", func() error { return t.lib.call(op, f) })
}

// arg holds the tensor as the argument `name` of op until the returned
// function runs; a closed one is an invalid argument.
func (t *Tensor) arg(op, name string) (func(), error) { return heldArg(&t.lease, op, name, "tensor") }

func (l *Library) ownedTensor(h *C.dp_tensor) *Tensor {
	if h == nil {
		return nil
	}
	return &Tensor{lib: l, h: h}
}

// shapeAndDevice converts the shape and device arguments of op: the
// dimension count, a pointer to shape's first element (nil for a 0-d
// shape; shape must stay alive across the call) and the device.
func shapeAndDevice(op string, shape []int64, device Device) (C.int32_t, *C.int64_t, C.dp_device, error) {
	ndim, err := cInt32(op, "len(shape)", len(shape))
	if err != nil {
		return 0, nil, C.dp_device{}, err
	}
	cd, err := cDevice(op, "device", device)
	if err != nil {
		return 0, nil, C.dp_device{}, err
	}
	var shapePtr *C.int64_t
	if len(shape) > 0 {
		shapePtr = (*C.int64_t)(unsafe.Pointer(&shape[0]))
	}
	return ndim, shapePtr, cd, nil
}

// NewTensor allocates a tensor of the given shape on device. Float tensors
// start zeroed.
func (l *Library) NewTensor(dtype DType, shape []int64, device Device) (*Tensor, error) {
	const op = "dp_tensor_create"
	ndim, shapePtr, cd, err := shapeAndDevice(op, shape, device)
	if err != nil {
		return nil, err
	}
	var h *C.dp_tensor
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_create(api, &h, C.int32_t(dtype), ndim, shapePtr, cd)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(h), nil
}

// TensorFromFloat32s makes a float32 tensor on device holding a copy of data
// (one copy), with shape's element count equal to len(data).
func (l *Library) TensorFromFloat32s(data []float32, shape []int64, device Device) (*Tensor, error) {
	count := int64(1)
	for _, n := range shape {
		count *= n
	}
	if count != int64(len(data)) {
		return nil, invalid("TensorFromFloat32s", "argument 'shape' %v holds %d elements, 'data' has %d", shape, count,
			len(data))
	}
	t, err := l.NewTensor(Float32, shape, device)
	if err != nil {
		return nil, err
	}
	if err := t.CopyFromFloat32s(data); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

// Close drops this reference once the calls in flight on it (from other
// goroutines) have returned; the storage lives while the library (or a
// module) holds another. Closing twice, or a borrowed tensor, does nothing.
// Inside a callback, while a call on this tensor runs, the reference is
// dropped when that call returns.
func (t *Tensor) Close() {
	if t == nil || t.borrowed {
		return
	}
	shutHandle(&t.lease, t.lib, "dp_tensor_destroy", &t.h, func(api *C.dp_api, h *C.dp_tensor) {
		C.dpgo_tensor_destroy(api, h)
	})
}

// DType, Numel and Device describe the tensor; on a closed tensor or
// library they are -1, -1 and device index -1, as the library answers for
// an invalid handle.
func (t *Tensor) DType() DType {
	return tensorQuery(t, "dp_tensor_dtype", DType(-1), func(api *C.dp_api, h *C.dp_tensor) DType {
		return DType(C.dpgo_tensor_dtype(api, h))
	})
}

func (t *Tensor) Numel() int64 {
	return tensorQuery(t, "dp_tensor_numel", int64(-1), func(api *C.dp_api, h *C.dp_tensor) int64 {
		return int64(C.dpgo_tensor_numel(api, h))
	})
}

func (t *Tensor) Device() Device {
	return tensorQuery(t, "dp_tensor_device", Device{Index: -1}, func(api *C.dp_api, h *C.dp_tensor) Device {
		return goDevice(C.dpgo_tensor_device(api, h))
	})
}

// tensorQuery is get's answer for t, or invalid on a nil or closed tensor or
// library.
func tensorQuery[V any](t *Tensor, op string, invalid V, get func(api *C.dp_api, h *C.dp_tensor) V) V {
	if t == nil {
		return invalid
	}
	v := invalid
	t.use(op, func(api *C.dp_api) { v = get(api, t.h) })
	return v
}

func (t *Tensor) Shape() ([]int64, error) {
	const op = "dp_tensor_shape"
	if t == nil {
		return nil, nilArgument(op, "t")
	}
	var shape []int64
	err := t.call(op, func(api *C.dp_api) C.dp_status {
		ndim := C.dpgo_tensor_ndim(api, t.h)
		if ndim < 0 {
			return C.DP_EINVAL // an invalid handle: dp_tensor_ndim set the message
		}
		shape = make([]int64, ndim+1) // +1: a valid pointer for 0-d tensors
		return C.dpgo_tensor_shape(api, t.h, (*C.int64_t)(unsafe.Pointer(&shape[0])), ndim)
	})
	if err != nil {
		return nil, err
	}
	return shape[:len(shape)-1], nil
}

// Float32s is the tensor's memory as a slice, without a copy: writes go
// straight into the tensor. The tensor must be float32 on a CPU device; the
// slice is valid while the storage lives (this reference, or a module holding
// the tensor).
func (t *Tensor) Float32s() ([]float32, error) {
	const op = "Float32s"
	if t == nil {
		return nil, nilArgument(op, "t")
	}
	var data []float32
	var refusal error
	err := t.use(op, func(api *C.dp_api) {
		if dt := DType(C.dpgo_tensor_dtype(api, t.h)); dt != Float32 {
			refusal = invalid(op, "the tensor's dtype is %d, not float32", int32(dt))
			return
		}
		if d := goDevice(C.dpgo_tensor_device(api, t.h)); d.Type != DeviceCPU {
			refusal = invalid(op, "the tensor is on %v; only CPU memory can be viewed (use CopyToFloat32s)", d)
			return
		}
		data = []float32{}
		if n := int64(C.dpgo_tensor_numel(api, t.h)); n > 0 {
			data = unsafe.Slice((*float32)(C.dpgo_tensor_data(api, t.h)), n)
		}
	})
	if err != nil {
		return nil, err
	}
	return data, refusal
}

// CopyFromFloat32s copies src, which holds exactly Numel elements, into a
// float32 tensor on any device.
func (t *Tensor) CopyFromFloat32s(src []float32) error {
	return t.copyHost("dp_tensor_copy_from_host", "CopyFromFloat32s", "src", src,
		func(api *C.dp_api, h *C.dp_tensor, p unsafe.Pointer, n C.size_t) C.dp_status {
			return C.dpgo_tensor_copy_from_host(api, h, p, n)
		})
}

// CopyToFloat32s copies a float32 tensor from any device into dst, which
// holds exactly Numel elements.
func (t *Tensor) CopyToFloat32s(dst []float32) error {
	return t.copyHost("dp_tensor_copy_to_host", "CopyToFloat32s", "dst", dst,
		func(api *C.dp_api, h *C.dp_tensor, p unsafe.Pointer, n C.size_t) C.dp_status {
			return C.dpgo_tensor_copy_to_host(api, h, p, n)
		})
}

// copyHost runs op, a copy between t and buf (the argument arg of method),
// which holds exactly Numel float32 elements.
func (t *Tensor) copyHost(op, method, arg string, buf []float32,
	f func(api *C.dp_api, h *C.dp_tensor, p unsafe.Pointer, n C.size_t) C.dp_status) error {
	if t == nil {
		return nilArgument(op, "t")
	}
	if len(buf) == 0 {
		return invalid(method, "argument '%s' is empty", arg)
	}
	return t.call(op, func(api *C.dp_api) C.dp_status {
		return f(api, t.h, unsafe.Pointer(&buf[0]), C.size_t(4*len(buf)))
	})
}

// NBytes is the tensor's size in bytes; 0 on a closed tensor or library.
func (t *Tensor) NBytes() (n int) {
	if t == nil {
		return 0
	}
	t.use("dp_tensor_nbytes", func(api *C.dp_api) { n = int(C.dpgo_tensor_nbytes(api, t.h)) })
	return n
}

// Data is the address of the first element (device memory for a CUDA
// tensor), for handing to other C code; nil for an empty tensor.
func (t *Tensor) Data() (p unsafe.Pointer) {
	if t == nil {
		return nil
	}
	t.use("dp_tensor_data", func(api *C.dp_api) { p = C.dpgo_tensor_data(api, t.h) })
	return p
}

// ToDevice is a copy of the tensor on device, always in new storage.
func (t *Tensor) ToDevice(device Device) (*Tensor, error) {
	const op = "dp_tensor_to_device"
	if t == nil {
		return nil, nilArgument(op, "t")
	}
	cd, err := cDevice(op, "device", device)
	if err != nil {
		return nil, err
	}
	var h *C.dp_tensor
	err = t.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_to_device(api, &h, t.h, cd)
	})
	if err != nil {
		return nil, err
	}
	return t.lib.ownedTensor(h), nil
}

// TensorFromBlob makes a tensor over memory the caller owns, without a copy:
// host memory for a CPU device, device memory for a GPU. The memory must not
// be Go's (cgo forbids C keeping a Go pointer): C.malloc'd, syscall.Mmap'd
// or from a CUDA allocator, say. release (may be nil) runs once the last
// tensor over the memory is gone, on whichever thread drops it; until then
// the memory must stay valid. A panic in release is printed to stderr, as
// nothing waits for it. On failure release is not called.
func (l *Library) TensorFromBlob(data unsafe.Pointer, dtype DType, shape []int64, device Device,
	release func()) (*Tensor, error) {
	const op = "dp_tensor_from_blob"
	ndim, shapePtr, cd, err := shapeAndDevice(op, shape, device)
	if err != nil {
		return nil, err
	}
	var handle cgo.Handle
	if release != nil {
		handle = cgo.NewHandle(release)
	}
	var h *C.dp_tensor
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_from_blob(api, &h, data, C.int32_t(dtype), ndim, shapePtr, cd, C.uintptr_t(handle))
	})
	if err != nil {
		if handle != 0 {
			handle.Delete()
		}
		return nil, err
	}
	return l.ownedTensor(h), nil
}

//export dpgoRelease
func dpgoRelease(call C.uintptr_t) {
	if failure := runCallback(func() {
		h := cgo.Handle(call)
		defer h.Delete()
		h.Value().(func())()
	}); failure != nil {
		fmt.Fprintf(os.Stderr, "dparallel: the release function of a TensorFromBlob tensor %v\n", failure)
	}
}

// TensorFromDLPack takes over a DLManagedTensor (a *C.DLManagedTensor from
// another library, as unsafe.Pointer): the tensor uses its memory in place
// and calls its deleter when the last tensor over it is gone. On failure
// the caller still owns managed.
func (l *Library) TensorFromDLPack(managed unsafe.Pointer) (*Tensor, error) {
	if managed == nil {
		return nil, invalid("dp_tensor_from_dlpack", "argument 'managed' is nil")
	}
	var h *C.dp_tensor
	err := l.call("dp_tensor_from_dlpack", func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_from_dlpack(api, &h, managed)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(h), nil
}

// TensorFromDLPackVersioned takes over a DLPack 1.x DLManagedTensorVersioned
// (as unsafe.Pointer; major version 1): in place as TensorFromDLPack, or,
// flagged read-only, as a copy (managed is released before it returns). On
// failure the caller still owns managed.
func (l *Library) TensorFromDLPackVersioned(managed unsafe.Pointer) (*Tensor, error) {
	if managed == nil {
		return nil, invalid("dp_tensor_from_dlpack_versioned", "argument 'managed' is nil")
	}
	var h *C.dp_tensor
	err := l.call("dp_tensor_from_dlpack_versioned", func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_from_dlpack_versioned(api, &h, managed)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(h), nil
}

// ToDLPackVersioned is a DLPack 1.x DLManagedTensorVersioned (as
// unsafe.Pointer, version 1.1) over the tensor's memory, flagged read-only
// when readOnly; owned as ToDLPack's.
func (t *Tensor) ToDLPackVersioned(readOnly bool) (unsafe.Pointer, error) {
	const op = "dp_tensor_to_dlpack_versioned"
	if t == nil {
		return nil, nilArgument(op, "t")
	}
	var out unsafe.Pointer
	err := t.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_to_dlpack_versioned(api, t.h, cbool(readOnly), &out)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ToDLPack is a DLManagedTensor (as unsafe.Pointer) over the tensor's
// memory, without a copy. Whoever receives it calls its deleter; the memory
// stays alive until then, even after the tensor is closed. DLPack knows one
// CPU: a tensor on a logical cpu device comes back from TensorFromDLPack on
// cpu:0.
func (t *Tensor) ToDLPack() (unsafe.Pointer, error) {
	const op = "dp_tensor_to_dlpack"
	if t == nil {
		return nil, nilArgument(op, "t")
	}
	var out unsafe.Pointer
	err := t.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_tensor_to_dlpack(api, t.h, &out)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
