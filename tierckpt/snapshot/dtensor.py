"""Distributed tensors (DTensor, as FSDP2 and tensor parallelism produce them): saving local shards with their place
in the global tensor, and assembling any target shard from saved shards of any other layout (resharding).

Saving: each DTensor leaf stores its local shard (contiguous, row-major) with ``shard = {"global_shape", "offset",
"placements", "mesh_shape", "mesh_dims", "coordinate"}`` (older checkpoints: ``"mesh"``, the mesh's ranks, in place
of the last three). A shard that several ranks hold identically (``Replicate`` on some mesh dimension) is
written only by the rank at coordinate 0 of those dimensions, so replicated data is stored once; the other ranks
record the leaf without data.

Restoring: a target (a live DTensor, or a plain tensor standing for the whole global tensor) covers a box of the
global tensor; every saved shard of the same key path whose box overlaps it contributes that overlap. Each source
shard is read whole and checked against its checksum before a byte of it is used; the overlaps must cover the
target exactly, or the checkpoint is corrupt. ``Shard(dim)`` (even or uneven) and ``Replicate`` placements on any
mesh, in any combination, are supported, and so is ``_StridedShard``, which FSDP2 puts on a parameter that tensor
parallelism already shards along the same dimension (each rank's local shard is then still one box of the global
tensor; a strided shard that is not one box is refused at save time, naming the key). ``Partial`` placements are
refused at save time (reduce them first).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..format.manifest import RankManifest, TensorRecord
from ..format.shard_index import Layout
from ..format.shards import UnknownPlacement, mesh_key, same_box
from .dtypes import CODE_TO_TORCH

#: Where torch keeps DTensor: ``torch.distributed.tensor`` (torch >= 2.5), ``torch.distributed._tensor`` (2.4).
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
_dtensor: type | None = None


def _dtensor_class() -> type | None:
    """DTensor's class once this process has imported it, else None.

    A state can hold a DTensor only after its module was imported (by FSDP2, tensor parallelism or the user), so
    tierckpt looks it up in ``sys.modules`` instead of importing it: ``import tierckpt`` then costs every rank of a
    job without DTensors 0.8 s less at start (the import of ``torch.distributed.tensor`` and its operators)."""
    global _dtensor
    if _dtensor is None:
        for name in _DTENSOR_MODULES:
            cls = getattr(sys.modules.get(name), "DTensor", None)
            if isinstance(cls, type):
                _dtensor = cls
                break
    return _dtensor


def _dtensor_api() -> tuple[Any, Any, Any, Any]:
    """(Replicate, Shard, _StridedShard, compute_local_shape_and_global_offset) wherever this torch keeps them
    (``_StridedShard``: None in a torch without it)."""
    try:
        from torch.distributed.tensor import Replicate, Shard, placement_types
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch 2.4
        from torch.distributed._tensor import (
            Replicate,
            Shard,
            placement_types,  # type: ignore[no-redef]
        )
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return Replicate, Shard, getattr(placement_types, "_StridedShard", None), compute_local_shape_and_global_offset


def is_dtensor(obj: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(obj, cls)


def local_box(t: Any, what: str = "a DTensor") -> tuple[tuple[int, ...], bool]:
    """(global offset of this rank's shard, whether this rank writes it) for a DTensor ``t``; ``what`` names it in
    errors (its key path, where known).

    Raises ``TypeError`` for a placement other than ``Shard``, ``_StridedShard`` and ``Replicate``, and for strided
    placements that leave this rank's shard in several stretches of the global tensor (not one box)."""
    Replicate, Shard, StridedShard, compute_local_shape_and_global_offset = _dtensor_api()  # noqa: N806
    mesh, placements = t.device_mesh, t.placements
    kinds = (Shard, Replicate) if StridedShard is None else (Shard, Replicate, StridedShard)
    for p in placements:
        if not isinstance(p, kinds):
            raise TypeError(f"cannot checkpoint {what} with placement {p}: reduce Partial placements first")
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coord = mesh.get_coordinate()
    if coord is not None and StridedShard is not None and any(isinstance(p, StridedShard) for p in placements):
        # DTensor reports where a strided shard begins, not whether it is one box: the placements tell
        problem = _strided_problem(tuple(t.shape), tuple(str(p) for p in placements), tuple(mesh.shape),
                                   tuple(coord), tuple(shape), tuple(offset))
        if problem is not None:
            raise TypeError(f"cannot checkpoint {what}: {problem}")
    writer = coord is not None and all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    return tuple(offset), writer


@functools.lru_cache(maxsize=4096)
def _strided_problem(global_shape: tuple[int, ...], placements: tuple[str, ...], mesh_shape: tuple[int, ...],
                     coordinate: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...]) -> str | None:
    """Why a shard cut with strided placements cannot be stored as the box DTensor reports (``shape`` at
    ``offset``), or None where it can. Remembered, so that a training loop's saves check each layout once."""
    shard = {"global_shape": list(global_shape), "placements": list(placements), "mesh_shape": list(mesh_shape),
             "coordinate": list(coordinate), "offset": list(offset)}
    try:
        if same_box(shard, shape):
            return None
    except UnknownPlacement as exc:
        return f"{exc}; redistribute it so that each rank's shard is one box of the tensor"
    return (f"with placements {list(placements)}, its local shard of shape {list(shape)} at {list(offset)} is not "
            "where these placements put it")


