"""Single-process twins of the multi-rank error paths of tests/distributed/test_multi_process.py.

Two levels, both in this process, no torch.distributed:

- the storage protocol of :mod:`tierckpt.tiers.sharded`, called directly on a LocalStore with world-size-2 steps
  built by hand (discard_shard, commit_step and its cleanup, holds_rank);
- the manager's multi-rank paths (:mod:`tierckpt.engine.sharded`) as rank 0 of a world of 2, rank 1 scripted: a fake
  coordinator hands rank 0's answer functions what rank 1 would have sent, or fails as when rank 1 never arrives.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.manager as manager_module
from tierckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    UploadError,
)
from tierckpt.distributed import AgreementError, Coordinator, Lane, Topology
from tierckpt.engine import sharded as _sharded
from tierckpt.format import hashing, layout
from tierckpt.format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from tierckpt.format.safetensors import build_header
from tierckpt.storage.base import join
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import sharded
from tierckpt.tiers.listing import list_root
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.verify import verify_step

pytestmark = pytest.mark.timeout(60)

WORLD = 2


# ------------------------------------------------------------------------------------------------ hand-built shards
@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    save_id: str
    manifest: RankManifest
    raw: bytes  # the rank manifest's bytes
    files: dict[str, bytes]

    @property
    def ref(self) -> RankRef:
        return RankRef(self.rank, layout.rank_manifest_name(self.rank, self.save_id), len(self.raw),
                       hashing.digest(self.raw).hex())


def build_shard(step: int, rank: int, save_id: str, *, sizes: tuple[int, ...] = (100, 37)) -> Shard:
    """One rank's valid shard of a world-size-2 step: one safetensors file of U8 tensors, and its rank manifest."""
    rng = random.Random(step * 100 + rank)
    entries = [(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)]
    header = build_header(entries, {"format": "pt"})
    payloads = [rng.randbytes(n) for n in sizes]
    digests = [hashing.digest(header)]
    tensors, offset = [], len(header)
    for i, ((name, dtype, shape, n), payload) in enumerate(zip(entries, payloads)):
        d = hashing.digest(payload)
        digests.append(d)
        tensors.append(TensorRecord(i, name, f"state[{name!r}]", dtype, shape, 0, offset, n, d.hex()))
        offset += n
    data = header + b"".join(payloads)
    fname = layout.data_file_name(rank, 0, save_id)
    rm = RankManifest(step=step, rank=rank, world_size=WORLD, save_id=save_id,
                      files=(FileRecord(fname, len(data), hashing.file_checksum(digests), len(header)),),
                      tensors=tuple(tensors), tree={"kind": "test"}, metadata=None)
    return Shard(rank, save_id, rm, rm.to_bytes(), {fname: data})


def place(store: LocalStore, step: int, shard: Shard) -> None:
    """A rank's shard durable in ``step-<N>/`` without a step manifest (what persist_shard leaves)."""
    folder = layout.step_dir(step)
    store.makedirs(folder)
    for name, data in shard.files.items():
        store.write_bytes(join(folder, name), data)
    store.write_bytes(join(folder, shard.ref.name), shard.raw)


def step_manifest(step: int, save_id: str, shards: list[Shard], holds: tuple[int, ...] | None) -> StepManifest:
    return StepManifest(step=step, world_size=WORLD, save_id=save_id, ranks=tuple(s.ref for s in shards),
                        total_bytes=sum(s.manifest.total_bytes for s in shards), holds_ranks=holds)


def names(store: LocalStore, step: int) -> list[str]:
    return store.list(layout.step_dir(step))


@pytest.fixture
def node(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "node0", tier="local")


@pytest.fixture
def remote(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "remote", tier="remote")


SID, OLD = "a" * 16, "b" * 16


# ------------------------------------------------------------------------------------------------ discard_shard
def test_discard_shard_removes_only_this_ranks_files_of_this_save(node: LocalStore) -> None:
    place(node, 5, build_shard(5, 0, SID))
    place(node, 5, build_shard(5, 1, SID))  # two ranks on one node
    place(node, 5, build_shard(5, 0, OLD))
    sharded.discard_shard(node, 5, 0, SID)
    left = names(node, 5)
    assert not [n for n in left if n.startswith("r00000-") and SID in n]
    assert [n for n in left if n.startswith("r00001-")] and [n for n in left if OLD in n]


