package dparallel

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"sync"
	"sync/atomic"
)

// A Go function that C calls back (a forward) must not end the cgo
// callback's goroutine: runtime.Goexit there, which t.Fatal and t.FailNow
// do, makes the runtime throw "internal lockOSThread error". So callbacks
// run on a goroutine of their own, which Goexit may end, while the cgo
// callback waits for it on the library's thread.

var errGoexit = errors.New("exited its goroutine (runtime.Goexit, e.g. t.Fatal or t.FailNow called in a callback)")

// runCallback runs f on a goroutine of its own and waits for it: nil when f
// returned, else an error for its panic or its runtime.Goexit.
func runCallback(f func()) error {
	done := make(chan error, 1)
	go runCallbackGoroutine(f, done)
	return <-done
}

// runCallbackGoroutine is the outermost function of every goroutine that
// runs a callback (insideCallback looks for it).
func runCallbackGoroutine(f func(), done chan<- error) {
	var failure error
	finished := false // false while a Goexit runs the deferred calls
	defer func() {
		if !finished {
			failure = errGoexit
		}
		done <- failure
	}()
	failure = recoverPanic(f)
	finished = true
}

// recoverPanic turns f's panic into an error. A Goexit also runs its
// deferred call, with recover() nil: runCallbackGoroutine tells the two
// apart, since only a recovered panic lets recoverPanic return.
func recoverPanic(f func()) (failure error) {
	returned := false
	defer func() {
		if returned {
			return
		}
		switch r := recover().(type) {
		case nil: // panic(nil) before Go 1.21 (later ones panic with a *runtime.PanicNilError)
			failure = errors.New("panicked: panic(nil)")
		case error:
			failure = fmt.Errorf("panicked: %w", r)
		default:
			failure = fmt.Errorf("panicked: %v", r)
		}
	}()
	f()
	returned = true
	return nil
}

var callbackGoroutineName = runtime.FuncForPC(reflect.ValueOf(runCallbackGoroutine).Pointer()).Name()

// insideCallback reports whether the calling goroutine runs a callback. On
// the cgo callback's own thread the library refuses the calls that would
// wait for the call in flight; a callback's goroutine runs on another
// thread, so the binding refuses them itself.
func insideCallback() bool {
	pcs := make([]uintptr, 64)
	n := runtime.Callers(2, pcs)
	for n == len(pcs) { // the stack may be deeper: its bottom is what counts
		pcs = make([]uintptr, 2*len(pcs))
		n = runtime.Callers(2, pcs)
	}
	frames := runtime.CallersFrames(pcs[:n])
	for {
		frame, more := frames.Next()
		if frame.Function == callbackGoroutineName {
			return true
		}
		if !more {
			return false
		}
	}
}

// A DDP comm hook or on_bucket_reduced must make its calls into the library
// on the library's worker thread that runs it: the library tells a hook's
// collectives (and its reads of the dp_ddp) from the host's by that thread.
// Yet the Go function cannot run on the cgo callback's goroutine, which
// runtime.Goexit must not end. So it runs on a goroutine of its own, as a
// forward does, and the callback's goroutine, locked to the worker thread,
// makes the library calls for it: Library.use hands them over.

type pinnedCall struct {
	f    func()
	done chan interface{} // f's panic value, or nil
}

type pinnedThread struct{ calls chan pinnedCall }

var (
	pinnedCount   atomic.Int32 // pinned callbacks running: Library.use looks them up only then
	pinnedThreads sync.Map     // goroutine id -> *pinnedThread
)

// runPinned runs f as runCallback does, with f's library calls made on the
// calling goroutine's thread.
func runPinned(f func()) error {
	thread := &pinnedThread{calls: make(chan pinnedCall)}
	done := make(chan error, 1)
	pinnedCount.Add(1)
	defer pinnedCount.Add(-1)
	go runCallbackGoroutine(func() {
		id := goroutineID()
		pinnedThreads.Store(id, thread)
		defer pinnedThreads.Delete(id)
		f()
	}, done)
	for {
		select {
		case c := <-thread.calls:
			func() {
				defer func() { c.done <- recover() }()
				c.f()
			}()
		case err := <-done:
			return err
		}
	}
}

// pinnedThreadOf is the thread that makes the calling goroutine's library
// calls, or nil when it is not running a pinned callback.
func pinnedThreadOf() *pinnedThread {
	if pinnedCount.Load() == 0 {
		return nil
	}
	if t, ok := pinnedThreads.Load(goroutineID()); ok {
		return t.(*pinnedThread)
	}
	return nil
}

// run makes f's call on the pinned thread; a panic there comes back here.
func (t *pinnedThread) run(f func()) {
	done := make(chan interface{}, 1)
	t.calls <- pinnedCall{f: f, done: done}
	if p := <-done; p != nil {
		panic(p)
	}
}

// goroutineID reads the calling goroutine's id from its stack header,
// "goroutine 18 [running]:".
func goroutineID() uint64 {
	var buf [64]byte
	text := buf[:runtime.Stack(buf[:], false)]
	const prefix = "goroutine "
	var id uint64
	if len(text) > len(prefix) {
		for _, c := range text[len(prefix):] {
			if c < '0' || c > '9' {
				break
			}
			id = id*10 + uint64(c-'0')
		}
	}
	return id
}