def shard_info(t: Any, path: str | None = None) -> tuple[torch.Tensor, dict[str, Any], bool]:
    """The local shard (contiguous), its shard description, and whether this rank stores it; ``path``, the value's
    key path, is named in errors (``TypeError`` from :func:`local_box`)."""
    offset, writer = local_box(t, "a DTensor" if path is None else f"the DTensor at {path}")
    local = t.to_local()
    mesh = t.device_mesh
    info = {
        "global_shape": list(t.shape),
        "offset": list(offset),
        "placements": [str(p) for p in t.placements],
        # where the shard lies, in a few integers whatever the mesh's size (tierckpt.format.shards)
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "coordinate": list(mesh.get_coordinate() or ()),
    }
    return local, info, writer


def saved_layouts(tree: Any) -> dict[str, dict[str, Any]]:
    """Every ``$dtensor`` node of a saved tree by key path: its global shape, dtype and (where saved) placements
    and mesh, which every rank records, also for a replicated tensor it stores no shard of."""
    out: dict[str, dict[str, Any]] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$dtensor"), str):
                out[node["$dtensor"]] = node
                continue
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def target_box(live: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset, local shape) that a live target covers."""
    if is_dtensor(live):
        offset, _ = local_box(live)
        return tuple(live.shape), offset, tuple(live.to_local().shape)
    return tuple(live.shape), (0,) * live.dim(), tuple(live.shape)


def index_layouts(own: RankManifest, targets: dict[str, tuple[Any, str, tuple[int, ...]]]) -> list[Layout] | None:
    """What a step's shard index needs to know of this rank's distributed-tensor ``targets`` (key path -> (live
    value, dtype code, global shape)): per target, the saved global shape, placements, mesh shape and mesh key that
    this rank's own saved tree records for its key path, and the box the target covers. None where that cannot be
    told (a target without a saved layout, one saved before layouts carried their mesh) or where this rank's own
    saved shards do not lie where :func:`.format.shards.saved_box` puts them (its arithmetic does not match how they
    were cut): then the ranks to read are not computed from the index."""
    saved = saved_layouts(own.tree)
    out: list[Layout] = []
    try:
        for rec in own.tensors:
            if rec.shard is not None and rec.path in targets and not same_box(rec.shard, rec.shape):
                return None
        for path, (live, _code, gshape) in targets.items():
            layout = saved.get(path)
            if layout is None or "placements" not in layout or "mesh_shape" not in layout:
                return None
            _g, offset, shape = target_box(live)
            out.append((tuple(gshape), tuple(layout["placements"]), tuple(layout["mesh_shape"]),
                        mesh_key(layout["mesh_shape"], layout.get("mesh_dims")), (offset, shape)))
    except (UnknownPlacement, KeyError, TypeError, ValueError):
        return None
    return out


def assemble(
    path: str,
    dtype_code: str,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    sources: Iterable[tuple[TensorRecord, Callable[[], torch.Tensor]]],
    *,
    step: int | None,
) -> torch.Tensor:
    """Build the box ``offset .. offset+shape`` of the global tensor from saved shards.

    ``sources`` are (record, read) pairs; ``read()`` returns the record's verified bytes as uint8. Only shards that
    overlap the box are read.
    """
    out = torch.empty(shape, dtype=CODE_TO_TORCH[dtype_code])
    covered = 0
    for rec, read in sources:
        sh = rec.shard
        assert sh is not None
        if tuple(sh["global_shape"]) != global_shape:
            raise CorruptCheckpointError(f"saved shards of {path} disagree on the global shape", step=step)
        if rec.dtype != dtype_code:
            raise CorruptCheckpointError(f"saved shards of {path} disagree on the dtype", step=step)
        s_off = tuple(sh["offset"])
        lo = [max(a, b) for a, b in zip(offset, s_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, s_off, rec.shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue  # no overlap (also: an empty target overlaps nothing)
        src = read()
        src = src.view(CODE_TO_TORCH[rec.dtype]).view(rec.shape) if rec.nbytes else torch.empty(rec.shape)
        src_sl = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, s_off))
        dst_sl = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, offset))
        out[dst_sl].copy_(src[src_sl])
        covered += math.prod(h - a for a, h in zip(lo, hi))
    if covered != math.prod(shape):
        raise CorruptCheckpointError(
            f"saved shards of {path} cover {covered} of the {math.prod(shape)} elements this rank needs", step=step)
    return out


def to_live_layout(live: Any, local: torch.Tensor) -> Any:
    """A value shaped like ``live`` holding ``local`` (its box): a DTensor with the same mesh and placements, or the
    plain tensor itself."""
    if is_dtensor(live):
        DTensor = _dtensor_class()  # noqa: N806
        assert DTensor is not None
        return DTensor.from_local(local.to(live.to_local().device), live.device_mesh, live.placements,
                                  shape=live.shape, stride=live.stride(), run_check=False)
    return local
