"""Rollbacks and a local folder the process cannot write.

A user restores an older step after a loss spike precisely to abandon the run after it: the abandoned steps must
never be restored again, nor push this run's steps out by retention. ``save()`` refuses a step below a newer
committed step (:class:`RollbackError`, which says what to do); ``rollback_to(step)`` sets the newer steps aside in
every tier, keeping their data.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tests._support.remote import wait_for
from tierckpt import CheckpointError, CheckpointManager
from tierckpt.errors import RollbackError, StorageAccessError
from tierckpt.format import layout
from tierckpt.replication import replicator as replicator_mod
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(10_000, generator=g), "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(10_000), "step": -1}


def _saved(root: Path, steps: list[int], **kw) -> None:
    with CheckpointManager(root, keep_local=10, **kw) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


@pytest.mark.parametrize("remote", [False, True])
def test_rollback_is_refused_until_made_explicit_then_sticks(tmp_path: Path, remote: bool) -> None:
    kw = {"remote": str(tmp_path / "remote"), "keep_remote": 10} if remote else {}
    root = tmp_path / "local"
    _saved(root, [10, 20, 30], **kw)
    with CheckpointManager(root, keep_local=2, **kw) as mgr:
        state = _empty()
        assert mgr.restore(state, step=20) == 20
        with pytest.raises(RollbackError) as ei:  # a restart would restore step 30
            mgr.save(21, _state(21))
        msg = str(ei.value)
        assert "step 21" in msg and "30" in msg and "rollback_to" in msg
        assert isinstance(ei.value, CheckpointError) and ei.value.step == 21
        assert 21 not in list_root(mgr.local).steps  # nothing was written
        assert mgr.rollback_to(20) == [30]
        for s in (21, 22, 23):
            mgr.save(s, _state(s))
        mgr.wait()
        assert sorted(list_root(mgr.local).steps) == [22, 23]
        if remote:
            assert 30 not in list_root(mgr.remote).steps
    aside = [n for n in os.listdir(root) if n.startswith(layout.ASIDE_PREFIX)]
    assert len(aside) == 1 and layout.step_dir(30) in aside[0]  # kept for inspection, not a checkpoint
    with CheckpointManager(root, **kw) as mgr:
        state = _empty()
        assert mgr.restore(state) == 23
        assert_tree_equal(state, _state(23))
        assert mgr.latest_step() == 23


def test_a_remote_listing_read_before_a_rollback_does_not_bring_back_what_it_set_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replicator's start-up listing of the remote reads step 30 and lands only after ``rollback_to(20)`` set
    step 30 aside: the next save is not refused as if step 30 were still committed."""
    remote = str(tmp_path / "remote")
    root = tmp_path / "local"
    _saved(root, [10, 20, 30], remote=remote, keep_remote=10)
    read, release = threading.Event(), threading.Event()
    real_list_root = replicator_mod.list_root

    def stale_list_root(store):  # noqa: ANN001, ANN202
        listing = real_list_root(store)
        if store.tier == "remote" and not read.is_set():
            read.set()
            release.wait(30)
        return listing

    monkeypatch.setattr(replicator_mod, "list_root", stale_list_root)
    with CheckpointManager(root, keep_local=2, remote=remote, keep_remote=10, remote_timeout_s=60) as mgr:
        assert read.wait(30)  # the start-up listing holds step 30, and waits
        state = _empty()
        assert mgr.restore(state, step=20) == 20
        assert mgr.rollback_to(20) == [30]
        release.set()
        wait_for(lambda: mgr.components.replicator.remote_steps() is not None)  # the listing landed
        mgr.save(21, _state(21))
        mgr.wait()
        assert 30 not in list_root(mgr.remote).steps and 21 in list_root(mgr.remote).steps
    with CheckpointManager(root, remote=remote) as mgr:
        assert mgr.restore(_empty()) == 21


def test_an_old_runs_steps_in_the_folder_are_not_silently_preferred(tmp_path: Path) -> None:
    """A new run (no restore) in a folder holding step 1000 of another run: its step 10 is refused."""
    root = tmp_path / "local"
    _saved(root, [1000])
    with CheckpointManager(root) as mgr, pytest.raises(RollbackError, match="1000"):
        mgr.save(10, _state(10))


def test_saving_on_after_a_restore_is_not_a_rollback(tmp_path: Path) -> None:
    root = tmp_path / "local"
    _saved(root, [1, 2])
    with CheckpointManager(root) as mgr:
        assert mgr.restore(_empty()) == 2
        mgr.save(3, _state(3))
        mgr.save(4, _state(4))
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 4


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A read-only file system (a tmpfs mounted ``ro``; root ignores a folder's mode bits)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0:
        os.chmod(mnt, 0o555)
        yield mnt
        os.chmod(mnt, 0o755)
        return
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_read_only_local_folder_is_a_clear_error(read_only_dir: Path) -> None:
    with pytest.raises(CheckpointError) as ei:  # not a bare OSError from the lock file
        CheckpointManager(read_only_dir)
    err = ei.value
    assert isinstance(err, StorageAccessError) and isinstance(err, PermissionError)
    assert err.tier == "local" and str(read_only_dir) in str(err)
