package dparallel

/*
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import (
	"errors"
	"math"
	"time"
	"unsafe"
)

// Store is a key-value store the ranks of a job share (c10d's contract): a
// file every rank sees, or a TCP server. Safe for use from many goroutines.
type Store struct {
	lib   *Library
	h     *C.dp_store
	lease lease // the calls in flight; Close waits for them
}

// milliseconds converts a timeout for the library, which takes int32 ms.
func milliseconds(op, arg string, d time.Duration) (C.int32_t, error) {
	ms := d.Milliseconds()
	if d > 0 && ms == 0 {
		ms = 1
	}
	if ms > math.MaxInt32 || ms < math.MinInt32 {
		return 0, invalid(op, "argument '%s' (%v) does not fit in int32 milliseconds", arg, d)
	}
	return C.int32_t(ms), nil
}

// NewFileStore opens the store in the file at path (created when missing)
// for worldSize users; the last to close it removes the file. Get and Wait
// time out after 300 s unless SetTimeout says otherwise.
func (l *Library) NewFileStore(path string, worldSize int) (*Store, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	const op = "dp_store_create_file"
	world, err := cInt32(op, "worldSize", worldSize)
	if err != nil {
		return nil, err
	}
	var h *C.dp_store
	err = l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_store_create_file(api, &h, cpath, world) })
	if err != nil {
		return nil, err
	}
	return &Store{lib: l, h: h}, nil
}

// NewTCPStore connects to the TCP store at host:port, or with isServer
// serves it there (port 0 picks a free one: Port says which) and connects
// too. The server's call returns once worldSize handles (its own included)
// have connected. timeout bounds the connection, each request, and is the
// default of Get and Wait.
func (l *Library) NewTCPStore(host string, port uint16, worldSize int, isServer bool,
	timeout time.Duration) (*Store, error) {
	const op = "dp_store_create_tcp"
	ms, err := milliseconds(op, "timeout", timeout)
	if err != nil {
		return nil, err
	}
	world, err := cInt32(op, "worldSize", worldSize)
	if err != nil {
		return nil, err
	}
	chost := C.CString(host)
	defer C.free(unsafe.Pointer(chost))
	var h *C.dp_store
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_store_create_tcp(api, &h, chost, C.uint16_t(port), world, cbool(isServer), ms)
	})
	if err != nil {
		return nil, err
	}
	return &Store{lib: l, h: h}, nil
}

// call is lib.call on a store that may be nil.
func (s *Store) call(op string, f func(api *C.dp_api) C.dp_status) error {
	if s == nil {
		return nilReceiver(op, "s", "*Store")
	}
	return held(&s.lease, op, "store", func() error { return s.lib.call(op, f) })
}

// Close drops this handle once the calls in flight on it (from other
// goroutines) have returned; a process group made with the store holds its
// own reference.
func (s *Store) Close() {
	if s == nil {
		return
	}
	shutHandle(&s.lease, s.lib, "dp_store_destroy", &s.h, func(api *C.dp_api, h *C.dp_store) {
		C.dpgo_store_destroy(api, h)
	})
}

// Set stores value under key; the last set wins.
func (s *Store) Set(key string, value []byte) error {
	ckey := C.CString(key)
	defer C.free(unsafe.Pointer(ckey))
	var p unsafe.Pointer
	if len(value) > 0 {
		p = unsafe.Pointer(&value[0])
	}
	return s.call("dp_store_set", func(api *C.dp_api) C.dp_status {
		return C.dpgo_store_set(api, s.h, ckey, p, C.size_t(len(value)))
	})
}

// Get waits up to the store's timeout for key, then returns its value.
func (s *Store) Get(key string) ([]byte, error) {
	const op = "dp_store_get"
	ckey := C.CString(key)
	defer C.free(unsafe.Pointer(ckey))
	buf := make([]byte, 256)
	for {
		var n C.size_t
		err := s.call(op, func(api *C.dp_api) C.dp_status {
			return C.dpgo_store_get(api, s.h, ckey, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), &n)
		})
		if err == nil {
			return buf[:n], nil
		}
		if !errors.Is(err, StatusInvalid) {
			return nil, err
		}
		// Too small a buffer, or another bad argument: the length says which.
		var need C.size_t
		if s.call(op, func(api *C.dp_api) C.dp_status {
			return C.dpgo_store_get(api, s.h, ckey, nil, 0, &need)
		}) != nil || int(need) <= len(buf) {
			return nil, err
		}
		buf = make([]byte, need) // the value may grow again meanwhile: retry
	}
}

// Add adds delta to the integer at key (0 when absent) and returns the new
// value.
func (s *Store) Add(key string, delta int64) (int64, error) {
	ckey := C.CString(key)
	defer C.free(unsafe.Pointer(ckey))
	var out C.int64_t
	err := s.call("dp_store_add", func(api *C.dp_api) C.dp_status {
		return C.dpgo_store_add(api, s.h, ckey, C.int64_t(delta), &out)
	})
	return int64(out), err
}

// Wait returns once every key exists: StatusTimeout naming the missing ones
// after timeout; a negative timeout means the store's.
func (s *Store) Wait(keys []string, timeout time.Duration) error {
	const op = "dp_store_wait"
	if len(keys) == 0 {
		return invalid(op, "argument 'keys' is empty")
	}
	ms, err := milliseconds(op, "timeout", timeout)
	if err != nil {
		return err
	}
	if timeout < 0 {
		ms = -1
	}
	ckeys := make([]*C.char, len(keys))
	for i, k := range keys {
		ckeys[i] = C.CString(k)
		defer C.free(unsafe.Pointer(ckeys[i]))
	}
	return s.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_store_wait(api, s.h, &ckeys[0], C.size_t(len(keys)), ms)
	})
}

// SetTimeout sets the default timeout of Get and Wait (and of each TCP
// request).
func (s *Store) SetTimeout(timeout time.Duration) error {
	const op = "dp_store_set_timeout"
	ms, err := milliseconds(op, "timeout", timeout)
	if err != nil {
		return err
	}
	return s.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_store_set_timeout(api, s.h, ms) })
}

// Port is the port a TCP store serves or is connected to; StatusInvalid for
// a file store.
func (s *Store) Port() (uint16, error) {
	var port C.uint16_t
	err := s.call("dp_store_tcp_port", func(api *C.dp_api) C.dp_status {
		return C.dpgo_store_tcp_port(api, s.h, &port)
	})
	return uint16(port), err
}
