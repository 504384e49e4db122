"""A multi-rank step's shard index: which saved rank holds which shard, readable a few kilobytes at a time.

A restore onto another world size or sharding (resharding) needs, for each of its distributed-tensor targets, the
saved ranks whose shards overlap it, and those ranks' manifest references (name, size, checksum). ``manifest.json``
has both, for every rank: 150 bytes a rank, 1.25 MB at 8,192 ranks, read whole by every rank (10 GB from one
object). The index, ``shards-<save id>.json`` in the step's folder (written before the copy's ``manifest.json``: by
rank 0 on the remote tier, by ``sync`` on the remote it replicates to, by ``pull`` in the local copy it makes, each
from that copy's own references, :func:`of_copy`; a node-local copy lists only its own ranks and has none), holds
the same in a form a rank reads O(1) bytes of:

- **Head** (the first line; sealed JSON, its checksum over its canonical form like a manifest's): the step, the save
  id, the world size, and for each device mesh the saved shards lie on (:func:`.shards.mesh_key`), the map from a
  mesh coordinate to the saved ranks at it. A regular mesh (ranks laid out row-major, as ``init_device_mesh`` does,
  with an offset and strides; pipeline stages with equal meshes as ``copies``) is a few integers whatever the world
  size: ``{"shape", "start", "strides", "copies", "copy_stride"}``. An irregular one lists the ranks of every
  coordinate (``{"shape", "ranks"}``, O(W)).
- **Blocks** (every later line, each padded with spaces to ``block_bytes``): the manifest references of
  ``block_ranks`` consecutive ranks, block ``b`` at byte ``len(head line) + b * block_bytes``; each sealed on its own
  and naming its step, save and first rank.

A reader reads the head (the first :data:`HEAD_READ` bytes: one ranged read, which for a small job holds the blocks
too), computes which mesh coordinates overlap its targets from the placements its own rank manifest records
(:func:`.shards.overlapping_coordinates`, without visiting every rank), turns them into ranks through the head, and
reads only the blocks holding those ranks' references. Everything read is bounded before it is allocated and
checked (:class:`~tierckpt.errors.CorruptCheckpointError` naming the step, tier and file); the rank manifests it
leads to are still checked against the references, and every byte of data against its checksum.
``tierckpt verify`` reads a copy's index whole and checks it against the copy's ``manifest.json``
(:func:`check_head`, :func:`check_block`).

Torch-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from . import hashing
from .checks import check_json_memory, unique_keys
from .layout import check_file_name
from .manifest import MAX_MANIFEST_BYTES, MAX_MESH_DIMS, MAX_MESHES, RankRef, StepManifest
from .shards import UnknownPlacement, overlapping_coordinates

FORMAT = "tierckpt.shards"
BLOCK_FORMAT = "tierckpt.shards.block"
#: Index format versions this library reads (the index has its own version: a step manifest's is unchanged).
FORMAT_VERSION = 1
READS_VERSIONS = (1,)
#: Ranks whose references one block holds: about 90 bytes each, so a block is about 6 KB.
BLOCK_RANKS = 64
#: Bytes of the index a reader asks for first (the head, and for a job of up to a few hundred ranks every block).
HEAD_READ = 16 << 10
#: No head is read past this (an irregular mesh lists every rank: about 8 bytes each, 64 KB at 8,192 ranks).
MAX_HEAD_BYTES = 8 << 20
#: No block is larger than this.
MAX_BLOCK_BYTES = 1 << 20
#: Blocks never hold more ranks than this.
MAX_BLOCK_RANKS = 4096
_HEX = frozenset("0123456789abcdef")
#: What a reader knows of one distributed-tensor target: the saved global shape, placements, mesh shape and mesh key
#: (:func:`.shards.mesh_key`) of its key path, and the target's box (offset, shape).
Layout = tuple[Sequence[int], Sequence[str], Sequence[int], str, tuple[Sequence[int], Sequence[int]]]


def index_name(save_id: str) -> str:
    """The index's file name in a step folder: it carries the save's id, as every file of that save does (so the
    commit's clean-up keeps it, and an index of another save of the step is never mistaken for this one's)."""
    return f"shards-{save_id}.json"


@dataclass(frozen=True)
class MeshRanks:
    """Which saved ranks stand at each coordinate of one mesh: an affine map (``ranks`` None) or a table."""

    shape: tuple[int, ...]
    start: int = 0
    strides: tuple[int, ...] = ()
    copies: int = 1
    copy_stride: int = 0
    #: the ranks at each coordinate, row-major (an irregular mesh)
    ranks: tuple[tuple[int, ...], ...] | None = None

    def at(self, coord: Sequence[int]) -> tuple[int, ...]:
        """The saved ranks at ``coord`` (empty where ``coord`` is off the mesh)."""
        if len(coord) != len(self.shape) or not all(0 <= c < n for c, n in zip(coord, self.shape)):
            return ()
        if self.ranks is not None:
            flat = 0
            for c, n in zip(coord, self.shape):
                flat = flat * n + c
            return self.ranks[flat]
        base = self.start + sum(c * s for c, s in zip(coord, self.strides))
        return tuple(base + j * self.copy_stride for j in range(self.copies))

    def to_json(self) -> dict[str, Any]:
        if self.ranks is not None:
            return {"shape": list(self.shape), "ranks": [list(r) for r in self.ranks]}
        return {"shape": list(self.shape), "start": self.start, "strides": list(self.strides), "copies": self.copies,
                "copy_stride": self.copy_stride}


@dataclass(frozen=True)
class IndexHead:
    """A parsed, verified head; ``head_bytes``: the length of its line (newline included), where block 0 starts."""

    step: int
    save_id: str
    world_size: int
    block_ranks: int
    block_bytes: int
    head_bytes: int
    meshes: dict[str, MeshRanks]

    def blocks_of(self, ranks: Iterable[int]) -> list[int]:
        """The blocks holding ``ranks``' references."""
        return sorted({r // self.block_ranks for r in ranks if 0 <= r < self.world_size})

    def block_span(self, block: int) -> tuple[int, int]:
        """(offset, length) of ``block`` in the file."""
        return self.head_bytes + block * self.block_bytes, self.block_bytes


# --------------------------------------------------------------------------------------------------------- writing
def _mesh_shape(key: str) -> tuple[int, ...] | None:
    """The shape a mesh key (:func:`.shards.mesh_key`) names, or None if it names none."""
    dims = key.split(":", 1)[0].split("x")
    if not dims or len(dims) > MAX_MESH_DIMS or not all(d.isdigit() and 0 < len(d) <= 9 for d in dims):
        return None
    shape = tuple(int(d) for d in dims)
    return shape if all(n >= 1 for n in shape) else None


def _coords(shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Every coordinate of a mesh, row-major."""
    if not shape:
        yield ()
        return
    for c in range(shape[0]):
        for rest in _coords(shape[1:]):
            yield (c, *rest)


def _mesh_ranks(shape: tuple[int, ...], at: dict[tuple[int, ...], list[int]]) -> MeshRanks:
    """The compact form of ``at`` (coordinate -> its ranks, each list sorted): affine where it is, else a table.
    Only the coordinates of ``at`` must fit the map: the others store no shard (a rank at a nonzero coordinate of a
    ``Replicate`` dimension writes none), so no reader asks for them."""
    zero = (0,) * len(shape)
    first = at.get(zero)
    if first:
        copies = len(first)
        copy_stride = first[1] - first[0] if copies > 1 else 0
        strides: list[int] = []
        for i in range(len(shape)):
            unit = tuple(1 if j == i else 0 for j in range(len(shape)))
            if unit in at:
                strides.append(at[unit][0] - first[0])
            elif any(c[i] for c in at):
                break  # no rank at the unit coordinate to tell the stride from
            else:
                strides.append(0)
        if len(strides) == len(shape):
            affine = MeshRanks(shape, first[0], tuple(strides), copies, copy_stride)
            if all(tuple(ranks) == affine.at(c) for c, ranks in at.items()):
                return affine
    return MeshRanks(shape, ranks=tuple(tuple(at.get(c, ())) for c in _coords(shape)))


def _seal(d: dict[str, Any]) -> bytes:
    canon = hashing.canonical_json(d)
    return b'{"checksum":"' + hashing.digest(canon).hex().encode() + b'",' + canon[1:]


def build(step: int, save_id: str, world_size: int, refs: Sequence[RankRef], *,
          block_ranks: int = BLOCK_RANKS) -> bytes | None:
    """The index of a committed step whose ``refs`` (every rank's, in rank order) carry mesh coordinates; None for
    a step without any (nothing of it can be resharded), or whose head would exceed :data:`MAX_HEAD_BYTES`. A mesh
    whose coordinates do not fit its shape is left out (a reader then reads as without an index)."""
    if len(refs) != world_size or [r.rank for r in refs] != list(range(world_size)) or not any(r.mesh for r in refs):
        return None
    by_mesh: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for ref in refs:
        for key, coord in ref.mesh:
            by_mesh.setdefault(key, {}).setdefault(tuple(coord), []).append(ref.rank)
    meshes = {}
    for key, at in sorted(by_mesh.items()):
        shape = _mesh_shape(key)
        if shape is None or math.prod(shape) > world_size or not all(
                len(c) == len(shape) and all(0 <= x < n for x, n in zip(c, shape)) for c in at):
            continue
        meshes[key] = _mesh_ranks(shape, at).to_json()
    blocks = []
    for first in range(0, world_size, block_ranks):
        blocks.append(_seal({"format": BLOCK_FORMAT, "step": step, "save_id": save_id, "first": first,
                             "ranks": [[r.name, r.size, r.checksum] for r in refs[first : first + block_ranks]]}))
    width = max(len(b) for b in blocks) + 1
    head = _seal({"format": FORMAT, "format_version": FORMAT_VERSION, "hash_algorithm": hashing.ALGORITHM,
                  "step": step, "save_id": save_id, "world_size": world_size, "block_ranks": block_ranks,
                  "block_bytes": width, "meshes": meshes})
    if len(head) + 1 > MAX_HEAD_BYTES or width > MAX_BLOCK_BYTES:
        return None
    return head + b"\n" + b"".join(b.ljust(width - 1) + b"\n" for b in blocks)


# --------------------------------------------------------------------------------------------------------- reading
class _Where:
    """What an error names: the step, tier and file."""

    def __init__(self, step: int, tier: str | None, path: str | None) -> None:
        self.step, self.tier, self.path = step, tier, path

    def bad(self, what: str) -> CorruptCheckpointError:
        name = self.path.rsplit("/", 1)[-1] if self.path else None
        return CorruptCheckpointError(f"shard index: {what}", step=self.step, tier=self.tier, path=self.path,
                                      bad_files=[name] if name else [])


def _unseal(raw: bytes, kind: str, where: _Where) -> dict[str, Any]:
    check_json_memory(raw, "shard index", step=where.step, path=where.path)
    try:
        d = json.loads(raw.decode("ascii"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise where.bad(f"unreadable: {str(exc)[:200]}") from None
    if not isinstance(d, dict) or d.get("format") != kind:
        raise where.bad(f"not a {kind} record")
    claimed = d.pop("checksum", None)
    try:
        actual = hashing.json_checksum(d)
    except (ValueError, RecursionError) as exc:
        raise where.bad(f"not canonical JSON: {exc}") from None
    if claimed != actual:
        raise where.bad("checksum mismatch (edited or damaged)")
    return d


def _int(d: dict[str, Any], key: str, lo: int, hi: int, where: _Where) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise where.bad(f"{key} is {str(v)[:40]}, not an integer in [{lo}, {hi}]")
    return v


def _ints(v: Any, n: int | None, lo: int, hi: int) -> bool:
    return (isinstance(v, list) and (n is None or len(v) == n)
            and all(type(x) is int and lo <= x <= hi for x in v))


def _parse_mesh(key: Any, v: Any, world: int, where: _Where) -> MeshRanks:
    shape = _mesh_shape(key) if isinstance(key, str) and len(key) <= 256 else None
    if shape is None or not isinstance(v, dict) or not _ints(v.get("shape"), len(shape), 1, world) \
            or tuple(v["shape"]) != shape:
        raise where.bad(f"bad mesh {str(key)[:80]}")
    size = math.prod(shape)
    if "ranks" in v:
        table = v["ranks"]
        if (set(v) != {"shape", "ranks"} or not isinstance(table, list) or len(table) != size
                or not all(_ints(r, None, 0, world - 1) for r in table) or sum(len(r) for r in table) > world):
            raise where.bad(f"bad rank table of mesh {key}")
        return MeshRanks(shape, ranks=tuple(tuple(r) for r in table))
    if set(v) != {"shape", "start", "strides", "copies", "copy_stride"} or not _ints(v["strides"], len(shape),
                                                                                       -world, world):
        raise where.bad(f"bad rank map of mesh {key}")
    start = _int(v, "start", 0, world - 1, where)
    copies = _int(v, "copies", 1, world, where)
    copy_stride = _int(v, "copy_stride", -world, world, where)
    if copies * size > world:
        raise where.bad(f"mesh {key} places {copies * size} shards on {world} ranks")
    strides = tuple(v["strides"])
    # the map's smallest and largest rank (each term at its extreme): every rank it names is a rank of the job
    lo = start + sum(min(0, s * (n - 1)) for s, n in zip(strides, shape)) + min(0, copy_stride * (copies - 1))
    hi = start + sum(max(0, s * (n - 1)) for s, n in zip(strides, shape)) + max(0, copy_stride * (copies - 1))
    if lo < 0 or hi >= world:
        raise where.bad(f"mesh {key} maps onto ranks {lo}..{hi} of a job of {world}")
    return MeshRanks(shape, start, strides, copies, copy_stride)


def head_line(prefix: bytes, *, step: int, tier: str | None = None, path: str | None = None) -> int | None:
    """The length of the head's line (newline included) if ``prefix`` (the file's first bytes) holds all of it;
    None if it may go on past ``prefix``; :class:`CorruptCheckpointError` once it is longer than
    :data:`MAX_HEAD_BYTES`."""
    end = prefix.find(b"\n", 0, MAX_HEAD_BYTES)
    if end >= 0:
        return end + 1
    if len(prefix) >= MAX_HEAD_BYTES:
        raise _Where(step, tier, path).bad(f"its first line is longer than {MAX_HEAD_BYTES} bytes")
    return None


def parse_head(line: bytes, *, step: int, save_id: str, world_size: int, tier: str | None = None,
               path: str | None = None) -> IndexHead:
    """Parse and check the head (``line``: the file's first line, newline included) of the index of save
    ``save_id`` of ``step`` by ``world_size`` ranks; :class:`CorruptCheckpointError` naming the step, ``tier`` and
    ``path`` for anything amiss, another step's, save's or world size's index included."""
    where = _Where(step, tier, path)
    if not line.endswith(b"\n") or len(line) > MAX_HEAD_BYTES:
        raise where.bad("its head is not one line")
    d = _unseal(line[:-1], FORMAT, where)
    version = d.get("format_version")
    if type(version) is not int or version not in READS_VERSIONS:
        raise where.bad(f"format version {version!r} is not supported (reads {list(READS_VERSIONS)})")
    if d.get("hash_algorithm") != hashing.ALGORITHM:
        raise where.bad(f"unsupported hash algorithm {str(d.get('hash_algorithm'))[:40]!r}")
    if d.get("step") != step or d.get("save_id") != save_id or d.get("world_size") != world_size:
        raise where.bad(f"it is the index of step {str(d.get('step'))[:20]}, save {str(d.get('save_id'))[:40]}, "
                        f"{str(d.get('world_size'))[:20]} ranks, not of this copy (step {step}, save {save_id}, "
                        f"{world_size} ranks)")
    block_ranks = _int(d, "block_ranks", 1, MAX_BLOCK_RANKS, where)
    block_bytes = _int(d, "block_bytes", 2, MAX_BLOCK_BYTES, where)
    meshes = d.get("meshes")
    if not isinstance(meshes, dict) or len(meshes) > MAX_MESHES:
        raise where.bad("bad meshes")
    parsed = {k: _parse_mesh(k, v, world_size, where) for k, v in meshes.items()}
    return IndexHead(step, save_id, world_size, block_ranks, block_bytes, len(line), parsed)


def parse_block(raw: bytes, head: IndexHead, block: int, *, tier: str | None = None,
                path: str | None = None) -> list[RankRef]:
    """The manifest references of block ``block`` (``raw``: its ``block_bytes`` bytes), checked: sealed, of this
    step, save and rank range, every name one safe path component, every size within a manifest's bound."""
    where = _Where(head.step, tier, path)
    first = block * head.block_ranks
    count = min(head.block_ranks, head.world_size - first)
    if count <= 0 or len(raw) != head.block_bytes or not raw.endswith(b"\n"):
        raise where.bad(f"block {block} is missing or cut short (truncated?)")
    d = _unseal(raw.rstrip(b" \n"), BLOCK_FORMAT, where)
    if d.get("step") != head.step or d.get("save_id") != head.save_id or d.get("first") != first:
        raise where.bad(f"block {block} belongs to another step, save or place")
    items = d.get("ranks")
    if not isinstance(items, list) or len(items) != count:
        raise where.bad(f"block {block} does not list ranks {first}..{first + count - 1}")
    out = []
    for i, item in enumerate(items):
        ok = (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and type(item[1]) is int
              and 0 < item[1] <= MAX_MANIFEST_BYTES and isinstance(item[2], str) and len(item[2]) == 32
              and set(item[2]) <= _HEX)
        if not ok:
            raise where.bad(f"block {block}: bad reference of rank {first + i}")
        try:
            name = check_file_name(item[0], step=head.step, path=path)
        except CorruptCheckpointError:
            raise where.bad(f"block {block}: unsafe file name {str(item[0])[:80]!r}") from None
        out.append(RankRef(first + i, name, item[1], item[2]))
    return out


def ranks_overlapping(head: IndexHead, layouts: Iterable[Layout]) -> set[int] | None:
    """The saved ranks whose shards overlap some target: ``layouts`` holds, per target, the saved global shape,
    placements, mesh shape and mesh key, and the target's box. None where the index cannot tell (a mesh it does
    not list, a placement :mod:`.shards` does not know): the caller then reads as without an index."""
    wanted: set[int] = set()
    try:
        for gshape, placements, mesh_shape, key, box in layouts:
            mesh = head.meshes.get(key)
            if mesh is None or tuple(mesh.shape) != tuple(int(n) for n in mesh_shape):
                return None
            for coord in overlapping_coordinates(gshape, placements, mesh_shape, box):
                wanted.update(mesh.at(coord))
    except (UnknownPlacement, TypeError, ValueError):
        return None
    return wanted


# -------------------------------------------------------------------------------------------------- copies, checks
def of_copy(manifest: StepManifest) -> tuple[str, bytes] | None:
    """The file name and bytes of the index of a committed copy of a step whose manifest is ``manifest`` (built from
    its own rank references, which differ between copies: a remote rank manifest names fan-out or compressed files),
    or None for a copy that gets none: one holding only some ranks (a node's), or a step without distributed
    tensors. Every writer of a copy (the sharded commit, ``sync``, ``pull``) writes this file before its
    ``manifest.json``."""
    if len(manifest.ranks) != manifest.world_size:
        return None
    raw = build(manifest.step, manifest.save_id, manifest.world_size, manifest.ranks)
    return None if raw is None else (index_name(manifest.save_id), raw)


def index_bytes(head: IndexHead) -> int:
    """The length of the whole file ``head`` describes: its line, then one ``block_bytes`` block per
    ``block_ranks`` ranks."""
    return head.head_bytes + -(-head.world_size // head.block_ranks) * head.block_bytes


def check_head(head: IndexHead, refs: Sequence[RankRef], size: int, *, tier: str | None = None,
               path: str | None = None) -> None:
    """Check a parsed head against the copy it is found in: the file is ``size`` bytes, as long as the head says
    (:func:`index_bytes`: not cut short, nothing appended), and its meshes agree with the mesh coordinates of
    ``refs`` (the copy's manifest references, those of every rank or of some): each rank's coordinate on a listed
    mesh maps to that rank, and no coordinate maps to a rank that records another one. A mesh the head does not
    list is not an error (a restore then reads ``manifest.json``). :class:`CorruptCheckpointError` naming the step,
    ``tier`` and ``path`` otherwise."""
    where = _Where(head.step, tier, path)
    if size != index_bytes(head):
        raise where.bad(f"it is {size} bytes, its head describes {index_bytes(head)} (truncated or appended to)")
    at: dict[tuple[str, int], tuple[int, ...]] = {}
    for ref in refs:
        for key, coord in ref.mesh:
            at[(key, ref.rank)] = tuple(coord)
            mesh = head.meshes.get(key)
            if mesh is not None and ref.rank not in mesh.at(coord):
                raise where.bad(f"mesh {key} does not place rank {ref.rank} at {list(coord)}, where manifest.json "
                                "does (stale: the index of another copy?)")
    for key, mesh in head.meshes.items():
        for coord in _coords(mesh.shape):
            for rank in mesh.at(coord):
                if at.get((key, rank), coord) != coord:
                    raise where.bad(f"mesh {key} places rank {rank} at {list(coord)}, manifest.json at "
                                    f"{list(at[(key, rank)])} (stale: the index of another copy?)")


def check_block(raw: bytes, head: IndexHead, block: int, refs: dict[int, RankRef], *, tier: str | None = None,
                path: str | None = None) -> None:
    """Parse block ``block`` (:func:`parse_block`) and compare each of its references with ``refs`` (the copy's
    manifest references by rank; a rank missing there, on a copy of some ranks, is not compared): the same rank
    manifest name, size and checksum. :class:`CorruptCheckpointError` naming the step, ``tier`` and ``path``."""
    for ref in parse_block(raw, head, block, tier=tier, path=path):
        want = refs.get(ref.rank)
        if want is not None and (want.name, want.size, want.checksum) != (ref.name, ref.size, ref.checksum):
            raise _Where(head.step, tier, path).bad(
                f"block {block}: rank {ref.rank}'s reference ({ref.name}, {ref.size} bytes, {ref.checksum[:12]}…) "
                f"is not manifest.json's ({want.name}, {want.size} bytes, {want.checksum[:12]}…): stale, the "
                "index of another copy of the step")