def test_discard_shard_removes_the_folder_once_empty_and_tolerates_a_missing_one(node: LocalStore) -> None:
    place(node, 5, build_shard(5, 0, SID))
    sharded.discard_shard(node, 5, 0, SID)
    assert not node.exists(layout.step_dir(5))
    sharded.discard_shard(node, 6, 0, SID)  # the rank failed before making its step folder
    assert not node.exists(layout.step_dir(6))


def test_discard_shard_keeps_files_a_committed_manifest_names(node: LocalStore) -> None:
    shards = [build_shard(5, 0, SID)]
    place(node, 5, shards[0])
    sharded.commit_step(node, step_manifest(5, SID, [shards[0], build_shard(5, 1, SID)], (0,)))
    before = names(node, 5)
    sharded.discard_shard(node, 5, 0, SID)
    assert names(node, 5) == before


def test_discard_shard_ignores_a_corrupt_step_manifest(node: LocalStore) -> None:
    place(node, 5, build_shard(5, 0, SID))
    node.write_bytes(join(layout.step_dir(5), layout.STEP_MANIFEST), b"{not json")
    sharded.discard_shard(node, 5, 0, SID)
    assert names(node, 5) == [layout.STEP_MANIFEST]


def test_discard_shard_is_best_effort_when_the_step_path_is_not_a_folder(node: LocalStore) -> None:
    node.write_bytes(layout.step_dir(5), b"a file where the step folder should be")
    sharded.discard_shard(node, 5, 0, SID)
    assert node.read_bytes(layout.step_dir(5), max_size=100) == b"a file where the step folder should be"  # not ours


# ------------------------------------------------------------------------------------------------ commit_step
def test_commit_step_on_a_node_removes_older_saves_of_held_ranks_only(node: LocalStore) -> None:
    new0, new1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(node, 5, new0)
    place(node, 5, build_shard(5, 0, OLD))  # an older save of step 5 by rank 0 (same node)
    place(node, 5, build_shard(5, 1, OLD))  # a file of a rank this node does not hold (left alone)
    sharded.commit_step(node, step_manifest(5, SID, [new0, new1], (0,)))
    left = names(node, 5)
    assert layout.STEP_MANIFEST in left
    assert not [n for n in left if n.startswith("r00000-") and OLD in n]
    assert [n for n in left if n.startswith("r00001-") and OLD in n]
    assert [n for n in left if n.startswith("r00000-") and SID in n]
    m, rms = read_manifests(node, 5)
    assert m.holds_ranks == (0,) and [rm.rank for rm in rms] == [0]


def test_commit_step_without_holds_removes_every_older_save(remote: LocalStore) -> None:
    new = [build_shard(5, r, SID) for r in range(WORLD)]
    for s in new + [build_shard(5, r, OLD) for r in range(WORLD)]:
        place(remote, 5, s)
    sharded.commit_step(remote, step_manifest(5, SID, new, None))
    assert not [n for n in names(remote, 5) if OLD in n]
    assert verify_step(remote, 5).ok


def test_a_node_copy_holds_only_its_ranks(node: LocalStore) -> None:
    s0, s1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(node, 5, s0)
    sharded.commit_step(node, step_manifest(5, SID, [s0, s1], (0,)))
    assert sharded.holds_rank(node, 5, 0) and not sharded.holds_rank(node, 5, 1)
    assert not sharded.holds_rank(node, 6, 0)  # no such step
    with pytest.raises(CheckpointNotFoundError, match=r"holds ranks \[0\] only"):
        read_manifests(node, 5, ranks=[1])
    report = verify_step(node, 5)
    assert report.ok and report.ranks == [0] and report.world_size == WORLD


def test_holds_rank_lets_the_loader_report_a_corrupt_manifest(node: LocalStore) -> None:
    node.makedirs(layout.step_dir(5))
    node.write_bytes(join(layout.step_dir(5), layout.STEP_MANIFEST), b"garbage")
    assert sharded.holds_rank(node, 5, 1)


# ------------------------------------------------------------------------------------------------ remote commit
def test_a_remote_step_committed_with_every_rank_holds_and_verifies_each(remote: LocalStore) -> None:
    s0, s1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(remote, 5, s0)
    place(remote, 5, s1)
    sharded.commit_step(remote, step_manifest(5, SID, [s0, s1], None))
    assert sharded.holds_rank(remote, 5, 0) and sharded.holds_rank(remote, 5, 1)
    report = verify_step(remote, 5)
    assert report.ok and report.ranks == [0, 1]


