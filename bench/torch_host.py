#!/usr/bin/env python3
"""PyTorch's DDP and fully_shard beside dparallel.torch's replicate and
fully_shard, in dp-perf's terms: the model of ../shared/anchors/5_ddp.sh
(layers x Linear(width, width), ReLU between, MSE loss, SGD), batch 32 per
rank, 2 ranks on this machine, one torch thread per rank. Each step
(zero_grad, forward, backward, optimizer step) is timed after a barrier, the
maximum over the ranks; median and minimum over the timed steps.
  PYTHONPATH=<wheel's site> python3 bench/torch_host.py [--steps 21] [--modes ...]
Modes: local, torch_ddp (gloo), dp_replicate_shm, dp_replicate_gloo,
torch_fsdp (gloo; each Linear, then the root), dp_fully_shard_shm."""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

MODES = ["local", "torch_ddp", "dp_replicate_shm", "dp_replicate_gloo", "torch_fsdp", "dp_fully_shard_shm"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import dparallel
    import dparallel.torch as dpt

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ports = os.environ["BENCH_PORTS"].split(",")

    def make():
        torch.manual_seed(0)
        mods = []
        for i in range(args.layers):
            mods.append(nn.Linear(args.width, args.width))
            if i < args.layers - 1:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods)

    def wrap(mode, model, port):
        if mode == "local":
            return model
        if mode == "torch_ddp":
            return nn.parallel.DistributedDataParallel(model)
        if mode == "torch_fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for m in model:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        os.environ["DP_STORE_PORT"] = port
        group = dparallel.ProcessGroup(backend=mode.rsplit("_", 1)[1])
        if mode.startswith("dp_replicate"):
            return dpt.replicate(model, group)
        for m in model:
            if isinstance(m, nn.Linear):
                dpt.fully_shard(m, group)
        return dpt.fully_shard(model, group)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    for n, mode in enumerate(args.modes):
        model = wrap(mode, make(), ports[n])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        times = []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(dt.item() * 1e3)
        if rank == 0:
            print(f"{mode:20s} {statistics.median(times):9.2f} {min(times):9.2f}", flush=True)
    dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank_main(args)
    import torch
    print(f"# torch {torch.__version__}, {args.layers} x Linear({args.width}), batch {args.batch}, 2 ranks, "
          f"1 thread each; load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':20s} {'t_med_ms':>9s} {'t_min_ms':>9s}", flush=True)
    ports = [str(free_port()) for _ in args.modes]
    master = str(free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "--rank"] + sys.argv[1:],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=master, DP_STORE_ADDR="127.0.0.1",
                                       BENCH_PORTS=",".join(ports), OMP_NUM_THREADS="1")) for r in range(2)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
