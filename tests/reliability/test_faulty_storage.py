"""Faulty storage: a really full local disk (ENOSPC on a small tmpfs, mounted when the test runs as root;
skipped otherwise) and a remote tier that is down for a while.

The manager does not take a Store for its remote (it opens a URL), so the remote-down tests build a manager on a
POSIX remote folder and then replace ``mgr.remote`` with a :class:`FaultyStore` wrapping it, before the first save:
the upload thread reads ``mgr.remote`` for every step. The local tier is not wrapped: ENOSPC is produced for real.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointError, CheckpointManager, UploadError, cli
from tierckpt.storage.faulty import FaultyStore
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(120)


def _state(step: int, n: int = 250_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _empty(n: int = 250_000) -> dict:
    return {"w": torch.zeros(n), "step": -1}


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """An 8 MiB tmpfs (a disk that really fills up)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path, leave: int) -> Path:
    """Fill the file system until fewer than ``leave`` bytes are free."""
    filler = mnt / "filler"
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave))
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_local_disk_full(tiny_fs: Path) -> None:
    root = tiny_fs / "ckpt"
    with CheckpointManager(root, keep_local=3) as mgr:
        mgr.save(1, _state(1))  # ~1 MB
        mgr.wait()
        filler = _fill(tiny_fs, leave=300_000)  # less than one more step
        h = mgr.save(2, _state(2))
        with pytest.raises(CheckpointError) as ei:
            mgr.wait()
        err = ei.value
        assert isinstance(err, OSError), f"a full disk should be a StorageError (an OSError): {err!r}"
        assert err.step == 2 and "step 2" in str(err), f"error does not name the step: {err}"
        assert err.path and str(root) in str(err), f"error does not name the path: {err}"
        assert "No space left" in str(err) or "ENOSPC" in str(err) or "28" in str(err), str(err)
        assert h.persisted.exception() is not None
        # nothing partial is visible, the older step is intact
        names = sorted(os.listdir(root))
        assert not [n for n in names if n.startswith((".tmp-", ".trash-"))], names
        assert sorted(list_root(mgr.local).steps) == [1], names
        state = _empty()
        assert mgr.restore(state) == 1
        assert_tree_equal(state, _state(1))
        # the next save fails the same way, clearly, while the disk is full
        mgr.save(3, _state(3))
        with pytest.raises(CheckpointError) as ei3:
            mgr.wait()
        assert ei3.value.step == 3
        # space freed: saving works again
        filler.unlink()
        mgr.save(4, _state(4))
        mgr.wait()
        state = _empty()
        assert mgr.restore(state) == 4
        assert_tree_equal(state, _state(4))
        records = mgr.records()
        assert [r.step for r in records] == [1, 2, 3, 4]
        assert records[1].error and records[2].error and not records[3].error
    assert cli.main(["verify", str(root)]) == 0
    assert sorted(list_root_steps(root)) == [1, 4]


def list_root_steps(root: Path) -> list[int]:
    from tierckpt.storage.local import LocalStore

    return list(list_root(LocalStore(root)).steps)


def _with_faulty_remote(tmp_path: Path, **plan) -> tuple[CheckpointManager, FaultyStore]:
    mgr = CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=1, keep_remote=None)
    faulty = FaultyStore(mgr.remote, **plan)
    mgr.remote = faulty  # see the module docstring
    return mgr, faulty


def test_remote_blip_is_retried(tmp_path: Path) -> None:
    """Transient failures (the first writes and a listing) are retried; every step lands on the remote."""
    mgr, faulty = _with_faulty_remote(tmp_path, fail={"open_write": [1, 2], "write_bytes": [1], "makedirs": [1]})
    with mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step, 1000))
        mgr.wait()
        assert faulty.plan.failures, "the plan injected nothing"
        assert sorted(list_root(faulty.inner).steps) == [1, 2, 3]
        assert sorted(list_root(mgr.local).steps) == [3], "uploaded steps beyond keep_local=1 stay locally"
    assert cli.main(["verify", str(tmp_path / "remote")]) == 0


def _save_past_upload_errors(mgr: CheckpointManager, step: int, state: dict) -> Any:
    """save(), once more if it re-raised an earlier step's upload error (it does so before doing anything)."""
    try:
        return mgr.save(step, state)
    except UploadError:
        return mgr.save(step, state)


