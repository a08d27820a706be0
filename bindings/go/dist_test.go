package dparallel

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// rankT reports one rank's failures; must ends that rank's goroutine (the
// other ranks then fail at the group's timeout).
type rankT struct {
	t    *testing.T
	rank int
}

func (r *rankT) must(err error) {
	if err != nil {
		r.t.Errorf("rank %d: %v", r.rank, err)
		runtime.Goexit()
	}
}

func (r *rankT) errorf(format string, args ...interface{}) {
	r.t.Errorf("rank %d: %s", r.rank, fmt.Sprintf(format, args...))
}

// runRanks runs body as `world` ranks, each a goroutine on a thread of its
// own with its own process group over one file store, and waits for them.
func runRanks(t *testing.T, lib *Library, world int, backend Backend, body func(r *rankT, pg *ProcessGroup)) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "store")
	var wg sync.WaitGroup
	for rank := 0; rank < world; rank++ {
		wg.Add(1)
		go func(rank int) {
			defer wg.Done()
			// A group is driven from one thread (async work, marks).
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			r := &rankT{t: t, rank: rank}
			store, err := lib.NewFileStore(path, world)
			r.must(err)
			pg, err := lib.NewProcessGroup(rank, world, &ProcessGroupOptions{Backend: backend, Store: store,
				Timeout: 30 * time.Second})
			store.Close()
			r.must(err)
			defer pg.Close()
			body(r, pg)
		}(rank)
	}
	wg.Wait()
}

func zeros(n int) [][]float32 {
	out := make([][]float32, layers)
	for l := range out {
		out[l] = make([]float32, n)
	}
	return out
}

// accumulate runs forwardBackward on rows into scratch gradients and adds
// them to v's, calling done(l) once layer l's sum is in place.
func accumulate(v *views, rows []float32, n, fullBatch int, done func(int) error) (float64, error) {
	gw, gb := zeros(width*width), zeros(width)
	return forwardBackward(v.w, v.b, gw, gb, rows, n, fullBatch, func(l int) error {
		for i := range gw[l] {
			v.gw[l][i] += gw[l][i]
		}
		for i := range gb[l] {
			v.gb[l][i] += gb[l][i]
		}
		if done == nil {
			return nil
		}
		return done(l)
	})
}

// markLayer marks layer l's weight and bias ready.
func markLayer(ddp *DDP) func(int) error {
	return func(l int) error {
		if err := ddp.MarkGradReady(weightName(l)); err != nil {
			return err
		}
		return ddp.MarkGradReady(biasName(l))
	}
}

