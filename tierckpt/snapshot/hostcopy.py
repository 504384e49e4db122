"""Host-to-host tensor copies with streaming stores, split over threads (the snapshot's copy of host tensors).

Why: storing into memory that is not in the cache first reads each line (read for ownership), so a plain copy into
a cold buffer moves three bytes of memory traffic per byte copied. A snapshot's staging buffer is far larger than any
cache and nothing reads it back soon (the writers hand it to the disk), so non-temporal (streaming) stores, which
skip the cache and that read, move two: a 2 GiB state of 592 tensors copied in 0.64x the time of torch's ``copy_``
on this project's 2-core VM. glibc streams only copies larger than about 3/4 of the shared cache, and torch's
``copy_`` never does.

The copying is the optional C extension :mod:`tierckpt.host._hostcopy` (``tierckpt/host/_hostcopy.c``). Where it was not
built (no compiler at install time) :data:`available` is False and every caller falls back to ``copy_``; where the
CPU is not x86-64 it copies with ``memcpy`` on the same threads.

Three entry points: :func:`copy_batch` copies a whole list of sources into fixed destinations (a staging slot's
views, read once into a :class:`Batch`) or nothing, checking the sources in one C-level pass per attribute;
:func:`copy_from_addresses` copies ranges of a buffer (a restore's loaded bytes) into a list of live tensors or
nothing; :func:`copy_pairs` takes the large plain pairs out of any list one by one.

Invariants: bytes are written only into contiguous CPU tensors with no lazy conjugate or negative bit, and read
only from plain CPU tensors of the destination's dtype and shape (of at least :data:`MIN_BYTES` in
:func:`copy_pairs`) or from address ranges the caller vouches for; everything else goes back to the caller. The
ranges of one call are copied in no set order, so :func:`copy_from_addresses` refuses overlapping destinations
(a batch's are a slot's views, which never overlap; :func:`copy_pairs` leaves it to its caller). Every call returns
once every byte is copied and fenced, so a thread that synchronises with the caller afterwards (a writer woken by a
watermark, a joined future) reads the new bytes.
"""

from __future__ import annotations

import os
from itertools import compress
from operator import attrgetter

import numpy as np
import torch

try:
    from ..host import _hostcopy
except ImportError:  # not built: the callers use torch's copy_
    _hostcopy = None

#: Whether the native copy can be used (``TIERCKPT_HOSTCOPY=0`` turns it off, for comparison and as an escape hatch).
available: bool = _hostcopy is not None and os.environ.get("TIERCKPT_HOSTCOPY", "1") != "0"
#: Whether the native copy uses streaming stores on this CPU (False: ``memcpy`` split over threads).
streaming: bool = bool(_hostcopy is not None and _hostcopy.streaming())
#: At most this many threads copy at once (memory bandwidth runs out long before cores do on large hosts).
MAX_THREADS = 8
#: :func:`copy_pairs` leaves smaller tensors to torch's ``_foreach_copy_``: its checks cost about a microsecond of
#: Python a pair, more than streaming saves on a small tensor (10,000 tensors of 26 KiB, all through it: 72 ms a
#: save against 58 ms with torch). :func:`copy_batch` takes every size: its checks are a pass per attribute.
MIN_BYTES = 1 << 20
_NBYTES = attrgetter("nbytes")
_CPU = torch.device("cpu")


def _addresses(a: np.ndarray, n: int) -> bool:
    """Whether ``a`` is what the native call takes for ``n`` ranges: ``n`` uint64 values in one dimension."""
    return a.dtype == np.uint64 and a.shape == (n,)


def default_threads() -> int:
    """Threads for one copy: torch's intra-op thread count (what ``copy_`` would use), at most :data:`MAX_THREADS`."""
    return max(1, min(MAX_THREADS, torch.get_num_threads()))


