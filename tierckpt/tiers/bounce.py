"""A small fixed set of page-aligned read buffers that an in-place restore reads through with ``O_DIRECT``.

Why: an in-place restore reads straight into the caller's tensors, whose memory is not aligned the way ``O_DIRECT``
needs (torch puts a large tensor 64 bytes past a page), so those reads went through the page cache, which on the
reference VM runs at half the speed of a direct read (and fills the cache with a copy of the state). Reading each
piece of a file direct into one of these buffers and copying it out into the tensors costs one memory copy per byte
(in C, without the GIL, on the file's hashing thread, beside the next read) and keeps the disk at direct-read speed.
Buffered vectored reads into the tensors instead made cold restores of 592 tensors 1.4-1.6x as long guarded and
4.4x in place at 2 GiB (benchmarks/restore_paths.py); at 10,000 tensors of 0.5 GiB in place they made it 0.58x
(0.42-0.67): there the bounce buffers are behind.

Invariants:
- the buffers are cut from a staging slot that a save has faulted in, borrowed for one restore's reads (the
  restore holds the slot until its reads end), or else allocated once (per manager), faulted in at once by one
  thread, and reused by every later restore:
  memory is ``count * size`` bytes however large the state (reads into fresh memory fault page by page, and pages
  faulted by several threads at once are physically scattered, which splits direct reads into many small requests;
  docs/design.md has the numbers);
- a buffer is handed to one reader at a time (:meth:`acquire` blocks while all are out) and comes back only after its
  bytes were copied out (:meth:`release`), so no read ever overwrites bytes not yet copied;
- nothing here knows about tensors: the caller hands destinations as memoryviews.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

from ..host.memory import anonymous_buffer, buffer_address

#: Bytes per buffer: one direct read (the virtual disk of the reference VM splits requests at 4 MiB, so several are
#: in flight per read).
BOUNCE_SIZE = 16 << 20
#: Buffers per reading thread: one being read into while the other is copied out.
BOUNCE_PER_THREAD = 2


class BounceBuffers:
    """``count`` reusable page-aligned buffers of ``size`` bytes, allocated by the first :meth:`acquire` (a restore
    that never reads around the page cache costs nothing).

    Call order: construct → per read: :meth:`acquire` → fill it → copy it out → :meth:`release` → …; the memory
    is unmapped once the object and every buffer it handed out are gone.
    """

    def __init__(self, count: int, size: int = BOUNCE_SIZE, *, huge: bool = False,
                 memory: memoryview | None = None) -> None:
        """``memory``: page-aligned memory of at least ``count * size`` bytes to cut the buffers from (borrowed:
        neither allocated nor freed here, and the lender must not use it while any buffer is handed out)."""
        if count < 1 or size < mmap.PAGESIZE or size % mmap.PAGESIZE:
            raise ValueError(f"bounce buffers need count >= 1 and a size that is a multiple of {mmap.PAGESIZE} bytes, "
                             f"not count={count}, size={size}")
        if memory is not None and (memory.nbytes < count * size or (buffer_address(memory) or 1) % mmap.PAGESIZE):
            raise ValueError(f"borrowed bounce memory must be page-aligned and hold {count * size} bytes")
        self.count, self.size, self.huge = count, size, huge
        self._borrowed = memory
        self._map: memoryview | None = None
        self._free: list[memoryview] = []
        self._cond = threading.Condition()

    def _allocate(self) -> None:
        # private anonymous memory, page-aligned (on huge pages with ``huge``). Python's default for an anonymous
        # map is shared (shmem), whose pages came out in descending physical order in one process here: each 4 KiB
        # page its own DMA segment, reads split at the disk's segment limit (0.5 GiB of 10,000 tensors in place:
        # 0.56 s, against 0.34 s with private memory and 0.33 s buffered)
        if self._borrowed is not None:
            whole = self._map = self._borrowed[: self.count * self.size]
        else:
            whole = self._map = anonymous_buffer(self.count * self.size, huge=self.huge)
            ctypes.memset(buffer_address(whole), 0, len(whole))  # fault in, on one thread
        self._free = [whole[i * self.size : (i + 1) * self.size] for i in range(self.count)]

    def acquire(self) -> memoryview:
        """A free buffer (blocks until one is released)."""
        with self._cond:
            if self._map is None:
                self._allocate()
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, buf: memoryview) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    @property
    def allocated(self) -> bool:
        """Whether the buffers' memory is mapped (a read needed them)."""
        return self._map is not None

    def free(self) -> int:
        """How many buffers are not handed out (all of them when no read is running)."""
        with self._cond:
            return self.count if self._map is None else len(self._free)


__all__ = ["BOUNCE_PER_THREAD", "BOUNCE_SIZE", "BounceBuffers"]