# --------------------------------------------------------------------------------------------- manager, rank 1 scripted
class FakeCoordinator(Coordinator):
    """Rank 0 of a world of 2; ``peer(lane, obj)`` returns what rank 1 hands in to each agreement, or raises as if
    rank 1 never arrived (it died or hung). Rank 0's real answer functions run on both inputs."""

    def __init__(self, peer: Callable[[str, Any], Any]) -> None:  # no store: nothing to connect to
        self.topology = Topology(rank=0, world_size=WORLD, node_ranks=(0,), run_id="single-process-twin")
        self._rank, self._world = 0, WORLD
        self.persist_lane, self.main_lane = Lane("persist", None), Lane("main", None)
        self.peer = peer
        self.calls: list[tuple[str, Any]] = []

    def exchange(self, obj: Any, lane: Lane, answer: Callable[[list[Any]], list[Any]], *, what: str,
                 step: int | None = None) -> Any:
        lane.next()
        self.calls.append((lane.name, obj))
        try:
            theirs = self.peer(lane.name, obj)
        except Exception:
            raise AgreementError(f"ranks could not agree ({what}); rank 1 never reached it (died or hung)",
                                 ranks=[1], step=step) from None
        return answer([obj, theirs])[0]

    def upload_channel(self) -> Any:
        return _LeaderChannel(self)


class _LeaderChannel:
    """Rank 0's side of the replication decisions; rank 1 of a twin reads none (its uploads are simulated)."""

    leader = True

    def __init__(self, coord: FakeCoordinator) -> None:
        self.coord = coord

    def publish(self, seq: int, decision: dict[str, Any]) -> None:
        self.coord.calls.append(("upload-decision", (seq, decision)))

    def receive(self, seq: int, timeout_s: float) -> None:  # pragma: no cover - rank 0 never receives
        raise AssertionError("the leader receives no decision")

    def post(self, name: str, value: dict[str, Any]) -> None:
        self.coord.calls.append(("upload-message", (name, value)))

    def fetch(self, names: list[str], timeout_s: float | None, *, readers: int) -> dict[str, Any]:
        time.sleep(min(timeout_s or 0.0, 1.0))  # rank 1 never reports: the wait runs out
        return {}


def ok_peer() -> Callable[[str, Any], Any]:
    """Rank 1 that succeeds at everything, its shard on another node, and holds every step rank 0 holds."""

    def peer(lane: str, obj: Any) -> Any:
        if lane == "persist":
            if isinstance(obj, dict) and ("ref" in obj or "error" in obj):  # "shards written"
                if "error" in obj:  # rank 0 failed; rank 1 itself succeeded (its shard name does not matter here)
                    return {"ref": (1, layout.rank_manifest_name(1, "0" * 16), 123, "0" * 32), "bytes": 0,
                            "node": (1,)}
                sid = obj["ref"][1].split("-", 1)[1].split(".", 1)[0]
                return {"ref": (1, layout.rank_manifest_name(1, sid), 123, "0" * 32), "bytes": obj["bytes"],
                        "node": (1,)}
            return {}  # "committed on every node"
        if isinstance(obj, dict):  # restore candidates: the same as rank 0's
            return dict(obj)
        if isinstance(obj, tuple) and len(obj) == 2 and not isinstance(obj[0], str):  # start-up: (host, folder)
            return ("other-host", obj[1])
        return obj if obj is None or isinstance(obj, list) else ("ok", "")

    return peer


def twin_manager(local: Path, peer: Callable[[str, Any], Any], *, channel: Callable[[Any], Any] | None = None,
                 **kw: Any) -> tuple[CheckpointManager, FakeCoordinator]:
    """Rank 0 of a world of 2 whose coordinator is a :class:`FakeCoordinator` (``channel(coord)``: its upload
    channel, else one where rank 1 never reports). The manager is built as any rank 0 is; only the class it
    makes its coordinator from is swapped while it is built."""
    kw.setdefault("log_records", False)
    coord = FakeCoordinator(peer)
    if channel is not None:
        coord.upload_channel = lambda: channel(coord)  # type: ignore[method-assign]
    real = manager_module.Coordinator
    manager_module.Coordinator = lambda *_a, **_k: coord  # type: ignore[assignment,misc]
    try:
        mgr = CheckpointManager(local, rank=0, world_size=WORLD, **kw)
    finally:
        manager_module.Coordinator = real  # type: ignore[misc]
    return mgr, coord


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.arange(50, dtype=torch.float32) + step, "step": step}


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(50), "step": -1}


