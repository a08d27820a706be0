package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import (
	"fmt"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// CommHook is a built-in reduction of the gradient buckets.
type CommHook int32

const (
	HookAllReduce CommHook = 0 // sum, then divide by the world size
	HookFP16      CommHook = 1 // in float16 on the wire
	HookBF16      CommHook = 2 // in bfloat16 on the wire
)

// CommHookFunc reduces one flat bucket (this rank's gradients of bucket
// `bucket`, concatenated) in place, typically by collectives on pg, leaving
// what the gradients should hold. It runs while the library's worker
// thread waits for it; its calls into the library are made on that thread
// for it (the library requires it), so calls from goroutines it starts are
// refused. pg and flatBucket are valid during the call only. An error, a
// panic or a runtime.Goexit fails FinishBackward with StatusUser, the Go
// error as Cause. It may read a DDP (NumBuckets, BucketParameters, Stats);
// other DDP calls from it are StatusState.
type CommHookFunc func(pg *ProcessGroup, bucket int, flatBucket *Tensor) error

// BucketReducedFunc is the optimizer inside backward: it runs, as a
// CommHookFunc does, as soon as bucket `bucket`'s averaged gradients are
// final in the module, while later buckets still reduce. params are the
// bucket's managed-parameter indices (ParameterUsed tells the unused ones).
// Every managed parameter is reported once per synced backward. A failure
// fails FinishBackward with StatusUser (the gradients are final all the
// same).
type BucketReducedFunc func(ddp *DDP, bucket int, params []int) error

// DDPOptions are the reducer's settings; zero values take the library's
// defaults.
type DDPOptions struct {
	BucketCapMB          float64 // 0: 25
	FirstBucketCapMB     float64 // 0: 1
	GradientAsBucketView bool    // gradients are views into the buckets (no copy)
	NoBroadcastBuffers   bool    // PreForward leaves the buffers alone
	FindUnusedParameters bool    // parameters left unmarked are agreed on, not errors
	NoInitSync           bool    // skip the agreement check and rank 0's broadcast at create
	IgnoredModules       []string
	IgnoredParameters    []string
	CommHook             CommHook
	CommHookFunc         CommHookFunc // replaces CommHook
	// StaticGraph records the first synced iteration's used parameters and
	// plan; later iterations must match them and run no used-map collective.
	StaticGraph bool
	// While ranks have joined (Join), built-in hooks divide by the ranks still
	// active instead of the initial world size.
	JoinDivideByActiveRanks bool
	OnBucketReduced         BucketReducedFunc
	// BucketPlan is text from DDP.BucketPlan: the buckets, final from the start.
	BucketPlan string
}

// DDP averages a module's gradients across the ranks of a group while the
// backward runs: the host marks each parameter's gradient ready as it is
// produced. A DDP handed to OnBucketReduced is the library's: valid during
// the call only.
type DDP struct {
	lib       *Library
	h         *C.dp_ddp
	borrowed  bool
	callbacks *ddpCallbacks // set once, at NewDDP
	lease     lease         // the calls in flight; Close waits for them
}

// ddpCallbacks is what the C callbacks reach through a cgo.Handle.
type ddpCallbacks struct {
	lib     *Library
	handle  cgo.Handle
	hook    CommHookFunc
	reduced BucketReducedFunc
	mu      sync.Mutex
	errs    []error // since the last FinishBackward or Join
}

func (c *ddpCallbacks) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, err)
}

// takeErrors attaches the first callback failure to err and forgets them.
func (c *ddpCallbacks) takeErrors(err error) error {
	if c == nil {
		return err
	}
	c.mu.Lock()
	errs := c.errs
	c.errs = nil
	c.mu.Unlock()
	if de, ok := err.(*Error); ok && len(errs) > 0 && de.Cause == nil {
		de.Cause = errs[0]
	}
	return err
}

//export dpgoCommHook
func dpgoCommHook(call C.uintptr_t, pg *C.dp_process_group, bucket C.size_t, flat *C.dp_tensor) C.int {
	var c *ddpCallbacks
	var err error
	failure := runPinned(func() {
		c = cgo.Handle(call).Value().(*ddpCallbacks)
		group := &ProcessGroup{lib: c.lib, h: pg, borrowed: true}
		t := &Tensor{lib: c.lib, h: flat, borrowed: true}
		defer func() { // the library's handles end with the call
			group.lease.shut(func() { group.h = nil })
			t.lease.shut(func() { t.h = nil })
		}()
		err = c.hook(group, int(bucket), t)
	})
	return c.answer(err, failure, fmt.Sprintf("the comm hook of bucket %d", int(bucket)))
}