// Two ranks train with gradient accumulation (the first half of each
// rank's share under no_sync, the second synced) and a comm hook written in
// Go that all-reduces each bucket and divides it itself; both ranks reach
// single-process training on the full batch, the hook runs only in synced
// backwards, and a hook's error, panic or runtime.Goexit comes back from
// FinishBackward.
func TestNoSyncAndGoCommHookMatchSingleProcess(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	const world = 2
	teacherW, teacherB := initialParameters(99)
	wantW, wantB, _ := reference(teacherW, teacherB)
	runRanks(t, lib, world, BackendAuto, func(r *rankT, pg *ProcessGroup) {
		w0, b0 := initialParameters(7 + uint64(r.rank))
		model := buildModel(r.t, lib, w0, b0)
		defer model.Close()
		var hookCalls atomic.Int32
		var ddp *DDP
		var nested error
		hook := func(pg *ProcessGroup, bucket int, flat *Tensor) error {
			if hookCalls.Add(1) == 1 {
				// Any other DDP call from a hook would wait for this bucket.
				nested = ddp.FinishBackward()
			}
			if err := pg.AllReduce(flat, Sum); err != nil {
				return err
			}
			values, err := flat.Float32s()
			if err != nil {
				return err
			}
			for i := range values {
				values[i] /= float32(pg.Size())
			}
			return nil
		}
		var err error
		ddp, err = lib.NewDDP(model, pg, &DDPOptions{BucketCapMB: 0.001, FirstBucketCapMB: 0.001, CommHookFunc: hook})
		r.must(err)
		buckets := ddp.NumBuckets()
		if buckets < 2 {
			r.errorf("%d buckets, want several", buckets)
		}
		share := batch / world
		half := share / 2
		for step := 0; step < steps; step++ {
			rows := batchOf(step, teacherW, teacherB)[r.rank*share*2*width : (r.rank+1)*share*2*width]
			r.must(model.ZeroGrad())
			for micro := 0; micro < 2; micro++ {
				r.must(ddp.SetRequiresGradientSync(micro == 1))
				r.must(ddp.PreForward())
				v, err := moduleViews(model)
				r.must(err)
				before := hookCalls.Load()
				_, err = accumulate(v, rows[micro*half*2*width:(micro+1)*half*2*width], half, share, markLayer(ddp))
				r.must(err)
				r.must(ddp.FinishBackward())
				if micro == 0 && hookCalls.Load() != before {
					r.errorf("step %d: the hook ran in a no_sync backward", step)
				}
				if micro == 1 {
					for l := 0; l < layers; l++ {
						sgd(v.w[l], v.gw[l])
						sgd(v.b[l], v.gb[l])
					}
				}
				v.close()
			}
		}
		if !errors.Is(nested, StatusState) {
			r.errorf("FinishBackward from inside the hook gave %v, want DP_ESTATE", nested)
		}
		if got, want := int(hookCalls.Load()), steps*buckets; got != want {
			r.errorf("the hook ran %d times, want %d (one per bucket per synced backward)", got, want)
		}
		v, err := moduleViews(model)
		r.must(err)
		compare(r.t, fmt.Sprintf("rank %d weights", r.rank), v.w, wantW)
		compare(r.t, fmt.Sprintf("rank %d biases", r.rank), v.b, wantB)
		v.close()
		ddp.Close()

		sentinel := errors.New("the hook refused the bucket")
		failures := []struct {
			what  string
			hook  CommHookFunc
			check func(error) bool
		}{
			{"an error", func(*ProcessGroup, int, *Tensor) error { return sentinel },
				func(err error) bool { return errors.Is(err, sentinel) }},
			{"a panic", func(*ProcessGroup, int, *Tensor) error { panic("hook exploded") },
				func(err error) bool { return strings.Contains(err.Error(), "panicked: hook exploded") }},
			{"runtime.Goexit", func(*ProcessGroup, int, *Tensor) error { runtime.Goexit(); return nil },
				func(err error) bool { return strings.Contains(err.Error(), "runtime.Goexit") }},
		}
		for _, f := range failures {
			failing, err := lib.NewDDP(model, pg, &DDPOptions{CommHookFunc: f.hook})
			r.must(err)
			r.must(failing.PreForward())
			v, err := moduleViews(model)
			r.must(err)
			_, err = accumulate(v, batchOf(0, teacherW, teacherB)[:2*2*width], 2, 2, markLayer(failing))
			v.close()
			r.must(err)
			err = failing.FinishBackward()
			if !errors.Is(err, StatusUser) || !f.check(err) {
				r.errorf("a hook with %s: FinishBackward gave %v, want DP_EUSER carrying it", f.what, err)
			}
			failing.Close()
		}
	})
}

// fully_shard over each layer on two ranks: forward and backward on the
// gathered parameters, SGD on the shards, reaches single-process training
// on the full batch; the full and the sharded state dicts load back.
func TestFullyShardTwoRanksMatchSingleProcess(t *testing.T) {
	fullyShardTwoRanks(t, false)
}

// The same with the full parameters as views of the shards (shared memory).
func TestFullyShardWithFullParamsAsViewsMatchesSingleProcess(t *testing.T) {
	fullyShardTwoRanks(t, true)
}

