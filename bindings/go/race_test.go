package dparallel

import (
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// closedError is what a call on a closed handle returns: a *Error saying so.
func closedError(err error) bool {
	var de *Error
	return errors.As(err, &de) && strings.Contains(de.Message, "closed")
}

// raceClose runs rounds times: callers goroutines call use on a new handle
// from open until it is closed, while this goroutine closes it once every
// caller has made a call. A call racing Close either succeeds or is the
// closed error; every call that starts after Close returned is the closed
// error. Run under the race detector, a read of a handle that Close
// releases, unordered with it, fails the test.
func raceClose[H any](t *testing.T, what string, rounds, callers int, open func() (H, error), closeIt func(H),
	use func(H) error) {
	t.Helper()
	for round := 0; round < rounds; round++ {
		h, err := open()
		if err != nil {
			t.Fatalf("%s, round %d: %v", what, round, err)
		}
		var called, wg sync.WaitGroup
		var closed atomic.Bool
		wrong := make(chan error, callers)
		called.Add(callers)
		wg.Add(callers)
		for i := 0; i < callers; i++ {
			go func() {
				defer wg.Done()
				counted := false
				defer func() {
					if !counted {
						called.Done()
					}
				}()
				for {
					afterClose := closed.Load()
					if err := use(h); err != nil {
						if !closedError(err) {
							wrong <- err
						}
						return
					}
					if afterClose {
						wrong <- errors.New("a call that started after Close returned succeeded")
						return
					}
					if !counted {
						counted = true
						called.Done()
					}
				}
			}()
		}
		called.Wait()
		closeIt(h)
		closed.Store(true)
		wg.Wait()
		close(wrong)
		for err := range wrong {
			t.Fatalf("%s, round %d: a caller racing Close got %v", what, round, err)
		}
		if err := use(h); !closedError(err) {
			t.Fatalf("%s: a call after Close gave %v, want the closed error", what, err)
		}
	}
	t.Logf("%s: Close raced calls on %d goroutines %d times", what, callers, rounds)
}

// Close racing calls on other goroutines: every handle type holds a lease
// per call, so Close waits for them and later calls are errors, never a
// read of a released handle (the race detector checks the binding's own
// memory; the library would crash on a freed handle).
func TestCloseRacingCallsIsSafe(t *testing.T) {
	// This goroutine issues the async collectives: the library orders a
	// group's calls by thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	lib := openLibrary(t)
	defer lib.Close()
	const callers = 2
	values := []float32{1, 2, 3, 4}
	raceClose(t, "Tensor", 1000, callers,
		func() (*Tensor, error) { return lib.TensorFromFloat32s(values, []int64{4}, CPU(0)) },
		(*Tensor).Close,
		func(x *Tensor) error {
			if n := x.Numel(); n != 4 && n != -1 {
				return fmt.Errorf("Numel gave %d", n)
			}
			return x.CopyFromFloat32s(values)
		})
	newModel := func() (*Module, error) {
		m, err := lib.NewModule()
		if err != nil {
			return nil, err
		}
		w, err := lib.TensorFromFloat32s(values, []int64{4}, CPU(0))
		if err != nil {
			m.Close()
			return nil, err
		}
		defer w.Close()
		if err := m.RegisterParameter("w", w, true); err != nil {
			m.Close()
			return nil, err
		}
		return m, nil
	}
	raceClose(t, "Module", 100, callers, newModel, (*Module).Close, func(m *Module) error {
		p, err := m.Parameter("w")
		p.Close()
		return err
	})
	model, err := newModel()
	must(t, err)
	defer model.Close()
	raceClose(t, "ReplicaSet", 30, callers,
		func() (*ReplicaSet, error) { return lib.NewReplicaSet(model, []Device{CPU(0), CPU(1)}) },
		(*ReplicaSet).Close, (*ReplicaSet).Sync)
	raceClose(t, "Stream", 50, callers, func() (*Stream, error) { return lib.NewStream(CPU(0)) },
		func(s *Stream) { must(t, s.Close()) }, (*Stream).Synchronize)
	dir := t.TempDir()
	round := 0
	raceClose(t, "Store", 20, callers,
		func() (*Store, error) {
			round++
			return lib.NewFileStore(filepath.Join(dir, fmt.Sprint("store", round)), 1)
		},
		(*Store).Close, func(s *Store) error { _, err := s.Add("k", 1); return err })
	store, err := lib.NewFileStore(filepath.Join(dir, "group"), 1)
	must(t, err)
	defer store.Close()
	newGroup := func() (*ProcessGroup, error) {
		return lib.NewProcessGroup(0, 1, &ProcessGroupOptions{Store: store})
	}
	// Collectives are one goroutine's at a time; a group's reads are
	// anyone's. Rank answers -1 once the group is closed.
	raceClose(t, "ProcessGroup", 20, callers, newGroup, (*ProcessGroup).Close, func(pg *ProcessGroup) error {
		switch pg.Rank() {
		case 0:
			return nil
		case -1:
			return invalid("Rank", "the process group is closed")
		}
		return errors.New("a racing Rank read the wrong rank")
	})
	pg, err := newGroup()
	must(t, err)
	defer pg.Close()
	grad, err := lib.TensorFromFloat32s([]float32{1, 2}, []int64{2}, CPU(0))
	must(t, err)
	defer grad.Close()
	raceClose(t, "Work", 50, callers, func() (*Work, error) { return pg.AllReduceAsync(grad, Sum) },
		(*Work).Close, (*Work).Wait)
	raceClose(t, "DDP", 30, callers, func() (*DDP, error) { return lib.NewDDP(model, pg, nil) }, (*DDP).Close,
		func(d *DDP) error { _, err := d.Stats(); return err })
	plain, err := newModel()
	must(t, err)
	defer plain.Close()
	raceClose(t, "FSDP", 20, callers, func() (*FSDP, error) { return lib.NewFSDP(plain, pg, nil) }, (*FSDP).Close,
		func(f *FSDP) error { _, err := f.ParameterNames(); return err })
	// A handle passed as an argument is held by the call too; a closed one
	// is an invalid argument naming it.
	raceClose(t, "Tensor as an argument", 100, callers,
		func() (*Tensor, error) { return lib.TensorFromFloat32s(values, []int64{4}, CPU(0)) },
		(*Tensor).Close,
		func(x *Tensor) error {
			m, err := lib.NewModule()
			if err != nil {
				return err
			}
			defer m.Close()
			return m.RegisterParameter("w", x, true)
		})
}
