"""The files a manager keeps under fixed names in its local root: the folder lock ``.lock-rank<N>`` and the record
log ``saves.jsonl``.

- The lock belongs to the process that took it: a child forked by it (``os.fork``, a multiprocessing or DataLoader
  worker) neither keeps the folder locked once the parent died (a SIGKILLed job restarts while its workers linger)
  nor unlocks it while the parent lives (a child that drops its copy of the manager);
- neither file is ever opened through a symbolic link (or any other non-regular file) planted at its name: a file
  outside the root stays untouched and the error names the path;
- their modes follow the process umask, as every file a save writes does.

Real processes, real signals, real links; nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._support.helpers import subprocess_env
from tests._support.procs import Child, start_python
from tierckpt import CheckpointLockedError, CheckpointManager, StorageAccessError
from tierckpt.storage import folder_lock

pytestmark = pytest.mark.timeout(120)

LOCK = ".lock-rank00000"
VICTIM_TEXT = "precious data outside the checkpoint root\n"


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000, dtype=torch.float32)}


# ------------------------------------------------------------------------------------------------- forked children
_HOLDER = """
import gc, multiprocessing, os, sys, time
import tierckpt

root, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
mgr = tierckpt.CheckpointManager(root)
if mode == "os.fork":
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
elif mode == "multiprocessing":
    proc = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    proc.start()
    pid = proc.pid
elif mode == "child-drops-manager":  # the child lets its copy of the manager go, as a worker's exit would
    pid = os.fork()
    if pid == 0:
        del mgr
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
else:  # no child: the plain holder
    pid = 0
with open(out + ".tmp", "w") as f:
    f.write(str(pid))
