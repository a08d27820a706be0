"""dparallel.torch on cuda:0, a world of one over NCCL (run by
tests/gpu/check.sh with DP_TEST_NCCL_SINGLE_RANK=1, so that the one rank's
calls go through NCCL): replicate and fully_shard train exactly as torch
alone does on the same GPU, on torch's default stream and under a side
stream of torch's (the library follows torch's current stream: its work
starts after what torch queued there, and torch's next kernels follow it).
Exits 0 with every check passed, 1 with the failures listed; 2 where this
machine has no PyTorch with CUDA (check.sh then says NOT RUN)."""
import os
import socket
import sys

# Deterministic cuBLAS (set before CUDA starts): torch alone and the wrapped
# runs, on two streams, must run the same kernels the same way.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

torch.use_deterministic_algorithms(True)
if not torch.cuda.is_available():
    print("cuda single rank: no GPU visible to PyTorch", file=sys.stderr)
    sys.exit(2)

import dparallel  # noqa: E402 - after the check: loading the library is the next step
import dparallel.torch as dpt  # noqa: E402

failures = []
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DP_STORE_ADDR="127.0.0.1", DP_STORE_PORT=str(port))
device = torch.device("cuda", 0)


class Net(torch.nn.Module):
    """Two sharded children and a parameter of the root's own; wide enough
    that the kernels outlast a host call, so a missing order shows."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(256, 1024)
        self.b = torch.nn.Linear(1024, 256)
        self.scale = torch.nn.Parameter(torch.full((256,), 1.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def train(model, steps, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def reference(state, steps, x):
    plain = Net().to(device)
    plain.load_state_dict(state)
    train(plain, steps, x)
    return plain.state_dict()


def compare(what, got, want):
    for k, v in want.items():
        if k not in got:
            failures.append(f"{what}: {k} missing")
        elif not torch.equal(got[k].to(v.device), v):
            diff = (got[k].to(v.device).float() - v.float()).abs().max().item()
            failures.append(f"{what}: {k} differs from torch alone by up to {diff}")


torch.manual_seed(0)
start = {k: v.to(device) for k, v in Net().state_dict().items()}
x = torch.randn(512, 256, device=device)
steps = 4
want = reference(start, steps, x)
group = dparallel.default_group("cuda:0")
if group.backend() != "nccl":
    failures.append(f"the default group on cuda:0 runs {group.backend()}, not nccl")

def train_on(stream, model):
    """train() on torch's current stream (None), or under `stream`, ordered
    after the current stream's work and before what follows it."""
    if stream is None:
        train(model, steps, x)
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        train(model, steps, x)
    torch.cuda.current_stream(device).wait_stream(stream)


side = torch.cuda.Stream(device)
for stream_name, stream in (("default stream", None), ("side stream", side)):
    # replicate: the reducer over torch's gradients on the GPU.
    model = Net().to(device)
    model.load_state_dict(start)
    dpt.replicate(model)
    train_on(stream, model)
    compare(f"replicate, {stream_name}", model.state_dict(), want)
    model.dp_close()

    # fully_shard: nested, resharded after forward, the backward's unshard
    # refilling what the forward saved.
    model = Net().to(device)
    model.load_state_dict(start)
    dpt.fully_shard(model.a)
    dpt.fully_shard(model.b)
    dpt.fully_shard(model)
    train_on(stream, model)
    compare(f"fully_shard, {stream_name}", dpt.full_state_dict(model), want)
torch.cuda.synchronize()

for f in failures:
    print(f"FAIL: {f}", file=sys.stderr)
print("cuda single rank: ok" if not failures else f"cuda single rank: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
