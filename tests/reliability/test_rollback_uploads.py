"""A rollback while a restarted job resumes its uploads: steps 11-20 exist only locally, the remote (a real
S3-protocol server behind a slow ``FaultProxy``) is uploading step 20 when the operator runs ``restore(step=5)``
and ``rollback_to(5)``. No upload of a set-aside step may land afterwards; a kill during ``rollback_to`` followed by
a retry converges to the same state."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from tests._support.helpers import assert_tree_equal, subprocess_env
from tests._support.procs import run_python
from tests._support.remote import wait_for
from tierckpt import CheckpointManager
from tierckpt.format import layout
from tierckpt.storage.open import open_store
from tierckpt.testing import FaultProxy
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(180)

N = 256 * 1024  # 1 MiB a step


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(N), "step": -1}


@pytest.fixture
def setup(tmp_path, s3_server, s3_bucket):
    """Steps 1-5 committed in both tiers, 11-20 only locally (their uploads failed); a proxy in front of S3."""
    with FaultProxy(s3_server.endpoint_url) as proxy:
        opts = s3_server.storage_options()
        opts["client_kwargs"] = {"endpoint_url": proxy.url}
        opts["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}
        url = f"{s3_bucket}/run"
        kw = {"storage_options": opts, "keep_local": 20, "remote_timeout_s": 5.0, "upload_deadline_s": 60.0}
        with CheckpointManager(tmp_path / "local", remote=url, **kw) as mgr:
            for s in range(1, 6):
                mgr.save(s, _state(s))
        proxy.set_mode("refuse")
        mgr = CheckpointManager(tmp_path / "local", remote=url, **{**kw, "remote_timeout_s": 1.0})
        for s in range(11, 21):
            mgr.save(s, _state(s))
        mgr.close(raise_upload_errors=False)
        proxy.set_mode("forward")
        remote = open_store(url, storage_options=s3_server.storage_options(), tier="remote")
        assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5]
        yield tmp_path / "local", url, kw, proxy, remote
        remote.close()


def test_a_resumed_upload_never_lands_above_the_rollback_point(setup) -> None:
    local, url, kw, proxy, remote = setup
    proxy.set_mode("slow", bytes_per_s=256 * 1024)  # a step takes ~4 s to upload
    mgr = CheckpointManager(local, remote=url, **kw)  # resumes 20, 19, ... newest first
    wait_for(lambda: mgr.health().uploading == 20, 30)
    state = _empty()
    assert mgr.restore(state, step=5) == 5
    assert_tree_equal(state, _state(5))
    t0 = time.monotonic()
    assert mgr.rollback_to(5) == list(range(11, 21))
    assert time.monotonic() - t0 < 20  # the upload in progress was cancelled, not waited out
    proxy.set_mode("forward")
    time.sleep(1.0)  # what an abandoned request could still have landed would land now
    assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5]
    mgr.save(6, _state(6))  # no RollbackError: nothing above 5 is committed anywhere
    mgr.wait()
    mgr.close()
    assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5, 6]
    assert max(list_root(mgr.local).steps) == 6
    with CheckpointManager(local, remote=url, **kw) as again:  # a restart restores the new branch
        state = _empty()
        assert again.restore(state) == 6
        assert_tree_equal(state, _state(6))


_ROLLBACK = """
import json, sys
import torch
from tierckpt import CheckpointManager
spec = json.loads(sys.argv[1])
mgr = CheckpointManager(spec["local"], remote=spec["url"], **spec["kw"])
state = {"w": torch.zeros(spec["n"]), "step": -1}
mgr.restore(state, step=5)
print("restored", flush=True)
mgr.rollback_to(5)
print("done", flush=True)
"""


@pytest.mark.parametrize("hit", [4, 13])
def test_a_kill_during_rollback_to_and_a_retry_converge(setup, hit: int) -> None:
    """Steps 11-20 uploaded too; SIGKILL after the hit-th step set aside (the ten remote ones first, then the
    local ones), then the same calls again in a new process (whose replicator meanwhile resumes the uploads of
    the local steps the remote no longer holds): the state is the one an uninterrupted rollback leaves."""
    local, url, kw, proxy, remote = setup
    with CheckpointManager(local, remote=url, **kw) as mgr:
        mgr.wait()  # the resumed uploads of 11-20
    assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5, *range(11, 21)]
    env = {**subprocess_env(), "TIERCKPT_FAULT": f"rollback:{hit}"}
    spec = json.dumps({"local": str(local), "url": url, "kw": kw, "n": N})
    proc = run_python(["-c", _ROLLBACK, spec], timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    env.pop("TIERCKPT_FAULT")
    proc = run_python(["-c", _ROLLBACK, spec], timeout=120, env=env)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5]
    assert sorted(list_root(open_store(str(local), tier="local")).steps) == [1, 2, 3, 4, 5]
    aside = sorted(n for n in os.listdir(local) if n.startswith(layout.ASIDE_PREFIX))
    assert len(aside) == 10  # every abandoned step's data kept, once
    with CheckpointManager(local, remote=url, **kw) as mgr:
        state = _empty()
        assert mgr.restore(state) == 5
        mgr.save(6, _state(6))
        mgr.wait()
    assert sorted(list_root(remote).steps) == [1, 2, 3, 4, 5, 6]
