// Package dparallel is the Go binding of dparallel: it loads libdparallel.so
// with dlopen, takes the table of entry points from its one exported lookup,
// dp_get_api, and calls everything through that table. Nothing links against
// the library, so a program picks the library at run time (Open, or Load with
// DP_LIBRARY).
//
// Handles (Tensor, Module, ReplicaSet, Store, ProcessGroup, Work, DDP,
// FSDP, Stream) are released by Close; there are no finalizers, because the
// slices from Tensor.Float32s view the tensor's memory and must not lose it
// behind the program's back.
// Failures come back as *Error, carrying the status code and the library's
// message.
package dparallel

/*
#cgo CFLAGS: -Wall
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "dpgo.h"
*/
import "C"

import (
	"fmt"
	"math"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// abiMajor is the ABI major of the headers this binding is compiled against;
// a library whose table has another major is refused.
const abiMajor = uint32(C.DP_VERSION_MAJOR)

// Status is a dparallel status code. The non-zero ones are errors, so that
// errors.Is(err, dparallel.StatusInvalid) tells what kind of failure err is.
type Status int32

const (
	StatusOK          Status = 0
	StatusInvalid     Status = -1  // bad argument, null handle, shape/dtype/device mismatch
	StatusNoMemory    Status = -2  // an allocation failed
	StatusDevice      Status = -3  // device missing, or a driver failure
	StatusTimeout     Status = -4  // a blocking call ran past its timeout
	StatusRemote      Status = -5  // a peer failed or disconnected
	StatusUser        Status = -6  // a host callback failed
	StatusIO          Status = -7  // file or socket I/O failed, or malformed data
	StatusState       Status = -8  // the call is not valid in the object's current state
	StatusUnsupported Status = -9  // valid request this build or device cannot do
	StatusInternal    Status = -10 // a bug in dparallel
)

var statusNames = map[Status]string{
	StatusOK: "DP_OK", StatusInvalid: "DP_EINVAL", StatusNoMemory: "DP_ENOMEM", StatusDevice: "DP_EDEVICE",
	StatusTimeout: "DP_ETIMEOUT", StatusRemote: "DP_EREMOTE", StatusUser: "DP_EUSER", StatusIO: "DP_EIO",
	StatusState: "DP_ESTATE", StatusUnsupported: "DP_EUNSUPPORTED", StatusInternal: "DP_EINTERNAL",
}

func (s Status) Error() string {
	if name, ok := statusNames[s]; ok {
		return name
	}
	return fmt.Sprintf("dparallel status %d", int32(s))
}

// Error is a failed call: the status, the entry point, dp_last_error()'s
// message, and for a failed forward callback the Go error (or panic) that
// made it fail.
type Error struct {
	Status  Status
	Op      string
	Message string
	Cause   error
}

func (e *Error) Error() string {
	text := "dparallel: " + e.Op + ": " + e.Status.Error()
	if e.Message != "" {
		text += ": " + e.Message
	}
	if e.Cause != nil {
		text += ": " + e.Cause.Error()
	}
	return text
}

func (e *Error) Unwrap() error { return e.Cause }

// Is matches the error's Status: errors.Is(err, dparallel.StatusInvalid).
func (e *Error) Is(target error) bool {
	s, ok := target.(Status)
	return ok && s == e.Status
}

// invalid is a bad argument caught before calling the library.
func invalid(op, format string, args ...interface{}) error {
	return &Error{Status: StatusInvalid, Op: op, Message: fmt.Sprintf(format, args...)}
}

// nilArgument is a nil handle passed as the named argument (a method's
// receiver included).
func nilArgument(op, arg string) error { return invalid(op, "argument '%s' is nil", arg) }

// nilReceiver is a method called on a nil handle: the receiver, named as
// its argument, and its type.
func nilReceiver(op, arg, typ string) error {
	return invalid(op, "argument '%s' (the %s) is nil", arg, typ)
}

// Library is one loaded libdparallel. Its methods, and those of the handles
// made from it, may be called from any goroutine as the C ABI allows. Close
// may be too: it waits for the calls in flight, and every later call, on the
// library or on a handle made from it, is a StatusState error.
type Library struct {
	api    *C.dp_api
	handle unsafe.Pointer
	path   string
	// calls counts the calls in flight, plus closedFlag once Close began.
	calls     atomic.Int64
	drained   chan struct{} // closed once Close began and no call is in flight
	drainOnce sync.Once
	closeMu   sync.Mutex // one Close at a time
}

const closedFlag = int64(1) << 62

// Open loads the library at path (a file name without a slash is searched
// the way dlopen searches) and refuses one whose ABI major differs from this
// binding's.
func Open(path string) (*Library, error) { return openMajor(path, abiMajor) }

// Load opens the library named by the environment variable DP_LIBRARY, or
// libdparallel.so from the loader's search path when it is unset.
func Load() (*Library, error) {
	path := os.Getenv("DP_LIBRARY")
	if path == "" {
		path = "libdparallel.so"
	}
	return Open(path)
}

func openMajor(path string, major uint32) (*Library, error) {
	if path == "" {
		return nil, invalid("Open", "argument 'path' is empty")
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var handle unsafe.Pointer
	var msg [1024]C.char
	api := C.dpgo_open(cpath, C.uint32_t(major), &handle, &msg[0], C.size_t(len(msg)))
	if api == nil {
		return nil, &Error{Status: StatusInvalid, Op: "Open", Message: C.GoString(&msg[0])}
	}
	return &Library{api: api, handle: handle, path: path, drained: make(chan struct{})}, nil
}

// Close ends the library's own threads (dp_shutdown) and unloads it
// (dlclose) once the calls in flight have returned; calls made meanwhile, and after, are StatusState errors. Close
// the handles made from it first: closing one afterwards does nothing, and
// its memory stays with the library. Closing twice does nothing; Close from
// inside a forward, which would wait for itself, is StatusState.
func (l *Library) Close() error {
	if l == nil || l.api == nil {
		return nil
	}
	if insideCallback() {
		return &Error{Status: StatusState, Op: "Close", Message: "called from inside a replica's forward, " +
			"which would wait for itself"}
	}
	l.closeMu.Lock()
	defer l.closeMu.Unlock()
	if l.calls.Load()&closedFlag != 0 {
		return nil
	}
	if l.calls.Add(closedFlag) != closedFlag {
		<-l.drained
	}
	// The library's own threads run its code: they end before it is unloaded.
	if s := C.dpgo_shutdown(l.api); s != 0 {
		return &Error{Status: Status(s), Op: "Close", Message: "dp_shutdown: " + C.GoString(C.dpgo_last_error(l.api)) +
			"; the library stays loaded"}
	}
	var msg [1024]C.char
	if C.dpgo_close(l.handle, &msg[0], C.size_t(len(msg))) != 0 {
		return &Error{Status: StatusInternal, Op: "Close", Message: C.GoString(&msg[0])}
	}
	return nil
}

// use runs f with the entry-point table unless the library is closed. Every
// path into the library goes through here, so that no call uses the table
// after Close and Close never unloads code that a call is running.
func (l *Library) use(op string, f func(api *C.dp_api)) error {
	if l == nil || l.api == nil {
		return &Error{Status: StatusState, Op: op, Message: "library not opened (use Open or Load)"}
	}
	if l.calls.Add(1)&closedFlag != 0 {
		l.leave()
		return &Error{Status: StatusState, Op: op, Message: "library closed"}
	}
	defer l.leave()
	if t := pinnedThreadOf(); t != nil {
		t.run(func() { f(l.api) })
		return nil
	}
	f(l.api)
	return nil
}

// shutHandle shuts l (see lease.shut) and then destroys *h through op,
// unless it was never made, and forgets it.
func shutHandle[H any](l *lease, lib *Library, op string, h **H, destroy func(api *C.dp_api, h *H)) {
	l.shut(func() {
		if *h != nil {
			lib.use(op, func(api *C.dp_api) { destroy(api, *h) })
		}
		*h = nil
	})
}

// heldCount is n's answer through lib while l is held; 0 when the handle
// or the library is closed.
func heldCount(l *lease, lib *Library, op, kind string, n func(api *C.dp_api) int) (count int) {
	held(l, op, kind, func() error {
		return lib.use(op, func(api *C.dp_api) { count = n(api) })
	})
	return count
}

func (l *Library) leave() {
	if l.calls.Add(-1) == closedFlag {
		l.drainOnce.Do(func() { close(l.drained) })
	}
}

// Path is the file name the library was opened with.
func (l *Library) Path() string {
	if l == nil {
		return ""
	}
	return l.path
}

// ABI is the major and minor version of the library's entry-point table;
// zeros once closed.
func (l *Library) ABI() (major, minor uint32) {
	l.use("ABI", func(api *C.dp_api) { major, minor = uint32(api.abi_major), uint32(api.abi_minor) })
	return major, minor
}

// Version is the library's version number, major*10000 + minor*100 + patch;
// 0 once closed.
func (l *Library) Version() (version uint32) {
	l.use("dp_version_number", func(api *C.dp_api) { version = uint32(C.dpgo_version_number(api)) })
	return version
}

// call runs one fallible entry point (f may call several, returning the
// first failure). The library's last error is per thread, so the goroutine
// stays on its thread until the message is read.
func (l *Library) call(op string, f func(api *C.dp_api) C.dp_status) error {
	var err error
	if useErr := l.use(op, func(api *C.dp_api) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if s := f(api); s != 0 {
			err = &Error{Status: Status(s), Op: op, Message: C.GoString(C.dpgo_last_error(api))}
		}
	}); useErr != nil {
		return useErr
	}
	return err
}

// DeviceType is where a device's memory lives.
type DeviceType int32

const (
	DeviceCPU  DeviceType = 1
	DeviceCUDA DeviceType = 2
)

// Device is a logical CPU device ("cpu:1": its own allocations and worker
// thread) or a GPU ("cuda:0").
type Device struct {
	Type  DeviceType
	Index int
}

// CPU is the logical CPU device cpu:index.
func CPU(index int) Device { return Device{DeviceCPU, index} }

func (d Device) String() string {
	switch d.Type {
	case DeviceCPU:
		return fmt.Sprintf("cpu:%d", d.Index)
	case DeviceCUDA:
		return fmt.Sprintf("cuda:%d", d.Index)
	}
	return fmt.Sprintf("device(%d):%d", int32(d.Type), d.Index)
}

// cInt32 is v for an int32_t argument of the library, or an error naming
// the argument when it does not fit (never a silent truncation).
func cInt32(op, arg string, v int) (C.int32_t, error) {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, invalid(op, "argument '%s' (%d) does not fit in int32", arg, v)
	}
	return C.int32_t(v), nil
}

