"""What the fully_shard parity tests share: sharding a Sequential the way
FSDP2 is meant to be used (each Linear, then the root), every rank's own
data, and the training loop (SGD with momentum, optionally a first
micro-batch without gradient sync). Imported inside the ranks, after the
check for PyTorch."""
import torch
import torch.nn as nn


def shard(model, fn, mesh, **kw):
    """`fn` (torch's fully_shard or dparallel's) on each Linear of `model`,
    then on `model`, with FSDP2's own keyword `mesh`, which dparallel's
    fully_shard takes too (a group or a DeviceMesh)."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fn(layer, mesh=mesh, **kw)
    fn(model, mesh=mesh, **kw)
    return model


def batches(rank, steps):
    """Each rank its own data: every rank's gradients differ."""
    g = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)) for _ in range(steps)]


def train(model, rank, steps, accumulate=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(rank, steps):
        opt.zero_grad()
        if accumulate:
            # Gradient accumulation: a first micro-batch without sync.
            model.set_requires_gradient_sync(False)
            nn.functional.mse_loss(model(x[:3]).float(), y[:3]).backward()
            model.set_requires_gradient_sync(True)
            x, y = x[3:], y[3:]
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