func fullyShardTwoRanks(t *testing.T, views bool) {
	lib := openLibrary(t)
	defer lib.Close()
	const world = 2
	teacherW, teacherB := initialParameters(99)
	wantW, wantB, _ := reference(teacherW, teacherB)
	dir := t.TempDir()
	runRanks(t, lib, world, BackendAuto, func(r *rankT, pg *ProcessGroup) {
		shardLayers := func(model *Module, opts *FSDPOptions) []*FSDP {
			var fsdps []*FSDP
			for l := 0; l < layers; l++ {
				fc, err := model.Submodule(fmt.Sprintf("fc%d", l))
				r.must(err)
				f, err := lib.NewFSDP(fc, pg, opts)
				fc.Close()
				r.must(err)
				fsdps = append(fsdps, f)
			}
			return fsdps
		}
		closeAll := func(fsdps []*FSDP) {
			for i := len(fsdps) - 1; i >= 0; i-- {
				fsdps[i].Close()
			}
		}
		// expect unshards every layer and compares the full parameters.
		expect := func(what string, model *Module, fsdps []*FSDP) {
			for _, f := range fsdps {
				r.must(f.Unshard())
			}
			v, err := moduleViews(model)
			r.must(err)
			compare(r.t, fmt.Sprintf("rank %d %s weights", r.rank, what), v.w, wantW)
			compare(r.t, fmt.Sprintf("rank %d %s biases", r.rank, what), v.b, wantB)
			v.close()
			for _, f := range fsdps {
				r.must(f.Reshard())
			}
		}

		w0, b0 := initialParameters(7 + uint64(r.rank))
		model := buildModel(r.t, lib, w0, b0)
		defer model.Close()
		fsdps := shardLayers(model, &FSDPOptions{FullParamsAsViews: views})
		names, err := fsdps[0].ParameterNames()
		r.must(err)
		if fsdps[0].NumParameters() != 2 || len(names) != 2 || names[0] != "weight" || names[1] != "bias" {
			r.errorf("the first FSDP manages %v, want [weight bias]", names)
		}
		shard, err := fsdps[0].Shard(0)
		r.must(err)
		shape, err := shard.Shape()
		r.must(err)
		shardData, err := shard.Float32s()
		r.must(err)
		if len(shape) != 2 || shape[0] != width/world || shape[1] != width {
			r.errorf("rank %d keeps a weight shard of shape %v, want [%d %d]", r.rank, shape, width/world, width)
		}
		// A view holds this rank's shard at its rows; a copy lies elsewhere.
		r.must(fsdps[0].Unshard())
		fullWeight, err := model.Parameter(weightName(0))
		r.must(err)
		fullData, err := fullWeight.Float32s()
		r.must(err)
		if isView := &fullData[r.rank*(width/world)*width] == &shardData[0]; isView != views {
			r.errorf("rank %d: the full weight is a view of its shard: %v, want %v", r.rank, isView, views)
		}
		fullWeight.Close()
		shard.Close()
		r.must(fsdps[0].Reshard())

		share := batch / world
		for step := 0; step < steps; step++ {
			rows := batchOf(step, teacherW, teacherB)[r.rank*share*2*width : (r.rank+1)*share*2*width]
			// Gather the first layer, prefetch the next while waiting for it.
			r.must(fsdps[0].Unshard())
			for l := 1; l < layers; l++ {
				r.must(fsdps[l].UnshardAsync())
			}
			for l := 1; l < layers; l++ {
				r.must(fsdps[l].WaitUnshard())
			}
			v, err := moduleViews(model)
			r.must(err)
			_, err = forwardBackward(v.w, v.b, v.gw, v.gb, rows, share, share, nil)
			r.must(err)
			v.close() // the full tensors are released after the reduce-scatter
			for l := layers - 1; l >= 1; l-- {
				r.must(fsdps[l].PostBackward())
			}
			// Layer 0 through per-parameter marks from two goroutines: the
			// last one runs its PostBackward.
			marked := make(chan error, 2)
			for _, name := range []string{"bias", "weight"} {
				go func(name string) { marked <- fsdps[0].MarkGradReady(name) }(name)
			}
			r.must(<-marked)
			r.must(<-marked)
			for _, f := range fsdps {
				r.must(f.FinishBackward())
				for i := 0; i < f.NumParameters(); i++ {
					p, err := f.Shard(i)
					r.must(err)
					g, err := f.ShardGrad(i)
					r.must(err)
					pv, err := p.Float32s()
					r.must(err)
					gv, err := g.Float32s()
					r.must(err)
					sgd(pv, gv)
					p.Close()
					g.Close()
				}
			}
			r.must(model.ZeroGrad())
		}
		expect("trained", model, fsdps)

		// The full state dict in memory: on every rank, or on rank 1 alone.
		state, err := model.FullStateDict(pg, -1)
		r.must(err)
		sv, err := moduleViews(state)
		r.must(err)
		compare(r.t, fmt.Sprintf("rank %d in-memory full state dict weights", r.rank), sv.w, wantW)
		compare(r.t, fmt.Sprintf("rank %d in-memory full state dict biases", r.rank), sv.b, wantB)
		sv.close()
		state.Close()
		onOne, err := model.FullStateDict(pg, 1)
		r.must(err)
		if (onOne != nil) != (r.rank == 1) {
			r.errorf("rank %d: the in-memory full state dict for rank 1 is %v", r.rank, onOne)
		}
		if onOne != nil {
			onOne.Close()
		}

		full := filepath.Join(dir, "full.safetensors")
		sharded := filepath.Join(dir, "sharded")
		r.must(model.SaveFullStateDict(pg, full))
		r.must(model.SaveShardedStateDict(pg, sharded))
		// In the background: the Work reports the save; it loads as the synchronous one.
		inBackground := filepath.Join(dir, "sharded-async")
		saving, err := model.SaveShardedStateDictAsync(pg, inBackground)
		r.must(err)
		r.must(saving.Wait())
		saving.Close()
		r.must(pg.Barrier())

		// The full file is the unsharded module's: a plain module loads it.
		wz, bz := initialParameters(1234)
		plain := buildModel(r.t, lib, wz, bz)
		r.must(plain.Load(full, true))
		v, err := moduleViews(plain)
		r.must(err)
		compare(r.t, fmt.Sprintf("rank %d full state dict weights", r.rank), v.w, wantW)
		v.close()
		plain.Close()

		for _, load := range []struct {
			what string
			fn   func(*Module) error
		}{
			{"full state dict", func(m *Module) error { return m.LoadFullStateDict(full, true) }},
			{"sharded state dict", func(m *Module) error { return m.LoadShardedStateDict(sharded) }},
			{"background save", func(m *Module) error { return m.LoadShardedStateDict(inBackground) }},
		} {
			other := buildModel(r.t, lib, wz, bz)
			others := shardLayers(other, &FSDPOptions{NoInitSync: true})
			r.must(load.fn(other))
			expect(load.what, other, others)
			closeAll(others)
			other.Close()
		}
		closeAll(fsdps)
	})
}

