package dparallel

import (
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The task of examples/dp-train.c at a small size: an MLP of tanh layers
// (linear last layer) regresses onto a fixed random teacher network of the
// same shape, with the forward and backward written here.
const (
	layers = 3
	width  = 16
	batch  = 64
	steps  = 25
	lr     = 0.5
	rtol   = 1.3e-6
	atol   = 5e-5
)

func openLibrary(t *testing.T) *Library {
	t.Helper()
	path := os.Getenv("DP_LIBRARY")
	if path == "" {
		t.Fatal("DP_LIBRARY names no library: set it to the path of libdparallel.so")
	}
	lib, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	return lib
}

// openWithModuleAndTensor opens the library with an empty module and a
// two-element tensor, valid handles for argument checks; the test's cleanup
// closes them, then the library.
func openWithModuleAndTensor(t *testing.T) (*Library, *Module, *Tensor) {
	t.Helper()
	lib := openLibrary(t)
	t.Cleanup(func() { lib.Close() })
	m, err := lib.NewModule()
	must(t, err)
	t.Cleanup(m.Close)
	x, err := lib.NewTensor(Float32, []int64{2}, CPU(0))
	must(t, err)
	t.Cleanup(x.Close)
	return lib, m, x
}

// openWithModelAndBatch opens the library with the test model and a batch
// for it on cpu:0; the test's cleanup closes them, then the library.
func openWithModelAndBatch(t *testing.T) (*Library, *Module, *Tensor) {
	t.Helper()
	lib := openLibrary(t)
	t.Cleanup(func() { lib.Close() })
	w, b := initialParameters(7)
	model := buildModel(t, lib, w, b)
	t.Cleanup(model.Close)
	input, err := lib.NewTensor(Float32, []int64{4, 2 * width}, CPU(0))
	must(t, err)
	t.Cleanup(input.Close)
	return lib, model, input
}

// openWithReplicaSet is openWithModelAndBatch with the model replicated on
// cpu:0 and cpu:1.
func openWithReplicaSet(t *testing.T) (*Library, *Module, *ReplicaSet, *Tensor) {
	t.Helper()
	lib, model, input := openWithModelAndBatch(t)
	set, err := lib.NewReplicaSet(model, []Device{CPU(0), CPU(1)})
	must(t, err)
	t.Cleanup(set.Close)
	return lib, model, set, input
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// splitmix64, as in dp-train.
type rng uint64

func (r *rng) next() uint64 {
	*r += 0x9e3779b97f4a7c15
	z := uint64(*r)
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (r *rng) normal() float32 {
	u := float64(r.next()>>11) / 9007199254740992.0
	v := float64(r.next()>>11) / 9007199254740992.0
	return float32(math.Sqrt(-2*math.Log(u+1e-300)) * math.Cos(2*math.Pi*v))
}

func initialParameters(seed uint64) (w, b [][]float32) {
	r := rng(seed)
	scale := float32(1 / math.Sqrt(width))
	for l := 0; l < layers; l++ {
		w = append(w, make([]float32, width*width))
		b = append(b, make([]float32, width))
		for i := range w[l] {
			w[l][i] = r.normal() * scale
		}
		for i := range b[l] {
			b[l][i] = 0.1 * r.normal()
		}
	}
	return w, b
}

// forwardOnly writes each layer's output into act[l] (n rows of width).
func forwardOnly(w, b [][]float32, rows []float32, n int, act [][]float32) {
	for l := 0; l < layers; l++ {
		for r := 0; r < n; r++ {
			var in []float32
			if l == 0 {
				in = rows[r*2*width : r*2*width+width]
			} else {
				in = act[l-1][r*width : (r+1)*width]
			}
			for j := 0; j < width; j++ {
				s := b[l][j]
				for k := 0; k < width; k++ {
					s += in[k] * w[l][j*width+k]
				}
				if l < layers-1 {
					s = float32(math.Tanh(float64(s)))
				}
				act[l][r*width+j] = s
			}
		}
	}
}

// batchOf fills rows of [x | teacher(x)] for a step.
func batchOf(step int, teacherW, teacherB [][]float32) []float32 {
	r := rng(1000 + uint64(step))
	rows := make([]float32, batch*2*width)
	for i := 0; i < batch; i++ {
		for k := 0; k < width; k++ {
			rows[i*2*width+k] = r.normal()
		}
	}
	act := make([][]float32, layers)
	for l := range act {
		act[l] = make([]float32, batch*width)
	}
	forwardOnly(teacherW, teacherB, rows, batch, act)
	for i := 0; i < batch; i++ {
		copy(rows[i*2*width+width:(i+1)*2*width], act[layers-1][i*width:(i+1)*width])
	}
	return rows
}

// forwardBackward over n rows of [x | y]: writes the gradients of the MSE
// over fullBatch rows (mean over rows and outputs) that these rows
// contribute, and returns their part of the loss. layerDone (may be nil) is
// called once a layer's gradients are final, last layer first.
func forwardBackward(w, b, gw, gb [][]float32, rows []float32, n, fullBatch int, layerDone func(int) error) (float64,
	error) {
	act := make([][]float32, layers)
	for l := range act {
		act[l] = make([]float32, n*width)
	}
	forwardOnly(w, b, rows, n, act)
	dz := make([]float32, n*width)
	da := make([]float32, n*width)
	scale := float32(2.0 / float64(fullBatch*width))
	loss := 0.0
	for r := 0; r < n; r++ {
		for j := 0; j < width; j++ {
			diff := act[layers-1][r*width+j] - rows[r*2*width+width+j]
			loss += float64(diff) * float64(diff)
			dz[r*width+j] = diff * scale
		}
	}
	input := func(l, r, k int) float32 {
		if l == 0 {
			return rows[r*2*width+k]
		}
		return act[l-1][r*width+k]
	}
	for l := layers - 1; l >= 0; l-- {
		for j := 0; j < width; j++ {
			gb[l][j] = 0
			for k := 0; k < width; k++ {
				gw[l][j*width+k] = 0
			}
		}
		for r := 0; r < n; r++ {
			for j := 0; j < width; j++ {
				g := dz[r*width+j]
				gb[l][j] += g
				for k := 0; k < width; k++ {
					gw[l][j*width+k] += g * input(l, r, k)
				}
			}
		}
		if layerDone != nil {
			if err := layerDone(l); err != nil {
				return 0, err
			}
		}
		if l == 0 {
			break
		}
		for r := 0; r < n; r++ {
			for k := 0; k < width; k++ {
				s := float32(0)
				for j := 0; j < width; j++ {
					s += dz[r*width+j] * w[l][j*width+k]
				}
				in := input(l, r, k)
				da[r*width+k] = s * (1 - in*in) // tanh' from its output
			}
		}
		dz, da = da, dz
	}
	return loss / float64(fullBatch*width), nil
}

func weightName(l int) string { return fmt.Sprintf("fc%d.weight", l) }
func biasName(l int) string   { return fmt.Sprintf("fc%d.bias", l) }

// buildModel makes a module of children fc0..fcN, each with weight and bias,
// on cpu:0.
func buildModel(t *testing.T, lib *Library, w, b [][]float32) *Module {
	t.Helper()
	model, err := lib.NewModule()
	must(t, err)
	for l := 0; l < layers; l++ {
		fc, err := lib.NewModule()
		must(t, err)
		wt, err := lib.TensorFromFloat32s(w[l], []int64{width, width}, CPU(0))
		must(t, err)
		bt, err := lib.TensorFromFloat32s(b[l], []int64{width}, CPU(0))
		must(t, err)
		must(t, fc.RegisterParameter("weight", wt, true))
		must(t, fc.RegisterParameter("bias", bt, true))
		must(t, model.RegisterModule(fmt.Sprintf("fc%d", l), fc))
		// The module holds its own references.
		wt.Close()
		bt.Close()
		fc.Close()
	}
	return model
}

// views holds the parameter and gradient slices of one module, over its
// tensors' memory.
type views struct {
	w, b, gw, gb [][]float32
	tensors      []*Tensor
}

func moduleViews(m *Module) (*views, error) {
	v := &views{}
	for l := 0; l < layers; l++ {
		for i, get := range []func() (*Tensor, error){
			func() (*Tensor, error) { return m.Parameter(weightName(l)) },
			func() (*Tensor, error) { return m.Parameter(biasName(l)) },
			func() (*Tensor, error) { return m.Grad(weightName(l)) },
			func() (*Tensor, error) { return m.Grad(biasName(l)) },
		} {
			tensor, err := get()
			if err != nil {
				v.close()
				return nil, err
			}
			v.tensors = append(v.tensors, tensor)
			data, err := tensor.Float32s()
			if err != nil {
				v.close()
				return nil, err
			}
			switch i {
			case 0:
				v.w = append(v.w, data)
			case 1:
				v.b = append(v.b, data)
			case 2:
				v.gw = append(v.gw, data)
			case 3:
				v.gb = append(v.gb, data)
			}
		}
	}
	return v, nil
}

func (v *views) close() {
	for _, t := range v.tensors {
		t.Close()
	}
}

// replicaStep is the forward callback: the replica's forward and backward
// on its rows, its part of the loss as a one-element tensor.
func replicaStep(lib *Library) ForwardFunc {
	return func(index int, replica *Module, input *Tensor, device Device) (*Tensor, error) {
		shape, err := input.Shape()
		if err != nil {
			return nil, err
		}
		rows, err := input.Float32s()
		if err != nil {
			return nil, err
		}
		v, err := moduleViews(replica)
		if err != nil {
			return nil, err
		}
		defer v.close()
		loss, err := forwardBackward(v.w, v.b, v.gw, v.gb, rows, int(shape[0]), batch, nil)
		if err != nil {
			return nil, err
		}
		return lib.TensorFromFloat32s([]float32{float32(loss)}, []int64{1}, device)
	}
}

func sgd(w, g []float32) {
	for i := range w {
		w[i] -= lr * g[i]
	}
}

// reference trains the same model in plain Go on the full batch.
func reference(teacherW, teacherB [][]float32) (w, b [][]float32, losses []float64) {
	w, b = initialParameters(7)
	gw := make([][]float32, layers)
	gb := make([][]float32, layers)
	for l := range gw {
		gw[l] = make([]float32, width*width)
		gb[l] = make([]float32, width)
	}
	for step := 0; step < steps; step++ {
		rows := batchOf(step, teacherW, teacherB)
		loss, _ := forwardBackward(w, b, gw, gb, rows, batch, batch, nil)
		losses = append(losses, loss)
		for l := 0; l < layers; l++ {
			sgd(w[l], gw[l])
			sgd(b[l], gb[l])
		}
	}
	return w, b, losses
}

func compare(t *testing.T, what string, got, want [][]float32) {
	t.Helper()
	worst, bad := 0.0, 0
	for l := range want {
		for i := range want[l] {
			diff := math.Abs(float64(got[l][i]) - float64(want[l][i]))
			if !(diff <= atol+rtol*math.Abs(float64(want[l][i]))) {
				bad++
			}
			worst = math.Max(worst, diff)
		}
	}
	t.Logf("%s: max |difference| %.3g", what, worst)
	if bad > 0 {
		t.Errorf("%s: %d values differ from single-device training by more than rtol %g atol %g (worst %g)", what,
			bad, rtol, atol, worst)
	}
}

// Data-parallel training over cpu:0 and cpu:1 with a replica set reaches
// the parameters of single-device training on the full batch.
func TestReplicaSetTrainingMatchesSingleDevice(t *testing.T) {
	lib := openLibrary(t)
	teacherW, teacherB := initialParameters(99)
	w0, b0 := initialParameters(7)
	model := buildModel(t, lib, w0, b0)
	defer model.Close()
	if n := model.NumParameters(); n != 2*layers {
		t.Fatalf("the model lists %d parameters, want %d", n, 2*layers)
	}
	names, err := model.ParameterNames()
	must(t, err)
	if names[0] != "fc0.weight" || names[len(names)-1] != biasName(layers-1) {
		t.Fatalf("parameter names %v", names)
	}

	devices := []Device{CPU(0), CPU(1)}
	set, err := lib.NewReplicaSet(model, devices)
	must(t, err)
	defer set.Close()
	if set.Size() != 2 {
		t.Fatalf("replica set size %d, want 2", set.Size())
	}
	input, err := lib.NewTensor(Float32, []int64{batch, 2 * width}, CPU(0))
	must(t, err)
	defer input.Close()
	inputRows, err := input.Float32s()
	must(t, err)
	params, err := moduleViews(model)
	must(t, err)
	defer params.close()

	var losses []float64
	for step := 0; step < steps; step++ {
		copy(inputRows, batchOf(step, teacherW, teacherB))
		must(t, set.Sync())
		out, err := set.Apply(input, 0, CPU(0), replicaStep(lib))
		must(t, err)
		parts, err := out.Float32s()
		must(t, err)
		if len(parts) != len(devices) {
			t.Fatalf("gathered %d losses, want one per replica (%d)", len(parts), len(devices))
		}
		losses = append(losses, float64(parts[0])+float64(parts[1]))
		out.Close()
		must(t, model.ZeroGrad())
		must(t, set.ReduceGradients())
		for l := 0; l < layers; l++ {
			sgd(params.w[l], params.gw[l])
			sgd(params.b[l], params.gb[l])
		}
	}
	wantW, wantB, wantLosses := reference(teacherW, teacherB)
	compare(t, "weights", params.w, wantW)
	compare(t, "biases", params.b, wantB)
	t.Logf("loss %.6f -> %.6f (single device %.6f -> %.6f)", losses[0], losses[steps-1], wantLosses[0],
		wantLosses[steps-1])
	if math.Abs(losses[0]-wantLosses[0]) > 1e-5*wantLosses[0] {
		t.Errorf("first step's loss %g, single device %g", losses[0], wantLosses[0])
	}
	if !(losses[steps-1] < 0.5*losses[0]) {
		t.Errorf("the loss did not halve over %d steps: %g -> %g", steps, losses[0], losses[steps-1])
	}
}

// One dp_data_parallel step (scatter, replicate, Go forward on each device,
// gradient reduction, gather) gives the full batch's gradients.
func TestDataParallelStepGivesFullBatchGradients(t *testing.T) {
	lib := openLibrary(t)
	teacherW, teacherB := initialParameters(99)
	rows := batchOf(0, teacherW, teacherB)
	w, b := initialParameters(7)
	model := buildModel(t, lib, w, b)
	defer model.Close()
	input, err := lib.TensorFromFloat32s(rows, []int64{batch, 2 * width}, CPU(0))
	must(t, err)
	defer input.Close()
	must(t, model.ZeroGrad())
	out, err := lib.DataParallel(model, input, []Device{CPU(0), CPU(1)}, CPU(0), 0, replicaStep(lib))
	must(t, err)
	defer out.Close()
	parts, err := out.Float32s()
	must(t, err)

	gw := make([][]float32, layers)
	gb := make([][]float32, layers)
	for l := range gw {
		gw[l] = make([]float32, width*width)
		gb[l] = make([]float32, width)
	}
	loss, _ := forwardBackward(w, b, gw, gb, rows, batch, batch, nil)
	got := float64(parts[0]) + float64(parts[1])
	if math.Abs(got-loss) > 1e-5*loss {
		t.Errorf("loss %g, single device %g", got, loss)
	}
	v, err := moduleViews(model)
	must(t, err)
	defer v.close()
	compare(t, "weight gradients", v.gw, gw)
	compare(t, "bias gradients", v.gb, gb)
}

// parallel_apply runs each replica's callback on that replica's device with
// its own input, and an output may be the input itself.
func TestParallelApplyRunsEveryReplicaOnItsDevice(t *testing.T) {
	lib := openLibrary(t)
	w, b := initialParameters(7)
	model := buildModel(t, lib, w, b)
	defer model.Close()
	devices := []Device{CPU(0), CPU(1)}
	replicas, err := lib.Replicate(model, devices, false)
	must(t, err)
	defer func() {
		for _, r := range replicas {
			r.Close()
		}
	}()
	var inputs []*Tensor
	for i, d := range devices {
		in, err := lib.TensorFromFloat32s([]float32{float32(10 * (i + 1))}, []int64{1}, d)
		must(t, err)
		defer in.Close()
		inputs = append(inputs, in)
	}
	outs, err := lib.ParallelApply(replicas, inputs, devices, func(index int, replica *Module, input *Tensor,
		device Device) (*Tensor, error) {
		if device != devices[index] {
			return nil, fmt.Errorf("replica %d called on %v", index, device)
		}
		if replica.NumParameters() != 2*layers {
			return nil, fmt.Errorf("replica %d has %d parameters", index, replica.NumParameters())
		}
		if index == 0 {
			return input, nil
		}
		x, err := input.Float32s()
		if err != nil {
			return nil, err
		}
		return lib.TensorFromFloat32s([]float32{x[0] + float32(index)}, []int64{1}, device)
	})
	must(t, err)
	want := []float32{10, 21}
	for i, o := range outs {
		x, err := o.Float32s()
		must(t, err)
		if x[0] != want[i] || o.Device() != devices[i] {
			t.Errorf("output %d is %v on %v, want %v on %v", i, x[0], o.Device(), want[i], devices[i])
		}
		o.Close()
	}
}

// A bad argument is an error that names it, with the status code.
func TestBadArgumentsAreErrorsNamingThem(t *testing.T) {
	lib, m, x := openWithModuleAndTensor(t)
	cases := []struct {
		what string
		err  error
		name string
	}{
		{"a dotted parameter name", m.RegisterParameter("fc.weight", x, true), "'name'"},
		{"an unknown parameter", func() error { _, err := m.Parameter("nope"); return err }(), "nope"},
		{"a negative dimension", func() error { _, err := lib.NewTensor(Float32, []int64{-3}, CPU(0)); return err }(),
			"shape"},
		{"a device name", func() error { _, err := lib.ParseDevice("tpu:0"); return err }(), "tpu:0"},
		{"a nil forward", func() error { _, err := lib.DataParallel(m, x, []Device{CPU(0)}, CPU(0), 0, nil); return err }(),
			"'fn'"},
		{"a closed tensor", func() error {
			y, err := lib.NewTensor(Float32, []int64{2}, CPU(0))
			must(t, err)
			y.Close()
			return m.RegisterParameter("w", y, true)
		}(), "'value'"},
		{"a short copy", x.CopyFromFloat32s([]float32{1, 2, 3}), "nbytes"},
		{"a wrong dtype view", func() error {
			y, err := lib.NewTensor(Int64, []int64{2}, CPU(0))
			must(t, err)
			defer y.Close()
			_, err = y.Float32s()
			return err
		}(), "float32"},
	}
	for _, c := range cases {
		var de *Error
		if !errors.As(c.err, &de) {
			t.Errorf("%s: got %v, want a *dparallel.Error", c.what, c.err)
			continue
		}
		if !errors.Is(c.err, StatusInvalid) || !strings.Contains(de.Message, c.name) {
			t.Errorf("%s: got %q (status %v), want DP_EINVAL naming %s", c.what, c.err, de.Status, c.name)
		}
	}
}

// A forward that panics or fails is an error in the caller, carrying the Go
// cause; the process survives and the replica set keeps working.
func TestForwardPanicAndErrorBecomeErrors(t *testing.T) {
	lib, _, set, input := openWithReplicaSet(t)

	_, err := set.Apply(input, 0, CPU(0), func(index int, replica *Module, in *Tensor, d Device) (*Tensor, error) {
		if index == 1 {
			var nilMap map[string]int
			nilMap["boom"] = 1 // a runtime panic on the library's worker thread
		}
		return in, nil
	})
	var de *Error
	if !errors.As(err, &de) || de.Status != StatusUser || de.Cause == nil ||
		!strings.Contains(de.Cause.Error(), "replica 1 panicked") {
		t.Fatalf("a panicking forward gave %v, want DP_EUSER caused by replica 1's panic", err)
	}
	t.Log(err)

	sentinel := errors.New("the host refused this batch")
	_, err = set.Apply(input, 0, CPU(0), func(index int, replica *Module, in *Tensor, d Device) (*Tensor, error) {
		return nil, sentinel
	})
	if !errors.Is(err, sentinel) || !errors.Is(err, StatusUser) {
		t.Fatalf("a failing forward gave %v, want DP_EUSER wrapping the Go error", err)
	}

	_, err = set.Apply(input, 0, CPU(0), func(int, *Module, *Tensor, Device) (*Tensor, error) { return nil, nil })
	if !errors.Is(err, StatusUser) || !strings.Contains(err.Error(), "no tensor") {
		t.Fatalf("a forward returning nothing gave %v", err)
	}

	out, err := set.Apply(input, 0, CPU(0), replicaStep(lib))
	must(t, err)
	out.Close()
}

// A forward that ends its goroutine with runtime.Goexit (as t.Fatal and
// t.FailNow do) fails the call with DP_EUSER, on the library's worker
// threads and, with one device, on the calling thread; the process and the
// library carry on.
func TestForwardGoexitBecomesError(t *testing.T) {
	lib, model, input := openWithModelAndBatch(t)
	for _, devices := range [][]Device{{CPU(0), CPU(1)}, {CPU(0)}} {
		last := len(devices) - 1
		_, err := lib.DataParallel(model, input, devices, CPU(0), 0, func(index int, replica *Module, in *Tensor,
			d Device) (*Tensor, error) {
			if index == last {
				runtime.Goexit()
			}
			return in, nil
		})
		var de *Error
		if !errors.As(err, &de) || de.Status != StatusUser || de.Cause == nil ||
			!strings.Contains(de.Cause.Error(), fmt.Sprintf("replica %d exited its goroutine (runtime.Goexit", last)) {
			t.Fatalf("on %d device(s), a forward calling runtime.Goexit gave %v, want DP_EUSER naming runtime.Goexit",
				len(devices), err)
		}
		t.Log(err)
	}
	out, err := lib.DataParallel(model, input, []Device{CPU(0), CPU(1)}, CPU(0), 0, replicaStep(lib))
	must(t, err)
	out.Close()
}

// panic(nil) in a forward is a failure that says so, not a success with no
// output (before Go 1.21 recover() returns nil for it).
func TestForwardPanicNilBecomesError(t *testing.T) {
	lib, _, set, input := openWithReplicaSet(t)
	_, err := set.Apply(input, 0, CPU(0), func(index int, replica *Module, in *Tensor, d Device) (*Tensor, error) {
		if index == 1 {
			panic(nil)
		}
		return in, nil
	})
	var de *Error
	// Go 1.21 and later panic with a *runtime.PanicNilError instead.
	if !errors.As(err, &de) || de.Status != StatusUser || de.Cause == nil ||
		!strings.Contains(de.Cause.Error(), "replica 1 panicked") ||
		!(strings.Contains(de.Cause.Error(), "panic(nil)") || strings.Contains(de.Cause.Error(), "nil argument")) {
		t.Fatalf("a forward calling panic(nil) gave %v, want DP_EUSER naming panic(nil)", err)
	}
	t.Log(err)
	out, err := set.Apply(input, 0, CPU(0), replicaStep(lib))
	must(t, err)
	out.Close()
}

// A forward that calls DataParallel, ParallelApply or ReplicaSet.Apply
// would wait for the devices its own call holds: it gets DP_ESTATE, not a
// deadlock.
func TestApplyInsideForwardIsRefused(t *testing.T) {
	lib, model, set, input := openWithReplicaSet(t)
	devices := []Device{CPU(0), CPU(1)}
	nested := []struct {
		op   string
		call func() error
	}{
		{"dp_data_parallel", func() error {
			_, err := lib.DataParallel(model, input, devices, CPU(0), 0, replicaStep(lib))
			return err
		}},
		{"dp_replica_set_apply", func() error { _, err := set.Apply(input, 0, CPU(0), replicaStep(lib)); return err }},
		{"dp_parallel_apply", func() error {
			_, err := lib.ParallelApply([]*Module{model}, []*Tensor{input}, []Device{CPU(2)}, replicaStep(lib))
			return err
		}},
	}
	for _, n := range nested {
		_, err := lib.DataParallel(model, input, devices, CPU(0), 0, func(index int, replica *Module, in *Tensor,
			d Device) (*Tensor, error) {
			if err := n.call(); err != nil {
				return nil, err
			}
			return in, nil
		})
		var outer, inner *Error
		if !errors.As(err, &outer) || outer.Status != StatusUser || !errors.As(outer.Cause, &inner) ||
			inner.Status != StatusState || inner.Op != n.op {
			t.Errorf("%s from inside a forward gave %v, want DP_EUSER caused by its DP_ESTATE", n.op, err)
		}
	}
}

// After Library.Close every call on the library, or on a handle made from
// it, is a DP_ESTATE error saying so; accessors give their invalid-handle
// values; closing handles then, or the library again, does nothing.
func TestCallsAfterCloseAreErrors(t *testing.T) {
	lib := openLibrary(t)
	w, b := initialParameters(7)
	model := buildModel(t, lib, w, b)
	x, err := lib.NewTensor(Float32, []int64{4, 2 * width}, CPU(0))
	must(t, err)
	set, err := lib.NewReplicaSet(model, []Device{CPU(0), CPU(1)})
	must(t, err)
	// A group of one rank, served by its own TCP store.
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	port := listener.Addr().(*net.TCPAddr).Port
	listener.Close()
	t.Setenv("RANK", "0")
	t.Setenv("LOCAL_RANK", "0")
	t.Setenv("WORLD_SIZE", "1")
	t.Setenv("MASTER_ADDR", "127.0.0.1")
	t.Setenv("MASTER_PORT", fmt.Sprint(port))
	pg, err := lib.ProcessGroupFromEnv()
	must(t, err)
	ddp, err := lib.NewDDP(model, pg, nil)
	must(t, err)
	must(t, lib.Close())
	must(t, lib.Close())

	fn := replicaStep(lib)
	calls := []struct {
		what string
		err  error
	}{
		{"ParseDevice", func() error { _, err := lib.ParseDevice("cpu:1"); return err }()},
		{"NewTensor", func() error { _, err := lib.NewTensor(Float32, []int64{2}, CPU(0)); return err }()},
		{"TensorFromFloat32s", func() error {
			_, err := lib.TensorFromFloat32s([]float32{1}, []int64{1}, CPU(0))
			return err
		}()},
		{"NewModule", func() error { _, err := lib.NewModule(); return err }()},
		{"Replicate", func() error { _, err := lib.Replicate(model, []Device{CPU(1)}, false); return err }()},
		{"ReduceGradients", lib.ReduceGradients([]*Module{model}, model)},
		{"ParallelApply", func() error {
			_, err := lib.ParallelApply([]*Module{model}, []*Tensor{x}, nil, fn)
			return err
		}()},
		{"DataParallel", func() error {
			_, err := lib.DataParallel(model, x, []Device{CPU(0)}, CPU(0), 0, fn)
			return err
		}()},
		{"NewReplicaSet", func() error { _, err := lib.NewReplicaSet(model, []Device{CPU(0)}); return err }()},
		{"ProcessGroupFromEnv", func() error { _, err := lib.ProcessGroupFromEnv(); return err }()},
		{"NewDDP", func() error { _, err := lib.NewDDP(model, pg, nil); return err }()},
		{"Tensor.Shape", func() error { _, err := x.Shape(); return err }()},
		{"Tensor.Float32s", func() error { _, err := x.Float32s(); return err }()},
		{"Tensor.CopyFromFloat32s", x.CopyFromFloat32s(make([]float32, 4*2*width))},
		{"Tensor.CopyToFloat32s", x.CopyToFloat32s(make([]float32, 4*2*width))},
		{"Module.RegisterParameter", model.RegisterParameter("extra", nil, false)},
		{"Module.RegisterModule", model.RegisterModule("extra", nil)},
		{"Module.ParameterNames", func() error { _, err := model.ParameterNames(); return err }()},
		{"Module.Parameter", func() error { _, err := model.Parameter(weightName(0)); return err }()},
		{"Module.Grad", func() error { _, err := model.Grad(weightName(0)); return err }()},
		{"Module.ZeroGrad", model.ZeroGrad()},
		{"Module.Save", model.Save(t.TempDir() + "/model.safetensors")},
		{"Module.Load", model.Load(t.TempDir()+"/model.safetensors", true)},
		{"ReplicaSet.Sync", set.Sync()},
		{"ReplicaSet.Replica", func() error { _, err := set.Replica(0); return err }()},
		{"ReplicaSet.Apply", func() error { _, err := set.Apply(x, 0, CPU(0), fn); return err }()},
		{"ReplicaSet.ReduceGradients", set.ReduceGradients()},
		{"ProcessGroup.AllReduce", pg.AllReduce(x, Sum)},
		{"ProcessGroup.Broadcast", pg.Broadcast(x, 0)},
		{"ProcessGroup.Barrier", pg.Barrier()},
		{"DDP.PreForward", ddp.PreForward()},
		{"DDP.MarkGradReady", ddp.MarkGradReady(weightName(0))},
		{"DDP.FinishBackward", ddp.FinishBackward()},
	}
	for _, c := range calls {
		if !errors.Is(c.err, StatusState) || !strings.Contains(c.err.Error(), "library closed") {
			t.Errorf("%s after Close gave %v, want DP_ESTATE: library closed", c.what, c.err)
		}
	}
	if major, minor := lib.ABI(); major != 0 || minor != 0 || lib.Version() != 0 {
		t.Errorf("a closed library reports ABI %d.%d, version %d; want zeros", major, minor, lib.Version())
	}
	if x.DType() != -1 || x.Numel() != -1 || x.Device().Index != -1 || model.NumParameters() != 0 ||
		set.Size() != 0 || pg.Rank() != -1 || pg.Size() != -1 || pg.Backend() != "" || ddp.NumBuckets() != 0 {
		t.Errorf("accessors after Close: dtype %d numel %d device %v parameters %d replicas %d rank %d size %d "+
			"backend %q buckets %d; want the library's invalid-handle values", x.DType(), x.Numel(), x.Device(),
			model.NumParameters(), set.Size(), pg.Rank(), pg.Size(), pg.Backend(), ddp.NumBuckets())
	}
	for i := 0; i < 2; i++ {
		ddp.Close()
		pg.Close()
		set.Close()
		x.Close()
		model.Close()
	}
}

// Close waits for the calls in flight, which meanwhile find the library
// closed to new calls; Close from inside a forward, which would wait for
// itself, is refused.
func TestCloseWaitsForCallsInFlight(t *testing.T) {
	lib := openLibrary(t)
	model, err := lib.NewModule()
	must(t, err)
	defer model.Close()
	input, err := lib.TensorFromFloat32s([]float32{1, 2}, []int64{2, 1}, CPU(0))
	must(t, err)
	defer input.Close()
	var forwardDone atomic.Bool
	closeReturned := make(chan error)
	_, err = lib.DataParallel(model, input, []Device{CPU(0)}, CPU(0), 0, func(index int, replica *Module, in *Tensor,
		d Device) (*Tensor, error) {
		defer forwardDone.Store(true)
		if err := lib.Close(); !errors.Is(err, StatusState) {
			return nil, fmt.Errorf("Close from inside a forward gave %v, want DP_ESTATE", err)
		}
		go func() { closeReturned <- lib.Close() }()
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			m, err := lib.NewModule()
			if err != nil {
				return nil, err
			}
			m.Close()
		}
		return nil, errors.New("calls were still admitted 10 s after Close began")
	})
	if !errors.Is(err, StatusUser) || !strings.Contains(err.Error(), "library closed") {
		t.Errorf("the call in flight gave %v, want DP_EUSER caused by 'library closed'", err)
	}
	must(t, <-closeReturned)
	if !forwardDone.Load() {
		t.Error("Close returned before the call in flight")
	}
}

// A library of another ABI major is refused with a message.
func TestOtherABIMajorIsRefused(t *testing.T) {
	lib := openLibrary(t)
	major, minor := lib.ABI()
	if major != abiMajor || minor < 1 {
		t.Errorf("table ABI %d.%d, binding major %d", major, minor, abiMajor)
	}
	_, err := openMajor(lib.Path(), abiMajor+1)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("ABI major %d", abiMajor+1)) {
		t.Fatalf("asking for ABI major %d gave %v, want a refusal naming it", abiMajor+1, err)
	}
	if _, err := Open("/nonexistent/libdparallel.so"); err == nil ||
		!strings.Contains(err.Error(), "/nonexistent/libdparallel.so") {
		t.Fatalf("a missing library gave %v", err)
	}
}

// dlclose after every handle is closed, then loading the library again and
// using its device workers, does not crash.
func TestCloseAndReopenLibrary(t *testing.T) {
	for round := 0; round < 2; round++ {
		lib := openLibrary(t)
		w, b := initialParameters(7)
		model := buildModel(t, lib, w, b)
		input, err := lib.NewTensor(Float32, []int64{4, 2 * width}, CPU(0))
		must(t, err)
		out, err := lib.DataParallel(model, input, []Device{CPU(0), CPU(1)}, CPU(0), 0, replicaStep(lib))
		must(t, err)
		out.Close()
		input.Close()
		model.Close()
		must(t, lib.Close())
	}
}

// Under dp-run -n 2: each rank trains its half of every batch, marking each
// layer's gradients ready for the DDP reducer during the backward, and both
// ranks reach the parameters of single-process training on the full batch
// (rank 1 starts from other parameters: DDP starts it from rank 0's).
func TestDDPTwoRanks(t *testing.T) {
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
	if want := os.Getenv("DP_GO_DDP_WORLD"); want != "" && want != fmt.Sprint(world) {
		t.Fatalf("world size %d, want %s", world, want)
	}
	if batch%world != 0 {
		t.Fatalf("batch %d does not split over %d ranks", batch, world)
	}
	teacherW, teacherB := initialParameters(99)
	w0, b0 := initialParameters(7 + uint64(rank))
	model := buildModel(t, lib, w0, b0)
	defer model.Close()
	ddp, err := lib.NewDDP(model, pg, &DDPOptions{BucketCapMB: 0.001, FirstBucketCapMB: 0.001})
	must(t, err)
	defer ddp.Close()
	t.Logf("rank %d of %d (%s), %d buckets", rank, world, pg.Backend(), ddp.NumBuckets())

	share := batch / world
	lossSum, err := lib.NewTensor(Float32, []int64{1}, CPU(0))
	must(t, err)
	defer lossSum.Close()
	lossView, err := lossSum.Float32s()
	must(t, err)
	markReady := func(l int) error {
		if err := ddp.MarkGradReady(weightName(l)); err != nil {
			return err
		}
		return ddp.MarkGradReady(biasName(l))
	}
	var losses []float64
	for step := 0; step < steps; step++ {
		rows := batchOf(step, teacherW, teacherB)[rank*share*2*width : (rank+1)*share*2*width]
		must(t, ddp.PreForward())
		// Fetched every step: the reducer may move the gradients.
		v, err := moduleViews(model)
		must(t, err)
		// The reducer averages over ranks: each contributes world x its share
		// of the full-batch gradient, i.e. the gradient of its own rows' mean.
		loss, err := forwardBackward(v.w, v.b, v.gw, v.gb, rows, share, share, markReady)
		must(t, err)
		must(t, ddp.FinishBackward())
		for l := 0; l < layers; l++ {
			sgd(v.w[l], v.gw[l])
			sgd(v.b[l], v.gb[l])
		}
		v.close()
		lossView[0] = float32(loss)
		must(t, pg.AllReduce(lossSum, Avg))
		losses = append(losses, float64(lossView[0]))
	}
	wantW, wantB, wantLosses := reference(teacherW, teacherB)
	v, err := moduleViews(model)
	must(t, err)
	defer v.close()
	compare(t, fmt.Sprintf("rank %d weights", rank), v.w, wantW)
	compare(t, fmt.Sprintf("rank %d biases", rank), v.b, wantB)
	t.Logf("loss %.6f -> %.6f (single process %.6f -> %.6f)", losses[0], losses[steps-1], wantLosses[0],
		wantLosses[steps-1])
	if math.Abs(losses[0]-wantLosses[0]) > 1e-5*wantLosses[0] {
		t.Errorf("first step's loss %g, single process %g", losses[0], wantLosses[0])
	}
}
