"""fully_shard for torch modules over dp_fsdp: FSDP2's hooks (unshard before
forward and backward, prefetch, reshard, a mark per gradient) around
dparallel's sharding. The optimizer steps the shards, which are torch
parameters over the library's memory; the full parameters are torch
tensors whose storage exists only while unsharded."""
import ctypes

import torch
from torch.autograd import Variable

from . import DeviceMesh, ProcessGroup, default_group
from ._lib import DpError, call, dp_fsdp_options, lib
from ._tensors import DTYPES, blob, module_device, owned_view, stream_follower

_DP_ESTATE = -8


class _Backward:
    """The states of the forward whose backward is running (one root)."""

    def __init__(self):
        self.root = None  # the state whose forward is running (the outermost)
        self.last_root = None  # the root whose backward is due or running
        self.queued = False


_iteration = _Backward()


class _Param:
    def __init__(self, name, owner, leaf, shard, shard_grad, full):
        self.name = name
        self.owner = owner
        self.leaf = leaf
        self.shard = shard  # nn.Parameter over the library's shard
        self.shard_grad = shard_grad  # torch view of the library's shard gradient
        self.full = full  # nn.Parameter; storage only while unsharded
        self.grad_ref = None  # the full gradient handed to the library


def _mirror(module, handles):
    """A dp_module tree for `module`, reusing the trees of fully_shard
    descendants (their dp_fsdp hold those parameters already)."""
    state = module.__dict__.get("_dp_fsdp")
    if state is not None:
        return state.module_handle
    h = ctypes.c_void_p()
    call("dp_module_create", ctypes.byref(h))
    handles.append(h)
    for name, p in module._parameters.items():
        if p is not None:
            t = blob(p.detach(), name)
            try:
                call("dp_module_register_parameter", h, name.encode(), t, int(p.requires_grad))
            finally:
                lib.dp_tensor_destroy(t)
    for name, b in module._buffers.items():
        if b is not None:
            t = blob(b, name)
            try:
                call("dp_module_register_buffer", h, name.encode(), t,
                     int(name not in module._non_persistent_buffers_set))
            finally:
                lib.dp_tensor_destroy(t)
    for name, child in module._modules.items():
        if child is not None:
            call("dp_module_register_module", h, name.encode(), _mirror(child, handles))
    return h