// The three-parameter module of the join test: a (4), b (3), c (2), each
// holding 0, 1, ...
var joinSizes = []int{4, 3, 2}

const joinLr = 0.25

func joinGrad(rank, iteration, p, k int) float32 { return float32((rank+1)*(iteration+2) + p + k) }

// joinReference: iteration i averages the gradients of the ranks with more
// than i batches; every rank ends with the parameters of the rank with the
// most.
func joinReference(batches []int, divideByActive bool) []float32 {
	most := 0
	for _, b := range batches {
		if b > most {
			most = b
		}
	}
	var out []float32
	for p, n := range joinSizes {
		for k := 0; k < n; k++ {
			value := float64(k)
			for i := 0; i < most; i++ {
				sum, active := 0.0, 0
				for r, b := range batches {
					if b > i {
						sum += float64(joinGrad(r, i, p, k))
						active++
					}
				}
				divisor := len(batches)
				if divideByActive {
					divisor = active
				}
				value -= joinLr * sum / float64(divisor)
			}
			out = append(out, float32(value))
		}
	}
	return out
}

// Ranks with uneven numbers of batches: the one that runs out joins
// (dp_ddp_join) and stands in for the others' reductions; every rank ends
// with the hand-computed parameters, dividing by the initial world size or
// by the ranks still active.
func TestDDPJoinWithUnevenInputs(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	batches := []int{1, 3}
	names := []string{"a", "b", "c"}
	for _, divideByActive := range []bool{false, true} {
		want := joinReference(batches, divideByActive)
		runRanks(t, lib, len(batches), BackendAuto, func(r *rankT, pg *ProcessGroup) {
			model, err := lib.NewModule()
			r.must(err)
			defer model.Close()
			for p, n := range joinSizes {
				values := make([]float32, n)
				for k := range values {
					values[k] = float32(k)
				}
				x, err := lib.TensorFromFloat32s(values, []int64{int64(n)}, CPU(0))
				r.must(err)
				r.must(model.RegisterParameter(names[p], x, true))
				x.Close()
			}
			ddp, err := lib.NewDDP(model, pg, &DDPOptions{BucketCapMB: 0.00001, FirstBucketCapMB: 0.00001,
				JoinDivideByActiveRanks: divideByActive})
			r.must(err)
			defer ddp.Close()
			for i := 0; i < batches[r.rank]; i++ {
				r.must(ddp.PreForward())
				for p := range names {
					g, err := model.Grad(names[p])
					r.must(err)
					gv, err := g.Float32s()
					r.must(err)
					for k := range gv {
						gv[k] = joinGrad(r.rank, i, p, k)
					}
					g.Close()
				}
				for p := len(names) - 1; p >= 0; p-- {
					r.must(ddp.MarkGradReadyIndex(p))
				}
				r.must(ddp.FinishBackward())
				for _, name := range names {
					w, err := model.Parameter(name)
					r.must(err)
					g, err := model.Grad(name)
					r.must(err)
					wv, err := w.Float32s()
					r.must(err)
					gv, err := g.Float32s()
					r.must(err)
					for k := range wv {
						wv[k] -= joinLr * gv[k]
					}
					w.Close()
					g.Close()
				}
			}
			r.must(lib.Join(ddp))
			var got []float32
			for _, name := range names {
				w, err := model.Parameter(name)
				r.must(err)
				wv, err := w.Float32s()
				r.must(err)
				got = append(got, wv...)
				w.Close()
			}
			for k := range want {
				if math.Abs(float64(got[k]-want[k])) > 1e-4*(1+math.Abs(float64(want[k]))) {
					r.errorf("divide by active ranks %v: value %d is %g, want %g", divideByActive, k, got[k], want[k])
				}
			}
			if err := lib.Join(); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "'ddps'") {
				r.errorf("Join() gave %v, want DP_EINVAL naming 'ddps'", err)
			}
		})
	}
}

