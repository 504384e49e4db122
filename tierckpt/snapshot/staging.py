"""Reusable host staging buffers, and how far a copy into one has got.

Memory budget: ``slots`` buffers, each as large as one snapshot (all of one rank's data files, headers included,
rounded up to 4 KiB per file). ``save()`` takes a free slot and copies into it; the slot comes back when the local
tier has made that snapshot durable. With one slot (the default) a save that arrives while the previous one is still
being written waits for it (back-pressure) rather than allocating more memory; two slots let one save be copied while
the previous is written, at twice the memory.

Buffers are allocated on first use (or ahead of it, on a background thread, by :meth:`StagingPool.reserve`), grown
only when a state grows, and otherwise reused forever, so a steady-state save allocates nothing large. A restore's
fresh buffer is faulted in by a :class:`Populator` while the reads fill it; it never changes a byte. They are
pinned (page-locked) when CUDA is available, so device-to-host copies run at full PCIe/NVLink bandwidth on a
dedicated copy stream without blocking the training stream.

How a state is copied into a slot (the copy's threads, the native streaming copy and the pipelined copy the
writers follow) is :mod:`.copier`'s concern; this module owns the memory and the watermarks (:class:`CopyProgress`)
the copy raises and the writers wait on. Invariant: a watermark covers only bytes whose copy has returned; a failed
copy fails the progress, which wakes every waiter with an error, and the slot is released by the writer's job (never
while it may still read from it).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import CheckpointError
from ..format.plan import SnapshotPlan
from ..host.libc import libc_function
from ..host.memory import anonymous_buffer

if TYPE_CHECKING:
    from ..tiers.memory import MemoryTier

log = logging.getLogger(__name__)

#: Grow buffers in steps of this many bytes so that a state growing a little does not reallocate every time.
GROWTH_QUANTUM = 64 << 20
#: Buffers start on this boundary (a page; what ``O_DIRECT`` needs), and so does every file image in them.
BUFFER_ALIGN = 4096
#: At most this many threads copy small tensors (beyond that, memory bandwidth and cores run out, not work).
MAX_COPY_THREADS = 4
#: Bytes a :class:`Populator` faults in per ``madvise`` call (its :meth:`~Populator.stop` waits for at most one).
POPULATE_CHUNK = 16 << 20
#: ``madvise`` advice (Linux 5.14+) that faults pages in as if written, without changing a byte of them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


_libc_madvise = (libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
                 if sys.platform.startswith("linux") else None)


class StagingFailed(CheckpointError):
    """The copy into a staging slot failed: whoever waits for its bytes gives up (the copy's error is the cause)."""


class CopyProgress:
    """How many leading bytes of each file image in a slot hold this snapshot's data (pipelined copy and write).

    The copier calls :meth:`advance` per group and :meth:`finish` at the end, or :meth:`fail`; writers call
    :meth:`wait` before reading a range. Watermarks only rise. The caller of ``save()`` calls :meth:`release` once it
    no longer waits (whatever happened); hashing waits for that (:meth:`wait_released`).
    """

    def __init__(self, file_sizes: list[int]) -> None:
        self._sizes = list(file_sizes)
        self._done = [0] * len(file_sizes)
        self._cond = threading.Condition()
        self._released = False
        self.failed: BaseException | None = None

    def advance(self, part: int, end: int) -> None:
        with self._cond:
            if end > self._done[part]:
                self._done[part] = end
                self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = list(self._sizes)
            self._cond.notify_all()

    def release(self) -> None:
        """The caller no longer waits for this copy: work that would only compete with it for the CPU may start."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def wait_released(self) -> None:
        """Block until every byte is copied and :meth:`release` was called; raise if the copy failed."""
        self._wait_until(lambda: self._released and self._done == self._sizes)

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failed = exc
            self._cond.notify_all()

    def wait(self, part: int, end: int) -> None:
        """Block until bytes ``[0, end)`` of file image ``part`` are copied; raise :class:`StagingFailed` if the copy
        failed."""
        self._wait_until(lambda: self._done[part] >= end)

    def _wait_until(self, reached: Callable[[], bool]) -> None:
        with self._cond:
            while not reached() and self.failed is None:
                self._cond.wait()
            if self.failed is not None:
                raise StagingFailed(f"the snapshot's copy into host memory failed: {self.failed}") from self.failed

    def waiter(self, part: int) -> Callable[[int], None]:
        """``wait`` bound to one file image (what a writer of that file gets)."""
        return lambda end: self.wait(part, end)


@dataclass(eq=False)
class Slot:
    index: int
    buffer: torch.Tensor | None = None  # uint8, 1-D
    # the copier._SlotLayout (destination views) of the plan last copied here; _allocate and close reset it to None,
    # which drops every view of the old buffer
    _views_for: object = None
    _views: list[torch.Tensor | np.ndarray] | None = None
    _headers_for: object = None
    # faults in the pages of a fresh buffer while a restore reads into it (acquire(populate=True)); stopped and
    # joined by release() and close(), before the slot can change hands or its buffer go
    _populator: Populator | None = None
    #: the buffer is this slot's file of the memory tier (:mod:`tierckpt.tiers.memory`), not private memory
    shared: bool = False
    #: the address registered with CUDA (``cudaHostRegister``) for a pinned shared buffer, to unregister
    _registered: int = 0

    @property
    def populating(self) -> bool:
        """Whether a thread is still faulting in this slot's pages (see :class:`Populator`)."""
        return self._populator is not None

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def file_view(self, plan: SnapshotPlan, part: int) -> memoryview:
        f = plan.files[part]
        assert self.buffer is not None
        return memoryview(self.buffer[f.buffer_offset : f.buffer_offset + f.size].numpy())

    def file_views(self, plan: SnapshotPlan) -> list[memoryview]:
        """Every file image of ``plan`` in this slot (cached with the slot's layout for that plan)."""
        layout = self._views_for  # a copier._SlotLayout, or None
        if layout is not None and getattr(layout, "plan", None) is plan:
            if layout.file_views is None:
                layout.file_views = [self.file_view(plan, f.part) for f in plan.files]
            return layout.file_views
        return [self.file_view(plan, f.part) for f in plan.files]

    def raw_leaf(self, plan: SnapshotPlan, file_of_leaf: list[tuple[int, int]], i: int) -> torch.Tensor:
        part, offset = file_of_leaf[i]
        start = plan.files[part].buffer_offset + offset
        assert self.buffer is not None
        return self.buffer[start : start + plan.signature[i].nbytes]


class StagingPool:
    """``slots`` reusable buffers; :meth:`acquire` blocks while all are in use (back-pressure)."""

    def __init__(self, *, slots: int, pin: bool, huge: bool = False, memory: MemoryTier | None = None) -> None:
        self.pin = pin
        #: the memory tier whose files back the slots (None: private memory). Its copy of a slot is invalidated
        #: whenever the slot is handed out (:meth:`acquire`), before anything may write it
        self.memory = memory
        #: pageable buffers go on transparent huge pages (:func:`aligned_empty`); they are kept and reused, which is
        #: what a huge page's larger first-touch cost on some VMs needs (:mod:`tierckpt.host.memory`)
        self.huge = huge
        self._slots = [Slot(i) for i in range(slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()
        self.allocations = 0  # how many times a buffer was (re)allocated; steady state keeps this constant
        self._copy_executor: ThreadPoolExecutor | None = None

    def acquire(self, nbytes: int, *, timeout: float | None = None, populate: bool = False) -> Slot:
        """A free slot of at least ``nbytes`` (allocated or grown here if needed); blocks while none is free.

        ``populate``: if the buffer is allocated here, fault its pages in on a background thread (a
        :class:`Populator`) while the caller fills it, until :meth:`release`. For a restore, whose reads wait on the
        disk: without it each reader traps into the kernel once per 4 KiB page as its bytes land in fresh memory
        (2 GiB, cold, 4 restores each: 2.1 s into a fresh buffer, 1.3 s into one faulted in before). What the
        populator wins back varies: docs/design.md, ``tierckpt-populate``."""
        slot, allocated = self._acquire(nbytes, timeout, invalidate=True)
        if populate and allocated and slot.buffer is not None and not self.pin:
            slot._populator = Populator(slot.buffer)
        return slot

    def _acquire(self, nbytes: int, timeout: float | None, *, invalidate: bool) -> tuple[Slot, bool]:
        """:meth:`acquire`, and whether the slot's buffer was allocated by this call. ``invalidate``: the caller
        may write the slot, so its memory-tier copy goes first (allocating it does that anyway)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"no staging buffer became free within {timeout} s")
                self._cond.wait(left)
            # prefer a slot that is already big enough
            self._free.sort(key=lambda s: (s.capacity < nbytes, s.capacity))
            slot = self._free.pop(0)
        if invalidate and self.memory is not None:
            try:
                self.memory.invalidate(slot.index)
            except BaseException:
                self.release(slot)
                raise
        if slot.capacity < nbytes:
            try:
                self._allocate(slot, nbytes)
            except BaseException:
                self.release(slot)  # no memory now: the slot (without a buffer) stays for the next save to try
                raise
            return slot, True
        return slot, False

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot, in order (a slot's ``buffer`` is None until a save or restore allocates it)."""
        return tuple(self._slots)

    @property
    def free_slots(self) -> int:
        """How many slots no save or restore holds now."""
        with self._cond:
            return len(self._free)

    def ready(self, nbytes: int) -> bool:
        """Whether a free slot already holds a buffer of at least ``nbytes`` (an :meth:`acquire` now would neither
        wait nor allocate, unless another caller takes it first)."""
        with self._cond:
            return any(s.capacity >= nbytes for s in self._free)

    def hold(self, index: int) -> Callable[[], None] | None:
        """Take slot ``index`` as it is, without waiting and without invalidating its memory copy (a restore reads
        that copy meanwhile, and no save may write the slot until it is done); returns the callable that gives it
        back (idempotent), or None if the slot is in use (a save is overwriting it)."""
        with self._cond:
            slot = next((s for s in self._free if s.index == index), None)
            if slot is None:
                return None
            self._free.remove(slot)
        given: list[bool] = []

        def give_back() -> None:
            if not given:
                given.append(True)
                self.release(slot)

        return give_back

    def release(self, slot: Slot) -> None:
        populator, slot._populator = slot._populator, None
        if populator is not None:
            populator.stop()
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify()

    def _allocate(self, slot: Slot, nbytes: int) -> None:
        size = -(-nbytes // GROWTH_QUANTUM) * GROWTH_QUANTUM if nbytes > GROWTH_QUANTUM else nbytes
        _unregister(slot)
        slot.buffer = None  # drop the old one first: peak memory is the new size, not old + new
        slot._views_for, slot._views, slot._headers_for = None, [], None
        slot.shared = False
        t0 = time.perf_counter()
        if self.memory is not None:
            slot.buffer = self._shared_buffer(slot, size)
        try:
            if slot.buffer is None:
                slot.buffer = aligned_empty(size, pin=self.pin, huge=self.huge)
        except (RuntimeError, OSError) as exc:  # torch's allocator / mmap (huge pages)
            raise CheckpointError(f"cannot allocate a {size}-byte staging buffer: {exc}") from exc
        self.allocations += 1
        kind = "pinned" if self.pin else "pageable, huge pages" if self.huge else "pageable"
        log.info("staging: allocated %.1f MiB (%s) for slot %d in %.3f s", size / 2**20,
                 f"memory tier, {'pinned' if slot._registered else 'pageable'}" if slot.shared else kind, slot.index,
                 time.perf_counter() - t0)

    def _shared_buffer(self, slot: Slot, size: int) -> torch.Tensor | None:
        """Slot ``slot``'s buffer as its memory-tier file (pinned by registering it with CUDA where the pool pins),
        or None (logged) where that memory cannot be had: the slot then uses private memory, without a memory
        copy."""
        assert self.memory is not None
        try:
            view = self.memory.map_slot(slot.index, size)
        except OSError as exc:
            log.warning("tier memory: cannot reserve %.1f MiB for slot %d in %s (%s): the slot uses private memory "
                        "and keeps no memory copy", size / 2**20, slot.index, self.memory.dir, exc)
            return None
        buffer = torch.from_numpy(np.frombuffer(view, dtype=np.uint8))
        if self.pin and size:
            why: object
            try:
                why = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
                ok = int(why) == 0  # type: ignore[call-overload]  # a cudaError enum
            except (RuntimeError, AssertionError, AttributeError, OSError, TypeError, ValueError) as exc:  # no CUDA
                why, ok = exc, False
            if ok:
                slot._registered = buffer.data_ptr()
            else:
                log.warning("tier memory: cudaHostRegister of slot %d failed (%s): its buffer stays pageable",
                            slot.index, why)
        slot.shared = True
        return buffer

    def reserve(self, nbytes: int) -> Future[float]:
        """Make a slot of at least ``nbytes`` ready on a ``tierckpt-reserve`` thread: allocate it if needed and
        fault its pages in (:func:`fault_in`), so that the save that takes it next does not pay for either.

        The thread holds the slot meanwhile, so a save that arrives first waits for it as for any busy slot (and
        never touches memory being faulted in). Returns a future of the seconds it took; failures (memory) end up
        there, and the next save, which needs the same memory, reports its own.
        """
        fut: Future[float] = Future()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                slot, allocated = self._acquire(nbytes, None, invalidate=False)  # faulting in changes no byte
                try:
                    if allocated and slot.buffer is not None:
                        fault_in(slot.buffer, pinned=self.pin)
                finally:
                    self.release(slot)
            except BaseException as exc:
                log.warning("staging: reserving %.1f MiB failed: %s", nbytes / 2**20, exc)
                fut.set_exception(exc)
                return
            fut.set_result(time.perf_counter() - t0)

        threading.Thread(target=run, name="tierckpt-reserve", daemon=True).start()
        return fut

    def copy_executor(self) -> ThreadPoolExecutor:
        """The threads that copy small tensors (created on first use, so a pool that never copies has none)."""
        with self._cond:
            if self._copy_executor is None:
                self._copy_executor = ThreadPoolExecutor(MAX_COPY_THREADS, thread_name_prefix="tierckpt-copy")
            return self._copy_executor

    def close(self) -> None:
        """Drop every buffer; a memory tier is closed and its files removed (a job that closes its manager has
        finished: only a crash leaves the memory copy for the next process)."""
        for s in self._slots:
            populator, s._populator = s._populator, None
            if populator is not None:
                populator.stop()
        with self._cond:
            for s in self._slots:
                _unregister(s)
                s.buffer, s._views_for, s._views, s._headers_for = None, None, [], None
                s.shared = False
            executor, self._copy_executor = self._copy_executor, None
            memory, self.memory = self.memory, None
        if executor is not None:
            executor.shutdown(wait=True)
        if memory is not None:
            memory.close(remove=True)


def _unregister(slot: Slot) -> None:
    """Undo the ``cudaHostRegister`` of a pinned shared buffer (before the buffer goes)."""
    if slot._registered:
        addr, slot._registered = slot._registered, 0
        torch.cuda.cudart().cudaHostUnregister(addr)


def fault_in(buffer: torch.Tensor, *, pinned: bool) -> None:
    """Fault in every page of a fresh buffer now, so that the first copy into it does not trap into the kernel once
    per 4 KiB page (2 GiB: 0.6-0.7 s on the reference VM). Pinned buffers are already resident (the CUDA driver
    locks them when they are allocated). ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) does it in the kernel
    without changing a byte; elsewhere the buffer is zeroed, which only its owner may do (the caller holds it)."""
    if pinned or buffer.numel() == 0:
        return
    if _populate_write(buffer.data_ptr(), buffer.numel()):
        return
    buffer.zero_()


def _populate_write(addr: int, n: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over ``n`` bytes at ``addr``: whether it worked (pages mapped, no byte
    changed)."""
    return _libc_madvise is not None and _libc_madvise(addr, n, _MADV_POPULATE_WRITE) == 0


class Populator:
    """Faults in a fresh host buffer's pages on a ``tierckpt-populate`` thread, :data:`POPULATE_CHUNK` at a time from
    its start, while other threads fill it (a restore's reads), until done or :meth:`stop`.

    Only with ``madvise(MADV_POPULATE_WRITE)``, which maps each missing page without writing a byte and leaves a
    page that is already there alone: it is safe beside the threads writing the same memory, whose bytes it never
    touches. Where that advice fails (kernels before 5.14, other platforms) the thread ends at its first chunk; the
    writers then fault the pages in themselves, as they would without it. Call order: construct (right after the
    allocation) -> fill the buffer meanwhile -> :meth:`stop` (before the buffer may be freed or reused).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self._addr, self._size = buffer.data_ptr(), buffer.numel()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if _libc_madvise is not None and self._size:
            self._thread = threading.Thread(target=self._run, name="tierckpt-populate", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for start in range(0, self._size, POPULATE_CHUNK):
            if self._stopped.is_set():
                return
            if not _populate_write(self._addr + start, min(POPULATE_CHUNK, self._size - start)):
                log.debug("staging: madvise(MADV_POPULATE_WRITE) failed (errno %d): pages fault in on use",
                          ctypes.get_errno())
                return

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has been through the whole buffer (or given up); whether it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        """Stop at the next chunk and wait for the thread (one madvise of at most a chunk: a few ms)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def aligned_empty(size: int, *, pin: bool, huge: bool = False) -> torch.Tensor:
    """A 1-D uint8 tensor of ``size`` bytes whose first byte sits on a :data:`BUFFER_ALIGN` boundary.

    Pageable buffers are private anonymous memory (:func:`tierckpt.host.memory.anonymous_buffer`): with ``huge`` on
    transparent huge pages where the kernel offers them (direct reads and writes of it move fewer, larger DMA
    segments), without it advised off them whatever the heap around it was advised. Pinned buffers come from
    torch (the CUDA driver allocates them), which aligns large blocks to 64 bytes or to a page plus a header; one
    spare page and a view fix that.
    """
    if not pin:
        return torch.from_numpy(np.frombuffer(anonymous_buffer(size, huge=huge), dtype=np.uint8))
    raw = torch.empty(size + BUFFER_ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % BUFFER_ALIGN
    return raw[skip : skip + size]


def leaf_locations(plan: SnapshotPlan) -> list[tuple[int, int]]:
    """For each leaf: (file part, absolute offset within that file)."""
    loc: list[tuple[int, int]] = [(0, 0)] * len(plan.signature)
    for f in plan.files:
        for t in f.tensors:
            loc[t.leaf] = (f.part, t.offset)
    return loc


__all__ = ["CopyProgress", "StagingFailed", "StagingPool", "Slot", "aligned_empty", "leaf_locations"]
