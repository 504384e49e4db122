"""Where each rank's shard of a distributed tensor lies, computed from the mesh instead of read from its manifest.

A DTensor shard's record (:attr:`~tierckpt.format.manifest.TensorRecord.shard`) holds its placements, the shape of
its device mesh (and the mesh's dimension names) and the saving rank's coordinate on it. A step manifest's
reference to each rank (:attr:`~tierckpt.format.manifest.RankRef.mesh`) holds that rank's coordinate on every mesh
its shards lie on: a few integers a rank. From those, :func:`saved_box` computes any rank's box of any tensor, so a
restore onto another world size reads the manifests of the ranks whose shards overlap its own instead of every
rank's. :func:`overlapping_coordinates` goes the other way: the mesh coordinates whose shards overlap a box, found
without visiting every coordinate of the mesh (what a step's shard index, :mod:`.shard_index`, turns into ranks).

The arithmetic is DTensor's, placement by placement from the mesh's first dimension to its last, each acting on
what the previous ones left along its tensor dimension:

- ``Shard(d)`` cuts it into ``n`` pieces as ``torch.chunk`` does (ceil-sized, the last ones short or empty) and
  keeps piece ``c``;
- ``_StridedShard(d, split_factor=f)`` (FSDP2 over tensor parallelism: the tensor-parallel cut is applied first)
  cuts it into ``f`` pieces, each of those into ``n``, and keeps piece ``c`` of each: ``f`` stretches, which a later
  ``Shard(d)`` over ``f`` ranks narrows back to one;
- ``Replicate`` keeps everything; its shard is stored by the rank at coordinate 0 only.

A shard is therefore a set of stretches along each dimension (:func:`saved_runs`); a stored one is a single box
(the snapshot refuses one that is not). A placement this module does not know raises :class:`UnknownPlacement`,
and its callers then fall back to reading every rank.

Torch-free: placements are the strings DTensor prints (``S(0)``/``Shard(dim=0)``, ``_S(0, 2)``/
``_StridedShard(dim=0, sf=2)``, ``R``/``Replicate()``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

_SHARD = re.compile(r"S\((\d+)\)|Shard\(dim=(\d+)\)")
_STRIDED = re.compile(r"_S\((\d+), (\d+)\)|_StridedShard\(dim=(\d+), (?:sf|split_factor)=(\d+)\)")
_REPLICATE = frozenset({"R", "Replicate()"})

#: one rank's coordinates: (mesh key, coordinate) pairs, sorted by key
MeshIndex = tuple[tuple[str, tuple[int, ...]], ...]
#: stretches of one tensor dimension, in the order a shard holds them: (start, stop) pairs, none empty
Runs = tuple[tuple[int, int], ...]


class UnknownPlacement(ValueError):
    """A placement whose boxes this module cannot compute (``Partial``, a future kind), or a shard that is not one
    box of its tensor."""


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


def _placement(p: str, n: int, ndim: int) -> tuple[int, int] | None:
    """(tensor dimension, split factor) of placement ``p`` over a mesh dimension of ``n`` (a plain ``Shard``: split
    factor 0), None for ``Replicate``. Raises :class:`UnknownPlacement`."""
    if p in _REPLICATE:
        return None
    m = _SHARD.fullmatch(p)
    if m is not None:
        d, f = int(m.group(1) or m.group(2)), 0
    else:
        m = _STRIDED.fullmatch(p)
        if m is None:
            raise UnknownPlacement(f"placement {p!r}")
        d, f = int(m.group(1) or m.group(3)), int(m.group(2) or m.group(4))
        if f < 1:
            raise UnknownPlacement(f"placement {p!r}")
    if not 0 <= d < ndim or n < 1:
        raise UnknownPlacement(f"placement {p!r} on a mesh dimension of {n}")
    return d, f


def _groups(length: int, f: int) -> list[tuple[int, int]]:
    """The position ranges a placement of split factor ``f`` (0: plain ``Shard``) cuts apart first: ``f`` pieces
    as ``torch.chunk`` cuts them, or the whole length."""
    if f == 0:
        return [(0, length)]
    size = -(-length // f)
    return [(min(k * size, length), min((k + 1) * size, length)) for k in range(f)]


def _kept(length: int, n: int, f: int, c: int) -> list[tuple[int, int]]:
    """The position ranges (start, stop) that coordinate ``c`` of ``n`` keeps of ``length`` positions under a
    placement of split factor ``f``: piece ``c`` of each group, as ``torch.chunk`` cuts it (possibly none)."""
    out = []
    for a, b in _groups(length, f):
        q = -(-(b - a) // n)
        if q and a + c * q < b:
            out.append((a + c * q, min(a + (c + 1) * q, b)))
    return out


def _select(runs: Runs, ranges: Iterable[tuple[int, int]]) -> Runs:
    """The stretches at positions ``ranges`` of the sequence ``runs`` stands for, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        pos = 0
        for s, e in runs:
            lo, hi = max(a, pos), min(b, pos + e - s)
            if lo < hi:
                start, stop = s + lo - pos, s + hi - pos
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((start, stop))
            pos += e - s
            if pos >= b:
                break
    return tuple(out)


def _length(runs: Runs) -> int:
    return sum(e - s for s, e in runs)


