package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import (
	"time"
	"unsafe"
)

// ReduceOp combines tensors across ranks.
type ReduceOp int32

const (
	Sum  ReduceOp = 0
	Avg  ReduceOp = 1
	Min  ReduceOp = 2
	Max  ReduceOp = 3
	Prod ReduceOp = 4
)

// ProcessGroup is this process's membership of a group of ranks. Drive a
// group from one goroutine at a time; one that issues async collectives, or
// drives a DDP with streams, stays on its thread (runtime.LockOSThread),
// since the library tells its callers apart by thread. The group a comm
// hook receives is the library's: valid during the call only.
type ProcessGroup struct {
	lib      *Library
	h        *C.dp_process_group
	borrowed bool
	lease    lease // the calls in flight; Close waits for them
}

// Backend is the transport a group asks for; ProcessGroup.Backend says what
// runs.
type Backend int32

const (
	BackendAuto Backend = 0 // NCCL for cuda; shared memory on one host, else Gloo, for cpu
	BackendGloo Backend = 1
	BackendNCCL Backend = 2
	BackendShm  Backend = 3 // shared memory; every rank on one host
	BackendMPI  Backend = 4 // the site's MPI, loaded at run time; the ranks started by mpirun
)

// ProcessGroupOptions are a group's settings; zero values take the
// library's defaults.
type ProcessGroupOptions struct {
	Backend Backend
	// Store the ranks meet through; nil: a TCP store served by rank 0 at
	// DP_STORE_ADDR:DP_STORE_PORT, else MASTER_ADDR:MASTER_PORT. The group holds its own reference.
	Store *Store
	// Timeout of every blocking call; 0: 300 s.
	Timeout time.Duration
	// Device this rank's tensors live on; the zero value means cpu:0.
	Device Device
}

// apply sets the backend, timeout and device of copts from o (not its store).
func (o *ProcessGroupOptions) apply(op string, copts *C.dp_process_group_options) (err error) {
	copts.backend = C.int32_t(o.Backend)
	if o.Timeout != 0 {
		if o.Timeout < 0 {
			return invalid(op, "argument 'opts.Timeout' is negative (%v)", o.Timeout)
		}
		if copts.timeout_ms, err = milliseconds(op, "opts.Timeout", o.Timeout); err != nil {
			return err
		}
	}
	if o.Device != (Device{}) {
		if copts.device, err = cDevice(op, "opts.Device", o.Device); err != nil {
			return err
		}
	}
	return nil
}

// NewProcessGroup joins a group as rank of worldSize; -1 for either reads it
// from the environment (RANK, WORLD_SIZE, or mpirun's). Every rank passes
// the same world size, store and backend.
func (l *Library) NewProcessGroup(rank, worldSize int, opts *ProcessGroupOptions) (*ProcessGroup, error) {
	const op = "dp_process_group_create"
	crank, err := cInt32(op, "rank", rank)
	if err != nil {
		return nil, err
	}
	cworld, err := cInt32(op, "worldSize", worldSize)
	if err != nil {
		return nil, err
	}
	var copts C.dp_process_group_options
	err = l.call("dp_process_group_options_init", func(api *C.dp_api) C.dp_status {
		return C.dpgo_process_group_options_init(api, &copts, C.size_t(unsafe.Sizeof(copts)))
	})
	if err != nil {
		return nil, err
	}
	copts.rank = crank
	copts.world_size = cworld
	if opts != nil {
		if opts.Store != nil {
			if !opts.Store.lease.enter() {
				return nil, invalid(op, "argument 'opts.Store' is a closed store")
			}
			defer opts.Store.lease.leave()
			copts.store = opts.Store.h
		}
		if err = opts.apply(op, &copts); err != nil {
			return nil, err
		}
	}
	var h *C.dp_process_group
	err = l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_process_group_create(api, &h, &copts) })
	if err != nil {
		return nil, err
	}
	return &ProcessGroup{lib: l, h: h}, nil
}

// ProcessGroupFromEnv joins the group described by RANK and WORLD_SIZE,
// with its store at DP_STORE_ADDR:DP_STORE_PORT (dp-run sets them, leaving
// MASTER_PORT to the program's own framework), else MASTER_ADDR:MASTER_PORT
// (torchrun); Open MPI, MPICH and Slurm variables serve where those are
// absent (dp_dist.h). Default options: Gloo (or shared memory on one host)
// on cpu:0.
func (l *Library) ProcessGroupFromEnv() (*ProcessGroup, error) {
	var h *C.dp_process_group
	err := l.call("dp_process_group_create_from_env", func(api *C.dp_api) C.dp_status {
		return C.dpgo_process_group_create_from_env(api, &h, nil)
	})
	if err != nil {
		return nil, err
	}
	return &ProcessGroup{lib: l, h: h}, nil
}

