package dparallel

/*
#include "dpgo.h"
*/
import "C"

import (
	"fmt"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// Stream is a queue of device work: a cudaStream_t on a GPU, a queue with a
// thread of its own on a cpu device. Current streams are per OS thread, so
// a goroutine that sets one calls runtime.LockOSThread first.
type Stream struct {
	lib    *Library
	device Device
	mu     sync.Mutex
	p      unsafe.Pointer
	owned  bool
	errs   []error // host functions that failed, for the next Synchronize or Close
	lease  lease   // the calls in flight; Close waits for them
}

// NewStream makes a stream of device; Close destroys it.
func (l *Library) NewStream(device Device) (*Stream, error) {
	p, err := l.deviceStream("dp_stream_create", device,
		func(api *C.dp_api, cd C.dp_device, p *unsafe.Pointer) C.dp_status {
			return C.dpgo_stream_create(api, cd, p)
		})
	if err != nil {
		return nil, err
	}
	return &Stream{lib: l, device: device, p: p, owned: true}, nil
}

// WrapStream is a stream the caller owns (a cudaStream_t from other code,
// or nil for the device's legacy default stream); Close does not destroy
// it.
func (l *Library) WrapStream(device Device, stream unsafe.Pointer) *Stream {
	return &Stream{lib: l, device: device, p: stream}
}

// Pointer is the stream's handle (cudaStream_t on a GPU), for other C code
// and MarkGradReadyStream; nil once closed.
func (s *Stream) Pointer() unsafe.Pointer {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.p
}

// Device is the stream's device; device index -1 for a nil Stream.
func (s *Stream) Device() Device {
	if s == nil {
		return Device{Index: -1}
	}
	return s.device
}

// open runs f with the stream's device and handle, held until f returns
// (Close waits), or is an error for a nil or closed Stream (a closed one
// must not stand for the legacy default stream, which nil means to the
// library).
func (s *Stream) open(op string, f func(cd C.dp_device, p unsafe.Pointer) error) error {
	if s == nil {
		return invalid(op, "argument 's' (the stream) is nil")
	}
	cd, err := cDevice(op, "device", s.device)
	if err != nil {
		return err
	}
	if !s.lease.enter() {
		return &Error{Status: StatusState, Op: op, Message: fmt.Sprintf("the stream (of %v) is closed", s.device)}
	}
	defer s.lease.leave()
	s.mu.Lock()
	p := s.p
	s.mu.Unlock()
	return f(cd, p)
}

func (s *Stream) takeErrors(err error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil && len(s.errs) > 0 {
		err = &Error{Status: StatusUser, Op: "host function", Message: "a host function on the stream failed",
			Cause: s.errs[0]}
	}
	s.errs = nil
	return err
}

// Synchronize returns once the work queued so far is done; a host function
// that failed since the last Synchronize makes it a StatusUser error. From
// a host function on the stream itself, which would wait for itself, it is
// StatusState; on a closed stream too.
func (s *Stream) Synchronize() error {
	const op = "dp_stream_synchronize"
	err := s.open(op, func(cd C.dp_device, p unsafe.Pointer) error {
		return s.lib.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_stream_synchronize(api, cd, p) })
	})
	if s == nil {
		return err
	}
	return s.takeErrors(err)
}

// Close waits for the queued work and destroys a stream from NewStream
// (and clears it as this thread's current stream); failed host functions
// are reported as by Synchronize. A host function may close its own
// stream: the stream then ends after its queued work, without waiting for
// it. Closing twice does nothing; other calls on a closed stream are
// StatusState. Calls in flight on the stream from other goroutines return
// first; from inside a callback, while a call on this stream runs, the
// stream is destroyed when that call returns (and Close reports nothing).
func (s *Stream) Close() error {
	if s == nil {
		return nil
	}
	var err error
	if !s.lease.shut(func() {
		s.mu.Lock()
		p, owned := s.p, s.owned
		s.p, s.owned = nil, false
		s.mu.Unlock()
		if owned && p != nil {
			const op = "dp_stream_destroy"
			var cd C.dp_device
			if cd, err = cDevice(op, "device", s.device); err == nil {
				err = s.lib.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_stream_destroy(api, cd, p) })
			}
		}
	}) {
		return nil
	}
	return s.takeErrors(err)
}

type hostFunc struct {
	stream *Stream
	fn     func()
}

// LaunchHostFunc queues fn on the stream: it runs after the work queued
// before it, and work queued after it waits for it. It must not call CUDA.
// A panic or runtime.Goexit in it is reported by the next Synchronize. Its
// calls into the library are made on the thread running it (as a
// CommHookFunc's are), so calls from goroutines it starts are not; it may
// close its own stream.
func (s *Stream) LaunchHostFunc(fn func()) error {
	const op = "dp_stream_launch_host_func"
	if fn == nil {
		return invalid(op, "argument 'fn' is nil")
	}
	return s.open(op, func(cd C.dp_device, p unsafe.Pointer) error {
		h := cgo.NewHandle(&hostFunc{stream: s, fn: fn})
		err := s.lib.call(op, func(api *C.dp_api) C.dp_status {
			return C.dpgo_stream_launch_host_func(api, cd, p, C.uintptr_t(h))
		})
		if err != nil {
			h.Delete()
		}
		return err
	})
}

//export dpgoHostFunc
func dpgoHostFunc(call C.uintptr_t) {
	h := cgo.Handle(call)
	f := h.Value().(*hostFunc)
	h.Delete()
	// The library knows a host function's calls by the stream's thread:
	// Synchronize of its own stream is refused, not a wait for itself, and
	// Close of it does not wait for it.
	if failure := runPinned(f.fn); failure != nil {
		f.stream.mu.Lock()
		f.stream.errs = append(f.stream.errs, fmt.Errorf("a host function %w", failure))
		f.stream.mu.Unlock()
	}
}

// SetCurrentStream makes stream (a Stream's Pointer, a cudaStream_t, or nil
// for none) current for device on the calling OS thread: later calls on
// this thread that touch the device's tensors order their work after it.
func (l *Library) SetCurrentStream(device Device, stream unsafe.Pointer) error {
	const op = "dp_set_current_stream"
	cd, err := cDevice(op, "device", device)
	if err != nil {
		return err
	}
	return l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_set_current_stream(api, cd, stream) })
}

// CurrentStream is the calling OS thread's current stream for device; nil
// when none is set.
func (l *Library) CurrentStream(device Device) (unsafe.Pointer, error) {
	return l.deviceStream("dp_get_current_stream", device,
		func(api *C.dp_api, cd C.dp_device, p *unsafe.Pointer) C.dp_status {
			return C.dpgo_get_current_stream(api, cd, p)
		})
}

// deviceStream runs op, which answers a stream of device.
func (l *Library) deviceStream(op string, device Device,
	f func(api *C.dp_api, cd C.dp_device, p *unsafe.Pointer) C.dp_status) (unsafe.Pointer, error) {
	cd, err := cDevice(op, "device", device)
	if err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	err = l.call(op, func(api *C.dp_api) C.dp_status { return f(api, cd, &p) })
	return p, err
}
