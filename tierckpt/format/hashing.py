"""Checksums.

The default is xxh3-128 (python-xxhash): ~9 GB/s on one core here, and it releases the GIL, so writer and reader
threads hash in parallel with each other and with I/O. sha256 is 8x slower and buys nothing against accidental
corruption, which is what checksums here guard against.

A data file's checksum is two-level so that one pass over its bytes yields both the per-tensor checksums and the
file's: the file is cut into *segments* that tile it exactly (the header segment ``[0, data_start)``, then every
tensor's byte range in file order); each segment is hashed on its own, and the file checksum is the hash of the
concatenated 16-byte segment digests. See docs/format.md.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

import xxhash

ALGORITHM = "xxh3_128"
DIGEST_SIZE = 16
_ONE_SHOT = xxhash.xxh3_128_digest
_EMPTY = xxhash.xxh3_128_digest(b"")
#: Bytes hashed per update call: large enough to amortise the call, small enough to stay in cache between the
#: hash and the write/read of the same chunk.
CHUNK = 4 << 20


class Hasher:
    """Streaming hasher for one segment."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: Any) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def digest(data: Any) -> bytes:
    """One-shot digest of a bytes-like object (releases the GIL on large buffers)."""
    return xxhash.xxh3_128_digest(data)


def file_checksum(segment_digests: Iterable[bytes]) -> str:
    """Combine segment digests (in file order) into the file checksum."""
    return xxhash.xxh3_128_hexdigest(b"".join(segment_digests))


def canonical_json(obj: Any) -> bytes:
    """The byte form that manifest checksums cover: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def json_checksum(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(canonical_json(obj))


def supported(algorithm: str) -> bool:
    return algorithm == ALGORITHM


class SegmentHasher:
    """Hashes consecutive chunks of one file, cutting them at segment boundaries (see the module docstring).

    Feed the file's bytes in order, in chunks of any size; segments must tile ``[0, size)`` in order. The segments
    that lie whole inside one chunk are hashed with one ``xxh3_128_digest`` call each, issued for the whole run of
    them through ``map`` (no Python statement per segment: at 10,000 small tensors a loop over them was most of the
    hashing's time); a segment that spans chunks streams through a hasher. Both give the same digest.
    """

    __slots__ = ("ends", "digests", "_k", "_pos", "_h", "_open")

    def __init__(self, segment_ends: list[int]) -> None:
        self.ends = segment_ends
        self.digests: list[bytes] = []
        self._k = 0
        self._pos = 0
        self._h = xxhash.xxh3_128()
        self._open = False  # the current segment has bytes in ``_h``
        while self._k < len(self.ends) and self.ends[self._k] == 0:  # empty segments at the very start
            self.digests.append(_EMPTY)
            self._k += 1

    def feed(self, chunk: Any) -> None:
        mv = memoryview(chunk).cast("B")
        n = len(mv)
        if not n:
            return
        ends, k, base = self.ends, self._k, self._pos
        end = base + n
        if k >= len(ends) or end > ends[-1]:
            raise ValueError("more bytes than the segments cover")
        pos = base
        if self._open:  # the segment a previous chunk began
            stop = min(end, ends[k])
            self._h.update(mv[: stop - base])
            pos = stop
            if stop < ends[k]:
                self._pos = pos
                return
            self.digests.append(self._h.digest())
            self._h.reset()
            self._open = False
            k += 1
        j = bisect_right(ends, end, k)  # segments k..j-1 end inside this chunk: one call each, no Python loop
        if j > k:
            stops = [e - base for e in ends[k:j]]
            starts = [pos - base, *stops[:-1]]
            self.digests += map(_ONE_SHOT, map(mv.__getitem__, map(slice, starts, stops)))
            pos = ends[j - 1]
            k = j
        if pos < end:  # the rest begins segment k, which ends in a later chunk
            self._h.update(mv[pos - base :])
            self._open = True
        self._k, self._pos = k, end

    def done(self) -> bool:
        return self._k == len(self.ends)

    def file_checksum(self) -> str:
        return file_checksum(self.digests)