// call is lib.call on a group that may be nil.
func (pg *ProcessGroup) call(op string, f func(api *C.dp_api) C.dp_status) error {
	if pg == nil {
		return nilReceiver(op, "pg", "*ProcessGroup")
	}
	return held(&pg.lease, op, "process group", func() error { return pg.lib.call(op, f) })
}

// arg holds the group as the argument `name` of op until the returned
// function runs; a closed one is an invalid argument.
func (pg *ProcessGroup) arg(op, name string) (func(), error) {
	return heldArg(&pg.lease, op, name, "process group")
}

// use is lib.use, holding the group's handle.
func (pg *ProcessGroup) use(op string, f func(api *C.dp_api)) error {
	return held(&pg.lease, op, "process group", func() error { return pg.lib.use(op, f) })
}

// Close waits for the calls in flight on the group (from other goroutines)
// and its queued collectives, then leaves the group; inside a callback,
// while a call on the group runs, it leaves when that call returns.
func (pg *ProcessGroup) Close() {
	if pg == nil || pg.borrowed {
		return
	}
	shutHandle(&pg.lease, pg.lib, "dp_process_group_destroy", &pg.h, func(api *C.dp_api, h *C.dp_process_group) {
		C.dpgo_process_group_destroy(api, h)
	})
}

// Rank, Size and Backend describe the group; -1, -1 and "" on a closed group
// or library, as the library answers for an invalid handle.
func (pg *ProcessGroup) Rank() int {
	rank := -1
	if pg == nil {
		return rank
	}
	pg.use("dp_process_group_rank", func(api *C.dp_api) { rank = int(C.dpgo_process_group_rank(api, pg.h)) })
	return rank
}

func (pg *ProcessGroup) Size() int {
	size := -1
	if pg == nil {
		return size
	}
	pg.use("dp_process_group_size", func(api *C.dp_api) { size = int(C.dpgo_process_group_size(api, pg.h)) })
	return size
}

func (pg *ProcessGroup) Backend() (backend string) {
	if pg == nil {
		return ""
	}
	pg.use("dp_process_group_backend", func(api *C.dp_api) {
		backend = C.GoString(C.dpgo_process_group_backend(api, pg.h))
	})
	return backend
}

// AllReduce combines t across ranks, in place.
func (pg *ProcessGroup) AllReduce(t *Tensor, op ReduceOp) error {
	const name = "dp_pg_all_reduce"
	var args heldArgs
	defer args.release()
	if err := tensorArg(name, "t", t, &args); err != nil {
		return err
	}
	return pg.call(name, func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_all_reduce(api, pg.h, t.h, C.int32_t(op))
	})
}

// Broadcast copies root's t to every rank, in place.
func (pg *ProcessGroup) Broadcast(t *Tensor, root int) error {
	const op = "dp_pg_broadcast"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "t", t, &args); err != nil {
		return err
	}
	croot, err := cInt32(op, "root", root)
	if err != nil {
		return err
	}
	return pg.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_broadcast(api, pg.h, t.h, croot)
	})
}

func (pg *ProcessGroup) Barrier() error {
	return pg.call("dp_pg_barrier", func(api *C.dp_api) C.dp_status { return C.dpgo_pg_barrier(api, pg.h) })
}

// AllGather fills outputs[r] (one per rank, each like input) with rank r's
// input.
func (pg *ProcessGroup) AllGather(input *Tensor, outputs []*Tensor) error {
	const op = "dp_pg_all_gather"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "input", input, &args); err != nil {
		return err
	}
	hs, err := tensorHandles(op, "outputs", outputs, &args)
	if err != nil {
		return err
	}
	return pg.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_all_gather(api, pg.h, input.h, &hs[0], C.size_t(len(hs)))
	})
}

// ReduceScatter sets output to the reduction over ranks of their
// inputs[this rank] (inputs: one per rank, each like output).
func (pg *ProcessGroup) ReduceScatter(inputs []*Tensor, output *Tensor, op ReduceOp) error {
	const name = "dp_pg_reduce_scatter"
	var args heldArgs
	defer args.release()
	if err := tensorArg(name, "output", output, &args); err != nil {
		return err
	}
	hs, err := tensorHandles(name, "inputs", inputs, &args)
	if err != nil {
		return err
	}
	return pg.call(name, func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_reduce_scatter(api, pg.h, &hs[0], C.size_t(len(hs)), output.h, C.int32_t(op))
	})
}

