"""One rank of a multi-process job for tests/distributed/test_multi_process.py (run as
``python _dist_worker.py SCENARIO RANK CONFIG``).

Each rank joins a gloo process group through a FileStore (no ports), runs the scenario's phases in order and writes
what it saw after every phase to ``<root>/result-<scenario>-r<rank>.json`` (so a rank that dies leaves what it had).
A phase that raises records the error and the next phase runs; the test asserts on each phase's record.

Phases talk to each other only through ``dist.barrier()`` on the default group (the "training" group), never through
files, so the ordering is the one a real job would have.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------------------------------ states
def make_state(rank: int, step: int) -> dict[str, Any]:
    """A per-rank state whose every value depends on the rank and the step (shapes differ across ranks)."""
    n = 64 + 17 * rank
    return {
        "model": {
            "w": torch.arange(n, dtype=torch.float32) * (rank + 1) + step * 1000.0,
            "b": torch.full((3,), rank * 10 + step, dtype=torch.int64),
        },
        "meta": {"rank": rank, "step": step, "tag": f"r{rank}-s{step}"},
    }


def empty_state(rank: int) -> dict[str, Any]:
    n = 64 + 17 * rank
    return {
        "model": {"w": torch.zeros(n, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.int64)},
        "meta": {"rank": -1, "step": -1, "tag": ""},
    }


def summarize(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["model"]["w"].tolist(), "b": state["model"]["b"].tolist(), "meta": dict(state["meta"])}


def err(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "msg": str(exc), "detail": getattr(exc, "detail", str(exc)),
            "step": getattr(exc, "step", None), "classes": [c.__name__ for c in type(exc).__mro__]}


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def phase(self, name: str, fn) -> None:
        try:
            self.put(name, fn())
        except Exception as exc:
            self.put(name, {"phase_error": err(exc), "traceback": traceback.format_exc()})


# ------------------------------------------------------------------------------------------------ helpers
LOADS: list[tuple[str, int]] = []


def spy_on_loads() -> None:
    """Record which tier each successful per-rank load came from (the manager calls ``_restore.prepare``)."""
    from tierckpt.engine import restore as _restore

    orig = _restore.prepare

    def spy(mgr, store, step, state, strict, *args, **kw):
        prepared = orig(mgr, store, step, state, strict, *args, **kw)
        LOADS.append((store.tier, step))
        return prepared

    _restore.prepare = spy


def restore_into_empty(mgr, rank: int, **kw: Any) -> dict[str, Any]:
    LOADS.clear()
    state = empty_state(rank)
    try:
        step = mgr.restore(state, **kw)
    except Exception as exc:
        return {"error": err(exc), "loads": list(LOADS), "state": summarize(state)}
    return {"restored": step, "state": summarize(state), "loads": list(LOADS)}


def guarded_restore_into_empty(mgr, rank: int, **kw: Any) -> dict[str, Any]:
    """A default restore with every tensor read in place and guarded (these tensors are far below the size that
    is otherwise read in place), recording the bytes each of this rank's undo logs put back."""
    from unittest import mock

    from tierckpt.engine import restore as _restore
    from tierckpt.tiers.undo import UndoLog

    put_back: list[int] = []
    real = UndoLog.rollback

    def rollback(log: UndoLog) -> int:
        put_back.append(real(log))
        return put_back[-1]

    with mock.patch.object(_restore, "DIRECT_READ_MIN_BYTES", 0), mock.patch.object(UndoLog, "rollback", rollback):
        return {**restore_into_empty(mgr, rank, **kw), "put_back": put_back}


def wait_result(mgr) -> dict[str, Any] | None:
    try:
        mgr.wait()
    except Exception as exc:
        return err(exc)
    return None


def steps_of(mgr) -> list[list[Any]]:
    return [[i.step, i.state] for i in mgr.steps()]


