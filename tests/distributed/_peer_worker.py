"""One rank of a peer-copies job for tests/distributed/test_peers.py (``python _peer_worker.py JOB RANK CONFIG``).

Two "nodes" of ``world // 2`` ranks each: the first half of the ranks share the folder ``<root>/A``, the second
half ``<root>/B``. Job ``save`` saves ``cfg["steps"]`` with ``peer_replicas=1`` (and the remote of
``cfg["remote"]``, if any; with ``cfg["options"]["incremental"]`` the state holds a tensor no step changes),
waits for every copy and closes; job ``restore`` restores into an empty state and records the step, the state and
where this rank's shard came from. Ranks meet only through ``dist.barrier()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed._dist_worker import LOADS, Recorder, empty_state, err, make_state, run_worker, summarize


def node_root(root: Path, rank: int, world: int) -> Path:
    return root / ("A" if rank < world // 2 else "B")


def manager(rank: int, world: int, cfg: dict[str, Any]) -> Any:
    from tierckpt import CheckpointManager

    return CheckpointManager(node_root(Path(cfg["root"]), rank, world), remote=cfg.get("remote"), keep_local=2,
                             peer_replicas=1, collective_timeout_s=cfg["timeout"], remote_timeout_s=5,
                             upload_deadline_s=10, **cfg.get("options", {}))


def frozen(rank: int) -> torch.Tensor:
    """A tensor no step changes: an incremental step references its bytes in the first step's file."""
    return torch.arange(4096, dtype=torch.float32) + rank


def saved_state(rank: int, step: int, cfg: dict[str, Any]) -> dict[str, Any]:
    st = make_state(rank, step)
    if cfg.get("options", {}).get("incremental"):
        st["frozen"] = frozen(rank)
    return st


def job_save(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    def run() -> dict[str, Any]:
        mgr = manager(rank, world, cfg)
        out: dict[str, Any] = {"persisted": []}
        try:
            for s in cfg["steps"]:  # saves spaced out as in training: each one's copy is done before the next
                out["persisted"].append(mgr.save(s, saved_state(rank, s, cfg)).persisted.result(timeout=60)
                                        is not None)
                try:
                    mgr.wait(timeout=60)  # the peer copy too
                except Exception as exc:  # an unreachable remote: the peer copies do not depend on it
                    out["wait_error"] = err(exc)
            peers = mgr.components.engine.peers
            health = mgr.health()
            out |= {"failures": health.peer_failures, "pushed": health.peer_step, "node": peers.ring.node}
            dist.barrier()  # every node's copies are in before any server stops
        finally:
            mgr.close(raise_upload_errors=False)
        return out

    rec.phase("save", run)
    dist.barrier()


def job_restore(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    def run() -> dict[str, Any]:
        state = empty_state(rank)
        incremental = bool(cfg.get("options", {}).get("incremental"))
        if incremental:
            state["frozen"] = torch.zeros(4096)
        LOADS.clear()
        mgr = manager(rank, world, cfg)
        try:
            step = mgr.restore(state)
        finally:
            mgr.close(raise_upload_errors=False)
        fetched = node_root(Path(cfg["root"]), rank, world) / "replicas" / f".fetch-r{rank:05d}"
        return {"step": step, "state": summarize(state), "loads": list(LOADS),
                "frozen": torch.equal(state["frozen"], frozen(rank)) if incremental else None,
                "fetched": sorted(p.name for p in fetched.iterdir()) if fetched.is_dir() else []}

    rec.phase("restore", run)
    dist.barrier()


def job_one_node(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Every rank in one folder: one node, no partner to copy to."""
    from tierckpt import CheckpointManager

    def run() -> dict[str, Any]:
        try:
            CheckpointManager(Path(cfg["root"]) / "only", peer_replicas=1, collective_timeout_s=cfg["timeout"]).close()
        except Exception as exc:
            return {"error": err(exc)}
        return {}

    rec.phase("one_node", run)
    dist.barrier()


JOBS = {"save": job_save, "restore": job_restore, "one_node": job_one_node}


if __name__ == "__main__":
    run_worker(JOBS, result_name="name")
