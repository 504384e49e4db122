"""Checks that every parser of stored metadata (safetensors headers, manifests) shares.

- :func:`unique_keys`: the ``json.loads`` hook that refuses a JSON object with a repeated key;
- :func:`check_shape`, with :data:`MAX_NDIM` and :data:`MAX_DIM`: the bounds of a stored tensor shape, which keep
  every size derived from it far below what could be allocated;
- :func:`json_memory_estimate` and :func:`check_json_memory`, with :data:`JSON_MEMORY_PER_BYTE`: what parsing a
  JSON document will cost, told from its bytes before it is parsed, so that a document of tiny objects cannot make
  a reader build 25 times its size in Python objects.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

#: A tensor may have at most this many dimensions (torch's own limit is 64).
MAX_NDIM = 64
#: No dimension of a stored shape may reach this (it bounds ``nbytes`` long before any allocation).
MAX_DIM = 1 << 48
#: The most memory that parsing a JSON document (a manifest, a safetensors header) may take per byte of it, as
#: :func:`json_memory_estimate` tells before the parse. Manifests as saves write them are estimated at 12-14 and
#: take 6-7 (measured with ``tracemalloc``: a tensor table and a tree of key paths, optimizer states included); a
#: list of tiny objects (``[{"a":0},...]``, ``[[],...]``) takes 22-26 and is estimated at 35 and more.
JSON_MEMORY_PER_BYTE = 24
#: Documents smaller than this are parsed without an estimate (their parse takes a few tens of MiB at most).
JSON_ESTIMATE_MIN = 1 << 20


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a JSON object with a repeated key is malformed (readers could disagree on it)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return d


def json_memory_estimate(raw: bytes) -> int:
    """An upper estimate of the bytes ``json.loads`` takes to parse ``raw`` (the decoded text and every object it
    builds) and to encode the result again (a checksum of its canonical form), from counts of the characters that
    start its values: no parse, five passes over the bytes at memory speed.

    Per occurrence (CPython 3.10-3.13, 64-bit): ``[`` 80 (an empty list and its slot in its parent), ``{`` 200 (a
    dict of up to five keys and its slot), ``,`` 32 (a slot, and a float or a large int), ``"`` 32 (half a string's
    object header; its characters are in the text), and 4 bytes per byte of ASCII text (the bytes decoded, the
    strings' characters, the canonical encoding and its bytes), 10 per byte of other text (which may decode to 4
    bytes per character). Characters inside strings are counted too, which only raises the estimate."""
    text = 4 if raw.isascii() else 10
    return (text * len(raw) + 80 * raw.count(b"[") + 200 * raw.count(b"{") + 32 * raw.count(b",")
            + 32 * raw.count(b'"'))


def check_json_memory(raw: bytes, what: str, *, step: int | None = None, path: str | None = None) -> None:
    """Refuse (:class:`CorruptCheckpointError` naming ``what``, ``step`` and ``path``) a JSON document of
    :data:`JSON_ESTIMATE_MIN` bytes or more whose parse would take more than :data:`JSON_MEMORY_PER_BYTE` bytes of
    memory per byte of it."""
    if len(raw) < JSON_ESTIMATE_MIN:
        return
    need = json_memory_estimate(raw)
    if need > JSON_MEMORY_PER_BYTE * len(raw):
        raise CorruptCheckpointError(
            f"{what} of {len(raw)} bytes would take about {need >> 20} MiB of memory to parse, "
            f"{need / len(raw):.0f} bytes per byte (at most {JSON_MEMORY_PER_BYTE} are allowed): too many tiny JSON "
            "values", step=step, path=path)


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


__all__ = ["JSON_ESTIMATE_MIN", "JSON_MEMORY_PER_BYTE", "MAX_DIM", "MAX_NDIM", "check_json_memory", "check_shape",
           "json_memory_estimate", "unique_keys"]
