"""POSIX folders through the OS: the local (NVMe) tier, and remotes given as a path or ``file://`` URL.

Durability: every file is ``fsync``-ed before its ``close()`` returns, and folders are ``fsync``-ed after entries
are added or renamed (:meth:`LocalStore.sync_dir`). Space is reserved with ``posix_fallocate`` when the size is
known, so a full disk fails at the start of a file rather than in the middle. A file is never written through a
symbolic link at its name (``O_NOFOLLOW``: a :class:`~tierckpt.errors.StorageAccessError` naming the path instead).

Direct I/O (``direct_io=True``, the local tier's default): large files are written with ``O_DIRECT`` where the file
system accepts it, so checkpoint bytes go from the staging buffer to the disk without a copy through the page cache
(that copy costs a CPU core per GB/s and pushes the training job's own pages out). Only aligned pieces go direct: a
write whose buffer address, length or file offset is not a multiple of :data:`DIRECT_ALIGN` (the tail of a file, a
``bytes`` object) switches that file descriptor back to buffered I/O, which the kernel keeps coherent with the
direct part. The ``fsync`` before ``close()`` returns is the same either way.

Reads: :meth:`LocalStore.readinto_direct` reads the aligned bulk of a page-aligned buffer with ``O_DIRECT`` (a
restore after a restart: 10-20% faster on the benchmark host's disk, and no second copy through the cache), the
rest buffered; :meth:`LocalStore.uncached` tells whether a range is mostly out of the page cache (``cachestat``, else
``mincore`` on a mapping of the range: no I/O either way), and the reader (:mod:`tierckpt.tiers.reader`) reads direct
only then, so a warm restore still reads from memory. The kernel writes back dirty cached pages of a range before a
direct read of it, so either way the bytes are the file's.

Atomic replacement of a step folder uses ``renameat2(RENAME_EXCHANGE)`` where the kernel and libc have it
(Linux >= 3.15, glibc >= 2.28): the new folder and the old one swap names in one step, so the step name always points at
a complete checkpoint. Elsewhere the old folder is first renamed to a ``.trash-`` name and the new one renamed into
place; a crash between the two leaves the complete new folder under its ``.tmp-`` name, which start-up recovery renames
into place.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import logging
import mmap
import os
import shutil
import sys
from collections.abc import Iterator
from typing import BinaryIO

from .. import faults
from ..errors import CheckpointError, StorageError
from ..format import layout
from ..host.libc import libc_function
from ..host.memory import anonymous_buffer, buffer_address
from .base import Store, WriteStream, join
from .files import refused

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
#: Buffer address, length and file offset alignment for ``O_DIRECT`` (covers 512-byte and 4 KiB sector devices).
DIRECT_ALIGN = 4096
#: Files smaller than this are written through the page cache (manifests, small states).
DIRECT_MIN_BYTES = 1 << 20
#: A read range goes direct when fewer than this share of its pages are in the page cache.
DIRECT_READ_MAX_CACHED = 0.5
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_AT_FDCWD = -100
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


_renameat2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
                           ctypes.c_int)


_mmap = libc_function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_long], ctypes.c_void_p)
_munmap = libc_function("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
_mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p], ctypes.c_int)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                "nr_recently_evicted")]


#: ``cachestat(2)`` (Linux >= 6.5): the same number on every architecture (new system calls share one table)
_SYS_CACHESTAT = 451
_syscall = libc_function("syscall", None, ctypes.c_long) if sys.platform.startswith("linux") else None
_cachestat_works = [_syscall is not None]


def _cachestat(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``[offset, offset + length)`` of ``fd`` are in the page cache, from ``cachestat(2)``;
    None where the kernel lacks it (then it is not asked again) or refuses this file."""
    if _syscall is None or not _cachestat_works[0]:
        return None
    rng, out = _CachestatRange(offset, length), _Cachestat()
    if _syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(out),
                ctypes.c_uint(0)) == 0:
        return int(out.nr_cache)
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter that forbids it
        _cachestat_works[0] = False
    return None


