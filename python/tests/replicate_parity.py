"""dparallel.torch.replicate against torch's DistributedDataParallel: two
real processes train the same models on the same data, with torch's DDP over
gloo and with replicate over dparallel's gloo and shm groups; every
parameter and buffer must equal torch's bit for bit. Scenarios: a plain
step with buffers (BatchNorm), gradient accumulation under no_sync,
find_unused_parameters with a branch one rank skips, and join with uneven
inputs. Run without arguments: starts its two ranks and waits for them."""
import os
import socket
import subprocess
import sys
import time

WORLD = 2
STEPS = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_unless_fsdp2():
    """Exits 77 (skipped), saying why, where PyTorch has no FSDP2 fully_shard
    to compare with (it has from 2.4 on)."""
    import importlib.util
    if importlib.util.find_spec("torch.distributed._composable.fsdp") is None:
        import torch
        print(f"SKIP: PyTorch {torch.__version__} has no FSDP2 fully_shard to compare with (2.4 or later)")
        sys.exit(77)


def launch_ranks(script, what, world=WORLD, rank_env=None):
    """Starts the `world` ranks of `script` (with --rank), rank r with the
    variables rank_env(r) on top, and waits for them."""
    ports = [free_port() for _ in range(3)]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(ports[0]), DP_STORE_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                   DP_TEST_PORTS=f"{ports[1]},{ports[2]}", OMP_NUM_THREADS="1")
        if rank_env is not None:
            env.update(rank_env(rank))
        procs.append(subprocess.Popen([sys.executable, script, "--rank"], env=env))
    # Bounded inside the test's ctest timeout (600 s), all ranks together; a hung rank fails it.
    deadline = time.monotonic() + 480
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("FAIL: a rank did not finish within 480 s", file=sys.stderr)
            return 1
    if any(rcs):
        print(f"FAIL: ranks exited with {rcs}", file=sys.stderr)
        return 1
    print(f"{what}: every rank passed")
    return 0


def rank_main():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dparallel
    import dparallel.torch as dpt

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    gloo_port, shm_port = os.environ["DP_TEST_PORTS"].split(",")
    groups = {}
    for backend, port in (("gloo", gloo_port), ("shm", shm_port)):
        os.environ["DP_STORE_PORT"] = port
        groups[backend] = dparallel.ProcessGroup(backend=backend)
        assert groups[backend].backend() == backend, groups[backend].backend()

    class Branchy(nn.Module):
        """`extra` runs only when asked: unused on some ranks and steps."""

        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            self.extra = nn.Linear(4, 4)

        def forward(self, x, use_extra):
            y = self.body(x)
            return self.extra(y) if use_extra else y

    def make(kind):
        # A different start on each rank: both wrappers must begin from rank 0's.
        torch.manual_seed(100 + rank)
        if kind == "bn":
            return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        if kind == "branchy":
            return Branchy()
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def batches(n):
        g = torch.Generator().manual_seed(7 + rank)
        return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]

    def train(model, scenario, wrapped_join):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if scenario == "plain":
            for x, y in batches(STEPS):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        elif scenario == "no_sync":
            data = batches(2 * STEPS)
            for i in range(STEPS):
                opt.zero_grad()
                with model.no_sync():
                    x, y = data[2 * i]
                    nn.functional.mse_loss(model(x), y).backward()
                x, y = data[2 * i + 1]
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        elif scenario == "unused":
            for i, (x, y) in enumerate(batches(STEPS)):
                opt.zero_grad()
                # Step 0: neither rank uses `extra`; odd steps: rank 0 only.
                use = i % 2 == 1 and rank == 0
                nn.functional.mse_loss(model(x, use), y).backward()
                opt.step()
        elif scenario == "join":
            # Uneven inputs: rank 0 runs out after 2 steps, rank 1 runs 4.
            def loop():
                for x, y in batches(2 if rank == 0 else STEPS):
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()

            wrapped_join(model, loop)
        inner = model.module if isinstance(model, DDP) else model
        return {k: v.detach().clone() for k, v in inner.state_dict().items()}

    def torch_join(model, loop):
        with Join([model]):
            loop()

    def dp_join(model, loop):
        loop()
        model.join()

    scenarios = [("plain", "bn", {}), ("no_sync", "mlp", {}), ("unused", "branchy", {"find_unused_parameters": True}),
                 ("join", "mlp", {})]
    failures = []
    for scenario, kind, kwargs in scenarios:
        ref_model = DDP(make(kind), **kwargs)
        ref = train(ref_model, scenario, torch_join)
        for backend, group in groups.items():
            model = dpt.replicate(make(kind), group, **kwargs)
            got = train(model, scenario, dp_join)
            model.dp_close()
            for name, want in ref.items():
                if want.dtype != got[name].dtype or want.numpy().tobytes() != got[name].numpy().tobytes():
                    diff = (want.double() - got[name].double()).abs().max().item()
                    failures.append(f"{scenario}/{backend}: {name} differs from torch's DDP (max |diff| {diff})")
    for g in groups.values():
        g.destroy()
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {rank}: FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(rank_main() if "--rank" in sys.argv else launch_ranks(__file__, "replicate parity"))
