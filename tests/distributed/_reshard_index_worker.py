"""One rank of a resharding job for tests/distributed/test_reshard_index.py
(``python _reshard_index_worker.py JOB RANK WORLD ROOT``): what each rank reads of a step's metadata.

Jobs:

- ``save4`` (4 ranks): a DTensor state (Shard(0), Shard(1), Replicate on a 1-D mesh) committed at step 1, each
  rank's local folder ``n<rank>``, the remote ``remote``; then a model under FSDP2 over tensor parallelism on a
  (dp=2, tp=2) mesh (its column-wise layer's placements ``_StridedShard(0), Shard(0)``) and its optimizer,
  committed at step 3 to ``remote_2d`` (local folders ``t<rank>``).
- ``load2`` (2 ranks, reusing ``n0`` and ``n1``): restores it onto 2 ranks from ``remote`` (with its shard index),
  ``remote_old`` (the index removed: a step saved before indexes) and ``remote_bad`` (the index damaged), then
  commits step 2 from 2 ranks to ``remote2``; restores step 3 of ``remote_2d`` into the same model under FSDP2
  alone on 2 ranks (fresh local folders).
- ``load4`` (4 ranks, fresh local folders): restores step 2 of ``remote2`` onto 4 ranks, and step 3 of
  ``remote_2d`` into the saving job's own layout (FSDP2 over tensor parallelism on (dp=2, tp=2)).

Every read of a remote file is counted per rank (bytes and requests, by kind: the step manifest, the shard index,
rank manifests) and recorded with the phase, beside whether the restore was bit-exact.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed._reshard_worker import Job, distribute, manager, run, same  # noqa: E402

SAVE = {"w": "S0", "e": "S1", "b": "R"}


def full() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3),
            "e": torch.arange(6 * 8, dtype=torch.int64).reshape(6, 8) * 7,
            "b": torch.arange(5, dtype=torch.float32) - 2.5}


class Reads:
    """Counts every read of a remote file in this process, by kind of file."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[int]] = {}
        self.rank_manifests: list[str] = []

    def add(self, tier: str, rel: str, n: int) -> None:
        if tier != "remote":
            return
        name = rel.rsplit("/", 1)[-1]
        kind = ("step_manifest" if name == "manifest.json" else "index" if name.startswith("shards-")
                else "rank_manifest" if name.endswith(".manifest.json") else "data")
        self.by_kind.setdefault(kind, []).append(n)
        if kind == "rank_manifest":
            self.rank_manifests.append(name.split("-", 1)[0])

    def record(self) -> dict[str, Any]:
        return {"bytes": {k: sum(v) for k, v in self.by_kind.items()},
                "requests": {k: len(v) for k, v in self.by_kind.items()},
                "rank_manifests": sorted(set(self.rank_manifests))}


def counting() -> Reads:
    """Count the remote's reads (a POSIX remote: LocalStore) from here on."""
    from tierckpt.storage.local import LocalStore

    reads = Reads()
    read_bytes, readinto_many = LocalStore.read_bytes, LocalStore.readinto_many

    def counted_read_bytes(self: Any, rel: str, *, max_size: int) -> bytes:
        raw = read_bytes(self, rel, max_size=max_size)
        reads.add(self.tier, rel, len(raw))
        return raw

    def counted_readinto_many(self: Any, rel: str, offset: int, bufs: list[memoryview]) -> int:
        n = readinto_many(self, rel, offset, bufs)
        reads.add(self.tier, rel, n)
        return n

    LocalStore.read_bytes = counted_read_bytes  # type: ignore[method-assign]
    LocalStore.readinto_many = counted_readinto_many  # type: ignore[method-assign]
    return reads


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def restore(job: Job, mesh: Any, local: str, remote: str, specs: dict[str, str], step: int) -> dict[str, Any]:
    reads = counting()
    st = {"model": distribute(full(), mesh, specs, zero=True)}
    warned = Warnings()
    logging.getLogger("tierckpt").addHandler(warned)
    try:
        with manager(job.root, local, remote) as m:
            got = m.restore(st)
    finally:
        logging.getLogger("tierckpt").removeHandler(warned)
    exact = {k: same(v.full_tensor(), full()[k]) for k, v in st["model"].items()}
    return {"restored": got, "step": step, "exact": exact, "warnings": warned.messages} | reads.record()


def plain_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))


