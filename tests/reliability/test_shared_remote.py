"""Two jobs pointed at one remote (a copy-pasted launch script): a real S3-protocol server (moto, through s3fs), job A
in this process, job B in a process of its own. No committed step of either run is ever replaced or lost: B
uploads nothing and says why, naming A's run, unless it continues A's run on purpose (it restored from the remote,
or ``continue_remote_run=True``)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from tests._support.helpers import TESTS_DIR, run_cli, subprocess_env
from tests._support.procs import run_python
from tierckpt import CheckpointManager, RunConflictError
from tierckpt.format import layout
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.local import LocalStore
from tierckpt.storage.open import open_store
from tierckpt.tiers import identity
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(180)

JOB = TESTS_DIR / "reliability" / "_job.py"


def _state(step: int, tag: float) -> dict:
    return {"w": torch.full((4096,), float(step) + tag), "step": step}


def _job(spec: dict) -> dict:
    proc = run_python([str(JOB), json.dumps(spec)], timeout=150, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _save_ids(url: str, opts: dict) -> dict[int, str]:
    store = open_store(url, storage_options=opts, tier="remote")
    try:
        return {s: read_step_manifest(store, layout.step_dir(s), s).save_id for s in list_root(store).steps}
    finally:
        store.close()


def _remote_identity(url: str, opts: dict) -> identity.RunIdentity | None:
    store = open_store(url, storage_options=opts, tier="remote")
    try:
        return identity.read(store)
    finally:
        store.close()


@pytest.fixture
def job_a(tmp_path, s3_server, s3_bucket):
    """Job A committed steps 10, 20, 30 to ``<bucket>/run``; returns (url, storage options, A's save ids)."""
    url, opts = f"{s3_bucket}/run", s3_server.storage_options()
    with CheckpointManager(tmp_path / "a", remote=url, storage_options=opts) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, _state(s, 0.25))
    ids = _save_ids(url, opts)
    assert sorted(ids) == [10, 20, 30]
    return url, opts, ids


def test_a_second_job_on_the_same_remote_replaces_nothing(tmp_path, job_a) -> None:
    """Job B (a new local folder, the same URL) saves 10 and 30 at once: its close() raises RunConflictError
    naming A's run and how to go on; A's steps keep their saves and values; B's steps stay in its folder."""
    url, opts, a_ids = job_a
    a_run = identity.read(LocalStore(tmp_path / "a"))
    out = _job({"local": str(tmp_path / "b"), "remote": url, "storage_options": opts, "steps": [10, 30],
                "tag": 0.5, "options": {"remote_timeout_s": 10}})
    assert out["error"] and out["error"][0] == "RunConflictError", out
    msg = out["error"][1]
    assert a_run.run_id in msg and "continue_remote_run=True" in msg and "restore" in msg
    assert _save_ids(url, opts) == a_ids  # nothing replaced
    assert _remote_identity(url, opts) == a_run
    assert sorted(list_root(LocalStore(tmp_path / "b")).steps) == [10, 30]  # B's checkpoints kept locally
    # the remote still restores A's values
    with CheckpointManager(tmp_path / "fresh", remote=url, storage_options=opts) as mgr:
        s = _state(-1, 0)
        assert mgr.restore(s) == 30 and float(s["w"][0]) == 30.25
    # B's local copy restores B's values (local first)
    with CheckpointManager(tmp_path / "b") as mgr:
        s = _state(-1, 0)
        assert mgr.restore(s) == 30 and float(s["w"][0]) == 30.5


def test_a_job_that_restores_from_the_remote_continues_its_run(tmp_path, job_a) -> None:
    """A new node (empty local folder) restores A's step 30 from the remote and saves 40: it adopted A's run, so
    the upload goes on; A's steps are untouched."""
    url, opts, a_ids = job_a
    a_run = identity.read(LocalStore(tmp_path / "a"))
    out = _job({"local": str(tmp_path / "node2"), "remote": url, "storage_options": opts, "steps": [40],
                "tag": 0.75, "restore": True})
    assert out["error"] is None and out["restored"] == 30 and out["restored_w"] == 30.25, out
    ids = _save_ids(url, opts)
    assert {s: ids[s] for s in a_ids} == a_ids and 40 in ids
    assert identity.read(LocalStore(tmp_path / "node2")) == a_run == _remote_identity(url, opts)


def test_a_job_with_checkpoints_of_its_own_never_resumes_the_other_run(tmp_path, job_a) -> None:
    """Job B saved 10 and 20 (not uploaded: A's remote) and restarts: restore() gives B's step 20, not A's newer
    step 30 from the shared remote, and latest_step() says 20; restore(source="remote") is the way to A's."""
    url, opts, a_ids = job_a
    out = _job({"local": str(tmp_path / "b"), "remote": url, "storage_options": opts, "steps": [10, 20],
                "tag": 0.5})
    assert out["error"][0] == "RunConflictError"
    with CheckpointManager(tmp_path / "b", remote=url, storage_options=opts) as mgr:
        s = _state(-1, 0)
        assert mgr.restore(s) == 20 and float(s["w"][0]) == 20.5
        assert mgr.latest_step() == 20
        s = _state(-1, 0)
        assert mgr.restore(s, source="remote") == 30 and float(s["w"][0]) == 30.25
    assert _save_ids(url, opts) == a_ids


