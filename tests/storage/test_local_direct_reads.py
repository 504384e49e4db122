"""A restore reads uncached files around the page cache and keeps every guarantee.

``LocalStore(direct_io=True)`` (the local tier's default) has ``direct_reads``: ``readinto_direct`` reads the aligned
bulk of a page-aligned buffer with ``O_DIRECT`` (an unaligned buffer and a file's unaligned tail buffered), and
``uncached`` says whether a range is mostly out of the page cache. A restore reads a file direct only then; either
way the bytes are the file's, a short file gives a short count, and every byte is still verified.
The page cache's state is read with ``cachestat`` or ``mincore`` (:func:`tierckpt.storage.local.cached_share`),
the real thing the store decides on; a file is evicted with ``fsync`` + ``posix_fadvise(DONTNEED)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tensor_equal, cached_fraction, data_files, direct_io_supported, step_path
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.host.memory import buffer_address
from tierckpt.snapshot.staging import aligned_empty
from tierckpt.storage import local as local_mod
from tierckpt.storage.local import DIRECT_ALIGN, LocalStore

pytestmark = pytest.mark.timeout(120)


def _evict(path: Path) -> None:
    """Drop the file's pages from the page cache (clean pages go at once); skip where the kernel keeps them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_fraction(path) > 0:
        pytest.skip("the page cache kept the file's pages")


def _file(tmp_path: Path, size: int, name: str = "f.bin") -> tuple[Path, bytes]:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).numpy()
    path = tmp_path / name
    path.write_bytes(data.tobytes())
    return path, data.tobytes()


def _aligned_view(size: int) -> memoryview:
    buf = aligned_empty(size, pin=False)
    buf.fill_(0xAB)
    return memoryview(buf.numpy())


