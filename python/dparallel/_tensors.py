"""Torch tensors and dp_tensors over the same memory, both ways."""
import ctypes

import torch
import torch.utils.dlpack

from ._lib import call, dp_device, lib

DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 8,
}


def dp_device_of(t):
    if t.device.type == "cpu":
        return dp_device(1, 0)
    if t.device.type == "cuda":
        return dp_device(2, t.device.index or 0)
    raise ValueError(f"a tensor on {t.device}: dparallel takes cpu and cuda tensors")


def module_device(module):
    """"cpu" or "cuda:N": where `module`'s first parameter lies (cpu for a
    module without any)."""
    first = next(module.parameters(), None)
    return "cpu" if first is None or first.device.type == "cpu" else f"cuda:{first.device.index or 0}"


def stream_follower(device):
    """A function that makes torch's current stream on `device` ("cpu",
    "cuda:N") dparallel's current stream there, on the calling thread: the
    library's work then starts after what torch queued on it, and torch's
    next work there follows the library's, with no wait on the host (torch's
    legacy default stream: the calls wait). Does nothing for cpu."""
    kind, _, index = str(device).partition(":")
    if kind != "cuda":
        return lambda: None
    torch_device = torch.device("cuda", int(index or 0))
    target = dp_device(2, torch_device.index)

    def follow():
        stream = torch.cuda.current_stream(torch_device).cuda_stream
        call("dp_set_current_stream", target, ctypes.c_void_p(stream or None))

    return follow


def blob(t, what):
    """A dp_tensor over `t`'s memory (the caller keeps `t` alive)."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{what}: dtype {t.dtype} has no dparallel dtype")
    if not t.is_contiguous():
        raise ValueError(f"{what}: dparallel needs contiguous tensors")
    shape = (ctypes.c_int64 * max(t.dim(), 1))(*t.shape)
    handle = ctypes.c_void_p()
    call("dp_tensor_from_blob", ctypes.byref(handle), ctypes.c_void_p(t.data_ptr() or None), DTYPES[t.dtype],
         t.dim(), shape, dp_device_of(t), None, None)
    return handle


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def view(handle):
    """A torch tensor over a dp_tensor's memory (DLPack, no copy); the
    memory lives as long as the torch tensor."""
    managed = ctypes.c_void_p()
    call("dp_tensor_to_dlpack", handle, ctypes.byref(managed))
    return torch.utils.dlpack.from_dlpack(_capsule_new(managed, b"dltensor", None))


def owned_view(handle):
    """view(handle), then the handle is released."""
    try:
        return view(handle)
    finally:
        lib.dp_tensor_destroy(handle)
