"""A real S3-protocol server (moto on loopback, through s3fs) behind network faults: refused, silent, denying, and a
bucket that does not exist. What a training job sees: construction never blocks on the remote, a restart restores
from the local tier after a bounded wait, never reports "no checkpoint" while a tier it could not read may hold
one, saves go on, and nothing creates a bucket or prints a credential.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointManager, StorageError, UploadError
from tierckpt.errors import StorageAccessError
from tierckpt.testing import DenyingServer, FaultProxy, refused_url
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(180)

SECRET = "sEcReT-do-not-print-9f3c"


def _state(step: int, n: int = 20_000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _empty(n: int = 20_000) -> dict:
    return {"w": torch.zeros(n), "step": -1}


def _opts(server, endpoint: str, *, secret: str | None = None) -> dict:
    opts = server.storage_options()
    opts["client_kwargs"] = {"endpoint_url": endpoint}
    opts["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
    if secret:
        opts["secret"] = secret
    return opts


def _manager(local: Path, url: str, opts: dict, **kw) -> CheckpointManager:
    kw.setdefault("remote_timeout_s", 3.0)
    kw.setdefault("upload_deadline_s", 10.0)
    return CheckpointManager(local, remote=url, storage_options=opts, **kw)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url) as p:
        yield p


def test_remote_refused_restart_restores_local_and_saves_go_on(tmp_path, s3_server, s3_bucket, proxy) -> None:
    url = f"{s3_bucket}/run"
    opts = _opts(s3_server, proxy.url)
    with _manager(tmp_path / "local", url, opts, keep_local=5) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
    proxy.set_mode("refuse")
    t0 = time.monotonic()
    mgr = _manager(tmp_path / "local", url, opts, keep_local=5)
    assert time.monotonic() - t0 < 2, "construction waited for the remote"
    state = _empty()
    t0 = time.monotonic()
    assert mgr.restore(state) == 3  # not the backend's EndpointConnectionError
    assert time.monotonic() - t0 < 15
    assert_tree_equal(state, _state(3))
    assert mgr.latest_step() == 3
    assert [i.step for i in mgr.steps()] == [1, 2, 3]
    for s in (4, 5):
        h = mgr.save(s, _state(s))  # never raises for the remote
        assert isinstance(h.uploaded.exception(timeout=60), UploadError)
    assert sorted(list_root(mgr.local).steps) == [1, 2, 3, 4, 5]
    health = mgr.health()
    assert not health.ok and health.local_step == 5 and health.upload_lag_steps >= 2
    proxy.set_mode("forward")
    h = mgr.save(6, _state(6))
    assert h.uploaded.result(timeout=60) is not None
    mgr.wait()  # steps 4 and 5 are caught up (tracked by wait()): their old errors no longer apply
    assert {4, 5, 6} <= set(list_root(mgr.remote).steps)
    assert mgr.health().ok
    mgr.close()


def test_remote_refused_and_local_empty_raises_instead_of_none(tmp_path, s3_server, s3_bucket, proxy) -> None:
    url = f"{s3_bucket}/run"
    opts = _opts(s3_server, proxy.url)
    with _manager(tmp_path / "a", url, opts) as mgr:
        mgr.save(7, _state(7))
    proxy.set_mode("refuse")
    with _manager(tmp_path / "wiped", url, opts) as mgr:  # a replaced node: nothing local
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            mgr.restore(_empty())  # None here would restart training from step 0
        assert time.monotonic() - t0 < 15
        assert ei.value.tier == "remote" and "not" in str(ei.value)
        with pytest.raises(StorageError):
            mgr.latest_step()
        with pytest.raises(StorageError):
            mgr.steps()
        proxy.set_mode("forward")
        state = _empty()
        assert mgr.restore(state) == 7
        assert_tree_equal(state, _state(7))


def test_silent_endpoint_never_blocks_construction_or_restore(tmp_path, s3_server, s3_bucket, proxy) -> None:
    url = f"{s3_bucket}/run"
    opts = _opts(s3_server, proxy.url)
    with _manager(tmp_path / "local", url, opts) as mgr:
        mgr.save(1, _state(1))
    proxy.set_mode("silent")
    t0 = time.monotonic()
    mgr = _manager(tmp_path / "local", url, opts, remote_timeout_s=2.0, upload_deadline_s=4.0)
    assert time.monotonic() - t0 < 2, "construction waited for a silent remote"
    state = _empty()
    assert mgr.restore(state) == 1
    assert time.monotonic() - t0 < 15
    assert_tree_equal(state, _state(1))
    mgr.save(2, _state(2)).persisted.result(timeout=30)
    t1 = time.monotonic()
    try:
        mgr.close()
    except UploadError:
        pass
    assert time.monotonic() - t1 < 60
    assert sorted(list_root(mgr.local).steps) == [1, 2]


def test_denied_remote_fails_uploads_fast_restores_local_and_hides_the_secret(tmp_path, s3_server, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    with DenyingServer() as denied:
        opts = _opts(s3_server, denied.url, secret=SECRET)
        with _manager(tmp_path / "local", "s3://bucket/run", opts) as mgr:
            h = mgr.save(1, _state(1))
            err = h.uploaded.exception(timeout=30)
            assert isinstance(err, UploadError) and SECRET not in str(err)
            assert isinstance(err.__cause__, StorageAccessError) or "denied" in str(err).lower(), err
            state = _empty()
            assert mgr.restore(state) == 1
            assert_tree_equal(state, _state(1))
            health = mgr.health()
            assert health.last_error and SECRET not in health.last_error
            with pytest.raises(UploadError) as ei:
                mgr.wait()
            assert SECRET not in str(ei.value)
    assert SECRET not in caplog.text
    assert "s3://bucket/run" in caplog.text


def test_a_missing_bucket_is_never_created(tmp_path, s3_server, s3_admin) -> None:
    bucket = "tierckpt-typo-bucket-4711"
    assert not s3_admin.exists(bucket)
    opts = s3_server.storage_options()
    with _manager(tmp_path / "local", f"s3://{bucket}/run", opts) as mgr:
        h = mgr.save(1, _state(1))
        assert isinstance(h.uploaded.exception(timeout=30), UploadError)
        with pytest.raises(UploadError, match=bucket):
            mgr.wait()
    s3_admin.invalidate_cache()
    assert not s3_admin.exists(bucket), "a mistyped bucket name created a bucket"
    with _manager(tmp_path / "local2", f"s3://{bucket}/run", opts, create_bucket=True) as mgr:
        assert mgr.save(1, _state(1)).uploaded.result(timeout=30) is not None
    assert s3_admin.exists(bucket)
    s3_admin.rm(bucket, recursive=True)


def test_refused_endpoint_url_gives_a_storage_error_not_a_backend_one(tmp_path, s3_server) -> None:
    opts = _opts(s3_server, refused_url())
    with _manager(tmp_path / "local", "s3://bucket/run", opts) as mgr:
        with pytest.raises(StorageError) as ei:
            mgr.restore(_empty(), source="remote")
        assert ei.value.transient is True and "s3://bucket/run" in str(ei.value)
