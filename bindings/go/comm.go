package dparallel

/*
#include "dpgo.h"
*/
import "C"

// In-process collectives across this process's devices (torch.cuda.comm's
// semantics). Every output is a new tensor the caller closes.

// tensorHandles checks a list of tensors for the named argument and holds
// each (args releases them after the call).
func tensorHandles(op, arg string, tensors []*Tensor, args *heldArgs) ([]*C.dp_tensor, error) {
	if len(tensors) == 0 {
		return nil, invalid(op, "argument '%s' is empty", arg)
	}
	hs := make([]*C.dp_tensor, len(tensors))
	for i, t := range tensors {
		if t == nil {
			return nil, invalid(op, "argument '%s'[%d] is nil or closed", arg, i)
		}
		if t.lease.enter() {
			*args = append(*args, t.lease.leave)
		} else {
			return nil, invalid(op, "argument '%s'[%d] is nil or closed", arg, i)
		}
		hs[i] = t.h
	}
	return hs, nil
}

// tensorArg holds a single tensor argument, which may not be nil (args
// releases it after the call).
func tensorArg(op, arg string, t *Tensor, args *heldArgs) error {
	if t == nil {
		return nilArgument(op, arg)
	}
	return args.hold(t.arg(op, arg))
}

func (l *Library) ownedTensors(hs []*C.dp_tensor) []*Tensor {
	out := make([]*Tensor, len(hs))
	for i, h := range hs {
		out[i] = l.ownedTensor(h)
	}
	return out
}

// Broadcast puts t on every device: out[i] is on devices[i], sharing t's
// storage on t's own device.
func (l *Library) Broadcast(t *Tensor, devices []Device) ([]*Tensor, error) {
	const op = "dp_broadcast"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "tensor", t, &args); err != nil {
		return nil, err
	}
	if len(devices) == 0 {
		return nil, invalid(op, "argument 'devices' is empty")
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	out := make([]*C.dp_tensor, len(devices))
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_broadcast(api, t.h, &cd[0], C.size_t(len(cd)), &out[0])
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensors(out), nil
}

// BroadcastCoalesced broadcasts tensors (all on devices[0]) through flat
// buffers of at most bufferSize bytes (0: 10 MiB): out[d][i] is tensors[i]
// on devices[d].
func (l *Library) BroadcastCoalesced(tensors []*Tensor, devices []Device, bufferSize int) ([][]*Tensor, error) {
	const op = "dp_broadcast_coalesced"
	var args heldArgs
	defer args.release()
	hs, err := tensorHandles(op, "tensors", tensors, &args)
	if err != nil {
		return nil, err
	}
	if len(devices) == 0 {
		return nil, invalid(op, "argument 'devices' is empty")
	}
	if bufferSize < 0 {
		return nil, invalid(op, "argument 'bufferSize' is negative (%d)", bufferSize)
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	out := make([]*C.dp_tensor, len(devices)*len(hs))
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_broadcast_coalesced(api, &hs[0], C.size_t(len(hs)), &cd[0], C.size_t(len(cd)),
			C.size_t(bufferSize), &out[0])
	})
	if err != nil {
		return nil, err
	}
	all := l.ownedTensors(out)
	perDevice := make([][]*Tensor, len(devices))
	for d := range perDevice {
		perDevice[d] = all[d*len(hs) : (d+1)*len(hs)]
	}
	return perDevice, nil
}

// ReduceAdd is the element-wise sum of inputs (equal shapes and dtypes) on
// destination.
func (l *Library) ReduceAdd(inputs []*Tensor, destination Device) (*Tensor, error) {
	const op = "dp_reduce_add"
	var args heldArgs
	defer args.release()
	hs, err := tensorHandles(op, "inputs", inputs, &args)
	if err != nil {
		return nil, err
	}
	cd, err := cDevice(op, "destination", destination)
	if err != nil {
		return nil, err
	}
	var out *C.dp_tensor
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_reduce_add(api, &hs[0], C.size_t(len(hs)), cd, &out)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(out), nil
}

// ReduceAddCoalesced sums lists of tensors: inputs[d] is device d's list
// (every list alike in shapes and dtypes); out[i] is the sum over d of
// inputs[d][i], on destination. bufferSize as for BroadcastCoalesced.
func (l *Library) ReduceAddCoalesced(inputs [][]*Tensor, destination Device, bufferSize int) ([]*Tensor, error) {
	const op = "dp_reduce_add_coalesced"
	var args heldArgs
	defer args.release()
	if len(inputs) == 0 || len(inputs[0]) == 0 {
		return nil, invalid(op, "argument 'inputs' is empty")
	}
	if bufferSize < 0 {
		return nil, invalid(op, "argument 'bufferSize' is negative (%d)", bufferSize)
	}
	cd, err := cDevice(op, "destination", destination)
	if err != nil {
		return nil, err
	}
	n := len(inputs[0])
	var hs []*C.dp_tensor
	for d, list := range inputs {
		if len(list) != n {
			return nil, invalid(op, "argument 'inputs'[%d] has %d tensors, inputs[0] has %d", d, len(list), n)
		}
		h, err := tensorHandles(op, "inputs", list, &args)
		if err != nil {
			return nil, err
		}
		hs = append(hs, h...)
	}
	out := make([]*C.dp_tensor, n)
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_reduce_add_coalesced(api, &hs[0], C.size_t(len(inputs)), C.size_t(n), cd,
			C.size_t(bufferSize), &out[0])
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensors(out), nil
}

// Scatter splits t along dim (negative counts from the end) and puts chunk
// i on devices[i]. chunkSizes nil splits evenly as torch.chunk does, which
// may give fewer chunks than devices; otherwise it holds one positive size
// per device, summing to the dimension.
func (l *Library) Scatter(t *Tensor, devices []Device, chunkSizes []int64, dim int) ([]*Tensor, error) {
	const op = "dp_scatter"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "tensor", t, &args); err != nil {
		return nil, err
	}
	if len(devices) == 0 {
		return nil, invalid(op, "argument 'devices' is empty")
	}
	var sizes *C.int64_t
	if chunkSizes != nil {
		if len(chunkSizes) != len(devices) {
			return nil, invalid(op, "argument 'chunkSizes' has %d sizes for %d devices", len(chunkSizes), len(devices))
		}
		sizes = (*C.int64_t)(&chunkSizes[0])
	}
	cdim, err := cInt32(op, "dim", dim)
	if err != nil {
		return nil, err
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	out := make([]*C.dp_tensor, len(devices))
	var count C.size_t
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_scatter(api, t.h, &cd[0], C.size_t(len(cd)), sizes, cdim, &out[0], &count)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensors(out[:count]), nil
}

// Gather concatenates tensors along dim into a new tensor on destination.
func (l *Library) Gather(tensors []*Tensor, dim int, destination Device) (*Tensor, error) {
	const op = "dp_gather"
	var args heldArgs
	defer args.release()
	hs, err := tensorHandles(op, "tensors", tensors, &args)
	if err != nil {
		return nil, err
	}
	cdim, err := cInt32(op, "dim", dim)
	if err != nil {
		return nil, err
	}
	cd, err := cDevice(op, "destination", destination)
	if err != nil {
		return nil, err
	}
	var out *C.dp_tensor
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_gather(api, &hs[0], C.size_t(len(hs)), cdim, cd, &out)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(out), nil
}
