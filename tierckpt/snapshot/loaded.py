"""A restore's loaded bytes, seen from the state: typed tensor views of the records (:func:`tensor_view_factory`),
their address ranges for the native copy into live tensors (:class:`LoadedBuffer`), and writable byte views of the
live tensors an in-place restore reads straight into (:func:`byte_view`).

Invariants: every view and range lies inside the loaded buffer (torch bounds-checks ``as_strided``;
:meth:`LoadedBuffer.ranges` checks each range against the buffer's size and returns None on any doubt); a byte view
is exactly its tensor's bytes and borrows its memory, so the tensor must outlive it.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..format.manifest import TensorRecord
from .dtypes import CODE_TO_TORCH

TensorSource = Callable[[int], torch.Tensor]
_FILE, _OFFSET, _NBYTES = operator.attrgetter("file"), operator.attrgetter("offset"), operator.attrgetter("nbytes")


@dataclass(frozen=True)
class LoadedBuffer:
    """Where a restore's loaded bytes lie: file ``f``'s image from byte ``file_starts[f]`` of ``buffer`` (uint8, in
    host memory), except the records in ``skip`` (read straight into live tensors)."""

    buffer: torch.Tensor
    file_starts: tuple[int, ...]
    skip: frozenset[int] = frozenset()

    def bytes_of(self, rec: TensorRecord) -> torch.Tensor:
        """The record's bytes in the buffer, as a uint8 slice (torch bounds the slice by the buffer)."""
        start = self.file_starts[rec.file] + rec.offset
        return self.buffer[start : start + rec.nbytes]

    def ranges(self, records: tuple[TensorRecord, ...], idx: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(addresses, lengths) of the bytes of records ``idx``, bounds-checked against the buffer; None when one of
        them is not in it."""
        buf = self.buffer
        if not self.skip.isdisjoint(idx) or not buf.is_cpu or buf.dtype != torch.uint8 or not buf.is_contiguous():
            return None
        recs = list(map(records.__getitem__, idx))
        n = len(recs)
        files = np.fromiter(map(_FILE, recs), dtype=np.int64, count=n)
        offsets = np.fromiter(map(_OFFSET, recs), dtype=np.uint64, count=n)
        lengths = np.fromiter(map(_NBYTES, recs), dtype=np.uint64, count=n)
        starts = np.array(self.file_starts, dtype=np.uint64)
        if n and (files.min() < 0 or files.max() >= len(starts)):
            return None
        pos = starts[files] + offsets
        if n and (pos + lengths > np.uint64(buf.numel())).any():
            return None
        return pos + np.uint64(buf.data_ptr()), lengths


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of the bytes of ``t`` (a contiguous host tensor, which must outlive the view), made from its
    address: no tensor views (a reshape, a dtype view and ``numpy()`` cost about 6 us a tensor, 60 ms for the
    10,000 targets of an in-place restore; this costs under 2 us)."""
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def tensor_view_factory(records: tuple[TensorRecord, ...], raw: Callable[[int], torch.Tensor], *,
                        buffer: torch.Tensor | None = None, file_starts: tuple[int, ...] = (),
                        skip: frozenset[int] = frozenset()) -> TensorSource:
    """Typed, shaped views over each leaf's loaded bytes (``raw(i)``: record ``i``'s bytes, uint8).

    With ``buffer`` (the uint8 buffer every file was loaded into, file ``f`` from byte ``file_starts[f]``), a view
    of a record not in ``skip`` is made in one step from a typed view of the whole buffer (``as_strided``, whose
    bounds torch checks): a slice and two views cost about seven times as much, which shows at 10,000 tensors.
    """
    typed: dict[str, torch.Tensor | None] = {}

    def get(i: int) -> torch.Tensor:
        rec = records[i]
        if rec.kind == "numpy":
            return raw(i)
        dtype = CODE_TO_TORCH[rec.dtype]
        if rec.nbytes == 0:
            return torch.empty(rec.shape, dtype=dtype)
        if buffer is not None and i not in skip:
            if rec.dtype not in typed:
                typed[rec.dtype] = _typed_view(buffer, dtype)
            base, start = typed[rec.dtype], file_starts[rec.file] + rec.offset
            if base is not None and start % dtype.itemsize == 0:
                # as_strided counts from the start of the storage, not of the view
                return base.as_strided(rec.shape, _contiguous_strides(rec.shape),
                                       base.storage_offset() + start // dtype.itemsize)
        return raw(i).view(dtype).view(rec.shape)

    return get


def _typed_view(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``buffer`` (uint8) seen as ``dtype`` elements, or None if its start is not aligned to them."""
    size = dtype.itemsize
    if buffer.storage_offset() % size:
        return None
    return buffer[: buffer.numel() - buffer.numel() % size].view(dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)