// answer is a callback's result for the library: 0, or 1 once err (or the
// callback's failure, from runPinned, as what did it) is recorded on c (nil
// when the call handle was not found).
func (c *ddpCallbacks) answer(err, failure error, what string) C.int {
	if failure != nil {
		err = fmt.Errorf("%s %w", what, failure)
	}
	if err == nil {
		return 0
	}
	if c != nil {
		c.fail(err)
	}
	return 1
}

//export dpgoBucketReduced
func dpgoBucketReduced(call C.uintptr_t, ddp *C.dp_ddp, bucket C.size_t, indices *C.size_t, n C.size_t) C.int {
	var c *ddpCallbacks
	var err error
	params := make([]int, int(n))
	if n > 0 {
		for i, v := range unsafe.Slice(indices, int(n)) {
			params[i] = int(v)
		}
	}
	failure := runPinned(func() {
		c = cgo.Handle(call).Value().(*ddpCallbacks)
		d := &DDP{lib: c.lib, h: ddp, borrowed: true}
		defer d.lease.shut(func() { d.h = nil })
		err = c.reduced(d, int(bucket), params)
	})
	return c.answer(err, failure, fmt.Sprintf("on_bucket_reduced of bucket %d", int(bucket)))
}

// cStrings is a C array of C strings, freed by free.
type cStrings []*C.char

func newCStrings(list []string) cStrings {
	out := make(cStrings, len(list))
	for i, s := range list {
		out[i] = C.CString(s)
	}
	return out
}

func (s cStrings) free() {
	for _, p := range s {
		C.free(unsafe.Pointer(p))
	}
}

// array is C memory holding the pointers: the options struct keeps it, and
// Go memory handed to C must not hold Go pointers.
func (s cStrings) array() (**C.char, func()) {
	if len(s) == 0 {
		return nil, func() {}
	}
	p := (**C.char)(C.malloc(C.size_t(len(s)) * C.size_t(unsafe.Sizeof((*C.char)(nil)))))
	copy(unsafe.Slice(p, len(s)), s)
	return p, func() { C.free(unsafe.Pointer(p)) }
}

// NewDDP makes the reducer; every rank passes equal options, and every
// rank's module starts from rank 0's parameters.
func (l *Library) NewDDP(module *Module, pg *ProcessGroup, opts *DDPOptions) (*DDP, error) {
	const op = "dp_ddp_create"
	if module == nil {
		return nil, nilArgument(op, "module")
	}
	if pg == nil {
		return nil, nilArgument(op, "pg")
	}
	var copts C.dp_ddp_options
	err := l.call("dp_ddp_options_init", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_options_init(api, &copts, C.size_t(unsafe.Sizeof(copts)))
	})
	if err != nil {
		return nil, err
	}
	var callbacks *ddpCallbacks
	if opts != nil {
		if opts.BucketCapMB < 0 || opts.FirstBucketCapMB < 0 {
			return nil, invalid(op, "argument 'opts.BucketCapMB' or 'opts.FirstBucketCapMB' is negative")
		}
		if opts.BucketCapMB > 0 {
			copts.bucket_cap_mb = C.double(opts.BucketCapMB)
		}
		if opts.FirstBucketCapMB > 0 {
			copts.first_bucket_cap_mb = C.double(opts.FirstBucketCapMB)
		}
		copts.gradient_as_bucket_view = cbool(opts.GradientAsBucketView)
		copts.broadcast_buffers = cbool(!opts.NoBroadcastBuffers)
		copts.find_unused_parameters = cbool(opts.FindUnusedParameters)
		copts.init_sync = cbool(!opts.NoInitSync)
		copts.static_graph = cbool(opts.StaticGraph)
		copts.join_divide_by_initial_world_size = cbool(!opts.JoinDivideByActiveRanks)
		modules, parameters := newCStrings(opts.IgnoredModules), newCStrings(opts.IgnoredParameters)
		defer modules.free()
		defer parameters.free()
		var freeModules, freeParameters func()
		copts.ignored_modules, freeModules = modules.array()
		defer freeModules()
		copts.num_ignored_modules = C.size_t(len(modules))
		copts.ignored_parameters, freeParameters = parameters.array()
		defer freeParameters()
		copts.num_ignored_parameters = C.size_t(len(parameters))
		if opts.CommHookFunc != nil && opts.CommHook != HookAllReduce {
			return nil, invalid(op, "arguments 'opts.CommHook' (%d) and 'opts.CommHookFunc' both set", opts.CommHook)
		}
		copts.comm_hook = C.int32_t(opts.CommHook)
		if opts.CommHookFunc != nil {
			copts.comm_hook = C.DP_HOOK_CUSTOM
		}
		if opts.BucketPlan != "" {
			plan := C.CString(opts.BucketPlan)
			defer C.free(unsafe.Pointer(plan))
			copts.bucket_plan = plan
		}
		if opts.CommHookFunc != nil || opts.OnBucketReduced != nil {
			callbacks = &ddpCallbacks{lib: l, hook: opts.CommHookFunc, reduced: opts.OnBucketReduced}
			callbacks.handle = cgo.NewHandle(callbacks)
			C.dpgo_ddp_set_callbacks(&copts, cbool(opts.CommHookFunc != nil), cbool(opts.OnBucketReduced != nil),
				C.uintptr_t(callbacks.handle))
		}
	}
	var args heldArgs
	defer args.release()
	if err := args.hold(module.arg(op, "module")); err != nil {
		if callbacks != nil {
			callbacks.handle.Delete()
		}
		return nil, err
	}
	if err := args.hold(pg.arg(op, "pg")); err != nil {
		if callbacks != nil {
			callbacks.handle.Delete()
		}
		return nil, err
	}
	var h *C.dp_ddp
	err = l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_create(api, &h, module.h, pg.h, &copts) })
	if err != nil {
		if callbacks != nil {
			callbacks.handle.Delete()
		}
		return nil, err
	}
	return &DDP{lib: l, h: h, callbacks: callbacks}, nil
}