// Work is a collective in flight. Its tensors must stay open until Wait
// (or a Test saying done) returns.
type Work struct {
	lib   *Library
	h     *C.dp_work
	lease lease // the calls in flight; Close waits for them
}

// call is lib.call holding the work's handle; a closed work is StatusState.
func (w *Work) call(op string, f func(api *C.dp_api) C.dp_status) error {
	return held(&w.lease, op, "work", func() error { return w.lib.call(op, f) })
}

// async starts a collective and wraps its handle.
func (pg *ProcessGroup) async(op string, f func(api *C.dp_api, out **C.dp_work) C.dp_status) (*Work, error) {
	if pg == nil {
		return nil, nilReceiver(op, "pg", "*ProcessGroup")
	}
	var h *C.dp_work
	err := pg.call(op, func(api *C.dp_api) C.dp_status { return f(api, &h) })
	if err != nil {
		return nil, err
	}
	return &Work{lib: pg.lib, h: h}, nil
}

func (pg *ProcessGroup) AllReduceAsync(t *Tensor, op ReduceOp) (*Work, error) {
	const name = "dp_pg_all_reduce_async"
	var args heldArgs
	defer args.release()
	if err := tensorArg(name, "t", t, &args); err != nil {
		return nil, err
	}
	return pg.async(name, func(api *C.dp_api, out **C.dp_work) C.dp_status {
		return C.dpgo_pg_all_reduce_async(api, pg.h, t.h, C.int32_t(op), out)
	})
}

func (pg *ProcessGroup) BroadcastAsync(t *Tensor, root int) (*Work, error) {
	const op = "dp_pg_broadcast_async"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "t", t, &args); err != nil {
		return nil, err
	}
	croot, err := cInt32(op, "root", root)
	if err != nil {
		return nil, err
	}
	return pg.async(op, func(api *C.dp_api, out **C.dp_work) C.dp_status {
		return C.dpgo_pg_broadcast_async(api, pg.h, t.h, croot, out)
	})
}

func (pg *ProcessGroup) AllGatherAsync(input *Tensor, outputs []*Tensor) (*Work, error) {
	const op = "dp_pg_all_gather_async"
	var args heldArgs
	defer args.release()
	if err := tensorArg(op, "input", input, &args); err != nil {
		return nil, err
	}
	hs, err := tensorHandles(op, "outputs", outputs, &args)
	if err != nil {
		return nil, err
	}
	return pg.async(op, func(api *C.dp_api, out **C.dp_work) C.dp_status {
		return C.dpgo_pg_all_gather_async(api, pg.h, input.h, &hs[0], C.size_t(len(hs)), out)
	})
}

func (pg *ProcessGroup) ReduceScatterAsync(inputs []*Tensor, output *Tensor, op ReduceOp) (*Work, error) {
	const name = "dp_pg_reduce_scatter_async"
	var args heldArgs
	defer args.release()
	if err := tensorArg(name, "output", output, &args); err != nil {
		return nil, err
	}
	hs, err := tensorHandles(name, "inputs", inputs, &args)
	if err != nil {
		return nil, err
	}
	return pg.async(name, func(api *C.dp_api, out **C.dp_work) C.dp_status {
		return C.dpgo_pg_reduce_scatter_async(api, pg.h, &hs[0], C.size_t(len(hs)), output.h, C.int32_t(op), out)
	})
}

func (pg *ProcessGroup) BarrierAsync() (*Work, error) {
	return pg.async("dp_pg_barrier_async", func(api *C.dp_api, out **C.dp_work) C.dp_status {
		return C.dpgo_pg_barrier_async(api, pg.h, out)
	})
}

// Wait returns the collective's result once it has finished.
func (w *Work) Wait() error {
	if w == nil {
		return nilReceiver("dp_work_wait", "w", "*Work")
	}
	return w.call("dp_work_wait", func(api *C.dp_api) C.dp_status { return C.dpgo_work_wait(api, w.h) })
}

// Test reports whether the collective has finished (then Wait returns at
// once).
func (w *Work) Test() (bool, error) {
	if w == nil {
		return false, nilReceiver("dp_work_test", "w", "*Work")
	}
	var done C.int
	err := w.call("dp_work_test", func(api *C.dp_api) C.dp_status { return C.dpgo_work_test(api, w.h, &done) })
	return done != 0, err
}

// Close drops the handle once the calls in flight on it have returned; the
// collective still completes.
func (w *Work) Close() {
	if w == nil {
		return
	}
	shutHandle(&w.lease, w.lib, "dp_work_destroy", &w.h, func(api *C.dp_api, h *C.dp_work) {
		C.dpgo_work_destroy(api, h)
	})
}
