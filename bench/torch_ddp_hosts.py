#!/usr/bin/env python3
"""PyTorch DDP over Gloo, one process per rank started by dp-run on every host.

The model and the modes are dp-perf ddp's (bench/dp_perf_ddp.cpp), so that
bench/testbed.sh can put the two side by side on the same hosts and links:
`layers` x Linear(width, width) with ReLU between, MSE loss, SGD (lr 1e-3),
`batch` rows per rank, one torch thread per rank. Modes, in this order:
  local           a plain model of this process's own
  ddp_no_sync     the DDP model inside no_sync() (no gradient all-reduce)
  ddp             the DDP model (25 MB buckets, torch's default)
  allreduce_only  one all_reduce of a flat float32 tensor of the model's size
Each step is timed after a barrier; a step's time is the maximum over the
ranks; rank 0 prints the median and the minimum over the timed steps.

dp-run exports RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (its own store
listens on DP_STORE_PORT, so MASTER_PORT is torch's); Gloo binds to
DP_SOCKET_IFNAME when set (the testbed's hosts set eth0).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def mlp(layers, width):
    torch.manual_seed(0)
    parts = []
    for i in range(layers):
        parts.append(nn.Linear(width, width))
        if i + 1 < layers:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def sgd_step(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = nn.MSELoss()

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss(model(x), y).backward()
        optimizer.step()

    return step


def timed(step, steps, warmup):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ordered = sorted(slowest.tolist())
    return ordered[len(ordered) // 2], ordered[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if "DP_SOCKET_IFNAME" in os.environ:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["DP_SOCKET_IFNAME"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://, from dp-run's variables
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 + rank)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    local = mlp(args.layers, args.width)
    ddp = DistributedDataParallel(mlp(args.layers, args.width))
    nparams = sum(p.numel() for p in local.parameters())
    flat = torch.zeros(nparams)
    ddp_step = sgd_step(ddp, x, y)

    def no_sync_step():
        with ddp.no_sync():
            ddp_step()

    modes = [("local", sgd_step(local, x, y)), ("ddp_no_sync", no_sync_step), ("ddp", ddp_step),
             ("allreduce_only", lambda: dist.all_reduce(flat))]
    if rank == 0:
        print(f"# torch {torch.__version__} DDP/gloo over {world} ranks, {args.layers} x Linear({args.width}, "
              f"{args.width}) = {nparams / 1e6:.2f} M parameters, batch {args.batch} per rank, "
              f"{args.steps} steps (+{args.warmup})")
        print(f"{'mode':<15} {'median_ms':>10} {'min_ms':>10}")
    medians = {}
    for name, step in modes:
        median, fastest = timed(step, args.steps, args.warmup)
        medians[name] = median
        if rank == 0:
            print(f"{name:<15} {median * 1e3:>10.2f} {fastest * 1e3:>10.2f}", flush=True)
    if rank == 0:
        added = medians["ddp"] - medians["local"]
        print(f"# comm overhead (median): ddp - local = {added * 1e3:.2f} ms "
              f"({added / medians['local'] * 100:.1f}% of local step)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