// cDevice is d for the library; an index that does not fit in int32 is an
// error naming the argument.
func cDevice(op, arg string, d Device) (C.dp_device, error) {
	if d.Index < math.MinInt32 || d.Index > math.MaxInt32 {
		return C.dp_device{}, invalid(op, "argument '%s' has device index %d, which does not fit in int32", arg,
			d.Index)
	}
	return C.dp_device{_type: C.int32_t(d.Type), index: C.int32_t(d.Index)}, nil
}

func goDevice(d C.dp_device) Device { return Device{DeviceType(d._type), int(d.index)} }

// cDevices converts a list of devices; arg names the list.
func cDevices(op, arg string, devices []Device) ([]C.dp_device, error) {
	out := make([]C.dp_device, len(devices))
	for i, d := range devices {
		if d.Index < math.MinInt32 || d.Index > math.MaxInt32 {
			return nil, invalid(op, "argument '%s'[%d] has device index %d, which does not fit in int32", arg, i,
				d.Index)
		}
		out[i] = C.dp_device{_type: C.int32_t(d.Type), index: C.int32_t(d.Index)}
	}
	return out, nil
}

// ParseDevice reads "cpu", "cpu:3", "cuda", "cuda:1".
func (l *Library) ParseDevice(text string) (Device, error) {
	ctext := C.CString(text)
	defer C.free(unsafe.Pointer(ctext))
	var d C.dp_device
	err := l.call("dp_device_parse", func(api *C.dp_api) C.dp_status { return C.dpgo_device_parse(api, ctext, &d) })
	return goDevice(d), err
}

