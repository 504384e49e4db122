"""A remote that refuses connections for a while, on a real S3-protocol server (moto through s3fs) behind
``FaultProxy``: a job that finishes during the outage ends, the outage is paid once, retries follow the backoff and
log once per change of state, errors that no longer apply are not raised, and the status is right from the first
failed request."""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tests._support.remote import wait_for
from tierckpt import CheckpointManager, StorageError, UploadError
from tierckpt import manager as manager_mod
from tierckpt.replication import ReplicationPolicy, Replicator
from tierckpt.testing import FaultProxy
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(180)


def _state(step: int, n: int = 20_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _empty(n: int = 20_000) -> dict:
    return {"w": torch.zeros(n), "step": -1}


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p


@pytest.fixture
def remote(s3_server, s3_bucket, proxy) -> tuple[str, dict]:
    opts = s3_server.storage_options()
    opts["client_kwargs"] = {"endpoint_url": proxy.url}
    opts["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
    return f"{s3_bucket}/run", opts


def _manager(local: Path, remote: tuple[str, dict], **kw) -> CheckpointManager:
    kw.setdefault("remote_timeout_s", 3.0)
    kw.setdefault("upload_deadline_s", 10.0)
    kw.setdefault("keep_local", 10)
    return CheckpointManager(local, remote=remote[0], storage_options=remote[1], **kw)


def _close_in_thread(mgr: CheckpointManager, **kw) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            mgr.close(**kw)
            out.append((time.monotonic() - t0, None))
        except BaseException as exc:  # handed to the test
            out.append((time.monotonic() - t0, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("raise_errors", [True, False], ids=["raises", "logs"])
def test_a_job_that_finishes_during_an_outage_ends(tmp_path, remote, proxy, caplog, raise_errors) -> None:
    """Four saves wait for a refused remote when the job ends: close() returns within one upload attempt's bound
    (remote_timeout_s), names the steps not uploaded once, raises the upload error (or only logs it), and every
    step is committed locally for the next start or `tierckpt sync`."""
    mgr = _manager(tmp_path / "local", remote)
    mgr.save(1, _state(1)).uploaded.result(timeout=60)
    proxy.set_mode("refuse")
    for s in (2, 3, 4, 5):
        mgr.save(s, _state(s))
    caplog.set_level(logging.INFO, logger="tierckpt")
    t, out = _close_in_thread(mgr, raise_upload_errors=raise_errors)
    t.join(60)
    assert out, "close() did not return within 60 s during an outage"
    took, err = out[0]
    assert took < 15, took
    assert isinstance(err, UploadError) if raise_errors else err is None, err
    reports = [r for r in caplog.records if "committed steps are not on" in r.getMessage()]
    assert len(reports) == 1 and "2, 3, 4, 5" in reports[0].getMessage() and "tierckpt sync" in reports[0].getMessage()
    assert sorted(list_root(mgr.local).steps) == [1, 2, 3, 4, 5]
    assert mgr.closed


def test_each_call_does_not_pay_the_outage_again(tmp_path, remote, proxy) -> None:
    """A restart while the remote refuses: the first restore waits for the remote once (remote_timeout_s), then
    latest_step(), steps() and load() answer from the local tier at once and health() says the remote is down;
    once the remote is back the background recheck sees it."""
    with _manager(tmp_path / "local", remote) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    proxy.set_mode("refuse")
    mgr = _manager(tmp_path / "local", remote)
    state = _empty()
    t0 = time.monotonic()
    assert mgr.restore(state) == 2
    assert time.monotonic() - t0 < 8
    assert_tree_equal(state, _state(2))
    for call in (mgr.latest_step, mgr.steps, lambda: mgr.load(), mgr.latest_step, mgr.steps):
        t0 = time.monotonic()
        call()
        assert time.monotonic() - t0 < 1.0, call
    assert mgr.latest_step() == 2 and [i.step for i in mgr.steps()] == [1, 2]
    assert not mgr.health().ok
    proxy.set_mode("forward")
    wait_for(lambda: mgr.health().ok, 30)  # rechecked in the background, with backoff
    mgr.close()


def test_retries_follow_the_backoff_and_log_once_per_change_of_state(tmp_path, remote, proxy, caplog,
                                                                     monkeypatch) -> None:
    """Three saves fail while the remote refuses; for 4.8 s the job calls latest_step() and wait(): the failed
    steps are tried again only as the backoff says (2 s, then 4 s here; 5 s and 10 s by default), the log has one
    ERROR for the outage, and the recovery is logged once."""
    monkeypatch.setattr(manager_mod, "ReplicationPolicy",
                        functools.partial(ReplicationPolicy, retry_initial_s=2.0, retry_max_s=8.0))
    mgr = _manager(tmp_path / "local", remote)
    mgr.save(1, _state(1)).uploaded.result(timeout=60)
    proxy.set_mode("refuse")
    caplog.set_level(logging.DEBUG, logger="tierckpt.replication")
    caplog.set_level(logging.INFO, logger="tierckpt")
    for s in (2, 3, 4):
        mgr.save(s, _state(s)).uploaded.exception(timeout=60)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4.8:
        mgr.latest_step()
        with pytest.raises(UploadError) if time.monotonic() - t0 < 0.2 else _nothing():
            mgr.wait()
        time.sleep(0.2)
    tries = [r for r in caplog.records if r.name == "tierckpt.replication.remote_state"
             and ("failed again" in r.getMessage() or r.levelno == logging.ERROR)]
    # 3 new saves, each tried once, then at most 2 retries of the failed steps in 4.8 s (2 s, 4 s of backoff)
    assert len(tries) <= 5, [r.getMessage()[:120] for r in tries]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("tierckpt")]
    assert len(errors) == 1, [r.getMessage()[:120] for r in errors]
    proxy.set_mode("forward")
    wait_for(lambda: {2, 3, 4} <= set(list_root(mgr.remote).steps), 60)
    mgr.wait()  # the old errors of steps since uploaded are not raised
    back = [r for r in caplog.records if "answers again" in r.getMessage()]
    assert len(back) == 1
    health = mgr.health()
    assert health.ok and health.upload_lag_steps == 0
    mgr.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


def test_an_error_that_no_longer_applies_is_not_raised(tmp_path, remote, proxy) -> None:
    """Step 2's upload fails; the remote recovers and the retry uploads it: the next wait() raises nothing."""
    mgr = _manager(tmp_path / "local", remote)
    mgr.save(1, _state(1)).uploaded.result(timeout=60)
    proxy.set_mode("refuse")
    assert isinstance(mgr.save(2, _state(2)).uploaded.exception(timeout=60), UploadError)
    proxy.set_mode("forward")
    wait_for(lambda: 2 in set(list_root(mgr.remote).steps), 60)
    wait_for(lambda: mgr.health().upload_lag_steps == 0 and mgr.health().ok, 30)
    mgr.wait()
    mgr.close()


def test_status_is_right_from_the_first_failed_request(tmp_path, remote, proxy) -> None:
    """health() is not ok from the first refused request of an upload that is still retrying; steps() marks a
    failed upload `upload-failed` while the remote cannot be listed; the errors name the refused connection."""
    mgr = _manager(tmp_path / "local", remote, remote_timeout_s=20.0, upload_deadline_s=60.0)
    mgr.save(1, _state(1)).uploaded.result(timeout=60)
    proxy.set_mode("refuse")
    h = mgr.save(2, _state(2))
    h.persisted.result(timeout=30)
    t0 = time.monotonic()
    wait_for(lambda: not mgr.health().ok, 10)
    assert time.monotonic() - t0 < 5 and not h.uploaded.done()  # seen while the upload still retries
    health = mgr.health()
    assert health.consecutive_failures >= 1 and "Could not connect" in (health.last_error or "")
    err = h.uploaded.exception(timeout=60)
    assert isinstance(err, UploadError) and "silent" not in str(err) and "Could not connect" in str(err), err
    assert {i.step: i.state for i in mgr.steps()} == {1: "local", 2: "upload-failed"}
    mgr.close(raise_upload_errors=False)


def test_a_refused_remote_is_named_as_refused_not_silent(tmp_path, remote, proxy) -> None:
    """A replaced node (nothing local) during an outage: the StorageError names the refused connection, also when
    the backend's own retries make the last try outlast the deadline (botocore's default retries here)."""
    url, opts = remote
    opts = {k: v for k, v in opts.items() if k != "config_kwargs"}
    with _manager(tmp_path / "a", (url, opts)) as mgr:
        mgr.save(1, _state(1))
    proxy.set_mode("refuse")
    with _manager(tmp_path / "wiped", (url, opts)) as mgr, pytest.raises(StorageError) as ei:
        mgr.restore(_empty())
    msg = str(ei.value)
    assert "silent" not in msg and ("Could not connect" in msg or "Connection refused" in msg), msg


def test_a_store_tells_a_refused_endpoint_from_a_silent_one(remote, proxy) -> None:
    """What a deadline's message says comes from ``Store.diagnose()``: refused, or not (silent, or answering)."""
    from tierckpt.storage.open import open_store

    store = open_store(remote[0], storage_options=remote[1], tier="remote")
    try:
        assert store.diagnose() is None
        proxy.set_mode("refuse")
        assert isinstance(store.diagnose(), ConnectionRefusedError)
        proxy.set_mode("silent")
        assert store.diagnose() is None
    finally:
        proxy.set_mode("forward")
        store.close()


def test_wait_after_a_restart_returns_with_the_local_tier_trimmed(tmp_path, remote, monkeypatch) -> None:
    """A restarted job whose local steps the remote already holds: wait() returns once local retention has run
    (keep_local=1 leaves the newest), however slow that retention is."""
    with _manager(tmp_path / "local", remote, keep_local=2) as mgr:
        for s in (8, 9):
            mgr.save(s, _state(s))
        mgr.wait()
    assert sorted(list_root(mgr.local).steps) == [8, 9]
    real = Replicator.apply_local_retention

    def slow_retention(self) -> None:
        time.sleep(0.5)
        real(self)

    monkeypatch.setattr(Replicator, "apply_local_retention", slow_retention)
    with _manager(tmp_path / "local", remote, keep_local=1) as mgr:
        mgr.wait()
        assert sorted(list_root(mgr.local).steps) == [9]