def test_remote_down_keeps_every_local_copy_then_catches_up(tmp_path: Path) -> None:
    """A remote down for good (a permanent error): every upload fails with UploadError, local retention deletes
    nothing (keep_local=1, yet every step stays: it is the only copy), restore works from the local tier. A new
    manager with the remote back re-uploads what is missing."""
    mgr, faulty = _with_faulty_remote(
        tmp_path, fail={"makedirs": "all", "open_write": "all", "write_bytes": "all"},
        error_factory=lambda op, n: PermissionError(13, f"injected: remote refuses {op} #{n}"))
    with pytest.raises(UploadError) as ei, mgr:
        handles = [_save_past_upload_errors(mgr, step, _state(step, 1000)) for step in (1, 2, 3)]
        for h in handles:
            h.persisted.result(timeout=30)
            assert isinstance(h.uploaded.exception(timeout=30), UploadError)
        assert sorted(list_root(mgr.local).steps) == [1, 2, 3], "retention deleted the only copy of a step"
        assert list_root(faulty.inner).steps == {}
        state = _empty(1000)
        assert mgr.restore(state) == 3
        assert_tree_equal(state, _state(3, 1000))
        mgr.wait()
    assert ei.value.step in (1, 2, 3) and "remote" in str(ei.value)
    # the remote is back: a new manager re-uploads the local steps it lacks, then retention trims the local tier
    with CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=1) as mgr2:
        mgr2.wait()
        assert sorted(list_root(mgr2.remote).steps) == [1, 2, 3]
        mgr2.save(4, _state(4, 1000))
        mgr2.wait()
        assert sorted(list_root(mgr2.local).steps) == [4]
        state = _empty(1000)
        assert mgr2.restore(state, step=2, source="remote") == 2
        assert_tree_equal(state, _state(2, 1000))


def test_remote_down_for_a_while_the_same_manager_catches_up(tmp_path: Path) -> None:
    """The remote refuses every write for two saves, then comes back: the next successful upload makes the same
    manager re-queue the two failed steps, and local retention then trims the local tier."""
    mgr, faulty = _with_faulty_remote(
        tmp_path, fail={"makedirs": "all", "open_write": "all", "write_bytes": "all"},
        error_factory=lambda op, n: PermissionError(13, f"injected: remote refuses {op} #{n}"))
    with mgr:
        for step in (1, 2):
            h = mgr.save(step, _state(step, 1000))
            assert isinstance(h.uploaded.exception(timeout=30), UploadError)
            with pytest.raises(UploadError):  # re-raised once, by the next call
                mgr.wait()
        assert [s.state for s in mgr.steps()] == ["upload-failed", "upload-failed"]
        mgr.remote = faulty.inner  # the remote is back
        h = mgr.save(3, _state(3, 1000))
        assert h.uploaded.result(timeout=60) is not None
        mgr.wait()
        assert sorted(list_root(faulty.inner).steps) == [1, 2, 3]
        assert sorted(list_root(mgr.local).steps) == [3]  # keep_local=1, and every step is now durable remotely
    assert cli.main(["verify", str(tmp_path / "remote")]) == 0


def test_local_retention_after_remote_retention(tmp_path: Path) -> None:
    """Remote holds 1, 2; step 3 is only local (its upload failed). A new manager (keep_local=2, keep_remote=2)
    re-uploads 3 (remote retention retires 1), then saves 4: the local tier should end with [3, 4]. (Regression:
    remote retention used to make local retention forget that step 1 had been replicated, keeping it forever.)"""
    mgr = CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=5)
    real_remote = mgr.remote
    with mgr:
        for step in (1, 2):
            mgr.save(step, _state(step, 1000))
        mgr.wait()
        mgr.remote = FaultyStore(real_remote, fail={"makedirs": "all"},
                                 error_factory=lambda op, n: PermissionError(13, "injected"))
        mgr.save(3, _state(3, 1000))
        with pytest.raises(UploadError):
            mgr.wait()
    assert sorted(list_root(real_remote).steps) == [1, 2]
    with CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=2, keep_remote=2) as mgr2:
        mgr2.wait()
        mgr2.save(4, _state(4, 1000))
        mgr2.wait()
        local, remote = sorted(list_root(mgr2.local).steps), sorted(list_root(mgr2.remote).steps)
    assert remote == [3, 4]
    assert local == [3, 4], f"keep_local=2 but the local tier holds {local}"
