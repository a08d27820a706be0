"""ctypes declarations of the C ABI this package uses, and the library's loading."""
import ctypes
import importlib.util
import os
import sys

_LIB_NAME = "libdparallel.so.0"


class DpError(RuntimeError):
    """A C ABI call failed: `call` is the entry point, `status` its dp_status,
    and the message carries dp_last_error()'s text."""

    def __init__(self, call, status, detail):
        self.call = call
        self.status = status
        self.detail = detail
        super().__init__(f"{call}: {_status_name(status)} ({status}): {detail}")


class dp_device(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("index", ctypes.c_int32)]


class dp_process_group_options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("store", ctypes.c_void_p),
        ("timeout_ms", ctypes.c_int32),
        ("device", dp_device),
    ]


class dp_ddp_options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("bucket_cap_mb", ctypes.c_double),
        ("first_bucket_cap_mb", ctypes.c_double),
        ("gradient_as_bucket_view", ctypes.c_int),
        ("broadcast_buffers", ctypes.c_int),
        ("find_unused_parameters", ctypes.c_int),
        ("init_sync", ctypes.c_int),
        ("ignored_modules", ctypes.POINTER(ctypes.c_char_p)),
        ("num_ignored_modules", ctypes.c_size_t),
        ("ignored_parameters", ctypes.POINTER(ctypes.c_char_p)),
        ("num_ignored_parameters", ctypes.c_size_t),
        ("comm_hook", ctypes.c_int32),
        ("hook_fn", ctypes.c_void_p),
        ("hook_user_data", ctypes.c_void_p),
        ("static_graph", ctypes.c_int),
        ("join_divide_by_initial_world_size", ctypes.c_int),
        ("on_bucket_reduced", ctypes.c_void_p),
        ("on_bucket_reduced_data", ctypes.c_void_p),
        ("bucket_plan", ctypes.c_char_p),
    ]


class dp_fsdp_options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("reshard_after_forward", ctypes.c_int),
        ("param_dtype", ctypes.c_int32),
        ("reduce_dtype", ctypes.c_int32),
        ("init_sync", ctypes.c_int),
        ("full_params_as_views", ctypes.c_int),
    ]


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_S = ctypes.c_int32
_SZ = ctypes.c_size_t
_STR = ctypes.c_char_p

