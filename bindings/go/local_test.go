package dparallel

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// A file store and a TCP store: set, get (a value longer than the first
// buffer too), add, wait and its timeout, the server's port.
func TestStoresRoundTrip(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	file, err := lib.NewFileStore(filepath.Join(t.TempDir(), "store"), 1)
	must(t, err)
	defer file.Close()
	server, err := lib.NewTCPStore("127.0.0.1", 0, 1, true, 10*time.Second)
	must(t, err)
	defer server.Close()
	port, err := server.Port()
	must(t, err)
	if port == 0 {
		t.Fatal("the TCP server reports port 0")
	}
	client, err := lib.NewTCPStore("127.0.0.1", port, 2, false, 10*time.Second)
	must(t, err)
	defer client.Close()
	if _, err := file.Port(); !errors.Is(err, StatusInvalid) {
		t.Errorf("Port of a file store gave %v, want DP_EINVAL", err)
	}
	long := bytes.Repeat([]byte("0123456789"), 100)
	for _, pair := range []struct {
		what       string
		writer, rd *Store
	}{{"file", file, file}, {"tcp", server, client}} {
		must(t, pair.writer.Set("short", []byte("value")))
		must(t, pair.writer.Set("long", long))
		must(t, pair.writer.Set("empty", nil))
		for key, want := range map[string][]byte{"short": []byte("value"), "long": long, "empty": {}} {
			got, err := pair.rd.Get(key)
			must(t, err)
			if !bytes.Equal(got, want) {
				t.Errorf("%s store: %s holds %d bytes %.20q, want %d bytes", pair.what, key, len(got), got, len(want))
			}
		}
		n, err := pair.writer.Add("counter", 5)
		must(t, err)
		m, err := pair.rd.Add("counter", -2)
		must(t, err)
		if n != 5 || m != 3 {
			t.Errorf("%s store: add gave %d then %d, want 5 then 3", pair.what, n, m)
		}
		must(t, pair.rd.Wait([]string{"short", "long", "counter"}, -1))
		err = pair.rd.Wait([]string{"short", "never-set"}, 50*time.Millisecond)
		if !errors.Is(err, StatusTimeout) || !strings.Contains(err.Error(), "never-set") {
			t.Errorf("%s store: waiting for a missing key gave %v, want DP_ETIMEOUT naming it", pair.what, err)
		}
		must(t, pair.rd.SetTimeout(50*time.Millisecond))
		if _, err := pair.rd.Get("never-set"); !errors.Is(err, StatusTimeout) {
			t.Errorf("%s store: get of a missing key gave %v, want DP_ETIMEOUT", pair.what, err)
		}
		if err := pair.rd.Wait(nil, time.Second); !errors.Is(err, StatusInvalid) ||
			!strings.Contains(err.Error(), "'keys'") {
			t.Errorf("%s store: Wait(nil) gave %v, want DP_EINVAL naming 'keys'", pair.what, err)
		}
	}
}

// takeValues is the values of x, a new reference that a call returned with
// err, and closes x.
func takeValues(t *testing.T, x *Tensor, err error) []float32 {
	t.Helper()
	must(t, err)
	defer x.Close()
	v, err := x.Float32s()
	must(t, err)
	return v
}

