"""Multi-rank checkpointing under torchrun or Slurm: each rank saves its shard, the managers agree on commits.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --local-dir /tmp/nvme/ckpt --remote-url /tmp/pfs/run1
    torchrun --nproc_per_node 2 examples/torchrun_train.py ... --steps 60   # again: restores step 30, trains to 60
    torchrun --nproc_per_node 4 examples/torchrun_train.py ... --tp 2       # FSDP2 over 2-way tensor parallelism
    srun python examples/torchrun_train.py ...       # see examples/slurm.sbatch

Runs on CPU with gloo (and on GPUs with NCCL for training; tierckpt's own coordination always uses gloo). The model
is sharded with FSDP2 when available, so its parameters and optimizer state are DTensors: a checkpoint written by N
ranks restores onto any number of ranks. With ``--tp N`` the ranks form a (data parallel, tensor parallel) mesh, as
TorchTitan does: each layer is split over N tensor-parallel ranks, then FSDP2 shards it over the data-parallel ones;
a checkpoint of either layout restores into the other.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import tierckpt


def setup() -> tuple[int, int]:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # plain srun, no torchrun
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # one GPU per rank, before NCCL starts
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local-dir", required=True, help="node-local folder (NVMe)")
    p.add_argument("--remote-url", default=None, help="shared folder or URL")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (FSDP2 shards over the rest)")
    args = p.parse_args()
    rank, world = setup()
    if args.tp < 1 or world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    dp_rank = rank // args.tp  # the ranks of one tensor-parallel group see the same batches
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        if args.tp > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    except ImportError:  # older torch: plain data parallel state, one copy per rank
        if args.tp > 1:
            raise SystemExit("--tp needs torch >= 2.6 (FSDP2 and tensor parallelism)") from None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    # Sharded optimizer state is checkpointed through DCP's state-dict helpers, which create it (as DTensors) before
    # the first step, so that a restore has tensors of the right layout to load into.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"model": model, "optimizer": get_optimizer_state_dict(model, opt), "generator": gen, "step": 0}
    # The local folder is per node: ranks on one node share it. The remote is shared by all.
    mgr = tierckpt.CheckpointManager(args.local_dir, remote=args.remote_url, keep_local=2, save_every_steps=args.every)
    mgr.install_signal_handlers()  # Slurm's --signal=USR1@120 / SIGTERM: one last checkpoint, then exit
    start = mgr.restore(state) or 0
    if start:
        set_optimizer_state_dict(model, opt, state["optimizer"])
    if rank == 0:
        print(f"world {world} (tp {args.tp}): starting at step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, 64, generator=gen).to(device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mgr.should_save(step):
            state["step"] = step
            state["optimizer"] = get_optimizer_state_dict(model, opt)
            t0 = time.perf_counter()
            mgr.save(step, state, metadata={"loss": loss.item()})
            if rank == 0:
                print(f"step {step}: saved, training waited {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
            if mgr.preempted:
                break
    mgr.wait()  # every save so far committed in both tiers (raises an upload's error)
    if rank == 0:
        print("done:", [(i.step, i.state) for i in mgr.steps()], flush=True)
    mgr.close()  # stops the manager's threads and releases the folder: nothing may be asked of it after this
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
