"""The storage interface every tier goes through.

A :class:`Store` is a root folder holding step folders that hold files; paths are relative, ``/``-separated, and
never contain ``..`` (:func:`join` checks). Stores describe what they can do with capability flags, and callers branch
on those flags, never on the store's type:

- ``atomic_rename``: a folder can be renamed atomically (POSIX). Steps are then written into a temporary folder and
  renamed into place; otherwise (object stores) they are written in place and ``manifest.json`` written last commits.
- ``local_path``: the root is a local POSIX path, so callers may use OS calls (``preadv``, ``O_DIRECT``) directly.
- ``parallel_writes``: concurrent writers to different files are worth it.
- ``direct_reads``: :meth:`Store.readinto_direct` of a page-aligned buffer reads around the OS page cache
  (``O_DIRECT``), and :meth:`Store.uncached` tells which ranges are not cached: readers read those direct.
- ``read_concurrency``: how many ranged reads of one file a reader keeps in flight (:mod:`.readahead`). 1 reads a
  file chunk after chunk (a local disk, whose kernel reads ahead by itself); an object store, where every read is a
  request with a round trip, says more. :meth:`Store.readinto` must then be safe to call from several threads at once.
- ``exclusive_create``: :meth:`Store.create_exclusive` is atomic (POSIX hard links, S3 conditional PUTs).
- ``spread_keys``: data files are stored under names that start with a fan-out tag
  (:func:`~tierckpt.format.layout.spread_name`), so that a step's data objects spread over many key prefixes
  (object stores, which rate-limit requests per prefix). The manifests name each file as stored, so readers need
  not know the flag.

Writing a step (see :mod:`.commit` for the exact order): ``makedirs`` → per data file ``open_write`` / ``write`` /
``close`` → ``write_bytes`` of each rank manifest → ``write_bytes`` of ``manifest.json`` → commit protocol.
``WriteStream.close()`` and ``write_bytes`` return only once the bytes are durable on that store (fsync on POSIX, a
completed PUT / multipart completion on object stores).
"""

from __future__ import annotations

import abc
import builtins
import mmap
from collections.abc import Iterator
from typing import BinaryIO

from ..errors import CheckpointError


def join(*parts: str) -> str:
    """Join relative path parts, refusing anything that could leave the root."""
    out: list[str] = []
    for part in parts:
        for comp in part.split("/"):
            if comp in ("", "."):
                continue
            if comp == ".." or "\\" in comp or "\x00" in comp:
                raise CheckpointError(f"refusing unsafe path component {comp!r}", path="/".join(parts))
            out.append(comp)
    return "/".join(out)


