"""Remote tier end to end: ``CheckpointManager`` with ``remote="s3://..."`` against the moto S3 server on
loopback, a POSIX remote folder, zstd remote copies, retention per tier, damaged objects, and a process SIGKILLed
mid-upload whose upload a restarted manager finishes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import REPO_ROOT, assert_tree_equal, cli_output, subprocess_env
from tests._support.procs import Child, start_python
from tierckpt import CheckpointManager
from tierckpt.format import layout
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_steps
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.verify import verify_step

pytestmark = pytest.mark.timeout(180)


def _state(step: int, n: int = 40_000, zeros: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)},
        "zeros": torch.zeros(zeros),
        "opt": {"step": step, "lr": 0.5 / (step + 1)},
        "ids": torch.randint(0, 1 << 40, (100,), generator=g),
    }


def _empty(n: int = 40_000, zeros: int = 0) -> dict[str, Any]:
    return {
        "model": {"w": torch.empty(n), "b": torch.empty(33, dtype=torch.bfloat16)},
        "zeros": torch.empty(zeros),
        "opt": {"step": -1, "lr": -1.0},
        "ids": torch.empty(100, dtype=torch.int64),
    }


def _cli(*args: str) -> Child:
    return start_python(["-m", "tierckpt", *args], env=subprocess_env(), cwd=REPO_ROOT)


def _finish(proc: Child) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _s3(url: str, s3_server: Any) -> FsspecStore:
    return FsspecStore(url, storage_options=s3_server.storage_options(), tier="remote")


def _data_key(store: FsspecStore, url: str, step: int) -> str:
    _, rms = read_manifests(store, step)
    return f"{url}/{layout.step_dir(step)}/{rms[0].files[0].name}".removeprefix("s3://")


def test_s3_save_wait_lose_node_restore_verify_damage(tmp_path, s3_server, s3_bucket, s3_admin, caplog):
    url = f"{s3_bucket}/run"
    opts = s3_server.storage_options()
    local = tmp_path / "nvme"
    with CheckpointManager(local, remote=url, storage_options=opts, keep_local=2, upload_threads=2,
                           writer_threads=2) as mgr:
        handles = [mgr.save(s, _state(s)) for s in (1, 2, 3, 4)]
        mgr.wait()
        for h in handles:
            up = h.uploaded.result(timeout=0)
            assert isinstance(up, float) and up >= h.persisted.result(timeout=0) > 0
            assert h.record().upload_s == up
        info = {i.step: i for i in mgr.steps()}
        assert sorted(info) == [1, 2, 3, 4]
        assert [(info[s].local, info[s].remote, info[s].state) for s in (1, 2)] == [(False, True, "remote")] * 2
        assert [(info[s].local, info[s].remote, info[s].state) for s in (3, 4)] == [(True, True, "local+remote")] * 2
        assert mgr.latest_step() == 4

    # the node is lost: an empty local disk restores from the remote tier with no extra call
    shutil.rmtree(local)
    with CheckpointManager(local, remote=url, storage_options=opts) as mgr:
        state = _empty()
        assert mgr.restore(state) == 4
        assert_tree_equal(state, _state(4))
        state = _empty()
        assert mgr.restore(state, step=2, source="remote") == 2
        assert_tree_equal(state, _state(2))
        assert [(i.step, i.state) for i in mgr.steps()] == [(s, "remote") for s in (1, 2, 3, 4)]
    assert not [n for n in os.listdir(local) if n.startswith("step-")]  # nothing was cached or re-uploaded

    verify, ls = _cli("verify", url, "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"), \
        _cli("ls", url, "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}")
    verify, ls = _finish(verify), _finish(ls)
    assert verify.returncode == 0 and "4 of 4 steps intact" in verify.stdout, cli_output(verify)
    assert ls.returncode == 0, cli_output(ls)
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == ["1", "2", "3", "4"]
    assert all("committed" in line for line in ls.stdout.splitlines()[1:])

    # flip bytes of one data object of step 4 (same size: only hashing can tell)
    store = _s3(url, s3_server)
    key = _data_key(store, url, 4)
    raw = bytearray(s3_admin.cat_file(key))
    raw[-7] ^= 0xFF
    s3_admin.pipe_file(key, bytes(raw))
    bad_verify = _cli("verify", url, "--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}")
    shutil.rmtree(local)
    caplog.set_level(logging.WARNING, logger="tierckpt")
    with CheckpointManager(local, remote=url, storage_options=opts) as mgr:
        state = _empty()
        assert mgr.restore(state) == 3  # step 4 is skipped, the older intact step loads
        assert_tree_equal(state, _state(3))
    assert any("step 4" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
    bad_verify = _finish(bad_verify)
    assert bad_verify.returncode == 1, cli_output(bad_verify)
    assert "step 4: CORRUPT" in bad_verify.stdout and key.rsplit("/", 1)[1] in bad_verify.stdout
    assert "3 of 4 steps intact" in bad_verify.stdout
    store.close()


def test_s3_retention_keep_remote_and_keep_every(tmp_path, s3_server, s3_bucket):
    url = f"{s3_bucket}/run"
    local = tmp_path / "nvme"
    with CheckpointManager(local, remote=url, storage_options=s3_server.storage_options(), keep_local=1,
                           keep_remote=2, keep_every=3, upload_threads=2) as mgr:
        for s in range(1, 8):
            mgr.save(s, _state(s, n=2000))
        mgr.wait()
        where = {i.step: i.state for i in mgr.steps()}
    store = _s3(url, s3_server)
    # newest 2 (6, 7) plus every 3rd (3, 6) in the remote; only the newest locally
    assert list_steps(store) == {3: "committed", 6: "committed", 7: "committed"}
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == [layout.step_dir(7)]
    assert where == {3: "remote", 6: "remote", 7: "local+remote"}
    assert all(verify_step(store, s).ok for s in (3, 6, 7))
    # nothing half-deleted; besides the steps, the root holds the run's identity
    assert [n for n in store.list("") if layout.parse_step_dir(n) not in (3, 6, 7)] == [layout.RUN_FILE]
    store.close()


def test_s3_zstd_remote_copy_round_trip(tmp_path, s3_server, s3_bucket):
    url = f"{s3_bucket}/zstd"
    local = tmp_path / "nvme"
    opts = s3_server.storage_options()
    with CheckpointManager(local, remote=url, storage_options=opts, remote_compression="zstd",
                           verify_uploads=True) as mgr:
        h = mgr.save(5, _state(5, n=5000, zeros=1 << 20))
        mgr.wait()
        assert h.uploaded.result(timeout=0) > 0
    store = _s3(url, s3_server)
    manifest, rms = read_manifests(store, 5)
    files = rms[0].files
    assert all(f.compression == "zstd" for f in files)
    assert sum(f.stored_size for f in files) < manifest.total_bytes // 4  # 4 MiB of zeros compress away
    assert verify_step(store, 5).ok
    _, local_rms = read_manifests(LocalStore(local, create=False), 5)
    assert [f.checksum for f in local_rms[0].files] == [f.checksum for f in files]  # same checksums in every tier
    assert all(f.compression is None for f in local_rms[0].files)
    shutil.rmtree(local)
    with CheckpointManager(local, remote=url, storage_options=opts) as mgr:
        state = _empty(n=5000, zeros=1 << 20)
        assert mgr.restore(state, source="remote") == 5
        assert_tree_equal(state, _state(5, n=5000, zeros=1 << 20))
    store.close()


def test_posix_remote_folder(tmp_path):
    local, nfs = tmp_path / "nvme", tmp_path / "lustre" / "run"
    with CheckpointManager(local, remote=str(nfs), keep_local=1, keep_remote=2) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, _state(s, n=3000))
        mgr.wait()
    remote = LocalStore(nfs, tier="remote", create=False)
    assert list_steps(remote) == {20: "committed", 30: "committed"}
    assert not [n for n in os.listdir(nfs) if layout.is_leftover(n)]  # committed by rename: no .tmp- left
    assert verify_step(remote, 20).ok and verify_step(remote, 30).ok
    shutil.rmtree(local)
    with CheckpointManager(local, remote=f"file://{nfs}") as mgr:
        state = _empty(n=3000)
        assert mgr.restore(state) == 30
        assert_tree_equal(state, _state(30, n=3000))
        state = _empty(n=3000)
        assert mgr.restore(state, step=20, source="remote") == 20
        assert_tree_equal(state, _state(20, n=3000))
        with pytest.raises(FileNotFoundError):
            mgr.restore(_empty(n=3000), step=10)


_CHILD = textwrap.dedent("""
    import sys, time, torch
    from tierckpt import CheckpointManager
    local, url, endpoint = sys.argv[1:4]

    def state(step, n):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(n, generator=g), "step": step}

    mgr = CheckpointManager(local, remote=url, storage_options={"client_kwargs": {"endpoint_url": endpoint}},
                            keep_local=5, upload_bandwidth_mbps=1.0, upload_part_mb=5)
    mgr.save(1, state(1, 1000))
    mgr.wait()
    h = mgr.save(2, state(2, 1 << 20))  # 4 MiB at 1 MB/s: the bandwidth cap holds it back ~3 s
    h.persisted.result()
    print("PERSISTED", flush=True)
    time.sleep(600)
