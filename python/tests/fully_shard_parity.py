"""dparallel.torch.fully_shard against torch's FSDP2 fully_shard: two real
processes shard the same model (each Linear, then the root) over gloo; with
dparallel's gloo and shm groups the unsharded parameters after several
optimizer steps must equal FSDP2's bit for bit, with and without
reshard_after_forward, with bfloat16 compute (MixedPrecisionPolicy), with
gradient accumulation (set_requires_gradient_sync), and as HSDP on a 2-D
mesh (1 replica x 2 shards) against FSDP2 on torch's.
Then full and sharded state dicts saved by one model load into another.
Run without arguments: starts its two ranks and waits for them."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replicate_parity import exit_unless_fsdp2, launch_ranks  # noqa: E402

STEPS = 4


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
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    gloo_port, shm_port = os.environ["DP_TEST_PORTS"].split(",")
    groups = {}
    for backend, port in (("gloo", gloo_port), ("shm", shm_port)):
        os.environ["DP_STORE_PORT"] = port
        groups[backend] = dparallel.ProcessGroup(backend=backend)

    def make(seed=0):
        # FSDP2 shards each rank's own values: every rank starts alike.
        torch.manual_seed(seed)
        # 5 output rows: shards of 3 and 2 rows.
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

    def torch_full(model):
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()

    failures = []
    configs = [("zero3", {"reshard_after_forward": True}), ("zero2", {"reshard_after_forward": False}),
               ("bf16", {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}), ("accumulate", {})]
    # HSDP on a 2-D mesh of 1 replica x 2 shards, as torch's 2-D mesh.
    hsdp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    dp_meshes = {b: dparallel.DeviceMesh(g, (1, world), ("replicate", "shard")) for b, g in groups.items()}
    if dp_meshes["shm"].shape != (1, world) or dp_meshes["shm"].dim_names != ("replicate", "shard"):
        failures.append(f"mesh: shape {dp_meshes['shm'].shape}, names {dp_meshes['shm'].dim_names}")
    configs.append(("hsdp", {}))
    for label, kw in configs:
        ref_model = shard(make(), torch_fully_shard, hsdp_mesh if label == "hsdp" else mesh, **kw)
        train(ref_model, rank, STEPS, accumulate=label == "accumulate")
        ref = torch_full(ref_model)
        for backend, group in groups.items():
            if label == "hsdp":
                group = dp_meshes[backend]
            model = shard(make(), dpt.fully_shard, group, **kw)
            train(model, rank, STEPS, accumulate=label == "accumulate")
            got = dpt.full_state_dict(model)
            if sorted(got) != sorted(ref):
                failures.append(f"{label}/{backend}: keys {sorted(got)} are not FSDP2's {sorted(ref)}")
                continue
            for name, want in ref.items():
                if not same(want, got[name]):
                    diff = (want.double() - got[name].double()).abs().max().item()
                    failures.append(f"{label}/{backend}: {name} differs from FSDP2's (max |diff| {diff})")

    # State dicts: a trained model's saves load into a fresh one.
    group = groups["shm"]
    trained = shard(make(), dpt.fully_shard, group)
    train(trained, rank, STEPS)
    want = dpt.full_state_dict(trained)
    with tempfile.TemporaryDirectory(prefix="dp-fsdp-sd-") as tmp:
        # Rank 0's folder name serves every rank (one machine).
        obj = [tmp]
        dist.broadcast_object_list(obj, src=0)
        folder = obj[0]
        path = os.path.join(folder, "full.safetensors")
        dpt.save_full_state_dict(trained, path)
        dpt.save_sharded_state_dict(trained, os.path.join(folder, "sharded"))
        with dpt.save_sharded_state_dict_async(trained, os.path.join(folder, "sharded-async")) as saving:
            saving.wait()
            if not saving.done():
                failures.append("the background save is not done once waited for")
        for how, load in (("full", lambda m: dpt.load_full_state_dict(m, path)),
                          ("sharded", lambda m: dpt.load_sharded_state_dict(m, os.path.join(folder, "sharded"))),
                          ("background",
                           lambda m: dpt.load_sharded_state_dict(m, os.path.join(folder, "sharded-async")))):
            fresh = shard(make(seed=1), dpt.fully_shard, group)
            load(fresh)
            got = dpt.full_state_dict(fresh)
            for name, w in want.items():
                if not same(w, got[name]):
                    failures.append(f"{how} state dict: {name} did not load")
        dist.barrier()

    for g in groups.values():
        g.destroy()
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {rank}: FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if "--rank" not in sys.argv:
        # The reference is FSDP2 itself (dparallel.torch.fully_shard runs on 2.1 too: single_rank.py).
        exit_unless_fsdp2()
    sys.exit(rank_main() if "--rank" in sys.argv else launch_ranks(__file__, "fully_shard parity"))
