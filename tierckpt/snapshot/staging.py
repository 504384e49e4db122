"""Reusable host staging buffers and the copy of a state into them.

Memory budget: ``slots`` buffers, each as large as one snapshot (all of one rank's data files, headers included,
rounded up to 4 KiB per file). ``save()`` takes a free slot and copies into it; the slot comes back when the local
tier has made that snapshot durable. With one slot (the default) a save that arrives while the previous one is still
being written waits for it (back-pressure) rather than allocating more memory; two slots let one save be copied while
the previous is written, at twice the memory.

Buffers are allocated on first use, grown only when a state grows, and otherwise reused forever, so a steady-state
save allocates nothing large. They are pinned (page-locked) when CUDA is available, so device-to-host copies run at
full PCIe/NVLink bandwidth on a dedicated copy stream without blocking the training stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CheckpointError
from ..format.plan import SnapshotPlan
from .dtypes import CODE_TO_NUMPY, CODE_TO_TORCH
from .tree import Leaf

log = logging.getLogger(__name__)

#: Grow buffers in steps of this many bytes so that a state growing a little does not reallocate every time.
GROWTH_QUANTUM = 64 << 20
#: Buffers start on this boundary (a page; what ``O_DIRECT`` needs), and so does every file image in them.
BUFFER_ALIGN = 4096


@dataclass(eq=False)
class Slot:
    index: int
    buffer: torch.Tensor | None = None  # uint8, 1-D
    # views cached per plan: (plan id) -> list of destination views, one per leaf
    _views_for: object = None
    _views: list[torch.Tensor | np.ndarray] = field(default_factory=list)
    _headers_for: object = None
    _torch_idx: list[int] = field(default_factory=list)
    _numpy_idx: list[int] = field(default_factory=list)
    _torch_dsts: list[torch.Tensor] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def file_view(self, plan: SnapshotPlan, part: int) -> memoryview:
        f = plan.files[part]
        assert self.buffer is not None
        return memoryview(self.buffer[f.buffer_offset : f.buffer_offset + f.size].numpy())

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

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> Slot:
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
        return slot

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

    def close(self) -> None:
        with self._cond:
            for s in self._slots:
                s.buffer, s._views_for, s._views, s._headers_for = None, None, [], None


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


def destination_views(slot: Slot, plan: SnapshotPlan, locations: list[tuple[int, int]], leaves: list[Leaf]):
    """Typed views into the slot for every leaf (cached while the plan and buffer stay the same)."""
    if slot._views_for is plan:
        return slot._views
    views: list[torch.Tensor | np.ndarray] = []
    for i, leaf in enumerate(leaves):
        raw = slot.raw_leaf(plan, locations, i)
        if leaf.kind == "numpy":
            views.append(raw.numpy().view(CODE_TO_NUMPY[leaf.dtype]).reshape(leaf.shape))
        elif leaf.nbytes == 0:
            views.append(raw)
        else:
            views.append(raw.view(CODE_TO_TORCH[leaf.dtype]).view(leaf.shape))
    slot._views_for, slot._views = plan, views
    slot._torch_idx = [i for i, leaf in enumerate(leaves) if leaf.kind == "torch" and leaf.nbytes]
    slot._numpy_idx = [i for i, leaf in enumerate(leaves) if leaf.kind == "numpy" and leaf.nbytes]
    slot._torch_dsts = [views[i] for i in slot._torch_idx]
    return views


def copy_into(slot: Slot, plan: SnapshotPlan, locations: list[tuple[int, int]], leaves: list[Leaf],
              *, copy_stream: object | None = None) -> None:
    """Copy the headers and every leaf's bytes into ``slot``; returns when the bytes are in host memory."""
    assert slot.buffer is not None
    buf = slot.buffer
    if slot._headers_for is not plan:  # headers depend on the plan only
        for f in plan.files:
            hdr = torch.frombuffer(bytearray(f.header), dtype=torch.uint8)
            buf[f.buffer_offset : f.buffer_offset + len(f.header)].copy_(hdr)
        slot._headers_for = plan
    views = destination_views(slot, plan, locations, leaves)
    torch_idx = slot._torch_idx
    srcs = [leaves[i].value for i in torch_idx]
    dsts = slot._torch_dsts
    for i in slot._numpy_idx:
        leaf = leaves[i]
        np.copyto(views[i], leaf.value, casting="no" if leaf.value.dtype.isnative else "equiv")  # type: ignore[arg-type]
    if any(s.is_cuda for s in srcs):
        cuda = [(d, s) for d, s in zip(dsts, srcs) if s.is_cuda]
        _copy_from_devices(cuda, copy_stream)
        pairs = [(d, s) for d, s in zip(dsts, srcs) if not s.is_cuda]
        dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
    if dsts:
        with torch.no_grad():
            if hasattr(torch, "_foreach_copy_") and len(dsts) > 8:
                torch._foreach_copy_(dsts, srcs)
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


__all__ = ["StagingPool", "Slot", "aligned_empty", "copy_into", "leaf_locations", "destination_views"]
