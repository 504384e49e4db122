"""One rank of a resharding job for tests/distributed/test_reshard.py
(``python _reshard_worker.py JOB RANK WORLD ROOT``).

Jobs:

- ``save2`` (2 ranks): a DTensor state (fp32/bf16/int64, Shard(0)/Shard(1)/Replicate, uneven shards) committed at
  steps 1 and 2; FSDP2 models + AdamW trained a few steps and committed at step 3 (reference full tensors to
  ``<variant>_ref.pt``; variant ``fsdp`` has dims divisible by 4, ``fsdpu`` uneven ones); a per-rank
  (non-distributed) state committed at step 1.
- ``load4`` (4 ranks): restores all of those with other placements, on a 1-D and a 2-D mesh; the error cases; a state
  saved on a (2, 2) mesh; then damages rank 1's shards in the remote and restores again.
- ``load3`` (3 ranks): the DTensor state onto 3 ranks (uneven) and the per-rank state refused.

Each rank joins a gloo group through a FileStore and writes ``result-<job>-r<rank>.json`` after every phase: what
it saw (steps, bit-exact comparisons per key, errors with their type and message). A phase that raises is recorded
with its traceback and the next phase runs. Comparisons are bitwise (NaN, -0.0 and inf included).

The module imports only torch at import time, so the test can import the state builders cheaply.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 30

# ------------------------------------------------------------------------------------------------ states
#: saved on 2 ranks (1-D mesh)
SAVE_PLACEMENTS = {"w": "S0", "e": "S1", "b": "R", "r": "S0", "i": "S1"}
#: restored on 4 ranks (1-D mesh): every key placed differently from how it was saved
LOAD4_PLACEMENTS = {"w": "S1", "e": "S0", "b": "S0", "r": "R", "i": "S0"}
#: restored on 4 ranks as a (2, 2) mesh
MESH2_PLACEMENTS = {"w": "S0,R", "e": "R,S1", "b": "S0,S0", "r": "S1,S0", "i": "R,R"}
#: restored on 3 ranks (1-D mesh)
LOAD3_PLACEMENTS = {"w": "S0", "e": "S1", "b": "S0", "r": "S1", "i": "R"}
#: saved on 4 ranks as a (2, 2) mesh (by the load4 job), restored on 4 ranks (1-D) and in one process
M2_SAVE_PLACEMENTS = {"a": "S0,R", "c": "R,S1", "d": "R,R", "f": "S1,S0"}
M2_LOAD_PLACEMENTS = {"a": "S1", "c": "S0", "d": "S0", "f": "R"}


def dt_full(version: int) -> dict[str, torch.Tensor]:
    """The global tensors of the DTensor state; ``version`` (the step) changes every value."""
    g = torch.Generator().manual_seed(1000 + version)
    w = torch.randn(9, 7, generator=g)  # 9 rows: 5+4 on 2 ranks; 7 columns: 2+2+2+1 on 4 ranks
    w[0, 0], w[0, 1], w[8, 6], w[4, 3] = float("nan"), -0.0, float("inf"), float("-inf")
    return {
        "w": w,
        "e": torch.randn(5, 11, generator=g).to(torch.bfloat16),  # 11 columns: 6+5; 5 rows: 2+2+1+0 on 4 ranks
        "b": torch.randint(-(2**62), 2**62, (13,), generator=g, dtype=torch.int64),
        "r": torch.randn(6, 3, generator=g),
        "i": torch.randint(-(2**62), 2**62, (7, 2), generator=g, dtype=torch.int64),
    }


def m2_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return {
        "a": torch.randn(7, 5, generator=g),
        "c": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "d": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "f": torch.randn(6, 5, generator=g),
    }


def plain_state(rank: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(rank)), "n": rank}


def bits(t: torch.Tensor) -> torch.Tensor:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}.get(t.dtype)
    return t.contiguous().view(view) if view is not None else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def fsdp_model(uneven: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if uneven:  # 30 and 5 output features: uneven FSDP shards on 4 ranks (8+8+8+6, 2+2+1+0) and on 2 (3+2)
        return torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def fsdp_input() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ plumbing
def err(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "msg": str(exc), "classes": [c.__name__ for c in type(exc).__mro__]}


class Job:
    def __init__(self, name: str, rank: int, world: int, root: Path) -> None:
        self.name, self.rank, self.world, self.root = name, rank, world, root
        self.out = root / f"result-{name}-r{rank}.json"
        self.data: dict[str, Any] = {}

    def phase(self, name: str, fn: Any) -> None:
        import torch.distributed as dist

        try:
            rec = fn()
        except BaseException as exc:  # recorded; the test fails with the traceback
            rec = {"phase_error": err(exc), "traceback": traceback.format_exc()}
        self.data[name] = rec
        self.out.write_text(json.dumps(self.data, indent=1, default=str))
        dist.barrier()


def placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def distribute(full: dict[str, torch.Tensor], mesh: Any, specs: dict[str, str], *, zero: bool) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    return {k: distribute_tensor(torch.zeros_like(v) if zero else v, mesh, placements(specs[k]))
            for k, v in full.items()}


def compare(restored: dict[str, Any], full: dict[str, torch.Tensor], specs: dict[str, str]) -> dict[str, Any]:
    """Per key: bit-exact full tensor, and whether the restored value kept the target's placements."""
    out = {}
    for k, ref in full.items():
        v = restored[k]
        out[k] = {"exact": same(v.full_tensor(), ref),
                  "placements_kept": [str(p) for p in v.placements] == [str(p) for p in placements(specs[k])]}
    return out