// Buffers are registered, listed, looked up and saved (the persistent
// ones); submodules, requires_grad and a gradient set by the host.
func TestModuleBuffersAndGradients(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	root, err := lib.NewModule()
	must(t, err)
	defer root.Close()
	fc, err := lib.NewModule()
	must(t, err)
	w, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4}, []int64{2, 2}, CPU(0))
	must(t, err)
	defer w.Close()
	mean, err := lib.TensorFromFloat32s([]float32{0.5, 0.25}, []int64{2}, CPU(0))
	must(t, err)
	defer mean.Close()
	scratch, err := lib.TensorFromFloat32s([]float32{7}, []int64{1}, CPU(0))
	must(t, err)
	defer scratch.Close()
	must(t, fc.RegisterParameter("weight", w, true))
	must(t, fc.RegisterBuffer("running_mean", mean, true))
	must(t, fc.RegisterBuffer("scratch", scratch, false))
	must(t, root.RegisterModule("fc", fc))
	fc.Close()

	if n := root.NumBuffers(); n != 2 {
		t.Errorf("%d buffers, want 2", n)
	}
	names, err := root.BufferNames()
	must(t, err)
	if fmt.Sprint(names) != "[fc.running_mean fc.scratch]" {
		t.Errorf("buffer names %v", names)
	}
	b, err := root.Buffer("fc.running_mean")
	if bv := takeValues(t, b, err); fmt.Sprint(bv) != "[0.5 0.25]" {
		t.Errorf("fc.running_mean holds %v", bv)
	}
	if _, err := root.Buffer("fc.nope"); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "fc.nope") {
		t.Errorf("an unknown buffer gave %v", err)
	}

	path := filepath.Join(t.TempDir(), "m.safetensors")
	must(t, root.Save(path))
	mv, err := mean.Float32s()
	must(t, err)
	sv, err := scratch.Float32s()
	must(t, err)
	mv[0], sv[0] = 9, 9
	must(t, root.Load(path, true))
	if mv[0] != 0.5 || sv[0] != 9 {
		t.Errorf("after a load the persistent buffer holds %v (want 0.5), the other %v (want 9, not saved)", mv[0], sv[0])
	}

	sub, err := root.Submodule("fc")
	must(t, err)
	if sub.NumParameters() != 1 || sub.NumBuffers() != 2 {
		t.Errorf("the submodule has %d parameters and %d buffers", sub.NumParameters(), sub.NumBuffers())
	}
	sub.Close()
	if _, err := root.Submodule("nope"); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "nope") {
		t.Errorf("an unknown submodule gave %v", err)
	}

	rg, err := root.RequiresGrad("fc.weight")
	must(t, err)
	must(t, root.SetRequiresGrad("fc.weight", false))
	now, err := root.RequiresGrad("fc.weight")
	must(t, err)
	if !rg || now {
		t.Errorf("requires_grad %v, then %v after setting false", rg, now)
	}

	g, err := lib.TensorFromFloat32s([]float32{-1, -2, -3, -4}, []int64{2, 2}, CPU(0))
	must(t, err)
	defer g.Close()
	must(t, root.SetGrad("fc.weight", g))
	got, err := root.Grad("fc.weight")
	if gv := takeValues(t, got, err); fmt.Sprint(gv) != "[-1 -2 -3 -4]" {
		t.Errorf("the gradient set holds %v", gv)
	}
	if err := root.SetGrad("fc.weight", mean); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "'grad'") {
		t.Errorf("a gradient of the wrong shape gave %v, want DP_EINVAL naming 'grad'", err)
	}
}

func float32sOf(t *testing.T, x *Tensor) string {
	t.Helper()
	v := make([]float32, x.Numel())
	must(t, x.CopyToFloat32s(v))
	return fmt.Sprint(v)
}

func closeTensors(ts []*Tensor) {
	for _, x := range ts {
		x.Close()
	}
}

