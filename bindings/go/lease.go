package dparallel

import "sync"

// lease counts the calls in flight on one handle, so that Close never
// releases a handle under a call on another goroutine: Close shuts the
// lease, waits for those calls, then releases the handle, and every call
// after it fails. The zero value is an open lease.
type lease struct {
	mu      sync.Mutex
	idle    *sync.Cond // made by the first Close that waits
	calls   int
	closed  bool
	release func() // left for the last call in flight (a Close inside a callback)
}

// enter starts a call; false once the lease is shut.
func (l *lease) enter() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.calls++
	return true
}

// leave ends a call; the last one out runs a release a Close left to it.
func (l *lease) leave() {
	l.mu.Lock()
	l.calls--
	var release func()
	if l.calls == 0 {
		if l.idle != nil {
			l.idle.Broadcast()
		}
		release, l.release = l.release, nil
	}
	l.mu.Unlock()
	if release != nil {
		release()
	}
}

// shut closes the lease and runs release once no call is in flight: now,
// after waiting for the calls in flight; or, from inside a callback, where
// the call in flight may be the one running the callback (waiting would
// never end), when the last of them returns. It reports whether release
// ran before shut returned; a second shut does nothing.
func (l *lease) shut(release func()) bool {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return false
	}
	l.closed = true
	if l.calls > 0 && insideCallback() {
		l.release = release
		l.mu.Unlock()
		return false
	}
	for l.calls > 0 {
		if l.idle == nil {
			l.idle = sync.NewCond(&l.mu)
		}
		l.idle.Wait()
	}
	l.mu.Unlock()
	release()
	return true
}

func (l *lease) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// held runs f while holding l: the handle stays valid until f returns. On
// a closed handle it is StatusInvalid, "the <kind> is closed", as the
// library answers for the NULL handle a closed one used to pass.
func held(l *lease, op, kind string, f func() error) error {
	if !l.enter() {
		return invalid(op, "the %s is closed", kind)
	}
	defer l.leave()
	return f()
}

// heldArg holds a handle argument's lease for one call; the returned
// function ends it. A closed argument is an invalid argument, named.
func heldArg(l *lease, op, name, kind string) (func(), error) {
	if !l.enter() {
		return nil, invalid(op, "argument '%s' is a closed %s", name, kind)
	}
	return l.leave, nil
}

// heldArgs are the handle arguments one call holds.
type heldArgs []func()

// hold keeps an argument's lease from Tensor.arg or Module.arg (or its error).
func (a *heldArgs) hold(done func(), err error) error {
	if err != nil {
		return err
	}
	*a = append(*a, done)
	return nil
}

func (a *heldArgs) release() {
	for _, done := range *a {
		done()
	}
	*a = nil
}