def manager(root: Path, local: str, remote: str) -> Any:
    import tierckpt

    return tierckpt.CheckpointManager(root / local, remote=root / remote, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def expect_error(fn: Any) -> dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:
        return {"raised": err(exc)}
    return {"raised": None, "returned": repr(value)}


def full_optim(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict from get_optimizer_state_dict with every DTensor replaced by its full tensor."""
    from torch.distributed.tensor import DTensor

    state = {fqn: {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in s.items()} for fqn, s in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def fsdp_setup(world: int, uneven: bool) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = fsdp_model(uneven)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return mesh, m, opt


def fsdp_compare(m: Any, opt: Any, ref: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = {k: same(v.full_tensor(), ref["model"][k]) for k, v in m.state_dict().items()}
    got = full_optim(get_optimizer_state_dict(m, opt))
    optim = {}
    for fqn, s in ref["optim"]["state"].items():
        for k, v in s.items():
            optim[f"{fqn}.{k}"] = (same(got["state"][fqn][k], v) if isinstance(v, torch.Tensor)
                                   else got["state"][fqn][k] == v)
    return {"model": model, "optim": optim, "model_keys": sorted(ref["model"]) == sorted(model),
            "optim_keys": sorted(got["state"]) == sorted(ref["optim"]["state"])}


# ------------------------------------------------------------------------------------------------ jobs
def job_save2(job: Job) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank = job.rank
    mesh = init_device_mesh("cpu", (job.world,))

    def dt_save() -> dict[str, Any]:
        with manager(job.root, f"node{rank}", "remote") as m:
            for step in (1, 2):
                m.save(step, {"model": distribute(dt_full(step), mesh, SAVE_PLACEMENTS, zero=False), "step": step})
            m.wait()
        return {"ok": True}

    def fsdp_save(variant: str) -> dict[str, Any]:
        try:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            return {"unsupported": f"no FSDP2 in this torch: {exc}"}
        try:
            _mesh, m, opt = fsdp_setup(job.world, uneven=variant == "fsdpu")
            x = fsdp_input()
            for _ in range(3):
                m(x).sum().backward()
                opt.step()
                opt.zero_grad()
        except Exception as exc:  # FSDP2 not usable on CPU/gloo in this torch
            return {"unsupported": f"FSDP2 training on CPU failed: {type(exc).__name__}: {exc}"}
        osd = get_optimizer_state_dict(m, opt)
        ref = {"model": {k: v.full_tensor() for k, v in m.state_dict().items()}, "optim": full_optim(osd)}
        if rank == 0:
            torch.save(ref, job.root / f"{variant}_ref.pt")
        with manager(job.root, f"{variant}_node{rank}", f"{variant}_remote") as mg:
            mg.save(3, {"model": m, "optim": osd})
            mg.wait()
        return {"ok": True, "optim_fqns": sorted(osd["state"])}

    def plain_save() -> dict[str, Any]:
        with manager(job.root, f"plain_node{rank}", "plain_remote") as m:
            m.save(1, plain_state(rank))
            m.wait()
        return {"ok": True}

    job.phase("dt_save", dt_save)
    job.phase("fsdp_save", lambda: fsdp_save("fsdp"))
    job.phase("fsdpu_save", lambda: fsdp_save("fsdpu"))
    job.phase("plain_save", plain_save)


def damage_rank1(root: Path, remote: str, step: int) -> list[str]:
    """Flip one byte inside every tensor of rank 1's data files of ``step`` in the remote; the names changed."""
    from tierckpt.storage.local import LocalStore
    from tierckpt.tiers.reader import read_manifests

    store = LocalStore(root / remote, tier="remote")
    _m, rms = read_manifests(store, step, ranks=[1])
    folder = root / remote / f"step-{step:010d}"
    changed = set()
    for rec in rms[0].tensors:
        if rec.nbytes == 0:
            continue
        f = rms[0].files[rec.file]
        assert not f.compression
        with open(folder / f.name, "r+b") as fh:
            fh.seek(rec.offset + rec.nbytes // 2)
            b = fh.read(1)
            fh.seek(rec.offset + rec.nbytes // 2)
            fh.write(bytes([b[0] ^ 0x5A]))
        changed.add(f.name)
    return sorted(changed)


def job_load4(job: Job) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt.errors import StateMismatchError  # noqa: F401  (imported so a failure to import shows here)

    rank, root = job.rank, job.root
    mesh = init_device_mesh("cpu", (job.world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    # ranks 0 and 1 reuse the saving job's local folders (they hold their own shards); ranks 2 and 3 are new nodes
    mgr = manager(root, f"node{rank}", "remote")

    def dt_1d() -> dict[str, Any]:
        st = {"model": distribute(dt_full(2), mesh, LOAD4_PLACEMENTS, zero=True), "step": 0}
        got = mgr.restore(st)
        return {"restored": got, "step_value": st["step"], "keys": compare(st["model"], dt_full(2), LOAD4_PLACEMENTS)}

    def dt_2d() -> dict[str, Any]:
        st = {"model": distribute(dt_full(2), mesh2, MESH2_PLACEMENTS, zero=True), "step": 0}
        got = mgr.restore(st)
        return {"restored": got, "step_value": st["step"], "keys": compare(st["model"], dt_full(2), MESH2_PLACEMENTS)}

    def dt_empty_target() -> dict[str, Any]:
        # w as Shard(0) on 4 ranks: 9 rows -> 3+3+3+0, so rank 3's box is empty (offset 9, past rank 0's saved rows)
        specs = dict(LOAD4_PLACEMENTS, w="S0")
        st = {"model": distribute(dt_full(2), mesh, specs, zero=True), "step": 0}
        got = mgr.restore(st)
        return {"restored": got, "keys": compare(st["model"], dt_full(2), specs)}

    def dt_shape_mismatch() -> dict[str, Any]:
        full = dt_full(2)
        full["w"] = torch.zeros(9, 8)  # saved global shape is (9, 7)
        st = {"model": distribute(full, mesh, LOAD4_PLACEMENTS, zero=True), "step": 0}
        out = expect_error(lambda: mgr.restore(st))
        out["untouched"] = all(bool((v.full_tensor() == 0).all()) for v in st["model"].values()) and st["step"] == 0
        return out

    def fsdp_load(variant: str) -> dict[str, Any]:
        if not (root / f"{variant}_ref.pt").exists():
            return {"unsupported": "no reference from the saving job"}
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        _mesh, m, opt = fsdp_setup(job.world, uneven=variant == "fsdpu")
        x = fsdp_input()
        m(x).sum().backward()  # one step of a "new" run, so that the optimizer has state to restore into
        opt.step()
        opt.zero_grad()
        st = {"model": m, "optim": get_optimizer_state_dict(m, opt)}
        with manager(root, f"{variant}_node{rank}", f"{variant}_remote") as mg:
            got = mg.restore(st)
        set_optimizer_state_dict(m, opt, st["optim"])
        ref = torch.load(root / f"{variant}_ref.pt", weights_only=False)
        out = fsdp_compare(m, opt, ref)
        # the restored job trains on: one more step runs (all ranks) and keeps every parameter finite
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        out["trains_on"] = all(bool(torch.isfinite(v.full_tensor()).all()) for v in m.state_dict().values())
        out["restored"] = got
        return out

    def plain_refused() -> dict[str, Any]:
        st = {"w": torch.zeros(4), "n": -1}
        with manager(root, f"plain_node{rank}", "plain_remote") as mg:
            out = expect_error(lambda: mg.restore(st))
        out["untouched"] = bool((st["w"] == 0).all()) and st["n"] == -1
        return out

    def m2_save() -> dict[str, Any]:
        full = m2_full()
        with manager(root, f"m2_node{rank}", "m2_remote") as mg:
            mg.save(5, {"t": distribute(full, mesh2, M2_SAVE_PLACEMENTS, zero=False)})
            mg.wait()
            st = {"t": distribute(full, mesh, M2_LOAD_PLACEMENTS, zero=True)}
            got = mg.restore(st)
        return {"restored": got, "keys": compare(st["t"], full, M2_LOAD_PLACEMENTS)}

    def dt_damaged_falls_back() -> dict[str, Any]:
        changed = damage_rank1(root, "remote", 2) if rank == 0 else None
        dist.barrier()
        st = {"model": distribute(dt_full(1), mesh, LOAD4_PLACEMENTS, zero=True), "step": 0}
        got = mgr.restore(st)
        return {"changed": changed, "restored": got, "step_value": st["step"],
                "keys": compare(st["model"], dt_full(1), LOAD4_PLACEMENTS)}

    def dt_damaged_everywhere() -> dict[str, Any]:
        changed = damage_rank1(root, "remote", 1) if rank == 0 else None
        dist.barrier()
        st = {"model": distribute(dt_full(1), mesh, LOAD4_PLACEMENTS, zero=True), "step": 0}
        out = expect_error(lambda: mgr.restore(st))
        out["changed"] = changed
        out["untouched"] = all(bool((v.full_tensor() == 0).all()) for v in st["model"].values()) and st["step"] == 0
        return out

    def index_reads() -> dict[str, Any]:
        """Saved on 4 ranks as Shard(0) of a 1-D mesh, restored on the (2, 2) mesh as (Shard(0), Replicate): the
        rank at (i, j) needs rows 4i..4i+3, saved by ranks 2i and 2i+1, and reads only those ranks' manifests."""
        import tierckpt.engine.restore as restore_mod
        import tierckpt.tiers.sharded as sharded_mod

        full = {"x": torch.arange(24, dtype=torch.float32).reshape(8, 3)}
        with manager(root, f"ix{rank}", "ixremote") as m:
            m.save(1, {"model": distribute(full, mesh, {"x": "S0"}, zero=False)})
            m.wait()
        reads: list[int] = []
        original = restore_mod.read_ranks

        def counting(store: Any, manifest: Any, ranks: Any = None) -> Any:
            reads.extend(ranks or [])
            return original(store, manifest, ranks)

        restore_mod.read_ranks = sharded_mod.read_ranks = counting  # the step manifest's path, the shard index's
        try:
            with manager(root, f"ix{rank}", "ixremote") as m:
                st = {"model": distribute(full, mesh2, {"x": "S0,R"}, zero=True)}
                got = m.restore(st)
        finally:
            restore_mod.read_ranks = sharded_mod.read_ranks = original
        return {"restored": got, "exact": same(st["model"]["x"].full_tensor(), full["x"]),
                "other_ranks_read": sorted(set(reads) - {rank})}

    job.phase("dt_1d", dt_1d)
    job.phase("dt_2d", dt_2d)
    job.phase("index_reads", index_reads)
    job.phase("dt_empty_target", dt_empty_target)
    job.phase("dt_shape_mismatch", dt_shape_mismatch)
    job.phase("fsdp_load", lambda: fsdp_load("fsdp"))
    job.phase("fsdpu_load", lambda: fsdp_load("fsdpu"))
    job.phase("plain_refused", plain_refused)
    job.phase("m2_save", m2_save)
    job.phase("dt_damaged_falls_back", dt_damaged_falls_back)
    job.phase("dt_damaged_everywhere", dt_damaged_everywhere)
    mgr.close()


def job_load3(job: Job) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, root = job.rank, job.root
    mesh = init_device_mesh("cpu", (job.world,))

    def dt_3() -> dict[str, Any]:
        st = {"model": distribute(dt_full(2), mesh, LOAD3_PLACEMENTS, zero=True), "step": 0}
        with manager(root, f"j3_node{rank}", "remote_pristine") as mg:
            got = mg.restore(st)
        return {"restored": got, "step_value": st["step"], "keys": compare(st["model"], dt_full(2), LOAD3_PLACEMENTS)}

    def plain_refused() -> dict[str, Any]:
        st = {"w": torch.zeros(4), "n": -1}
        with manager(root, f"j3_plain_node{rank}", "plain_remote") as mg:
            out = expect_error(lambda: mg.restore(st))
        out["untouched"] = bool((st["w"] == 0).all()) and st["n"] == -1
        return out

    job.phase("dt_3", dt_3)
    job.phase("plain_refused", plain_refused)


JOBS = {"save2": job_save2, "load4": job_load4, "load3": job_load3}


def run(jobs: dict[str, Callable[[Job], None]], after: Callable[[Job], None] | None = None) -> None:
    """Run job ``sys.argv[1]`` of ``jobs`` as rank ``sys.argv[2]`` of ``sys.argv[3]`` in a gloo group under the root
    ``sys.argv[4]``; ``after(job)`` once the group is gone; then exit without the interpreter's teardown."""
    import torch.distributed as dist

    name, rank, world, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg-{name}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    job = Job(name, rank, world, root)
    try:
        jobs[name](job)
    finally:
        dist.destroy_process_group()
    if after is not None:
        after(job)
    os._exit(0)  # skip interpreter teardown (seconds of torch atexit work on a 2-core box)


def keep_pristine_remote(job: Job) -> None:
    """After ``save2``, rank 0 keeps a pristine copy of the remote, for restores after ``load4`` damages it."""
    if job.rank == 0 and job.name == "save2":
        shutil.copytree(job.root / "remote", job.root / "remote_pristine")


def main() -> None:
    run(JOBS, keep_pristine_remote)


if __name__ == "__main__":
    main()