// The in-process collectives across cpu devices give the expected values
// on the expected devices.
func TestInProcessCollectives(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	devices := []Device{CPU(0), CPU(1), CPU(2)}
	x, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4, 5, 6}, []int64{3, 2}, CPU(0))
	must(t, err)
	defer x.Close()
	y, err := lib.TensorFromFloat32s([]float32{10, 20}, []int64{2}, CPU(0))
	must(t, err)
	defer y.Close()

	copies, err := lib.Broadcast(x, devices)
	must(t, err)
	for i, c := range copies {
		if c.Device() != devices[i] || float32sOf(t, c) != "[1 2 3 4 5 6]" {
			t.Errorf("broadcast %d: %s on %v", i, float32sOf(t, c), c.Device())
		}
	}
	sum, err := lib.ReduceAdd(copies, CPU(1))
	must(t, err)
	if sum.Device() != CPU(1) || float32sOf(t, sum) != "[3 6 9 12 15 18]" {
		t.Errorf("reduce_add: %s on %v", float32sOf(t, sum), sum.Device())
	}
	sum.Close()
	closeTensors(copies)

	lists, err := lib.BroadcastCoalesced([]*Tensor{x, y}, devices[:2], 0)
	must(t, err)
	if len(lists) != 2 || len(lists[1]) != 2 || lists[1][1].Device() != CPU(1) || float32sOf(t, lists[1][1]) != "[10 20]" {
		t.Fatalf("broadcast_coalesced gave %d lists", len(lists))
	}
	sums, err := lib.ReduceAddCoalesced(lists, CPU(0), 0)
	must(t, err)
	if float32sOf(t, sums[0]) != "[2 4 6 8 10 12]" || float32sOf(t, sums[1]) != "[20 40]" {
		t.Errorf("reduce_add_coalesced: %s %s", float32sOf(t, sums[0]), float32sOf(t, sums[1]))
	}
	closeTensors(sums)
	closeTensors(lists[0])
	closeTensors(lists[1])

	chunks, err := lib.Scatter(x, devices, []int64{1, 2, 0}, 0)
	if err == nil {
		t.Errorf("a chunk of size 0 was accepted")
		closeTensors(chunks)
	}
	chunks, err = lib.Scatter(x, devices, nil, 0)
	must(t, err)
	if len(chunks) != 3 || chunks[2].Device() != CPU(2) || float32sOf(t, chunks[2]) != "[5 6]" {
		t.Fatalf("scatter gave %d chunks", len(chunks))
	}
	back, err := lib.Gather(chunks, 0, CPU(1))
	must(t, err)
	if back.Device() != CPU(1) || float32sOf(t, back) != "[1 2 3 4 5 6]" {
		t.Errorf("gather: %s on %v", float32sOf(t, back), back.Device())
	}
	back.Close()
	closeTensors(chunks)
	cols, err := lib.Scatter(x, devices[:2], []int64{1, 1}, -1)
	must(t, err)
	if float32sOf(t, cols[1]) != "[2 4 6]" {
		t.Errorf("scatter along the last dim: %s", float32sOf(t, cols[1]))
	}
	closeTensors(cols)
	if _, err := lib.Scatter(x, devices, []int64{3}, 0); !errors.Is(err, StatusInvalid) ||
		!strings.Contains(err.Error(), "'chunkSizes'") {
		t.Errorf("too few chunk sizes gave %v", err)
	}
}

