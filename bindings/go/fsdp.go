package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import "unsafe"

// FSDPOptions are fully_shard's settings; zero values take the library's
// defaults.
type FSDPOptions struct {
	// KeepUnshardedAfterForward keeps the full parameters from an unshard to
	// the next PostBackward (ZeRO-2); by default Reshard frees them (ZeRO-3).
	KeepUnshardedAfterForward bool
	// MixedPrecision, when set, computes and reduces in other dtypes than the
	// parameters' own.
	MixedPrecision *FSDPMixedPrecision
	// NoInitSync skips the agreement check and rank 0's values at create.
	NoInitSync bool
	// FullParamsAsViews, on a shared-memory group of two or more ranks
	// (without NoInitSync), makes the full parameters views of every rank's
	// shards: an unshard copies nothing. A write to a full parameter then
	// reaches every rank's shard, and shards may be written only while no
	// rank has this FSDP unsharded (after FinishBackward, say). Elsewhere,
	// or with a ParamDType cast, the full parameters stay copies.
	FullParamsAsViews bool
}

// FSDPMixedPrecision: the full parameters and their gradients are in
// ParamDType (BFloat16, say); gradients are reduced in ReduceDType (Float32,
// the zero value, avoids 16-bit sums); the shards keep their own dtype.
type FSDPMixedPrecision struct {
	ParamDType  DType
	ReduceDType DType
}

// FSDP is fully_shard over a module: each rank keeps only its rows of every
// parameter it manages (those of the module no other live FSDP holds, so
// make the children's first). The host drives it around its forward and
// backward:
//
//	Unshard (or UnshardAsync then WaitUnshard) ... forward ... Reshard
//	Unshard ... backward into the full gradients (Module.Grad) ... PostBackward
//	FinishBackward, then the optimizer steps on Shard / ShardGrad
//
// Every rank makes the same calls in the same order. Each full parameter
// keeps one address from the first Unshard to Close: a tensor taken while
// unsharded sees every later unshard's values, and reads zeros while
// resharded on the CPU (its pages are given back; dp_fsdp.h).
type FSDP struct {
	lib   *Library
	h     *C.dp_fsdp
	lease lease // the calls in flight; Close waits for them
}

// NewFSDP shards module's parameters over pg (collective unless
// NoInitSync): the module's slots then hold this rank's shards.
func (l *Library) NewFSDP(module *Module, pg *ProcessGroup, opts *FSDPOptions) (*FSDP, error) {
	const op = "dp_fsdp_create"
	return l.newFSDP(op, module, opts, func(args *heldArgs) error {
		if pg == nil {
			return nilArgument(op, "pg")
		}
		return args.hold(pg.arg(op, "pg"))
	},
		func(api *C.dp_api, h **C.dp_fsdp, copts *C.dp_fsdp_options) C.dp_status {
			return C.dpgo_fsdp_create(api, h, module.h, pg.h, copts)
		})
}

// NewFSDPOnMesh is FSDP2's mesh argument: on a 1-D mesh as NewFSDP over its
// group; on a 2-D mesh HSDP, the shards over dimension 1's group and
// replicated across dimension 0's (gradients averaged over every rank).
func (l *Library) NewFSDPOnMesh(module *Module, mesh *DeviceMesh, opts *FSDPOptions) (*FSDP, error) {
	const op = "dp_fsdp_create_on_mesh"
	return l.newFSDP(op, module, opts, func(args *heldArgs) error {
		if mesh == nil {
			return nilArgument(op, "mesh")
		}
		return args.hold(heldArg(&mesh.lease, op, "mesh", "device mesh"))
	}, func(api *C.dp_api, h **C.dp_fsdp, copts *C.dp_fsdp_options) C.dp_status {
		return C.dpgo_fsdp_create_on_mesh(api, h, module.h, mesh.h, copts)
	})
}

