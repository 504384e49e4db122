"""Issue 4 (distributed): single-process twins of the multi-rank error paths of tests/test_dist.py.

Two levels, both in this process, no torch.distributed:

- the storage protocol of :mod:`tierckpt.tiers.sharded`, called directly on a LocalStore with world-size-2 steps
  built by hand (discard_shard, commit_step and its cleanup, commit_remote's deadline, wait_remote_commit, holds_rank);
- the manager's multi-rank paths (:mod:`tierckpt._sharded`) as rank 0 of a world of 2, with rank 1 scripted: a fake
  coordinator answers each collective with what rank 1 would have sent, or raises as gloo does when a peer died.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    UploadError,
    _sharded,
)
from tierckpt.distributed import Topology
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
def test_commit_remote_deadline_names_the_missing_ranks(remote: LocalStore) -> None:
    s0, s1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(remote, 5, s0)  # rank 1 never uploads
    with pytest.raises(UploadError, match=r"ranks \[1\] did not upload") as ei:
        sharded.commit_remote(remote, step_manifest(5, SID, [s0, s1], (0,)), deadline_s=0.2)
    assert ei.value.step == 5
    assert 5 not in list_root(remote).steps


def test_commit_remote_ignores_a_rank_manifest_of_another_save(remote: LocalStore) -> None:
    s0, s1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(remote, 5, s0)
    stale = build_shard(5, 1, OLD)
    place(remote, 5, stale)
    # the stale manifest under the name the step manifest expects: same rank, another save
    remote.write_bytes(join(layout.step_dir(5), s1.ref.name), stale.raw)
    with pytest.raises(UploadError, match=r"\[1\]"):
        sharded.commit_remote(remote, step_manifest(5, SID, [s0, s1], (0,)), deadline_s=0.2)


def test_commit_remote_commits_once_every_rank_is_there(remote: LocalStore) -> None:
    s0, s1 = build_shard(5, 0, SID), build_shard(5, 1, SID)
    place(remote, 5, s0)
    place(remote, 5, s1)
    final = sharded.commit_remote(remote, step_manifest(5, SID, [s0, s1], (0,)), deadline_s=5)
    assert final.holds_ranks is None and [r.rank for r in final.ranks] == [0, 1]
    assert sharded.holds_rank(remote, 5, 0) and sharded.holds_rank(remote, 5, 1)
    report = verify_step(remote, 5)
    assert report.ok and report.ranks == [0, 1]
    sharded.wait_remote_commit(remote, 5, SID, deadline_s=0.5)  # returns at once


def test_wait_remote_commit_times_out_naming_the_step(remote: LocalStore) -> None:
    with pytest.raises(UploadError, match="rank 0 did not commit") as ei:
        sharded.wait_remote_commit(remote, 5, SID, deadline_s=0.2)
    assert ei.value.step == 5
    s0, s1 = build_shard(5, 0, OLD), build_shard(5, 1, OLD)
    for s in (s0, s1):
        place(remote, 5, s)
    sharded.commit_step(remote, step_manifest(5, OLD, [s0, s1], None))  # another save of step 5 is committed
    with pytest.raises(UploadError):
        sharded.wait_remote_commit(remote, 5, SID, deadline_s=0.2)


# --------------------------------------------------------------------------------------------- manager, rank 1 scripted
class FakeCoordinator:
    """Rank 0 of a world of 2; ``peer(group, obj)`` returns rank 1's object for each collective, or raises."""

    def __init__(self, peer: Callable[[str, str, Any], Any]) -> None:
        self.topology = Topology(rank=0, world_size=WORLD, node_ranks=(0,), run_id="single-process-twin")
        self.persist_group, self.main_group = "persist", "main"
        self.peer = peer
        self.calls: list[tuple[str, Any]] = []

    def gather(self, obj: Any, group: Any) -> list[Any]:
        self.calls.append((group, obj))
        return [obj, self.peer(group, obj)]

    def scatter(self, objs: list[Any] | None, group: Any, *, src: int = 0) -> Any:
        self.calls.append((group, ("scatter", objs)))
        return objs[0] if objs else None

    def announce(self, sid: str, what: str) -> None:
        self.calls.append(("announce", (sid, what)))

    def silent_ranks(self, sid: str) -> list[int]:
        return [1]  # rank 1 is the one a twin makes fail or die

    def upload_channel(self) -> Any:
        return _LeaderChannel(self)

    def destroy(self) -> None:
        pass


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


