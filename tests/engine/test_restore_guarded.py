"""A default restore of local files is guarded. It reads its large CPU tensors in place, saving each
range's old bytes into its staging slot just before the range is overwritten (``tiers.undo.UndoLog``), so no copy
of every byte follows the last read. A restore that fails puts the old bytes back: the state is bit-identical to
before, whether the files are read cold (``O_DIRECT`` through bounce buffers) or warm (vectored reads), whether a
checksum or a read fails, and when a rank releases a prepared step unapplied (another rank could not load it).

Real files on the real disk; the page cache is emptied per file for the cold case.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import (
    assert_tree_equal,
    clone_tree,
    data_files,
    direct_io_supported,
    evict_data_files,
    flip_byte,
    step_path,
)
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.engine import restore as _restore
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import reader
from tierckpt.tiers.undo import UndoLog

pytestmark = pytest.mark.timeout(120)

LARGE = _restore.DIRECT_READ_MIN_BYTES


@pytest.fixture(autouse=True)
def _small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_restore, "BOUNCE_SIZE", 64 << 10)  # every large tensor crosses several bounce buffers
    monkeypatch.setattr(reader, "FUSED_BLOCK", 12 << 10)  # and each copy-out (and save) runs in several blocks
    monkeypatch.setattr(reader, "READ_CHUNK", 96 << 10)  # and warm vectored reads come in several batches


def _state(seed: int = 5) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(100_000 + 3_001 * i, generator=g) for i in range(5)},  # 400+ KiB each
        "half": torch.randn(150_001, generator=g).to(torch.bfloat16),
        "small": torch.randn(33, generator=g),  # below DIRECT_READ_MIN_BYTES: staged, copied in once verified
        "step": seed,
    }


def _target(state: dict[str, Any]) -> dict[str, Any]:
    """A live state shaped like ``state`` whose tensors hold other, recognisable bytes."""
    out = clone_tree(state)
    for t in [*out["model"].values(), out["half"], out["small"]]:
        t.fill_(-3.5)
    out["step"] = -1
    return out


def _large_bytes(state: dict[str, Any]) -> int:
    return sum(t.nbytes for t in [*state["model"].values(), state["half"]] if t.nbytes >= LARGE)


def _save(root: Path, *states: dict[str, Any]) -> None:
    with CheckpointManager(root, file_size_mb=1, writer_threads=2) as mgr:
        for step, state in enumerate(states, start=1):
            mgr.save(step, state)
        mgr.wait()


class _UndoSpy:
    """What every UndoLog of the test ended with: ('discard' | 'rollback', bytes saved, bytes put back)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ends: list[tuple[str, int, int]] = []
        real_discard, real_rollback = UndoLog.discard, UndoLog.rollback

        def discard(log: UndoLog) -> None:
            self.ends.append(("discard", log.saved_bytes, 0))
            real_discard(log)

        def rollback(log: UndoLog) -> int:
            saved = log.saved_bytes
            restored = real_rollback(log)
            self.ends.append(("rollback", saved, restored))
            return restored

        monkeypatch.setattr(UndoLog, "discard", discard)
        monkeypatch.setattr(UndoLog, "rollback", rollback)


def _read_cold(root: Path, step: int, cold: bool) -> None:
    if cold:
        if not direct_io_supported(root):
            pytest.skip("no O_DIRECT on this file system: the cold path is the warm one")
        evict_data_files(step_path(root, step))


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_default_restore_reads_large_tensors_in_place_saving_their_old_bytes(tmp_path: Path, cold: bool,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    _save(tmp_path, state)
    _read_cold(tmp_path, 1, cold)
    spy = _UndoSpy(monkeypatch)
    target = _target(state)
    addresses = {k: t.data_ptr() for k, t in target["model"].items()}
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 1
    assert_tree_equal(target, state)
    assert {k: t.data_ptr() for k, t in target["model"].items()} == addresses  # loaded into the same memory
    # every large tensor's old bytes were saved (each exactly once), and kept no longer than the restore
    assert spy.ends == [("discard", _large_bytes(state), 0)]


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "warm"])
def test_a_corrupt_file_gets_every_old_byte_put_back(tmp_path: Path, cold: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    _save(tmp_path, state)
    flip_byte(data_files(step_path(tmp_path, 1))[-1], offset_from_end=5)  # the last tensor of the last file
    _read_cold(tmp_path, 1, cold)
    spy = _UndoSpy(monkeypatch)
    target = _target(state)
    before = clone_tree(target)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="the state was not changed") as err:
            mgr.restore(target, step=1)
        assert err.value.step == 1 and err.value.bad_files
        # the slot holding the old bytes came back
        assert mgr.components.staging.free_slots == mgr.options.staging_buffers
    assert_tree_equal(target, before)
    # the reads had overwritten tensors before the mismatch was found: putting them back was needed
    assert len(spy.ends) == 1 and spy.ends[0][0] == "rollback"
    assert spy.ends[0][1] == spy.ends[0][2] > 0