// A tensor over memory Go did not allocate (mmap) uses it in place and runs
// its release once the last reference, the module's, is gone; DLPack hands
// a tensor's memory out and back without a copy.
func TestTensorFromBlobAndDLPack(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	mem, err := syscall.Mmap(-1, 0, 4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	must(t, err)
	floats := unsafe.Slice((*float32)(unsafe.Pointer(&mem[0])), 4)
	copy(floats, []float32{1, 2, 3, 4})
	released := 0
	x, err := lib.TensorFromBlob(unsafe.Pointer(&mem[0]), Float32, []int64{2, 2}, CPU(0), func() {
		released++
		if err := syscall.Munmap(mem); err != nil {
			panic(err)
		}
	})
	must(t, err)
	if x.Data() != unsafe.Pointer(&mem[0]) || float32sOf(t, x) != "[1 2 3 4]" {
		t.Fatalf("the tensor does not use the memory in place")
	}
	m, err := lib.NewModule()
	must(t, err)
	must(t, m.RegisterParameter("w", x, true))
	x.Close()
	if released != 0 {
		t.Fatal("released while the module still holds the tensor")
	}
	m.Close()
	if released != 1 {
		t.Fatalf("released %d times after the last reference went, want once", released)
	}
	if _, err := lib.TensorFromBlob(nil, Float32, []int64{-1}, CPU(0), func() { released++ }); err == nil || released != 1 {
		t.Errorf("a bad shape gave %v and released %d times, want an error and no release", err, released)
	}

	y, err := lib.TensorFromFloat32s([]float32{5, 6, 7}, []int64{3}, CPU(1))
	must(t, err)
	managed, err := y.ToDLPack()
	must(t, err)
	data := y.Data()
	y.Close() // the DLPack tensor keeps the memory alive
	z, err := lib.TensorFromDLPack(managed)
	must(t, err)
	// DLPack knows one CPU: a logical cpu device comes back as cpu:0.
	if z.Data() != data || z.Device() != CPU(0) || float32sOf(t, z) != "[5 6 7]" {
		t.Errorf("through DLPack: %s on %v, at %v (was %v)", float32sOf(t, z), z.Device(), z.Data(), data)
	}
	z.Close()
	if _, err := lib.TensorFromDLPack(nil); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "'managed'") {
		t.Errorf("a nil DLManagedTensor gave %v", err)
	}

	// DLPack 1.x: in place, or a copy when exported read-only.
	v, err := lib.TensorFromFloat32s([]float32{1, 2, 3}, []int64{3}, CPU(0))
	must(t, err)
	defer v.Close()
	writable, err := v.ToDLPackVersioned(false)
	must(t, err)
	inPlace, err := lib.TensorFromDLPackVersioned(writable)
	must(t, err)
	readOnly, err := v.ToDLPackVersioned(true)
	must(t, err)
	copied, err := lib.TensorFromDLPackVersioned(readOnly)
	must(t, err)
	if inPlace.Data() != v.Data() || copied.Data() == v.Data() || float32sOf(t, copied) != "[1 2 3]" {
		t.Errorf("versioned DLPack: in place at %v, copy at %v holding %s (the tensor at %v)", inPlace.Data(),
			copied.Data(), float32sOf(t, copied), v.Data())
	}
	inPlace.Close()
	copied.Close()
	if _, err := lib.TensorFromDLPackVersioned(nil); !errors.Is(err, StatusInvalid) {
		t.Errorf("a nil DLManagedTensorVersioned gave %v", err)
	}
}

// Host functions run in order on a cpu stream; a panic in one is reported
// by the next Synchronize; the current stream is per thread.
func TestStreamsAndHostFunctions(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s, err := lib.NewStream(CPU(0))
	must(t, err)
	var order []int
	for i := 1; i <= 3; i++ {
		i := i
		must(t, s.LaunchHostFunc(func() { order = append(order, i) }))
	}
	must(t, s.Synchronize())
	if fmt.Sprint(order) != "[1 2 3]" {
		t.Errorf("host functions ran as %v", order)
	}
	must(t, s.LaunchHostFunc(func() { panic("host function exploded") }))
	if err := s.Synchronize(); !errors.Is(err, StatusUser) || !strings.Contains(err.Error(), "host function exploded") {
		t.Errorf("a panicking host function: Synchronize gave %v", err)
	}
	must(t, s.Synchronize())

	must(t, lib.SetCurrentStream(CPU(0), s.Pointer()))
	current, err := lib.CurrentStream(CPU(0))
	must(t, err)
	if current != s.Pointer() {
		t.Errorf("the current stream is %v, set %v", current, s.Pointer())
	}
	x, err := lib.TensorFromFloat32s([]float32{1, 2}, []int64{2}, CPU(0))
	must(t, err)
	y, err := x.ToDevice(CPU(0)) // ordered on the current stream
	must(t, err)
	must(t, s.Synchronize())
	if float32sOf(t, y) != "[1 2]" {
		t.Errorf("a copy on the stream holds %s", float32sOf(t, y))
	}
	x.Close()
	y.Close()
	must(t, lib.SetCurrentStream(CPU(0), nil))
	if current, err := lib.CurrentStream(CPU(0)); err != nil || current != nil {
		t.Errorf("after clearing, the current stream is %v (%v)", current, err)
	}
	must(t, s.Close())

	ran := false
	def := lib.WrapStream(CPU(0), nil) // the legacy default stream runs it at once
	must(t, def.LaunchHostFunc(func() { ran = true }))
	if !ran {
		t.Error("a host function on the legacy default stream did not run before the call returned")
	}
	must(t, def.Close())
	if err := def.LaunchHostFunc(nil); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "'fn'") {
		t.Errorf("a nil host function gave %v", err)
	}
}