// FormatDevice is the library's text for d ("cpu:3").
func (l *Library) FormatDevice(d Device) (string, error) {
	const op = "dp_device_format"
	cd, err := cDevice(op, "d", d)
	if err != nil {
		return "", err
	}
	var buf [64]C.char
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_device_format(api, cd, &buf[0], C.size_t(len(buf)))
	})
	if err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// DeviceCount is the number of devices of a type: GPUs present, or the
// logical CPU devices allowed (DP_NUM_CPU_DEVICES, default 64).
func (l *Library) DeviceCount(t DeviceType) (int, error) {
	var n C.int32_t
	err := l.call("dp_device_count", func(api *C.dp_api) C.dp_status { return C.dpgo_device_count(api, C.int32_t(t), &n) })
	return int(n), err
}

// StatusString is the library's static text for a status code; "" once
// closed.
func (l *Library) StatusString(s Status) (text string) {
	l.use("dp_status_string", func(api *C.dp_api) { text = C.GoString(C.dpgo_status_string(api, C.dp_status(s))) })
	return text
}

// DTypeSize is the size of one element in bytes; 0 for an unknown dtype or
// a closed library.
func (l *Library) DTypeSize(dtype DType) (n int) {
	l.use("dp_dtype_size", func(api *C.dp_api) { n = int(C.dpgo_dtype_size(api, C.int32_t(dtype))) })
	return n
}

