"""PyTorch on dparallel: replicate(module, group) is DistributedDataParallel
with dparallel's reducer. The parameters, buffers and gradients stay torch
tensors; the library reads and writes their memory in place (no copies)."""
import contextlib
import ctypes

import torch

from . import ProcessGroup, default_group
from ._fsdp import FSDPModule, fully_shard, full_state_dict, load_full_state_dict, load_sharded_state_dict
from ._fsdp import SaveWork, save_full_state_dict, save_sharded_state_dict, save_sharded_state_dict_async
from ._lib import DpError, call, dp_ddp_options, lib
from ._tensors import blob as _blob
from ._tensors import module_device, stream_follower

__all__ = [
    "replicate", "ReplicateModule", "join", "fully_shard", "FSDPModule", "full_state_dict", "save_full_state_dict",
    "load_full_state_dict", "save_sharded_state_dict", "load_sharded_state_dict", "save_sharded_state_dict_async",
    "SaveWork"
]

class _Mirror:
    """A dp_module whose parameters and buffers are the torch module's memory,
    under the same dotted names."""

    def __init__(self, module):
        self.handle = ctypes.c_void_p()
        call("dp_module_create", ctypes.byref(self.handle))
        self._children = {"": self.handle}
        self.params = []  # (name, parameter) in named_parameters order
        try:
            for name, p in module.named_parameters():
                self._register(name, p, True)
                self.params.append((name, p))
            for name, b in module.named_buffers():
                self._register(name, b, False, persistent=self._persistent(module, name))
        except BaseException:
            self.destroy()
            raise

    @staticmethod
    def _persistent(module, name):
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        return leaf not in getattr(sub, "_non_persistent_buffers_set", ())

    def _child(self, path):
        if path in self._children:
            return self._children[path]
        parent_path, _, leaf = path.rpartition(".")
        parent = self._child(parent_path)
        child = ctypes.c_void_p()
        call("dp_module_create", ctypes.byref(child))
        # Kept (and destroyed with the root): a handle is a reference.
        self._children[path] = child
        call("dp_module_register_module", parent, leaf.encode(), child)
        return child

    def _register(self, name, t, is_param, persistent=True):
        owner, _, leaf = name.rpartition(".")
        tensor = _blob(t.detach(), name)
        try:
            if is_param:
                call("dp_module_register_parameter", self._child(owner), leaf.encode(), tensor,
                     int(t.requires_grad))
            else:
                call("dp_module_register_buffer", self._child(owner), leaf.encode(), tensor, int(persistent))
        finally:
            lib.dp_tensor_destroy(tensor)

    def set_grad(self, name, grad):
        tensor = _blob(grad, name + ".grad")
        try:
            call("dp_module_set_grad", self.handle, name.encode(), tensor)
        finally:
            lib.dp_tensor_destroy(tensor)

    def destroy(self):
        for child in self._children.values():
            lib.dp_module_destroy(child)
        self._children = {}
        self.handle = ctypes.c_void_p()


class _ReplicateState:
    def __init__(self, module, group, bucket_cap_mb, broadcast_buffers, find_unused_parameters,
                 gradient_as_bucket_view):
        self.group = group
        self.follow = stream_follower(group.device)
        self.mirror = _Mirror(module)
        self.find_unused = bool(find_unused_parameters)
        self.managed = [(n, p) for n, p in self.mirror.params if p.requires_grad]
        # Torch tensors whose memory the library holds as gradients.
        self.grads = [None] * len(self.managed)
        # Gradients this state allocated before a backward that no mark has
        # touched yet: set back to None when no rank used the parameter.
        self.zeros_only = [False] * len(self.managed)
        self.sync = True
        self.in_backward = False
        self.ddp = ctypes.c_void_p()
        opts = dp_ddp_options()
        call("dp_ddp_options_init", ctypes.byref(opts), ctypes.sizeof(opts))
        opts.bucket_cap_mb = float(bucket_cap_mb)
        opts.broadcast_buffers = int(broadcast_buffers)
        opts.find_unused_parameters = int(find_unused_parameters)
        opts.gradient_as_bucket_view = int(gradient_as_bucket_view)
        # Gradients the host allocates before create are its own memory: the
        # reducer reads and writes them in place.
        with torch.no_grad():
            self._attach_grads()
        try:
            call("dp_ddp_create", ctypes.byref(self.ddp), self.mirror.handle, group.handle, ctypes.byref(opts))
        except BaseException:
            self.mirror.destroy()
            raise
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(self.managed)]
        self.hooks.append(module.register_forward_pre_hook(self._pre_forward))

    def _attach_grads(self):
        """Every managed parameter gets a gradient in torch's memory, which
        autograd accumulates into in place; the library is told of new ones."""
        for i, (name, p) in enumerate(self.managed):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
                p.grad = g
                self.zeros_only[i] = True
            if self.grads[i] is None or self.grads[i].data_ptr() != g.data_ptr() or self.grads[i] is not g:
                self.mirror.set_grad(name, g)
                self.grads[i] = g

    def _pre_forward(self, module, args):
        self._check_alive()
        self.follow()
        with torch.no_grad():
            self._attach_grads()
        call("dp_ddp_pre_forward", self.ddp)

    def _hook(self, index):
        def hook(p):
            if p.grad is not self.grads[index]:
                raise DpError("dp_ddp_mark_grad_ready", -8,
                              f"the gradient of '{self.managed[index][0]}' was replaced during backward "
                              "(run a forward of the replicated module before each backward)")
            self.zeros_only[index] = False
            if not self.in_backward:
                self.in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if p.is_cuda:
                stream = torch.cuda.current_stream(p.device).cuda_stream
                call("dp_ddp_mark_grad_ready_stream", self.ddp, index, ctypes.c_void_p(stream))
            else:
                call("dp_ddp_mark_grad_ready_index", self.ddp, index)

        return hook

    def _finish(self):
        self.in_backward = False
        self.follow()
        call("dp_ddp_finish_backward", self.ddp)
        if self.find_unused and self.sync:
            used = ctypes.c_int()
            for i, (_, p) in enumerate(self.managed):
                if self.zeros_only[i]:
                    call("dp_ddp_parameter_used", self.ddp, i, ctypes.byref(used))
                    if not used.value:
                        # As torch's DDP: a parameter no rank used keeps no gradient.
                        p.grad = None
                        self.grads[i] = None
                    # Else it holds the other ranks' average from now on.
                    self.zeros_only[i] = False

    def rebind(self, group):
        self._check_alive()
        self.follow()
        call("dp_ddp_rebind", self.ddp, group.handle)
        self.group = group

    def set_sync(self, sync):
        self._check_alive()
        call("dp_ddp_set_requires_gradient_sync", self.ddp, int(sync))
        self.sync = bool(sync)

    def _check_alive(self):
        if not self.ddp:
            raise DpError("replicate", -8, "the replicated module was closed")

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.ddp:
            lib.dp_ddp_destroy(self.ddp)
            self.ddp = ctypes.c_void_p()
        self.mirror.destroy()