def model_2d(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 over tensor parallelism on a (dp=2, tp=2) mesh, trained one step (so the optimizer holds state)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = plain_model(seed)
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def model_fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model under FSDP2 alone on 2 ranks, trained one step (so its optimizer has state to restore)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = plain_model(seed)
    fully_shard(m, mesh=init_device_mesh("cpu", (2,)))
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 8)).sum().backward()
    opt.step()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model's and the optimizer's state, whole."""
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update((f"optim.{i}.{k}", v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items())
    return out


def restore_2d(job: Job, built: tuple[torch.nn.Module, torch.optim.Optimizer], local: str) -> dict[str, Any]:
    """Restore step 3 of ``remote_2d`` into a model and optimizer trained one step (so the optimizer has state to
    restore into), from the fresh local folder ``local``; whether every tensor is the saved one, bit for bit."""
    reads = counting()
    model, opt = built
    train_step(model, opt)
    st = {"model": model.state_dict(), "optim": opt.state_dict()}
    with manager(job.root, local, "remote_2d") as m:
        got = m.restore(st)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optim"])
    ref, now = torch.load(job.root / "full_2d.pt"), full_state(model, opt)
    exact = {k: same(now[k], v) for k, v in ref.items()} | {"same keys": sorted(now) == sorted(ref)}
    return {"restored": got, "exact": exact, "warnings": []} | reads.record()


def job_save4(job: Job) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (job.world,))

    def save() -> dict[str, Any]:
        with manager(job.root, f"n{job.rank}", "remote") as m:
            m.save(1, {"model": distribute(full(), mesh, SAVE, zero=False)})
            m.wait()
        return {"ok": True}

    def save_2d() -> dict[str, Any]:
        model, opt = model_2d(0)
        train_step(model, opt)
        sd = model.state_dict()
        placed = {k: [str(p) for p in v.placements] for k, v in sd.items()}
        whole = full_state(model, opt)
        with manager(job.root, f"t{job.rank}", "remote_2d") as m:
            m.save(3, {"model": sd, "optim": opt.state_dict()})
            m.wait()
        if job.rank == 0:
            torch.save(whole, job.root / "full_2d.pt")
        return {"placements": placed}

    def strided_not_a_box() -> dict[str, Any]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard

        # rows 2r, 2r+1 and 8+2r, 8+2r+1 of 16: two stretches, not one box
        local = torch.arange(4, dtype=torch.float32) + 100 * job.rank
        t = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2)], shape=torch.Size([16]),
                               stride=(1,), run_check=False)
        from torch.distributed.tensor import Partial

        partial = DTensor.from_local(local, mesh, [Partial()], run_check=False)  # a sum not yet reduced
        out: dict[str, Any] = {"raised": None, "partial": None}
        with manager(job.root, f"s{job.rank}", "remote_strided") as m:
            for key, value in (("raised", t), ("partial", partial)):
                try:
                    m.save(4, {"t": value})
                except TypeError as exc:
                    out[key] = str(exc)
            out["steps"] = [s.step for s in m.steps()]
        return out

    job.phase("save", save)
    job.phase("save_2d", save_2d)
    job.phase("strided_not_a_box", strided_not_a_box)


def job_load2(job: Job) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (job.world,))
    local = f"n{job.rank}"  # each rank's node still holds the saving job's shard of the same rank
    job.phase("indexed", lambda: restore(job, mesh, local, "remote", SAVE, 1))
    job.phase("old", lambda: restore(job, mesh, local, "remote_old", SAVE, 1))
    job.phase("corrupt", lambda: restore(job, mesh, local, "remote_bad", SAVE, 1))

    def save() -> dict[str, Any]:
        with manager(job.root, f"m{job.rank}", "remote2") as m:
            m.save(2, {"model": distribute(full(), mesh, SAVE, zero=False)})
            m.wait()
        return {"ok": True}

    job.phase("save2", save)

    # fresh nodes, FSDP2 alone on 2 ranks: the 2-D step resharded
    job.phase("fsdp_from_2d", lambda: restore_2d(job, model_fsdp(1), f"u{job.rank}"))


def job_load4(job: Job) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (job.world,))
    # fresh nodes: every rank reads from the remote
    job.phase("indexed", lambda: restore(job, mesh, f"k{job.rank}", "remote2", {"w": "S0", "e": "S1", "b": "S0"}, 2))

    # fresh nodes, the saving job's (dp, tp) layout: strided targets, each rank's own saved shards
    job.phase("same_2d", lambda: restore_2d(job, model_2d(1), f"v{job.rank}"))


JOBS = {"save4": job_save4, "load2": job_load2, "load4": job_load4}


def main() -> None:
    run(JOBS)


if __name__ == "__main__":
    main()
