"""Reusable host staging buffers and the copy of a state into them.

Memory budget: ``slots`` buffers, each as large as one snapshot (all of one rank's data files, headers included,
rounded up to 4 KiB per file). ``save()`` takes a free slot and copies into it; the slot comes back when the local
tier has made that snapshot durable. With one slot (the default) a save that arrives while the previous one is still
being written waits for it (back-pressure) rather than allocating more memory; two slots let one save be copied while
the previous is written, at twice the memory.

Buffers are allocated on first use (or ahead of it, on a background thread, by :meth:`StagingPool.reserve`), grown
only when a state grows, and otherwise reused forever, so a steady-state save allocates nothing large. They are
pinned (page-locked) when CUDA is available, so device-to-host copies run at full PCIe/NVLink bandwidth on a
dedicated copy stream without blocking the training stream.

Copying host tensors: where the optional native copy is built (:mod:`.hostcopy`), one call copies every tensor
(or, pipelined, every tensor of a group) with streaming stores, its bytes split evenly over torch's intra-op thread
count (0.64x the time of ``copy_`` for the benchmark's 2 GiB state; they skip the read of each destination line
that a cached store makes). The destinations' addresses are read once per plan (:class:`hostcopy.Batch`); the
sources are checked in one C-level pass per attribute, so 10,000 small tensors cost milliseconds, not one Python
loop each. If any source is strided or lazily conjugated, that batch goes the other way: large plain tensors
natively one by one (:func:`hostcopy.copy_pairs`), the rest, and everything without the extension, in one
``torch._foreach_copy_`` call, which copies a list of tensors in C++ (releasing the GIL); torch splits each large
copy over its own threads. Thousands of small tensors are dominated by per-tensor cost instead, which torch does
not parallelise, so on that path, where there are many small ones, they are split into chunks copied by a few
threads of the pool's :meth:`StagingPool.copy_executor` while the calling thread copies a chunk of its own.

Pipelining (the manager asks for it where :func:`overlap_pays`, or ``overlap_writes=True``): given a
:class:`CopyProgress`, the copy runs file image by file image in groups of about
:data:`PIPELINE_GROUP_BYTES`, in the order the writer threads consume them, and raises each file's watermark after
each group; a group holding many small tensors is split over the copy threads (above) and its watermark rises when
every chunk of it has returned. The local tier's writers wait on those watermarks, so they start writing a file's
first bytes while the rest of the state is still being copied, and durable time is no longer copy time plus write
time. Invariant: a watermark covers only bytes whose copy has returned; a failed copy fails the progress, which
wakes every waiter with an error, and the slot is released by the writer's job (never while it may still read
from it).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._libc import libc_function
from ..errors import CheckpointError
from ..format.plan import SnapshotPlan
from . import hostcopy
from .dtypes import CODE_TO_NUMPY, CODE_TO_TORCH
from .tree import FlatState

log = logging.getLogger(__name__)

#: Grow buffers in steps of this many bytes so that a state growing a little does not reallocate every time.
GROWTH_QUANTUM = 64 << 20
#: Buffers start on this boundary (a page; what ``O_DIRECT`` needs), and so does every file image in them.
BUFFER_ALIGN = 4096
#: Host tensors below this size are "small": their copy costs more per tensor than per byte.
SMALL_TENSOR_BYTES = 1 << 20
#: Small tensors are split over threads only when there are more of them than this (below, the hand-off to
#: other threads costs about what it saves).
THREADED_MIN_TENSORS = 256
#: At most this many threads copy small tensors (beyond that, memory bandwidth and cores run out, not work).
MAX_COPY_THREADS = 4
#: When balancing chunks, one tensor counts as this many bytes on top of its own (its fixed per-tensor cost).
_TENSOR_COST_BYTES = 32 << 10
#: A pipelined copy raises a file's watermark after about this many bytes of it (see the module docstring): with
#: the default 512 MiB files, once a file. Each group costs a hand-over (a native call, a watermark, waking the
#: writers) while the writers are busy; on 2 cores, 2 GiB, 12 interleaved pairs against copying first, the copy
#: took 21% longer with 128 MiB groups, 11% with 256 MiB, 5% with 512 MiB, for the same durable time (8% sooner than
#: copying first). A writer's first bytes wait for one group: 35 ms at the native copy's speed.
PIPELINE_GROUP_BYTES = 512 << 20
#: A pipelined group is split over the copy threads when it holds at least this many small tensors (not tuned:
#: below it, the hand-off to another thread is assumed to cost more than it saves).
PIPELINE_SPLIT_MIN_TENSORS = 64
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
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
    # the _SlotLayout (destination views) of the plan last copied here; _allocate and close reset it to None, which
    # drops every view of the old buffer
    _views_for: object = None
    _views: list[torch.Tensor | np.ndarray] | None = None
    _headers_for: object = None

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def file_view(self, plan: SnapshotPlan, part: int) -> memoryview:
        f = plan.files[part]
        assert self.buffer is not None
        return memoryview(self.buffer[f.buffer_offset : f.buffer_offset + f.size].numpy())

    def file_views(self, plan: SnapshotPlan) -> list[memoryview]:
        """Every file image of ``plan`` in this slot (cached with the slot's layout for that plan)."""
        layout = self._views_for
        if isinstance(layout, _SlotLayout) and layout.plan is plan:
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

    def __init__(self, *, slots: int, pin: bool) -> None:
        self.pin = pin
        self._slots = [Slot(i) for i in range(slots)]
        self._free = list(self._slots)
        self._cond = threading.Condition()
        self.allocations = 0  # how many times a buffer was (re)allocated; steady state keeps this constant
        self._copy_executor: ThreadPoolExecutor | None = None

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> Slot:
        """A free slot of at least ``nbytes`` (allocated or grown here if needed); blocks while none is free."""
        return self._acquire(nbytes, timeout)[0]

    def _acquire(self, nbytes: int, timeout: float | None) -> tuple[Slot, bool]:
        """:meth:`acquire`, and whether the slot's buffer was allocated by this call."""
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
        if slot.capacity < nbytes:
            self._allocate(slot, nbytes)
            return slot, True
        return slot, False

    def release(self, slot: Slot) -> None:
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify()

    def _allocate(self, slot: Slot, nbytes: int) -> None:
        size = -(-nbytes // GROWTH_QUANTUM) * GROWTH_QUANTUM if nbytes > GROWTH_QUANTUM else nbytes
        slot.buffer = None  # drop the old one first: peak memory is the new size, not old + new
        slot._views_for, slot._views, slot._headers_for = None, [], None
        t0 = time.perf_counter()
        try:
            slot.buffer = aligned_empty(size, pin=self.pin)
        except RuntimeError as exc:
            raise CheckpointError(f"cannot allocate a {size}-byte staging buffer: {exc}") from exc
        self.allocations += 1
        log.info("staging: allocated %.1f MiB (%s) for slot %d in %.3f s", size / 2**20,
                 "pinned" if self.pin else "pageable", slot.index, time.perf_counter() - t0)

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
                slot, allocated = self._acquire(nbytes, None)
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
        with self._cond:
            for s in self._slots:
                s.buffer, s._views_for, s._views, s._headers_for = None, None, [], None
            executor, self._copy_executor = self._copy_executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def fault_in(buffer: torch.Tensor, *, pinned: bool) -> None:
    """Fault in every page of a fresh buffer now, so that the first copy into it does not trap into the kernel once
    per 4 KiB page (2 GiB: 0.6-0.7 s on the reference VM). Pinned buffers are already resident (the CUDA driver
    locks them when they are allocated). ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) does it in the kernel
    without changing a byte; elsewhere the buffer is zeroed, which only its owner may do (the caller holds it)."""
    if pinned or buffer.numel() == 0:
        return
    if _libc_madvise is not None and _libc_madvise(buffer.data_ptr(), buffer.numel(), _MADV_POPULATE_WRITE) == 0:
        return
    buffer.zero_()


def aligned_empty(size: int, *, pin: bool) -> torch.Tensor:
    """A 1-D uint8 tensor of ``size`` bytes whose first byte sits on a :data:`BUFFER_ALIGN` boundary.

    Allocators align large blocks to 64 bytes or to a page plus a header; one spare page and a view fix that.
    """
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


class _Group:
    """One step of a pipelined copy, after which file ``part``'s watermark rises to ``end``: either whole tensors
    (``positions`` into the layout's sources and their ``dsts``), cut into ``chunks`` (positions, destinations) for
    the copy threads when there are many small ones, or one ``piece`` of a tensor larger than a group (position,
    first and last element, destination view of those elements)."""

    __slots__ = ("part", "end", "dsts", "positions", "chunks", "piece", "_batch")

    def __init__(self, part: int, end: int, dsts: list[torch.Tensor], positions: list[int],
                 chunks: list[tuple[list[int], list[torch.Tensor]]] | None = None,
                 piece: tuple[int, int, int, torch.Tensor] | None = None) -> None:
        self.part, self.end, self.dsts, self.positions = part, end, dsts, positions
        self.chunks, self.piece = chunks, piece
        self._batch: hostcopy.Batch | None = None

    def batch(self) -> hostcopy.Batch:
        """The group's destinations as one native copy batch (built on first use)."""
        if self._batch is None:
            self._batch = hostcopy.Batch(self.dsts)
        return self._batch


class _CopySchedule:
    """How one plan's host tensors are copied with ``threads`` threads: ``chunks`` of small tensors for the copy
    threads (None: no threads, one call copies everything) and the large ones for the calling thread. Positions
    index the list of sources of :class:`_SlotLayout`."""

    __slots__ = ("chunks", "large_pos", "large_dsts")

    def __init__(self, chunks: list[tuple[list[int], list[torch.Tensor]]] | None, large_pos: list[int],
                 large_dsts: list[torch.Tensor]) -> None:
        self.chunks, self.large_pos, self.large_dsts = chunks, large_pos, large_dsts


class _SlotLayout:
    """Typed views into a slot for every leaf of one plan, and the copy derived from them (built once per plan)."""

    __slots__ = ("plan", "kinds", "views", "torch_idx", "numpy_idx", "dsts", "schedules", "pipelines", "file_views",
                 "_batch")

    def __init__(self, plan: SnapshotPlan, kinds: list[str], views: list[torch.Tensor | np.ndarray]) -> None:
        self.plan, self.kinds, self.views = plan, kinds, views
        sig = plan.signature
        torch_idx = [i for i, k in enumerate(kinds) if k == "torch" and sig[i].nbytes]
        # None: every leaf is a non-empty tensor, so the sources are the leaves' values as they are
        self.torch_idx: list[int] | None = None if len(torch_idx) == len(kinds) else torch_idx
        self.numpy_idx = [i for i, k in enumerate(kinds) if k == "numpy" and sig[i].nbytes]
        self.dsts: list[torch.Tensor] = [views[i] for i in torch_idx]  # type: ignore[misc]
        self.schedules: dict[int, _CopySchedule] = {}
        self.pipelines: dict[tuple[int, int], list[_Group]] = {}
        self.file_views: list[memoryview] | None = None
        self._batch: hostcopy.Batch | None = None

    def batch(self) -> hostcopy.Batch:
        """Every destination as one native copy batch (built on first use)."""
        if self._batch is None:
            self._batch = hostcopy.Batch(self.dsts)
        return self._batch

    def pipeline(self, waves: int, threads: int = 1) -> list[_Group]:
        """The groups of a pipelined copy (see :class:`_Group`), in the order they are copied.

        Each file's tensors in file order, cut every :data:`PIPELINE_GROUP_BYTES` (a larger tensor into pieces of
        that size, so that a writer's first bytes never wait for a whole embedding); files taken ``waves`` at a time
        (the writer threads take them in that order) with their groups interleaved, so every busy writer has its
        next bytes early. A group with at least :data:`PIPELINE_SPLIT_MIN_TENSORS` small tensors is cut into
        ``threads`` chunks of equal cost. Leaves copied before the groups (arrays) and empty ones are covered but
        not listed.
        """
        cached = self.pipelines.get((waves, threads))
        if cached is not None:
            return cached
        pos_of = {leaf: p for p, leaf in enumerate(self.torch_idx)} if self.torch_idx is not None else None
        sizes = [d.nbytes for d in self.dsts]

        def group(part: int, end: int, dsts: list[torch.Tensor], positions: list[int]) -> _Group:
            small = sum(1 for p in positions if sizes[p] < SMALL_TENSOR_BYTES)
            if threads < 2 or small < PIPELINE_SPLIT_MIN_TENSORS:
                return _Group(part, end, dsts, positions)
            runs = _balanced_runs(positions, sizes, threads)
            return _Group(part, end, dsts, positions, [(run, [self.dsts[q] for q in run]) for run in runs])

        per_file: list[list[_Group]] = []
        for f in self.plan.files:
            groups: list[_Group] = []
            dsts: list[torch.Tensor] = []
            positions: list[int] = []
            size = 0
            for t in f.tensors:
                pos = t.leaf if pos_of is None else pos_of.get(t.leaf)
                if pos is not None and t.nbytes > PIPELINE_GROUP_BYTES:
                    if positions:
                        groups.append(group(f.part, t.offset, dsts, positions))
                        dsts, positions, size = [], [], 0
                    flat_dst = self.dsts[pos].view(-1)
                    step = max(1, PIPELINE_GROUP_BYTES // flat_dst.element_size())
                    for lo in range(0, flat_dst.numel(), step):
                        hi = min(flat_dst.numel(), lo + step)
                        end = t.offset + hi * flat_dst.element_size()
                        groups.append(_Group(f.part, end, [], [], None, (pos, lo, hi, flat_dst[lo:hi])))
                    continue
                if pos is not None:
                    dsts.append(self.dsts[pos])
                    positions.append(pos)
                    size += t.nbytes
                if size >= PIPELINE_GROUP_BYTES:
                    groups.append(group(f.part, t.offset + t.nbytes, dsts, positions))
                    dsts, positions, size = [], [], 0
            if positions or not groups or groups[-1].end != f.size:
                groups.append(group(f.part, f.size, dsts, positions))
            per_file.append(groups)
        order: list[_Group] = []
        for w in range(0, len(per_file), max(1, waves)):
            wave = per_file[w : w + max(1, waves)]
            for k in range(max(len(g) for g in wave)):
                order.extend(g[k] for g in wave if k < len(g))
        self.pipelines[(waves, threads)] = order
        return order

    def schedule(self, threads: int) -> _CopySchedule:
        sched = self.schedules.get(threads)
        if sched is None:
            sched = self.schedules[threads] = self._make_schedule(threads)
        return sched

    def _make_schedule(self, threads: int) -> _CopySchedule:
        sizes = [d.nbytes for d in self.dsts]
        small = [p for p, n in enumerate(sizes) if n < SMALL_TENSOR_BYTES]
        if threads < 2 or len(small) <= THREADED_MIN_TENSORS:
            return _CopySchedule(None, [], [])
        large = [p for p, n in enumerate(sizes) if n >= SMALL_TENSOR_BYTES]
        chunks = [(run, [self.dsts[q] for q in run]) for run in _balanced_runs(small, sizes, threads)]
        return _CopySchedule(chunks, large, [self.dsts[p] for p in large])


def _balanced_runs(positions: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    """``positions`` cut into at most ``parts`` contiguous runs of about equal cost (bytes plus a fixed cost per
    tensor); neighbours in the leaf order are neighbours in the buffer."""
    total = sum(sizes[p] + _TENSOR_COST_BYTES for p in positions)
    runs: list[list[int]] = []
    run: list[int] = []
    done = 0
    for p in positions:
        run.append(p)
        done += sizes[p] + _TENSOR_COST_BYTES
        if done * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs


def _slot_layout(slot: Slot, plan: SnapshotPlan, locations: list[tuple[int, int]], kinds: list[str]) -> _SlotLayout:
    layout = slot._views_for
    if isinstance(layout, _SlotLayout) and layout.plan is plan and layout.kinds == kinds:
        return layout
    sig = plan.signature
    views: list[torch.Tensor | np.ndarray] = []
    for i, kind in enumerate(kinds):
        spec = sig[i]
        raw = slot.raw_leaf(plan, locations, i)
        if kind == "numpy":
            views.append(raw.numpy().view(CODE_TO_NUMPY[spec.dtype]).reshape(spec.shape))
        elif spec.nbytes == 0:
            views.append(raw)
        else:
            views.append(raw.view(CODE_TO_TORCH[spec.dtype]).view(spec.shape))
    layout = _SlotLayout(plan, list(kinds), views)
    slot._views_for, slot._views = layout, views
    return layout


def destination_views(slot: Slot, plan: SnapshotPlan, locations: list[tuple[int, int]],
                      kinds: list[str]) -> list[torch.Tensor | np.ndarray]:
    """Typed views into the slot for every leaf (cached while the plan, the leaves' kinds and the buffer stay)."""
    return _slot_layout(slot, plan, locations, kinds).views


def overlap_pays(writers: int) -> bool:
    """Whether to write while copying (the ``overlap_writes=None`` rule).

    With the native streaming copy (:mod:`.hostcopy`), always: it needs fewer cycles for the same bytes and, with
    the pipeline's large groups, the writes lengthened it by 5% on 2 cores while the state was durable 8% sooner
    (12 A/B pairs; 11-24% and 8-14% in two benchmark runs, where both stayed inside their 1.1x targets).
    With torch's ``copy_``, only when this process may use as many cores as torch's copy threads and ``writers``
    together. On fewer, the writes' kernel work takes cores from the copy that training waits for (2 cores, 2 GiB:
    3-15% longer stall for a 4-13% earlier durable checkpoint)."""
    if hostcopy.available:
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return cores >= torch.get_num_threads() + writers


def copy_into(slot: Slot, plan: SnapshotPlan, locations: list[tuple[int, int]], flat: FlatState,
              *, copy_stream: object | None = None, executor: Executor | None = None,
              progress: CopyProgress | None = None, waves: int = 1) -> None:
    """Copy the headers and every leaf's bytes into ``slot``; returns when the bytes are in host memory.

    ``executor``: threads for copying many small host tensors in parallel (see :data:`THREADED_MIN_TENSORS` and
    :data:`PIPELINE_SPLIT_MIN_TENSORS`).
    ``progress``: advanced group by group as the bytes land (pipelined, ``waves`` files at a time) when every leaf
    is a host tensor. The caller then finishes it, or fails it on error.
    """
    assert slot.buffer is not None
    buf = slot.buffer
    if slot._headers_for is not plan:  # headers depend on the plan only
        for f in plan.files:
            hdr = torch.frombuffer(bytearray(f.header), dtype=torch.uint8)
            buf[f.buffer_offset : f.buffer_offset + len(f.header)].copy_(hdr)
        slot._headers_for = plan
    layout = _slot_layout(slot, plan, locations, flat.kinds)
    values = flat.values
    for i in layout.numpy_idx:
        src = values[i]
        np.copyto(layout.views[i], src, casting="no" if src.dtype.isnative else "equiv")  # type: ignore[arg-type]
    srcs = values if layout.torch_idx is None else list(map(values.__getitem__, layout.torch_idx))
    dsts = layout.dsts
    if not flat.all_cpu:  # device tensors: device-to-host on the copy stream, the others in one call
        if any(s.is_cuda for s in srcs):
            _copy_from_devices([(d, s) for d, s in zip(dsts, srcs) if s.is_cuda], copy_stream)
            pairs = [(d, s) for d, s in zip(dsts, srcs) if not s.is_cuda]
            dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
        _copy_tensors(dsts, srcs)
        return
    threads = min(MAX_COPY_THREADS, torch.get_num_threads()) if executor is not None else 1
    native = hostcopy.available  # one native call per batch splits its bytes over threads: no chunks needed
    pick = srcs.__getitem__
    if progress is not None:
        for g in layout.pipeline(waves, 1 if native else threads):
            if g.piece is not None:
                _copy_piece(g.piece, layout.dsts, pick)
            elif g.chunks is None:
                _copy_tensors(g.dsts, list(map(pick, g.positions)), g.batch)
            else:
                assert executor is not None
                _copy_split(executor, g.chunks[1:], g.chunks[0], pick)
            progress.advance(g.part, g.end)
        return
    sched = layout.schedule(1 if native else threads)
    if sched.chunks is None:
        _copy_tensors(dsts, srcs, layout.batch)
        return
    assert executor is not None
    _copy_split(executor, sched.chunks, (sched.large_pos, sched.large_dsts), pick)


def _copy_piece(piece: tuple[int, int, int, torch.Tensor], dsts: list[torch.Tensor],
                pick: Callable[[int], torch.Tensor]) -> None:
    """Copy elements ``lo:hi`` of a large source; a strided source is copied whole with its first piece."""
    pos, lo, hi, dst = piece
    src = pick(pos)
    if src.is_contiguous():
        with torch.no_grad():
            part = src.view(-1)[lo:hi]
        _copy_tensors([dst], [part])
    elif lo == 0:
        _copy_tensors([dsts[pos]], [src])


def _copy_split(executor: Executor, others: list[tuple[list[int], list[torch.Tensor]]],
                own: tuple[list[int], list[torch.Tensor]], pick: Callable[[int], torch.Tensor]) -> None:
    """Copy ``others`` (source positions, destinations) on the executor's threads and ``own`` on this one."""
    futures: list[Future[Any]] = []
    try:
        for pos, d in others:
            futures.append(executor.submit(_copy_tensors, d, list(map(pick, pos))))
        _copy_tensors(own[1], list(map(pick, own[0])))
    finally:
        wait_futures(futures)  # never return (and let the slot go) while a thread still writes into it
    for fut in futures:
        fut.result()


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i without autograd, in one C++ call when there are several (restore's
    batch copy into live tensors uses it too)."""
    _copy_tensors(dsts, srcs)


def _copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                  batch: Callable[[], hostcopy.Batch] | None = None) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i (both release the GIL): with the native copy (:mod:`.hostcopy`), all
    in one call on ``batch()``'s fixed destinations when every source is plain, else the plain ones of 1 MiB or more
    one by one; the rest in one torch C++ call when there are several."""
    if hostcopy.available and dsts:
        if batch is not None and hostcopy.copy_batch(batch(), srcs):
            return
        dsts, srcs = hostcopy.copy_pairs(dsts, srcs)
    if not dsts:
        return
    with torch.no_grad():  # grad mode is per thread: the copy threads need it too
        if _FOREACH_COPY is not None and len(dsts) > 8:
            _FOREACH_COPY(dsts, srcs)
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s)


def _copy_from_devices(pairs: list[tuple[torch.Tensor, torch.Tensor]], copy_stream: object | None) -> None:
    """Device -> pinned host copies on a side stream that first waits for the producer's stream."""
    if not torch.cuda.is_available() or copy_stream is None:
        with torch.no_grad():
            for d, s in pairs:
                d.copy_(s)
        return
    stream = copy_stream
    assert isinstance(stream, torch.cuda.Stream)
    devices = {s.device for _, s in pairs}
    for dev in devices:
        stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.no_grad(), torch.cuda.stream(stream):
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
    stream.synchronize()


__all__ = ["CopyProgress", "StagingFailed", "StagingPool", "Slot", "aligned_empty", "copy_into", "copy_tensors",
           "leaf_locations", "destination_views"]
