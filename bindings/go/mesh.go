package dparallel

// #include <stdlib.h>
// #include "dpgo.h"
import "C"

import (
	"unsafe"
)

// LocalRank is this rank's index among the group's ranks on its host, as the
// group's creation learnt them; -1 on a closed group or library.
func (pg *ProcessGroup) LocalRank() int {
	return pg.hostCount("dp_process_group_local_rank", func(api *C.dp_api) C.int32_t {
		return C.dpgo_process_group_local_rank(api, pg.h)
	})
}

// LocalSize is how many of the group's ranks run on this host; -1 on a
// closed group or library.
func (pg *ProcessGroup) LocalSize() int {
	return pg.hostCount("dp_process_group_local_size", func(api *C.dp_api) C.int32_t {
		return C.dpgo_process_group_local_size(api, pg.h)
	})
}

// NumHosts is how many hosts the group spans; -1 on a closed group or library.
func (pg *ProcessGroup) NumHosts() int {
	return pg.hostCount("dp_process_group_num_hosts", func(api *C.dp_api) C.int32_t {
		return C.dpgo_process_group_num_hosts(api, pg.h)
	})
}

// Abort aborts the group, from any goroutine, also while another's call on
// it runs: every later call fails (DP_ESTATE, "aborted"), and the peers'
// next calls fail rather than wait for their timeout; a running call fails
// at once on shared memory, NCCL and MPI, at its deadline on Gloo (dp_dist.h).
// Close is still needed.
func (pg *ProcessGroup) Abort() error {
	return pg.call("dp_process_group_abort", func(api *C.dp_api) C.dp_status {
		return C.dpgo_process_group_abort(api, pg.h)
	})
}

// Shrink is called by every survivor after a peer's failure: they agree on
// who is left and each gets a new group of the survivors in their old
// order (dp_dist.h). pg is left as it was; Close it.
func (pg *ProcessGroup) Shrink() (*ProcessGroup, error) {
	var h *C.dp_process_group
	err := pg.call("dp_process_group_shrink", func(api *C.dp_api) C.dp_status {
		return C.dpgo_process_group_shrink(api, pg.h, &h)
	})
	if err != nil {
		return nil, err
	}
	return &ProcessGroup{lib: pg.lib, h: h}, nil
}

// LostRanks lists the ranks pg's last Shrink left out (for a group made by
// Shrink: those left out of the group it came from).
func (pg *ProcessGroup) LostRanks() ([]int, error) {
	var ranks []int
	err := pg.call("dp_process_group_lost_ranks", func(api *C.dp_api) C.dp_status {
		n := C.dpgo_process_group_lost_ranks(api, pg.h, nil, 0)
		if n < 0 {
			return C.DP_EINVAL // an invalid handle: the call set the message
		}
		buf := make([]C.int32_t, int(n)+1)
		got := C.dpgo_process_group_lost_ranks(api, pg.h, &buf[0], C.size_t(n))
		if got < 0 {
			return C.DP_EINVAL
		}
		if got > n {
			got = n
		}
		ranks = make([]int, 0, int(got))
		for _, r := range buf[:got] {
			ranks = append(ranks, int(r))
		}
		return C.DP_OK
	})
	return ranks, err
}

func (pg *ProcessGroup) hostCount(op string, f func(api *C.dp_api) C.int32_t) int {
	n := -1
	if pg == nil {
		return n
	}
	pg.use(op, func(api *C.dp_api) { n = int(f(api)) })
	return n
}