// call is lib.call on a DDP that may be nil.
func (d *DDP) call(op string, f func(api *C.dp_api) C.dp_status) error {
	if d == nil {
		return nilReceiver(op, "d", "*DDP")
	}
	return held(&d.lease, op, "DDP", func() error { return d.lib.call(op, f) })
}

// Close waits for the calls in flight on the reducer (from other
// goroutines), drops the queued reductions, waits for the running one and
// releases the module and the group. Inside a callback, while a call on
// this DDP runs, that happens when the call returns.
func (d *DDP) Close() {
	if d == nil || d.borrowed {
		return
	}
	d.lease.shut(func() {
		if d.h != nil { // one never made holds nothing
			d.lib.use("dp_ddp_destroy", func(api *C.dp_api) { C.dpgo_ddp_destroy(api, d.h) })
		}
		d.h = nil
		if d.callbacks != nil {
			d.callbacks.handle.Delete()
		}
	})
}

// PreForward starts a step (broadcasting buffers from rank 0, unless
// NoBroadcastBuffers).
func (d *DDP) PreForward() error {
	return d.call("dp_ddp_pre_forward", func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_pre_forward(api, d.h) })
}

// MarkGradReady says the named parameter's gradient is final for this step.
// It belongs to the library until FinishBackward returns.
func (d *DDP) MarkGradReady(name string) error {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return d.call("dp_ddp_mark_grad_ready", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_mark_grad_ready(api, d.h, cname)
	})
}

// MarkGradReadyIndex is MarkGradReady by managed-parameter index: those of
// the module that require grad, minus the ignored ones, in listing order.
func (d *DDP) MarkGradReadyIndex(index int) error {
	const op = "dp_ddp_mark_grad_ready_index"
	if index < 0 {
		return invalid(op, "argument 'index' is negative (%d)", index)
	}
	return d.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_mark_grad_ready_index(api, d.h, C.size_t(index))
	})
}

// MarkGradReadyStream says the gradient is final once the work queued so
// far on stream completes: a cudaStream_t of the parameter's GPU, a Stream's
// Pointer for a cpu parameter, or nil for the legacy default stream.
func (d *DDP) MarkGradReadyStream(index int, stream unsafe.Pointer) error {
	const op = "dp_ddp_mark_grad_ready_stream"
	if index < 0 {
		return invalid(op, "argument 'index' is negative (%d)", index)
	}
	return d.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_mark_grad_ready_stream(api, d.h, C.size_t(index), stream)
	})
}

// FinishBackward waits for the reductions: the gradients are then averaged.
// A failed comm hook or OnBucketReduced is the returned error's Cause.
func (d *DDP) FinishBackward() error {
	if d == nil {
		return nilReceiver("dp_ddp_finish_backward", "d", "*DDP")
	}
	err := d.call("dp_ddp_finish_backward", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_finish_backward(api, d.h)
	})
	return d.callbacks.takeErrors(err)
}

// Rebind makes the reducer go on over pg, another group (a shrunk one after
// a peer failed): every rank of pg calls it between steps. The plan and
// options are kept, the parameters and buffers broadcast from pg's rank 0,
// the averages divided by pg's size, and a comm hook is given pg from then
// on. A refusal (bad argument, mid-step) leaves it on its group; a failed
// broadcast leaves only Close (dp_ddp.h).
func (d *DDP) Rebind(pg *ProcessGroup) error {
	const op = "dp_ddp_rebind"
	if pg == nil {
		return nilArgument(op, "pg")
	}
	done, err := pg.arg(op, "pg")
	if err != nil {
		return err
	}
	defer done()
	return d.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_rebind(api, d.h, pg.h) })
}