// newFSDP is NewFSDP and NewFSDPOnMesh past their groups: hold holds the
// group or mesh for the call, create makes the dp_fsdp.
func (l *Library) newFSDP(op string, module *Module, opts *FSDPOptions, hold func(args *heldArgs) error,
	create func(api *C.dp_api, h **C.dp_fsdp, copts *C.dp_fsdp_options) C.dp_status) (*FSDP, error) {
	if module == nil {
		return nil, nilArgument(op, "module")
	}
	var copts C.dp_fsdp_options
	err := l.call("dp_fsdp_options_init", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_options_init(api, &copts, C.size_t(unsafe.Sizeof(copts)))
	})
	if err != nil {
		return nil, err
	}
	if opts != nil {
		copts.reshard_after_forward = cbool(!opts.KeepUnshardedAfterForward)
		copts.init_sync = cbool(!opts.NoInitSync)
		copts.full_params_as_views = cbool(opts.FullParamsAsViews)
		if mp := opts.MixedPrecision; mp != nil {
			copts.param_dtype = C.int32_t(mp.ParamDType)
			copts.reduce_dtype = C.int32_t(mp.ReduceDType)
		}
	}
	var args heldArgs
	defer args.release()
	if err := args.hold(module.arg(op, "module")); err != nil {
		return nil, err
	}
	if err := hold(&args); err != nil {
		return nil, err
	}
	var h *C.dp_fsdp
	err = l.call(op, func(api *C.dp_api) C.dp_status { return create(api, &h, &copts) })
	if err != nil {
		return nil, err
	}
	return &FSDP{lib: l, h: h}, nil
}

// Close is collective (every rank closes its FSDP of the pair): the
// module's slots get the full parameters back, once the calls in flight on
// this FSDP (from other goroutines) have returned.
func (f *FSDP) Close() {
	if f == nil {
		return
	}
	shutHandle(&f.lease, f.lib, "dp_fsdp_destroy", &f.h, func(api *C.dp_api, h *C.dp_fsdp) {
		C.dpgo_fsdp_destroy(api, h)
	})
}

// simple is lib.call holding the FSDP's handle; a closed FSDP is StatusState.
func (f *FSDP) simple(op string, fn func(api *C.dp_api) C.dp_status) error {
	if f == nil {
		return nilReceiver(op, "f", "*FSDP")
	}
	return held(&f.lease, op, "FSDP", func() error {
		if f.h == nil { // an FSDP not made by NewFSDP
			return invalid(op, "the FSDP is closed")
		}
		return f.lib.call(op, fn)
	})
}

// Unshard all-gathers: the slots hold the full parameters once it returns.
func (f *FSDP) Unshard() error {
	return f.simple("dp_fsdp_unshard", func(api *C.dp_api) C.dp_status { return C.dpgo_fsdp_unshard(api, f.h, 0) })
}

// UnshardAsync starts the all-gather and returns (prefetch); WaitUnshard or
// Unshard completes it.
func (f *FSDP) UnshardAsync() error {
	return f.simple("dp_fsdp_unshard", func(api *C.dp_api) C.dp_status { return C.dpgo_fsdp_unshard(api, f.h, 1) })
}

func (f *FSDP) WaitUnshard() error {
	return f.simple("dp_fsdp_wait_unshard", func(api *C.dp_api) C.dp_status { return C.dpgo_fsdp_wait_unshard(api, f.h) })
}

// Reshard puts the shards back in the slots (see KeepUnshardedAfterForward).
func (f *FSDP) Reshard() error {
	return f.simple("dp_fsdp_reshard", func(api *C.dp_api) C.dp_status { return C.dpgo_fsdp_reshard(api, f.h) })
}

// PostBackward says the full gradients are final: it reshards and starts
// reduce-scattering their average into the shard gradients.
func (f *FSDP) PostBackward() error {
	return f.simple("dp_fsdp_post_backward", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_post_backward(api, f.h)
	})
}

