"""dparallel.torch on a world of one (one process, launcher variables set):
wrappers given no group share dparallel.default_group(); fully_shard's
shard is the whole parameter and a step gives torch's own gradients; a
no_grad forward leaves the root resharded, so state dicts work right after
it."""
import os
import socket
import sys
import tempfile

import torch

import dparallel
import dparallel.torch as dpt

failures = []
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DP_STORE_ADDR="127.0.0.1", DP_STORE_PORT=str(port))



class Net(torch.nn.Module):
    """Two sharded children and a parameter of the root's own."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2)
        self.scale = torch.nn.Parameter(torch.full((2,), 1.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


torch.manual_seed(0)
model = Net()
plain = Net()
plain.load_state_dict(model.state_dict())
dpt.fully_shard(model.a)
dpt.fully_shard(model.b)
dpt.fully_shard(model)
group = dparallel.default_group()
for m in (model.a, model.b, model):
    if m._dp_fsdp.group is not group:
        failures.append("a fully_shard given no group is not on dparallel.default_group()")
if group.size() != 1:
    failures.append(f"default group of size {group.size()}")

x = torch.randn(5, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    ref_opt.zero_grad()
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    opt.step()
    ref_opt.step()
got = dpt.full_state_dict(model)
for k, v in plain.state_dict().items():
    if not torch.equal(got[k], v):
        failures.append(f"fully_shard on one rank: {k} is {got[k]}, torch alone gives {v}")

with tempfile.TemporaryDirectory(prefix="dp-single-") as tmp:
    path = os.path.join(tmp, "full.safetensors")
    dpt.save_full_state_dict(model, path)
    with torch.no_grad():
        model(x)
    # The root resharded after the no_grad forward (its full parameters
    # freed): a load, which needs every dp_fsdp resharded, works.
    freed = all(p.full.untyped_storage().size() == 0 for s in (model, model.a, model.b) for p in s._dp_fsdp.params)
    if not freed:
        failures.append("full parameters still held after a no_grad forward")
    try:
        dpt.load_full_state_dict(model, path)
        after = dpt.full_state_dict(model)
        if not all(torch.equal(after[k], got[k]) for k in got):
            failures.append("the saved state dict did not load back")
    except dparallel.DpError as e:
        failures.append(f"load_full_state_dict after a no_grad forward: {e}")

rep = dpt.replicate(torch.nn.Linear(2, 2))
if rep._dp_replicate.group is not group:
    failures.append("a replicate given no group is not on dparallel.default_group()")
# Rebound onto a second one-rank group (a store of its own), training goes
# on: the average over one rank is the rank's own gradient.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["DP_STORE_PORT"] = str(s.getsockname()[1])
second = dparallel.ProcessGroup()
rep.dp_rebind(second)
if rep._dp_replicate.group is not second:
    failures.append("dp_rebind did not move the replicated module to the new group")
xr = torch.randn(3, 2)
rep(xr).sum().backward()
if not torch.allclose(rep.weight.grad, xr.sum(0).expand(2, 2)) or not torch.equal(rep.bias.grad, torch.full((2,), 3.0)):
    failures.append(f"a step after dp_rebind: gradients {rep.weight.grad}, {rep.bias.grad}")
try:
    rep.dp_rebind(None)
    failures.append("dp_rebind(None) returned")
except TypeError:
    pass
rep.dp_close()

for f in failures:
    print(f"FAIL: {f}", file=sys.stderr)
print("single rank: ok" if not failures else f"single rank: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
