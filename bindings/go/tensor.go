package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import "unsafe"

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
}

func (l *Library) ownedTensor(h *C.dp_tensor) *Tensor {
	if h == nil {
		return nil
	}
	return &Tensor{lib: l, h: h}
}

// NewTensor allocates a tensor of the given shape on device. Float tensors
// start zeroed.
func (l *Library) NewTensor(dtype DType, shape []int64, device Device) (*Tensor, error) {
	var h *C.dp_tensor
	var shapePtr *C.int64_t
	if len(shape) > 0 {
		shapePtr = (*C.int64_t)(unsafe.Pointer(&shape[0]))
	}
	err := l.call("dp_tensor_create", func() C.dp_status {
		return C.dpgo_tensor_create(l.api, &h, C.int32_t(dtype), C.int32_t(len(shape)), shapePtr, device.c())
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

// Close drops this reference; the storage lives while the library (or a
// module) holds another. Closing twice, or a borrowed tensor, does nothing.
func (t *Tensor) Close() {
	if t == nil || t.h == nil || t.borrowed {
		return
	}
	C.dpgo_tensor_destroy(t.lib.api, t.h)
	t.h = nil
}

// DType, Numel, Device and Shape describe the tensor.
func (t *Tensor) DType() DType   { return DType(C.dpgo_tensor_dtype(t.lib.api, t.h)) }
func (t *Tensor) Numel() int64   { return int64(C.dpgo_tensor_numel(t.lib.api, t.h)) }
func (t *Tensor) Device() Device { return goDevice(C.dpgo_tensor_device(t.lib.api, t.h)) }

func (t *Tensor) Shape() ([]int64, error) {
	ndim := int(C.dpgo_tensor_ndim(t.lib.api, t.h))
	if ndim < 0 {
		return nil, invalid("Shape", "the tensor handle is invalid")
	}
	shape := make([]int64, ndim+1) // +1: a valid pointer for 0-d tensors
	err := t.lib.call("dp_tensor_shape", func() C.dp_status {
		return C.dpgo_tensor_shape(t.lib.api, t.h, (*C.int64_t)(unsafe.Pointer(&shape[0])), C.int32_t(ndim))
	})
	return shape[:ndim], err
}

// Float32s is the tensor's memory as a slice, without a copy: writes go
// straight into the tensor. The tensor must be float32 on a CPU device; the
// slice is valid while the storage lives (this reference, or a module holding
// the tensor).
func (t *Tensor) Float32s() ([]float32, error) {
	if t == nil || t.h == nil {
		return nil, invalid("Float32s", "the tensor is closed (or nil)")
	}
	if dt := t.DType(); dt != Float32 {
		return nil, invalid("Float32s", "the tensor's dtype is %d, not float32", int32(dt))
	}
	if d := t.Device(); d.Type != DeviceCPU {
		return nil, invalid("Float32s", "the tensor is on %v; only CPU memory can be viewed (use CopyToFloat32s)", d)
	}
	n := t.Numel()
	if n == 0 {
		return []float32{}, nil
	}
	data := C.dpgo_tensor_data(t.lib.api, t.h)
	return unsafe.Slice((*float32)(data), n), nil
}

// CopyFromFloat32s copies src, which holds exactly Numel elements, into a
// float32 tensor on any device.
func (t *Tensor) CopyFromFloat32s(src []float32) error {
	if len(src) == 0 {
		return invalid("CopyFromFloat32s", "argument 'src' is empty")
	}
	return t.lib.call("dp_tensor_copy_from_host", func() C.dp_status {
		return C.dpgo_tensor_copy_from_host(t.lib.api, t.h, unsafe.Pointer(&src[0]), C.size_t(4*len(src)))
	})
}

// CopyToFloat32s copies a float32 tensor from any device into dst, which
// holds exactly Numel elements.
func (t *Tensor) CopyToFloat32s(dst []float32) error {
	if len(dst) == 0 {
		return invalid("CopyToFloat32s", "argument 'dst' is empty")
	}
	return t.lib.call("dp_tensor_copy_to_host", func() C.dp_status {
		return C.dpgo_tensor_copy_to_host(t.lib.api, t.h, unsafe.Pointer(&dst[0]), C.size_t(4*len(dst)))
	})
}