class _FSDPState:
    def __init__(self, module, group, reshard_after_forward, param_dtype, reduce_dtype, cast_forward_inputs):
        self.group = group
        self.follow = stream_follower(group.device)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.param_dtype = param_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.handles = []
        self.fsdp = ctypes.c_void_p()
        try:
            self.module_handle = _mirror(module, self.handles)
            opts = dp_fsdp_options()
            call("dp_fsdp_options_init", ctypes.byref(opts), ctypes.sizeof(opts))
            opts.reshard_after_forward = int(self.reshard_after_forward)
            opts.param_dtype = -1 if param_dtype is None else DTYPES[param_dtype]
            opts.reduce_dtype = -1 if reduce_dtype is None else DTYPES[reduce_dtype]
            if isinstance(group, DeviceMesh):
                call("dp_fsdp_create_on_mesh", ctypes.byref(self.fsdp), self.module_handle, group.handle,
                     ctypes.byref(opts))
                # State dicts gather over the shard group: the last dimension's.
                self.mesh = group
                self.group = group.group(group.dim_names[-1])
            else:
                call("dp_fsdp_create", ctypes.byref(self.fsdp), self.module_handle, group.handle, ctypes.byref(opts))
            self.params = self._take_parameters(module)
        except BaseException:
            self._release()
            raise
        self.full_ready = False  # the torch full parameters hold the unsharded values
        self.unsharded = False  # an unshard issued since the last post_backward
        self.marked = 0
        self.needs_grad = sum(1 for p in self.params if p.full.requires_grad)
        self.pre_backward_done = False
        self.sync = True  # set_requires_gradient_sync
        self.order = None  # the root's: states in the order their forwards ran
        self.hooks = [module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                      module.register_forward_hook(self._post_forward)]
        for p in self.params:
            if p.full.requires_grad:
                self.hooks.append(p.full.register_post_accumulate_grad_hook(self._mark_hook(p)))

    def _take_parameters(self, module):
        params = []
        for i in range(lib.dp_fsdp_num_parameters(self.fsdp)):
            cname = ctypes.c_char_p()
            call("dp_fsdp_parameter_name", self.fsdp, i, ctypes.byref(cname))
            name = cname.value.decode()
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            original = owner._parameters[leaf]
            h = ctypes.c_void_p()
            call("dp_fsdp_shard", self.fsdp, i, ctypes.byref(h))
            shard = torch.nn.Parameter(owned_view(h), requires_grad=original.requires_grad)
            h = ctypes.c_void_p()
            call("dp_fsdp_shard_grad", self.fsdp, i, ctypes.byref(h))
            shard_grad = owned_view(h)
            dtype = self.param_dtype if self.param_dtype is not None and original.is_floating_point() else original.dtype
            full = torch.nn.Parameter(torch.empty(original.shape, dtype=dtype, device=original.device),
                                      requires_grad=original.requires_grad)
            full.untyped_storage().resize_(0)
            owner._parameters[leaf] = shard
            params.append(_Param(name, owner, leaf, shard, shard_grad, full))
        return params

    # ---- unshard / reshard ----
    def unshard(self, async_op=False):
        call("dp_fsdp_unshard", self.fsdp, int(async_op))
        self.unsharded = True

    def _materialize(self):
        """The library's full parameters copied into the torch ones, whose
        storage comes back (autograd's saved references see it)."""
        if self.full_ready:
            return
        self.unshard()
        call("dp_fsdp_wait_unshard", self.fsdp)
        with torch.no_grad():
            for p in self.params:
                h = ctypes.c_void_p()
                call("dp_module_get_parameter", self.module_handle, p.name.encode(), ctypes.byref(h))
                src = owned_view(h)
                storage = p.full.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(p.full.numel() * p.full.element_size())
                # Through .data: autograd saved this parameter in the forward,
                # and a write it tracked would fail the backward's version check.
                p.full.data.copy_(src)
        self.full_ready = True

    def _free_full(self):
        for p in self.params:
            p.full.untyped_storage().resize_(0)
        self.full_ready = False

    def _register(self, full):
        for p in self.params:
            p.owner._parameters[p.leaf] = p.full if full else p.shard

    # ---- hooks ----
    def _pre_forward(self, module, args, kwargs):
        self._check_alive()
        self.follow()
        root = _iteration.root is None
        if root:
            _iteration.root = self
            _iteration.queued = False
            if self.order is None:
                self.order = []
            self._prepare_shard_grads()
        order = _iteration.root.order
        if order is not None and self not in order:
            order.append(self)
        self._materialize()
        self._register(True)
        self.pre_backward_done = False
        self.marked = 0
        # Prefetch: the next module's all-gather runs during this forward.
        nxt = self._neighbour(+1)
        if nxt is not None and not nxt.full_ready:
            nxt.unshard(async_op=True)
        if self.cast_forward_inputs and self.param_dtype is not None:
            cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return args, kwargs

    def _post_forward(self, module, args, output):
        self.follow()
        self._register(False)
        is_root = _iteration.root is self
        tensors = [t for t in _flatten(output) if torch.is_tensor(t) and t.requires_grad]
        # With no backward to follow (no_grad, inference) the root reshards too.
        if (self.reshard_after_forward and not is_root) or not tensors:
            call("dp_fsdp_reshard", self.fsdp)
            self._free_full()
        if is_root:
            # The next forward of this root starts the next iteration.
            _iteration.root = None
            _iteration.last_root = self
        root_state = self if is_root else None
        for t in tensors:
            t.register_hook(self._pre_backward_hook(root_state))
        return output

    def _pre_backward_hook(self, root_state):
        def hook(grad):
            self.follow()
            if root_state is not None and not _iteration.queued:
                _iteration.queued = True
                Variable._execution_engine.queue_callback(lambda: _finish_backward(root_state))
            if not self.pre_backward_done:
                self.pre_backward_done = True
                self._materialize()
                prev = self._neighbour(-1)
                if prev is not None and not prev.full_ready:
                    prev.unshard(async_op=True)
            return None

        return hook

    def _mark_hook(self, p):
        def hook(full):
            self.follow()
            # The full gradient, in torch's memory, handed to the library as is.
            p.grad_ref = full.grad
            t = blob(full.grad, p.name + ".grad")
            try:
                call("dp_module_set_grad", self.module_handle, p.name.encode(), t)
            finally:
                lib.dp_tensor_destroy(t)
            call("dp_fsdp_mark_grad_ready", self.fsdp, p.name.encode())
            self.marked += 1

        return hook

    def _neighbour(self, step):
        root = _iteration.root or _iteration.last_root
        order = root.order if root is not None else None
        if not order or self not in order:
            return None
        i = order.index(self) + step
        return order[i] if 0 <= i < len(order) else None

    def _prepare_shard_grads(self):
        """Each shard's .grad is the library's shard gradient; a gradient the
        optimizer set to None reads as zeros again."""
        for state in self._tree():
            with torch.no_grad():
                for p in state.params:
                    if not p.shard.requires_grad:
                        continue
                    if p.shard.grad is None:
                        p.shard_grad.zero_()
                    elif p.shard.grad is not p.shard_grad:
                        p.shard_grad.copy_(p.shard.grad)
                    p.shard.grad = p.shard_grad

    def _tree(self):
        return list(self.order) if self.order else [self]

    def end_backward(self):
        self.follow()
        if self.unsharded and self.marked < self.needs_grad:
            # Parameters without a gradient: reduced as zeros.
            call("dp_fsdp_post_backward", self.fsdp)
        if self.unsharded:
            self.unsharded = False
            call("dp_fsdp_finish_backward", self.fsdp)
        self._free_full()
        for p in self.params:
            if self.sync:
                p.full.grad = None
                p.grad_ref = None
            # Else the library keeps the full gradient (this memory) and the
            # next backwards add to it, until a synced one reduces the sum.
            if p.shard.requires_grad:
                p.shard.grad = p.shard_grad

    def _check_alive(self):
        if not self.fsdp:
            raise DpError("fully_shard", _DP_ESTATE, "the module's dp_fsdp was closed")

    def _release(self):
        if self.fsdp:
            lib.dp_fsdp_destroy(self.fsdp)
            self.fsdp = ctypes.c_void_p()
        for h in self.handles:
            lib.dp_module_destroy(h)
        self.handles = []


