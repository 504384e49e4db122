"""``reserve_staging(state)`` allocates the staging buffer and faults its pages in on a background thread, so the
first save does not pay for them; a save that comes first waits for that slot; a grown state still gets room."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from helpers_core import assert_tree_equal, zeros_like_tree

import tierckpt
from tierckpt.errors import CheckpointError
from tierckpt.snapshot import staging


def _state(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": {f"t{i}": torch.randn(100_000, generator=g) for i in range(n)}, "step": 1}


def _assert_the_save_reuses_the_buffer(mgr, step: int, state: dict) -> None:
    """With one staging buffer already in the pool, saving ``state`` as ``step`` allocates none; the step restores."""
    assert mgr._pool.allocations == 1
    mgr.save(step, state)
    mgr.wait()
    assert mgr._pool.allocations == 1, "the save allocated a buffer of its own"
    target = zeros_like_tree(state)
    assert mgr.restore(target) == step
    assert_tree_equal(target, state)


def test_the_first_save_reuses_the_reserved_buffer(tmp_path):
    state = _state()
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        fut = mgr.reserve_staging(state)
        assert fut.result(10) >= 0
        _assert_the_save_reuses_the_buffer(mgr, 1, state)


@pytest.mark.parametrize("writer_threads", [1, 2])
def test_the_first_save_after_a_restore_reuses_the_restore_buffer(tmp_path, writer_threads):
    """A restarted job restores, then saves: the default restore's staging buffer serves that save (no second
    state-sized allocation and first touch)."""
    state = _state()
    with tierckpt.CheckpointManager(tmp_path / "ck", writer_threads=writer_threads) as mgr:
        mgr.save(1, state)
        mgr.wait()
    with tierckpt.CheckpointManager(tmp_path / "ck", writer_threads=writer_threads) as mgr:
        target = zeros_like_tree(state)
        assert mgr.restore(target) == 1
        assert_tree_equal(target, state)
        _assert_the_save_reuses_the_buffer(mgr, 2, target)


def test_a_save_that_comes_first_waits_for_the_reserved_slot(tmp_path, monkeypatch):
    state = _state()
    entered, calls = threading.Event(), []
    real = staging.fault_in

    def slow_fault_in(buffer, *, pinned):
        calls.append(buffer.numel())
        entered.set()
        time.sleep(0.3)
        real(buffer, pinned=pinned)

    monkeypatch.setattr(staging, "fault_in", slow_fault_in)
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        fut = mgr.reserve_staging(state)
        assert entered.wait(10)
        mgr.save(1, state)  # blocks until the reserve thread gives the slot back
        assert fut.done() and fut.result() >= 0.3
        mgr.wait()
        assert mgr._pool.allocations == 1 and len(calls) == 1
        target = zeros_like_tree(state)
        assert mgr.restore(target) == 1
    assert_tree_equal(target, state)


def test_a_state_that_grew_after_the_reservation_gets_a_bigger_buffer(tmp_path):
    small, big = _state(2), _state(40)  # 16 MB against 0.8 MB: more than the reserved buffer holds
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.reserve_staging(small).result(10)
        reserved = mgr._pool._slots[0].capacity
        mgr.save(1, big)
        mgr.wait()
        assert mgr._pool._slots[0].capacity > reserved
        target = zeros_like_tree(big)
        assert mgr.restore(target) == 1
    assert_tree_equal(target, big)


def test_reserve_keeps_no_reference_to_the_state(tmp_path):
    state = _state()
    ref = weakref.ref(state["w"]["t0"])
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.reserve_staging(state).result(10)
        del state
        gc.collect()
        assert ref() is None


def test_reserve_on_a_closed_manager_raises(tmp_path):
    mgr = tierckpt.CheckpointManager(tmp_path / "ck")
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.reserve_staging(_state())


def test_fault_in_keeps_the_bytes_with_madvise_and_zeroes_without(monkeypatch):
    buf = staging.aligned_empty(1 << 20, pin=False)
    buf.fill_(7)
    if staging._libc_madvise is None or staging._libc_madvise(buf.data_ptr(), buf.numel(),
                                                              staging._MADV_POPULATE_WRITE) != 0:
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here (Linux 5.14+)")
    staging.fault_in(buf, pinned=False)
    assert bool((buf == 7).all()), "MADV_POPULATE_WRITE changed the buffer"
    monkeypatch.setattr(staging, "_libc_madvise", None)
    staging.fault_in(buf, pinned=False)
    assert bool((buf == 0).all())  # the portable way writes every page
    buf.fill_(5)
    staging.fault_in(buf, pinned=True)  # pinned memory is resident already: untouched
    assert bool((buf == 5).all())
