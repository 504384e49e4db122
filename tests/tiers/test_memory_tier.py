"""The memory tier (``memory_tier=True``): a training process SIGKILLed after a save, restarted in a new process,
restores from shared memory, bit for bit what the local disk holds; a torn, wiped or corrupted memory copy falls
back to the disk; a stale tier of a dead job is reclaimed; ``close()`` frees it; ``tierckpt ls`` shows it.

Each test gets its own shared-memory folder under ``/dev/shm`` (``TIERCKPT_SHM_DIR``), so the tiers it creates and
reclaims are its own. The training processes fork from the test's server (:mod:`tests._support.procs`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import REPO_ROOT, empty_like_kill_state, kill_state, subprocess_env
from tests._support.procs import run_python
from tierckpt import CheckpointManager, cli
from tierckpt.tiers import memory

JOB = str(Path(__file__).with_name("_memory_job.py"))
pytestmark = pytest.mark.timeout(120)


def _job(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    e = subprocess_env()
    e.update(env or {})
    proc = run_python([JOB, str(root), *args], env=e, cwd=REPO_ROOT, timeout=90)
    return proc.returncode, proc.stdout, proc.stderr


def _crash_after_save(root: Path, steps: int = 2, env: dict[str, str] | None = None) -> None:
    rc, out, err = _job(root, "save", str(steps), env=env)
    assert rc == -signal.SIGKILL, err
    if env is None:
        assert "saved" in out, err


def _restart(root: Path, tmp_path: Path) -> tuple[dict[str, Any], str]:
    out = tmp_path / "restored.json"
    rc, _, err = _job(root, "restore", str(out))
    assert rc == -signal.SIGKILL, err  # it crashes again on purpose, after writing its findings
    return json.loads(out.read_text()), err


def _disk_copy(root: Path, step: int) -> dict[str, Any]:
    """The state restored from the local disk alone (no memory tier)."""
    state = empty_like_kill_state(False)
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state, step) == step
    return state


def _assert_same_as_disk(root: Path, found: dict[str, Any], tmp_path: Path) -> None:
    got = torch.load(tmp_path / "restored.json.pt")
    disk = _disk_copy(root, found["step"])
    for k in ("w", "h", "ids"):
        assert got[k].view(torch.uint8).numpy().tobytes() == disk[k].view(torch.uint8).numpy().tobytes(), k


def test_restart_after_a_crash_restores_from_memory_bit_for_bit(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    _crash_after_save(root)
    assert memory.steps_in_memory(str(root)) == {2: [0]}
    found, err = _restart(root, tmp_path)
    assert found["step"] == 2
    assert found["restored_from_memory"] == [2]  # restore()
    assert found["loaded_from_memory"] == [2, 2]  # and load()
    assert found["equal"] and found["loaded_equal"]
    assert "restore: step 2 from tier memory" in err
    _assert_same_as_disk(root, found, tmp_path)


def test_a_snapshot_killed_before_its_copy_is_committed_is_never_chosen(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    # killed at the staging point of the second save: the slot (holding step 1, committed in memory) was taken for
    # step 2, so its memory copy was withdrawn before any byte of step 2 could land in it
    _crash_after_save(root, 2, env={"TIERCKPT_FAULT": "staging:2"})
    assert memory.steps_in_memory(str(root)) == {}
    found, err = _restart(root, tmp_path)
    assert found["step"] == 1 and found["equal"]
    assert found["restored_from_memory"] == []
    assert "step 1 is not in tier memory" in err
    _assert_same_as_disk(root, found, tmp_path)


def test_a_wiped_memory_tier_falls_back_to_disk(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    _crash_after_save(root)
    shutil.rmtree(memory.job_dir(str(root)))  # a reboot
    found, _ = _restart(root, tmp_path)
    assert found["step"] == 2 and found["equal"] and found["restored_from_memory"] == []


def test_a_corrupted_memory_copy_falls_back_to_disk_with_a_log_line(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    _crash_after_save(root)
    (copy,) = memory.job_copies(str(root))[0].values()
    last = copy.files[-1]
    with open(copy.path, "r+b") as f:  # one bit of the last data file's last byte
        f.seek(last.offset + last.size - 1)
        b = f.read(1)[0]
        f.seek(last.offset + last.size - 1)
        f.write(bytes([b ^ 1]))
    found, err = _restart(root, tmp_path)
    assert found["step"] == 2 and found["equal"] and found["loaded_equal"]
    assert found["restored_from_memory"] == []
    assert f"restore: step 2 in tier memory ({copy.path}) is corrupt" in err
    _assert_same_as_disk(root, found, tmp_path)


def test_a_copy_of_another_save_of_the_step_is_not_used(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    _crash_after_save(root)
    (copy,) = memory.job_copies(str(root))[0].values()
    # the memory copy now claims another rank manifest than the one the disk's manifest.json names
    other = memory.MemoryCopy(copy.slot, copy.step, copy.save_id, copy.rank, copy.step_manifest,
                              copy.rank_manifest_name, copy.rank_manifest + b" ", copy.files, copy.path, copy.created)
    Path(copy.path + ".manifest.json").write_bytes(other.to_bytes())
    found, err = _restart(root, tmp_path)
    assert found["step"] == 2 and found["equal"] and found["restored_from_memory"] == []
    assert "is another save than the local copy" in err


def test_close_frees_the_memory_tier(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root, memory_tier=True) as mgr:
        mgr.save(1, kill_state(1, 7, False))
        mgr.wait()
        tier = mgr.components.staging.memory
        assert tier is not None and mgr.components.staging.slots[0].shared
        assert memory.steps_in_memory(str(root)) == {1: [0]}
        assert os.path.isfile(tier.slot_path(0))
    assert not os.path.exists(memory.job_dir(str(root)))
    assert os.listdir(shm) == []


def test_restore_in_the_same_process_uses_memory_and_a_later_save_still_works(tmp_path: Path, shm: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt", memory_tier=True, staging_buffers=2) as mgr:
        for step in (1, 2):
            mgr.save(step, kill_state(step, 7, False))
        mgr.wait()
        state = empty_like_kill_state(False)
        assert mgr.restore(state, 1) == 1
        tier = mgr.components.staging.memory
        assert tier is not None and tier.restored == [1]
        assert torch.equal(state["w"], kill_state(1, 7, False)["w"])
        mgr.save(3, kill_state(3, 7, False))
        mgr.wait()
        assert sorted(memory.steps_in_memory(str(tmp_path / "ckpt"))) in ([2, 3], [1, 3])
        state = empty_like_kill_state(False)
        assert mgr.restore(state) == 3 and tier.restored == [1, 3]
        assert torch.equal(state["w"], kill_state(3, 7, False)["w"])


def test_a_stale_tier_of_a_dead_job_is_reclaimed(tmp_path: Path, shm: Path) -> None:
    gone, kept, live = tmp_path / "gone", tmp_path / "kept", tmp_path / "live"
    _crash_after_save(gone, 1)
    _crash_after_save(kept, 1)
    shutil.rmtree(gone)  # the dead job's local folder is gone: its tier serves nobody
    with CheckpointManager(live, memory_tier=True) as mgr:
        # opening a memory tier reclaimed the orphan, and kept the crashed job's tier for its restart
        assert not os.path.exists(memory.job_dir(str(gone)))
        assert memory.steps_in_memory(str(kept)) == {1: [0]}
        # nobody adopted it for longer than STALE_AFTER_S: reclaimed; a live job's tier never is
        later = time.time() + memory.STALE_AFTER_S + 1
        assert memory.reclaim_stale(str(shm), now=later) == [memory.job_dir(str(kept))]
        assert mgr.components.staging.memory is not None
        assert os.path.isdir(mgr.components.staging.memory.dir)
    assert os.listdir(shm) == []


def test_ls_shows_the_memory_copy(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    _crash_after_save(root)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ls", str(root)]) == 0
    assert any(line.split()[:2] == ["2", "memory"] for line in out.getvalue().splitlines()), out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ls", "--json", str(root)]) == 0
    assert json.loads(out.getvalue())["memory"] == {"2": [0]}


def test_no_shared_memory_means_no_memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ROOT_ENV, str(tmp_path / "missing" / "shm"))
    with CheckpointManager(tmp_path / "ckpt", memory_tier=True) as mgr:
        assert mgr.components.staging.memory is None
        mgr.save(1, kill_state(1, 7, False))
        state = empty_like_kill_state(False)
        assert mgr.restore(state) == 1


def test_memory_tier_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory_tier must be a bool"):
        CheckpointManager(tmp_path / "ckpt", memory_tier="yes")  # type: ignore[arg-type]


def test_two_ranks_on_a_node_restore_each_from_its_own_memory_copy(tmp_path: Path, shm: Path) -> None:
    """Each rank has its own slot file; the step (incremental) is agreed as always (from the local tier), then
    each rank reads its shard from memory. Rank 1's copy is corrupted: rank 1 alone reads the disk, and the job
    still agrees."""
    from tests._support.ranks import assert_all_ok, rank_env, run_ranks

    worker = str(Path(__file__).with_name("_memory_ranks.py"))
    env = rank_env({memory.ROOT_ENV: str(shm)})

    def job(mode: str) -> None:
        store = f"file://{tmp_path}/store-{mode}"
        ranks = run_ranks(lambda r: [worker, mode, str(r), str(tmp_path), store], 2, tmp_path, mode, env=env,
                          timeout=90)
        if mode == "restore":
            assert_all_ok(ranks, mode, 90)
        else:
            assert ranks.returncodes == [-signal.SIGKILL] * 2, ranks.detail()

    job("save")
    assert memory.steps_in_memory(str(tmp_path / "node")) == {2: [0, 1]}
    # the steps are incremental: each rank's memory copy of step 2 carries a slot manifest
    assert json.loads((tmp_path / "node" / "step-0000000002" / "manifest.json").read_text())["refs"] == [1]
    (copy,) = memory.job_copies(str(tmp_path / "node"))[1].values()
    assert copy.slot_manifest
    at = copy.files[0].offset + copy.files[0].size - 1  # the last byte of rank 1's first data file
    with open(copy.path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 1]))
    job("restore")
    found = [json.loads((tmp_path / f"result-restore-r{r}.json").read_text()) for r in (0, 1)]
    assert [f["step"] for f in found] == [2, 2] and all(f["equal"] for f in found)
    assert found[0]["from_memory"] == [2] and found[1]["from_memory"] == []
    assert not os.path.exists(memory.job_dir(str(tmp_path / "node")))  # close() on both ranks freed it


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the slot is registered (pinned)")
def test_pinned_slots_without_cuda_stay_pageable_and_work(tmp_path: Path, shm: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(tmp_path / "ckpt", memory_tier=True, pin_memory=True) as mgr:
        mgr.save(1, kill_state(1, 7, False))
        mgr.wait()
        state = empty_like_kill_state(False)
        assert mgr.restore(state) == 1
        tier = mgr.components.staging.memory
        assert tier is not None and tier.restored == [1] and mgr.components.staging.slots[0].shared
    assert "cudaHostRegister of slot 0 failed" in caplog.text
