"""Staging buffers a restore allocates start on a huge-page boundary and carry ``MADV_HUGEPAGE`` (checked in the
kernel's own view of the mapping, ``/proc/self/smaps``); small ones, and those a save allocates, keep plain pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt.snapshot import staging

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or staging._MADV_HUGEPAGE is None or not Path("/proc/self/smaps").exists(),
    reason="transparent huge pages are a Linux feature")


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux_only
def test_large_buffers_are_huge_page_aligned_and_advised(monkeypatch):
    buf = staging.aligned_empty(staging.HUGE_PAGE_MIN_BYTES + 12345, pin=False, huge_pages=True)
    assert buf.data_ptr() % staging.HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(buf.data_ptr())
    buf.fill_(7)  # usable as any buffer
    assert int(buf[-1]) == 7 and buf.numel() == staging.HUGE_PAGE_MIN_BYTES + 12345


@linux_only
def test_small_or_unasked_buffers_keep_plain_pages():
    small = staging.aligned_empty(1 << 20, pin=False, huge_pages=True)
    assert small.data_ptr() % staging.BUFFER_ALIGN == 0
    assert "hg" not in _vm_flags(small.data_ptr())
    big = staging.aligned_empty(staging.HUGE_PAGE_MIN_BYTES, pin=False)
    assert big.data_ptr() % staging.BUFFER_ALIGN == 0
    assert "hg" not in _vm_flags(big.data_ptr())


@linux_only
def test_a_failing_advice_leaves_a_working_buffer(monkeypatch):
    def refuse(*_args):
        raise OSError("no madvise here")

    monkeypatch.setattr(staging, "_libc_madvise", refuse)
    buf = staging.aligned_empty(staging.HUGE_PAGE_MIN_BYTES, pin=False, huge_pages=True)
    assert "hg" not in _vm_flags(buf.data_ptr())
    buf.fill_(3)
    assert int(buf.sum()) == 3 * buf.numel()


@linux_only
def test_restore_slots_use_huge_pages_and_save_slots_do_not(tmp_path):
    state = {"w": torch.arange(40 << 18, dtype=torch.float32)}  # 40 MiB
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, state)
        mgr.wait()
        (slot,) = mgr._pool._slots
        assert slot.buffer is not None and "hg" not in _vm_flags(slot.buffer.data_ptr())
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:  # a restarted job: the restore allocates the slot
        target = {"w": torch.zeros_like(state["w"])}
        assert mgr.restore(target) == 1
        (slot,) = mgr._pool._slots
        assert slot.buffer is not None and "hg" in _vm_flags(slot.buffer.data_ptr())
        before = mgr._pool.allocations
        mgr.save(2, state)  # the save after it reuses that slot, huge pages and all
        mgr.wait()
        assert mgr._pool.allocations == before and "hg" in _vm_flags(slot.buffer.data_ptr())
    assert torch.equal(target["w"], state["w"])
