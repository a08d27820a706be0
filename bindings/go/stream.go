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
	p      unsafe.Pointer
	owned  bool
	mu     sync.Mutex
	errs   []error // host functions that failed, for the next Synchronize or Close
}

// NewStream makes a stream of device; Close destroys it.
func (l *Library) NewStream(device Device) (*Stream, error) {
	var p unsafe.Pointer
	err := l.call("dp_stream_create", func(api *C.dp_api) C.dp_status { return C.dpgo_stream_create(api, device.c(), &p) })
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
// and MarkGradReadyStream.
func (s *Stream) Pointer() unsafe.Pointer { return s.p }

func (s *Stream) Device() Device { return s.device }

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
// that failed since the last Synchronize makes it a StatusUser error.
func (s *Stream) Synchronize() error {
	err := s.lib.call("dp_stream_synchronize", func(api *C.dp_api) C.dp_status {
		return C.dpgo_stream_synchronize(api, s.device.c(), s.p)
	})
	return s.takeErrors(err)
}

// Close waits for the queued work and destroys a stream from NewStream
// (and clears it as this thread's current stream); failed host functions
// are reported as by Synchronize.
func (s *Stream) Close() error {
	if s == nil {
		return nil
	}
	var err error
	if s.owned && s.p != nil {
		err = s.lib.call("dp_stream_destroy", func(api *C.dp_api) C.dp_status {
			return C.dpgo_stream_destroy(api, s.device.c(), s.p)
		})
		s.p, s.owned = nil, false
	}
	return s.takeErrors(err)
}

type hostFunc struct {
	stream *Stream
	fn     func()
}

// LaunchHostFunc queues fn on the stream: it runs after the work queued
// before it, and work queued after it waits for it. It must not call CUDA.
// A panic or runtime.Goexit in it is reported by the next Synchronize.
func (s *Stream) LaunchHostFunc(fn func()) error {
	const op = "dp_stream_launch_host_func"
	if fn == nil {
		return invalid(op, "argument 'fn' is nil")
	}
	h := cgo.NewHandle(&hostFunc{stream: s, fn: fn})
	err := s.lib.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_stream_launch_host_func(api, s.device.c(), s.p, C.uintptr_t(h))
	})
	if err != nil {
		h.Delete()
	}
	return err
}

//export dpgoHostFunc
func dpgoHostFunc(call C.uintptr_t) {
	var f *hostFunc
	failure := runCallback(func() {
		h := cgo.Handle(call)
		defer h.Delete()
		f = h.Value().(*hostFunc)
		f.fn()
	})
	if failure != nil && f != nil {
		f.stream.mu.Lock()
		f.stream.errs = append(f.stream.errs, fmt.Errorf("a host function %w", failure))
		f.stream.mu.Unlock()
	}
}

// SetCurrentStream makes stream (a Stream's Pointer, a cudaStream_t, or nil
// for none) current for device on the calling OS thread: later calls on
// this thread that touch the device's tensors order their work after it.
func (l *Library) SetCurrentStream(device Device, stream unsafe.Pointer) error {
	return l.call("dp_set_current_stream", func(api *C.dp_api) C.dp_status {
		return C.dpgo_set_current_stream(api, device.c(), stream)
	})
}

// CurrentStream is the calling OS thread's current stream for device; nil
// when none is set.
func (l *Library) CurrentStream(device Device) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := l.call("dp_get_current_stream", func(api *C.dp_api) C.dp_status {
		return C.dpgo_get_current_stream(api, device.c(), &p)
	})
	return p, err
}
