"""Decoding a saved state tree into Python values (the inverse of :mod:`.tree`).

Invariants: decoding accepts exactly the tags :mod:`.tree` writes, checks every tensor index and nesting depth,
and never evaluates or imports anything named in the tree: a malformed node raises
:class:`~tierckpt.errors.CorruptCheckpointError`. :func:`decode_tree` gives the values of a tree without a live
state to load into (template-free loading); :class:`Decoder` is what a restore's plan (:mod:`.load`) decodes with.
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..format.manifest import TensorRecord
from .dtypes import CODE_TO_NUMPY
from .loaded import TensorSource
from .tree import MAX_DEPTH


class Decoder:
    """Turns tree nodes into Python values. ``tensor(i)`` returns a view of loaded bytes (not owned)."""

    def __init__(self, records: tuple[TensorRecord, ...], tensor: TensorSource, *, step: int | None,
                 dtensor: Callable[[str], Any] | None = None, direct: frozenset[int] = frozenset()) -> None:
        self.records = records
        self.tensor = tensor
        self.step = step
        self.dtensor = dtensor
        #: records loaded straight into live memory: already owned by the state, so never cloned
        self.direct = direct

    def bad(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"malformed state tree: {msg}", step=self.step)

    def index(self, node: dict, tag: str, kind: str) -> int:
        i = node[tag]
        if type(i) is not int or not 0 <= i < len(self.records) or self.records[i].kind != kind:
            raise self.bad(f"bad {tag} reference {i!r}")
        return i

    def key(self, node: Any, depth: int = 0) -> Any:
        """A saved dict key: anything hashable that :meth:`decode` gives (a list is no key of any state)."""
        key = self.decode(node, own=True, depth=depth)
        try:
            hash(key)
        except TypeError:
            raise self.bad("unhashable dict key") from None
        return key

    def decode(self, node: Any, *, own: bool, depth: int = 0) -> Any:
        """``own``: copy tensors out of the loading buffers (for values the caller keeps)."""
        if depth > MAX_DEPTH:
            raise self.bad(f"nested deeper than {MAX_DEPTH}")
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            return node
        if isinstance(node, list):
            return [self.decode(v, own=own, depth=depth + 1) for v in node]
        if not isinstance(node, dict) or not (len(node) in (1, 2, 3) or (len(node) <= 6 and "$dtensor" in node)):
            raise self.bad(f"unexpected node {str(node)[:80]}")  # a $dtensor node may carry its layout too
        tag = next(iter(node))
        if tag == "$dtensor":
            if self.dtensor is None or not isinstance(node[tag], str):
                raise self.bad("a distributed tensor where none was expected")
            return self.dtensor(node[tag])
        if tag == "$float":
            try:
                return float.fromhex(node[tag])
            except (TypeError, ValueError):
                raise self.bad(f"bad float {node[tag]!r}") from None
        if tag == "$bytes":
            try:
                return base64.b64decode(node[tag], validate=True)
            except (TypeError, ValueError):
                raise self.bad("bad bytes") from None
        if tag in ("$dict", "$odict"):
            items = node[tag]
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise self.bad("bad dict")
            cls = collections.OrderedDict if tag == "$odict" else dict
            out = cls()
            for k, v in items:
                out[self.key(k, depth + 1)] = self.decode(v, own=own, depth=depth + 1)
            return out
        if tag in ("$tuple", "$set"):
            if not isinstance(node[tag], list):
                raise self.bad(f"bad {tag}")
            vals = [self.decode(v, own=own, depth=depth + 1) for v in node[tag]]
            if tag == "$tuple":
                return tuple(vals)
            try:
                return set(vals)
            except TypeError:  # a list inside: no saved set holds one
                raise self.bad("unhashable set item") from None
        if tag == "$tensor":
            i = self.index(node, tag, "torch")
            t = self.tensor(i)
            return t.clone() if own and i not in self.direct else t
        if tag in ("$ndarray", "$npscalar"):
            arr = self.array(self.index(node, tag, "numpy"))
            return arr[()] if tag == "$npscalar" else arr
        if tag == "$generator":
            g = torch.Generator(device=node.get("device", "cpu")) if node.get("device", "cpu") == "cpu" else None
            state = self.tensor(self.index(node, tag, "torch")).clone()
            if g is None:
                return state
            g.set_state(state)
            return g
        if tag == "$dtype":
            dt = getattr(torch, str(node[tag]), None)
            if not isinstance(dt, torch.dtype):
                raise self.bad(f"unknown dtype {node[tag]!r}")
            return dt
        if tag == "$device":
            try:
                return torch.device(str(node[tag]))
            except RuntimeError:
                raise self.bad(f"bad device {node[tag]!r}") from None
        if tag == "$size":
            if not isinstance(node[tag], list) or not all(type(d) is int for d in node[tag]):
                raise self.bad("bad size")
            return torch.Size(node[tag])
        if tag == "$stateful":
            return self.decode(node[tag], own=own, depth=depth + 1)
        raise self.bad(f"unknown tag {tag!r}")

    def array(self, i: int) -> np.ndarray:
        rec = self.records[i]
        raw = self.tensor(i)  # uint8 bytes of the leaf, as loaded
        return raw.numpy().view(CODE_TO_NUMPY[rec.dtype]).reshape(rec.shape).copy()


class _ValueDecoder(Decoder):
    """A :class:`Decoder` whose ``tensor(i)`` is record ``i``'s final value (a torch tensor, or a numpy array for
    a ``numpy`` record), owned by the caller and returned as is: never cloned, never copied."""

    def array(self, i: int) -> np.ndarray:
        return self.tensor(i)  # type: ignore[return-value]


def decode_tree(tree: Any, records: tuple[TensorRecord, ...], values: Callable[[int], Any], *, step: int | None,
                dtensor: Callable[[str], Any] | None = None) -> Any:
    """``tree`` as plain Python values, without a live state to load into (template-free loading).

    ``values(i)``: record ``i``'s value, of its dtype and shape, owned by the caller: a CPU tensor for a ``torch``
    record, a numpy array for a ``numpy`` one; each is put in the result as is, so a record referenced under
    several keys (tied parameters) comes back as one object under each. ``$stateful`` nodes come back as the
    ``state_dict()`` tree that was saved; ``dtensor(path)`` gives each ``$dtensor`` node's value. Raises
    :class:`CorruptCheckpointError` for a malformed tree (nothing in it is imported or evaluated)."""
    return _ValueDecoder(records, values, step=step, dtensor=dtensor).decode(tree, own=False)
