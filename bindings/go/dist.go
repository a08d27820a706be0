package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import "unsafe"

// ReduceOp combines tensors across ranks.
type ReduceOp int32

const (
	Sum  ReduceOp = 0
	Avg  ReduceOp = 1
	Min  ReduceOp = 2
	Max  ReduceOp = 3
	Prod ReduceOp = 4
)

// ProcessGroup is this process's membership of a group of ranks.
type ProcessGroup struct {
	lib *Library
	h   *C.dp_process_group
}

// ProcessGroupFromEnv joins the group described by RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT (as dp-run and torchrun set them), with the
// default options: Gloo (or shared memory on one host) on cpu:0.
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

// Close waits for queued collectives, then leaves the group.
func (pg *ProcessGroup) Close() {
	if pg == nil || pg.h == nil {
		return
	}
	pg.lib.use("dp_process_group_destroy", func(api *C.dp_api) { C.dpgo_process_group_destroy(api, pg.h) })
	pg.h = nil
}

// Rank, Size and Backend describe the group; -1, -1 and "" on a closed group
// or library, as the library answers for an invalid handle.
func (pg *ProcessGroup) Rank() int {
	rank := -1
	pg.lib.use("dp_process_group_rank", func(api *C.dp_api) { rank = int(C.dpgo_process_group_rank(api, pg.h)) })
	return rank
}

func (pg *ProcessGroup) Size() int {
	size := -1
	pg.lib.use("dp_process_group_size", func(api *C.dp_api) { size = int(C.dpgo_process_group_size(api, pg.h)) })
	return size
}

func (pg *ProcessGroup) Backend() (backend string) {
	pg.lib.use("dp_process_group_backend", func(api *C.dp_api) {
		backend = C.GoString(C.dpgo_process_group_backend(api, pg.h))
	})
	return backend
}

// AllReduce combines t across ranks, in place.
func (pg *ProcessGroup) AllReduce(t *Tensor, op ReduceOp) error {
	return pg.lib.call("dp_pg_all_reduce", func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_all_reduce(api, pg.h, t.h, C.int32_t(op))
	})
}

// Broadcast copies root's t to every rank, in place.
func (pg *ProcessGroup) Broadcast(t *Tensor, root int) error {
	return pg.lib.call("dp_pg_broadcast", func(api *C.dp_api) C.dp_status {
		return C.dpgo_pg_broadcast(api, pg.h, t.h, C.int32_t(root))
	})
}

func (pg *ProcessGroup) Barrier() error {
	return pg.lib.call("dp_pg_barrier", func(api *C.dp_api) C.dp_status { return C.dpgo_pg_barrier(api, pg.h) })
}

// DDPOptions are the reducer's settings; zero values take the library's
// defaults (25 MB buckets, 1 MB first bucket).
type DDPOptions struct {
	BucketCapMB          float64
	FirstBucketCapMB     float64
	GradientAsBucketView bool
}

// DDP averages a module's gradients across the ranks of a group while the
// backward runs: the host marks each parameter's gradient ready as it is
// produced.
type DDP struct {
	lib *Library
	h   *C.dp_ddp
}

// NewDDP makes the reducer; every rank's module starts from rank 0's
// parameters.
func (l *Library) NewDDP(module *Module, pg *ProcessGroup, opts *DDPOptions) (*DDP, error) {
	const op = "dp_ddp_create"
	if module == nil || pg == nil {
		return nil, invalid(op, "argument 'module' or 'pg' is nil")
	}
	var copts C.dp_ddp_options
	err := l.call("dp_ddp_options_init", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_options_init(api, &copts, C.size_t(unsafe.Sizeof(copts)))
	})
	if err != nil {
		return nil, err
	}
	if opts != nil {
		if opts.BucketCapMB > 0 {
			copts.bucket_cap_mb = C.double(opts.BucketCapMB)
		}
		if opts.FirstBucketCapMB > 0 {
			copts.first_bucket_cap_mb = C.double(opts.FirstBucketCapMB)
		}
		if opts.GradientAsBucketView {
			copts.gradient_as_bucket_view = 1
		}
	}
	var h *C.dp_ddp
	err = l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_create(api, &h, module.h, pg.h, &copts) })
	if err != nil {
		return nil, err
	}
	return &DDP{lib: l, h: h}, nil
}

func (d *DDP) Close() {
	if d == nil || d.h == nil {
		return
	}
	d.lib.use("dp_ddp_destroy", func(api *C.dp_api) { C.dpgo_ddp_destroy(api, d.h) })
	d.h = nil
}

// PreForward starts a step.
func (d *DDP) PreForward() error {
	return d.lib.call("dp_ddp_pre_forward", func(api *C.dp_api) C.dp_status { return C.dpgo_ddp_pre_forward(api, d.h) })
}

// MarkGradReady says the named parameter's gradient is final for this step.
func (d *DDP) MarkGradReady(name string) error {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return d.lib.call("dp_ddp_mark_grad_ready", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_mark_grad_ready(api, d.h, cname)
	})
}

// FinishBackward waits for the reductions: the gradients are then averaged.
func (d *DDP) FinishBackward() error {
	return d.lib.call("dp_ddp_finish_backward", func(api *C.dp_api) C.dp_status {
		return C.dpgo_ddp_finish_backward(api, d.h)
	})
}

// NumBuckets is the number of gradient buckets; 0 on a closed reducer or
// library.
func (d *DDP) NumBuckets() (n int) {
	d.lib.use("dp_ddp_num_buckets", func(api *C.dp_api) { n = int(C.dpgo_ddp_num_buckets(api, d.h)) })
	return n
}