def ok_peer(step_sid: Callable[[int], str] | None = None) -> Callable[[str, Any], Any]:
    """Rank 1 that succeeds at everything, its shard on another node, and holds every step rank 0 holds."""

    def peer(group: str, obj: Any) -> Any:
        if group == "persist":
            if isinstance(obj, tuple) and len(obj) == 5:  # "shards written": (ok, ref, bytes, created, metadata)
                ok, ref, nbytes, created, metadata = obj
                if not ok:  # rank 0 failed; rank 1 itself succeeded (its shard name does not matter here)
                    return (True, (1, layout.rank_manifest_name(1, "0" * 16), 123, "0" * 32), 0, 0.0, None)
                sid = ref[1].split("-", 1)[1].split(".", 1)[0]
                return (True, (1, layout.rank_manifest_name(1, sid), 123, "0" * 32), nbytes, created, metadata)
            return (True, "")  # "committed on every node"
        if isinstance(obj, dict):  # restore candidates: the same as rank 0's
            return dict(obj)
        return obj if obj is None else ("ok", "")

    return peer


def twin_manager(local: Path, peer: Callable[[str, Any], Any], **kw: Any) -> tuple[CheckpointManager, FakeCoordinator]:
    kw.setdefault("log_records", False)
    mgr = CheckpointManager(local, rank=0, world_size=1, **kw)
    coord = FakeCoordinator(peer)
    mgr._coord = coord
    mgr.world_size = WORLD
    mgr._engine.coord, mgr._engine.world_size = coord, WORLD  # what the restore and commit paths see
    return mgr, coord


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.arange(50, dtype=torch.float32) + step, "step": step}


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(50), "step": -1}


def test_twin_rank1_save_fails_step_uncommitted_error_names_rank1(tmp_path: Path) -> None:
    fail_step = {2}

    def peer(group: str, obj: Any) -> Any:
        if group == "persist" and isinstance(obj, tuple) and len(obj) == 5 and obj[0]:
            step = next(iter(fail_step)) if fail_step else None
            if (step is not None
                    and obj[1][1].split("-", 1)[1].split(".")[0] == _sharded.save_id("single-process-twin", step)):
                return (False, "OSError: [Errno 28] No space left on device", 0, 0.0, None)
        return ok_peer()(group, obj)

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
    assert m.holds_ranks == (0,) and [r.rank for r in m.ranks] == [0, 1]
    mgr.close()


def test_twin_rank1_dies_during_the_agreement(tmp_path: Path) -> None:
    dead = {"now": False}

    def peer(group: str, obj: Any) -> Any:
        if dead["now"] and group == "persist":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
        return ok_peer()(group, obj)

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
    def peer(group: str, obj: Any) -> Any:
        if group == "persist" and obj == (True, ""):
            return (False, "OSError: [Errno 5] Input/output error")
        return ok_peer()(group, obj)

    mgr, _ = twin_manager(tmp_path / "n0", peer)
    mgr.save(1, state_at(1))
    with pytest.raises(CheckpointError, match=r"node\(s\) of rank\(s\) \[1\].*Input/output") as ei:
        mgr.wait()
    assert ei.value.step == 1
    mgr.close()


def test_twin_type_error_at_save_happens_before_any_collective(tmp_path: Path) -> None:
    mgr, coord = twin_manager(tmp_path / "n0", ok_peer())
    with pytest.raises(TypeError, match=r"state\['extra'\]"):
        mgr.save(1, {"w": torch.ones(3), "extra": object()})
    mgr.wait()
    assert coord.calls == [] and list_root(mgr.local).steps == {}
    mgr.close()


# ------------------------------------------------------------------------------------------------ restore agreement
def saved_twin(tmp_path: Path, steps: list[int], peer: Callable[[str, Any], Any]) -> CheckpointManager:
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer(), keep_local=10)
    for s in steps:
        mgr.save(s, state_at(s))
    mgr.wait()
    mgr._coord.peer = peer
    return mgr


def restore_peer(candidates: list[int], outcome: Callable[[], tuple[str, str]] = lambda: ("ok", "")):
    def peer(group: str, obj: Any) -> Any:
        assert group == "main"
        return {"steps": list(candidates), "shared_first": []} if isinstance(obj, dict) else outcome()

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
    mgr._coord.peer = restore_peer([])  # rank 1 holds nothing
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
    mgr, _ = twin_manager(tmp_path / "n0", ok_peer(), upload_deadline_s=0.3)
    mgr.remote = LocalStore(tmp_path / "remote", tier="remote")  # attached after start-up: no resume collective
    mgr._start_replication([])
    h = mgr.save(1, state_at(1))
    with pytest.raises(UploadError, match=r"ranks \[1\] did not upload") as ei:
        mgr.wait()
    assert ei.value.step == 1
    assert isinstance(h.uploaded.exception(), UploadError)
    assert list_root(mgr.remote).steps == {}
    assert list_root(mgr.local).steps.keys() == {1}  # the local copy is kept
    assert any(n.startswith("r00000-") for n in mgr.remote.list("step-0000000001"))
    mgr.close()
