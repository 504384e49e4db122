"""The shard index (tierckpt.format.shard_index): its size and what a reader reads of it do not grow with the world
size for a regular split; the coordinates it computes match the box arithmetic; a damaged or foreign index is
refused with an error naming the step, tier and file."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.format._strategies import placed
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import hashing, shard_index
from tierckpt.format.manifest import RankRef, StepManifest
from tierckpt.format.shards import mesh_key, overlapping_coordinates, saved_runs
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import sharded

SID = "0123456789abcdef"


def refs(world: int, mesh: list[int] | None = None, *, dims: list[str] | None = None,
         coord_of: Any = None) -> list[RankRef]:
    """Every rank's reference, each with its coordinate on ``mesh`` (row-major by default)."""
    mesh = mesh or [world]
    key = mesh_key(mesh, dims)
    out = []
    for r in range(world):
        coord = coord_of(r) if coord_of else tuple(int(c) for c in _unravel(r, mesh))
        out.append(RankRef(r, f"r{r:05d}-{SID}.manifest.json", 40_000 + r, f"{r:032x}",
                           () if coord is None else ((key, coord),)))
    return out


def _unravel(r: int, shape: list[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(r % n)
        r //= n
    return out[::-1]


def head_of(raw: bytes, world: int, step: int = 7) -> shard_index.IndexHead:
    end = shard_index.head_line(raw, step=step)
    assert end is not None
    return shard_index.parse_head(raw[:end], step=step, save_id=SID, world_size=world)


# ---------------------------------------------------------------------------------------------- the box arithmetic
@st.composite
def boxes(draw: st.DrawFn) -> tuple[list[int], list[str], list[int], tuple[list[int], list[int]]]:
    shape, places, mesh = draw(placed())
    off = [draw(st.integers(0, n)) for n in shape]
    size = [draw(st.integers(0, n - o)) for n, o in zip(shape, off)]
    return shape, places, mesh, (off, size)


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_overlapping_coordinates_are_exactly_those_whose_saved_shard_overlaps(
        case: tuple[list[int], list[str], list[int], tuple[list[int], list[int]]]) -> None:
    shape, places, mesh, box = case
    brute = []
    for coord in itertools.product(*(range(n) for n in mesh)):
        runs = saved_runs(shape, places, mesh, coord)
        if runs is not None and all(any(max(s, o) < min(e, o + n) for s, e in r)
                                    for r, o, n in zip(runs, box[0], box[1])):
            brute.append(coord)
    assert overlapping_coordinates(shape, places, mesh, box) == brute


# ---------------------------------------------------------------------------------------------- size and reads
def test_index_of_a_regular_split_does_not_grow_with_the_world_size(tmp_path: Path) -> None:
    small, large = shard_index.build(7, SID, 8, refs(8)), shard_index.build(7, SID, 8192, refs(8192))
    assert small is not None and large is not None
    hs, hl = head_of(small, 8), head_of(large, 8192)
    # the head (the rank map) is the same few hundred bytes; only the blocks of references grow with the ranks
    assert hl.head_bytes - hs.head_bytes < 16 and hl.head_bytes < 400, (hs.head_bytes, hl.head_bytes)
    assert hl.meshes["8192"] == shard_index.MeshRanks((8192,), 0, (1,), 1, 0)
    # a block holds 64 ranks' references whatever the world size (the small job's one block holds its 8)
    mid = head_of(shard_index.build(7, SID, 1024, refs(1024)) or b"", 1024)
    assert abs(hl.block_bytes - mid.block_bytes) < 64 and hl.block_bytes < 64 * 100
    # a rank of a 4,096-rank job restoring an FSDP split of 8,192 needs saved ranks 2r and 2r + 1
    rows = 8192 * 4
    for target in (0, 1000, 4095):
        box = ([rows // 4096 * target, 0], [rows // 4096, 16])
        wanted = shard_index.ranks_overlapping(hl, [((rows, 16), ("S(0)",), (8192,), "8192", box)])
        assert wanted == {2 * target, 2 * target + 1}
    # what a reader reads: the first HEAD_READ bytes, then the one block holding those two ranks
    store = CountingStore(tmp_path / "large")
    store.makedirs("step-0000000007")
    store.put_atomic(f"step-0000000007/{shard_index.index_name(SID)}", large)
    manifest = StepManifest(step=7, world_size=8192, save_id=SID, ranks=refs(1), total_bytes=0)
    found = sharded.index_head(store, manifest)
    assert found is not None
    got = sharded._index_refs(store, found[1], found[2], [4000, 4001])
    assert got[4001] == dataclasses.replace(refs(8192)[4001], mesh=())
    assert store.read <= shard_index.HEAD_READ + hl.block_bytes, store.read
    assert len(large) > 25 * store.read  # the whole index is far larger than what one rank reads of it
    small_store = CountingStore(tmp_path / "small")
    small_store.makedirs("step-0000000007")
    small_store.put_atomic(f"step-0000000007/{shard_index.index_name(SID)}", small)
    found = sharded.index_head(small_store, dataclasses.replace(manifest, world_size=8))
    assert found is not None and sharded._index_refs(small_store, found[1], found[2], [3])[3].checksum == f"{3:032x}"
    assert small_store.reads == 1  # a small job's index is read whole with the head


def test_meshes_that_are_not_one_row_major_split() -> None:
    # (replicate 2, shard 4) for HSDP: only coordinate 0 of the replicated dimension stores, and only those ranks
    # record a coordinate; the map stays affine
    hsdp = refs(8, [2, 4], dims=["rep", "shard"], coord_of=lambda r: (0, r) if r < 4 else None)
    head = head_of(shard_index.build(7, SID, 8, hsdp) or b"", 8)
    assert head.meshes["2x4:rep,shard"].ranks is None and head.meshes["2x4:rep,shard"].at((0, 3)) == (3,)
    # two pipeline stages on equal meshes: each coordinate is held by a rank of each stage
    stages = refs(8, [4], coord_of=lambda r: (r % 4,))
    head = head_of(shard_index.build(7, SID, 8, stages) or b"", 8)
    assert head.meshes["4"].at((1,)) == (1, 5) and head.meshes["4"].ranks is None
    # an arbitrary rank order: a table
    perm = [3, 0, 2, 1]
    shuffled = refs(4, [4], coord_of=lambda r: (perm[r],))
    head = head_of(shard_index.build(7, SID, 4, shuffled) or b"", 4)
    assert head.meshes["4"].ranks is not None and [head.meshes["4"].at((c,)) for c in range(4)] == [(1,), (3,), (2,),
                                                                                                   (0,)]
    # no distributed tensor: no index
    assert shard_index.build(7, SID, 4, [dataclasses.replace(r, mesh=()) for r in refs(4)]) is None


# ---------------------------------------------------------------------------------------------- damage
def _reseal(line: bytes, change: Any) -> bytes:
    d = json.loads(line)
    d.pop("checksum")
    change(d)
    canon = hashing.canonical_json(d)
    return b'{"checksum":"' + hashing.digest(canon).hex().encode() + b'",' + canon[1:]


def test_damaged_or_foreign_index_is_refused_naming_step_tier_and_file() -> None:
    raw = shard_index.build(7, SID, 8, refs(8))
    assert raw is not None
    end = shard_index.head_line(raw, step=7)
    assert end is not None
    line, block = raw[:end], raw[end:]
    path = "s3://b/run/step-0000000007/shards-x.json"

    def refused(line: bytes, match: str, **kw: Any) -> None:
        args = {"step": 7, "save_id": SID, "world_size": 8} | kw
        with pytest.raises(CorruptCheckpointError, match=match) as exc:
            shard_index.parse_head(line, tier="remote", path=path, **args)
        assert exc.value.step == 7 and exc.value.tier == "remote" and exc.value.path == path
        assert exc.value.bad_files == ["shards-x.json"]

    refused(line.replace(b'"start":0', b'"start":1'), "checksum mismatch")
    refused(line.replace(b'"meshes"', b'"meshes', 1), "unreadable")
    refused(line, "not of this copy", save_id="f" * 16)
    refused(line, "not of this copy", world_size=16)
    refused(line[:-1], "not one line")
    # sealed again after the change: the bounds still catch a map onto ranks the job does not have
    refused(_reseal(line[:-1], lambda d: d["meshes"]["8"].update(start=5)) + b"\n", "onto ranks 5..12")
    refused(_reseal(line[:-1], lambda d: d.update(format_version=99)) + b"\n", "format version 99")
    refused(_reseal(line[:-1], lambda d: d["meshes"]["8"].update(strides=[1 << 40])) + b"\n", "bad rank map")
    head = shard_index.parse_head(line, step=7, save_id=SID, world_size=8)
    assert [r.rank for r in shard_index.parse_block(block, head, 0)] == list(range(8))
    with pytest.raises(CorruptCheckpointError, match="cut short"):
        shard_index.parse_block(block[:-3], head, 0)
    bad = bytearray(block)
    bad[40] ^= 1
    with pytest.raises(CorruptCheckpointError, match="shard index"):
        shard_index.parse_block(bytes(bad), head, 0)
    unsafe = _reseal(block.rstrip(), lambda d: d["ranks"][2].__setitem__(0, "../x")).ljust(len(block) - 1) + b"\n"
    with pytest.raises(CorruptCheckpointError, match="unsafe file name"):
        shard_index.parse_block(unsafe, head, 0)


class CountingStore(LocalStore):
    """A local store that counts the reads and bytes read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, tier="remote")
        self.reads = self.read = 0

    def readinto_many(self, rel: str, offset: int, bufs: list[memoryview]) -> int:
        n = super().readinto_many(rel, offset, bufs)
        self.reads += 1
        self.read += n
        return n



@pytest.mark.parametrize("kind", ["s3", "posix_remote"])
def test_index_read_in_ranges_from_each_remote_kind_and_a_truncated_one_is_corrupt(make_store: Any, kind: str) -> None:
    store = make_store(kind)
    world = 300  # 5 blocks: the first read holds the head and the first two
    raw = shard_index.build(7, SID, world, refs(world))
    assert raw is not None
    folder = "step-0000000007"
    store.makedirs(folder)
    store.put_atomic(f"{folder}/{shard_index.index_name(SID)}", raw)
    manifest = StepManifest(step=7, world_size=world, save_id=SID, ranks=refs(1), total_bytes=0)
    found = sharded.index_head(store, manifest)
    assert found is not None and len(found[2]) == shard_index.HEAD_READ
    got = sharded._index_refs(store, found[1], found[2], [10, 299])
    assert [got[r] for r in (10, 299)] == [dataclasses.replace(refs(world)[r], mesh=()) for r in (10, 299)]
    # cut inside the third block: the head and the blocks before it still read, a later block is corrupt, not a
    # storage failure (a reader then falls back to manifest.json)
    head = found[1]
    store.put_atomic(f"{folder}/{shard_index.index_name(SID)}", raw[: head.block_span(2)[0] + 100])
    found = sharded.index_head(store, manifest)
    assert found is not None and sharded._index_refs(store, found[1], found[2], [70])[70].rank == 70
    for rank in (150, 299):
        with pytest.raises(CorruptCheckpointError, match="shard index") as exc:
            sharded._index_refs(store, found[1], found[2], [rank])
        assert exc.value.step == 7 and exc.value.tier == "remote" and shard_index.index_name(SID) in str(exc.value)
    assert sharded.index_head(store, dataclasses.replace(manifest, save_id="f" * 16)) is None  # another save's


def test_an_index_that_misplaces_the_ranks_already_read_is_not_used(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """An index sealed correctly but placing this rank's own saved shard elsewhere than its manifest does (a writer
    that got the map wrong) is not trusted: the restore reads the step manifest instead, with a warning."""
    from types import SimpleNamespace

    world = 8
    four = refs(world, [4], coord_of=lambda r: (r,) if r < 4 else None)  # ranks 0-3 on a mesh of 4
    raw = shard_index.build(7, SID, world, four)
    assert raw is not None
    end = shard_index.head_line(raw, step=7)
    assert end is not None
    store = LocalStore(tmp_path, tier="remote")
    store.makedirs("step-0000000007")
    rel = f"step-0000000007/{shard_index.index_name(SID)}"
    manifest = StepManifest(step=7, world_size=world, save_id=SID, ranks=four[:1], total_bytes=0)
    own = SimpleNamespace(tensors=[SimpleNamespace(shard={"mesh_shape": [4], "mesh_dims": None, "coordinate": [3]})])
    layouts = [((8, 2), ("S(0)",), (4,), "4", ((0, 0), (2, 2)))]
    for index, used in ((raw, True), (_reseal(raw[: end - 1], lambda d: d["meshes"]["4"].update(start=4)) + b"\n"
                                      + raw[end:], False)):
        store.put_atomic(rel, index)
        caplog.clear()
        have: dict[int, Any] = {3: (store, own)}
        assert sharded.indexed_rank_manifests([store], manifest, layouts, have, lambda t: None) is used
        assert ("does not place rank 3 at [3] of mesh 4" in caplog.text) is not used, caplog.text


def test_a_remote_that_cannot_be_read_for_the_index_leaves_the_step_manifest_path(tmp_path: Path) -> None:
    """The remote down at a restart: no index is used (the caller's reads, which a node's complete copy may serve
    without the remote, decide), instead of the restore failing on the index."""
    from tierckpt.errors import StorageUnavailableError
    from tierckpt.storage.faulty import FaultyStore

    raw = shard_index.build(7, SID, 8, refs(8))
    assert raw is not None
    inner = LocalStore(tmp_path, tier="remote")
    inner.makedirs("step-0000000007")
    inner.put_atomic(f"step-0000000007/{shard_index.index_name(SID)}", raw)
    down = FaultyStore(inner, fail={"readinto": "all"},
                       error_factory=lambda op, n: StorageUnavailableError(f"injected: {op} #{n}", tier="remote"))
    manifest = StepManifest(step=7, world_size=8, save_id=SID, ranks=refs(1), total_bytes=0)
    with pytest.raises(StorageUnavailableError):
        sharded.index_head(down, manifest)
    layouts = [((16, 2), ("S(0)",), (8,), "8", ((0, 0), (4, 2)))]
    assert sharded.indexed_rank_manifests([down], manifest, layouts, {}, lambda t: None) is False
