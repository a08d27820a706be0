package dparallel

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
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
