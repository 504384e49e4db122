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

    Feed the file's bytes in order, in chunks of any size; segments must tile ``[0, size)`` in order. A segment that
    lies whole inside one chunk is hashed in one call (``xxh3_128_digest``); one that spans chunks streams through a
    hasher. Both give the same digest; the one-shot call saves the hasher's update/digest/reset round trip, which
    at 10,000 small tensors is most of the hashing's Python time.
    """

    __slots__ = ("ends", "digests", "_k", "_pos", "_h", "_open")

    def __init__(self, segment_ends: list[int]) -> None:
        self.ends = segment_ends
        self.digests: list[bytes] = []
        self._k = 0
        self._pos = 0
        self._h = xxhash.xxh3_128()
        self._open = False  # the current segment has bytes in ``_h``
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._k < len(self.ends) and self.ends[self._k] == self._pos:
            self.digests.append(_EMPTY)
            self._k += 1

    def feed(self, chunk: Any) -> None:
        mv = memoryview(chunk).cast("B")
        i = 0
        n = len(mv)
        ends, digests, h = self.ends, self.digests, self._h
        while i < n:
            k = self._k
            if k >= len(ends):
                raise ValueError("more bytes than the segments cover")
            left = ends[k] - self._pos
            take = min(n - i, left)
            if take == left:  # the segment ends in this chunk
                if self._open:
                    h.update(mv[i : i + take])
                    digests.append(h.digest())
                    h.reset()
                    self._open = False
                else:
                    digests.append(_ONE_SHOT(mv[i : i + take]))
                self._k = k + 1
            else:
                h.update(mv[i : i + take])
                self._open = True
            i += take
            self._pos += take
            self._skip_empty()

    def done(self) -> bool:
        return self._k == len(self.ends)

    def file_checksum(self) -> str:
        return file_checksum(self.digests)