os.rename(out + ".tmp", out)
time.sleep(300)
"""


def _start_holder(tmp_path: Path, root: Path, mode: str) -> tuple[Child, int]:
    """A process that constructs a manager on ``root`` (so it holds the folder lock) and, as ``mode`` says, forks;
    returns it and its child's pid (0 without a live one) once it is there."""
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(_HOLDER))
    out = tmp_path / f"child-{mode}.pid"
    proc = start_python([str(script), str(root), mode, str(out)], env=subprocess_env(), folder=tmp_path)
    deadline = time.monotonic() + 60
    while not out.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the holder exited with {proc.returncode} before it forked")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the holder did not start within 60 s")
        time.sleep(0.05)
    return proc, int(out.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) holds no files
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids to SIGKILL at the end of the test (a holder's orphaned child)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("mode", ["os.fork", "multiprocessing"])
def test_restart_succeeds_while_a_forked_child_of_the_killed_job_lives(tmp_path: Path, mode: str,
                                                                      reap: list[int]) -> None:
    root = tmp_path / "ckpt"
    proc, child = _start_holder(tmp_path, root, mode)
    reap.append(child)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert child > 0 and _alive(child), "the forked child should outlive its SIGKILLed parent for this test"
    with CheckpointManager(root) as mgr:  # the restart: the lingering child must not keep the folder locked
        mgr.save(1, _state())
        mgr.wait()
    assert _alive(child)


def test_second_manager_is_refused_while_the_holder_lives(tmp_path: Path, reap: list[int]) -> None:
    root = tmp_path / "ckpt"
    proc, _ = _start_holder(tmp_path, root, "none")
    try:
        with pytest.raises(CheckpointLockedError) as ei:
            CheckpointManager(root)
        assert LOCK in str(ei.value)
        assert folder_lock.live_holders(str(root)) == [0]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with CheckpointManager(root):
        pass


def test_a_child_dropping_its_copy_of_the_manager_does_not_unlock_the_parent(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    proc, _ = _start_holder(tmp_path, root, "child-drops-manager")
    try:
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(root)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_lock_taken_again_in_a_forked_child_is_its_own(tmp_path: Path) -> None:
    """The child closes the inherited descriptor only: a lock it takes itself after the fork works as any other."""
    root = tmp_path / "ckpt"
    root.mkdir()
    fd = folder_lock.acquire(str(root), 3)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 2
            try:
                if not _is_open(fd):  # the inherited descriptor is closed at the fork
                    code = 1
                    folder_lock.acquire(str(root), 3)
            except CheckpointLockedError:
                code = 0  # and the parent's lock is still there: the child cannot take it
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child kept the inherited lock descriptor, or got the lock"
        assert folder_lock.held_by_other(str(root), 3)  # still held (by this process: the child never unlocked)
    finally:
        folder_lock.release(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------------------------- planted links
@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def test_lock_file_planted_as_a_symlink_is_refused(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK).symlink_to(victim)
    with pytest.raises(StorageAccessError) as ei:
        CheckpointManager(root)
    assert str(root / LOCK) in str(ei.value) and "symbolic link" in str(ei.value)
    assert victim.read_text() == VICTIM_TEXT
    assert folder_lock.live_holders(str(root)) == []  # probing never follows it either


def test_lock_file_planted_as_a_dangling_symlink_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    target = tmp_path / "outside-created"
    (root / LOCK).symlink_to(target)
    with pytest.raises(StorageAccessError):
        CheckpointManager(root)
    assert not target.exists()


def test_lock_file_planted_as_a_fifo_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    os.mkfifo(root / LOCK)
    with pytest.raises(StorageAccessError) as ei:
        CheckpointManager(root)
    assert "not a regular file" in str(ei.value)
    assert folder_lock.held_by_other(str(root), 0) is False  # and the probe does not block on it


def test_records_file_planted_as_a_symlink_is_never_followed(tmp_path: Path, victim: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "saves.jsonl").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="tierckpt"), CheckpointManager(root) as mgr:
        mgr.save(1, _state())
        mgr.wait()
        assert [r.step for r in mgr.records()] == [1]  # the save itself is not affected
    assert victim.read_text() == VICTIM_TEXT
    assert (root / "saves.jsonl").is_symlink()
    msgs = [r.getMessage() for r in caplog.records if "saves.jsonl" in r.getMessage()]
    assert msgs and "symbolic link" in msgs[0] and str(root / "saves.jsonl") in msgs[0]


def test_records_file_is_appended_as_before(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2):
        with CheckpointManager(root) as mgr:
            mgr.save(step, _state())
    lines = (root / "saves.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"step": 1' in lines[0].replace('"step":1', '"step": 1')


# ----------------------------------------------------------------------------------------------------- file modes
def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_saved_files_lock_and_records_follow_the_umask(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "ckpt"
    old = os.umask(umask)
    try:
        with CheckpointManager(root) as mgr:
            mgr.save(1, _state())
            mgr.wait()
    finally:
        os.umask(old)
    modes = _modes(root)
    assert LOCK in modes and "saves.jsonl" in modes and any(n.endswith(".safetensors") for n in modes)
    for name, mode in modes.items():
        is_dir = (root / name).is_dir()
        want = (0o777 if is_dir else 0o666) & ~umask if umask == 0o077 else (0o755 if is_dir else 0o644)
        assert mode == want, f"{name}: mode {mode:o}, expected {want:o} under umask {umask:03o}"


def test_local_store_never_writes_through_a_link(tmp_path: Path, victim: Path) -> None:
    from tierckpt.storage.local import LocalStore

    store = LocalStore(tmp_path / "tier")
    store.makedirs("step-0000000001")
    (tmp_path / "tier" / "step-0000000001" / "manifest.json").symlink_to(victim)
    for direct in (False, True):
        store.direct_io = direct
        with pytest.raises(StorageAccessError) as ei:
            store.write_bytes("step-0000000001/manifest.json", b"x" * (2 << 20))
        assert "symbolic link" in str(ei.value) and "manifest.json" in str(ei.value)
    assert victim.read_text() == VICTIM_TEXT
