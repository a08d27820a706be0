package dparallel

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// argCase is a call expected to be a DP_EINVAL naming an argument.
type argCase struct {
	what string
	call func() error
	name string
}

// checkArgCases runs each call (a panic counts as a failure) and wants
// DP_EINVAL whose message names the argument.
func checkArgCases(t *testing.T, cases []argCase) {
	t.Helper()
	for _, c := range cases {
		err := func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("panicked: %v", r)
				}
			}()
			return c.call()
		}()
		var de *Error
		if !errors.As(err, &de) || !errors.Is(err, StatusInvalid) || !strings.Contains(de.Message, c.name) {
			t.Errorf("%s: got %v, want DP_EINVAL naming %s", c.what, err, c.name)
		}
	}
}

// Nil handles, as arguments or as receivers, are errors naming the
// argument, never panics; accessors on nil handles give the invalid-handle
// values.
func TestNilHandlesAreErrorsNamingThem(t *testing.T) {
	lib, m, x := openWithModuleAndTensor(t)
	pg := &ProcessGroup{lib: lib}
	var (
		nt   *Tensor
		nm   *Module
		npg  *ProcessGroup
		ns   *Store
		nd   *DDP
		nf   *FSDP
		nst  *Stream
		nset *ReplicaSet
		nw   *Work
	)
	fn := replicaStep(lib)
	second := func(_ interface{}, err error) error { return err }
	checkArgCases(t, []argCase{
		{"AllReduce of nil", func() error { return pg.AllReduce(nil, Sum) }, "'t'"},
		{"AllReduceAsync of nil", func() error { return second(pg.AllReduceAsync(nil, Sum)) }, "'t'"},
		{"Broadcast of nil", func() error { return pg.Broadcast(nil, 0) }, "'t'"},
		{"BroadcastAsync of nil", func() error { return second(pg.BroadcastAsync(nil, 0)) }, "'t'"},
		{"nil Tensor.CopyFromFloat32s", func() error { return nt.CopyFromFloat32s([]float32{1}) }, "'t'"},
		{"nil Tensor.CopyToFloat32s", func() error { return nt.CopyToFloat32s([]float32{1}) }, "'t'"},
		{"nil Tensor.Shape", func() error { return second(nt.Shape()) }, "'t'"},
		{"nil Tensor.ToDevice", func() error { return second(nt.ToDevice(CPU(0))) }, "'t'"},
		{"nil Tensor.ToDLPack", func() error { return second(nt.ToDLPack()) }, "'t'"},
		{"nil ProcessGroup.AllReduce", func() error { return npg.AllReduce(x, Sum) }, "'pg'"},
		{"nil ProcessGroup.Broadcast", func() error { return npg.Broadcast(x, 0) }, "'pg'"},
		{"nil ProcessGroup.Barrier", func() error { return npg.Barrier() }, "'pg'"},
		{"nil ProcessGroup.BarrierAsync", func() error { return second(npg.BarrierAsync()) }, "'pg'"},
		{"nil ProcessGroup.AllGather", func() error { return npg.AllGather(x, []*Tensor{x}) }, "'pg'"},
		{"nil ProcessGroup.ReduceScatterAsync", func() error {
			return second(npg.ReduceScatterAsync([]*Tensor{x}, x, Sum))
		}, "'pg'"},
		{"nil Module.Parameter", func() error { return second(nm.Parameter("w")) }, "'m'"},
		{"nil Module.RegisterParameter", func() error { return nm.RegisterParameter("w", x, true) }, "'m'"},
		{"nil Module.ZeroGrad", func() error { return nm.ZeroGrad() }, "'m'"},
		{"nil Module.ParameterNames", func() error { return second(nm.ParameterNames()) }, "'m'"},
		{"nil Module.LoadShardedStateDict", func() error { return nm.LoadShardedStateDict(t.TempDir()) }, "'m'"},
		{"nil Store.Set", func() error { return ns.Set("k", []byte("v")) }, "'s'"},
		{"nil Store.Get", func() error { return second(ns.Get("k")) }, "'s'"},
		{"nil Store.Wait", func() error { return ns.Wait([]string{"k"}, time.Second) }, "'s'"},
		{"nil DDP.PreForward", func() error { return nd.PreForward() }, "'d'"},
		{"nil DDP.FinishBackward", func() error { return nd.FinishBackward() }, "'d'"},
		{"nil DDP.BucketPlan", func() error { return second(nd.BucketPlan()) }, "'d'"},
		{"nil DDP.Rebind", func() error { return nd.Rebind(pg) }, "'d'"},
		{"DDP.Rebind onto nil", func() error { return (&DDP{lib: lib}).Rebind(nil) }, "'pg'"},
		{"nil FSDP.Unshard", func() error { return nf.Unshard() }, "'f'"},
		{"nil FSDP.Shard", func() error { return second(nf.Shard(0)) }, "'f'"},
		{"nil Stream.Synchronize", func() error { return nst.Synchronize() }, "'s'"},
		{"nil Stream.LaunchHostFunc", func() error { return nst.LaunchHostFunc(func() {}) }, "'s'"},
		{"nil ReplicaSet.Sync", func() error { return nset.Sync() }, "'s'"},
		{"nil ReplicaSet.Apply", func() error { return second(nset.Apply(x, 0, CPU(0), fn)) }, "'s'"},
		{"nil Work.Wait", func() error { return nw.Wait() }, "'w'"},
		{"Replicate of nil", func() error { return second(lib.Replicate(nil, []Device{CPU(0)}, false)) }, "'module'"},
		{"ReduceGradients into nil", func() error { return lib.ReduceGradients([]*Module{m}, nil) }, "'target'"},
		{"ReduceGradients of nil", func() error { return lib.ReduceGradients([]*Module{nil}, m) }, "'replicas'[0]"},
		{"NewDDP of nil", func() error { return second(lib.NewDDP(nil, pg, nil)) }, "'module'"},
		{"NewDDP over nil", func() error { return second(lib.NewDDP(m, nil, nil)) }, "'pg'"},
		{"NewFSDP over nil", func() error { return second(lib.NewFSDP(m, nil, nil)) }, "'pg'"},
		{"DataParallel of nil", func() error {
			return second(lib.DataParallel(m, nil, []Device{CPU(0)}, CPU(0), 0, fn))
		}, "'input'"},
		{"ParallelApply of nil", func() error {
			return second(lib.ParallelApply([]*Module{m}, []*Tensor{nil}, nil, fn))
		}, "'inputs'[0]"},
	})
	if nt.DType() != -1 || nt.Numel() != -1 || nt.Device().Index != -1 || nt.NBytes() != 0 || nt.Data() != nil ||
		nm.NumParameters() != 0 || nm.NumBuffers() != 0 || npg.Rank() != -1 || npg.Size() != -1 ||
		npg.Backend() != "" || nd.NumBuckets() != 0 || nf.NumParameters() != 0 || nset.Size() != 0 ||
		nst.Pointer() != nil || nst.Device().Index != -1 {
		t.Error("accessors on nil handles do not give the invalid-handle values")
	}
}