// Device counts and names, status texts, dtype sizes, tensor sizes and
// copies, memory accounting.
func TestDevicesStatusesAndMemory(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	n, err := lib.DeviceCount(DeviceCPU)
	must(t, err)
	if n < 4 {
		t.Errorf("%d cpu devices", n)
	}
	if text, err := lib.FormatDevice(CPU(3)); err != nil || text != "cpu:3" {
		t.Errorf("FormatDevice(cpu:3) gave %q, %v", text, err)
	}
	if lib.StatusString(StatusInvalid) == "" || lib.StatusString(StatusInvalid) == lib.StatusString(StatusOK) {
		t.Errorf("status texts %q and %q", lib.StatusString(StatusInvalid), lib.StatusString(StatusOK))
	}
	if lib.DTypeSize(Float64) != 8 || lib.DTypeSize(BFloat16) != 2 || lib.DTypeSize(DType(99)) != 0 {
		t.Errorf("dtype sizes %d %d %d", lib.DTypeSize(Float64), lib.DTypeSize(BFloat16), lib.DTypeSize(DType(99)))
	}
	x, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4, 5, 6}, []int64{2, 3}, CPU(0))
	must(t, err)
	defer x.Close()
	y, err := x.ToDevice(CPU(1))
	must(t, err)
	if x.NBytes() != 24 || y.Device() != CPU(1) || float32sOf(t, y) != "[1 2 3 4 5 6]" || y.Data() == x.Data() {
		t.Errorf("nbytes %d; the copy holds %s on %v", x.NBytes(), float32sOf(t, y), y.Device())
	}
	y.Close()

	device := CPU(7)
	must(t, lib.ResetPeakMemory(device))
	before, err := lib.MemoryStats(device)
	must(t, err)
	big, err := lib.NewTensor(Float32, []int64{1 << 18}, device)
	must(t, err)
	during, err := lib.MemoryStats(device)
	must(t, err)
	big.Close()
	after, err := lib.MemoryStats(device)
	must(t, err)
	must(t, lib.ResetPeakMemory(device))
	reset, err := lib.MemoryStats(device)
	must(t, err)
	if during.Allocated < before.Allocated+1<<20 || after.Allocated != before.Allocated ||
		after.PeakAllocated < during.Allocated || reset.PeakAllocated != reset.Allocated {
		t.Errorf("memory before %+v, with 1 MiB %+v, after %+v, after the reset %+v", before, during, after, reset)
	}
}

// dp_shutdown ends the device workers, which the next forward starts
// again; from inside a forward it is refused.
func TestShutdownEndsThreadsAndTheyRestart(t *testing.T) {
	lib, model, input := openWithModelAndBatch(t)
	devices := []Device{CPU(0), CPU(1)}
	for round := 0; round < 2; round++ {
		out, err := lib.DataParallel(model, input, devices, CPU(0), 0, replicaStep(lib))
		must(t, err)
		out.Close()
		must(t, lib.Shutdown())
	}
	_, err := lib.DataParallel(model, input, devices, CPU(0), 0, func(i int, r *Module, in *Tensor,
		d Device) (*Tensor, error) {
		return in, lib.Shutdown()
	})
	var de *Error
	if !errors.As(err, &de) || !errors.Is(de.Cause, StatusState) {
		t.Errorf("Shutdown inside a forward gave %v, want DP_EUSER caused by DP_ESTATE", err)
	}
}

