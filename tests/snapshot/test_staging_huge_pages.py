"""Pageable staging buffers and the in-place restore's bounce buffers sit on transparent huge pages
(``huge_pages``, auto by default), so direct reads and writes of them move 2 MiB DMA segments.

Real memory: what the kernel actually mapped is read from ``/proc/self/smaps`` (``AnonHugePages`` of the mapping
that holds a buffer). Where the kernel offers no transparent huge pages the huge cases skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tensor_equal, direct_io_supported
from tierckpt import CheckpointManager
from tierckpt.host.memory import HUGE_PAGE, anonymous_buffer, buffer_address, huge_pages_available

pytestmark = pytest.mark.timeout(120)

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages for madvise here")


def _huge_kib(addr: int) -> int:
    """``AnonHugePages`` (KiB) of the mapping of this process that holds ``addr``."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping of this process holds address {addr:#x}")


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(mib)
    return {"w": torch.randn(mib << 18, generator=g), "b": torch.randn(1000, generator=g)}


def test_anonymous_buffer_small_pages() -> None:
    buf = anonymous_buffer(3 * 4096 + 5)
    assert buf.nbytes == 3 * 4096 + 5 and not buf.readonly
    assert buffer_address(buf) % 4096 == 0
    assert bytes(buf[:16]) == bytes(16) and bytes(buf[-16:]) == bytes(16)
    buf[-1] = 7
    assert buf[-1] == 7
    assert anonymous_buffer(0).nbytes == 0
    with pytest.raises(ValueError, match="size"):
        anonymous_buffer(-1)


@needs_thp
def test_anonymous_buffer_on_huge_pages() -> None:
    size = 3 * HUGE_PAGE + 4096  # a partial huge page at the end
    buf = anonymous_buffer(size, huge=True)
    addr = buffer_address(buf)
    assert buf.nbytes == size and addr is not None and addr % HUGE_PAGE == 0
    assert bytes(buf[:64]) == bytes(64)
    buf[:] = b"\x01" * size  # fault every page in
    assert _huge_kib(addr) >= 2048, "the kernel mapped no huge page"
    plain = anonymous_buffer(size)
    plain[:] = b"\x01" * size
    assert _huge_kib(buffer_address(plain)) == 0, "a buffer without huge=True got huge pages"
    # a view outlives the mapping's other references
    tail = buf[-4096:]
    del buf
    assert bytes(tail[:8]) == b"\x01" * 8


@needs_thp
@pytest.mark.parametrize("huge", [True, False])
def test_manager_staging_and_bounce_buffers_follow_huge_pages(tmp_path: Path, huge: bool) -> None:
    state = _state(16)
    with CheckpointManager(tmp_path / "c", huge_pages=huge, pin_memory=False) as mgr:
        mgr.save(1, state).persisted.result()
        buf = mgr.components.staging.slots[0].buffer
        assert buf is not None
        addr = buf.data_ptr()
        if huge:
            assert addr % HUGE_PAGE == 0
            assert _huge_kib(addr) >= 2048, "the staging buffer is not on huge pages"
        else:
            assert _huge_kib(addr) == 0, "huge_pages=False still got a staging buffer on huge pages"
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        assert mgr.restore(fresh, in_place=True) == 1
        for k in state:
            assert_tensor_equal(fresh[k], state[k], k)
        bounce = mgr.components.engine.bounce
        if direct_io_supported(tmp_path):  # the files were written around the page cache: read through bounce buffers
            assert bounce is not None and bounce._map is not None, "the in-place restore used no bounce buffers"
            baddr = buffer_address(bounce._map)
            assert baddr is not None and bounce.count * bounce.size >= HUGE_PAGE
            if huge:
                assert baddr % HUGE_PAGE == 0 and _huge_kib(baddr) >= 2048, "bounce buffers not on huge pages"
            else:
                assert _huge_kib(baddr) == 0
    with CheckpointManager(tmp_path / "c", huge_pages=huge) as mgr:  # a fresh restore buffer, default restore
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        assert mgr.restore(fresh) == 1
        for k in state:
            assert_tensor_equal(fresh[k], state[k], k)


def test_huge_pages_option_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="huge_pages"):
        CheckpointManager(tmp_path / "c", huge_pages="yes")  # type: ignore[arg-type]


