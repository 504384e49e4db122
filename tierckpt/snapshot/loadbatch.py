"""A restore plan's checks for a whole dict of plain tensors at once (the common shape of a large state: a model's
or an optimizer's tensors under str/int keys), the counterpart of the flatten's batches in :mod:`.tree`.

Invariant: a batch accepts a saved dict node only when the item-by-item walk of :mod:`.load` would accept every
item and do for each exactly what the batch does (record it as a direct target or as a copy); at the first doubt
(a malformed or unusual node, a key that is missing or unexpected, a type, dtype or shape that differs, a live
tensor that is sparse, nested or meta or whose elements share memory) it returns None having changed nothing, and
the item-by-item walk then decides, and names any problem with its key path. The checks read each attribute
through ``map`` over the whole dict (no Python statement per tensor for them): at 10,000 tensors the item-by-item
walk cost about 40 ms of a warm restore.
"""

from __future__ import annotations

import collections
from operator import attrgetter, itemgetter
from typing import Any

import torch

from ..format.manifest import TensorRecord
from .dtypes import TORCH_TO_CODE
from .tree import PLAIN_KEY_TYPES, PLAIN_TENSOR_TYPES

#: A dict node with fewer items than this takes the item-by-item walk (the batch's fixed cost is a few passes).
BATCH_MIN = 8

_DICT_TYPES = (dict, collections.OrderedDict)
_FIRST, _SECOND, _TENSOR_REF = itemgetter(0), itemgetter(1), itemgetter("$tensor")
_KIND, _DTYPE_CODE, _SHAPE_T = attrgetter("kind"), attrgetter("dtype"), attrgetter("shape")
_NBYTES, _SHARD = attrgetter("nbytes"), attrgetter("shard")
_DTYPE, _SHAPE, _IS_CPU = attrgetter("dtype"), attrgetter("shape"), attrgetter("is_cpu")
_REQUIRES_GRAD = attrgetter("requires_grad")
_LAYOUT, _DEVICE = attrgetter("layout"), attrgetter("device")
_STRIDED = frozenset({torch.strided})


def plain_tensor_items(cur: Any, pairs: list[Any], records: tuple[TensorRecord, ...], *,
                       strict: bool) -> tuple[list[torch.Tensor], list[TensorRecord]] | None:
    """The live tensors of ``cur`` and the records of the saved dict node ``pairs`` (its ``[key, node]`` items), in
    saved order, when every item is ``[str|int key, {"$tensor": i}]``, ``cur`` (an exact dict) holds a plain tensor
    of the record's dtype and shape under every saved key, and (``strict``) no other key; else None."""
    if type(cur) not in _DICT_TYPES or len(pairs) < BATCH_MIN:
        return None
    if set(map(type, pairs)) != {list} or set(map(len, pairs)) != {2}:
        return None
    keys = list(map(_FIRST, pairs))
    nodes = list(map(_SECOND, pairs))
    if not set(map(type, keys)) <= PLAIN_KEY_TYPES or set(map(type, nodes)) != {dict} or set(map(len, nodes)) != {1}:
        return None
    try:
        idx = list(map(_TENSOR_REF, nodes))
    except KeyError:
        return None
    if set(map(type, idx)) != {int} or min(idx) < 0 or max(idx) >= len(records):
        return None
    recs = list(map(records.__getitem__, idx))
    if set(map(_KIND, recs)) != {"torch"}:
        return None
    if len(set(keys)) != len(keys) or (strict and len(cur) != len(keys)):
        return None
    try:
        live = list(map(cur.__getitem__, keys))
    except KeyError:
        return None
    if not set(map(type, live)) <= PLAIN_TENSOR_TYPES:
        return None
    if list(map(TORCH_TO_CODE.get, map(_DTYPE, live))) != list(map(_DTYPE_CODE, recs)):
        return None
    if not set(map(_LAYOUT, live)) <= _STRIDED:  # sparse: nothing to load into (the walk names it)
        return None
    if not all(map(_IS_CPU, live)) and any(d.type == "meta" for d in set(map(_DEVICE, live))):
        return None  # a meta tensor holds no memory to load into
    try:
        if list(map(tuple, map(_SHAPE, live))) != list(map(_SHAPE_T, recs)):
            return None
    except RuntimeError:  # a nested tensor of the strided layout has no sizes
        return None
    if not all(map(torch.Tensor.is_contiguous, live)) and any(map(overlaps_itself, live)):
        return None  # nothing can be copied into it: the walk decides what to do, and names it
    return live, recs


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are the same memory (an ``expand()``ed or broadcast view: a stride of 0; or an
    ``as_strided`` view whose strides overlap). A copy into such a tensor is ill-defined (torch refuses the stride-0
    case), so a restore never loads into one in place.

    Cost: a contiguous tensor is answered by its flag; a strided one by its strides, except where the dimensions'
    strides interleave, which is settled by listing every element's offset (memory of 8 bytes an element, for
    views that only ``as_strided`` makes)."""
    if t.is_contiguous():
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 0  # the largest offset the dimensions of smaller strides reach
    for st, sz in dims:
        if st == 0:
            return True
        if st <= reach:  # the strides interleave: count the distinct offsets
            offsets = torch.zeros((), dtype=torch.int64)
            for stride, size in dims:
                offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
            return bool(offsets.unique().numel() < offsets.numel())
        reach += st * (sz - 1)
    return False


def direct_flags(live: list[torch.Tensor], recs: list[TensorRecord]) -> list[bool]:
    """For tensors that passed :func:`plain_tensor_items`: whether each may be its record's direct target (what
    :func:`.load.direct_target` decides with ``layout_checked=True``: a contiguous host tensor without the neg bit,
    for a record with bytes and no shard)."""
    return [cpu and contiguous and not neg and nbytes > 0 and shard is None
            for cpu, contiguous, neg, nbytes, shard in zip(
                map(_IS_CPU, live), map(torch.Tensor.is_contiguous, live), map(torch.Tensor.is_neg, live),
                map(_NBYTES, recs), map(_SHARD, recs))]


def detached(live: list[torch.Tensor]) -> list[torch.Tensor]:
    """``t.detach()`` of each tensor that requires grad, the others as they are (the same memory either way)."""
    grads = list(map(_REQUIRES_GRAD, live))
    if not any(grads):
        return live
    return [t.detach() if g else t for t, g in zip(live, grads)]


__all__ = ["BATCH_MIN", "detached", "direct_flags", "overlaps_itself", "plain_tensor_items"]
