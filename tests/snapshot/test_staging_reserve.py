"""``reserve_staging(state)`` allocates the staging buffer and faults its pages in on a background thread, so the
first save does not pay for them; a save that comes first waits for that slot; a grown state still gets room."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import tierckpt
from tests._support.helpers import assert_tree_equal, zeros_like_tree
from tierckpt.errors import CheckpointError
from tierckpt.snapshot import staging


def _state(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": {f"t{i}": torch.randn(100_000, generator=g) for i in range(n)}, "step": 1}


def _assert_the_save_reuses_the_buffer(mgr, step: int, state: dict) -> None:
    """With one staging buffer already in the pool, saving ``state`` as ``step`` allocates none; the step restores."""
    assert mgr.components.staging.allocations == 1
    mgr.save(step, state)
    mgr.wait()
    assert mgr.components.staging.allocations == 1, "the save allocated a buffer of its own"
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
        assert mgr.components.staging.allocations == 1 and len(calls) == 1
        target = zeros_like_tree(state)
        assert mgr.restore(target) == 1
    assert_tree_equal(target, state)


def test_a_state_that_grew_after_the_reservation_gets_a_bigger_buffer(tmp_path):
    small, big = _state(2), _state(40)  # 16 MB against 0.8 MB: more than the reserved buffer holds
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.reserve_staging(small).result(10)
        reserved = mgr.components.staging.slots[0].capacity
        mgr.save(1, big)
        mgr.wait()
        assert mgr.components.staging.slots[0].capacity > reserved
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
    if not staging._populate_write(buf.data_ptr(), buf.numel()):
        pytest.skip("no madvise(MADV_POPULATE_WRITE) here (Linux 5.14+)")
    staging.fault_in(buf, pinned=False)
    assert bool((buf == 7).all()), "MADV_POPULATE_WRITE changed the buffer"
    monkeypatch.setattr(staging, "_libc_madvise", None)
    staging.fault_in(buf, pinned=False)
    assert bool((buf == 0).all())  # the portable way writes every page
    buf.fill_(5)
    staging.fault_in(buf, pinned=True)  # pinned memory is resident already: untouched
    assert bool((buf == 5).all())


def _populate_write_works() -> bool:
    probe = staging.aligned_empty(1 << 16, pin=False)
    return staging._populate_write(probe.data_ptr(), probe.numel())


def _fresh(size: int) -> torch.Tensor:
    """Memory no one has touched: its own anonymous mapping (an allocator may hand back pages it used before)."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)


def _resident_fraction(buf: torch.Tensor) -> float:
    """The share of the (page-aligned) buffer's pages that are in memory, from ``mincore``."""
    import ctypes

    from tierckpt.host.libc import libc_function

    mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p], ctypes.c_int)
    if mincore is None:
        pytest.skip("no mincore here")
    pages = -(-buf.numel() // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert mincore(buf.data_ptr(), buf.numel(), vec) == 0
    return sum(b & 1 for b in vec.raw) / pages


@pytest.mark.skipif(not _populate_write_works(), reason="no madvise(MADV_POPULATE_WRITE) here (Linux 5.14+)")
def test_populator_faults_a_fresh_buffer_in_and_never_changes_a_byte_written_beside_it():
    """What a default restore relies on: the pages of its fresh buffer are faulted in on another thread while the
    reads fill it, and the bytes the reads wrote, before or during that, are what stays."""
    size, part = 64 << 20, 1 << 20
    buf = _fresh(size)
    assert _resident_fraction(buf) == 0.0
    pattern = [(i * 37) % 251 + 1 for i in range(size // part)]
    half = len(pattern) // 2
    for i in range(half):  # what the reads wrote before the populator started
        buf[i * part : (i + 1) * part].fill_(pattern[i])
    go = threading.Event()

    def writer() -> None:  # the rest, written while the populator runs
        go.wait()
        for i in range(half, len(pattern)):
            buf[i * part : (i + 1) * part].fill_(pattern[i])

    t = threading.Thread(target=writer)
    t.start()
    populator = staging.Populator(buf)
    go.set()
    assert populator.wait(30)
    t.join(30)
    for i, v in enumerate(pattern):
        assert bool((buf[i * part : (i + 1) * part] == v).all()), f"part {i} changed"
    # alone on an untouched buffer: every page resident, every byte still the kernel's zero
    other = _fresh(size)
    assert _resident_fraction(other) == 0.0
    staging.Populator(other).wait(30)
    assert _resident_fraction(other) == 1.0
    assert int(other.count_nonzero()) == 0


def test_the_pool_populates_only_a_buffer_it_allocates_and_stops_before_the_slot_goes_back():
    pool = staging.StagingPool(slots=1, pin=False)
    slot = pool.acquire(256 << 20, populate=True)
    populator = slot._populator
    assert populator is not None
    pool.release(slot)  # right away: 256 MiB take tens of ms to fault in, so the thread is stopped mid-way
    assert slot._populator is None
    assert populator.wait(0), "release returned while the populator still ran"
    again = pool.acquire(256 << 20, populate=True)  # the same buffer: nothing to populate
    assert again is slot and again._populator is None
    pool.release(again)
    plain = staging.StagingPool(slots=1, pin=False).acquire(1 << 20)  # saves take no populator
    assert plain._populator is None
    grown = pool.acquire(512 << 20, populate=True)
    running = grown._populator
    assert running is not None
    pool.close()  # while the new buffer may still be faulted in: stops that first
    assert grown._populator is None and grown.buffer is None
    assert running.wait(0)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_restore_populates_its_fresh_buffer_only_when_every_byte_is_read_into_it(tmp_path, monkeypatch, in_place):
    """A default restore fills the whole slot, so its pages are faulted in beside the reads; an in-place one reads
    the large tensors straight into the state and leaves most of the slot untouched, so it populates nothing."""
    state = {"big": torch.randn(1 << 18), "small": torch.randn(10)}  # 1 MiB: read in place; 40 B: via the slot
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, state)
        mgr.wait()
    made: list[int] = []
    real = staging.Populator

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, buffer: torch.Tensor) -> None:
            made.append(buffer.numel())
            super().__init__(buffer)

    monkeypatch.setattr(staging, "Populator", Recording)
    # pageable buffers, also where CUDA exists: a pinned buffer's pages are locked in as it is allocated
    with tierckpt.CheckpointManager(tmp_path / "ck", pin_memory=False) as mgr:
        target = zeros_like_tree(state)
        assert mgr.restore(target, in_place=in_place) == 1
        assert_tree_equal(target, state)
        assert not mgr.components.staging.slots[0].populating  # stopped once the restore gave the slot back
    assert len(made) == (0 if in_place else 1)