// SetRequiresGradientSync(false) is no_sync: later backwards only
// accumulate gradients locally (still marked and finished as usual); the
// next synced backward reduces the sum.
func (d *DDP) SetRequiresGradientSync(sync bool) error {
	return d.call("dp_ddp_set_requires_gradient_sync", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_set_requires_gradient_sync(api, d.h, cbool(sync))
	})
}

// NumBuckets is the number of gradient buckets; 0 on a closed reducer or
// library.
func (d *DDP) NumBuckets() int {
	if d == nil {
		return 0
	}
	return heldCount(&d.lease, d.lib, "dp_ddp_num_buckets", "DDP", func(api *C.dp_api) int {
		return int(C.dpgo_ddp_num_buckets(api, d.h))
	})
}

// BucketParameters lists bucket's managed-parameter indices in their order
// inside it.
func (d *DDP) BucketParameters(bucket int) ([]int, error) {
	const op = "dp_ddp_bucket_parameters"
	if bucket < 0 {
		return nil, invalid(op, "argument 'bucket' is negative (%d)", bucket)
	}
	var indices []C.size_t
	err := d.call(op, func(api *C.dp_api) C.dp_status {
		var count C.size_t
		if s := C.dpgo_ddp_bucket_parameters(api, d.h, C.size_t(bucket), nil, 0, &count); s != 0 {
			return s
		}
		indices = make([]C.size_t, count+1) // +1: a valid pointer for an empty bucket
		return C.dpgo_ddp_bucket_parameters(api, d.h, C.size_t(bucket), &indices[0], count, &count)
	})
	if err != nil {
		return nil, err
	}
	out := make([]int, len(indices)-1)
	for i := range out {
		out[i] = int(indices[i])
	}
	return out, nil
}

// DDPStats is what the last synced iteration cost.
type DDPStats struct {
	BackwardMs     float64 // from the first ready mark to the end of FinishBackward
	ReduceMs       float64 // the reductions' running time
	ExposedMs      float64 // the part of ReduceMs spent inside FinishBackward
	NumBuckets     int
	BucketsRebuilt bool // that FinishBackward rebuilt the buckets into another plan
}

func (d *DDP) Stats() (DDPStats, error) {
	var out C.dp_ddp_stats
	out.struct_size = C.size_t(unsafe.Sizeof(out))
	err := d.call("dp_ddp_last_stats", func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_last_stats(api, d.h, &out) })
	return DDPStats{float64(out.backward_ms), float64(out.reduce_ms), float64(out.exposed_ms), int(out.num_buckets),
		out.buckets_rebuilt != 0}, err
}

// ParameterUsed says whether some rank used the managed parameter in the
// last synced iteration (inside OnBucketReduced: the one being reduced);
// without FindUnusedParameters every parameter counts as used.
func (d *DDP) ParameterUsed(index int) (bool, error) {
	const op = "dp_ddp_parameter_used"
	if index < 0 {
		return false, invalid(op, "argument 'index' is negative (%d)", index)
	}
	var out C.int
	err := d.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_parameter_used(api, d.h, C.size_t(index), &out)
	})
	return out != 0, err
}

// BucketPlan is the current bucket plan as text, one line per bucket; pass
// it as DDPOptions.BucketPlan to start a later run with these buckets.
func (d *DDP) BucketPlan() (string, error) {
	var text string
	err := d.call("dp_ddp_bucket_plan", func(api *C.dp_api) C.dp_status {
		var n C.size_t
		if s := C.dpgo_ddp_bucket_plan(api, d.h, nil, 0, &n); s != 0 {
			return s
		}
		buf := make([]byte, int(n)+1)
		if s := C.dpgo_ddp_bucket_plan(api, d.h, (*C.char)(unsafe.Pointer(&buf[0])), C.size_t(len(buf)), &n); s != 0 {
			return s
		}
		text = string(buf[:n])
		return 0
	})
	return text, err
}

// Join says this rank has no more data, for every DDP it drives (the same
// ones in the same order on every rank): it stands in for the other ranks'
// iterations until all have joined, then every rank holds the parameters
// of the rank that ran the most iterations. Call it after FinishBackward.
func (l *Library) Join(ddps ...*DDP) error {
	const op = "dp_ddp_join"
	if len(ddps) == 0 {
		return invalid(op, "argument 'ddps' is empty")
	}
	hs := make([]*C.dp_ddp, len(ddps))
	var args heldArgs
	defer args.release()
	for i, d := range ddps {
		if d == nil || !d.lease.enter() {
			return invalid(op, "argument 'ddps'[%d] is nil or closed", i)
		}
		args = append(args, d.lease.leave)
		hs[i] = d.h
	}
	err := l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_join(api, &hs[0], C.size_t(len(hs))) })
	for _, d := range ddps {
		err = d.callbacks.takeErrors(err)
	}
	return err
}
