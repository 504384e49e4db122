"""A remote tier that refuses, stalls or lags behind the saves, seen from a training loop: every local checkpoint is
kept (save() never drops one for a remote error), the local tier stays bounded, the newest step goes first, and a
restore never waits for the upload backlog.

The remote is a POSIX folder wrapped, after construction, in a :class:`FaultyStore` (``mgr.remote = faulty``: the
replication component uploads through the manager's current remote); the S3 cases with real network faults are
in ``test_remote_s3_faults.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tests._support.remote import wait_for
from tierckpt import CheckpointManager, UploadError
from tierckpt.storage.faulty import FaultyStore
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(120)


def _state(step: int, n: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _empty(n: int = 50_000) -> dict:
    return {"w": torch.zeros(n), "step": -1}


def _denied(op: str, n: int) -> BaseException:
    return PermissionError(13, f"injected: remote refuses {op} #{n}")


def _manager(tmp_path: Path, **kw) -> tuple[CheckpointManager, FaultyStore]:
    plan = kw.pop("plan", None) or {"fail": {"makedirs": "all", "open_write": "all", "write_bytes": "all"},
                                    "error_factory": _denied}
    mgr = CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), **kw)
    faulty = FaultyStore(mgr.remote, **plan)
    mgr.remote = faulty
    return mgr, faulty


def test_a_failing_remote_never_costs_a_local_checkpoint(tmp_path: Path) -> None:
    """8 saves in a loop with the remote refusing every write: save() never raises, every step reaches the local
    disk, and the upload errors come out of handle.uploaded, wait() and health()."""
    mgr, faulty = _manager(tmp_path, keep_local=50)
    handles = []
    for step in range(1, 9):
        handles.append(mgr.save(step, _state(step)))  # an earlier upload error must not stop this one
        handles[-1].persisted.result(timeout=30)
        handles[-1].uploaded.exception(timeout=30)
    assert sorted(list_root(mgr.local).steps) == list(range(1, 9))
    for h in handles:
        err = h.uploaded.exception(timeout=0)
        assert isinstance(err, UploadError) and err.step == h.step, err
        assert h.record().error and str(h.step) in h.record().error
    health = mgr.health()
    assert not health.ok and health.consecutive_failures >= 8
    assert health.local_step == 8 and health.remote_step is None and health.upload_lag_steps == 8
    assert health.last_error and str(tmp_path / "remote") in health.last_error
    with pytest.raises(UploadError):
        mgr.wait()
    mgr.close()
    assert faulty.plan.failures


def test_local_tier_stays_bounded_during_an_outage(tmp_path: Path) -> None:
    """keep_local=2, 8 saves, remote down: the local tier holds at most keep_local + max_upload_backlog steps,
    the newest among them, and a keep_every milestone before plain old steps."""
    mgr, _ = _manager(tmp_path, keep_local=2, keep_every=4, max_upload_backlog=2)
    for step in range(1, 9):
        h = mgr.save(step, _state(step))
        h.uploaded.exception(timeout=30)
        assert len(list_root(mgr.local).steps) <= 4
    local = sorted(list_root(mgr.local).steps)
    assert local == [4, 6, 7, 8], local  # not all 8: the outage must not fill the disk
    state = _empty()
    assert mgr.restore(state) == 8
    assert_tree_equal(state, _state(8))
    with pytest.raises(UploadError):
        mgr.close()


def test_outage_ends_newest_first_and_superseded_steps_are_skipped(tmp_path: Path) -> None:
    """The remote stalls on step 1 while steps 2..8 are saved (keep_local=2, keep_remote=2). When it answers
    again the newest step is uploaded before the older one still kept, superseded steps are never uploaded, and
    the local tier never held more than keep_local + max_upload_backlog (+ the step being uploaded)."""
    gate = threading.Event()
    plan = {"stall": {"read_bytes": (1.0, [1])}, "sleep": lambda _s: gate.wait(60)}
    mgr, faulty = _manager(tmp_path, keep_local=2, keep_remote=2, plan=plan)
    handles = {1: mgr.save(1, _state(1))}
    deadline = time.monotonic() + 10
    while faulty.calls["read_bytes"] < 1 and time.monotonic() < deadline:  # step 1's upload is stuck
        time.sleep(0.01)
    most = 0
    for step in range(2, 9):
        handles[step] = mgr.save(step, _state(step))
        handles[step].persisted.result(timeout=30)
        most = max(most, len(list_root(mgr.local).steps))
    assert most <= 5, most
    assert mgr.health().waiting and mgr.health().uploading == 1
    gate.set()
    mgr.wait()
    assert sorted(list_root(faulty.inner).steps) == [7, 8]
    up = {s: h.record().upload_s for s, h in handles.items()}
    assert up[8] is not None and up[7] is not None and up[8] < up[7], up  # newest first
    for s in range(2, 7):
        assert handles[s].uploaded.result(timeout=0) is None and handles[s].record().upload_skipped, s
    assert sorted(list_root(mgr.local).steps) == [7, 8]
    mgr.close()


def test_restore_does_not_wait_for_the_upload_backlog(tmp_path: Path) -> None:
    """Uploads stuck behind a silent remote: restore() loads the newest local step at once."""
    gate = threading.Event()
    plan = {"stall": {"read_bytes": 1.0}, "sleep": lambda _s: gate.wait(60)}
    mgr, _ = _manager(tmp_path, keep_local=10, plan=plan)
    for step in (1, 2, 3):
        mgr.save(step, _state(step)).persisted.result(timeout=30)
    t0 = time.monotonic()
    state = _empty()
    assert mgr.restore(state, source="local") == 3
    assert time.monotonic() - t0 < 5, "restore waited for the uploads"
    assert_tree_equal(state, _state(3))
    gate.set()
    mgr.close()


def test_bandwidth_cap_applies_to_small_steps(tmp_path: Path) -> None:
    """upload_bandwidth_mbps=1: a 0.8 MB step takes about 0.8 s to upload, not one burst."""
    with CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), upload_bandwidth_mbps=1.0,
                           upload_threads=1) as mgr:
        h = mgr.save(1, _state(1, n=200_000))
        up = h.uploaded.result(timeout=60) - h.persisted.result(timeout=60)
        assert up >= 0.6, up  # not one burst: the cap holds from the first byte


def test_a_failed_upload_leaves_the_local_tier_within_its_bound(tmp_path: Path) -> None:
    """A step committed while an older step's upload runs is kept as 'being uploaded'; when that upload then fails,
    retention runs again, so wait() returns with the local tier within keep_local + max_upload_backlog."""
    gate = threading.Event()
    mgr = CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=1, max_upload_backlog=0,
                            pin_memory=False, log_records=False)
    # every write fails but the first, the run identity that the first upload claims the remote with: were that
    # refused, no upload would start
    faulty = FaultyStore(mgr.remote, fail={"makedirs": "all", "open_write": "all", "write_bytes": range(2, 1000)},
                         error_factory=_denied, stall={"makedirs": (1.0, [1])}, sleep=lambda _s: gate.wait(30))
    mgr.remote = faulty
    try:
        mgr.save(1, _state(1, 100)).persisted.result(timeout=30)
        wait_for(lambda: faulty.plan.calls["makedirs"] >= 1, 30)  # step 1's upload is in flight
        mgr.save(2, _state(2, 100)).persisted.result(timeout=30)
        wait_for(lambda: 2 in mgr.health().waiting, 30)  # committed; retention ran
        gate.set()  # step 1's upload now fails
        with pytest.raises(UploadError):
            mgr.wait(timeout=60)
        mgr.wait(timeout=60)
        assert sorted(list_root(mgr.local).steps) == [2], "the local tier is over keep_local + max_upload_backlog"
    finally:
        gate.set()
        try:
            mgr.close()
        except UploadError:
            pass