// Split is collective over pg (MPI_Comm_split): the ranks passing the same
// color >= 0 form a new group ranked by (key, rank in pg); a negative color
// joins none (nil, nil). The new group has pg's timeout and device and
// chooses its backend as any group does; opts (may be nil) sets its
// Backend, Timeout and Device instead (its Store is not used).
func (pg *ProcessGroup) Split(color, key int, opts *ProcessGroupOptions) (*ProcessGroup, error) {
	const op = "dp_process_group_split"
	ccolor, err := cInt32(op, "color", color)
	if err != nil {
		return nil, err
	}
	ckey, err := cInt32(op, "key", key)
	if err != nil {
		return nil, err
	}
	var copts *C.dp_process_group_options
	if opts != nil {
		copts = new(C.dp_process_group_options)
		err = pg.call("dp_process_group_options_init", func(api *C.dp_api) C.dp_status {
			return C.dpgo_process_group_options_init(api, copts, C.size_t(unsafe.Sizeof(*copts)))
		})
		if err != nil {
			return nil, err
		}
		if err = opts.apply(op, copts); err != nil {
			return nil, err
		}
	}
	var h *C.dp_process_group
	err = pg.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_process_group_split(api, pg.h, ccolor, ckey, copts, &h)
	})
	if err != nil || h == nil {
		return nil, err
	}
	return &ProcessGroup{lib: pg.lib, h: h}, nil
}

// DeviceMesh is a group's ranks laid out as an n-dimensional array with one
// group per dimension (PyTorch's init_device_mesh). Its groups are borrowed
// from it: Close closes them too.
type DeviceMesh struct {
	lib    *Library
	h      *C.dp_device_mesh
	lease  lease
	names  []string
	groups []*ProcessGroup
}

// NewDeviceMesh lays pg's ranks out row-major over shape (its product the
// world size), the dimensions named names (nil: "dim0", "dim1", ...).
// Collective over pg.
func NewDeviceMesh(pg *ProcessGroup, shape []int, names []string) (*DeviceMesh, error) {
	const op = "dp_device_mesh_create"
	if pg == nil {
		return nil, invalid(op, "argument 'pg' is nil")
	}
	if names != nil && len(names) != len(shape) {
		return nil, invalid(op, "argument 'names' has %d names for %d dimensions", len(names), len(shape))
	}
	extents := make([]C.int32_t, len(shape))
	for i, n := range shape {
		var err error
		if extents[i], err = cInt32(op, "shape", n); err != nil {
			return nil, err
		}
	}
	var cnames []*C.char
	for _, name := range names {
		cname := C.CString(name)
		defer C.free(unsafe.Pointer(cname))
		cnames = append(cnames, cname)
	}
	done, err := pg.arg(op, "pg")
	if err != nil {
		return nil, err
	}
	defer done()
	var h *C.dp_device_mesh
	err = pg.lib.call(op, func(api *C.dp_api) C.dp_status {
		var pshape *C.int32_t
		if len(extents) > 0 {
			pshape = &extents[0]
		}
		var pnames **C.char
		if len(cnames) > 0 {
			// Held in C memory: cgo may not pass Go memory holding Go pointers.
			pnames = (**C.char)(C.malloc(C.size_t(len(cnames)) * C.size_t(unsafe.Sizeof(cnames[0]))))
			defer C.free(unsafe.Pointer(pnames))
			copy(unsafe.Slice(pnames, len(cnames)), cnames)
		}
		return C.dpgo_device_mesh_create(api, &h, pg.h, pshape, C.size_t(len(extents)), pnames)
	})
	if err != nil {
		return nil, err
	}
	return adoptMesh(pg.lib, h)
}

// DeviceMeshByHost is the 2-D mesh ("host", "local") of pg's hosts: one row
// per host, "local" joining this rank's host. Collective over pg.
func DeviceMeshByHost(pg *ProcessGroup) (*DeviceMesh, error) {
	const op = "dp_device_mesh_create_by_host"
	if pg == nil {
		return nil, invalid(op, "argument 'pg' is nil")
	}
	done, err := pg.arg(op, "pg")
	if err != nil {
		return nil, err
	}
	defer done()
	var h *C.dp_device_mesh
	err = pg.lib.call(op, func(api *C.dp_api) C.dp_status {
		return C.dpgo_device_mesh_create_by_host(api, &h, pg.h)
	})
	if err != nil {
		return nil, err
	}
	return adoptMesh(pg.lib, h)
}

