package dparallel

/*
#include <stdint.h>
#include "dpgo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime/cgo"
	"sort"
	"sync"
)

// ForwardFunc runs one replica's forward (and, for training, backward) while
// that replica's device worker thread waits for it; several run at once, one
// per device. It runs on a goroutine of its own, not locked to the worker
// thread, so that runtime.Goexit in it (t.Fatal) can end that goroutine:
// cgo code in it that needs the device current on its thread (CUDA) must
// make it current itself. replica and input belong to the library and are
// valid during the call only. It returns a new tensor, whose reference
// passes to the library, or input itself. An error, a panic (panic(nil)
// included) or a runtime.Goexit fails the whole call: the caller gets an
// *Error with StatusUser whose Cause is the Go error of the first failed
// replica. Calling ParallelApply, DataParallel or ReplicaSet.Apply from it
// would deadlock and is StatusState.
type ForwardFunc func(index int, replica *Module, input *Tensor, device Device) (*Tensor, error)

// forwardCall is what a call's callbacks share, behind a cgo.Handle.
type forwardCall struct {
	lib  *Library
	fn   ForwardFunc
	mu   sync.Mutex
	errs map[int]error
}

func (c *forwardCall) fail(index int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.errs == nil {
		c.errs = map[int]error{}
	}
	c.errs[index] = err
}

// runForward makes the call with the handle and attaches the first replica's Go
// error to a failure.
func (l *Library) runForward(op string, fn ForwardFunc, f func(api *C.dp_api, call C.uintptr_t) C.dp_status) error {
	if insideCallback() {
		return &Error{Status: StatusState, Op: op, Message: "called from inside a replica's forward, which would deadlock"}
	}
	if fn == nil {
		return invalid(op, "argument 'fn' is nil")
	}
	c := &forwardCall{lib: l, fn: fn}
	h := cgo.NewHandle(c)
	defer h.Delete()
	err := l.call(op, func(api *C.dp_api) C.dp_status { return f(api, C.uintptr_t(h)) })
	if err != nil {
		c.mu.Lock()
		defer c.mu.Unlock()
		if len(c.errs) > 0 {
			indices := make([]int, 0, len(c.errs))
			for i := range c.errs {
				indices = append(indices, i)
			}
			sort.Ints(indices)
			err.(*Error).Cause = c.errs[indices[0]]
		}
	}
	return err
}

//export dpgoForward
func dpgoForward(call C.uintptr_t, index C.size_t, replica *C.dp_module, input *C.dp_tensor, device C.dp_device,
	output **C.dp_tensor) C.int {
	c := cgo.Handle(call).Value().(*forwardCall)
	i := int(index)
	m := &Module{lib: c.lib, h: replica, borrowed: true}
	in := &Tensor{lib: c.lib, h: input, borrowed: true}
	// The library's handles end with the call.
	defer func() {
		m.lease.shut(func() { m.h = nil })
		in.lease.shut(func() { in.h = nil })
	}()
	var out *Tensor
	var err error
	failure := runCallback(func() { out, err = c.fn(i, m, in, goDevice(device)) })
	switch {
	case failure != nil:
		c.fail(i, fmt.Errorf("forward of replica %d %w", i, failure))
		return 1
	case err != nil:
		c.fail(i, err)
		return 2
	case out == nil:
		c.fail(i, errors.New("the forward returned no tensor"))
		return 3
	}
	var h *C.dp_tensor
	if out.borrowed {
		// A tensor the library lent (the input): still the library's.
		if out.lease.enter() {
			h = out.h
			out.lease.leave()
		}
	} else {
		// The library takes the reference over: the tensor is closed.
		out.lease.shut(func() { h, out.h = out.h, nil })
	}
	if h == nil {
		c.fail(i, errors.New("the forward returned a closed tensor (or one a call was still using)"))
		return 3
	}
	*output = h
	return 0
}

// ParallelApply calls fn(i, replicas[i], inputs[i], devices[i]) for every i
// in parallel and returns the outputs. devices may be nil: each input's
// device.
func (l *Library) ParallelApply(replicas []*Module, inputs []*Tensor, devices []Device,
	fn ForwardFunc) ([]*Tensor, error) {
	const op = "dp_parallel_apply"
	n := len(replicas)
	if len(inputs) != n {
		return nil, invalid(op, "argument 'inputs' has %d tensors for %d replicas", len(inputs), n)
	}
	if devices != nil && len(devices) != n {
		return nil, invalid(op, "argument 'devices' has %d devices for %d replicas", len(devices), n)
	}
	if n == 0 {
		return nil, nil
	}
	rh := make([]*C.dp_module, n)
	ih := make([]*C.dp_tensor, n)
	var args heldArgs
	defer args.release()
	for i := 0; i < n; i++ {
		if replicas[i] == nil {
			return nil, invalid(op, "argument 'replicas'[%d] is nil", i)
		}
		if inputs[i] == nil {
			return nil, invalid(op, "argument 'inputs'[%d] is nil", i)
		}
		if err := args.hold(replicas[i].arg(op, fmt.Sprintf("replicas[%d]", i))); err != nil {
			return nil, err
		}
		if err := args.hold(inputs[i].arg(op, fmt.Sprintf("inputs[%d]", i))); err != nil {
			return nil, err
		}
		rh[i], ih[i] = replicas[i].h, inputs[i].h
	}
	var dptr *C.dp_device
	if devices != nil {
		cd, err := cDevices(op, "devices", devices)
		if err != nil {
			return nil, err
		}
		dptr = &cd[0]
	}
	out := make([]*C.dp_tensor, n)
	err := l.runForward(op, fn, func(api *C.dp_api, call C.uintptr_t) C.dp_status {
		return C.dpgo_parallel_apply(api, &rh[0], &ih[0], dptr, C.size_t(n), call, &out[0])
	})
	if err != nil {
		return nil, err
	}
	tensors := make([]*Tensor, n)
	for i, h := range out {
		tensors[i] = l.ownedTensor(h)
	}
	return tensors, nil
}

// DataParallel scatters input along dim over devices, replicates module,
// runs fn on every replica in parallel, adds the replicas' gradients into
// module's, and gathers the outputs along dim on outputDevice.
func (l *Library) DataParallel(module *Module, input *Tensor, devices []Device, outputDevice Device, dim int,
	fn ForwardFunc) (*Tensor, error) {
	const op = "dp_data_parallel"
	if module == nil {
		return nil, nilArgument(op, "module")
	}
	if input == nil {
		return nil, nilArgument(op, "input")
	}
	if len(devices) == 0 {
		return nil, invalid(op, "argument 'devices' is empty")
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	cout, err := cDevice(op, "outputDevice", outputDevice)
	if err != nil {
		return nil, err
	}
	cdim, err := cInt32(op, "dim", dim)
	if err != nil {
		return nil, err
	}
	var args heldArgs
	defer args.release()
	if err := args.hold(module.arg(op, "module")); err != nil {
		return nil, err
	}
	if err := args.hold(input.arg(op, "input")); err != nil {
		return nil, err
	}
	var out *C.dp_tensor
	err = l.runForward(op, fn, func(api *C.dp_api, call C.uintptr_t) C.dp_status {
		return C.dpgo_data_parallel(api, module.h, input.h, &cd[0], C.size_t(len(cd)), cout, cdim, call, &out)
	})
	if err != nil {
		return nil, err
	}
	return l.ownedTensor(out), nil
}

// Replicate makes a replica of module on each device.
func (l *Library) Replicate(module *Module, devices []Device, detach bool) ([]*Module, error) {
	const op = "dp_replicate"
	if module == nil {
		return nil, nilArgument(op, "module")
	}
	if len(devices) == 0 {
		return nil, nil
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	out := make([]*C.dp_module, len(devices))
	d := C.int(0)
	if detach {
		d = 1
	}
	done, err := module.arg(op, "module")
	if err != nil {
		return nil, err
	}
	defer done()
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_replicate(api, module.h, &cd[0], C.size_t(len(cd)), d, &out[0])
	})
	if err != nil {
		return nil, err
	}
	replicas := make([]*Module, len(out))
	for i, h := range out {
		replicas[i] = &Module{lib: l, h: h}
	}
	return replicas, nil
}

// ReduceGradients adds the replicas' gradients into target's.
func (l *Library) ReduceGradients(replicas []*Module, target *Module) error {
	const op = "dp_reduce_gradients"
	if len(replicas) == 0 {
		return invalid(op, "argument 'replicas' is empty")
	}
	if target == nil {
		return nilArgument(op, "target")
	}
	rh := make([]*C.dp_module, len(replicas))
	var args heldArgs
	defer args.release()
	for i, r := range replicas {
		if r == nil {
			return invalid(op, "argument 'replicas'[%d] is nil", i)
		}
		if err := args.hold(r.arg(op, fmt.Sprintf("replicas[%d]", i))); err != nil {
			return err
		}
		rh[i] = r.h
	}
	if err := args.hold(target.arg(op, "target")); err != nil {
		return err
	}
	return l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_reduce_gradients(api, &rh[0], C.size_t(len(rh)), target.h)
	})
}

// ReplicaSet keeps a module's replicas across steps.
type ReplicaSet struct {
	lib   *Library
	h     *C.dp_replica_set
	lease lease // the calls in flight; Close waits for them
}

// NewReplicaSet replicates module onto devices (each listed once).
func (l *Library) NewReplicaSet(module *Module, devices []Device) (*ReplicaSet, error) {
	const op = "dp_replica_set_create"
	if module == nil {
		return nil, invalid(op, "argument 'module' is nil")
	}
	if len(devices) == 0 {
		return nil, invalid(op, "argument 'devices' is empty")
	}
	cd, err := cDevices(op, "devices", devices)
	if err != nil {
		return nil, err
	}
	done, err := module.arg(op, "module")
	if err != nil {
		return nil, err
	}
	defer done()
	var h *C.dp_replica_set
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_replica_set_create(api, &h, module.h, &cd[0], C.size_t(len(cd)))
	})
	if err != nil {
		return nil, err
	}
	return &ReplicaSet{lib: l, h: h}, nil
}

// call is lib.call on a replica set that may be nil, holding its handle
// (Close waits); on a closed set it is a StatusState error.
func (s *ReplicaSet) call(op string, f func(api *C.dp_api) C.dp_status) error {
	if s == nil {
		return nilReceiver(op, "s", "*ReplicaSet")
	}
	return held(&s.lease, op, "replica set", func() error { return s.lib.call(op, f) })
}

// Close destroys the set once the calls in flight on it (from other
// goroutines) have returned; inside one of its own forwards, when that
// call returns.
func (s *ReplicaSet) Close() {
	if s == nil {
		return
	}
	shutHandle(&s.lease, s.lib, "dp_replica_set_destroy", &s.h, func(api *C.dp_api, h *C.dp_replica_set) {
		C.dpgo_replica_set_destroy(api, h)
	})
}

// Size is the number of replicas; 0 on a closed set or library.
func (s *ReplicaSet) Size() int {
	if s == nil {
		return 0
	}
	return heldCount(&s.lease, s.lib, "dp_replica_set_size", "replica set", func(api *C.dp_api) int {
		return int(C.dpgo_replica_set_size(api, s.h))
	})
}

// Sync copies the module's current parameters into the replicas.
func (s *ReplicaSet) Sync() error {
	return s.call("dp_replica_set_sync", func(api *C.dp_api) C.dp_status { return C.dpgo_replica_set_sync(api, s.h) })
}

// Replica is a new reference to replica index.
func (s *ReplicaSet) Replica(index int) (*Module, error) {
	if index < 0 {
		return nil, invalid("dp_replica_set_replica", "argument 'index' is negative (%d)", index)
	}
	var h *C.dp_module
	err := s.call("dp_replica_set_replica", func(api *C.dp_api) C.dp_status {
		return C.dpgo_replica_set_replica(api, s.h, C.size_t(index), &h)
	})
	if err != nil {
		return nil, err
	}
	return &Module{lib: s.lib, h: h}, nil
}

// Apply scatters input along dim, runs fn on the kept replicas in parallel
// and gathers the outputs on outputDevice. Gradients stay in the replicas
// until ReduceGradients.
func (s *ReplicaSet) Apply(input *Tensor, dim int, outputDevice Device, fn ForwardFunc) (*Tensor, error) {
	const op = "dp_replica_set_apply"
	if s == nil {
		return nil, nilReceiver(op, "s", "*ReplicaSet")
	}
	if input == nil {
		return nil, nilArgument(op, "input")
	}
	cdim, err := cInt32(op, "dim", dim)
	if err != nil {
		return nil, err
	}
	cout, err := cDevice(op, "outputDevice", outputDevice)
	if err != nil {
		return nil, err
	}
	done, err := input.arg(op, "input")
	if err != nil {
		return nil, err
	}
	defer done()
	var out *C.dp_tensor
	err = held(&s.lease, op, "replica set", func() error {
		return s.lib.runForward(op, fn, func(api *C.dp_api, call C.uintptr_t) C.dp_status {
			return C.dpgo_replica_set_apply(api, s.h, input.h, cdim, cout, call, &out)
		})
	})
	if err != nil {
		return nil, err
	}
	return s.lib.ownedTensor(out), nil
}

// ReduceGradients adds the replicas' gradients into the module's and zeroes
// the replicas'.
func (s *ReplicaSet) ReduceGradients() error {
	return s.call("dp_replica_set_reduce_gradients", func(api *C.dp_api) C.dp_status {
		return C.dpgo_replica_set_reduce_gradients(api, s.h)
	})
}