// An int that does not fit the library's int32 is an error naming it,
// never a truncated value (1<<32 would be 0).
func TestOutOfRangeIntsAreErrorsNamingThem(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	const big = 1 << 32
	store, err := lib.NewFileStore(filepath.Join(t.TempDir(), "store"), 1)
	must(t, err)
	defer store.Close()
	pg, err := lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Store: store})
	must(t, err)
	defer pg.Close()
	m, err := lib.NewModule()
	must(t, err)
	defer m.Close()
	x, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4}, []int64{2, 2}, CPU(0))
	must(t, err)
	defer x.Close()
	set, err := lib.NewReplicaSet(m, []Device{CPU(0)})
	must(t, err)
	defer set.Close()
	fn := replicaStep(lib)
	// A call that wrongly succeeds hands back handles: close them.
	closing := func(v interface{}, err error) error {
		switch h := v.(type) {
		case *Tensor:
			h.Close()
		case []*Tensor:
			closeTensors(h)
		case *ProcessGroup:
			h.Close()
		case *Store:
			h.Close()
		case *Stream:
			h.Close()
		case *Work:
			if h != nil {
				h.Wait()
				h.Close()
			}
		}
		return err
	}
	otherStore := func() *Store {
		s, err := lib.NewFileStore(filepath.Join(t.TempDir(), "other"), 1)
		must(t, err)
		return s
	}
	checkArgCases(t, []argCase{
		{"Broadcast from root 1<<32", func() error { return pg.Broadcast(x, big) }, "'root'"},
		{"BroadcastAsync from root 1<<32", func() error { return closing(pg.BroadcastAsync(x, big)) }, "'root'"},
		{"rank 1<<32", func() error {
			s := otherStore()
			defer s.Close()
			return closing(lib.NewProcessGroup(big, 1+big, &ProcessGroupOptions{Store: s}))
		}, "'rank'"},
		{"world size 1+1<<32", func() error {
			s := otherStore()
			defer s.Close()
			return closing(lib.NewProcessGroup(0, 1+big, &ProcessGroupOptions{Store: s}))
		}, "'worldSize'"},
		{"a group's device index 1<<32", func() error {
			s := otherStore()
			defer s.Close()
			return closing(lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Store: s, Device: CPU(big)}))
		}, "'opts.Device'"},
		{"a group timeout past int32 ms", func() error {
			return closing(lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Timeout: 1000 * time.Hour}))
		}, "'opts.Timeout'"},
		{"Scatter along dim 1<<32", func() error {
			return closing(lib.Scatter(x, []Device{CPU(0)}, nil, big))
		}, "'dim'"},
		{"Gather along dim 1<<32", func() error { return closing(lib.Gather([]*Tensor{x}, big, CPU(0))) }, "'dim'"},
		{"Gather onto cpu:1<<32", func() error { return closing(lib.Gather([]*Tensor{x}, 0, CPU(big))) },
			"'destination'"},
		{"DataParallel along dim 1<<32", func() error {
			return closing(lib.DataParallel(m, x, []Device{CPU(0)}, CPU(0), big, fn))
		}, "'dim'"},
		{"ReplicaSet.Apply along dim 1<<32", func() error { return closing(set.Apply(x, big, CPU(0), fn)) }, "'dim'"},
		{"NewTensor on cpu:1<<32", func() error {
			return closing(lib.NewTensor(Float32, []int64{2}, CPU(big)))
		}, "'device'"},
		{"ToDevice cpu:1+1<<32", func() error { return closing(x.ToDevice(CPU(1 + big))) }, "'device'"},
		{"Broadcast onto cpu:1<<32", func() error {
			return closing(lib.Broadcast(x, []Device{CPU(0), CPU(big)}))
		}, "'devices'[1]"},
		{"ReduceAdd onto cpu:1<<32", func() error { return closing(lib.ReduceAdd([]*Tensor{x}, CPU(big))) },
			"'destination'"},
		{"a file store of 1+1<<32 users", func() error {
			return closing(lib.NewFileStore(filepath.Join(t.TempDir(), "big"), 1+big))
		}, "'worldSize'"},
		{"a TCP store of 1+1<<32 users", func() error {
			return closing(lib.NewTCPStore("127.0.0.1", 0, 1+big, true, 10*time.Second))
		}, "'worldSize'"},
		{"a store wait past int32 ms", func() error { return store.Wait([]string{"k"}, 1000*time.Hour) }, "'timeout'"},
		{"a store timeout past int32 ms", func() error { return store.SetTimeout(1000 * time.Hour) }, "'timeout'"},
		{"NewStream on cpu:1<<32", func() error { return closing(lib.NewStream(CPU(big))) }, "'device'"},
		{"a wrapped stream of cpu:1<<32", func() error { return lib.WrapStream(CPU(big), nil).Synchronize() },
			"'device'"},
		{"SetCurrentStream of cpu:1<<32", func() error { return lib.SetCurrentStream(CPU(big), nil) }, "'device'"},
		{"FormatDevice of cpu:1<<32", func() error { return closing(lib.FormatDevice(CPU(big))) }, "'d'"},
		{"MemoryStats of cpu:1<<32", func() error { return closing(lib.MemoryStats(CPU(big))) }, "'d'"},
	})
}
