"""An in-place restore reads files that are not in the page cache with ``O_DIRECT`` through a few bounce
buffers, copies each out into the tensors and hashes the bytes where they landed; every guarantee stays.

Real files on the real disk; the page cache is emptied per file (``fsync`` + ``posix_fadvise(DONTNEED)``) and read
with ``cachestat`` or ``mincore``. Small bounce buffers make every tensor cross several of them.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests._support.helpers import assert_tensor_equal, data_files, direct_io_supported, evict_data_files, step_path
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.engine import restore as _restore
from tierckpt.format import hashing
from tierckpt.host.memory import buffer_address
from tierckpt.storage import local as local_mod
from tierckpt.storage.local import cached_share
from tierckpt.tiers import reader
from tierckpt.tiers.bounce import BounceBuffers

pytestmark = pytest.mark.timeout(120)

SMALL = 64 << 10  # bounce buffers of 64 KiB: every large tensor below crosses several


@pytest.fixture(autouse=True)
def _small_bounce_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_restore, "BOUNCE_SIZE", SMALL)
    monkeypatch.setattr(reader, "FUSED_BLOCK", 12 << 10)  # and each copy-out runs in several blocks (not aligned)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {  # sizes that are no multiple of the bounce buffers, and one below the direct-read threshold
        "a": torch.randn(400_003, generator=g),
        "b": torch.randn(123_457, generator=g).to(torch.bfloat16),
        "c": torch.randn(300_001, generator=g).double(),
        "tiny": torch.randn(17, generator=g),
    }


def _saved(tmp_path: Path) -> dict[str, torch.Tensor]:
    state = _state()
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        mgr.save(1, state)
        mgr.wait()
    return state


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the buffers every ``LocalStore.readinto_direct`` call reads into (the real call still runs)."""
    sizes: list[int] = []
    real = local_mod.LocalStore.readinto_direct

    def spy(self: local_mod.LocalStore, rel: str, offset: int, buf: memoryview) -> int:
        sizes.append(buf.nbytes)
        return real(self, rel, offset, buf)

    monkeypatch.setattr(local_mod.LocalStore, "readinto_direct", spy)
    return sizes


