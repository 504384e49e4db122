"""The copy of a state into a staging slot (:mod:`.staging` owns the slot's memory and the watermarks).

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

import os
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
import torch

from ..format.plan import SnapshotPlan
from . import hostcopy
from .dtypes import CODE_TO_NUMPY, CODE_TO_TORCH
from .staging import MAX_COPY_THREADS, CopyProgress, Slot
from .tree import FlatState

#: Host tensors below this size are "small": their copy costs more per tensor than per byte.
SMALL_TENSOR_BYTES = 1 << 20
#: Small tensors are split over threads only when there are more of them than this (below, the hand-off to
#: other threads costs about what it saves).
THREADED_MIN_TENSORS = 256
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


class _Destinations:
    """Destination views (``dsts``) that the native copy fills as one :class:`hostcopy.Batch`, read on first use."""

    __slots__ = ("dsts", "_batch")

    def batch(self) -> hostcopy.Batch:
        batch = getattr(self, "_batch", None)
        if batch is None:
            batch = self._batch = hostcopy.Batch(self.dsts)
        return batch


class _Group(_Destinations):
    """One step of a pipelined copy, after which file ``part``'s watermark rises to ``end``: either whole tensors
    (``positions`` into the layout's sources and their ``dsts``), cut into ``chunks`` (positions, destinations) for
    the copy threads when there are many small ones, or one ``piece`` of a tensor larger than a group (position,
    first and last element, destination view of those elements)."""

    __slots__ = ("part", "end", "positions", "chunks", "piece", "_index")

    def __init__(self, part: int, end: int, dsts: list[torch.Tensor], positions: list[int],
                 chunks: list[tuple[list[int], list[torch.Tensor]]] | None = None,
                 piece: tuple[int, int, int, torch.Tensor] | None = None) -> None:
        self.part, self.end, self.dsts, self.positions = part, end, dsts, positions
        self.chunks, self.piece = chunks, piece
        self._index: np.ndarray | None = None

    def index(self) -> np.ndarray:
        """``positions`` as an index array (to pick this group's source addresses out of all of them)."""
        if self._index is None:
            self._index = np.array(self.positions, dtype=np.intp)
        return self._index


class _CopySchedule:
    """How one plan's host tensors are copied with ``threads`` threads: ``chunks`` of small tensors for the copy
    threads (None: no threads, one call copies everything) and the large ones for the calling thread. Positions
    index the list of sources of :class:`_SlotLayout`."""

    __slots__ = ("chunks", "large_pos", "large_dsts")

    def __init__(self, chunks: list[tuple[list[int], list[torch.Tensor]]] | None, large_pos: list[int],
                 large_dsts: list[torch.Tensor]) -> None:
        self.chunks, self.large_pos, self.large_dsts = chunks, large_pos, large_dsts


class _SlotLayout(_Destinations):
    """Typed views into a slot for every leaf of one plan, and the copy derived from them (built once per plan)."""

    __slots__ = ("plan", "kinds", "views", "torch_idx", "numpy_idx", "schedules", "pipelines", "file_views",
                 "_torch_index")

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
        self._torch_index = None if self.torch_idx is None else np.array(self.torch_idx, dtype=np.intp)

    def source_addresses(self, ptrs: list[int]) -> np.ndarray:
        """The data pointers of the sources (the non-empty tensor leaves), out of every leaf's ``ptrs``."""
        addr = np.array(ptrs, dtype=np.uint64)
        return addr if self._torch_index is None else addr[self._torch_index]

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
              progress: CopyProgress | None = None, waves: int = 1, layout_checked: bool = False) -> None:
    """Copy the headers and every leaf's bytes into ``slot``; returns when the bytes are in host memory.

    ``executor``: threads for copying many small host tensors in parallel (see :data:`THREADED_MIN_TENSORS` and
    :data:`PIPELINE_SPLIT_MIN_TENSORS`).
    ``progress``: advanced group by group as the bytes land (pipelined, ``waves`` files at a time) when every leaf
    is a host tensor. The caller then finishes it, or fails it on error.
    ``layout_checked``: ``flat`` was flattened just now, on this thread, with no user code run since, and
    ``flat.specs`` equal ``plan.signature``; so every value still has the device, dtype and shape the plan was made
    for at the addresses in ``flat.ptrs``; the native copy reuses those and reads only the lazy bits and
    contiguity (see :func:`hostcopy.copy_batch`). A lazy snapshot, which copies later while training runs, passes
    False: there every attribute is read again.
    """
    assert slot.buffer is not None
    if layout_checked and flat.specs is not plan.signature and flat.specs != plan.signature:
        raise ValueError("copy_into(layout_checked=True) with a state flattened for another plan")
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
    native = hostcopy.available  # one native call per batch splits its bytes over threads: no chunks needed
    threads = min(MAX_COPY_THREADS, torch.get_num_threads()) if executor is not None and not native else 1
    pick = srcs.__getitem__
    # the flatten just read every source's address: the native copy reuses them (one pass over 10,000 tensors less)
    addr = layout.source_addresses(flat.ptrs) if layout_checked and native and len(flat.ptrs) == len(values) \
        else None
    if progress is not None:
        for g in layout.pipeline(waves, threads):
            if g.piece is not None:
                _copy_piece(g.piece, layout.dsts, pick)
            elif g.chunks is None:
                _copy_tensors(g.dsts, list(map(pick, g.positions)), g.batch, layout_checked,
                              None if addr is None else addr[g.index()])
            else:
                assert executor is not None
                _copy_split(executor, g.chunks[1:], g.chunks[0], pick)
            progress.advance(g.part, g.end)
        return
    sched = layout.schedule(threads)
    if sched.chunks is None:
        _copy_tensors(dsts, srcs, layout.batch, layout_checked, addr)
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
                  batch: Callable[[], hostcopy.Batch] | None = None, layout_checked: bool = False,
                  src_addr: np.ndarray | None = None) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i (both release the GIL): with the native copy (:mod:`.hostcopy`), all
    in one call on ``batch()``'s fixed destinations when every source is plain (``layout_checked`` and the sources'
    addresses ``src_addr``: see :func:`copy_into`), else the plain ones of 1 MiB or more one by one; the rest in one
    torch C++ call when there are several."""
    if hostcopy.available and dsts:
        if batch is not None and hostcopy.copy_batch(batch(), srcs, layout_checked=layout_checked,
                                                         src_addr=src_addr):
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


__all__ = ["copy_into", "copy_tensors", "destination_views", "overlap_pays"]