// The optimizer inside backward: SGD on each bucket's parameters as soon as
// its averaged gradients are final gives single-process training on the
// full batch; every parameter is reported once per iteration, used; the
// bucket plan carries over to a new DDP; a failure comes back from
// FinishBackward.
func TestOnBucketReducedSGDMatchesSingleProcess(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	const world = 2
	teacherW, teacherB := initialParameters(99)
	wantW, wantB, _ := reference(teacherW, teacherB)
	runRanks(t, lib, world, BackendAuto, func(r *rankT, pg *ProcessGroup) {
		w0, b0 := initialParameters(7 + uint64(r.rank))
		model := buildModel(r.t, lib, w0, b0)
		defer model.Close()
		names, err := model.ParameterNames()
		r.must(err)
		reported := make([]int, len(names))
		step := func(ddp *DDP, bucket int, params []int) error {
			for _, i := range params {
				reported[i]++
				used, err := ddp.ParameterUsed(i)
				if err != nil {
					return err
				}
				if !used {
					return fmt.Errorf("parameter %d reported unused", i)
				}
				p, err := model.Parameter(names[i])
				if err != nil {
					return err
				}
				g, err := model.Grad(names[i])
				if err != nil {
					return err
				}
				pv, err := p.Float32s()
				if err != nil {
					return err
				}
				gv, err := g.Float32s()
				if err != nil {
					return err
				}
				sgd(pv, gv)
				p.Close()
				g.Close()
			}
			return nil
		}
		ddp, err := lib.NewDDP(model, pg, &DDPOptions{BucketCapMB: 0.001, FirstBucketCapMB: 0.001,
			OnBucketReduced: step})
		r.must(err)
		share := batch / world
		for s := 0; s < steps; s++ {
			rows := batchOf(s, teacherW, teacherB)[r.rank*share*2*width : (r.rank+1)*share*2*width]
			r.must(ddp.PreForward())
			v, err := moduleViews(model)
			r.must(err)
			// Reversed: the last layer first, by index.
			_, err = forwardBackward(v.w, v.b, v.gw, v.gb, rows, share, share, func(l int) error {
				if err := ddp.MarkGradReadyIndex(2*l + 1); err != nil {
					return err
				}
				return ddp.MarkGradReadyIndex(2 * l)
			})
			v.close()
			r.must(err)
			r.must(ddp.FinishBackward())
		}
		for i, n := range reported {
			if n != steps {
				r.errorf("%s reported %d times, want %d", names[i], n, steps)
			}
		}
		v, err := moduleViews(model)
		r.must(err)
		compare(r.t, fmt.Sprintf("rank %d weights", r.rank), v.w, wantW)
		compare(r.t, fmt.Sprintf("rank %d biases", r.rank), v.b, wantB)
		v.close()

		stats, err := ddp.Stats()
		r.must(err)
		plan, err := ddp.BucketPlan()
		r.must(err)
		buckets := ddp.NumBuckets()
		var layout [][]int
		for b := 0; b < buckets; b++ {
			params, err := ddp.BucketParameters(b)
			r.must(err)
			layout = append(layout, params)
		}
		if stats.NumBuckets != buckets || strings.Count(plan, "\nbucket float32 ") != buckets {
			r.errorf("stats say %d buckets, the plan %q, NumBuckets %d", stats.NumBuckets, plan, buckets)
		}
		ddp.Close()

		sentinel := errors.New("the optimizer refused")
		again, err := lib.NewDDP(model, pg, &DDPOptions{BucketPlan: plan,
			OnBucketReduced: func(*DDP, int, []int) error { return sentinel }})
		r.must(err)
		defer again.Close()
		if again.NumBuckets() != buckets {
			r.errorf("a DDP from the plan has %d buckets, want %d", again.NumBuckets(), buckets)
		}
		for b := 0; b < buckets; b++ {
			params, err := again.BucketParameters(b)
			r.must(err)
			if fmt.Sprint(params) != fmt.Sprint(layout[b]) {
				r.errorf("bucket %d holds %v from the plan, %v before", b, params, layout[b])
			}
		}
		r.must(again.PreForward())
		for i := range names {
			r.must(again.MarkGradReadyIndex(i))
		}
		if err := again.FinishBackward(); !errors.Is(err, sentinel) || !errors.Is(err, StatusUser) {
			r.errorf("a failing on_bucket_reduced gave %v, want DP_EUSER carrying its error", err)
		}
	})
}