def test_a_node_given_the_remotes_step_by_pull_continues_the_run(tmp_path, job_a) -> None:
    """The runbook's replaced node: `tierckpt pull` puts step 30 on the new node's disk, the job restores it from
    there and saves 40: its folder holds the remote's save, so it continues that run and uploads."""
    url, opts, a_ids = job_a
    a_run = identity.read(LocalStore(tmp_path / "a"))
    args = ["pull", url, str(tmp_path / "node2"), "--step", "30"]
    for k in ("key", "secret"):
        args += ["--storage-option", f"{k}={opts[k]}"]
    args += ["--storage-option", f"client_kwargs={json.dumps(opts['client_kwargs'])}"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _job({"local": str(tmp_path / "node2"), "remote": url, "storage_options": opts, "steps": [40],
                "tag": 0.75, "restore": True})
    assert out["error"] is None and out["restored"] == 30 and out["restored_w"] == 30.25, out
    ids = _save_ids(url, opts)
    assert {s: ids[s] for s in a_ids} == a_ids and 40 in ids
    assert identity.read(LocalStore(tmp_path / "node2")) == a_run == _remote_identity(url, opts)


def test_continue_remote_run_adopts_the_remote_run_without_a_restore(tmp_path, job_a) -> None:
    url, opts, a_ids = job_a
    a_run = identity.read(LocalStore(tmp_path / "a"))
    out = _job({"local": str(tmp_path / "b"), "remote": url, "storage_options": opts, "steps": [40], "tag": 0.5,
                "options": {"continue_remote_run": True}})
    assert out["error"] is None, out
    ids = _save_ids(url, opts)
    assert {s: ids[s] for s in a_ids} == a_ids and 40 in ids
    assert identity.read(LocalStore(tmp_path / "b")) == a_run


def test_a_conflicting_job_keeps_saving_locally_and_health_says_why(tmp_path, job_a) -> None:
    """Within the job: save() keeps working (the local tier is never cost), each handle's upload fails with
    RunConflictError, health() is not ok and names the other run, wait() raises it once."""
    url, opts, a_ids = job_a
    mgr = CheckpointManager(tmp_path / "b", remote=url, storage_options=opts)
    handles = [mgr.save(s, _state(s, 0.5)) for s in (10, 30, 31)]
    for h in handles:
        assert isinstance(h.uploaded.exception(timeout=60), RunConflictError)
        h.persisted.result(timeout=0)
    health = mgr.health()
    assert not health.ok and "another run" in (health.last_error or "")
    with pytest.raises(RunConflictError):
        mgr.wait()
    mgr.wait()  # raised once
    mgr.close()
    mgr = CheckpointManager(tmp_path / "c", remote=url, storage_options=opts)
    mgr.save(10, _state(10, 0.5))
    with pytest.raises(RunConflictError):
        mgr.close(raise_upload_errors=False)  # a conflict is raised whatever the upload-error policy
    assert _save_ids(url, opts) == a_ids


def test_a_remote_without_identity_is_claimed_only_by_the_run_that_wrote_it(tmp_path, job_a) -> None:
    """A remote written before roots recorded their run (no run.json): A's own folder continues it and records
    its identity there; a new job conflicts."""
    url, opts, a_ids = job_a
    store = open_store(url, storage_options=opts, tier="remote")
    store.remove(layout.RUN_FILE)
    (tmp_path / "a" / layout.RUN_FILE).unlink()  # the local folder of that older version had none either
    out = _job({"local": str(tmp_path / "b"), "remote": url, "storage_options": opts, "steps": [40], "tag": 0.5})
    assert out["error"] and out["error"][0] == "RunConflictError" and "recorded no identity" in out["error"][1]
    assert identity.read(store) is None and _save_ids(url, opts) == a_ids
    with CheckpointManager(tmp_path / "a", remote=url, storage_options=opts) as mgr:
        mgr.save(40, _state(40, 0.25))
    assert identity.read(store) == identity.read(LocalStore(tmp_path / "a")) is not None
    assert 40 in _save_ids(url, opts)
    store.close()


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_two_jobs_racing_for_an_empty_root_agree_on_one_run(tmp_path, s3_server, s3_bucket, kind) -> None:
    """Eight claims at once on an empty root: one identity wins and every claimant is told that one."""
    if kind == "posix":
        store = LocalStore(tmp_path / "remote", tier="remote")
    else:
        store = open_store(f"{s3_bucket}/race", storage_options=s3_server.storage_options(), tier="remote")
    mine = [identity.RunIdentity.new() for _ in range(8)]
    got: list = [None] * 8
    go = threading.Barrier(8)

    def claim(i: int) -> None:
        go.wait()
        got[i] = identity.claim(store, mine[i])

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({g.run_id for g in got}) == 1 and got[0] in mine and identity.read(store) == got[0]
    with pytest.raises(RunConflictError):
        identity.check_remote(store, next(m for m in mine if m != got[0]), local_url="x", adopt_theirs=False,
                              shares_saves=lambda steps: False)
    store.close()