class ReplicateModule:
    """Mixed into a replicated module's class (as FSDP2's fully_shard does)."""

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate gradients; the next synced one
        reduces the sum."""
        state = self._dp_replicate
        previous = state.sync
        state.set_sync(False)
        try:
            yield
        finally:
            state.set_sync(previous)

    def join(self):
        """This rank has no more inputs: it stands in for the other ranks'
        iterations until every rank has joined; then every rank holds the
        parameters of the rank that ran the most iterations."""
        join(self)

    def dp_rebind(self, group):
        """dp_ddp_rebind: goes on over `group`, another dparallel
        ProcessGroup on the same device (the survivors' after a peer
        failed); every rank of it calls this between iterations. The
        parameters and buffers become its rank 0's, later backwards average
        over its size; the bucket plan and the options are kept."""
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: a dparallel.ProcessGroup is needed, not {type(group).__name__}")
        self._dp_replicate.rebind(group)

    def dp_bucket_count(self):
        return lib.dp_ddp_num_buckets(self._dp_replicate.ddp)

    def dp_close(self):
        """Releases the reducer and removes the hooks; the module stays a
        plain torch module with its current values."""
        self._dp_replicate.close()


def replicate(module, group=None, *, bucket_cap_mb=25.0, broadcast_buffers=True, find_unused_parameters=False,
              gradient_as_bucket_view=False):
    """Data-parallel training of `module` over `group` (a dparallel
    ProcessGroup; None: dparallel.default_group() on the module's device).
    Every rank calls it with equal arguments; parameters and buffers
    start as rank 0's. Returns `module`, changed in place: after each
    backward its gradients hold the average over the ranks. Each backward
    must follow a forward of `module` itself (the forward pre-hook hands
    the gradients' memory to the reducer)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: a torch.nn.Module is needed, not {type(module).__name__}")
    if isinstance(module, ReplicateModule):
        raise ValueError("module: already replicated")
    if group is None:
        group = default_group(module_device(module))
    elif not isinstance(group, ProcessGroup):
        raise TypeError(f"group: a dparallel.ProcessGroup is needed, not {type(group).__name__}")
    state = _ReplicateState(module, group, bucket_cap_mb, broadcast_buffers, find_unused_parameters,
                            gradient_as_bucket_view)
    cls = module.__class__
    module.__class__ = type(f"Replicate{cls.__name__}", (ReplicateModule, cls), {})
    module._dp_replicate = state
    return module


def join(*modules):
    """dp_ddp_join over the replicated `modules` (the same, in the same order,
    on every rank); returns once every rank has joined."""
    if not modules:
        raise ValueError("modules: at least one replicated module is needed")
    handles = []
    for m in modules:
        if not isinstance(m, ReplicateModule):
            raise TypeError(f"modules: {type(m).__name__} is not a replicated module")
        m._dp_replicate._check_alive()
        handles.append(m._dp_replicate.ddp.value)
    array = (ctypes.c_void_p * len(handles))(*handles)
    call("dp_ddp_join", array, len(handles))