def listing(folder: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if not folder.exists():
        return out
    for p in sorted(folder.iterdir()):
        out[p.name] = sorted(c.name for c in p.iterdir()) if p.is_dir() else []
    return out


def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def data_file(folder: Path, rank: int) -> Path:
    return sorted(folder.glob(f"r{rank:05d}-p*.safetensors"))[0]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def save_steps(mgr, rank: int, steps: list[int]) -> dict[str, Any]:
    handles = [mgr.save(s, make_state(rank, s), metadata={"step": s}) for s in steps]
    werr = wait_result(mgr)
    return {"wait_error": werr, "persisted": [h.persisted.exception() is None for h in handles]}


# ------------------------------------------------------------------------------------------------ scenarios
def scenario_posix2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """World 2, each rank its own node; shared POSIX remote. Round trip, node replacement, failed save, different
    local progress, one folder shared by both ranks, no process group and no store key left by the manager."""
    from tierckpt import CheckpointManager

    root = Path(cfg["root"])
    T = cfg["timeout"]
    node = root / f"n{rank}"
    remote = root / "remote"

    def roundtrip():
        mgr = CheckpointManager(node, remote=remote, collective_timeout_s=T)
        saved = save_steps(mgr, rank, [1, 2, 3])
        steps = steps_of(mgr)
        mgr.close()
        with CheckpointManager(node, remote=remote, collective_timeout_s=T) as mgr:
            out = restore_into_empty(mgr, rank)
        return {**saved, "steps": steps, **out}

    def replace():
        if rank == 1:
            shutil.rmtree(node)  # node 1 replaced: an empty disk
        dist.barrier()
        with CheckpointManager(node, remote=remote, collective_timeout_s=T) as mgr:
            out = restore_into_empty(mgr, rank)
            out["after"] = save_steps(mgr, rank, [4])
            out["steps"] = steps_of(mgr)
        return out

    def failed_save():
        local = root / f"f{rank}"
        fremote = root / "fremote"
        mgr = CheckpointManager(local, remote=fremote, collective_timeout_s=T)
        first = save_steps(mgr, rank, [1])
        blocker = step_dir(local, 2)
        if rank == 1:
            blocker.write_bytes(b"not a folder")  # rank 1 cannot create its step folder: its save fails
        dist.barrier()
        h = mgr.save(2, make_state(rank, 2))
        werr = wait_result(mgr)
        persisted = h.persisted.exception()
        if rank == 1:
            blocker.unlink()
        dist.barrier()
        listing_after = listing(local)
        out = restore_into_empty(mgr, rank)
        third = save_steps(mgr, rank, [3])
        steps = steps_of(mgr)
        mgr.close()
        return {"first": first, "wait_error": werr, "persisted_error": None if persisted is None else err(persisted),
                "listing_after_failure": listing_after, **out, "third": third, "steps": steps}

    def disk_full():
        local = root / f"d{rank}"
        mgr = CheckpointManager(local, collective_timeout_s=T)
        first = save_steps(mgr, rank, [1])
        if rank == 1:  # rank 1's disk fills up during step 2
            real_open_write = mgr.local.open_write

            def open_write(rel, *, size_hint=None):
                if "step-0000000002" in rel:
                    raise OSError(28, "No space left on device", str(local / rel))
                return real_open_write(rel, size_hint=size_hint)

            mgr.local.open_write = open_write
        h = mgr.save(2, make_state(rank, 2))
        werr = wait_result(mgr)
        persisted = h.persisted.exception()
        listing_after = listing(local)
        out = restore_into_empty(mgr, rank)
        mgr.close()
        return {"first": first, "wait_error": werr, "persisted_error": None if persisted is None else err(persisted),
                "listing_after_failure": listing_after, **out}

    def progress():
        local = root / f"p{rank}"
        with CheckpointManager(local, keep_local=10, collective_timeout_s=T) as mgr:
            saved = save_steps(mgr, rank, [1, 2, 3])
        if rank == 1:
            shutil.rmtree(step_dir(local, 3))  # rank 1 lost its newest step
        dist.barrier()
        out: dict[str, Any] = {"saved": saved}
        with CheckpointManager(local, keep_local=10, collective_timeout_s=T) as mgr:
            out["newest_common"] = restore_into_empty(mgr, rank)
            if rank == 1:
                flip_byte(data_file(step_dir(local, 2), 1))  # and its step 2 is corrupt
            dist.barrier()
            out["corrupt_fallback"] = restore_into_empty(mgr, rank)
            out["corrupt_explicit_guarded"] = guarded_restore_into_empty(mgr, rank, step=2)
            # in place: rank 0 reads its intact step 2 into its tensors, rank 1 finds its copy corrupt; both then
            # load step 1 over whatever they read
            out["corrupt_fallback_in_place"] = restore_into_empty(mgr, rank, in_place=True)
            out["explicit_missing"] = restore_into_empty(mgr, rank, step=3)
            if rank == 0:
                shutil.rmtree(step_dir(local, 1))
                shutil.rmtree(step_dir(local, 2))  # rank 0 holds {3}, rank 1 holds {1, 2 (corrupt)}
            dist.barrier()
            out["disjoint"] = restore_into_empty(mgr, rank)
            for p in local.glob("step-*"):
                shutil.rmtree(p)
            dist.barrier()
            out["nothing"] = restore_into_empty(mgr, rank)
        return out

    def shared():
        local = root / "shared"
        sremote = root / "sremote"
        mgr = CheckpointManager(local, remote=sremote, collective_timeout_s=T)
        topo = mgr.components.coordinator.topology
        saved = save_steps(mgr, rank, [1, 2])
        steps = steps_of(mgr)
        mgr.close()
        with CheckpointManager(local, remote=sremote, collective_timeout_s=T) as mgr:
            out = restore_into_empty(mgr, rank)
        return {**saved, "steps": steps, "node_ranks": list(topo.node_ranks), **out}

    def groups():
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        dist.barrier()
        keys_before = store.num_keys()
        before = len(c10d._world.pg_map)
        mgr = CheckpointManager(root / f"g{rank}", remote=root / "gremote", collective_timeout_s=T)
        during = len(c10d._world.pg_map)
        saved = save_steps(mgr, rank, [1, 2])
        mgr.close()
        with CheckpointManager(root / f"g{rank}", remote=root / "gremote", collective_timeout_s=T) as mgr:
            restored = restore_into_empty(mgr, rank)
        dist.barrier()
        return {"before": before, "during": during, "after": len(c10d._world.pg_map), "saved": saved,
                "restored": restored, "keys_before": keys_before, "keys_after": store.num_keys()}

    for name, fn in [("roundtrip", roundtrip), ("replace", replace), ("failed_save", failed_save),
                     ("disk_full", disk_full), ("progress", progress), ("shared", shared), ("groups", groups)]:
        rec.phase(name, fn)
        dist.barrier()


def scenario_world4(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """World 4 on three nodes: ranks 0 and 1 share node A, rank 2 is node B, rank 3 node C; shared POSIX remote."""
    from tierckpt import CheckpointManager

    root = Path(cfg["root"])
    T = cfg["timeout"]
    node = root / {0: "A", 1: "A", 2: "B", 3: "C"}[rank]
    remote = root / "remote"

    def roundtrip():
        mgr = CheckpointManager(node, remote=remote, collective_timeout_s=T)
        topo = mgr.components.coordinator.topology
        saved = save_steps(mgr, rank, [1, 2])
        steps = steps_of(mgr)
        mgr.close()
        with CheckpointManager(node, remote=remote, collective_timeout_s=T) as mgr:
            out = restore_into_empty(mgr, rank)
        return {**saved, "steps": steps, "node_ranks": list(topo.node_ranks), **out}

    def replace():
        dist.barrier()
        if rank == 0:
            shutil.rmtree(node)  # node A (ranks 0 and 1, rank 0 the remote committer) replaced
        dist.barrier()
        with CheckpointManager(node, remote=remote, collective_timeout_s=T) as mgr:
            return restore_into_empty(mgr, rank)

    for name, fn in [("roundtrip", roundtrip), ("replace", replace)]:
        rec.phase(name, fn)
        dist.barrier()


def scenario_s3(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """World 2, separate nodes, the S3 loopback server as the remote tier; rank 0 (the remote committer) replaced."""
    from tierckpt import CheckpointManager

    root = Path(cfg["root"])
    T = cfg["timeout"]
    node = root / f"n{rank}"
    kw = dict(remote=cfg["remote"], storage_options=cfg["storage_options"], collective_timeout_s=T, upload_part_mb=5)

    def roundtrip():
        mgr = CheckpointManager(node, **kw)
        saved = save_steps(mgr, rank, [1, 2])
        steps = steps_of(mgr)
        mgr.close()
        with CheckpointManager(node, **kw) as mgr:
            out = restore_into_empty(mgr, rank)
        return {**saved, "steps": steps, **out}

    def replace():
        if rank == 0:
            shutil.rmtree(node)
        dist.barrier()
        with CheckpointManager(node, **kw) as mgr:
            return restore_into_empty(mgr, rank)

    for name, fn in [("roundtrip", roundtrip), ("replace", replace)]:
        rec.phase(name, fn)
        dist.barrier()


def scenario_kill1(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Step 1 committed everywhere; then rank 1 is SIGKILLed (TIERCKPT_FAULT=mid-file, set on rank 1 only) while
    persisting step 2. Rank 0 records the error its handle and wait() report, then exits without further collectives."""
    from tierckpt import CheckpointManager, faults

    root = Path(cfg["root"])
    T = cfg["timeout"]
    mgr = CheckpointManager(root / f"n{rank}", remote=root / "remote", collective_timeout_s=T)
    rec.phase("first", lambda: save_steps(mgr, rank, [1]))
    dist.barrier()
    if rank == 1:
        os.environ["TIERCKPT_FAULT"] = "mid-file"
        faults._target = faults._parse(os.environ["TIERCKPT_FAULT"])  # the env is read at import: arm it now
        faults._hits = 0
    t0 = time.monotonic()
    h = mgr.save(2, make_state(rank, 2))
    persisted = h.persisted.exception()
    werr = wait_result(mgr)
    rec.put("second", {"persisted_error": None if persisted is None else err(persisted), "wait_error": werr,
                       "seconds": time.monotonic() - t0})
    try:
        mgr.close(timeout=5)
    except Exception as exc:
        rec.put("close_error", err(exc))
    rec.put("done", True)
    os._exit(0)  # the peer is gone: tearing the process group down could wait on it


def scenario_kill2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Both ranks restarted after the kill: step 1 is everyone's target; step 2 can be saved again."""
    from tierckpt import CheckpointManager

    root = Path(cfg["root"])
    T = cfg["timeout"]
    node = root / f"n{rank}"

    def restart():
        with CheckpointManager(node, remote=root / "remote", collective_timeout_s=T) as mgr:
            at_start = listing(node)
            out = restore_into_empty(mgr, rank)
            out["listing_at_start"] = at_start
            out["again"] = save_steps(mgr, rank, [2])
            out["steps"] = steps_of(mgr)
        with CheckpointManager(node, remote=root / "remote", collective_timeout_s=T) as mgr:
            out["second_restore"] = restore_into_empty(mgr, rank)
        return out

    rec.phase("restart", restart)
    dist.barrier()


def scenario_outage2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """The shared remote refuses every write while 8 steps are saved (keep_local=2, keep_remote=2), then comes back
    for step 9. Records each node's largest local tier, what every rank's handles said, and both tiers at the end."""
    from tierckpt import CheckpointManager
    from tierckpt.storage.faulty import FaultyStore
    from tierckpt.tiers.listing import list_root

    root = Path(cfg["root"])
    T = cfg["timeout"]

    def outage():
        mgr = CheckpointManager(root / f"o{rank}", remote=root / "oremote", keep_local=2, keep_remote=2,
                                collective_timeout_s=T, upload_deadline_s=30)
        real = mgr.remote
        mgr.remote = FaultyStore(real, fail={"makedirs": "all", "open_write": "all", "write_bytes": "all"},
                                 error_factory=lambda op, n: PermissionError(13, f"injected: {op} refused"))
        most, outcomes = 0, []
        for s in range(1, 9):
            h = mgr.save(s, make_state(rank, s))
            h.persisted.result(timeout=60)
            try:
                outcomes.append("skipped" if h.uploaded.result(timeout=60) is None else "uploaded")
            except Exception as exc:
                outcomes.append(type(exc).__name__)
            most = max(most, len(list_root(mgr.local).steps))
        werr = wait_result(mgr)
        dist.barrier()  # each node's retention follows rank 0's decisions on its own upload thread: settled here
        during = sorted(list_root(mgr.local).steps)
        mgr.remote = real
        h = mgr.save(9, make_state(rank, 9))
        up9 = h.uploaded.result(timeout=60)
        wait_result(mgr)  # the catch-up of the failed steps still kept
        dist.barrier()  # every rank's thread took part in every upload the leader decided
        out = {"most": most, "outcomes": outcomes, "during": during, "wait_error": werr,
               "uploaded9": up9 is not None, "local_after": sorted(list_root(mgr.local).steps),
               "remote_after": sorted(list_root(real).steps)}
        mgr.close()
        return out

    rec.phase("outage", outage)
    dist.barrier()


def scenario_rcommit1(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Step 1 uploaded and committed remotely; rank 0 is SIGKILLed in the middle of step 2's remote commit (every
    shard reported, ``manifest.json`` not written: TIERCKPT_FAULT=remote-commit:2 on rank 0). Rank 1 records what
    its handle and wait() say and what the remote holds, then exits without further collectives."""
    from tierckpt import CheckpointManager, faults
    from tierckpt.tiers.listing import list_root

    root = Path(cfg["root"])
    T = cfg["timeout"]
    mgr = CheckpointManager(root / f"k{rank}", remote=root / "kremote", collective_timeout_s=T, upload_deadline_s=5)
    if rank == 0:
        os.environ["TIERCKPT_FAULT"] = "remote-commit:2"
        faults._target = faults._parse(os.environ["TIERCKPT_FAULT"])
        faults._hits = 0
    rec.phase("first", lambda: save_steps(mgr, rank, [1]))
    h = mgr.save(2, make_state(rank, 2))
    h.persisted.result(timeout=60)
    up = h.uploaded.exception(timeout=60)
    rec.put("second", {"upload_error": None if up is None else err(up), "wait_error": wait_result(mgr),
                       "remote": sorted(list_root(mgr.remote).steps), "health": mgr.health().to_dict()})
    rec.put("done", True)
    os._exit(0)  # the peer is gone: tearing the process group down could wait on it


def scenario_rcommit2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Both ranks restarted after rank 0 died mid-commit: step 2 is uploaded again and committed."""
    from tierckpt import CheckpointManager
    from tierckpt.tiers.listing import list_root

    root = Path(cfg["root"])
    T = cfg["timeout"]

    def restart():
        with CheckpointManager(root / f"k{rank}", remote=root / "kremote", collective_timeout_s=T) as mgr:
            before = sorted(list_root(mgr.remote).steps)
            werr = wait_result(mgr)
            out = {"remote_at_start": before, "wait_error": werr, "remote": sorted(list_root(mgr.remote).steps)}
        with CheckpointManager(root / f"k{rank}", remote=root / "kremote", collective_timeout_s=T) as mgr:
            out["restore"] = restore_into_empty(mgr, rank, source="remote")
        return out

    rec.phase("restart", restart)
    dist.barrier()


def scenario_count2(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Three saves to a POSIX remote wrapped to record every read of a ``manifest.json``: while the ranks upload
    and rank 0 commits, no other rank reads one (they learn of the commit through the c10d store)."""
    from tierckpt import CheckpointManager
    from tierckpt.storage.faulty import FaultyStore
    from tierckpt.tiers.listing import list_root

    root = Path(cfg["root"])
    T = cfg["timeout"]

    class Recording(FaultyStore):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.manifest_reads: list[str] = []

        def read_bytes(self, rel: str, *, max_size: int) -> bytes:
            if rel.endswith("manifest.json") and not rel.rsplit("/", 1)[-1].startswith("r"):
                self.manifest_reads.append(rel)
            return super().read_bytes(rel, max_size=max_size)

        def exists(self, rel: str) -> bool:
            if rel.endswith("manifest.json"):
                self.manifest_reads.append(rel)
            return super().exists(rel)

    def count():
        mgr = CheckpointManager(root / f"c{rank}", remote=root / "cremote", collective_timeout_s=T)
        real = mgr.remote
        recording = Recording(real)
        mgr.remote = recording
        saved = save_steps(mgr, rank, [1, 2, 3])
        out = {**saved, "manifest_reads": list(recording.manifest_reads),
               "remote": sorted(list_root(real).steps)}
        mgr.close()
        return out

    rec.phase("count", count)
    dist.barrier()


def scenario_traffic(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    """Every rank its own node, a POSIX remote, ``keep_local=1``: ``cfg["steps"]`` saves, a restart with every
    local tier intact, then one with the last rank's node wiped. Each rank's store traffic is counted (requests
    and bytes it sent and received), apart for the agreements and for the upload messages, around the last save
    and each restart; and the keys this rank set and removed by then (the test combines every rank's)."""
    from tierckpt import CheckpointManager
    from tierckpt import distributed as tdist
    from tierckpt.store_client import StoreTraffic, Traffic

    root = Path(cfg["root"])
    T = cfg["timeout"]
    node, remote = root / f"n{rank}", root / "remote"
    agree, role, upload = Traffic(), Traffic(), Traffic()
    #: every key this rank's managers set or removed: the test combines every rank's to find the keys left
    created: set[str] = set()
    deleted: set[str] = set()
    shared = ("/answer", "/read")

    class Counted(StoreTraffic):
        """The agreements' keys are tierckpt/m<n>/..., the upload messages' the others (their values: not the polls
        that wait for them nor their removal by their last reader); the removal of an agreement's shared keys by
        its last reader counts apart, as "role": which rank does it varies from run to run."""

        def set(self, key: str, value: bytes | str) -> None:
            created.add(key)
            super().set(key, value)

        def add(self, key: str, n: int) -> int:
            created.add(key)
            return super().add(key, n)

        def multi_set(self, keys: list[str], values: list[bytes]) -> None:
            created.update(keys)
            super().multi_set(keys, values)

        def delete_key(self, key: str) -> bool:
            deleted.add(key)
            return super().delete_key(key)

        def _count(self, op: str, sent: int, received: int, key: str) -> None:
            if not key.startswith("tierckpt/m"):
                # how often a follower polls for the next decision, and whether it is the message's last reader
                # (which removes it), is timing
                if op not in ("wait", "check", "delete"):
                    upload.add(op, sent, received)
            elif op == "delete" and key.endswith(shared):
                role.add(op, sent, received)
            else:
                agree.add(op, sent, received)

        def clone(self) -> StoreTraffic:
            return Counted(self.inner.clone(), self.traffic)

    real = tdist._default_store()
    counted = Counted(real)
    tdist._default_store = lambda: counted  # type: ignore[assignment]

    def snap() -> dict[str, Any]:
        return {"agree": agree.snapshot(), "role": role.snapshot(), "upload": upload.snapshot()}

    def delta(before: dict[str, Any]) -> dict[str, Any]:
        after = snap()
        return {k: {f: after[k][f] - before[k][f] for f in ("requests", "sent", "received")} for k in after}

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        dist.barrier()  # every rank has imported what it needs: 16 ranks' imports on 2 busy cores take a while
        mgr = CheckpointManager(node, remote=remote, keep_local=1, collective_timeout_s=T)
        for s in range(1, cfg["steps"]):
            mgr.save(s, make_state(rank, s))
            mgr.wait()
        dist.barrier()
        before = snap()
        mgr.save(cfg["steps"], make_state(rank, cfg["steps"]))
        mgr.wait()
        out["save"] = delta(before)
        mgr.close()
        dist.barrier()
        out["keys_after_save"] = {"created": sorted(created), "deleted": sorted(deleted)}
        for name in ("restart", "wiped"):
            if name == "wiped" and rank == world - 1:
                shutil.rmtree(node)
            dist.barrier()
            before = snap()
            with CheckpointManager(node, remote=remote, keep_local=1, collective_timeout_s=T) as mgr:
                out[f"{name}_restore"] = restore_into_empty(mgr, rank)
                out[name] = delta(before)
            dist.barrier()
            out[f"keys_after_{name}"] = {"created": sorted(created), "deleted": sorted(deleted)}
        return out

    rec.phase("traffic", run)
    dist.barrier()


SCENARIOS = {
    "posix2": scenario_posix2, "world4": scenario_world4, "s3": scenario_s3, "kill1": scenario_kill1,
    "kill2": scenario_kill2, "outage2": scenario_outage2, "count2": scenario_count2,
    "rcommit1": scenario_rcommit1, "rcommit2": scenario_rcommit2, "traffic": scenario_traffic,
}


def run_worker(jobs: dict[str, Any], *, result_name: str | None = None) -> None:
    """A rank's process: ``python WORKER JOB RANK CONFIG`` joins the gloo group of the config's store, runs
    ``jobs[JOB]`` and records into ``result-<result_name or JOB>-r<rank>.json`` under the config's root."""
    import datetime

    job, rank, cfg_path = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    cfg = json.loads(cfg_path.read_text())
    world = cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["store"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"] * 3))
    spy_on_loads()
    name = cfg[result_name] if result_name else job
    rec = Recorder(Path(cfg["root"]) / f"result-{name}-r{rank}.json")
    jobs[job](rank, world, cfg, rec)
    rec.put("done", True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(SCENARIOS)