def _opened_flags(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the flags of every ``os.open`` the store makes (a spy: the real call still runs)."""
    flags: list[int] = []
    real_open = os.open

    def spy(path: str, fl: int, *args: int) -> int:
        flags.append(fl)
        return real_open(path, fl, *args)

    monkeypatch.setattr(local_mod.os, "open", spy)
    return flags


def test_an_uncached_range_is_read_direct_and_stays_out_of_the_cache(tmp_path: Path) -> None:
    size = 3 * local_mod.DIRECT_MIN_BYTES + 777  # an unaligned tail after an aligned bulk
    path, data = _file(tmp_path, size)
    store = LocalStore(tmp_path, direct_io=True)
    _evict(path)
    assert store.uncached("f.bin", 0, size)
    view = _aligned_view(size)
    assert store.readinto_direct("f.bin", 0, view) == size
    assert bytes(view) == data
    head = size - size % DIRECT_ALIGN
    if direct_io_supported(tmp_path):
        assert store.direct_reads
        assert cached_fraction(path, head) == 0.0  # a buffered read would have left every page of it cached
        assert store.uncached("f.bin", 0, size)
    else:
        assert cached_fraction(path, head) == 1.0


@pytest.mark.parametrize("way", ["cachestat", "mincore"])
def test_uncached_tells_cached_from_uncached_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    size = 4 * local_mod.DIRECT_MIN_BYTES
    path, _ = _file(tmp_path, size)
    if way == "mincore":  # a kernel older than 6.5: the fallback
        monkeypatch.setattr(local_mod, "_cachestat_works", [False])
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            if local_mod._cachestat(fd, 0, size) is None:
                pytest.skip("this kernel has no cachestat(2)")
        finally:
            os.close(fd)

        def no_mincore(*args: object) -> int:
            raise AssertionError("mincore was asked where cachestat answers")

        monkeypatch.setattr(local_mod, "_mincore", no_mincore)
    store = LocalStore(tmp_path, direct_io=True)
    _evict(path)
    with open(path, "rb", buffering=0) as f:  # the first half into the cache, buffered, and nothing beyond it:
        # readahead would still be reading the second half in (cachestat counts such pages, mincore not yet)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read(size // 2)
    assert not store.uncached("f.bin", 0, size // 2)
    assert store.uncached("f.bin", size // 2, size // 2)
    assert not store.uncached("missing.bin", 0, size)  # unknown: the read that follows reports it
    # reads_direct asks the same of the whole pages around any range, and only on a store that reads direct
    assert store.reads_direct("f.bin", size // 2 + 5, 100_000) and not store.reads_direct("f.bin", 5, 100_000)
    assert not LocalStore(tmp_path, direct_io=False).reads_direct("f.bin", size // 2, size // 2)
    path.read_bytes()
    assert not store.uncached("f.bin", 0, size)


def test_reads_at_an_offset_short_files_and_unaligned_buffers(tmp_path: Path) -> None:
    size = 2 * local_mod.DIRECT_MIN_BYTES + 4096 + 5
    path, data = _file(tmp_path, size)
    store = LocalStore(tmp_path, direct_io=True)
    # a buffer larger than what is left of the file: the count says where it ended (the reader's "ends early")
    _evict(path)
    off = DIRECT_ALIGN
    whole = _aligned_view(size + DIRECT_ALIGN)
    view = whole[:size]
    assert store.readinto_direct("f.bin", off, view) == size - off
    assert bytes(view[: size - off]) == data[off:]
    assert bytes(whole[size:]) == b"\xab" * DIRECT_ALIGN  # nothing written past the caller's buffer
    # the file ends inside the aligned part of the buffer, at an unaligned point
    _evict(path)
    view = _aligned_view(size + 3 * DIRECT_ALIGN)
    assert store.readinto_direct("f.bin", 0, view) == size
    assert bytes(view[:size]) == data
    # an unaligned buffer and an unaligned offset are read buffered, and right
    _evict(path)
    raw = _aligned_view(local_mod.DIRECT_MIN_BYTES + 1)[1:]
    assert store.readinto_direct("f.bin", 3, raw) == raw.nbytes
    assert bytes(raw) == data[3 : 3 + raw.nbytes]
    _evict(path)
    view = _aligned_view(local_mod.DIRECT_MIN_BYTES)
    assert store.readinto_direct("f.bin", 5, view) == view.nbytes
    assert bytes(view) == data[5 : 5 + view.nbytes]


def test_direct_io_off_never_reads_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 2 * local_mod.DIRECT_MIN_BYTES
    path, data = _file(tmp_path, size)
    _evict(path)
    store = LocalStore(tmp_path, direct_io=False)
    assert not store.direct_reads
    flags = _opened_flags(monkeypatch)
    view = _aligned_view(size)
    assert store.readinto_direct("f.bin", 0, view) == size
    assert bytes(view) == data
    assert flags and not any(f & local_mod._O_DIRECT for f in flags)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(1_500_000, generator=g), "b": torch.randn(1001, generator=g)}


def _restore_evicted(root: Path, state: dict[str, torch.Tensor], files: list[Path]) -> dict[str, torch.Tensor]:
    """Evict the step's data files, restore them by default in a fresh manager and check every tensor."""
    for f in files:
        _evict(f)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(out) == 1
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    return out


def test_a_restore_from_an_uncached_step_reads_direct_and_is_exact(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        mgr.save(1, state)
        mgr.wait()
    files = data_files(step_path(tmp_path, 1))
    _restore_evicted(tmp_path, state, files)
    if direct_io_supported(tmp_path):
        big = max(files, key=lambda f: f.stat().st_size)
        size = big.stat().st_size
        assert cached_fraction(big, size - size % DIRECT_ALIGN) < 0.5  # read around the cache, not through it


def test_uncached_files_are_read_in_the_larger_direct_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file read whole around the cache goes in ``DIRECT_READ_CHUNK`` reads (a fresh buffer faults in inside each
    read, so fewer, larger reads keep the disk busier); a cached one in ``READ_CHUNK`` reads. (A staged restore:
    a guarded one reads these large tensors in place, through bounce buffers; see
    tests/engine/test_restore_guarded.py.)"""
    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    from tierckpt.engine import restore as _restore
    from tierckpt.tiers import reader

    monkeypatch.setattr(_restore, "GUARD_MIN_SHARE", 2.0)  # never guarded: every byte staged

    monkeypatch.setattr(reader, "READ_CHUNK", 256 << 10)
    monkeypatch.setattr(reader, "DIRECT_READ_CHUNK", 1 << 20)
    state = _state()  # about 6 MB of data files
    with CheckpointManager(tmp_path, file_size_mb=4) as mgr:
        mgr.save(1, state)
        mgr.wait()
    files = data_files(step_path(tmp_path, 1))
    sizes: dict[str, list[int]] = {"direct": [], "cached": []}
    real_direct, real_read = LocalStore.readinto_direct, LocalStore.readinto

    def direct(self: LocalStore, rel: str, offset: int, buf: memoryview) -> int:
        sizes["direct"].append(buf.nbytes)
        return real_direct(self, rel, offset, buf)

    def cached(self: LocalStore, rel: str, offset: int, buf: memoryview) -> int:
        sizes["cached"].append(buf.nbytes)
        return real_read(self, rel, offset, buf)

    monkeypatch.setattr(LocalStore, "readinto_direct", direct)
    monkeypatch.setattr(LocalStore, "readinto", cached)
    out = _restore_evicted(tmp_path, state, files)
    total = sum(f.stat().st_size for f in files)
    assert sum(sizes["direct"]) >= total - len(files) * DIRECT_ALIGN  # every file's bulk read around the cache
    assert max(sizes["direct"]) == 1 << 20 and sizes["direct"].count(1 << 20) >= total // (1 << 20) - len(files)

    for f in files:
        f.read_bytes()  # now cached: read through the cache in the smaller chunks
    sizes["direct"].clear()
    sizes["cached"].clear()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(out) == 1
    assert not sizes["direct"] and max(sizes["cached"]) == 256 << 10


def test_a_restore_from_a_cached_step_reads_through_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        mgr.save(1, state)
        mgr.wait()
    for f in data_files(step_path(tmp_path, 1)):
        f.read_bytes()  # as after the uploader or a buffered reader read it
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        flags = _opened_flags(monkeypatch)
        assert mgr.restore(out) == 1
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    assert flags and not any(f & local_mod._O_DIRECT for f in flags)


def test_corruption_in_an_uncached_step_is_still_found(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, file_size_mb=2) as mgr:
        mgr.save(1, state)
        mgr.wait()
    big = max(data_files(step_path(tmp_path, 1)), key=lambda f: f.stat().st_size)
    fd = os.open(big, os.O_RDWR)
    try:
        mid = big.stat().st_size // 2  # in the aligned bulk that a direct read covers
        byte = os.pread(fd, 1, mid)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), mid)
    finally:
        os.close(fd)
    for f in data_files(step_path(tmp_path, 1)):
        _evict(f)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError) as ei:
        mgr.restore(out, step=1)
    assert big.name in str(ei.value)
    assert all(torch.count_nonzero(v) == 0 for v in out.values())  # the default restore changed nothing


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize(("size", "chunk", "start", "length"), [
    (0, 1 << 20, 0, None),
    (1, 1 << 20, 0, None),
    (DIRECT_ALIGN, 1 << 20, 0, None),
    (3 * (1 << 20) + 123, 1 << 20, 0, None),  # three whole chunks and an unaligned tail
    (3 * (1 << 20) + 123, 1000, 0, None),  # chunks that are no multiple of a page: read buffered
    (3 * (1 << 20) + 123, 1 << 20, 1 << 20, 1 << 20),  # a range
    (3 * (1 << 20) + 123, 1 << 20, 5, 100_000),  # an unaligned range
])
def test_reused_chunks_are_the_files_bytes(tmp_path: Path, direct_io: bool, size: int, chunk: int, start: int,
                                           length: int | None) -> None:
    """``iter_chunks(reuse=True)`` (the uploader's read of a committed file) yields the same bytes as new ``bytes``
    chunks, each at most ``chunk`` long, every one a view of the same buffer; direct or not, cached or not."""
    path, data = _file(tmp_path, size)
    store = LocalStore(tmp_path, direct_io=direct_io)
    want = data[start:] if length is None else data[start : start + length]
    plain = list(store.iter_chunks("f.bin", chunk, start=start, length=length))
    assert b"".join(plain) == want
    for evict in (True, False):
        if evict and size:
            _evict(path)
        got = []
        addresses = set()
        for view in store.iter_chunks("f.bin", chunk, start=start, length=length, reuse=True):
            assert isinstance(view, memoryview) and 0 < view.nbytes <= chunk
            addresses.add(buffer_address(view))
            got.append(bytes(view))  # the next chunk overwrites this one
        assert b"".join(got) == want and [len(g) for g in got] == [len(p) for p in plain]
        assert len(addresses) <= 1, "every chunk should be read into the one reused buffer"


def test_remote_direct_io_is_validated() -> None:
    with pytest.raises(ValueError, match="remote_direct_io must be None"):
        CheckpointManager(os.devnull + "-never", remote_direct_io="yes")  # type: ignore[arg-type]


def test_reused_chunks_of_an_uncached_file_are_read_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    path, data = _file(tmp_path, 4 * (1 << 20))
    store = LocalStore(tmp_path, direct_io=True)
    _evict(path)
    flags = _opened_flags(monkeypatch)
    assert b"".join(bytes(v) for v in store.iter_chunks("f.bin", 1 << 20, reuse=True)) == data
    assert any(f & local_mod._O_DIRECT for f in flags)
    assert cached_fraction(path) < 0.5  # read around the cache
    path.read_bytes()  # cached now: read through the cache
    flags.clear()
    assert b"".join(bytes(v) for v in store.iter_chunks("f.bin", 1 << 20, reuse=True)) == data
    assert flags and not any(f & local_mod._O_DIRECT for f in flags)


@pytest.mark.parametrize(("options", "direct_io"), [
    ({}, True),
    ({"direct_io": False}, False),
    ({"remote_direct_io": False}, False),  # an NFS mount kept buffered while the local tier stays direct
    ({"direct_io": False, "remote_direct_io": True}, True),
], ids=["default", "off", "remote-off", "remote-only"])
def test_a_posix_remote_is_written_direct_when_the_manager_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    options: dict, direct_io: bool) -> None:
    """A remote given as a path (a Lustre/Weka mount) follows ``remote_direct_io``, by default ``direct_io``: the
    uploader writes its data files ``O_DIRECT`` from its reused buffer, and a restore from that remote alone is
    exact."""
    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    state = {"w": torch.randn(3_000_000, generator=torch.Generator().manual_seed(5)), "b": torch.arange(7.0)}
    remote_opens: list[int] = []  # flags of every open of a file under the remote
    real_open = os.open

    def spy(path: str, fl: int, *args: int) -> int:
        if str(path).startswith(str(tmp_path / "remote")):
            remote_opens.append(fl)
        return real_open(path, fl, *args)

    monkeypatch.setattr(local_mod.os, "open", spy)
    with CheckpointManager(tmp_path / "local", remote=tmp_path / "remote", file_size_mb=4, **options) as mgr:
        assert isinstance(mgr.remote, LocalStore) and mgr.remote.direct_io is direct_io
        assert mgr.local.direct_io is options.get("direct_io", True)
        mgr.save(1, state).uploaded.result(timeout=60)
    monkeypatch.undo()
    remote_files = data_files(step_path(tmp_path / "remote", 1))
    assert remote_files
    direct_writes = [f for f in remote_opens if f & local_mod._O_DIRECT and f & os.O_WRONLY]
    assert remote_opens and bool(direct_writes) is direct_io
    big = max(remote_files, key=lambda f: f.stat().st_size)
    size = big.stat().st_size
    cached = cached_fraction(big, size - size % DIRECT_ALIGN)
    # written from the page-aligned reused buffer, the bulk went around the page cache (not only opened that way)
    assert cached < 0.5 if direct_io else cached > 0.5, cached
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path / "fresh", remote=tmp_path / "remote") as mgr:
        assert mgr.restore(out, source="remote") == 1
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