// MemoryStats is what the library allocated for a device's tensors, in
// bytes (memory lent through TensorFromBlob or DLPack is not counted).
type MemoryStats struct {
	Allocated     uint64 // in use now
	PeakAllocated uint64 // the most in use at once since the last ResetPeakMemory
	Cached        uint64 // freed blocks kept for reuse, all devices together
}

func (l *Library) MemoryStats(d Device) (MemoryStats, error) {
	const op = "dp_device_memory_stats"
	cd, err := cDevice(op, "d", d)
	if err != nil {
		return MemoryStats{}, err
	}
	var out C.dp_memory_stats
	out.struct_size = C.size_t(unsafe.Sizeof(out))
	err = l.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_device_memory_stats(api, cd, &out)
	})
	return MemoryStats{uint64(out.allocated_bytes), uint64(out.peak_allocated_bytes), uint64(out.cached_bytes)}, err
}

// ResetPeakMemory starts MemoryStats' PeakAllocated afresh from what is in
// use now.
func (l *Library) ResetPeakMemory(d Device) error {
	const op = "dp_device_reset_peak_memory"
	cd, err := cDevice(op, "d", d)
	if err != nil {
		return err
	}
	return l.call(op, func(api *C.dp_api) C.dp_status { return C.dpgo_device_reset_peak_memory(api, cd) })
}

// Shutdown ends the threads the library keeps for itself (device workers,
// compute pool), each after what it has queued; a later call that needs
// them starts them again. Close calls it. From inside a callback it would
// wait for the thread running it: StatusState.
func (l *Library) Shutdown() error {
	if insideCallback() {
		return &Error{Status: StatusState, Op: "dp_shutdown", Message: "called from inside a callback, whose thread " +
			"it would wait for"}
	}
	return l.call("dp_shutdown", func(api *C.dp_api) C.dp_status { return C.dpgo_shutdown(api) })
}
