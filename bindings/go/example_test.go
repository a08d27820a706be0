package dparallel_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"dparallel.org/dparallel"
)

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

// The README's example: a forward written in Go runs on two logical CPU
// devices, each on its half of the batch; the outputs are gathered back.
func Example() {
	lib, err := dparallel.Load() // dlopen($DP_LIBRARY), one dlsym of dp_get_api
	check(err)
	defer lib.Close()
	model, err := lib.NewModule()
	check(err)
	defer model.Close()
	x, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4}, []int64{4, 1}, dparallel.CPU(0))
	check(err)
	defer x.Close()
	devices := []dparallel.Device{dparallel.CPU(0), dparallel.CPU(1)}
	y, err := lib.DataParallel(model, x, devices, dparallel.CPU(0), 0, func(i int, replica *dparallel.Module,
		in *dparallel.Tensor, dev dparallel.Device) (*dparallel.Tensor, error) {
		rows, err := in.Float32s() // this replica's rows, without a copy
		if err != nil {
			return nil, err
		}
		return lib.TensorFromFloat32s([]float32{2 * rows[0], 2 * rows[1]}, []int64{2, 1}, dev)
	})
	check(err)
	defer y.Close()
	values, err := y.Float32s()
	check(err)
	fmt.Println(values)
	// Output: [2 4 6 8]
}

// asRanks runs body as `world` ranks, each a goroutine of this process with
// its own process group over one file store, and waits for them all.
func asRanks(lib *dparallel.Library, world int, body func(rank int, pg *dparallel.ProcessGroup)) {
	dir, err := os.MkdirTemp("", "dparallel-example")
	check(err)
	defer os.RemoveAll(dir)
	var wg sync.WaitGroup
	for rank := 0; rank < world; rank++ {
		wg.Add(1)
		go func(rank int) {
			defer wg.Done()
			runtime.LockOSThread() // a group is driven from one thread
			defer runtime.UnlockOSThread()
			store, err := lib.NewFileStore(filepath.Join(dir, "store"), world)
			check(err)
			pg, err := lib.NewProcessGroup(rank, world, &dparallel.ProcessGroupOptions{Store: store})
			store.Close() // the group holds its own reference
			check(err)
			defer pg.Close()
			body(rank, pg)
		}(rank)
	}
	wg.Wait()
}

// One DDP step on two ranks (goroutines here; processes under dp-run work
// the same, with ProcessGroupFromEnv): each rank marks its own gradient
// ready, and FinishBackward leaves the average over the ranks.
func ExampleDDP() {
	lib, err := dparallel.Load()
	check(err)
	defer lib.Close()
	grads := make([][]float32, 2)
	asRanks(lib, 2, func(rank int, pg *dparallel.ProcessGroup) {
		model, err := lib.NewModule()
		check(err)
		defer model.Close()
		w, err := lib.TensorFromFloat32s([]float32{1, 1}, []int64{2}, dparallel.CPU(0))
		check(err)
		check(model.RegisterParameter("w", w, true))
		w.Close()
		ddp, err := lib.NewDDP(model, pg, nil)
		check(err)
		defer ddp.Close()

		check(ddp.PreForward())
		grad, err := model.Grad("w")
		check(err)
		defer grad.Close()
		g, err := grad.Float32s()
		check(err)
		g[0], g[1] = float32(rank+1), float32(10*(rank+1)) // this rank's backward
		check(ddp.MarkGradReady("w"))
		check(ddp.FinishBackward())
		g, err = grad.Float32s()
		check(err)
		grads[rank] = append([]float32(nil), g...)
	})
	fmt.Println("rank 0's gradient:", grads[0])
	fmt.Println("rank 1's gradient:", grads[1])
	// Output:
	// rank 0's gradient: [1.5 15]
	// rank 1's gradient: [1.5 15]
}

// fully_shard on two ranks: each keeps half the rows of w; Unshard gathers
// the whole, the backward fills the full gradient, PostBackward
// reduce-scatters its average into the shard gradients, and SGD steps on
// the shards.
func ExampleFSDP() {
	lib, err := dparallel.Load()
	check(err)
	defer lib.Close()
	lines := make([]string, 2)
	asRanks(lib, 2, func(rank int, pg *dparallel.ProcessGroup) {
		model, err := lib.NewModule()
		check(err)
		defer model.Close()
		w, err := lib.TensorFromFloat32s([]float32{0, 1, 2, 3, 4, 5, 6, 7}, []int64{4, 2}, dparallel.CPU(0))
		check(err)
		check(model.RegisterParameter("w", w, true))
		w.Close()
		fsdp, err := lib.NewFSDP(model, pg, nil)
		check(err)
		defer fsdp.Close()

		check(fsdp.Unshard()) // the module's w is whole now
		grad, err := model.Grad("w")
		check(err)
		g, err := grad.Float32s()
		check(err)
		for i := range g {
			g[i] = float32(rank + 1) // this rank's backward
		}
		grad.Close()
		check(fsdp.PostBackward())
		check(fsdp.FinishBackward())

		shard, err := fsdp.Shard(0)
		check(err)
		defer shard.Close()
		shardGrad, err := fsdp.ShardGrad(0)
		check(err)
		defer shardGrad.Close()
		s, err := shard.Float32s()
		check(err)
		sg, err := shardGrad.Float32s()
		check(err)
		before := append([]float32(nil), s...)
		for i := range s {
			s[i] -= sg[i] // SGD, learning rate 1, in place on the shard
		}
		lines[rank] = fmt.Sprintf("rank %d keeps %v, gradient %v, after SGD %v", rank, before, sg, s)
	})
	fmt.Println(lines[0])
	fmt.Println(lines[1])
	// Output:
	// rank 0 keeps [0 1 2 3], gradient [1.5 1.5 1.5 1.5], after SGD [-1.5 -0.5 0.5 1.5]
	// rank 1 keeps [4 5 6 7], gradient [1.5 1.5 1.5 1.5], after SGD [2.5 3.5 4.5 5.5]
}