// MarkGradReady is FSDP2's per-parameter hook: managed parameter name's
// full gradient is final. Any goroutine, any order, several at once; the
// mark that completes the set of parameters that required grad at create
// runs PostBackward itself (an explicit PostBackward after it is a no-op).
// A FinishBackward after some marks but not all fails naming the others.
func (f *FSDP) MarkGradReady(name string) error {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	return f.simple("dp_fsdp_mark_grad_ready", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_mark_grad_ready(api, f.h, cname)
	})
}

// FinishBackward waits for the last PostBackward's reduce-scatter.
func (f *FSDP) FinishBackward() error {
	return f.simple("dp_fsdp_finish_backward", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_finish_backward(api, f.h)
	})
}

// SetRequiresGradientSync(false): PostBackward keeps the full gradients,
// which later backwards add to; the next synced one reduces the sum.
func (f *FSDP) SetRequiresGradientSync(sync bool) error {
	return f.simple("dp_fsdp_set_requires_gradient_sync", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_set_requires_gradient_sync(api, f.h, cbool(sync))
	})
}

// NumParameters counts the managed parameters; 0 on a closed FSDP.
func (f *FSDP) NumParameters() int {
	if f == nil {
		return 0
	}
	return heldCount(&f.lease, f.lib, "dp_fsdp_num_parameters", "FSDP", func(api *C.dp_api) int {
		return int(C.dpgo_fsdp_num_parameters(api, f.h))
	})
}

// ParameterNames lists the managed parameters, relative to the module, in
// its listing order (the indices of Shard and ShardGrad).
func (f *FSDP) ParameterNames() ([]string, error) {
	var names []string
	err := f.simple("dp_fsdp_parameter_name", func(api *C.dp_api) C.dp_status {
		n := int(C.dpgo_fsdp_num_parameters(api, f.h))
		names = make([]string, 0, n)
		for i := 0; i < n; i++ {
			var name *C.char
			if s := C.dpgo_fsdp_parameter_name(api, f.h, C.size_t(i), &name); s != 0 {
				return s
			}
			names = append(names, C.GoString(name))
		}
		return 0
	})
	return names, err
}

func (f *FSDP) shardTensor(op string, index int, fn func(api *C.dp_api, out **C.dp_tensor) C.dp_status) (*Tensor,
	error) {
	if index < 0 {
		return nil, invalid(op, "argument 'index' is negative (%d)", index)
	}
	var h *C.dp_tensor
	if err := f.simple(op, func(api *C.dp_api) C.dp_status { return fn(api, &h) }); err != nil {
		return nil, err
	}
	return f.lib.ownedTensor(h), nil
}

// Shard is this rank's rows of managed parameter index (the shard itself:
// the optimizer updates it in place); a tensor of 0 rows when this rank
// keeps none.
func (f *FSDP) Shard(index int) (*Tensor, error) {
	return f.shardTensor("dp_fsdp_shard", index, func(api *C.dp_api, out **C.dp_tensor) C.dp_status {
		return C.dpgo_fsdp_shard(api, f.h, C.size_t(index), out)
	})
}

// ShardGrad is the gradient of Shard(index), final after FinishBackward.
func (f *FSDP) ShardGrad(index int) (*Tensor, error) {
	return f.shardTensor("dp_fsdp_shard_grad", index, func(api *C.dp_api, out **C.dp_tensor) C.dp_status {
		return C.dpgo_fsdp_shard_grad(api, f.h, C.size_t(index), out)
	})
}

// SaveFullStateDict gathers the sharded parameters of the module (whose
// FSDPs are all on pg and resharded) and rank 0 writes path as Save would
// for the unsharded module. Collective.
func (m *Module) SaveFullStateDict(pg *ProcessGroup, path string) error {
	return m.saveStateDict("dp_fsdp_save_full_state_dict", pg, path,
		func(api *C.dp_api, group *C.dp_process_group, cpath *C.char) C.dp_status {
			return C.dpgo_fsdp_save_full_state_dict(api, m.h, group, cpath)
		})
}