def test_huge_pages_auto_follows_the_kernel(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.components.staging.huge is huge_pages_available()
    with CheckpointManager(tmp_path / "d", huge_pages=False) as mgr:
        assert mgr.components.staging.huge is False


@needs_thp
@pytest.mark.parametrize("huge", [True, False])
def test_uploader_read_buffer_follows_huge_pages(tmp_path: Path, huge: bool) -> None:
    """``iter_chunks(reuse=True)`` (the uploader's read of a committed file) reads into one buffer on huge pages
    when the store has ``huge_pages``; the bytes are the file's either way."""
    from tierckpt.storage.local import LocalStore

    data = torch.randint(0, 256, (3 * HUGE_PAGE + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    store = LocalStore(tmp_path / "s", huge_pages=huge)
    store.write_bytes("f.bin", bytes(data.numpy()))
    got, addrs = [], set()
    for chunk in store.iter_chunks("f.bin", 2 * HUGE_PAGE, reuse=True):
        assert isinstance(chunk, memoryview)
        addr = buffer_address(chunk)
        assert addr is not None
        addrs.add(addr)
        if huge:
            assert addr % HUGE_PAGE == 0 and _huge_kib(addr) >= 2048, "the read buffer is not on huge pages"
        else:
            assert _huge_kib(addr) == 0
        got.append(bytes(chunk))
    assert b"".join(got) == bytes(data.numpy()) and len(addrs) == 1


@pytest.mark.parametrize("huge", [True, False])
def test_manager_gives_its_stores_huge_pages(tmp_path: Path, huge: bool) -> None:
    with CheckpointManager(tmp_path / "c", remote=str(tmp_path / "r"), huge_pages=huge) as mgr:
        assert mgr.local.huge_pages is huge
        assert mgr.remote is not None and mgr.remote.huge_pages is huge  # type: ignore[attr-defined]


def _mapping(addr: int) -> tuple[int, int, int] | None:
    """``(start, end, Rss KiB)`` of the mapping of this process that holds ``addr``, or None when none does."""
    found: tuple[int, int] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= addr < hi else None
            elif found and head == "Rss:":
                return found[0], found[1], int(line.split()[1])
    return None


@needs_thp
def test_huge_staging_memory_is_given_back(tmp_path: Path) -> None:
    """The mapping goes when the pool drops its buffer: closing the manager gives the huge pages back, and a state
    that grows replaces the buffer rather than keeping both.

    Measured per mapping (``/proc/self/smaps``), not by the process's RSS, which the allocator and the garbage
    collector move by tens of MiB on their own."""
    small, large = _state(32), _state(96)
    with CheckpointManager(tmp_path / "c", huge_pages=True, pin_memory=False) as mgr:
        mgr.save(1, small).persisted.result()
        first = mgr.components.staging.slots[0].buffer
        assert first is not None
        old = _mapping(first.data_ptr())
        assert old is not None and old[2] >= 32 << 10, f"the 32 MiB staging buffer is not resident ({old})"
        del first
        mgr.save(2, large).persisted.result()  # grows the slot: the 32 MiB buffer goes first
        buf = mgr.components.staging.slots[0].buffer
        assert buf is not None and _huge_kib(buf.data_ptr()) >= 2048
        new = _mapping(buf.data_ptr())
        del buf
        assert new is not None and new[2] >= 96 << 10, f"the staging buffer is not resident ({new})"
        again = _mapping(old[0])
        kept = again is not None and again[:2] == old[:2] and again[:2] != new[:2]
        assert not kept, f"the grown pool kept the old buffer too ({again})"
    gone = _mapping(new[0])
    assert gone is None or gone[:2] != new[:2], f"closing the manager kept the staging buffer ({gone})"


def test_a_failed_huge_page_mapping_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmap failing (ENOMEM: no real way to exhaust memory here) surfaces as the pool's CheckpointError with the
    size, as torch's allocator failing does, and the slot goes back to the pool: the next save may try again
    instead of waiting forever for a slot nobody holds."""
    import errno

    from tierckpt import CheckpointError
    from tierckpt.snapshot import staging

    def fail(size: int, *, huge: bool = False) -> memoryview:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    pool = staging.StagingPool(slots=1, pin=False, huge=True)
    monkeypatch.setattr(staging, "anonymous_buffer", fail)
    with pytest.raises(CheckpointError, match=r"cannot allocate a \d+-byte staging buffer"):
        pool.acquire(3 << 20)
    monkeypatch.undo()
    slot = pool.acquire(3 << 20, timeout=5)  # the failed allocation gave its slot back (else: no free slot)
    assert slot.capacity == 3 << 20
    pool.release(slot)
    pool.close()


def _vm_flags(addr: int) -> list[str]:
    """``VmFlags`` of the mapping of this process that holds ``addr``."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping of this process holds address {addr:#x}")


@needs_thp
def test_a_buffer_without_huge_pages_is_advised_off_them() -> None:
    """``huge_pages=False`` is a promise: the buffer is advised off huge pages (``nh``), so neither THP's
    ``always`` mode nor a library's advice on a reused heap range (NumPy advises its large arrays onto them) puts
    a staging buffer there."""
    from tierckpt.snapshot.staging import aligned_empty

    small = aligned_empty(16 << 20, pin=False, huge=False)
    assert "nh" in _vm_flags(small.data_ptr())
    big = aligned_empty(16 << 20, pin=False, huge=True)
    assert "hg" in _vm_flags(big.data_ptr()) and "nh" not in _vm_flags(big.data_ptr())