def test_an_in_place_restore_of_an_uncached_step_reads_through_the_bounce_buffers(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    files = evict_data_files(step_path(tmp_path, 1))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    live = {k: v.data_ptr() for k, v in out.items()}
    sizes = _spy_direct(monkeypatch)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(out, in_place=True) == 1
        assert mgr.components.engine.bounce.free() == mgr.components.engine.bounce.count  # every buffer came back
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
        assert out[k].data_ptr() == live[k], f"{k} was replaced instead of filled in place"
    # the files holding the large tensors, a bounce buffer at a time (a file of small tensors goes to the slot)
    assert sizes.count(SMALL) >= (400_003 * 4 + 300_001 * 8) // SMALL - 2
    assert sum(sizes) >= sum(f.stat().st_size for f in files) - 4096 * len(files)  # every file, through them
    if direct_io_supported(tmp_path):
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                assert cached_share(fd, 0, size - size % local_mod.DIRECT_ALIGN) < 0.5, (
                    f"{f.name} went through the cache")
            finally:
                os.close(fd)


def test_a_cached_step_restores_in_place_without_them(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    for f in data_files(step_path(tmp_path, 1)):
        f.read_bytes()  # as after the uploader read it
    sizes = _spy_direct(monkeypatch)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(out, in_place=True) == 1
        bounce = mgr.components.engine.bounce
        assert bounce is not None and not bounce.allocated  # never used, so never allocated
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    assert sizes == []


def test_direct_io_off_restores_in_place_buffered(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    evict_data_files(step_path(tmp_path, 1))
    sizes = _spy_direct(monkeypatch)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, direct_io=False) as mgr:
        assert mgr.restore(out, in_place=True) == 1
        assert mgr.components.engine.bounce is None
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    assert sizes == []


def test_a_flipped_byte_read_through_the_bounce_buffers_is_found_and_named(tmp_path):
    state = _saved(tmp_path)
    folder = step_path(tmp_path, 1)
    big = max(data_files(folder), key=lambda f: f.stat().st_size)
    fd = os.open(big, os.O_RDWR)
    try:
        mid = big.stat().st_size // 2  # inside a large tensor, in the aligned bulk a direct read covers
        os.pwrite(fd, bytes([os.pread(fd, 1, mid)[0] ^ 0x5A]), mid)
    finally:
        os.close(fd)
    evict_data_files(folder)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.restore(out, step=1, in_place=True)
        assert mgr.components.engine.bounce.free() == mgr.components.engine.bounce.count
    assert big.name in str(ei.value) and "tensor" in str(ei.value)
    assert "in_place=True" in str(ei.value)  # says the state was partly overwritten


def test_a_failing_direct_read_ends_the_restore_and_gives_every_buffer_back(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    evict_data_files(step_path(tmp_path, 1))
    calls = {"n": 0}
    real = local_mod.LocalStore.readinto_direct

    def failing(self: local_mod.LocalStore, rel: str, offset: int, buf: memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(5, "Input/output error (injected)", rel)
        return real(self, rel, offset, buf)

    monkeypatch.setattr(local_mod.LocalStore, "readinto_direct", failing)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(Exception, match="injected"):
            mgr.restore(out, step=1, in_place=True)
        assert mgr.components.engine.bounce.free() == mgr.components.engine.bounce.count
        monkeypatch.setattr(local_mod.LocalStore, "readinto_direct", real)
        assert mgr.restore(out, step=1, in_place=True) == 1  # the same manager, the same buffers: now it works
    for k in state:
        assert_tensor_equal(out[k], state[k], k)


@pytest.mark.parametrize("threaded", [False, True])
def test_after_a_failed_copy_nothing_more_is_copied_but_every_buffer_is_released(threaded, monkeypatch):
    seg = hashing.SegmentHasher([0, 30])
    released: list[int] = []
    source = bytearray(range(100, 130))
    src = ctypes.addressof(ctypes.c_char.from_buffer(source))
    dst = bytearray(30)
    real_memmove = ctypes.memmove
    calls: list[int] = []

    def memmove(to: int, from_: int, n: int) -> int:
        calls.append(from_ - src)
        if from_ - src == 10:  # the second piece's copy fails
            raise RuntimeError("copy failed")
        return real_memmove(to, from_, n)

    monkeypatch.setattr(reader, "ctypes", SimpleNamespace(memmove=memmove))
    executor = ThreadPoolExecutor(1) if threaded else None
    hasher = reader._Hashing(seg, executor)
    out = memoryview(dst)
    try:
        for i in range(3):
            try:
                hasher.feed([out[i * 10 : (i + 1) * 10]], sources=[src + i * 10],
                            release=lambda i=i: released.append(i))
            except RuntimeError:
                assert not threaded and i >= 1  # inline, the error surfaces at once (and again after)
        with pytest.raises(RuntimeError, match="copy failed"):
            hasher.finish()
    finally:
        if executor is not None:
            executor.shutdown()
    assert calls == [0, 10] and released == [0, 1, 2]
    assert dst == bytes(range(100, 110)) + bytes(20), "only the first piece was copied"


def test_copy_and_hash_copies_in_blocks_and_hashes_what_landed(monkeypatch):
    """The fused copy-out hashes every block right after copying it: the digests are those of the source bytes,
    and a destination that is changed between the copy and the hash would show (it is hashed, not the source)."""
    monkeypatch.setattr(reader, "FUSED_BLOCK", 4096)
    data = bytes(random.Random(3).randbytes(3 * 4096 + 100))
    source = bytearray(data)
    src = ctypes.addressof(ctypes.c_char.from_buffer(source))
    ends = [1000, 9000, len(data)]
    seg = hashing.SegmentHasher(ends)
    dst = bytearray(len(data))
    view = memoryview(dst)
    reader._copy_and_hash(seg, [view[:5000], view[5000:5000], view[5000:]], [src, src + 5000, src + 5000])
    assert dst == data
    want = [hashing.digest(data[a:b]) for a, b in zip([0, *ends[:-1]], ends)]
    assert seg.digests == want
    with pytest.raises(ValueError, match="read-only"):  # never a copy to an unknown address
        reader._copy_and_hash(hashing.SegmentHasher([10]), [memoryview(bytes(10))], [src])

    # the destination is what is hashed: a copy that lands wrong is caught
    real_memmove = ctypes.memmove

    def bad_memmove(to: int, from_: int, n: int) -> int:
        real_memmove(to, from_, n)
        ctypes.c_char.from_address(to).value = b"\xff" if data[from_ - src] != 0xFF else b"\x00"
        return to

    monkeypatch.setattr(reader, "ctypes", SimpleNamespace(memmove=bad_memmove))
    seg = hashing.SegmentHasher(ends)
    reader._copy_and_hash(seg, [memoryview(bytearray(len(data)))], [src])
    assert seg.digests[0] != want[0] and seg.digests[2] != want[2]

def test_bounce_buffers_are_bounded_and_hand_each_buffer_to_one_reader_at_a_time():
    with pytest.raises(ValueError, match="multiple"):
        BounceBuffers(2, 1000)
    pool = BounceBuffers(2, 4096)
    a, b = pool.acquire(), pool.acquire()
    assert {a.nbytes, b.nbytes} == {4096} and pool.free() == 0
    got: list[memoryview] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    time.sleep(0.1)
    assert not got, "a third buffer was handed out while both were in use"
    pool.release(a)
    t.join(10)
    assert got and got[0] is a
    assert buffer_address(a) % 4096 == 0 and buffer_address(b) % 4096 == 0


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failing_copy_out_gives_each_buffer_back_exactly_once(tmp_path, monkeypatch, threaded):
    """Whoever fails, the reader or the copy, a bounce buffer goes back once: twice would let two reads share it."""
    _saved(tmp_path)
    evict_data_files(step_path(tmp_path, 1))
    store = local_mod.LocalStore(tmp_path, create=False, direct_io=True)
    _, (rm,) = reader.read_manifests(store, 1, ranks=[0])
    targets = {t.index: torch.zeros(t.nbytes, dtype=torch.uint8) for t in rm.tensors if t.nbytes >= 1 << 20}
    direct = {i: memoryview(t.numpy()) for i, t in targets.items()}
    calls = {"n": 0}
    real = reader.ctypes.memmove

    def failing(dst: int, src: int, n: int) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy-out failed (injected)")
        return real(dst, src, n)

    monkeypatch.setattr(reader.ctypes, "memmove", failing)
    bounce = BounceBuffers(2, SMALL)
    buf = memoryview(bytearray(sum(f.size for f in rm.files) + 4096 * len(rm.files)))
    with ThreadPoolExecutor(1) as io, ThreadPoolExecutor(1) as hx, pytest.raises(RuntimeError, match="injected"):
        reader.load_files(store, rm, lambda n: buf[:n], executor=io, direct=direct,
                          hash_executor=hx if threaded else None, bounce=bounce)
    assert bounce.free() == bounce.count
    assert len({id(b) for b in bounce._free}) == bounce.count  # no buffer listed twice
    assert len({buffer_address(b) for b in bounce._free}) == bounce.count


def _save_in(mgr: CheckpointManager, state: dict[str, torch.Tensor], step: int) -> None:
    mgr.save(step, state).persisted.result()
    mgr.wait()


def test_a_manager_that_has_saved_cuts_the_bounce_buffers_from_its_ready_staging_slot(tmp_path, monkeypatch):
    """After a save the pool holds a slot that is faulted in: the bounce buffers are cut from it for the reads (no
    memory of their own, no fresh pages), the restore's other bytes go to a private buffer, and the slot goes
    back once the reads end."""
    state = _state()
    private: list[int] = []
    real_empty = _restore.aligned_empty
    monkeypatch.setattr(_restore, "aligned_empty", lambda n, **kw: private.append(n) or real_empty(n, **kw))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        _save_in(mgr, state, 1)
        slot = mgr.components.staging.slots[0]
        lo, hi = slot.buffer.data_ptr(), slot.buffer.data_ptr() + slot.capacity
        allocations = mgr.components.staging.allocations
        files = evict_data_files(step_path(tmp_path, 1))
        seen: list[int] = []  # where each read through a bounce buffer went (a read of SMALL bytes)
        real_read = local_mod.LocalStore.readinto_direct

        def spy(self: local_mod.LocalStore, rel: str, offset: int, buf: memoryview) -> int:
            if buf.nbytes == SMALL:
                seen.append(buffer_address(buf) or 0)
            return real_read(self, rel, offset, buf)

        monkeypatch.setattr(local_mod.LocalStore, "readinto_direct", spy)
        assert mgr.restore(out, in_place=True) == 1
        assert mgr.components.engine.bounce is None, "the restore made bounce buffers of its own"
        assert len(seen) > 10 and all(lo <= a < hi for a in seen), "a bounce buffer lay outside the staging slot"
        pool = mgr.components.staging
        assert pool.allocations == allocations and pool.ready(slot.capacity), "the slot did not come back"
        assert len(private) == 1  # the headers and the small tensor
        _save_in(mgr, state, 2)  # the slot still serves saves
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    assert files


def test_borrowed_bounce_buffers_give_the_slot_back_when_the_restore_fails(tmp_path):
    state = _state()
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        _save_in(mgr, state, 1)
        folder = step_path(tmp_path, 1)
        big = max(data_files(folder), key=lambda f: f.stat().st_size)
        fd = os.open(big, os.O_RDWR)
        try:
            mid = big.stat().st_size // 2
            os.pwrite(fd, bytes([os.pread(fd, 1, mid)[0] ^ 0x5A]), mid)
        finally:
            os.close(fd)
        evict_data_files(folder)
        with pytest.raises(CorruptCheckpointError, match=big.name):
            mgr.restore({k: torch.zeros_like(v) for k, v in state.items()}, step=1, in_place=True)
        assert mgr.components.engine.bounce is None and mgr.components.staging.ready(1), \
            "the slot the bounce buffers were cut from was kept"
        _save_in(mgr, state, 2)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert mgr.restore(out, in_place=True) == 2
    for k in state:
        assert_tensor_equal(out[k], state[k], k)


def test_borrowed_bounce_memory_is_checked() -> None:
    mem = memoryview(bytearray(3 * 4096))
    with pytest.raises(ValueError, match="borrowed"):
        BounceBuffers(2, 4096, memory=mem[1:])  # too small, and off a page boundary
    buf = torch.empty(4 * 4096 + 4096, dtype=torch.uint8)
    skip = -buf.data_ptr() % 4096
    pool = BounceBuffers(2, 4096, memory=memoryview(buf[skip : skip + 2 * 4096].numpy()))
    a = pool.acquire()
    assert buffer_address(a) == buf.data_ptr() + skip or buffer_address(a) == buf.data_ptr() + skip + 4096
