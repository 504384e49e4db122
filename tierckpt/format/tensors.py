"""A rank manifest's tensor records, and the table that stores them from format version 2.

Version 1 stored one JSON object per tensor (``"tensors": [{"index": 0, "name": ..., ...}, ...]``); version 2 stores
one JSON list per field (``"tensors": {"name": [...], "dtype": [...], ...}``, a record's index being its position).
The table is a third smaller, and parsing it builds ten lists instead of one dict per tensor: at 10,000 tensors the
JSON parse went from 30 to 6 ms and the records are built without a Python statement each. See docs/format.md.

Invariant: :func:`table_records` accepts a table only when every record passes exactly the checks that
``manifest._checked_tensors`` makes field by field (types, dtype and kind codes, shape dimensions and rank, ``nbytes``
against shape and dtype, the byte range inside its file and after its header); at the first doubt it returns None
and the caller runs those field-by-field checks over :func:`table_items`, which name the record and field at fault.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from functools import partial
from itertools import chain
from typing import Any, NamedTuple

from .checks import MAX_DIM, MAX_NDIM
from .dtypes import ITEMSIZE

#: Containers tags the tree may use for tensors.
TENSOR_KINDS = ("torch", "numpy")


class TensorRecord(NamedTuple):
    """One stored tensor: where its bytes are and what they are (a tuple: a rank may have tens of thousands)."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, which nothing here calls
    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    file: int
    offset: int
    nbytes: int
    checksum: str
    kind: str = "torch"
    #: For a shard of a distributed tensor (DTensor): where it sits in the global tensor; None otherwise.
    shard: dict[str, Any] | None = None


#: The table's columns (version 2): every field but the index, which is the position.
COLUMNS: tuple[str, ...] = TensorRecord._fields[1:]
_MAX_INT = 1 << 63
#: ``TensorRecord`` from one iterable of all eleven fields, without the generated ``__new__`` (a Python call).
make_record = partial(tuple.__new__, TensorRecord)
_STR, _INT, _LIST, _NONE = frozenset({str}), frozenset({int}), frozenset({list}), frozenset({type(None)})
_KINDS = frozenset(TENSOR_KINDS)


def encode_table(tensors: Sequence[TensorRecord]) -> dict[str, Any]:
    """The version-2 table of ``tensors`` (whose indices are their positions)."""
    if not tensors:
        return {c: [] for c in COLUMNS}
    return dict(zip(COLUMNS, map(list, list(zip(*tensors))[1:])))


def table_records(cols: list[list[Any]], files_start: list[int], files_size: list[int]) -> list[TensorRecord] | None:
    """The records of a table's columns (in :data:`COLUMNS` order, lists of equal length), or None at the first
    doubt (see the module docstring); ``files_start`` / ``files_size``: each data file's header end and size."""
    names, paths, dtypes, shapes, fidx, offsets, nbytes, checksums, kinds, shards = cols
    n = len(names)
    if not n:
        return []
    if not (set(map(type, names)) <= _STR and set(map(type, paths)) <= _STR and set(map(type, checksums)) <= _STR
            and set(map(type, dtypes)) <= _STR and set(map(type, kinds)) <= _STR):
        return None
    if not set(dtypes) <= ITEMSIZE.keys() or not set(kinds) <= _KINDS or set(map(type, shards)) != _NONE:
        return None  # a shard's description has its own checks, record by record
    if not set(map(type, chain(fidx, offsets, nbytes))) <= _INT:
        return None
    if (min(fidx) < 0 or max(fidx) >= len(files_start) or min(offsets) < 0 or min(nbytes) < 0
            or max(offsets) >= _MAX_INT or max(nbytes) >= _MAX_INT):
        return None
    if set(map(type, shapes)) != _LIST or max(map(len, shapes)) > MAX_NDIM:
        return None
    dims = list(chain.from_iterable(shapes))
    if dims and (not set(map(type, dims)) <= _INT or min(dims) < 0 or max(dims) >= MAX_DIM):
        return None
    if list(map(operator.mul, map(math.prod, shapes), map(ITEMSIZE.__getitem__, dtypes))) != nbytes:
        return None
    if not all(map(operator.le, map(files_start.__getitem__, fidx), offsets)):
        return None  # a tensor inside its file's header
    if not all(map(operator.le, map(operator.add, offsets, nbytes), map(files_size.__getitem__, fidx))):
        return None  # a tensor past its file's end
    return list(map(make_record, zip(range(n), names, paths, dtypes, map(tuple, shapes), fidx, offsets, nbytes,
                               checksums, kinds, shards)))


def table_items(cols: list[list[Any]]) -> list[dict[str, Any]]:
    """The table's records as version-1 record objects (with their index), for the field-by-field checks."""
    return [{"index": i, **dict(zip(COLUMNS, row))} for i, row in enumerate(zip(*cols))]


__all__ = ["COLUMNS", "MAX_DIM", "TENSOR_KINDS", "TensorRecord", "encode_table", "make_record", "table_items",
           "table_records"]