def _finish_backward(root):
    states = root._tree()
    try:
        for state in reversed(states):
            state.end_backward()
    finally:
        _iteration.last_root = None
        _iteration.queued = False


def _flatten(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _flatten(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _flatten(v)


class FSDPModule:
    """Mixed into a fully_shard module's class, as FSDP2 does."""

    def unshard(self, async_op=False):
        self._dp_fsdp.follow()
        self._dp_fsdp.unshard(async_op)

    def reshard(self):
        self._dp_fsdp.follow()
        call("dp_fsdp_reshard", self._dp_fsdp.fsdp)
        self._dp_fsdp._free_full()

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backwards only accumulate the full gradients (no
        collective); the next synced backward reduces their sum."""
        mods = self.modules() if recurse else [self]
        for m in mods:
            state = m.__dict__.get("_dp_fsdp")
            if state is not None:
                state._check_alive()
                call("dp_fsdp_set_requires_gradient_sync", state.fsdp, int(bool(requires_gradient_sync)))
                state.sync = bool(requires_gradient_sync)


def fully_shard(module, group=None, *, mesh=None, reshard_after_forward=True, mp_policy=None):
    """FSDP2's fully_shard over dparallel: shards `module`'s parameters (those
    no fully_shard descendant holds; shard the children first) across
    `group` (a dparallel ProcessGroup; a DeviceMesh: 2-D is HSDP; None:
    dparallel.default_group() on the module's device). The module's parameters become the shards (build the
    optimizer after this); forward and backward unshard as FSDP2 does.
    mp_policy: torch's MixedPrecisionPolicy or any object with param_dtype,
    reduce_dtype and cast_forward_inputs. `mesh` is FSDP2's name for
    `group`. Returns `module`."""
    if mesh is not None:
        if group is not None:
            raise ValueError("group, mesh: pass one of them")
        group = mesh
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: a torch.nn.Module is needed, not {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError("module: already sharded by fully_shard")
    if group is None:
        group = default_group(module_device(module))
    elif not isinstance(group, (ProcessGroup, DeviceMesh)):
        raise TypeError(f"group: a dparallel.ProcessGroup or DeviceMesh is needed, not {type(group).__name__}")
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
    for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (dt in DTYPES and dt.is_floating_point):
            raise ValueError(f"mp_policy.{what}: {dt} is not a floating dtype dparallel has")
    if param_dtype is not None and reduce_dtype is None:
        # As FSDP2 (PyTorch 2.15): gradients are reduced in the parameters'
        # own dtype unless reduce_dtype says otherwise.
        own = {p.dtype for p in module.parameters() if p.is_floating_point()}
        if len(own) == 1:
            reduce_dtype = own.pop()
    state = _FSDPState(module, group, reshard_after_forward, param_dtype, reduce_dtype,
                       bool(getattr(mp_policy, "cast_forward_inputs", True)))
    cls = module.__class__
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__dict__["_dp_fsdp"] = state
    return module


def _root_state(module):
    state = module.__dict__.get("_dp_fsdp")
    if state is None:
        raise TypeError(f"module: {type(module).__name__} is not a fully_shard module")
    state._check_alive()
    state.follow()
    return state


def full_state_dict(module, rank=None):
    """The unsharded state dict as cpu tensors, on rank `rank` (None: every
    rank; {} elsewhere). Collective over the module's group."""
    state = _root_state(module)
    out = ctypes.c_void_p()
    call("dp_fsdp_full_state_dict", state.module_handle, state.group.handle, -1 if rank is None else int(rank),
         ctypes.byref(out))
    if not out:
        return {}
    result = {}
    try:
        for count, at in (("dp_module_num_parameters", "dp_module_parameter_at"),
                          ("dp_module_num_buffers", "dp_module_buffer_at")):
            for i in range(getattr(lib, count)(out)):
                name = ctypes.c_char_p()
                h = ctypes.c_void_p()
                call(at, out, i, ctypes.byref(name), ctypes.byref(h))
                result[name.value.decode()] = owned_view(h).clone()
    finally:
        lib.dp_module_destroy(out)
    return result


def save_full_state_dict(module, path):
    """Rank 0 writes the unsharded state dict (safetensors) at `path`."""
    state = _root_state(module)
    call("dp_fsdp_save_full_state_dict", state.module_handle, state.group.handle, str(path).encode())


def load_full_state_dict(module, path, strict=True):
    """Every rank reads `path` and keeps its rows of each shard."""
    call("dp_fsdp_load_full_state_dict", _root_state(module).module_handle, str(path).encode(), int(strict))


def save_sharded_state_dict(module, folder):
    state = _root_state(module)
    call("dp_fsdp_save_sharded_state_dict", state.module_handle, state.group.handle, str(folder).encode())


class SaveWork:
    """A sharded save in the background: wait() returns once its files and
    manifest are written and raises DpError when the save failed (on every
    rank alike); done() says whether it has finished."""

    def __init__(self, handle):
        self._handle = handle

    def _live(self):
        if self._handle is None:
            raise ValueError("the save's work is closed")
        return self._handle

    def wait(self):
        call("dp_work_wait", self._live())

    def done(self):
        finished = ctypes.c_int(0)
        call("dp_work_test", self._live(), ctypes.byref(finished))
        return finished.value != 0

    def close(self):
        """Drops the handle; the save goes on."""
        if self._handle is not None:
            lib.dp_work_destroy(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def save_sharded_state_dict_async(module, folder):
    """save_sharded_state_dict in the background (DCP's async_save): copies
    this rank's shards aside and returns a SaveWork; what the model changes
    afterwards is not saved."""
    state = _root_state(module)
    out = ctypes.c_void_p()
    call("dp_fsdp_save_sharded_state_dict_async", state.module_handle, state.group.handle, str(folder).encode(),
         ctypes.byref(out))
    return SaveWork(out.value)


def load_sharded_state_dict(module, folder):
    call("dp_fsdp_load_sharded_state_dict", _root_state(module).module_handle, str(folder).encode())
