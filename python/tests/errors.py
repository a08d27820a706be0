"""The package's argument checks and the C ABI's errors as Python exceptions
(DpError naming the entry point and dp_last_error's text); one process."""
import ctypes
import os
import socket
import sys

import dparallel
from dparallel import DpError
from dparallel import _lib

failures = []


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as e:
        text = str(e)
        for n in needles:
            if n not in text:
                failures.append(f"{exc_type.__name__} '{text}' lacks '{n}'")
        return e
    except Exception as e:  # noqa: BLE001 - report the wrong type
        failures.append(f"expected {exc_type.__name__} containing {needles}, got {type(e).__name__}: {e}")
        return None
    failures.append(f"expected {exc_type.__name__} containing {needles}, nothing raised")
    return None


installed = os.environ.get("DP_TEST_INSTALLED")
if installed and not dparallel.library_path.startswith(os.path.join(installed, "dparallel")):
    failures.append(f"the library came from {dparallel.library_path}, not from the installed package under {installed}")
if dparallel.version().count(".") != 2:
    failures.append(f"version() is {dparallel.version()!r}")

# A failing entry point: its name, the status and dp_last_error's text.
e = expect(DpError, lambda: _lib.call("dp_ddp_create", ctypes.byref(ctypes.c_void_p()), None, None, None),
           "dp_ddp_create", "invalid argument", "'pg'")
if e is not None and e.status != -1:
    failures.append(f"DpError.status is {e.status}, not DP_EINVAL (-1)")

expect(ValueError, lambda: dparallel.ProcessGroup(backend="mpi"), "backend", "mpi")
expect(ValueError, lambda: dparallel.ProcessGroup(device="tpu:0"), "device", "tpu")
for var in ("RANK", "WORLD_SIZE", "DP_STORE_ADDR", "DP_STORE_PORT", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
            "PMI_RANK", "SLURM_PROCID"):
    os.environ.pop(var, None)
expect(DpError, lambda: dparallel.ProcessGroup(backend="gloo", rank=0, world_size=1), "dp_process_group_create",
       "MASTER_ADDR")

# A world of one: a working group.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(DP_STORE_ADDR="127.0.0.1", DP_STORE_PORT=str(port))
with dparallel.ProcessGroup(backend="gloo", rank=0, world_size=1) as pg:
    if (pg.rank(), pg.size(), pg.backend()) != (0, 1, "gloo"):
        failures.append(f"group: rank {pg.rank()}, size {pg.size()}, backend {pg.backend()}")
    pg.barrier()
    try:
        import torch
    except ImportError:
        torch = None
        print("torch is not importable here: replicate's argument checks not run")
    if torch is not None:
        import dparallel.torch as dpt

        expect(TypeError, lambda: dpt.replicate(object(), pg), "module", "torch.nn.Module")
        expect(TypeError, lambda: dpt.replicate(torch.nn.Linear(2, 2), "gloo"), "group", "ProcessGroup")

        class Strided(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(4, 3).t())

        expect(ValueError, lambda: dpt.replicate(Strided(), pg), "w", "contiguous")
        m = dpt.replicate(torch.nn.Linear(2, 2), pg)
        expect(ValueError, lambda: dpt.replicate(m, pg), "already replicated")
        expect(TypeError, lambda: dpt.join(torch.nn.Linear(2, 2)), "not a replicated module")
        # A backward without a forward of the replicated module first: the
        # reducer never saw the new gradients.
        m.weight.grad = None
        out = torch.nn.functional.linear(torch.ones(1, 2), m.weight, m.bias).sum()
        expect(DpError, out.backward, "weight", "replaced")
        m.dp_close()
        # A parameter the backward never reached, without find_unused_parameters:
        # finish_backward's DP_ESTATE comes out of backward() naming it, and the
        # next iteration works.
        two = dpt.replicate(torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "idle": torch.nn.Linear(2, 2)}), pg)
        two.forward = lambda x: two["used"](x)
        e = expect(DpError, lambda: two(torch.ones(1, 2)).sum().backward(), "dp_ddp_finish_backward", "idle.weight",
                   "find_unused_parameters")
        two.forward = lambda x: two["idle"](two["used"](x))
        two(torch.ones(1, 2)).sum().backward()
        if not torch.equal(two["idle"].bias.grad, torch.ones(2)):
            failures.append(f"after a failed backward, the next one gave bias gradient {two['idle'].bias.grad}")
        two.dp_close()
        expect(TypeError, lambda: dpt.fully_shard(object(), pg), "module", "torch.nn.Module")
        expect(ValueError, lambda: dpt.fully_shard(torch.nn.Linear(2, 2), pg, mesh=pg), "group, mesh")

        class Policy:
            param_dtype = torch.int32

        expect(ValueError, lambda: dpt.fully_shard(torch.nn.Linear(2, 2), pg, mp_policy=Policy()), "param_dtype",
               "floating")
        expect(TypeError, lambda: dpt.full_state_dict(torch.nn.Linear(2, 2)), "not a fully_shard module")
        sharded = dpt.fully_shard(torch.nn.Linear(3, 2), pg)
        expect(ValueError, lambda: dpt.fully_shard(sharded, pg), "already sharded")
        expect(DpError, lambda: m.no_sync().__enter__(), "closed")
expect(DpError, pg.rank, "destroyed")

for f in failures:
    print(f"FAIL: {f}", file=sys.stderr)
print("errors: ok" if not failures else f"errors: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