def saved_runs(global_shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
               coordinate: Sequence[int]) -> tuple[Runs, ...] | None:
    """Per tensor dimension, the stretches of the global tensor that the rank at ``coordinate`` holds, or None
    where it stores nothing (a ``Replicate`` mesh dimension is stored by its coordinate 0 only). Raises
    :class:`UnknownPlacement`."""
    if not (len(placements) == len(mesh_shape) == len(coordinate)):
        raise UnknownPlacement(f"{len(placements)} placements on a mesh of {len(mesh_shape)} dimensions")
    runs: list[Runs] = [((0, int(n)),) if int(n) > 0 else () for n in global_shape]
    for p, n, c in zip(placements, mesh_shape, coordinate):
        n, c = int(n), int(c)
        how = _placement(p, n, len(runs))
        if not 0 <= c < n:
            raise UnknownPlacement(f"coordinate {c} on a mesh dimension of {n}")
        if how is None:
            if c != 0:
                return None
            continue
        d, f = how
        runs[d] = _select(runs[d], _kept(_length(runs[d]), n, f, c))
    return tuple(runs)


def saved_box(global_shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
              coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of the shard that the rank at ``coordinate`` stores, or None where it stores none. An empty
    shard's offset is immaterial (it overlaps nothing); this one puts it where its stretch would have begun, or at
    0. Raises :class:`UnknownPlacement`, also where the shard is not one box (a ``_StridedShard`` that no later
    ``Shard`` narrows to one stretch)."""
    runs = saved_runs(global_shape, placements, mesh_shape, coordinate)
    if runs is None:
        return None
    if any(len(r) > 1 for r in runs):
        raise UnknownPlacement(f"placements {list(placements)} at {list(coordinate)} hold several stretches of "
                               "one dimension, not one box")
    return tuple(r[0][0] if r else 0 for r in runs), tuple(r[0][1] - r[0][0] if r else 0 for r in runs)


def same_box(shard: dict[str, Any], shape: Sequence[int]) -> bool:
    """Whether a stored shard's record (its ``shard`` entry and ``shape``) lies where :func:`saved_box` puts it;
    an empty shard's offset is not compared. Raises :class:`UnknownPlacement`, ``KeyError`` or ``TypeError`` for
    a record that cannot tell."""
    box = saved_box(shard["global_shape"], shard["placements"], shard["mesh_shape"], shard["coordinate"])
    if box is None or box[1] != tuple(shape):
        return False
    return 0 in box[1] or box[0] == tuple(shard["offset"])


def overlaps(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]) -> bool:
    """Whether boxes ``a`` and ``b`` (offset, shape) share an element."""
    return all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))


def _meets(runs: Runs, lo: int, hi: int) -> list[tuple[int, int]]:
    """The position ranges of ``runs`` whose stretches fall in ``[lo, hi)``."""
    out, pos = [], 0
    for s, e in runs:
        a, b = max(s, lo), min(e, hi)
        if a < b:
            out.append((pos + a - s, pos + b - s))
        pos += e - s
    return out


def _candidates(length: int, n: int, f: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The coordinates (of ``n``, split factor ``f``) whose kept positions meet ``ranges``, without visiting the
    others: per group of positions, the coordinates are found by division."""
    found: set[int] = set()
    for a, b in _groups(length, f):
        q = -(-(b - a) // n)
        if q == 0:
            continue
        for u0, u1 in ranges:
            lo, hi = max(u0, a), min(u1, b)
            if lo < hi:
                found.update(range((lo - a) // q, min(n - 1, (hi - 1 - a) // q) + 1))
    return sorted(found)


def overlapping_coordinates(global_shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
                            box: tuple[Sequence[int], Sequence[int]]) -> list[tuple[int, ...]]:
    """The mesh coordinates whose stored shard (:func:`saved_runs`) overlaps ``box`` (offset, shape), in row-major
    order. Mesh dimension by mesh dimension, only the pieces of the current extent that meet the box are visited,
    so the work is proportional to the shards found (times the mesh's dimensions and split factors), not to the
    mesh's size: at 8,192 ranks, an FSDP shard of another world size meets two or three saved ones. Raises
    :class:`UnknownPlacement`."""
    if not len(placements) == len(mesh_shape):
        raise UnknownPlacement(f"{len(placements)} placements on a mesh of {len(mesh_shape)} dimensions")
    offset, shape = [int(x) for x in box[0]], [int(x) for x in box[1]]
    if len(offset) != len(global_shape) or len(shape) != len(global_shape) or 0 in shape:
        return []  # an empty box overlaps nothing
    hows = [_placement(p, int(n), len(global_shape)) for p, n in zip(placements, mesh_shape)]
    out: list[tuple[int, ...]] = []

    def walk(level: int, runs: list[Runs], coord: tuple[int, ...]) -> None:
        if level == len(hows):
            if all(_meets(r, o, o + s) for r, o, s in zip(runs, offset, shape)):
                out.append(coord)
            return
        how = hows[level]
        if how is None:  # Replicate: stored by coordinate 0 only
            walk(level + 1, runs, (*coord, 0))
            return
        d, f = how
        n, length = int(mesh_shape[level]), _length(runs[d])
        for c in _candidates(length, n, f, _meets(runs[d], offset[d], offset[d] + shape[d])):
            kept = _select(runs[d], _kept(length, n, f, c))
            if _meets(kept, offset[d], offset[d] + shape[d]):
                walk(level + 1, [*runs[:d], kept, *runs[d + 1:]], (*coord, c))

    walk(0, [((0, int(n)),) if int(n) > 0 else () for n in global_shape], ())
    return out