// Bad arguments to the newer calls are errors naming them, caught before
// anything reaches the library.
func TestNewCallsNameTheirBadArguments(t *testing.T) {
	lib, m, x := openWithModuleAndTensor(t)
	hook := func(*ProcessGroup, int, *Tensor) error { return nil }
	cases := []struct {
		what string
		err  error
		name string
	}{
		{"a hook kind and a hook func", func() error {
			_, err := lib.NewDDP(m, &ProcessGroup{lib: lib}, &DDPOptions{CommHook: HookFP16, CommHookFunc: hook})
			return err
		}(), "'opts.CommHook'"},
		{"a negative group timeout", func() error {
			_, err := lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Timeout: -time.Second})
			return err
		}(), "'opts.Timeout'"},
		{"a store timeout past int32 ms", func() error {
			_, err := lib.NewTCPStore("127.0.0.1", 0, 1, true, 1000*time.Hour)
			return err
		}(), "'timeout'"},
		{"uneven lists", func() error {
			_, err := lib.ReduceAddCoalesced([][]*Tensor{{x, x}, {x}}, CPU(0), 0)
			return err
		}(), "'inputs'[1]"},
		{"a nil tensor in a list", func() error { _, err := lib.Gather([]*Tensor{x, nil}, 0, CPU(0)); return err }(),
			"'tensors'[1]"},
		{"a negative bucket", func() error { _, err := (&DDP{lib: lib}).BucketParameters(-1); return err }(),
			"'bucket'"},
		{"a negative parameter index", (&DDP{lib: lib}).MarkGradReadyIndex(-2), "'index'"},
		{"a closed FSDP", (&FSDP{lib: lib}).Unshard(), "closed"},
		{"a negative buffer size", func() error {
			_, err := lib.BroadcastCoalesced([]*Tensor{x}, []Device{CPU(0)}, -1)
			return err
		}(), "'bufferSize'"},
	}
	for _, c := range cases {
		var de *Error
		if !errors.As(c.err, &de) || !errors.Is(c.err, StatusInvalid) || !strings.Contains(de.Message, c.name) {
			t.Errorf("%s: got %v, want DP_EINVAL naming %s", c.what, c.err, c.name)
		}
	}
}

// receive waits for what a host function sends; a host function that
// deadlocked never sends, and the test fails saying so instead of hanging
// (setting *stuck: closing the library would wait for the call in flight).
func receive[T any](t *testing.T, stuck *bool, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(60 * time.Second):
		*stuck = true
		t.Fatalf("%s never returned: deadlocked", what)
		panic("unreachable")
	}
}

// A host function's calls reach the library from the stream's own thread:
// Synchronize of its own stream is refused instead of waiting for itself,
// Close of its own stream ends the stream after its queued work, and on
// the legacy default stream (run at once, on the caller's thread) its calls
// work too.
func TestHostFunctionsSynchronizeAndCloseTheirOwnStream(t *testing.T) {
	lib := openLibrary(t)
	stuck := false
	defer func() {
		if !stuck {
			lib.Close()
		}
	}()
	s, err := lib.NewStream(CPU(0))
	must(t, err)
	synced := make(chan error, 1)
	must(t, s.LaunchHostFunc(func() { synced <- s.Synchronize() }))
	err = receive(t, &stuck, "Synchronize from a host function of its own stream", synced)
	if !errors.Is(err, StatusState) || !strings.Contains(err.Error(), "own cpu stream") {
		t.Errorf("Synchronize from a host function of its own stream gave %v, want DP_ESTATE naming its own stream", err)
	}
	must(t, s.Synchronize())

	other, err := lib.NewStream(CPU(1))
	must(t, err)
	made := make(chan error, 1)
	must(t, s.LaunchHostFunc(func() {
		x, err := lib.TensorFromFloat32s([]float32{1, 2}, []int64{2}, CPU(0))
		if err == nil {
			x.Close()
			err = other.Synchronize() // another stream: waits as usual
		}
		made <- err
	}))
	must(t, receive(t, &stuck, "a host function's own calls", made))
	must(t, other.Close())

	gate := make(chan struct{})
	closed := make(chan error, 1)
	after := make(chan bool, 1)
	must(t, s.LaunchHostFunc(func() {
		<-gate // the next one is queued first
		closed <- s.Close()
	}))
	must(t, s.LaunchHostFunc(func() { after <- true }))
	close(gate)
	must(t, receive(t, &stuck, "Close from a host function of its own stream", closed))
	receive(t, &stuck, "the host function queued after the one that closed the stream", after)
	if err := s.Synchronize(); !errors.Is(err, StatusState) {
		t.Errorf("Synchronize after a host function closed the stream gave %v, want DP_ESTATE", err)
	}

	// On the caller's thread, inside LaunchHostFunc, unless DP_CPU_ASYNC=1.
	def := lib.WrapStream(CPU(0), nil)
	copied := make(chan error, 1)
	must(t, def.LaunchHostFunc(func() {
		x, err := lib.TensorFromFloat32s([]float32{3}, []int64{1}, CPU(1))
		if err == nil {
			x.Close()
		}
		copied <- err
	}))
	must(t, receive(t, &stuck, "a host function's calls on the legacy default stream", copied))
}