def test_a_failed_read_gets_the_old_bytes_put_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    _save(tmp_path, state)
    real = LocalStore.readinto_many
    calls = [0]

    def failing(store: LocalStore, rel: str, offset: int, buffers: list[memoryview]) -> int:
        calls[0] += 1
        if calls[0] == 6:
            raise OSError(5, "Input/output error (injected)")
        return real(store, rel, offset, buffers)

    monkeypatch.setattr(LocalStore, "readinto_many", failing)
    spy = _UndoSpy(monkeypatch)
    target = _target(state)
    before = clone_tree(target)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(OSError, match="injected"):
            mgr.restore(target, step=1)
        assert mgr.components.staging.free_slots == mgr.options.staging_buffers
    assert_tree_equal(target, before)
    assert [end for end, *_ in spy.ends] == ["rollback"] and spy.ends[0][2] > 0


def test_a_corrupt_newest_step_falls_back_to_the_older_one_whole(tmp_path: Path) -> None:
    old, new = _state(1), _state(2)
    _save(tmp_path, old, new)
    flip_byte(data_files(step_path(tmp_path, 2))[-1], offset_from_end=5)
    target = _target(old)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target) == 1
    assert_tree_equal(target, old)


def test_a_prepared_step_released_unapplied_puts_the_old_bytes_back(tmp_path: Path) -> None:
    """What a rank does when another rank cannot load the step (``_sharded.restore``)."""
    state = _state()
    _save(tmp_path, state)
    target = _target(state)
    before = clone_tree(target)
    with CheckpointManager(tmp_path) as mgr:
        prepared = _restore.prepare(mgr.components.engine, mgr.local, 1, target, True)
        assert torch.equal(target["model"]["w0"], state["model"]["w0"])  # read in place already
        assert target["step"] == -1  # the rest waits for apply()
        prepared.release()
        prepared.release()  # idempotent: nothing is put back twice
        assert_tree_equal(target, before)
        assert mgr.components.staging.free_slots == mgr.options.staging_buffers
        _restore.prepare(mgr.components.engine, mgr.local, 1, target, True).apply()
    assert_tree_equal(target, state)


def test_no_guard_where_nothing_large_is_read_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tensors only, or ``in_place=True``: no old bytes are saved (the first is staged whole and planned
    while the disk reads; the second promises nothing on failure)."""
    made: list[UndoLog] = []
    real_init = UndoLog.__init__

    def init(log: UndoLog) -> None:
        made.append(log)
        real_init(log)

    monkeypatch.setattr(UndoLog, "__init__", init)
    g = torch.Generator().manual_seed(3)
    small = {f"t{i}": torch.randn(2_000, generator=g) for i in range(40)}
    _save(tmp_path / "small", small)
    target = {k: torch.zeros_like(v) for k, v in small.items()}
    with CheckpointManager(tmp_path / "small") as mgr:
        assert mgr.restore(target) == 1
    assert_tree_equal(target, small)
    state = _state()
    _save(tmp_path / "large", state)
    target = _target(state)
    with CheckpointManager(tmp_path / "large") as mgr:
        assert mgr.restore(target, in_place=True) == 1
    assert_tree_equal(target, state)
    assert made == []
    with CheckpointManager(tmp_path / "large") as mgr:  # the control: the same state, default restore
        assert mgr.restore(_target(state)) == 1
    assert len(made) == 1


def _memory(n: int) -> tuple[bytearray, int]:
    buf = bytearray(n)
    return buf, ctypes.addressof((ctypes.c_char * n).from_buffer(buf))


def test_rollback_of_overlapping_ranges_ends_with_the_first_saved_bytes() -> None:
    live, live_at = _memory(16)
    live[:] = bytes(range(16))
    saved, saved_at = _memory(32)
    log = UndoLog()
    log.save(live_at, saved_at, 8)  # bytes 0-7 saved, then overwritten
    live[0:8] = b"A" * 8
    log.save(live_at + 4, saved_at + 16, 8)  # bytes 4-11 (4-7 already new) saved, then overwritten
    live[4:12] = b"B" * 8
    assert log.saved_bytes == 16
    assert log.rollback() == 16
    assert bytes(live) == bytes(range(16))
    assert log.rollback() == 0  # once


def test_place_saves_live_parts_at_their_file_position_only() -> None:
    buffer = memoryview(bytearray(100))
    base = ctypes.addressof((ctypes.c_char * 100).from_buffer(buffer.obj))  # type: ignore[arg-type]
    live = memoryview(bytearray(10))
    assert UndoLog.place(buffer[20:30], 20, buffer) is None  # the buffer's own bytes (a header, a small tensor)
    assert UndoLog.place(live, 40, buffer) == base + 40
    with pytest.raises(ValueError, match="runs past"):
        UndoLog.place(live, 95, buffer)
    with pytest.raises(ValueError, match="writable"):
        UndoLog.place(memoryview(bytes(10)), 0, buffer)
