"""A staged default restore (remote or compressed files, or a state mostly of small tensors) reads into its staging
buffer while it checks the state (the plan), and a state mismatch found meanwhile stops those reads and changes
nothing; an in-place or guarded restore plans first (the plan names the tensors it reads into). Tensor views over
the loaded bytes are made in one step (``as_strided``) and equal the slow path's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tierckpt
from tests._support.helpers import assert_tree_equal, clone_tree, save_once, zeros_like_tree
from tierckpt.engine import restore as _restore
from tierckpt.errors import StateMismatchError
from tierckpt.format.manifest import TensorRecord
from tierckpt.snapshot.loaded import tensor_view_factory
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import reader


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"w": {f"t{i}": torch.randn(200_000 + 1000 * i, generator=g) for i in range(6)}, "n": 4}


@pytest.fixture
def saved(tmp_path) -> tuple[dict, object]:
    state = _state()
    return state, save_once(tmp_path / "ck", state, 3)


@pytest.fixture
def staged(monkeypatch) -> None:
    """The default restore of these local files is staged, as a remote one is, not guarded."""
    monkeypatch.setattr(_restore, "GUARD_MIN_SHARE", 2.0)


class _Reads:
    """Counts the bytes every LocalStore reads from data files (optionally slowly), and signals the first read."""

    def __init__(self, monkeypatch, delay: float = 0.0) -> None:
        self.bytes = 0
        self.first = threading.Event()
        self._lock = threading.Lock()
        for name in ("readinto", "readinto_many"):  # staged reads, and in-place (vectored) ones
            monkeypatch.setattr(LocalStore, name, self._counting(getattr(LocalStore, name), delay))

    def _counting(self, real, delay: float):
        def read(store, rel, offset, out):
            if delay:
                time.sleep(delay)
            n = real(store, rel, offset, out)
            if rel.endswith(".safetensors"):
                with self._lock:
                    self.bytes += n
                self.first.set()
            return n

        return read


def _watch_plan(monkeypatch, reads: _Reads, *, wait_for_read: bool) -> dict:
    seen: dict = {}
    real = _restore.plan_restore

    def plan(*args, **kwargs):
        seen["read_before_plan"] = reads.first.is_set()
        if wait_for_read:
            seen["read_during_plan"] = reads.first.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(_restore, "plan_restore", plan)
    return seen


def test_staged_restore_reads_while_it_plans(saved, staged, monkeypatch):
    state, root = saved
    reads = _Reads(monkeypatch)
    seen = _watch_plan(monkeypatch, reads, wait_for_read=True)
    target = zeros_like_tree(state)
    with tierckpt.CheckpointManager(root, file_size_mb=1) as mgr:
        assert mgr.restore(target) == 3
    assert seen["read_during_plan"], "no data file was read while the plan was being made"
    assert_tree_equal(target, state)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "guarded"])
def test_in_place_and_guarded_restores_plan_before_they_read(saved, monkeypatch, in_place):
    state, root = saved
    reads = _Reads(monkeypatch)
    seen = _watch_plan(monkeypatch, reads, wait_for_read=False)
    target = zeros_like_tree(state)
    with tierckpt.CheckpointManager(root, file_size_mb=1) as mgr:
        assert mgr.restore(target, in_place=in_place) == 3
    assert seen["read_before_plan"] is False
    assert reads.first.is_set()
    assert_tree_equal(target, state)


def test_a_mismatch_found_while_reading_stops_the_reads_and_changes_nothing(saved, staged, monkeypatch):
    state, root = saved
    monkeypatch.setattr(reader, "READ_CHUNK", 64 << 10)  # many small reads: most are still queued when planning fails
    reads = _Reads(monkeypatch, delay=0.01)
    _watch_plan(monkeypatch, reads, wait_for_read=True)
    target = zeros_like_tree(state)
    target["w"]["t2"] = torch.zeros(7)  # wrong shape
    before = clone_tree(target)
    total = sum(t.numel() * 4 for t in state["w"].values())
    with tierckpt.CheckpointManager(root, file_size_mb=1) as mgr:
        with pytest.raises(StateMismatchError, match="t2"):
            mgr.restore(target, step=3)
        stopped_at = reads.bytes
        time.sleep(0.1)
        assert reads.bytes == stopped_at, "reads went on after restore() raised"
        assert 0 < stopped_at < total / 2, f"read {stopped_at} of {total} bytes after the plan failed"
        assert mgr.components.staging.free_slots == mgr.options.staging_buffers  # the staging slot came back
        assert_tree_equal(target, before)
        good = zeros_like_tree(state)
        assert mgr.restore(good, step=3) == 3
    assert_tree_equal(good, state)


def test_a_mismatch_is_reported_before_a_damaged_file(saved):
    state, root = saved
    data = sorted((root / "step-0000000003").glob("*.safetensors"))[0]
    with open(data, "r+b") as f:
        f.truncate(100)
    target = zeros_like_tree(state)
    target["w"]["t0"] = torch.zeros(3)
    with tierckpt.CheckpointManager(root, file_size_mb=1) as mgr, pytest.raises(StateMismatchError, match="t0"):
        mgr.restore(target, step=3)


def _records(specs: list[tuple[str, tuple[int, ...], int]]) -> tuple[TensorRecord, ...]:
    itemsize = {"F32": 4, "BF16": 2, "I64": 8, "BOOL": 1, "U8": 1}
    return tuple(TensorRecord(i, f"t{i}", f"t{i}", code, shape, 0, offset,
                              itemsize[code] * int(torch.Size(shape).numel()), "", "torch")
                 for i, (code, shape, offset) in enumerate(specs))


def test_one_step_views_equal_slice_and_view():
    raw_storage = torch.randint(0, 256, (9000,), dtype=torch.uint8)
    buffer = raw_storage[64 : 64 + 8192]  # a view that does not start at its storage's start, like a staging slot
    file_start = 128
    records = _records([("F32", (4, 8), 0), ("BF16", (3, 5), 128), ("I64", (), 160), ("BOOL", (2, 3), 168),
                        ("U8", (5,), 181), ("U8", (0, 4), 300), ("F32", (2, 1, 3), 304)])

    def raw(i: int) -> torch.Tensor:
        start = file_start + records[i].offset
        return buffer[start : start + records[i].nbytes]

    fast = tensor_view_factory(records, raw, buffer=buffer, file_starts=(file_start,))
    slow = tensor_view_factory(records, raw)
    for i, rec in enumerate(records):
        a, b = fast(i), slow(i)
        assert a.dtype == b.dtype and a.shape == b.shape == rec.shape, rec.name
        assert a.is_contiguous(), rec.name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), rec.name
        if rec.nbytes:
            assert a.data_ptr() == buffer.data_ptr() + file_start + rec.offset, rec.name  # a view, not a copy
    skipped = tensor_view_factory(records, lambda i: torch.full((records[i].nbytes,), 7, dtype=torch.uint8),
                                  buffer=buffer, file_starts=(file_start,), skip=frozenset({0}))
    assert skipped(0).data_ptr() != buffer.data_ptr() + file_start  # a record in ``skip`` comes from ``raw``
    assert skipped(1).data_ptr() == buffer.data_ptr() + file_start + 128