""")


def test_sigkill_mid_upload_resumes_on_restart(tmp_path, s3_server, s3_bucket, caplog):
    url = f"{s3_bucket}/run"
    local = tmp_path / "nvme"
    child = start_python(["-c", _CHILD, str(local), url, s3_server.endpoint_url], folder=tmp_path,
                         env=subprocess_env(), cwd=tmp_path)
    try:
        line = child.readline(timeout=120)
        assert line.strip() == "PERSISTED", f"{line!r} {child.errors()}"
        time.sleep(0.7)  # into the throttled upload of step 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    store = _s3(url, s3_server)
    assert list_steps(store).get(1) == "committed"
    assert list_steps(store).get(2) != "committed"  # killed mid-upload: not visible as a checkpoint
    assert list_steps(LocalStore(local, create=False)) == {1: "committed", 2: "committed"}

    caplog.set_level(logging.INFO, logger="tierckpt")
    with CheckpointManager(local, remote=url, storage_options=s3_server.storage_options(), keep_local=5) as mgr:
        mgr.wait()
        assert {i.step: i.state for i in mgr.steps()} == {1: "local+remote", 2: "local+remote"}
        shutil.rmtree(local / layout.step_dir(2))  # restore must now come from the remote copy
        g = torch.Generator().manual_seed(2)
        want = {"w": torch.randn(1 << 20, generator=g), "step": 2}
        state = {"w": torch.empty(1 << 20), "step": -1}
        assert mgr.restore(state, source="remote") == 2
        assert_tree_equal(state, want)
    requeued = [r.getMessage() for r in caplog.records if "re-queueing upload" in r.getMessage()]
    assert len(requeued) == 1 and "step 2" in requeued[0], requeued  # step 1 was committed there: not re-sent
    assert list_steps(store) == {1: "committed", 2: "committed"}
    assert verify_step(store, 2).ok
    store.close()


def _step_names(root: Path) -> list[int]:
    return sorted(s for s in (layout.parse_step_dir(n) for n in os.listdir(root)) if s is not None)


def test_local_retention_after_remote_retention_pruned_the_step(tmp_path):
    local, nfs = tmp_path / "nvme", tmp_path / "nfs"
    with CheckpointManager(local, remote=str(nfs), keep_local=2, keep_remote=1) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, _state(s, n=100))
            mgr.wait()
    assert _step_names(nfs) == [4]
    assert _step_names(local) == [3, 4]  # keep_local=2; 1 and 2 were replicated (then pruned there by policy)


def test_restart_does_not_reupload_steps_remote_retention_removed(tmp_path, caplog):
    local, nfs = tmp_path / "nvme", tmp_path / "nfs"
    with CheckpointManager(local, remote=str(nfs), keep_local=3, keep_remote=1) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s, n=100))
            mgr.wait()
    assert _step_names(local) == [1, 2, 3] and _step_names(nfs) == [3]
    caplog.set_level(logging.INFO, logger="tierckpt")
    with CheckpointManager(local, remote=str(nfs), keep_local=3, keep_remote=1) as mgr:
        mgr.wait()
    requeued = [r.getMessage() for r in caplog.records if "re-queueing upload" in r.getMessage()]
    assert requeued == [], requeued


def test_small_upload_part_on_s3_is_refused_up_front_or_works(tmp_path, s3_server, s3_bucket):
    try:
        mgr = CheckpointManager(tmp_path / "nvme", remote=f"{s3_bucket}/run",
                                storage_options=s3_server.storage_options(), upload_part_mb=1)
    except ValueError as exc:
        assert "upload_part_mb" in str(exc)
        return
    with mgr:
        mgr.save(1, _state(1, n=100))
        mgr.wait()
    assert list_steps(_s3(f"{s3_bucket}/run", s3_server)) == {1: "committed"}
