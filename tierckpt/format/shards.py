"""Where each rank's shard of a distributed tensor lies, computed from the mesh instead of read from its manifest.

A DTensor shard's record (:attr:`~tierckpt.format.manifest.TensorRecord.shard`) holds its placements, the shape of
its device mesh (and the mesh's dimension names) and the saving rank's coordinate on it. A step manifest's
reference to each rank (:attr:`~tierckpt.format.manifest.RankRef.mesh`) holds that rank's coordinate on every mesh
its shards lie on: a few integers a rank. From those, :func:`saved_box` computes any rank's box of any tensor, so a
restore onto another world size reads the manifests of the ranks whose shards overlap its own instead of every
rank's. The boxes follow ``torch.chunk`` along each sharded dimension (as DTensor's ``Shard`` does); a placement
this module does not know makes the caller fall back to reading every rank. :func:`overlapping_coordinates` goes the
other way: the mesh coordinates whose shards overlap a box, found without visiting every coordinate of the mesh
(what a step's shard index, :mod:`.shard_index`, turns into ranks).

Torch-free: placements are the strings DTensor prints (``S(0)``/``Shard(dim=0)``, ``R``/``Replicate()``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

_SHARD = re.compile(r"S\((\d+)\)|Shard\(dim=(\d+)\)")
_REPLICATE = frozenset({"R", "Replicate()"})

#: one rank's coordinates: (mesh key, coordinate) pairs, sorted by key
MeshIndex = tuple[tuple[str, tuple[int, ...]], ...]


class UnknownPlacement(ValueError):
    """A placement whose boxes this module cannot compute (``_StridedShard``, ``Partial``, a future kind)."""


def mesh_key(shape: Sequence[int], dims: Sequence[str] | None) -> str:
    """A mesh's name in the index: its shape and dimension names, e.g. ``2x4:dp,tp``."""
    key = "x".join(str(int(n)) for n in shape)
    return f"{key}:{','.join(dims)}" if dims else key


def mesh_index(shards: Iterable[dict[str, Any] | None]) -> MeshIndex:
    """A rank's coordinates on the meshes of its stored shards (the ``shard`` entries of its tensor records)."""
    out: dict[str, tuple[int, ...]] = {}
    for sh in shards:
        if sh and "coordinate" in sh and "mesh_shape" in sh:
            out.setdefault(mesh_key(sh["mesh_shape"], sh.get("mesh_dims")), tuple(int(c) for c in sh["coordinate"]))
    return tuple(sorted(out.items()))


def saved_box(global_shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
              coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of the shard that the rank at ``coordinate`` stores, or None where it stores none (a
    ``Replicate`` mesh dimension is stored by its coordinate 0 only). Raises :class:`UnknownPlacement`."""
    if not (len(placements) == len(mesh_shape) == len(coordinate)):
        raise UnknownPlacement(f"{len(placements)} placements on a mesh of {len(mesh_shape)} dimensions")
    shape, offset = [int(n) for n in global_shape], [0] * len(global_shape)
    for p, n, c in zip(placements, mesh_shape, coordinate):
        if p in _REPLICATE:
            if c != 0:
                return None
            continue
        m = _SHARD.fullmatch(p)
        if m is None:
            raise UnknownPlacement(f"placement {p!r}")
        d = int(m.group(1) or m.group(2))
        if not 0 <= d < len(shape) or n < 1 or not 0 <= c < n:
            raise UnknownPlacement(f"placement {p!r} on a mesh dimension of {n} at {c}")
        chunk = -(-shape[d] // n)  # torch.chunk: ceil-sized pieces, the last ones short or empty
        start = min(chunk * c, shape[d])
        offset[d] += start
        shape[d] = min(shape[d], start + chunk) - start
    return tuple(offset), tuple(shape)


def overlaps(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]) -> bool:
    """Whether boxes ``a`` and ``b`` (offset, shape) share an element."""
    return all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))


def _shard_dim(p: str, n: int, ndim: int) -> int | None:
    """The tensor dimension placement ``p`` shards over a mesh dimension of ``n``, None for ``Replicate``; raises
    :class:`UnknownPlacement` as :func:`saved_box` does."""
    if p in _REPLICATE:
        return None
    m = _SHARD.fullmatch(p)
    if m is None:
        raise UnknownPlacement(f"placement {p!r}")
    d = int(m.group(1) or m.group(2))
    if not 0 <= d < ndim or n < 1:
        raise UnknownPlacement(f"placement {p!r} on a mesh dimension of {n}")
    return d


def overlapping_coordinates(global_shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
                            box: tuple[Sequence[int], Sequence[int]]) -> list[tuple[int, ...]]:
    """The mesh coordinates whose stored shard (:func:`saved_box`) overlaps ``box`` (offset, shape), in row-major
    order. Mesh dimension by mesh dimension, only the pieces of the current extent that meet the box are visited,
    so the work is proportional to the shards found (times the mesh's dimensions), not to the mesh's size: at 8,192
    ranks, an FSDP shard of another world size meets two or three saved ones. Raises :class:`UnknownPlacement`."""
    if not len(placements) == len(mesh_shape):
        raise UnknownPlacement(f"{len(placements)} placements on a mesh of {len(mesh_shape)} dimensions")
    offset, shape = [int(x) for x in box[0]], [int(x) for x in box[1]]
    if len(offset) != len(global_shape) or len(shape) != len(global_shape) or 0 in shape:
        return []  # an empty box overlaps nothing
    dims = [_shard_dim(p, int(n), len(global_shape)) for p, n in zip(placements, mesh_shape)]
    out: list[tuple[int, ...]] = []

    def walk(level: int, lo: list[int], hi: list[int], coord: tuple[int, ...]) -> None:
        if level == len(dims):
            if overlaps((lo, [h - low for low, h in zip(lo, hi)]), (offset, shape)):
                out.append(coord)
            return
        d = dims[level]
        if d is None:  # Replicate: stored by coordinate 0 only
            walk(level + 1, lo, hi, (*coord, 0))
            return
        n, extent = int(mesh_shape[level]), hi[d] - lo[d]
        chunk = -(-extent // n)
        if chunk == 0:
            return  # every piece is empty
        t0, t1 = offset[d] - lo[d], offset[d] + shape[d] - lo[d]  # the box along d, relative to this extent
        for c in range(max(0, t0 // chunk), min(n - 1, (t1 - 1) // chunk) + 1):
            start, end = min(chunk * c, extent), min(chunk * (c + 1), extent)
            if start < end and max(start, t0) < min(end, t1):
                walk(level + 1, [*lo[:d], lo[d] + start, *lo[d + 1:]], [*hi[:d], lo[d] + end, *hi[d + 1:]],
                     (*coord, c))

    walk(0, [0] * len(global_shape), [int(n) for n in global_shape], ())
    return out