def test_twin_rank1_save_fails_step_uncommitted_error_names_rank1(tmp_path: Path) -> None:
    fail_step = {2}

    def peer(lane: str, obj: Any) -> Any:
        if lane == "persist" and isinstance(obj, dict) and "ref" in obj:
            step = next(iter(fail_step)) if fail_step else None
            if (step is not None
                    and obj["ref"][1].split("-", 1)[1].split(".")[0] == _sharded.save_id("single-process-twin", step)):
                return {"error": "OSError: [Errno 28] No space left on device"}
        return ok_peer()(lane, obj)

    mgr, _ = twin_manager(tmp_path / "n0", peer)
    mgr.save(1, state_at(1))
    mgr.wait()
    h = mgr.save(2, state_at(2))
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] failed to save: rank 1: OSError.*No space") as ei:
        mgr.wait()
    assert ei.value.step == 2
    assert isinstance(h.persisted.exception(), CheckpointError)
    assert not (tmp_path / "n0" / "step-0000000002").exists()  # rank 0 discarded its shard
    st = empty()
    assert mgr.restore(st) == 1 and st["step"] == 1 and torch.equal(st["w"], state_at(1)["w"])
    fail_step.clear()
    mgr.save(3, state_at(3))
    mgr.wait()
    assert sorted(list_root(mgr.local).steps) == [1, 3]
    m = read_manifests(mgr.local, 3)[0]
    assert m.holds_ranks == (0,) and [r.rank for r in m.ranks] == [0]  # a node's copy lists its own ranks only
    assert m.world_size == WORLD
    mgr.close()


def test_twin_rank1_dies_during_the_agreement(tmp_path: Path) -> None:
    dead = {"now": False}

    def peer(lane: str, obj: Any) -> Any:
        if dead["now"] and lane == "persist":
            raise TimeoutError("rank 1 never set its key")
        return ok_peer()(lane, obj)

    mgr, coord = twin_manager(tmp_path / "n0", peer)
    mgr.save(1, state_at(1))
    mgr.wait()
    dead["now"] = True
    h = mgr.save(2, state_at(2))
    with pytest.raises(CheckpointError, match="rank 1 never reached it") as ei:
        mgr.wait()
    assert ei.value.step == 2 and "step 2" in str(ei.value)
    assert isinstance(h.persisted.exception(), CheckpointError)
    # rank 0's shard stays in step-2/ without a step manifest: never a checkpoint ...
    assert list_root(mgr.local).steps.keys() == {1}
    assert "step-0000000002" in list_root(mgr.local).incomplete
    dead["now"] = False
    st = empty()
    assert mgr.restore(st) == 1 and st["step"] == 1
    # ... and the node leader's start-up recovery removes it
    _sharded.recover_local(mgr.local, coord)
    assert not (tmp_path / "n0" / "step-0000000002").exists()
    assert coord.calls[-1] == ("main", None)  # the barrier after the cleanup
    mgr.close()


def test_twin_rank0s_own_save_fails_error_names_rank0(tmp_path: Path) -> None:
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer())
    mgr.save(1, state_at(1))
    mgr.wait()
    (tmp_path / "n0" / "step-0000000002").write_bytes(b"not a folder")
    mgr.save(2, state_at(2))
    try:
        with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\] failed to save") as ei:
            mgr.wait()
        assert ei.value.step == 2
    finally:
        (tmp_path / "n0" / "step-0000000002").unlink()
        mgr.close()


def test_twin_commit_fails_on_rank1s_node(tmp_path: Path) -> None:
    def peer(lane: str, obj: Any) -> Any:
        if lane == "persist" and obj == {}:
            return {"error": "OSError: [Errno 5] Input/output error"}
        return ok_peer()(lane, obj)

    mgr, _ = twin_manager(tmp_path / "n0", peer)
    mgr.save(1, state_at(1))
    with pytest.raises(CheckpointError, match=r"node\(s\) of rank\(s\) \[1\].*Input/output") as ei:
        mgr.wait()
    assert ei.value.step == 1
    mgr.close()


def test_twin_type_error_at_save_happens_before_any_collective(tmp_path: Path) -> None:
    mgr, coord = twin_manager(tmp_path / "n0", ok_peer())
    started = list(coord.calls)  # the start-up agreements
    with pytest.raises(TypeError, match=r"state\['extra'\]"):
        mgr.save(1, {"w": torch.ones(3), "extra": object()})
    mgr.wait()
    assert coord.calls == started and list_root(mgr.local).steps == {}
    mgr.close()


