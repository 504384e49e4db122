"""Concurrency: two managers on one folder, restore during an upload, save() while the previous save is
still persisting (one staging buffer: back-pressure), close() with pending work, and an exception inside
``with CheckpointManager(...)``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointLockedError, CheckpointManager, cli
from tierckpt.tiers import writer
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(120)


def _state(step: int, n: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _empty(n: int = 50_000) -> dict:
    return {"w": torch.zeros(n), "step": -1}


@pytest.fixture
def slow_persist(monkeypatch: pytest.MonkeyPatch):
    """Every local persist first sleeps 0.4 s (a slow disk), through the module attribute the manager calls."""
    real = writer.persist

    def slow(*args, **kwargs):
        time.sleep(0.4)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "persist", slow)


def test_second_manager_on_same_folder_is_locked_out(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "c") as mgr:
        with pytest.raises(CheckpointLockedError) as ei:
            CheckpointManager(tmp_path / "c")
        assert isinstance(ei.value, BlockingIOError) and "another CheckpointManager" in str(ei.value)
        assert str(tmp_path / "c") in str(ei.value)
        mgr.save(1, _state(1))
    with CheckpointManager(tmp_path / "c") as mgr2:  # released by close()
        assert mgr2.latest_step() == 1


def test_restore_while_upload_in_flight(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "l", remote=str(tmp_path / "r"), upload_bandwidth_mbps=0.4) as mgr:
        h = mgr.save(1, _state(1))  # 200 kB at 0.4 MB/s: the upload takes ~0.5 s
        h.persisted.result(timeout=30)
        in_flight = not h.uploaded.done()
        state = _empty()
        assert mgr.restore(state) == 1
        assert_tree_equal(state, _state(1))
        mgr.wait()
        assert h.uploaded.result() is not None
        assert 1 in list_root(mgr.remote).steps
    assert in_flight, "the upload finished before restore ran: the test did not exercise the overlap"


def test_save_while_previous_persists_blocks_then_both_commit(tmp_path: Path, slow_persist) -> None:
    with CheckpointManager(tmp_path / "c", staging_buffers=1, keep_local=5) as mgr:
        h1 = mgr.save(1, _state(1))
        assert not h1.persisted.done()
        t0 = time.monotonic()
        h2 = mgr.save(2, _state(2))  # the only staging buffer is still being written: save() waits for it
        blocked = time.monotonic() - t0
        assert h1.persisted.done(), "save(2) returned before save(1) released the staging buffer"
        assert blocked > 0.2, f"save(2) did not wait for the buffer ({blocked:.3f} s)"
        mgr.wait()
        assert h2.persisted.done() and h2.record().stall_s >= 0.2
        for step in (1, 2):
            state = _empty()
            assert mgr.restore(state, step=step) == step
            assert_tree_equal(state, _state(step))


def test_close_with_pending_work_makes_it_durable(tmp_path: Path, slow_persist) -> None:
    mgr = CheckpointManager(tmp_path / "c", staging_buffers=2, keep_local=5)
    handles = [mgr.save(step, _state(step)) for step in (1, 2, 3)]
    assert not handles[-1].persisted.done()
    mgr.close()
    assert all(h.persisted.done() and h.persisted.exception() is None for h in handles)
    assert sorted(list_root(mgr.local).steps) == [1, 2, 3]
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    with CheckpointManager(tmp_path / "c") as mgr2:
        state = _empty()
        assert mgr2.restore(state) == 3
        assert_tree_equal(state, _state(3))


def test_exception_in_with_block_propagates_and_closes(tmp_path: Path, slow_persist) -> None:
    boom = ValueError("training diverged")
    # threads of earlier tests in this process (a remote call abandoned past its deadline) are not this manager's
    before = set(threading.enumerate())
    with pytest.raises(ValueError) as ei, CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, _state(1))
        raise boom
    assert ei.value is boom, "the training loop's exception was replaced"
    assert mgr.closed
    assert [t for t in threading.enumerate()
            if t.name.startswith("tierckpt-") and t.is_alive() and t not in before] == []
    with CheckpointManager(tmp_path / "c") as mgr2:  # the lock is released, the pending save is durable
        state = _empty()
        assert mgr2.restore(state) == 1
        assert_tree_equal(state, _state(1))
