"""One rank of a two-rank job with incremental saves for tests/distributed/test_incremental_ranks.py (run as
``python _incremental_worker.py inc2 RANK CONFIG``).

The state is DTensors on a 1-D mesh of the two ranks: a large frozen base (Shard(0)) and a replicated embedding
that never change, and a small adapter (Shard(0)) that changes every step. Phases (each recorded in
``<root>/result-inc2-r<rank>.json``, see tests/distributed/_dist_worker.py):

- ``save``: steps 1-5 with ``incremental=True, full_every=3``, ``keep_local=3``, ``keep_remote=3``, waiting for
  each; per step, this rank's own data bytes in its node folder and in the remote, and both step manifests'
  ``refs``/``shared_bytes``; the steps left in both tiers;
- ``restart``: a new manager (``keep_local=keep_remote=4``) restores the newest step (bit-exact), saves step 6
  (referencing what it found); ``tierckpt verify`` of the node folder (and the remote, rank 0); the steps left;
- ``damaged``: rank 0 flips a byte in rank 1's file of step 4 in node 1's folder and in the remote (a file steps 5
  and 6 reference); every rank restores: the newest intact step is 3;
- ``carry``: fresh folders and remote; steps 1 and 2, then the remote loses step 1 and step 3 (referencing step 1
  locally) is uploaded: its files of step 1 are carried over into the remote's step 3;
- ``s3`` (when the config names an S3 remote, the moto server): fresh node folders, steps 1-5 with ``full_every=3``,
  ``keep_local=2``, ``keep_remote=2``; per step, the remote's steps and this step's ``refs`` and own bytes there
  (read through the library, never by key); then a new manager on empty node folders restores step 5 from the
  remote alone (bit-exact) and saves step 6; rank 0 runs ``tierckpt verify`` of the remote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed._dist_worker import Recorder, flip_byte, run_worker

#: the DTensor placements the state is saved with
SPECS = {"base": "S0", "emb": "R", "adapter": "S0"}


def full(step: int) -> dict[str, torch.Tensor]:
    """The global tensors at ``step``: only the adapter changes."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(256, 128, generator=g)  # 128 KiB, 64 KiB per rank
    emb = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    adapter = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))
    return {"base": base, "emb": emb, "adapter": adapter}


def state(mesh: Any, step: int, *, zero: bool = False) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for k, v in full(step).items():
        p = Replicate() if SPECS[k] == "R" else Shard(int(SPECS[k][1:]))
        out[k] = distribute_tensor(torch.zeros_like(v) if zero else v, mesh, [p])
    return {"model": out, "step": 0 if zero else step}


def exact(st: dict[str, Any], step: int) -> bool:
    ref = full(step)
    return st["step"] == step and all(
        torch.equal(st["model"][k].full_tensor().view(torch.uint8), ref[k].view(torch.uint8)) for k in ref)


def own_bytes(folder: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"r{rank:05d}-p*.safetensors"))


def refs_of(folder: Path) -> list[Any]:
    m = json.loads((folder / "manifest.json").read_text())
    return [m.get("refs", []), m.get("shared_bytes", 0)]


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.glob("step-*") if (p / "manifest.json").exists())