// all_gather and reduce_scatter give the expected values, blocking and as
// async work (Wait, Test, Close), on shared memory and on Gloo.
func TestAllGatherReduceScatterAndAsyncWork(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	const world = 2
	for _, backend := range []Backend{BackendAuto, BackendGloo} {
		runRanks(t, lib, world, backend, func(r *rankT, pg *ProcessGroup) {
			if backend == BackendGloo && pg.Backend() != "gloo" {
				r.errorf("asked for Gloo, runs %q", pg.Backend())
			}
			tensor := func(values ...float32) *Tensor {
				x, err := lib.TensorFromFloat32s(values, []int64{int64(len(values))}, CPU(0))
				r.must(err)
				return x
			}
			values := func(x *Tensor) string {
				v, err := x.Float32s()
				r.must(err)
				return fmt.Sprint(v)
			}
			rank := float32(r.rank)
			in := tensor(rank, 10+rank)
			defer in.Close()
			outs := []*Tensor{tensor(-1, -1), tensor(-1, -1)}
			r.must(pg.AllGather(in, outs))
			if values(outs[0]) != "[0 10]" || values(outs[1]) != "[1 11]" {
				r.errorf("all_gather: %s %s", values(outs[0]), values(outs[1]))
			}
			// Rank r sends (r+1)*(p+1) to rank p: p gets 3*(p+1).
			ins := []*Tensor{tensor(rank+1, 2*(rank+1)), tensor(2*(rank+1), 4*(rank+1))}
			out := tensor(0, 0)
			r.must(pg.ReduceScatter(ins, out, Sum))
			want := map[int]string{0: "[3 6]", 1: "[6 12]"}[r.rank]
			if values(out) != want {
				r.errorf("reduce_scatter: %s, want %s", values(out), want)
			}

			sum := tensor(rank + 1)
			root := tensor(100 * (rank + 1))
			work := []func() (*Work, error){
				func() (*Work, error) { return pg.AllReduceAsync(sum, Sum) },
				func() (*Work, error) { return pg.BroadcastAsync(root, 1) },
				func() (*Work, error) { return pg.AllGatherAsync(in, outs) },
				func() (*Work, error) { return pg.ReduceScatterAsync(ins, out, Max) },
				func() (*Work, error) { return pg.BarrierAsync() },
			}
			var pending []*Work
			for _, start := range work {
				w, err := start()
				r.must(err)
				pending = append(pending, w)
			}
			last := pending[len(pending)-1]
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
				done, err := last.Test()
				r.must(err)
				if done {
					break
				}
				if time.Now().After(deadline) {
					r.must(errors.New("the async barrier did not finish within 20 s"))
				}
			}
			for _, w := range pending {
				r.must(w.Wait())
				w.Close()
				w.Close()
			}
			if err := last.Wait(); !errors.Is(err, StatusInvalid) {
				r.errorf("Wait on a closed work gave %v", err)
			}
			wantMax := map[int]string{0: "[2 4]", 1: "[4 8]"}[r.rank]
			if values(sum) != "[3]" || values(root) != "[200]" || values(outs[1]) != "[1 11]" || values(out) != wantMax {
				r.errorf("async: all_reduce %s, broadcast %s, all_gather %s, reduce_scatter max %s (want %s)",
					values(sum), values(root), values(outs[1]), values(out), wantMax)
			}
			for _, x := range append(append(outs, ins...), out, sum, root) {
				x.Close()
			}
		})
	}
}