class WriteStream(abc.ABC):
    """One file being written. ``close()`` makes it durable; ``abort()`` discards it."""

    @abc.abstractmethod
    def write(self, data: memoryview | bytes) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> WriteStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Store(abc.ABC):
    """A tier's root folder. See the module docstring for the contract."""

    #: Human-readable location, for messages (a path or URL; never credentials).
    url: str
    #: Name of the tier this store serves ("local", "remote"), for messages.
    tier: str = "?"
    atomic_rename: bool = False
    local_path: str | None = None
    parallel_writes: bool = True
    direct_reads: bool = False
    read_concurrency: int = 1
    exclusive_create: bool = False
    spread_keys: bool = False

    # --- listing and reading -------------------------------------------------------------------------------
    @abc.abstractmethod
    def list(self, rel: str = "") -> list[str]:
        """Names directly inside folder ``rel`` (empty list if it does not exist)."""

    def sizes(self, rel: str = "") -> dict[str, int]:
        """The files directly inside folder ``rel`` with their sizes (empty if it does not exist). Object stores
        answer from one listing (paginated by the backend) instead of a request per file."""
        out = {}
        for name in self.list(rel):
            try:
                out[name] = self.size(join(rel, name))
            except (FileNotFoundError, IsADirectoryError):
                continue
        return out

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """Size of file ``rel`` in bytes; ``FileNotFoundError`` if missing."""

    @abc.abstractmethod
    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        """The whole (small) file; ``CheckpointError`` if it is larger than ``max_size``."""

    @abc.abstractmethod
    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""

    def readinto_many(self, rel: str, offset: int, bufs: builtins.list[memoryview]) -> int:
        """Fill ``bufs`` in order from ``offset`` (a vectored read); returns the bytes read (fewer only at end of
        file). Stores with a local path do this in one ``preadv``; the default reads buffer by buffer."""
        total = 0
        for buf in bufs:
            n = self.readinto(rel, offset + total, buf)
            total += n
            if n < buf.nbytes:
                break
        return total

    def readinto_direct(self, rel: str, offset: int, buf: memoryview) -> int:
        """:meth:`readinto` around the OS page cache where the store can (``direct_reads``) and ``buf`` is
        page-aligned; the same bytes either way."""
        return self.readinto(rel, offset, buf)

    def uncached(self, rel: str, offset: int, length: int) -> bool:
        """Whether bytes ``[offset, offset + length)`` of ``rel`` are known not to be in memory (most of them), so
        that a ``direct_reads`` store reads them direct; False where that cannot be told. ``offset``: page-aligned."""
        return False

    def reads_direct(self, rel: str, offset: int, length: int) -> bool:
        """Whether bytes ``[offset, offset + length)`` of ``rel`` are to be read around the page cache
        (:meth:`readinto_direct`): on a ``direct_reads`` store, where most of the range (widened to whole pages) is
        not in memory. Asked once per file or range, before its first read, not once per read."""
        if not self.direct_reads:
            return False
        head = offset % mmap.PAGESIZE
        return self.uncached(rel, offset - head, length + head)

    @abc.abstractmethod
    def open_read(self, rel: str) -> BinaryIO:
        """A sequential binary reader (``read(n)``/``readinto``), for streaming verification and copies."""

    def iter_chunks(self, rel: str, chunk: int, *, start: int = 0, length: int | None = None,
                    reuse: bool = False) -> Iterator[bytes | memoryview]:
        """Sequential chunks of a file, ``chunk`` bytes at most each.

        ``reuse=True`` lets a store hand back views of one buffer that the next chunk overwrites (the caller must be
        done with a chunk before it asks for the next): a store that can read around the page cache then reads each
        chunk into that buffer, with no fresh memory per chunk (:class:`~tierckpt.storage.local.LocalStore`). This
        base implementation returns new ``bytes`` either way."""
        with self.open_read(rel) as f:
            if start:
                f.seek(start)
            left = length
            while left is None or left > 0:
                n = chunk if left is None else min(chunk, left)
                data = f.read(n)
                if not data:
                    return
                if left is not None:
                    left -= len(data)
                yield data

    # --- writing -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abc.abstractmethod
    def open_write(self, rel: str, *, size_hint: int | None = None) -> WriteStream:
        """A new file (an old one of that name is replaced). ``size_hint`` lets a store reserve space up front,
        so that a full disk fails before any byte is written."""

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole small file durably."""

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write a whole small file so that readers see the old content or the new, never a torn one. Object
        stores' PUTs already are; POSIX stores override this with a temporary name and a rename."""
        self.write_bytes(rel, data)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Write a whole small file only if none of that name exists; returns False (writing nothing) if one does.

        Stores with ``exclusive_create`` do it atomically (POSIX: a hard link of a complete temporary file; S3: a
        conditional PUT, ``If-None-Match: *``): of two concurrent callers exactly one creates the file, and readers
        never see a torn one. Elsewhere this checks, then writes: two callers racing within one request's time
        could both succeed (the later write wins)."""
        if self.exists(rel):
            return False
        self.put_atomic(rel, data)
        return True

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Remove a file or a folder tree; missing is fine."""

    def replace_dir(self, src: str, dst: str) -> None:
        """Atomically make folder ``src`` appear as ``dst`` (replacing an old ``dst``); ``atomic_rename`` only."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename folders atomically")

    def sync_dir(self, rel: str) -> None:  # noqa: B027 - optional hook
        """Make the folder's entries durable (POSIX fsync of the directory); a no-op where it means nothing."""

    def discard_unfinished_uploads(self, *, dry_run: bool = False,
                                   older_than_s: float | None = None) -> builtins.list[str]:
        """Abort the uploads under the root that were started and never completed or aborted (S3's multipart
        uploads of a writer that was killed: invisible, but stored and billed), or with ``dry_run`` only name them;
        returns a line per upload. ``older_than_s``: only uploads started at least that long ago (a younger one,
        or one of unknown age, may belong to a live writer: it is kept, with a line that starts with "kept").
        Only safe while nothing writes to the root, or with ``older_than_s`` (``tierckpt prune --leftovers``).
        Stores without such uploads have none."""
        return []

    def modified_times(self) -> dict[str, float | None]:
        """Every file (and, where folders exist, folder) under the root by relative path, with its last
        modification time in seconds since the epoch (None where the store does not say). Used to tell a
        leftover from an upload in progress. The default, for stores that cannot be walked, is empty."""
        return {}

    def diagnose(self) -> BaseException | None:
        """Why a request that did not answer in time failed, where the store can tell (its endpoint refuses
        connections, its name does not resolve), or None: called only after a deadline passed."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads."""