// adoptMesh wraps h with its dimensions' names and borrowed groups.
func adoptMesh(lib *Library, h *C.dp_device_mesh) (*DeviceMesh, error) {
	m := &DeviceMesh{lib: lib, h: h}
	var ndim int
	lib.use("dp_device_mesh_ndim", func(api *C.dp_api) { ndim = int(C.dpgo_device_mesh_ndim(api, h)) })
	for d := 0; d < ndim; d++ {
		var name *C.char
		var group *C.dp_process_group
		err := lib.call("dp_device_mesh_dim_name", func(api *C.dp_api) C.dp_status {
			if s := C.dpgo_device_mesh_dim_name(api, h, C.size_t(d), &name); s != 0 {
				return s
			}
			return C.dpgo_device_mesh_group(api, h, name, &group)
		})
		if err != nil {
			m.Close()
			return nil, err
		}
		m.names = append(m.names, C.GoString(name))
		m.groups = append(m.groups, &ProcessGroup{lib: lib, h: group, borrowed: true})
	}
	return m, nil
}

// Ndim is the number of dimensions; 0 once closed.
func (m *DeviceMesh) Ndim() int {
	if m == nil || !m.lease.enter() {
		return 0
	}
	defer m.lease.leave()
	return len(m.names)
}

// DimNames are the dimensions' names, in order; nil once closed.
func (m *DeviceMesh) DimNames() []string {
	if m == nil || !m.lease.enter() {
		return nil
	}
	defer m.lease.leave()
	return append([]string(nil), m.names...)
}

// Shape is the extent of each dimension.
func (m *DeviceMesh) Shape() ([]int, error) {
	return m.ints("dp_device_mesh_shape", func(api *C.dp_api, out *C.int32_t, n C.size_t) C.dp_status {
		return C.dpgo_device_mesh_shape(api, m.h, out, n)
	})
}

// Coordinate is this rank's coordinate along each dimension (its rank in
// that dimension's group).
func (m *DeviceMesh) Coordinate() ([]int, error) {
	return m.ints("dp_device_mesh_coordinate", func(api *C.dp_api, out *C.int32_t, n C.size_t) C.dp_status {
		return C.dpgo_device_mesh_coordinate(api, m.h, out, n)
	})
}

func (m *DeviceMesh) ints(op string, f func(api *C.dp_api, out *C.int32_t, n C.size_t) C.dp_status) ([]int, error) {
	if m == nil {
		return nil, nilReceiver(op, "mesh", "*DeviceMesh")
	}
	var values []int
	err := held(&m.lease, op, "device mesh", func() error {
		out := make([]C.int32_t, len(m.names))
		err := m.lib.call(op, func(api *C.dp_api) C.dp_status { return f(api, &out[0], C.size_t(len(out))) })
		for _, v := range out {
			values = append(values, int(v))
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return values, nil
}

// Group is the group of the dimension name, borrowed from the mesh: valid
// until the mesh's Close, and its own Close does nothing.
func (m *DeviceMesh) Group(name string) (*ProcessGroup, error) {
	const op = "dp_device_mesh_group"
	if m == nil {
		return nil, nilReceiver(op, "mesh", "*DeviceMesh")
	}
	var group *ProcessGroup
	err := held(&m.lease, op, "device mesh", func() error {
		for i, n := range m.names {
			if n == name {
				group = m.groups[i]
				return nil
			}
		}
		// The library's error names the dimension and lists the mesh's.
		cname := C.CString(name)
		defer C.free(unsafe.Pointer(cname))
		var h *C.dp_process_group
		if err := m.lib.call(op, func(api *C.dp_api) C.dp_status {
			return C.dpgo_device_mesh_group(api, m.h, cname, &h)
		}); err != nil {
			return err
		}
		return invalid(op, "argument 'name': the mesh has no dimension '%s'", name)
	})
	return group, err
}

// Close waits for the calls in flight on the mesh and on its groups, then
// leaves the groups and frees the mesh; later calls on either fail as
// closed.
func (m *DeviceMesh) Close() {
	if m == nil {
		return
	}
	for _, g := range m.groups {
		shutHandle(&g.lease, m.lib, "dp_device_mesh_destroy", &g.h, func(*C.dp_api, *C.dp_process_group) {})
	}
	shutHandle(&m.lease, m.lib, "dp_device_mesh_destroy", &m.h, func(api *C.dp_api, h *C.dp_device_mesh) {
		C.dpgo_device_mesh_destroy(api, h)
	})
}