def cached_share(fd: int, offset: int, length: int) -> float | None:
    """The share of the pages of bytes ``[offset, offset + length)`` of ``fd`` that are in the page cache; None
    where it cannot be told. ``offset`` must be page-aligned.

    ``cachestat(2)`` where the kernel has it: it walks only the cached pages (15-70 us for a 0.5 GiB file on the
    reference VM). Else ``mincore`` on a shared read-only mapping of the range (which maps but never reads): it
    looks up every page, 7-12 ms for the same file, which a restore paid before each file's first read. They
    differ on pages still being read in (readahead in flight): ``cachestat`` counts them, ``mincore`` not yet."""
    if length <= 0:
        return None
    pages = -(-length // mmap.PAGESIZE)
    cached = _cachestat(fd, offset, length)
    if cached is not None:
        return min(cached, pages) / pages
    if _mmap is None or _munmap is None or _mincore is None:
        return None
    addr = _mmap(None, length, _PROT_READ, _MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = ctypes.create_string_buffer(pages)
        if _mincore(addr, length, vec) != 0:
            return None
        return vec.raw[:pages].translate(_LOW_BIT).count(1) / pages  # bit 0: resident (the others are undefined)
    finally:
        _munmap(addr, length)


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False where the platform cannot."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_ok(view: memoryview, offset: int) -> bool:
    """Whether ``view`` at file ``offset`` meets ``O_DIRECT``'s alignment rules."""
    if offset % DIRECT_ALIGN or view.nbytes % DIRECT_ALIGN:
        return False
    addr = buffer_address(view)
    return addr is not None and addr % DIRECT_ALIGN == 0


def clear_direct(fd: int) -> None:
    """Turn ``O_DIRECT`` off on an open file descriptor (for an unaligned piece)."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def open_direct(path: str, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """``os.open`` with ``O_DIRECT`` where the file system accepts it; returns the fd and whether it is direct."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system does not do O_DIRECT (tmpfs on old kernels)
                raise
    return os.open(path, flags, mode), False


def write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until every byte is written (short writes happen on signals and some file systems)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - a POSIX write never returns 0 for a non-empty buffer
            raise OSError(errno.EIO, "write returned 0")
        view = view[n:]


class _LocalWriteStream(WriteStream):
    def __init__(self, path: str, size_hint: int | None, *, direct: bool = False, tier: str | None = None) -> None:
        self.path = path
        # a link planted at the name is never followed (the names are the manager's own, in its own folders)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            if direct and size_hint is not None and size_hint >= DIRECT_MIN_BYTES:
                self.fd, self.direct = open_direct(path, flags)
            else:
                self.fd, self.direct = os.open(path, flags, 0o644), False
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
                raise refused(path, "the name is a symbolic link", tier=tier) from None
            raise
        if size_hint and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(self.fd, 0, size_hint)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    self.abort()
                    raise
                # EOPNOTSUPP on some file systems (tmpfs on old kernels, NFS): fine, write without it
        self.written = 0

    def write(self, data: memoryview | bytes) -> None:
        view = (data if isinstance(data, memoryview) else memoryview(data)).cast("B")
        if self.direct and not direct_ok(view, self.written):
            head = view.nbytes - view.nbytes % DIRECT_ALIGN
            if head and self.written % DIRECT_ALIGN == 0 and direct_ok(view[:head], self.written):
                write_all(self.fd, view[:head])  # the aligned bulk of a file's last chunk still goes direct
                self.written += head
                view = view[head:]
            clear_direct(self.fd)
            self.direct = False
        write_all(self.fd, view)
        self.written += view.nbytes

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, self.written)  # in case fallocate reserved more than was written
            faults.point("before-fsync")
            os.fsync(self.fd)
            faults.point("after-fsync")
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LocalStore(Store):
    """A folder on a POSIX file system."""

    atomic_rename = True
    exclusive_create = True
    parallel_writes = True

    def __init__(self, root: str | os.PathLike[str], *, tier: str = "local", create: bool = True,
                 direct_io: bool = False, huge_pages: bool = False) -> None:
        self.direct_io = bool(direct_io and _O_DIRECT)
        #: ``iter_chunks(reuse=True)``'s buffer goes on transparent huge pages (:mod:`tierckpt.host.memory`)
        self.huge_pages = huge_pages
        self.direct_reads = self.direct_io
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.local_path = self.root
        self.tier = tier
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create folder: {exc}", tier=tier, path=self.root) from exc

    def path(self, rel: str) -> str:
        rel = join(rel)
        return os.path.join(self.root, rel) if rel else self.root

    def list(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def isdir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def size(self, rel: str) -> int:
        return os.stat(self.path(rel)).st_size

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        p = self.path(rel)
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_size:
                raise CheckpointError(f"file is {size} bytes, more than the {max_size} allowed", tier=self.tier, path=p)
            return f.read(min(size, max_size) + 1)

    def uncached(self, rel: str, offset: int, length: int) -> bool:
        try:
            fd = os.open(self.path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False  # the read that follows reports it
        try:
            share = cached_share(fd, offset, length)
        finally:
            os.close(fd)
        return share is not None and share < DIRECT_READ_MAX_CACHED

    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        return self.readinto_many(rel, offset, [buf])

    def iter_chunks(self, rel: str, chunk: int, *, start: int = 0, length: int | None = None,
                    reuse: bool = False) -> Iterator[bytes | memoryview]:
        """With ``reuse``, every chunk is read into one page-aligned buffer of ``chunk`` bytes (mapped per call),
        ``O_DIRECT`` where this store reads direct and the range is mostly not in the page cache: the uploader's read
        of a committed file then takes neither fresh memory per chunk nor the page cache's (1 GiB to a POSIX remote
        on the same disk, direct writes there: 0.85 s against 2.25 s for a fresh buffer per chunk written through
        the page cache, 6 interleaved rounds). On huge pages with :attr:`huge_pages` (fewer, larger DMA segments for
        the direct read and for a direct write of the chunk to a POSIX remote: 1 GiB 0.62-0.67 s against
        1.12-1.23 s on small pages)."""
        if not reuse:
            yield from super().iter_chunks(rel, chunk, start=start, length=length)
            return
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        end = self.size(rel) if length is None else start + length
        # readinto_direct reads the page-aligned part of each piece O_DIRECT and falls back for the rest
        read = self.readinto_direct if self.reads_direct(rel, start, end - start) else self.readinto
        size = max(1, min(chunk, end - start))
        buf = anonymous_buffer(size, huge=self.huge_pages)
        pos = start
        while pos < end:
            n = read(rel, pos, buf[: min(size, end - pos)])
            if n <= 0:
                return
            yield buf[:n]
            pos += n

    def readinto_direct(self, rel: str, offset: int, buf: memoryview) -> int:
        """``readinto`` around the page cache: the aligned bulk of a page-aligned buffer at an aligned offset with
        ``O_DIRECT``, the rest (a file's unaligned tail, or all of an unaligned buffer) buffered."""
        head = buf.nbytes - buf.nbytes % DIRECT_ALIGN
        if not (self.direct_io and head and direct_ok(buf[:head], offset)):
            return self.readinto(rel, offset, buf)
        fd, direct = open_direct(self.path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        n = 0
        try:
            if not direct:  # this file system does not do O_DIRECT
                return preadv_into(fd, offset, [buf])
            while n < head:
                got = os.preadv(fd, [buf[n:head]], offset + n)
                n += got
                if got <= 0 or got % DIRECT_ALIGN:  # the end of the file (shorter than the caller expected)
                    return n
        finally:
            os.close(fd)
        return n + (self.readinto(rel, offset + n, buf[head:]) if head < buf.nbytes else 0)

    def readinto_many(self, rel: str, offset: int, bufs: builtins.list[memoryview]) -> int:
        fd = os.open(self.path(rel), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            return preadv_into(fd, offset, bufs)
        finally:
            os.close(fd)

    def open_read(self, rel: str) -> BinaryIO:
        return open(self.path(rel), "rb", buffering=0)  # noqa: SIM115 - caller closes

    def makedirs(self, rel: str) -> None:
        os.makedirs(self.path(rel), exist_ok=True)

    def open_write(self, rel: str, *, size_hint: int | None = None) -> WriteStream:
        return _LocalWriteStream(self.path(rel), size_hint, direct=self.direct_io, tier=self.tier)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_write(rel, size_hint=len(data)) as w:
            w.write(data)

    def put_atomic(self, rel: str, data: bytes) -> None:
        final = self.path(rel)
        tmp = f"{final}.{layout.new_save_id()}.part"
        with _LocalWriteStream(tmp, len(data), tier=self.tier) as w:
            w.write(data)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        final = self.path(rel)
        tmp = f"{final}.{layout.new_save_id()}.part"
        with _LocalWriteStream(tmp, len(data), tier=self.tier) as w:
            w.write(data)
        try:
            os.link(tmp, final)  # fails if ``final`` exists, a dangling link included: never follows one
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(final))
        return True

    def modified_times(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for folder, dirs, files in os.walk(self.root):
            base = os.path.relpath(folder, self.root)
            for name in dirs + files:
                try:
                    out[name if base == "." else f"{base}/{name}"] = os.lstat(os.path.join(folder, name)).st_mtime
                except FileNotFoundError:
                    continue
        return out

    def move_into(self, src: str, dst: str) -> None:
        """Rename one file within the tier (atomic on POSIX); the destination folder's fsync is the caller's."""
        os.rename(self.path(src), self.path(dst))

    def remove(self, rel: str) -> None:
        p = self.path(rel)
        if not rel:
            raise CheckpointError("refusing to remove the root of a tier", tier=self.tier, path=p)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass

    def replace_dir(self, src: str, dst: str) -> None:
        s, d = self.path(src), self.path(dst)
        if not os.path.exists(d):
            os.rename(s, d)
            return
        if exchange(s, d):
            # ``s`` now holds the old folder: the new one is in place, so the old one may go.
            self.sync_dir(os.path.dirname(join(dst)))
            shutil.rmtree(s, ignore_errors=True)
            return
        trash = self.path(layout.trash_dir(os.path.basename(d)))
        os.rename(d, trash)
        os.rename(s, d)
        self.sync_dir(os.path.dirname(join(dst)))
        shutil.rmtree(trash, ignore_errors=True)

    def sync_dir(self, rel: str) -> None:
        fsync_dir(self.path(rel))


def preadv_into(fd: int, offset: int, bufs: list[memoryview]) -> int:
    """``preadv`` until every buffer is full or the file ends; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in bufs if b.nbytes]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:  # drop the buffers this call filled, trim a partly filled one
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total