// FullStateDict is the full state dict in memory: collective over pg as
// SaveFullStateDict; on rank root (every rank for -1) a new module of the
// unsharded tensors, cpu copies under the file's names; nil on the others.
func (m *Module) FullStateDict(pg *ProcessGroup, root int) (*Module, error) {
	const op = "dp_fsdp_full_state_dict"
	if pg == nil {
		return nil, nilArgument(op, "pg")
	}
	done, err := pg.arg(op, "pg")
	if err != nil {
		return nil, err
	}
	defer done()
	var h *C.dp_module
	if err := m.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_full_state_dict(api, m.h, pg.h, C.int32_t(root), &h)
	}); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, nil
	}
	return &Module{lib: m.lib, h: h}, nil
}

// saveStateDict runs op, a save collective over pg, to path.
func (m *Module) saveStateDict(op string, pg *ProcessGroup, path string,
	save func(api *C.dp_api, group *C.dp_process_group, cpath *C.char) C.dp_status) error {
	if pg == nil {
		return nilArgument(op, "pg")
	}
	done, err := pg.arg(op, "pg")
	if err != nil {
		return err
	}
	defer done()
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return m.call(op, func(api *C.dp_api) C.dp_status { return save(api, pg.h, cpath) })
}

// LoadFullStateDict reads a full state dict: each rank keeps its rows of
// the sharded parameters and every other tensor whole. Local.
func (m *Module) LoadFullStateDict(path string, strict bool) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	return m.call("dp_fsdp_load_full_state_dict", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_load_full_state_dict(api, m.h, cpath, cbool(strict))
	})
}

// SaveShardedStateDict writes this rank's rows to one file per rank in
// folder (made when missing), then rank 0 writes the save's manifest last.
// Collective over pg: it succeeds on every rank or fails on every rank, and
// a failed save leaves the folder's last complete save loadable.
func (m *Module) SaveShardedStateDict(pg *ProcessGroup, folder string) error {
	return m.saveStateDict("dp_fsdp_save_sharded_state_dict", pg, folder,
		func(api *C.dp_api, group *C.dp_process_group, cfolder *C.char) C.dp_status {
			return C.dpgo_fsdp_save_sharded_state_dict(api, m.h, group, cfolder)
		})
}

// SaveShardedStateDictAsync is SaveShardedStateDict in the background: it
// copies this rank's part aside and returns; a library thread writes the
// same files and manifest, and the Work's Wait reports the save's outcome,
// the same on every rank. What the host changes after it returns is not
// saved, and pg stays the host's to drive meanwhile.
func (m *Module) SaveShardedStateDictAsync(pg *ProcessGroup, folder string) (*Work, error) {
	const op = "dp_fsdp_save_sharded_state_dict_async"
	var h *C.dp_work
	err := m.saveStateDict(op, pg, folder, func(api *C.dp_api, group *C.dp_process_group, cfolder *C.char) C.dp_status {
		return C.dpgo_fsdp_save_sharded_state_dict_async(api, m.h, group, cfolder, &h)
	})
	if err != nil {
		return nil, err
	}
	return &Work{lib: pg.lib, h: h}, nil
}

// LoadShardedStateDict reads a complete sharded save (of any world size),
// checked against its manifest, and keeps the rows this rank holds now.
// Collective over the group of the Fsdp holding the module: every rank
// loads, or none does and the module is unchanged.
func (m *Module) LoadShardedStateDict(folder string) error {
	cfolder := C.CString(folder)
	defer C.free(unsafe.Pointer(cfolder))
	return m.call("dp_fsdp_load_sharded_state_dict", func(api *C.dp_api) C.dp_status {
		return C.dpgo_fsdp_load_sharded_state_dict(api, m.h, cfolder)
	})
}
