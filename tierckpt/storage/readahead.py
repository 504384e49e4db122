"""Hiding an object store's round trips: a file's chunk reads kept in flight, and small requests issued together.

An object store answers each ranged GET after a round trip (tens of milliseconds on S3) and gives one connection a
fraction of the bandwidth a node has; reading a file one chunk at a time leaves most of both unused. A
:class:`ReadAhead` keeps up to ``window`` chunk reads in flight and hands the chunks back strictly in file order, so
a hasher can be fed as the bytes arrive. A store says how many it wants with its ``read_concurrency`` capability
(:class:`~tierckpt.storage.base.Store`); a local disk says 1, and then nothing here starts a thread.

Invariants:

- chunks come back in order, each ``chunk`` bytes except the range's last, and shorter only where the file ends
  early: a short chunk (or an empty read) ends the iteration, so the caller sees fewer bytes than it asked for and
  names the file as truncated;
- with ``into`` every chunk is read into its own place in ``into`` (nothing is copied); without it, into one of at
  most ``window + 1`` reusable buffers, and a chunk handed back stays valid until the next one is asked for (its
  buffer is reused only then): memory stays bounded whatever the file's size;
- ``check`` runs before each read is started (a cancelled restore stops there);
- a failed read raises its error when its chunk's turn comes; :meth:`ReadAhead.close` (also the end of a ``with``,
  whatever happened) cancels the reads not yet started and waits for the running ones, so once it returns no read
  writes into the caller's memory any more.

:func:`each` does the same for many small requests (does each step folder hold a ``manifest.json``, how large is
each file): a remote tier keeping a thousand steps would otherwise wait a thousand round trips, one after another,
to list them. Results come back in the items' order, and the first error is raised after every request ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: ``read(offset, view) -> bytes read`` (fewer only at the end of the file), e.g. a store's ``readinto`` of one file.
ReadFn = Callable[[int, memoryview], int]


def fill(read: ReadFn, offset: int, view: memoryview) -> int:
    """Read until ``view`` is full or the file ends; returns the bytes read."""
    n = 0
    while n < len(view):
        got = read(offset + n, view[n:])
        if got <= 0:
            break
        n += got
    return n


class ReadAhead:
    """Bytes ``[start, end)`` of one file as ``(offset, view)`` chunks in order; see the module docstring."""

    def __init__(self, read: ReadFn, start: int, end: int, *, chunk: int, window: int,
                 into: memoryview | None = None, check: Callable[[], None] | None = None) -> None:
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")
        self._read, self._start, self._end, self._chunk = read, start, end, chunk
        self._window = max(1, int(window))
        self._into = None if into is None else memoryview(into).cast("B")
        if self._into is not None and len(self._into) != end - start:
            raise ValueError(f"into holds {len(self._into)} bytes for a range of {end - start}")
        self._check = check
        self._pool = ThreadPoolExecutor(self._window, thread_name_prefix="tierckpt-readahead") \
            if self._window > 1 and end - start > chunk else None
        #: (offset, where the chunk goes, its reusable buffer or None, its read or None: read when its turn comes)
        self._pending: deque[tuple[int, memoryview, memoryview | None, Future[int] | None]] = deque()
        self._next = start  # offset of the next chunk to start
        self._free: list[memoryview] = []  # reusable buffers (without ``into``)
        self._lent: memoryview | None = None  # the buffer of the chunk handed back last
        self._done = False

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        return self

    def _buffer(self, pos: int, n: int) -> tuple[memoryview, memoryview | None]:
        if self._into is not None:
            return self._into[pos - self._start : pos - self._start + n], None
        buf = self._free.pop() if self._free else memoryview(bytearray(self._chunk))
        return buf[:n], buf

    def _top_up(self) -> None:
        """Start reads until ``window`` are in flight (one, read when its turn comes, without a pool)."""
        while self._next < self._end and len(self._pending) < (self._window if self._pool is not None else 1):
            if self._check is not None:
                self._check()
            pos, n = self._next, min(self._chunk, self._end - self._next)
            view, buf = self._buffer(pos, n)
            fut = self._pool.submit(fill, self._read, pos, view) if self._pool is not None else None
            self._pending.append((pos, view, buf, fut))
            self._next = pos + n

    def __next__(self) -> tuple[int, memoryview]:
        if self._done:
            raise StopIteration
        if self._lent is not None:  # the caller asked for the next chunk: it is done with the last one
            self._free.append(self._lent)
            self._lent = None
        self._top_up()
        if not self._pending:
            self._done = True
            raise StopIteration
        pos, view, buf, fut = self._pending.popleft()
        self._lent = buf
        n = fut.result() if fut is not None else fill(self._read, pos, view)
        if n < len(view):  # the file ended early: nothing after this chunk is valid
            self.close()
            if not n:
                raise StopIteration
        return pos, view[:n]

    def close(self) -> None:
        """Cancel the reads not started, wait for the running ones (idempotent)."""
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


def each(fn: Callable[[T], R], items: Sequence[T], *, concurrency: int) -> list[R]:
    """``[fn(x) for x in items]``, with up to ``2 x concurrency`` calls at once where ``concurrency`` > 1 (a store's
    ``read_concurrency``: small requests such as a ``HEAD`` hold no buffer, so twice as many run as reads)."""
    if concurrency <= 1 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(len(items), 2 * concurrency), thread_name_prefix="tierckpt-readahead") as ex:
        futures = [ex.submit(fn, x) for x in items]
    return [f.result() for f in futures]
