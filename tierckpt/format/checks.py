"""Checks that every parser of stored metadata (safetensors headers, manifests) shares.

- :func:`unique_keys`: the ``json.loads`` hook that refuses a JSON object with a repeated key;
- :func:`check_shape`, with :data:`MAX_NDIM` and :data:`MAX_DIM`: the bounds of a stored tensor shape, which keep
  every size derived from it far below what could be allocated.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

#: A tensor may have at most this many dimensions (torch's own limit is 64).
MAX_NDIM = 64
#: No dimension of a stored shape may reach this (it bounds ``nbytes`` long before any allocation).
MAX_DIM = 1 << 48


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a JSON object with a repeated key is malformed (readers could disagree on it)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return d


def check_shape(shape: object, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple, if it is a list of at most :data:`MAX_NDIM` integers in ``[0, MAX_DIM)``; else
    :class:`CorruptCheckpointError` naming ``what``."""
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape)
    ):
        raise CorruptCheckpointError(f"bad shape {shape!r} for {what}")
    return tuple(shape)


__all__ = ["MAX_DIM", "MAX_NDIM", "check_shape", "unique_keys"]