// A closed stream is not the legacy default stream (which a nil handle
// means to the library): its calls are DP_ESTATE naming it closed, and
// nothing it is handed runs.
func TestClosedStreamIsRefused(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	s, err := lib.NewStream(CPU(2))
	must(t, err)
	def := lib.WrapStream(CPU(0), nil)
	for _, stream := range []*Stream{s, def} {
		must(t, stream.Close())
		ran := false
		err := stream.LaunchHostFunc(func() { ran = true })
		if !errors.Is(err, StatusState) || !strings.Contains(err.Error(), "stream") ||
			!strings.Contains(err.Error(), "closed") {
			t.Errorf("LaunchHostFunc on a closed stream of %v gave %v, want DP_ESTATE: the stream is closed",
				stream.Device(), err)
		}
		if ran {
			t.Errorf("a host function handed to a closed stream of %v ran", stream.Device())
		}
		if err := stream.Synchronize(); !errors.Is(err, StatusState) || !strings.Contains(err.Error(), "closed") {
			t.Errorf("Synchronize on a closed stream of %v gave %v, want DP_ESTATE: the stream is closed",
				stream.Device(), err)
		}
		if stream.Pointer() != nil {
			t.Errorf("a closed stream of %v still has a handle", stream.Device())
		}
		must(t, stream.Close()) // twice does nothing
	}
}

// Rebind onto a second one-rank group: the plan is kept, the first group
// may close, and the next step averages over the new group (one rank: the
// gradient as it was).
func TestDDPRebindOntoASecondOneRankGroup(t *testing.T) {
	lib := openLibrary(t)
	defer lib.Close()
	group := func(name string) *ProcessGroup {
		store, err := lib.NewFileStore(filepath.Join(t.TempDir(), name), 1)
		must(t, err)
		defer store.Close()
		pg, err := lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Store: store})
		must(t, err)
		return pg
	}
	first, second := group("first"), group("second")
	defer second.Close()
	m, err := lib.NewModule()
	must(t, err)
	defer m.Close()
	for _, name := range []string{"a", "b"} {
		w := floatTensor(t, lib, []float32{1, 2, 3})
		must(t, m.RegisterParameter(name, w, true))
		w.Close()
	}
	d, err := lib.NewDDP(m, first, &DDPOptions{BucketCapMB: 1e-6, FirstBucketCapMB: 1e-6})
	must(t, err)
	defer d.Close()
	step := func(value float32) {
		for _, name := range []string{"b", "a"} {
			g, err := m.Grad(name)
			must(t, err)
			must(t, g.CopyFromFloat32s([]float32{value, value + 1, value + 2}))
			g.Close()
			must(t, d.MarkGradReady(name))
		}
		must(t, d.FinishBackward())
		for _, name := range []string{"a", "b"} {
			g, err := m.Grad(name)
			must(t, err)
			if got := readFloats(t, g); !reflect.DeepEqual(got, []float32{value, value + 1, value + 2}) {
				t.Fatalf("%s's gradient after a step over one rank: %v", name, got)
			}
			g.Close()
		}
	}
	step(1)
	plan, err := d.BucketPlan()
	must(t, err)
	must(t, d.Rebind(second))
	first.Close()
	if kept, err := d.BucketPlan(); err != nil || kept != plan {
		t.Fatalf("the plan after Rebind: %q (%v), want %q", kept, err, plan)
	}
	step(5)
	if err := d.Rebind(first); !errors.Is(err, StatusInvalid) || !strings.Contains(err.Error(), "'pg'") {
		t.Fatalf("Rebind onto a closed group: %v", err)
	}
	step(9)
}