# ------------------------------------------------------------------------------------------------ restore agreement
def saved_twin(tmp_path: Path, steps: list[int], peer: Callable[[str, Any], Any]) -> CheckpointManager:
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer(), keep_local=10)
    for s in steps:
        mgr.save(s, state_at(s))
    mgr.wait()
    mgr.components.coordinator.peer = peer
    return mgr


def restore_peer(candidates: list[int], outcome: Callable[[], tuple[str, str]] = lambda: ("ok", "")):
    def peer(lane: str, obj: Any) -> Any:
        assert lane == "main"
        if obj is None or isinstance(obj, list):  # start-up: the clean-up barrier, the steps every rank holds
            return obj
        return {"local": list(candidates)} if isinstance(obj, dict) else outcome()  # rank 1's node-local steps

    return peer


def test_twin_different_progress_newest_common_step(tmp_path: Path) -> None:
    mgr = saved_twin(tmp_path, [1, 2, 3], restore_peer([1, 2]))
    st = empty()
    assert mgr.restore(st) == 2 and st["step"] == 2 and torch.equal(st["w"], state_at(2)["w"])
    st = empty()
    with pytest.raises(CheckpointNotFoundError, match=r"rank\(s\) \[1\] find no committed copy") as ei:
        mgr.restore(st, step=3)
    assert ei.value.step == 3 and st == {"w": st["w"], "step": -1} and not st["w"].any()
    mgr.close()


def test_twin_no_common_step_is_an_error_nothing_anywhere_is_none(tmp_path: Path) -> None:
    mgr = saved_twin(tmp_path, [3], restore_peer([1, 2]))
    st = empty()
    with pytest.raises(CorruptCheckpointError, match="no step is committed for every rank"):
        mgr.restore(st)
    assert st["step"] == -1
    mgr.components.coordinator.peer = restore_peer([])  # rank 1 holds nothing
    with pytest.raises(CorruptCheckpointError, match="no step is committed for every rank"):
        mgr.restore(empty())
    mgr.close()
    mgr, _ = twin_manager(tmp_path / "empty", restore_peer([]))
    assert mgr.restore(empty()) is None
    mgr.close()


def test_twin_rank1s_copy_corrupt_everyone_falls_back_state_untouched_by_the_rejected_step(tmp_path: Path) -> None:
    outcomes = iter([("corrupt", "r00001-p0000-x.safetensors: checksum mismatch"), ("ok", "")])
    mgr = saved_twin(tmp_path, [1, 2], restore_peer([1, 2], lambda: next(outcomes)))
    st = empty()
    assert mgr.restore(st) == 1
    assert st["step"] == 1 and torch.equal(st["w"], state_at(1)["w"])
    mgr.close()


def test_twin_rank1s_copy_corrupt_in_every_step(tmp_path: Path) -> None:
    mgr = saved_twin(tmp_path, [1, 2], restore_peer([1, 2], lambda: ("corrupt", "checksum mismatch in r00001")))
    st = empty()
    with pytest.raises(CorruptCheckpointError, match=r"step 2: rank 1: checksum mismatch.*step 1: rank 1"):
        mgr.restore(st)
    assert st["step"] == -1 and not st["w"].any()
    mgr.close()


def test_twin_state_mismatch_on_rank1_is_raised_on_every_rank(tmp_path: Path) -> None:
    mgr = saved_twin(tmp_path, [1], restore_peer([1], lambda: ("mismatch", "state['w']: shape (50,) != (7,)")))
    st = empty()
    with pytest.raises(StateMismatchError, match=r"rank 1: state\['w'\]"):
        mgr.restore(st)
    assert st["step"] == -1 and not st["w"].any()
    mgr.close()


# ------------------------------------------------------------------------------------------------ remote, rank 1 absent
def test_twin_rank1_never_uploads_remote_commit_times_out_naming_it(tmp_path: Path) -> None:
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer(), remote=tmp_path / "remote", upload_deadline_s=0.3)
    h = mgr.save(1, state_at(1))
    with pytest.raises(UploadError, match=r"ranks \[1\] did not upload") as ei:
        mgr.wait()
    assert ei.value.step == 1
    assert isinstance(h.uploaded.exception(), UploadError)
    assert list_root(mgr.remote).steps == {}
    assert list_root(mgr.local).steps.keys() == {1}  # the local copy is kept
    assert any(n.startswith("r00000-") for n in mgr.remote.list("step-0000000001"))
    mgr.close()


