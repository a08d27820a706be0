package dparallel

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// Under dp-run -n 2 (one host): a split that reverses the ranks, one only
// rank 0 joins, the 1-D and by-host meshes, and a mesh's groups closed with
// it.
func TestMeshTwoRanks(t *testing.T) {
	if os.Getenv("RANK") == "" {
		if os.Getenv("DP_GO_DDP_WORLD") != "" {
			t.Fatal("RANK is not set: run this test under dp-run -n 2")
		}
		t.Skip("a multi-process test: run it under dp-run -n 2")
	}
	lib := openLibrary(t)
	pg, err := lib.ProcessGroupFromEnv()
	must(t, err)
	defer pg.Close()
	rank, world := pg.Rank(), pg.Size()
	if pg.LocalRank() != rank || pg.LocalSize() != world || pg.NumHosts() != 1 {
		t.Fatalf("one host: local rank %d of %d on %d host(s)", pg.LocalRank(), pg.LocalSize(), pg.NumHosts())
	}
	reversed, err := pg.Split(0, -rank, nil)
	must(t, err)
	if reversed.Rank() != world-1-rank || reversed.Size() != world {
		t.Fatalf("split by key -rank: rank %d of %d", reversed.Rank(), reversed.Size())
	}
	v := floatTensor(t, lib, []float32{float32(rank)})
	must(t, reversed.Broadcast(v, 0))
	if got := readFloats(t, v); got[0] != float32(world-1) {
		t.Fatalf("broadcast from the reversed group's rank 0 gave %v", got)
	}
	v.Close()
	reversed.Close()
	color := -1
	if rank == 0 {
		color = 7
	}
	alone, err := pg.Split(color, 0, &ProcessGroupOptions{Backend: BackendGloo})
	must(t, err)
	if (alone != nil) != (rank == 0) || (alone != nil && (alone.Size() != 1 || alone.Backend() != "gloo")) {
		t.Fatalf("a negative color joins none; rank 0 alone on gloo: %v", alone)
	}
	alone.Close()

	again, err := pg.Shrink()
	must(t, err)
	lost, err := again.LostRanks()
	must(t, err)
	if again.Rank() != rank || again.Size() != world || len(lost) != 0 {
		t.Fatalf("a shrink with no rank lost: rank %d of %d, lost %v", again.Rank(), again.Size(), lost)
	}
	again.Close()

	mesh, err := NewDeviceMesh(pg, []int{world}, []string{"dp"})
	must(t, err)
	shape, err := mesh.Shape()
	must(t, err)
	coord, err := mesh.Coordinate()
	must(t, err)
	if mesh.Ndim() != 1 || !reflect.DeepEqual(mesh.DimNames(), []string{"dp"}) ||
		!reflect.DeepEqual(shape, []int{world}) || !reflect.DeepEqual(coord, []int{rank}) {
		t.Fatalf("1-D mesh: %d dims %v, shape %v, coordinate %v", mesh.Ndim(), mesh.DimNames(), shape, coord)
	}
	if _, err := mesh.Group("tp"); err == nil || !strings.Contains(err.Error(), "'tp'") {
		t.Fatalf("an unknown dimension: %v", err)
	}
	dp, err := mesh.Group("dp")
	must(t, err)
	sum := floatTensor(t, lib, []float32{float32(rank + 1)})
	must(t, dp.AllReduce(sum, Sum))
	if got := readFloats(t, sum); got[0] != float32(world*(world+1)/2) {
		t.Fatalf("all_reduce over the mesh's group gave %v", got)
	}
	mesh.Close()
	if err := dp.AllReduce(sum, Sum); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("a mesh's group after the mesh's Close: %v", err)
	}
	sum.Close()
	if _, err := NewDeviceMesh(pg, []int{world + 1}, nil); err == nil || !strings.Contains(err.Error(), "'shape'") {
		t.Fatalf("a shape that is not the world size: %v", err)
	}

	hosts, err := DeviceMeshByHost(pg)
	must(t, err)
	defer hosts.Close()
	local, err := hosts.Group("local")
	must(t, err)
	across, err := hosts.Group("host")
	must(t, err)
	if local.Size() != world || local.Backend() != "shm" || across.Size() != 1 {
		t.Fatalf("by host: local %d on %s, host group of %d", local.Size(), local.Backend(), across.Size())
	}
	// HSDP on the by-host mesh: shards over "local", rank 0's values (init_sync).
	module, err := lib.NewModule()
	must(t, err)
	defer module.Close()
	w := floatTensor(t, lib, []float32{float32(rank), 1, 2, 3})
	must(t, module.RegisterParameter("w", w, true))
	w.Close()
	f, err := lib.NewFSDPOnMesh(module, hosts, nil)
	must(t, err)
	defer f.Close()
	shard, err := f.Shard(0)
	must(t, err)
	defer shard.Close()
	if got := readFloats(t, shard); !reflect.DeepEqual(got, []float32{float32(2 * rank), float32(2*rank + 1)}) {
		t.Fatalf("the shard on the mesh's local group: %v", got)
	}
}

func floatTensor(t *testing.T, lib *Library, values []float32) *Tensor {
	t.Helper()
	v, err := lib.TensorFromFloat32s(values, []int64{int64(len(values))}, CPU(0))
	must(t, err)
	return v
}

func readFloats(t *testing.T, v *Tensor) []float32 {
	t.Helper()
	values, err := v.Float32s()
	must(t, err)
	return values
}