def eligible(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` is a plain byte copy this module may do instead."""
    return (
        src.device == _CPU
        and dst.device == _CPU
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and not dst.is_conj()
        and not dst.is_neg()
    )


def copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, threads: int | None = None,
               min_bytes: int = MIN_BYTES) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy every eligible ``srcs[i]`` of at least ``min_bytes`` into ``dsts[i]`` natively; return the pairs left
    for ``copy_`` (all of them when the extension is unavailable).

    ``dsts`` must not overlap each other or ``srcs`` (staging buffers and live tensors never do).
    """
    if not available or not dsts:
        return dsts, srcs
    sizes = list(map(_NBYTES, srcs))
    if max(sizes) < min_bytes:  # nothing to take (thousands of small tensors: one pass, no per-pair checks)
        return dsts, srcs
    if min(sizes) >= min_bytes:
        big_d, big_s, big_n, rest_d, rest_s = dsts, srcs, sizes, [], []
    else:  # the per-pair checks below only for the large ones (a few among thousands of small ones)
        small = [n < min_bytes for n in sizes]
        large = [not x for x in small]
        big_d, big_s, big_n = list(compress(dsts, large)), list(compress(srcs, large)), list(compress(sizes, large))
        rest_d, rest_s = list(compress(dsts, small)), list(compress(srcs, small))
    daddr: list[int] = []
    saddr: list[int] = []
    lens: list[int] = []
    for d, s, n in zip(big_d, big_s, big_n, strict=True):
        if eligible(d, s):
            daddr.append(d.data_ptr())
            saddr.append(s.data_ptr())
            lens.append(n)
        else:
            rest_d.append(d)
            rest_s.append(s)
    if lens:
        assert _hostcopy is not None
        _hostcopy.copy(np.array(daddr, dtype=np.uint64), np.array(saddr, dtype=np.uint64),
                       np.array(lens, dtype=np.uint64), default_threads() if threads is None else threads, True)
    return rest_d, rest_s


_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_CONJ = torch.Tensor.is_conj
_IS_NEG = torch.Tensor.is_neg
_IS_CPU = attrgetter("is_cpu")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


class Batch:
    """Fixed destinations copied into again and again (a staging slot's views for one plan): their addresses,
    sizes, dtypes and shapes, read once. The destinations must stay alive and unmoved while the batch is used."""

    __slots__ = ("dst_addr", "lengths", "sizes", "dtypes", "shapes", "complex")

    def __init__(self, dsts: list[torch.Tensor]) -> None:
        if not all(eligible(d, d) for d in dsts):
            raise ValueError("batch destinations must be contiguous CPU tensors without lazy conjugate/negative bits")
        self.dst_addr = np.fromiter(map(_PTR, dsts), dtype=np.uint64, count=len(dsts))
        self.sizes = list(map(_NBYTES, dsts))
        self.lengths = np.array(self.sizes, dtype=np.uint64)
        self.dtypes = list(map(_DTYPE, dsts))
        self.shapes = list(map(_SHAPE, dsts))
        # torch sets the lazy conjugate bit on complex tensors only (an internal assert in TensorImpl): a source of
        # a destination's dtype can carry it only where some destination is complex
        self.complex = any(d.is_complex for d in set(self.dtypes))


def copy_batch(batch: Batch, srcs: list[torch.Tensor], *, threads: int | None = None,
               layout_checked: bool = False, src_addr: np.ndarray | None = None) -> bool:
    """Copy ``srcs[i]`` into the batch's i-th destination for every i, in one native call, when every source is a
    contiguous CPU tensor with no lazy bits and of the destination's dtype and shape; else copy nothing, return False.

    For the thousands of small tensors of a large model, where :func:`copy_pairs` would cost more per tensor than it
    saves: the checks here are one C-level pass over the sources per attribute (0.1-0.2 us a tensor each).

    ``layout_checked``: the caller has just read every source's device, dtype and shape and found them equal to the
    destinations' (a save's flatten compares them with its plan, and no user code runs between it and the copy), so
    only contiguity and the lazy bits are read here: two passes instead of eight (10,000 tensors: about 10 ms
    less a save on the reference VM). ``src_addr``: the sources' data pointers (uint64), read by the caller along
    with their layout. A wrong promise can make the copy read past a source's memory.
    """
    if not available or len(srcs) != len(batch.sizes):
        return False
    if not layout_checked and (
            list(map(_NBYTES, srcs)) != batch.sizes or list(map(_DTYPE, srcs)) != batch.dtypes
            or list(map(_SHAPE, srcs)) != batch.shapes or not all(map(_IS_CPU, srcs))):
        return False
    if not all(map(_CONTIGUOUS, srcs)) or any(map(_IS_NEG, srcs)) or (batch.complex and any(map(_IS_CONJ, srcs))):
        return False
    if not srcs:
        return True
    assert _hostcopy is not None
    if src_addr is None:
        saddr = np.fromiter(map(_PTR, srcs), dtype=np.uint64, count=len(srcs))
    elif not _addresses(src_addr, len(srcs)):
        raise ValueError(f"src_addr must be {len(srcs)} uint64 addresses, got {src_addr.dtype} {src_addr.shape}")
    else:
        saddr = src_addr
    _hostcopy.copy(batch.dst_addr, saddr, batch.lengths, default_threads() if threads is None else threads, True)
    return True


def copy_from_addresses(dsts: list[torch.Tensor], src_addr: np.ndarray, lengths: np.ndarray, *,
                        threads: int | None = None) -> bool:
    """Copy ``lengths[i]`` bytes from address ``src_addr[i]`` into ``dsts[i]`` for every i, in one native call, when
    every destination is a contiguous CPU tensor of exactly that many bytes with no lazy bits and no two destinations
    overlap; else copy nothing and return False (the caller then copies with torch).

    For a restore's copy out of its loaded buffer into thousands of live tensors: the sources need no tensor views
    (10,000 of them cost about 40 ms). The caller vouches for the sources: ``lengths[i]`` readable bytes at each
    address (ranges of the buffer it bounds-checked), none inside a destination.
    """
    n = len(dsts)
    if not available or not _addresses(src_addr, n) or not _addresses(lengths, n):
        return False
    if not n:
        return True
    if (not np.array_equal(np.fromiter(map(_NBYTES, dsts), dtype=np.uint64, count=n), lengths)
            or not all(map(_IS_CPU, dsts)) or not all(map(_CONTIGUOUS, dsts)) or any(map(_IS_NEG, dsts))
            or any(map(_IS_CONJ, dsts))):
        return False
    dst_addr = np.fromiter(map(_PTR, dsts), dtype=np.uint64, count=n)
    order = np.argsort(dst_addr, kind="stable")
    starts = dst_addr[order]
    if n > 1 and not (starts[:-1] + lengths[order][:-1] <= starts[1:]).all():
        return False  # views of one tensor (or the same tensor twice): torch's copies keep their order
    assert _hostcopy is not None
    _hostcopy.copy(dst_addr, src_addr, lengths, default_threads() if threads is None else threads, True)
    return True


__all__ = ["Batch", "available", "copy_batch", "copy_from_addresses", "copy_pairs", "default_threads", "eligible",
           "streaming"]
