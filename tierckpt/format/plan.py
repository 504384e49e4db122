"""Where each tensor goes: the layout of a rank's data files, computed once per state signature and reused.

A plan splits the tensors over files (balanced by bytes, largest first, so several writer threads and reader threads
have equal work), orders each file's tensors by decreasing element size (so every tensor starts aligned to its
element size without gaps, which safetensors forbids), and precomputes every file's header. The plan depends only on
the tensors' names, dtypes and shapes, so a training loop that saves the same state every time plans once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .dtypes import ITEMSIZE
from .safetensors import ALIGN, build_header

HEADER_METADATA = {"format": "pt", "producer": "tierckpt"}
#: Below this many bytes a state is written as one file: splitting would only add overhead.
MIN_SPLIT_BYTES = 64 << 20


class LeafSpec(NamedTuple):
    """What the planner needs to know about one tensor (a tuple: comparing two states' signatures runs in C)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PlannedTensor:
    leaf: int  # index into the snapshot's leaves
    offset: int  # absolute byte offset in its file
    nbytes: int


@dataclass(frozen=True)
class PlannedFile:
    part: int
    header: bytes
    size: int
    tensors: tuple[PlannedTensor, ...]
    buffer_offset: int  # where this file's image starts in the staging buffer

    @property
    def data_start(self) -> int:
        return len(self.header)


@dataclass(frozen=True)
class SnapshotPlan:
    files: tuple[PlannedFile, ...]
    buffer_bytes: int
    signature: tuple[LeafSpec, ...]
    #: Scratch space for data derived from this plan (and validated before each reuse) that the saver keeps between
    #: saves of the same state, so that a steady-state save rebuilds nothing per tensor. Not part of the plan's value.
    cache: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def make_plan(leaves: Sequence[LeafSpec], *, file_bytes: int, min_files: int = 1) -> SnapshotPlan:
    total = sum(leaf.nbytes for leaf in leaves)
    n = -(-total // file_bytes) if file_bytes > 0 else 1
    if total >= MIN_SPLIT_BYTES:
        # a multiple of the writer threads, so that no thread is left with one file more than the others
        n = -(-max(n, min_files) // min_files) * min_files
    n = max(1, min(n, len(leaves)))
    # Longest-processing-time-first: each tensor to the currently lightest file.
    heap = [(0, part) for part in range(n)]
    members: list[list[int]] = [[] for _ in range(n)]
    for idx in sorted(range(len(leaves)), key=lambda i: -leaves[i].nbytes):
        load, part = heapq.heappop(heap)
        members[part].append(idx)
        heapq.heappush(heap, (load + leaves[idx].nbytes, part))
    files: list[PlannedFile] = []
    buffer_offset = 0
    for part, idxs in enumerate(members):
        if not idxs and part > 0:
            continue
        idxs.sort(key=lambda i: (-ITEMSIZE[leaves[i].dtype], i))
        header = build_header(
            [(leaves[i].name, leaves[i].dtype, leaves[i].shape, leaves[i].nbytes) for i in idxs], HEADER_METADATA
        )
        offset = len(header)
        planned = []
        for i in idxs:
            planned.append(PlannedTensor(i, offset, leaves[i].nbytes))
            offset += leaves[i].nbytes
        files.append(PlannedFile(len(files), header, offset, tuple(planned), buffer_offset))
        buffer_offset += -(-offset // ALIGN) * ALIGN
    return SnapshotPlan(tuple(files), buffer_offset, tuple(leaves))
