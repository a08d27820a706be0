"""HSDP: dparallel.torch.fully_shard on a 2x2 DeviceMesh against torch's
fully_shard on init_device_mesh("cpu", (2, 2)) over gloo. Four real
processes as two pretend hosts of two ranks (DP_HOST_ID a for ranks 0 and
1, b for 2 and 3): each host's ranks shard the parameters between them
(mesh dimension 1), the hosts replicate them (dimension 0), as torch's
row-major mesh does. Every rank trains on its own data, so the gradients
need both the reduce-scatter inside a host and the all-reduce across hosts.
dparallel runs over its "auto" group, which is hierarchical here (shared
memory inside a host, Gloo across; the mesh's shard groups are shared
memory and its replicate groups Gloo), and over a "gloo" group made with
DP_SHM=0, whose mesh is Gloo in both dimensions. After several SGD steps
the unsharded parameters must equal torch's bit for bit: with and without
reshard_after_forward, with bfloat16 compute (MixedPrecisionPolicy), with
bfloat16 gradient reduction, and with gradient accumulation.
Run without arguments: starts its four ranks and waits for them."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replicate_parity import exit_unless_fsdp2, launch_ranks  # noqa: E402

WORLD = 4
SHAPE = (2, 2)  # replicas (hosts) x shards (ranks of a host)
DIM_NAMES = ("replicate", "shard")
STEPS = 4


def rank_env(rank):
    # Shard groups (consecutive ranks, as torch's row-major mesh) stay inside a pretend host.
    return {"DP_HOST_ID": "ab"[rank // SHAPE[1]], "LOCAL_RANK": str(rank % SHAPE[1])}


def rank_main():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:  # PyTorch before 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard

    import dparallel
    import dparallel.torch as dpt
    from parity_training import shard, train

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch_mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=DIM_NAMES)
    failures = []

    auto_port, gloo_port = os.environ["DP_TEST_PORTS"].split(",")
    os.environ["DP_STORE_PORT"] = auto_port
    auto = dparallel.ProcessGroup(backend="auto")
    # A mesh's groups choose their backend as "auto" does: DP_SHM=0 keeps
    # the gloo variant on Gloo in both dimensions.
    os.environ["DP_STORE_PORT"] = gloo_port
    os.environ["DP_SHM"] = "0"
    gloo = dparallel.ProcessGroup(backend="gloo")
    gloo_mesh = dparallel.DeviceMesh(gloo, SHAPE, DIM_NAMES)
    del os.environ["DP_SHM"]
    auto_mesh = dparallel.DeviceMesh(auto, SHAPE, DIM_NAMES)
    meshes = {"auto": auto_mesh, "gloo": gloo_mesh}
    want_backends = {"auto": ("shm+gloo", "gloo", "shm"), "gloo": ("gloo", "gloo", "gloo")}
    for label, group in (("auto", auto), ("gloo", gloo)):
        mesh = meshes[label]
        got = (group.backend(), mesh.group("replicate").backend(), mesh.group("shard").backend())
        if got != want_backends[label]:
            failures.append(f"{label}: backends (group, replicate, shard) {got}, not {want_backends[label]}")
        coords = (mesh.group("replicate").rank(), mesh.group("shard").rank())
        want_coords = (torch_mesh.get_local_rank("replicate"), torch_mesh.get_local_rank("shard"))
        if mesh.shape != SHAPE or coords != want_coords:
            failures.append(f"{label}: mesh {mesh.shape} at {coords}, torch's {SHAPE} at {want_coords}")

    def make():
        # FSDP2 shards each rank's own values: every rank starts alike.
        torch.manual_seed(0)
        # 5 output rows: shards of 3 and 2 rows.
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()

    start = {k: v.detach().clone() for k, v in make().state_dict().items()}
    configs = [("zero3", {"reshard_after_forward": True}), ("zero2", {"reshard_after_forward": False}),
               ("bf16", {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}),
               ("bf16-reduce", {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.bfloat16)}),
               ("accumulate", {})]
    for config, kw in configs:
        ref_model = shard(make(), torch_fully_shard, torch_mesh, **kw)
        train(ref_model, rank, STEPS, accumulate=config == "accumulate")
        ref = {k: v.full_tensor().detach().clone() for k, v in ref_model.state_dict().items()}
        if all(same(ref[k], start[k]) for k in start):
            failures.append(f"{config}: torch's training left the parameters as they started")
        for label, mesh in meshes.items():
            model = shard(make(), dpt.fully_shard, mesh, **kw)
            train(model, rank, STEPS, accumulate=config == "accumulate")
            got = dpt.full_state_dict(model)
            if sorted(got) != sorted(ref):
                failures.append(f"{config}/{label}: keys {sorted(got)} are not torch's {sorted(ref)}")
                continue
            for name, want in ref.items():
                if not same(want, got[name]):
                    diff = (want.double() - got[name].double()).abs().max().item()
                    failures.append(f"{config}/{label}: {name} differs from torch's HSDP (max |diff| {diff})")

    for mesh in meshes.values():
        mesh.destroy()
    auto.destroy()
    gloo.destroy()
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {rank}: FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if "--rank" not in sys.argv:
        # The reference is FSDP2 itself (dparallel.torch.fully_shard runs on 2.1 too: single_rank.py).
        exit_unless_fsdp2()
    sys.exit(rank_main() if "--rank" in sys.argv else launch_ranks(__file__, "HSDP parity", WORLD, rank_env))
