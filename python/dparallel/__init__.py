"""dparallel from Python: process groups over the library's C ABI (ctypes),
and in dparallel.torch the DDP reducer driven by PyTorch's autograd."""
import atexit
import ctypes

from ._lib import DpError, call, dp_device, dp_process_group_options, lib, library_path

__all__ = ["DpError", "DeviceMesh", "ProcessGroup", "default_group", "library_path", "version"]

_BACKENDS = {"auto": 0, "gloo": 1, "nccl": 2, "shm": 3}
_DEVICE_TYPES = {"cpu": 1, "cuda": 2}


def version():
    """The loaded library's version, "major.minor.patch"."""
    n = lib.dp_version_number()
    return f"{n // 10000}.{n // 100 % 100}.{n % 100}"


# The library's own idle threads end before the interpreter's teardown.
atexit.register(lambda: lib.dp_shutdown())


def _device(text):
    kind, _, index = str(text).partition(":")
    if kind not in _DEVICE_TYPES:
        raise ValueError(f"device: {text!r} is neither cpu nor cuda")
    return dp_device(_DEVICE_TYPES[kind], int(index) if index else 0)


class ProcessGroup:
    """A dparallel process group. Rank and world size default to the
    launcher's (dp-run, torchrun, mpirun, srun), the store's address to
    DP_STORE_ADDR/DP_STORE_PORT, else MASTER_ADDR/MASTER_PORT.
    backend: "auto", "gloo", "shm" or "nccl"; device: "cpu" or "cuda:N"."""

    def __init__(self, backend="auto", rank=None, world_size=None, timeout_ms=300000, device="cpu"):
        if backend not in _BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {sorted(_BACKENDS)}")
        opts = dp_process_group_options()
        call("dp_process_group_options_init", ctypes.byref(opts), ctypes.sizeof(opts))
        opts.backend = _BACKENDS[backend]
        opts.rank = -1 if rank is None else int(rank)
        opts.world_size = -1 if world_size is None else int(world_size)
        opts.timeout_ms = int(timeout_ms)
        opts.device = _device(device)
        self.device = str(device)
        handle = ctypes.c_void_p()
        call("dp_process_group_create", ctypes.byref(handle), ctypes.byref(opts))
        self._handle = handle

    @property
    def handle(self):
        if not self._handle:
            raise DpError("ProcessGroup", -8, "the group was destroyed")
        return self._handle

    def rank(self):
        return lib.dp_process_group_rank(self.handle)

    def size(self):
        return lib.dp_process_group_size(self.handle)

    def backend(self):
        """What runs: "gloo", "shm", "nccl" or "shm+gloo"."""
        return lib.dp_process_group_backend(self.handle).decode()

    def barrier(self):
        call("dp_pg_barrier", self.handle)

    def destroy(self):
        """Leaves the group (after its queued collectives); idempotent."""
        if self._handle:
            lib.dp_process_group_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


class _MeshGroup(ProcessGroup):
    """A mesh dimension's group: the mesh owns it (destroy is a no-op)."""

    def __init__(self, mesh, handle, device):
        self._mesh = mesh  # keeps the mesh, which owns the group, alive
        self._handle = handle
        self.device = device

    def destroy(self):
        pass


class DeviceMesh:
    """PyTorch's init_device_mesh over a dparallel group: the group's ranks
    row-major over `shape`, one group per dimension (dim_names, default
    "dim0", "dim1", ...). A collective over `group`. A 2-D mesh gives
    fully_shard HSDP: sharded along dimension 1, replicated along 0."""

    def __init__(self, group, shape, dim_names=None, _handle=None):
        self.device = group.device
        if _handle is not None:
            self._handle = _handle
            return
        shape = [int(x) for x in shape]
        dims = (ctypes.c_int32 * len(shape))(*shape)
        names = None
        if dim_names is not None:
            if len(dim_names) != len(shape):
                raise ValueError(f"dim_names: {len(dim_names)} names for {len(shape)} dimensions")
            names = (ctypes.c_char_p * len(shape))(*[str(n).encode() for n in dim_names])
        handle = ctypes.c_void_p()
        call("dp_device_mesh_create", ctypes.byref(handle), group.handle, dims, len(shape), names)
        self._handle = handle

    @classmethod
    def by_host(cls, group):
        """The 2-D mesh ("host", "local") of the group's hosts."""
        handle = ctypes.c_void_p()
        call("dp_device_mesh_create_by_host", ctypes.byref(handle), group.handle)
        return cls(group, None, _handle=handle)

    @property
    def handle(self):
        if not self._handle:
            raise DpError("DeviceMesh", -8, "the mesh was destroyed")
        return self._handle

    @property
    def ndim(self):
        return lib.dp_device_mesh_ndim(self.handle)

    @property
    def shape(self):
        out = (ctypes.c_int32 * self.ndim)()
        call("dp_device_mesh_shape", self.handle, out, self.ndim)
        return tuple(out)

    @property
    def dim_names(self):
        names = []
        for d in range(self.ndim):
            name = ctypes.c_char_p()
            call("dp_device_mesh_dim_name", self.handle, d, ctypes.byref(name))
            names.append(name.value.decode())
        return tuple(names)

    def group(self, dim_name):
        """The group of dimension `dim_name` (lives as long as the mesh)."""
        handle = ctypes.c_void_p()
        call("dp_device_mesh_group", self.handle, str(dim_name).encode(), ctypes.byref(handle))
        return _MeshGroup(self, handle, self.device)

    def destroy(self):
        if self._handle:
            lib.dp_device_mesh_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
            pass


_default_groups = {}


def default_group(device="cpu"):
    """The group from the launcher's environment for `device`, made on first
    use and shared: every wrapper given no group uses it (one store, one
    rendezvous per process)."""
    group = _default_groups.get(str(device))
    if group is None or not group._handle:
        group = ProcessGroup(device=device)
        _default_groups[str(device)] = group
    return group