# ------------------------------------------------------------------------------------------------ remote throttling
class _Throttle:
    """WSGI middleware in front of moto: answers 503 SlowDown (as S3 does past its per-prefix rates) to the first
    ``n`` requests of each kind that rank 0's remote commit sends (the listing of ``step-N/`` and the PUT of its
    ``manifest.json``), then lets them through."""

    BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")

    def __init__(self, app: Any, n: int) -> None:
        self.app, self.n = app, n
        self.throttled: dict[str, int] = {"list": 0, "put-manifest": 0}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        method, path, query = environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        kind = ("list" if method == "GET" and "prefix=run%2Fstep-" in query
                else "put-manifest" if method == "PUT" and path.endswith("/manifest.json") else None)
        if kind is not None and self.throttled[kind] < self.n:
            self.throttled[kind] += 1
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(self.BODY)))])
            return [self.BODY]
        return self.app(environ, start_response)


class _ReportingChannel(_LeaderChannel):
    """Rank 0's channel of a twin whose rank 1 uploaded its shard: its report is there at once."""

    def __init__(self, coord: FakeCoordinator, report: Callable[[str], dict[str, Any]]) -> None:
        super().__init__(coord)
        self.report = report

    def fetch(self, names: list[str], timeout_s: float | None, *, readers: int) -> dict[str, Any]:
        return {n: self.report(n) for n in names if n.endswith("/r1")}


def test_throttling_during_the_remote_commit_is_retried(tmp_path: Path, s3_server: Any) -> None:
    import s3fs
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server


    app = _Throttle(DomainDispatcherApplication(create_backend_app), n=2)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        opts = dict(s3_server.storage_options(), client_kwargs={"endpoint_url": endpoint})
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **opts)
        fs.mkdir("throttled")
        sid = _sharded.save_id("single-process-twin", 1)
        rank1 = layout.rank_manifest_name(1, sid)
        fs.pipe(f"throttled/run/{layout.step_dir(1)}/{rank1}", b"x" * 123)  # rank 1's shard, uploaded already
        mgr, coord = twin_manager(tmp_path / "n0", ok_peer(), remote="s3://throttled/run", storage_options=opts,
                                  upload_deadline_s=60, remote_timeout_s=60,
                                  channel=lambda c: _ReportingChannel(c, lambda n: {"ref": [1, rank1, 123, "0" * 32]}))
        h = mgr.save(1, state_at(1))
        mgr.wait()
        assert h.uploaded.exception() is None
        assert app.throttled == {"list": 2, "put-manifest": 2}  # each answered SlowDown twice, then went through
        committed = StepManifest.from_bytes(fs.cat(f"throttled/run/{layout.step_dir(1)}/manifest.json"), step=1)
        assert [r.rank for r in committed.ranks] == [0, 1] and committed.save_id == sid
        mgr.close()
    finally:
        server.shutdown()


def test_a_file_not_on_the_remote_at_the_size_its_rank_reported_fails_the_commit(tmp_path: Path) -> None:
    """No rank asks the store for a file's size after its PUT; rank 0's one listing of the step folder checks every
    reported file, and a short one keeps the step uncommitted, naming the rank."""
    remote = tmp_path / "remote"
    sid = _sharded.save_id("single-process-twin", 1)
    rank1, data1 = layout.rank_manifest_name(1, sid), f"r00001-p0000-{sid}.safetensors"
    folder = remote / layout.step_dir(1)
    folder.mkdir(parents=True)
    (folder / rank1).write_bytes(b"x" * 123)
    (folder / data1).write_bytes(b"y" * 40)  # rank 1 reports 50 bytes: a short object
    report = {"ref": [1, rank1, 123, "0" * 32], "sizes": {rank1: 123, data1: 50}}
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer(), remote=remote, upload_deadline_s=30,
                          channel=lambda c: _ReportingChannel(c, lambda n: report))
    h = mgr.save(1, state_at(1))
    with pytest.raises(UploadError, match=r"files of rank\(s\) \[1\] are not on the remote as reported"):
        mgr.wait()
    assert isinstance(h.uploaded.exception(), UploadError)
    assert not (folder / "manifest.json").exists()
    mgr.close()