def scenario_inc2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt import CheckpointManager, cli

    root = Path(cfg["root"])
    node, remote = root / f"n{rank}", root / "remote"
    mesh = init_device_mesh("cpu", (world,))

    def manager(keep: int = 3) -> Any:
        return CheckpointManager(node, remote=remote, collective_timeout_s=cfg["timeout"], incremental=True,
                                 full_every=3, keep_local=keep, keep_remote=keep)

    def save() -> dict[str, Any]:
        per_step = {}
        with manager() as mgr:
            for s in range(1, 6):
                mgr.save(s, state(mesh, s))
                mgr.wait()
                d = f"step-{s:010d}"
                per_step[s] = {"local": own_bytes(node / d, rank), "remote": own_bytes(remote / d, rank),
                               "local_refs": refs_of(node / d), "remote_refs": refs_of(remote / d)}
        dist.barrier()
        return {"steps": per_step, "local": steps_in(node), "remote": steps_in(remote)}

    def restart() -> dict[str, Any]:
        with manager(keep=4) as mgr:
            st = state(mesh, 0, zero=True)
            got = mgr.restore(st)
            mgr.save(6, state(mesh, 6))
            mgr.wait()
        d = node / "step-0000000006"
        dist.barrier()
        rcs = {"local": cli.main(["verify", str(node)])}
        if rank == 0:
            rcs["remote"] = cli.main(["verify", str(remote)])
        return {"restored": got, "exact": exact(st, 5), "own6": own_bytes(d, rank), "refs6": refs_of(d),
                "verify": rcs, "local": steps_in(node), "remote": steps_in(remote)}

    def damaged() -> dict[str, Any]:
        if rank == 0:
            for folder in (root / "n1" / "step-0000000004", remote / "step-0000000004"):
                flip_byte(sorted(folder.glob("r00001-p*.safetensors"))[0])
        dist.barrier()
        with manager(keep=4) as mgr:
            st = state(mesh, 0, zero=True)
            got = mgr.restore(st)
        return {"restored": got, "exact": exact(st, got)}

    def carry() -> dict[str, Any]:
        node2, remote2 = root / f"c{rank}", root / "remote2"
        with CheckpointManager(node2, remote=remote2, collective_timeout_s=cfg["timeout"], incremental=True) as mgr:
            for s in (1, 2):
                mgr.save(s, state(mesh, s))
                mgr.wait()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(remote2 / "step-0000000001")  # the remote lost the step the next one references
            dist.barrier()
            mgr.save(3, state(mesh, 3))
            mgr.wait()
        d = "step-0000000003"
        return {"local_refs": refs_of(node2 / d), "remote_refs": refs_of(remote2 / d),
                "remote": own_bytes(remote2 / d, rank)}

    def s3() -> dict[str, Any]:
        from tierckpt.format import layout
        from tierckpt.storage.commit import read_step_manifest
        from tierckpt.tiers.listing import list_root
        from tierckpt.tiers.reader import read_manifests

        url, opts = cfg["s3"], cfg["storage_options"]

        def mgr_at(folder: Path) -> Any:
            return CheckpointManager(folder, remote=url, storage_options=opts, collective_timeout_s=cfg["timeout"],
                                     incremental=True, full_every=3, keep_local=2, keep_remote=2, upload_part_mb=5)

        per_step: dict[int, Any] = {}
        with mgr_at(root / f"s{rank}") as mgr:
            for s in range(1, 6):
                mgr.save(s, state(mesh, s))
                mgr.wait()
                m = read_step_manifest(mgr.remote, layout.step_dir(s), s)
                _, rms = read_manifests(mgr.remote, s)
                mine = [rm for rm in rms if rm.rank == rank]
                per_step[s] = {"remote": sorted(list_root(mgr.remote).steps), "refs": list(m.refs) if m else None,
                               "own": sum(f.stored_size or f.size for rm in mine for f in rm.files
                                          if f.in_step is None)}
        dist.barrier()
        with mgr_at(root / f"s{rank}-again") as mgr:
            st = state(mesh, 0, zero=True)
            got = mgr.restore(st)
            restored_exact = exact(st, 5)
            mgr.save(6, state(mesh, 6))
            mgr.wait()
            left = sorted(list_root(mgr.remote).steps)
        dist.barrier()
        out = {"steps": per_step, "restored": got, "exact": restored_exact, "remote": left}
        if rank == 0:
            so = [f"--storage-option=client_kwargs.endpoint_url={opts['client_kwargs']['endpoint_url']}"]
            out["verify"] = cli.main(["verify", url, *so])
        return out

    phases = [("save", save), ("restart", restart), ("damaged", damaged), ("carry", carry)]
    for name, fn in phases + ([("s3", s3)] if cfg.get("s3") else []):
        rec.phase(name, fn)
        dist.barrier()


def scenario_inckill(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """A two-rank incremental job for the kill-anywhere harness (tests/reliability/test_incremental_kill.py):
    ``phase`` ``run`` saves steps 1-5 (``full_every=3``, ``keep_local=keep_remote=2``, waiting for each), rank
    ``kill_rank`` armed with the fault point ``fault``; ``check`` restarts: restores the newest step (recording
    whether it is bit-exact), saves the two steps after the newest one started, and restores again."""
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt import CheckpointManager, faults

    if cfg.get("fault") and rank == cfg["kill_rank"]:
        faults._target = faults._parse(cfg["fault"])  # this rank only: the environment is the job's
    root = Path(cfg["root"])
    node, progress = root / f"n{rank}", root / f"progress-r{rank}"
    mesh = init_device_mesh("cpu", (world,))

    def manager() -> Any:
        return CheckpointManager(node, remote=cfg["remote"], collective_timeout_s=cfg["timeout"], incremental=True,
                                 full_every=3, keep_local=2, keep_remote=2, upload_threads=2)

    def run() -> dict[str, Any]:
        with manager() as mgr:
            for s in range(1, 6):
                with progress.open("a") as f:
                    f.write(f"start {s}\n")
                mgr.save(s, state(mesh, s))
                mgr.wait()
                with progress.open("a") as f:
                    f.write(f"done {s}\n")
        return {}

    def check() -> dict[str, Any]:
        with manager() as mgr:
            st = state(mesh, 0, zero=True)
            got = mgr.restore(st)
            first = {"restored": got, "exact": got is not None and exact(st, got)}
            for s in (cfg["next"], cfg["next"] + 1):
                mgr.save(s, state(mesh, s))
                mgr.wait()
            st = state(mesh, 0, zero=True)
            again = mgr.restore(st)
        return {**first, "again": again, "again_exact": again is not None and exact(st, again)}

    rec.phase(cfg["phase"], run if cfg["phase"] == "run" else check)
    dist.barrier()


if __name__ == "__main__":
    run_worker({"inc2": scenario_inc2, "inckill": scenario_inckill})