# name: (restype, argtypes)
_SIGNATURES = {
    "dp_status_string": (_STR, [_S]),
    "dp_last_error": (_STR, []),
    "dp_version_number": (ctypes.c_uint32, []),
    "dp_shutdown": (_S, []),
    "dp_device_count": (_S, [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]),
    "dp_set_current_stream": (_S, [dp_device, _P]),
    "dp_tensor_from_blob": (
        _S,
        [_PP, _P, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), dp_device, _P, _P],
    ),
    "dp_tensor_destroy": (None, [_P]),
    "dp_tensor_data": (_P, [_P]),
    "dp_module_create": (_S, [_PP]),
    "dp_module_destroy": (None, [_P]),
    "dp_module_register_parameter": (_S, [_P, _STR, _P, ctypes.c_int]),
    "dp_module_register_buffer": (_S, [_P, _STR, _P, ctypes.c_int]),
    "dp_module_register_module": (_S, [_P, _STR, _P]),
    "dp_module_num_parameters": (_SZ, [_P]),
    "dp_module_set_grad": (_S, [_P, _STR, _P]),
    "dp_store_create_tcp": (_S, [_PP, _STR, ctypes.c_uint16, ctypes.c_int32, ctypes.c_int, ctypes.c_int32]),
    "dp_store_destroy": (None, [_P]),
    "dp_process_group_options_init": (_S, [ctypes.POINTER(dp_process_group_options), _SZ]),
    "dp_process_group_create": (_S, [_PP, ctypes.POINTER(dp_process_group_options)]),
    "dp_process_group_create_from_env": (_S, [_PP, ctypes.POINTER(dp_process_group_options)]),
    "dp_process_group_rank": (ctypes.c_int32, [_P]),
    "dp_process_group_size": (ctypes.c_int32, [_P]),
    "dp_process_group_backend": (_STR, [_P]),
    "dp_process_group_destroy": (None, [_P]),
    "dp_pg_barrier": (_S, [_P]),
    "dp_ddp_options_init": (_S, [ctypes.POINTER(dp_ddp_options), _SZ]),
    "dp_ddp_create": (_S, [_PP, _P, _P, ctypes.POINTER(dp_ddp_options)]),
    "dp_ddp_pre_forward": (_S, [_P]),
    "dp_ddp_mark_grad_ready_index": (_S, [_P, _SZ]),
    "dp_ddp_mark_grad_ready_stream": (_S, [_P, _SZ, _P]),
    "dp_ddp_finish_backward": (_S, [_P]),
    "dp_ddp_set_requires_gradient_sync": (_S, [_P, ctypes.c_int]),
    "dp_ddp_parameter_used": (_S, [_P, _SZ, ctypes.POINTER(ctypes.c_int)]),
    "dp_ddp_join": (_S, [ctypes.POINTER(ctypes.c_void_p), _SZ]),
    "dp_ddp_rebind": (_S, [_P, _P]),
    "dp_ddp_num_buckets": (_SZ, [_P]),
    "dp_ddp_destroy": (None, [_P]),
    "dp_tensor_to_dlpack": (_S, [_P, _PP]),
    "dp_module_get_parameter": (_S, [_P, _STR, _PP]),
    "dp_module_num_buffers": (_SZ, [_P]),
    "dp_module_parameter_at": (_S, [_P, _SZ, ctypes.POINTER(_STR), _PP]),
    "dp_module_buffer_at": (_S, [_P, _SZ, ctypes.POINTER(_STR), _PP]),
    "dp_device_mesh_create": (_S, [_PP, _P, ctypes.POINTER(ctypes.c_int32), _SZ, ctypes.POINTER(_STR)]),
    "dp_device_mesh_create_by_host": (_S, [_PP, _P]),
    "dp_device_mesh_ndim": (_SZ, [_P]),
    "dp_device_mesh_group": (_S, [_P, _STR, _PP]),
    "dp_device_mesh_shape": (_S, [_P, ctypes.POINTER(ctypes.c_int32), _SZ]),
    "dp_device_mesh_dim_name": (_S, [_P, _SZ, ctypes.POINTER(_STR)]),
    "dp_device_mesh_destroy": (None, [_P]),
    "dp_fsdp_create_on_mesh": (_S, [_PP, _P, _P, ctypes.POINTER(dp_fsdp_options)]),
    "dp_fsdp_options_init": (_S, [ctypes.POINTER(dp_fsdp_options), _SZ]),
    "dp_fsdp_create": (_S, [_PP, _P, _P, ctypes.POINTER(dp_fsdp_options)]),
    "dp_fsdp_unshard": (_S, [_P, ctypes.c_int]),
    "dp_fsdp_wait_unshard": (_S, [_P]),
    "dp_fsdp_reshard": (_S, [_P]),
    "dp_fsdp_post_backward": (_S, [_P]),
    "dp_fsdp_mark_grad_ready": (_S, [_P, _STR]),
    "dp_fsdp_finish_backward": (_S, [_P]),
    "dp_fsdp_set_requires_gradient_sync": (_S, [_P, ctypes.c_int]),
    "dp_fsdp_num_parameters": (_SZ, [_P]),
    "dp_fsdp_parameter_name": (_S, [_P, _SZ, ctypes.POINTER(_STR)]),
    "dp_fsdp_shard": (_S, [_P, _SZ, _PP]),
    "dp_fsdp_shard_grad": (_S, [_P, _SZ, _PP]),
    "dp_fsdp_destroy": (None, [_P]),
    "dp_fsdp_save_full_state_dict": (_S, [_P, _P, _STR]),
    "dp_fsdp_load_full_state_dict": (_S, [_P, _STR, ctypes.c_int]),
    "dp_fsdp_full_state_dict": (_S, [_P, _P, ctypes.c_int32, _PP]),
    "dp_fsdp_save_sharded_state_dict": (_S, [_P, _P, _STR]),
    "dp_fsdp_load_sharded_state_dict": (_S, [_P, _STR]),
    "dp_fsdp_save_sharded_state_dict_async": (_S, [_P, _P, _STR, _PP]),
    "dp_work_wait": (_S, [_P]),
    "dp_work_test": (_S, [_P, ctypes.POINTER(ctypes.c_int)]),
    "dp_work_destroy": (None, [_P]),
}


def _candidates():
    here = os.path.dirname(os.path.abspath(__file__))
    # Inside the installed package first, then where the environment says.
    yield os.path.join(here, "lib", _LIB_NAME)
    env = os.environ.get("DP_LIBRARY")
    if env:
        yield env
    # A source checkout: python/dparallel next to build/<dir>/capi.
    build = os.path.join(os.path.dirname(os.path.dirname(here)), "build")
    for sub in ("normal", "sanitize"):
        yield os.path.join(build, sub, "capi", _LIB_NAME)


def _load():
    # The library and PyTorch's CUDA build both need libnccl.so.2, and the
    # first one loaded serves both: torch's own (newer) must be that one, or
    # torch fails to import with an undefined NCCL symbol.
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401
    tried = []
    for path in _candidates():
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            return lib, path
        tried.append(path)
    raise ImportError("dparallel: the library was not found; looked at " + ", ".join(tried) +
                      " (set DP_LIBRARY to libdparallel.so.0)")


lib, library_path = _load()


def _status_name(status):
    return lib.dp_status_string(status).decode()


def check(call, status):
    """Raises DpError for a failed `call` (the entry point's name)."""
    if status != 0:
        raise DpError(call, status, lib.dp_last_error().decode(errors="replace"))


def call(name, *args):
    """Calls entry point `name` and raises DpError naming it on failure."""
    check(name, getattr(lib, name)(*args))
