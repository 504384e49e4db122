"""``format.hashing.SegmentHasher``: one pass over a file's bytes, fed in chunks of any size, gives each segment's
digest exactly as hashing that segment on its own would, and the file checksum over them (docs/format.md)."""

from __future__ import annotations

import random

import pytest
import xxhash

from tierckpt.format import hashing


def _layout(rng: random.Random, size: int) -> list[int]:
    """Segment ends that tile ``[0, size)``: a header, then segments of mixed sizes, some empty."""
    ends = [rng.randint(1, 64)]
    pos = ends[0]
    while pos < size:
        pos = min(size, pos + rng.choice([0, 0, 1, 7, 100, 4096, 70_000]))
        ends.append(pos)
    return ends


@pytest.mark.parametrize("seed", range(6))
def test_segment_digests_match_hashing_each_segment_alone(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(300_000)
    ends = _layout(rng, len(data))
    want = [xxhash.xxh3_128_digest(data[a:b]) for a, b in zip([0, *ends], ends)]
    for chunking in ("one", "random", "tiny", "at_ends"):
        seg = hashing.SegmentHasher(list(ends))
        if chunking == "one":
            cuts = [len(data)]
        elif chunking == "random":
            cuts = sorted({rng.randint(1, len(data)) for _ in range(20)} | {len(data)})
        elif chunking == "tiny":
            cuts = list(range(997, len(data), 997)) + [len(data)]
        else:  # chunks that end exactly where segments end
            cuts = sorted(set(ends))
        pos = 0
        for cut in cuts:
            seg.feed(memoryview(data)[pos:cut])
            pos = cut
        assert seg.done(), chunking
        assert seg.digests == want, chunking
        assert seg.file_checksum() == hashing.file_checksum(want)


def test_empty_segments_and_overfeeding() -> None:
    seg = hashing.SegmentHasher([0, 0, 3, 3])
    assert seg.digests == [xxhash.xxh3_128_digest(b"")] * 2
    seg.feed(b"abc")
    assert seg.done() and seg.digests[2:] == [xxhash.xxh3_128_digest(b"abc"), xxhash.xxh3_128_digest(b"")]
    with pytest.raises(ValueError, match="more bytes"):
        seg.feed(b"d")
