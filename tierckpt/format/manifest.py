"""Manifests: the JSON records that describe, and commit, a checkpoint.

Two kinds, both JSON (never pickle), both carrying a checksum of their own canonical content:

- :class:`RankManifest` (``r<rank>-<save id>.manifest.json``): one rank's files (name, size, checksum), its tensors
  (name, key path, dtype, shape, file, byte range, checksum; a table of one list per field from format version 2,
  see :mod:`.tensors`; version 1's list of records is still read), the type-tagged tree of everything else, and the
  user's metadata.
- :class:`StepManifest` (``manifest.json``): the step, the world size, and every rank manifest with its size and
  checksum. Writing it is the commit: it is always the last file written in a step folder.

Parsing trusts nothing: every field is type-checked, every file name must be one safe path component, every byte
range must lie inside its file, and every size is checked before anything of that size is allocated. Memory is
bounded per byte of a manifest: no manifest is read past :data:`MAX_MANIFEST_BYTES`, one whose parse would take more
than :data:`.checks.JSON_MEMORY_PER_BYTE` bytes per byte is refused before it is parsed
(:func:`.checks.check_json_memory`), and a parse that runs out of memory all the same is reported as corruption,
so a reader falls back to another copy. Saves refuse to write what readers would refuse to read
(:func:`check_writable`).
"""

from __future__ import annotations

import builtins
import json
import math
import operator
import time
from dataclasses import dataclass, field, fields
from typing import Any

from .._version import __version__
from ..errors import CorruptCheckpointError
from . import hashing, layout
from .checks import JSON_MEMORY_PER_BYTE, check_json_memory, check_shape, json_memory_estimate, unique_keys
from .dtypes import ITEMSIZE
from .layout import check_file_name
from .shards import MeshIndex
from .tensors import (
    COLUMNS,
    TENSOR_KINDS,
    TensorRecord,
    encode_table,
    table_items,
    table_records,
)

FORMAT = "tierckpt"
FORMAT_VERSION = 2
#: The version written for a manifest that references files of earlier steps (an incremental step): readers that
#: predate references refuse it instead of looking for those files in the step's own folder. Steps without
#: references keep :data:`FORMAT_VERSION`.
REFS_FORMAT_VERSION = 3
#: No manifest is read (or written) if larger than this (bytes). Saves write about 250 bytes per tensor record (400
#: with a DTensor shard's description) and its key path in the tree: this holds some 300,000 sharded records per
#: rank (a 600-layer-equivalent MoE with unfused experts and Adam states), and parses in under 1 GiB.
MAX_MANIFEST_BYTES = 128 << 20
#: bounds of a rank's mesh index (:mod:`.shards`): the meshes its shards lie on, and their dimensions
MAX_MESHES = 64
MAX_MESH_DIMS = 16
#: bound on the earlier steps one step may reference
MAX_REFS = 4096
#: Format versions this library reads (1: one JSON object per tensor record; 2: the tensor table of :mod:`.tensors`;
#: 3: version 2 plus files held in earlier steps' folders, :attr:`FileRecord.in_step`).
READS_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    checksum: str
    data_start: int
    #: Set in a remote copy stored compressed: the codec ("zstd") and the stored (compressed) size.
    compression: str | None = None
    stored_size: int | None = None
    #: The earlier committed step whose folder holds this file (an incremental step references that step's stored
    #: bytes instead of writing them again); None: the file is in this step's own folder.
    in_step: int | None = None
    #: A file this step shares with others (``in_step``, or carried over from one, :mod:`tierckpt.tiers.uploader`):
    #: every segment end of the stored file after its header's (each tensor's end, in file order,
    #: those this manifest does not list included), so that the file's checksum can be verified whole though this
    #: step uses only some of its tensors.
    cuts: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = _shallow(self)
        if d["in_step"] is None:  # a step without references keeps the version-2 form
            del d["in_step"]
        if self.cuts:
            d["cuts"] = list(self.cuts)
        else:
            del d["cuts"]
        return d


def folder_of(step: int, f: FileRecord) -> str:
    """The step folder (relative to the tier's root) that holds file ``f`` of a manifest of ``step``: its own, or
    the earlier step it references. Never leaves the root: both are step numbers, not paths."""
    return layout.step_dir(step if f.in_step is None else f.in_step)


def file_rel(step: int, f: FileRecord) -> str:
    """Where file ``f`` of a manifest of ``step`` is stored, relative to the tier's root."""
    return f"{folder_of(step, f)}/{f.name}"


def shared_steps(files: tuple[FileRecord, ...] | list[FileRecord]) -> tuple[int, ...]:
    """The earlier steps whose folders hold some of ``files``, sorted."""
    return tuple(sorted({f.in_step for f in files if f.in_step is not None}))


@dataclass(frozen=True)
class RankManifest:
    step: int
    rank: int
    world_size: int
    save_id: str
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    tree: Any
    metadata: Any = None
    created: float = field(default_factory=time.time)
    library_version: str = __version__
    format_version: int = FORMAT_VERSION
    hash_algorithm: str = hashing.ALGORITHM

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def shared_bytes(self) -> int:
        """Bytes of the files this step references in earlier steps' folders (part of :attr:`total_bytes`)."""
        return sum(f.size for f in self.files if f.in_step is not None)

    def to_bytes(self) -> bytes:
        """The sealed manifest in the current format (whatever version it was read from)."""
        d = _shallow(self)
        d["files"] = [f.to_json() for f in self.files]
        d["tensors"] = encode_table(self.tensors)
        d["format"] = FORMAT + ".rank"
        shares = any(f.in_step is not None or f.cuts for f in self.files)
        d["format_version"] = REFS_FORMAT_VERSION if shares else FORMAT_VERSION
        return check_writable(_seal(d), "rank manifest", self.step)

    @classmethod
    def from_bytes(cls, raw: bytes, *, step: int | None = None, path: str | None = None,
                   digest_verified: bool = False) -> RankManifest:
        """Parse and check a rank manifest. ``digest_verified``: the caller matched these exact bytes against the
        digest its step manifest records, so the embedded checksum (a second, slower check of the same bytes:
        re-encoding 10,000 tensor records costs tens of ms) is skipped; every field is still checked."""
        try:
            return cls._parse(raw, step=step, path=path, digest_verified=digest_verified)
        except MemoryError:
            raise _out_of_memory(raw, step, path) from None

    @classmethod
    def _parse(cls, raw: bytes, *, step: int | None, path: str | None, digest_verified: bool) -> RankManifest:
        d = _unseal(raw, FORMAT + ".rank", step=step, path=path, check=not digest_verified)
        g = _Getter(d, step, path)
        own_step = g.int("step")
        refs_allowed = g.int("format_version") >= REFS_FORMAT_VERSION
        files = []
        for i, fd in enumerate(g.list("files")):
            fg = _Getter(fd, step, path, f"files[{i}]")
            size = fg.int("size")
            data_start = fg.int("data_start")
            if data_start > size:
                raise CorruptCheckpointError(f"files[{i}].data_start beyond its size", step=step, path=path)
            comp = fg.opt_str("compression")
            if comp not in (None, "zstd"):
                raise CorruptCheckpointError(f"unknown compression {comp!r}", step=step, path=path)
            in_step = fg.opt_int("in_step")
            if in_step is not None and (not refs_allowed or in_step >= own_step):
                raise CorruptCheckpointError(f"files[{i}].in_step {in_step} is not an earlier step"
                                             if refs_allowed else f"files[{i}].in_step in a version-"
                                             f"{g.int('format_version')} manifest", step=step, path=path)
            cuts = _cuts(fd.get("cuts") if refs_allowed else None, data_start, size, f"files[{i}]", step, path)
            files.append(
                FileRecord(
                    name=check_file_name(fg.str("name"), step=step, path=path),
                    size=size,
                    checksum=fg.str("checksum"),
                    data_start=data_start,
                    compression=comp,
                    stored_size=fg.opt_int("stored_size"),
                    in_step=in_step,
                    cuts=cuts,
                )
            )
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise CorruptCheckpointError("duplicate file names in manifest", step=step, path=path)
        if g.int("format_version") == 1:
            items = g.list("tensors")
            tensors = _well_formed_tensors(items, files)
        else:
            items = _table_columns(g.raw("tensors"), step, path)
            tensors = table_records(items, [f.data_start for f in files], [f.size for f in files])
            if tensors is None:
                items = table_items(items)
        if tensors is None:  # field by field: names the first record and field at fault
            tensors = _checked_tensors(items, files, step, path)
        world = g.int("world_size")
        rank = g.int("rank")
        if world < 1 or rank >= world:
            raise CorruptCheckpointError(f"rank {rank} outside world size {world}", step=step, path=path)
        return cls(
            step=g.int("step"),
            rank=rank,
            world_size=world,
            save_id=g.str("save_id"),
            files=tuple(files),
            tensors=tuple(tensors),
            tree=g.raw("tree"),
            metadata=d.get("metadata"),
            created=g.num("created"),
            library_version=g.str("library_version"),
            format_version=g.int("format_version"),
            hash_algorithm=g.str("hash_algorithm"),
        )


def _table_columns(table: Any, step: int | None, path: str | None) -> list[list[Any]]:
    """The columns of a version-2 tensor table, in :data:`.tensors.COLUMNS` order, checked to be lists of one
    length."""
    if type(table) is not dict or table.keys() != set(COLUMNS):
        raise CorruptCheckpointError(f"manifest field tensors is not a table of the columns {', '.join(COLUMNS)}",
                                     step=step, path=path)
    cols = [table[c] for c in COLUMNS]
    bad = next((c for c, col in zip(COLUMNS, cols) if type(col) is not list or len(col) != len(cols[0])), None)
    if bad is not None:
        raise CorruptCheckpointError(f"manifest field tensors.{bad} is not a list as long as tensors.name",
                                     step=step, path=path)
    return cols


def _checked_tensors(items: list[Any], files: list[FileRecord], step: int | None,
                     path: str | None) -> list[TensorRecord]:
    """The tensor records, each field checked on its own so that an error names it."""
    tensors = []
    for i, td in enumerate(items):
        tg = _Getter(td, step, path, f"tensors[{i}]")
        dtype = tg.str("dtype")
        if dtype not in ITEMSIZE:
            raise CorruptCheckpointError(f"tensors[{i}]: unknown dtype {dtype!r}", step=step, path=path)
        shape = check_shape(tg.raw("shape"), f"tensors[{i}]")
        fidx, offset, nbytes = tg.int("file"), tg.int("offset"), tg.int("nbytes")
        if fidx >= len(files) or offset + nbytes > files[fidx].size or offset < files[fidx].data_start:
            raise CorruptCheckpointError(f"tensors[{i}]: byte range outside its file", step=step, path=path)
        if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
            raise CorruptCheckpointError(f"tensors[{i}]: nbytes does not match shape/dtype", step=step, path=path)
        kind = tg.str("kind")
        if kind not in TENSOR_KINDS:
            raise CorruptCheckpointError(f"tensors[{i}]: unknown kind {kind!r}", step=step, path=path)
        if tg.int("index") != i:
            raise CorruptCheckpointError(f"tensors[{i}]: index out of order", step=step, path=path)
        shard = _shard(td.get("shard"), shape, f"tensors[{i}]", step, path)
        tensors.append(
            TensorRecord(i, tg.str("name"), tg.str("path"), dtype, shape, fidx, offset, nbytes, tg.str("checksum"),
                         kind, shard)
        )
    return tensors


_INDEX = operator.itemgetter("index")
_V1_COLUMNS = [operator.itemgetter(c) for c in COLUMNS if c != "shard"]


def _well_formed_tensors(items: list[Any], files: list[FileRecord]) -> list[TensorRecord] | None:
    """The tensor records of a version-1 manifest when every one passes the same checks as
    :func:`_checked_tensors`'s field-by-field loop, by turning the records into the version-2 table's columns and
    taking its fast path (:func:`.tensors.table_records`); None at the first doubt (a shard, a missing or odd field),
    and the field-by-field loop then names the problem or accepts what this path does not handle. Records without a
    ``shard`` field (older manifests) and extra fields are accepted, as by that loop."""
    if not set(map(type, items)) <= {dict}:
        return None
    try:
        index = list(map(_INDEX, items))
        cols = [list(map(get, items)) for get in _V1_COLUMNS]
    except KeyError:
        return None
    if not set(map(type, index)) <= {int} or index != list(range(len(items))):
        return None
    cols.append([td.get("shard") for td in items])
    return table_records(cols, [f.data_start for f in files], [f.size for f in files])


@dataclass(frozen=True)
class RankRef:
    """A step manifest's reference to one rank's manifest: its name, size and checksum, and the rank's coordinates
    on the device meshes of its distributed-tensor shards (:mod:`.shards`; empty without any)."""

    rank: int
    name: str
    size: int
    checksum: str
    mesh: MeshIndex = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "name": self.name, "size": self.size, "checksum": self.checksum}
        if self.mesh:
            d["mesh"] = {k: list(c) for k, c in self.mesh}
        return d


@dataclass(frozen=True)
class StepManifest:
    step: int
    world_size: int
    save_id: str
    #: The rank manifests of this copy: every rank of the job, or (a node's copy of a multi-rank step) the ranks in
    #: ``holds_ranks``, so that a node's copy stays O(its ranks) whatever the world size.
    ranks: tuple[RankRef, ...]
    #: Bytes of every rank's shards (the whole step, also in a node's copy)
    total_bytes: int
    metadata: Any = None
    created: float = field(default_factory=time.time)
    #: Which ranks' shards this copy holds: None for all (remote tiers, single-rank steps); a node-local tier of a
    #: multi-rank job holds only the ranks of that node.
    holds_ranks: tuple[int, ...] | None = None
    library_version: str = __version__
    format_version: int = FORMAT_VERSION
    hash_algorithm: str = hashing.ALGORITHM
    #: The earlier steps whose folders hold files this step's rank manifests reference (sorted; empty for a step
    #: that holds all its bytes): retention keeps those steps while this one is kept.
    refs: tuple[int, ...] = ()
    #: Bytes of :attr:`total_bytes` held in those earlier steps' folders (the rest, this step's own).
    shared_bytes: int = 0

    def to_bytes(self) -> bytes:
        """The sealed manifest in the current format (whatever version it was read from)."""
        d = _shallow(self)
        d["ranks"] = [r.to_json() for r in self.ranks]
        d["format"] = FORMAT + ".step"
        if self.refs:
            d["refs"] = list(self.refs)
            d["format_version"] = REFS_FORMAT_VERSION
        else:  # a step without references keeps the version-2 form
            del d["refs"], d["shared_bytes"]
            d["format_version"] = FORMAT_VERSION
        return check_writable(_seal(d), "step manifest", self.step)

    @classmethod
    def from_bytes(cls, raw: bytes, *, step: int | None = None, path: str | None = None) -> StepManifest:
        """Parse and check a step manifest (its embedded checksum included); :class:`CorruptCheckpointError` for
        anything amiss, a parse that runs out of memory included."""
        try:
            return cls._parse(raw, step=step, path=path)
        except MemoryError:
            raise _out_of_memory(raw, step, path) from None

    @classmethod
    def _parse(cls, raw: bytes, *, step: int | None, path: str | None) -> StepManifest:
        d = _unseal(raw, FORMAT + ".step", step=step, path=path)
        g = _Getter(d, step, path)
        world = g.int("world_size")
        holds = _holds_ranks(d.get("holds_ranks"), world, step, path)
        listed = len(g.list("ranks"))
        if listed != world and (holds is None or listed != len(holds)):
            raise CorruptCheckpointError(f"manifest lists {listed} ranks for world size {world}", step=step, path=path)
        ranks = []
        for i, rd in enumerate(g.list("ranks")):
            rg = _Getter(rd, step, path, f"ranks[{i}]")
            ranks.append(
                RankRef(rg.int("rank"), check_file_name(rg.str("name"), step=step, path=path), rg.int("size"),
                        rg.str("checksum"), _mesh_index(rd.get("mesh"), step, path))
            )
        # a copy lists every rank of the job, or (a node's copy of a multi-rank step) exactly the ranks it holds
        expected = list(range(world)) if listed == world else list(holds or ())
        if world < 1 or sorted(r.rank for r in ranks) != expected:
            raise CorruptCheckpointError(f"manifest does not list exactly ranks 0..{world - 1}" if listed == world
                                         else f"manifest does not list exactly the ranks it holds, {expected}",
                                         step=step, path=path)
        m = cls(
            step=g.int("step"),
            world_size=world,
            save_id=g.str("save_id"),
            ranks=tuple(sorted(ranks, key=lambda r: r.rank)),
            total_bytes=g.int("total_bytes"),
            metadata=d.get("metadata"),
            created=g.num("created"),
            library_version=g.str("library_version"),
            format_version=g.int("format_version"),
            hash_algorithm=g.str("hash_algorithm"),
            holds_ranks=holds,
            refs=_refs(d.get("refs"), g.int("step"), g.int("format_version"), step, path),
            shared_bytes=g.opt_int("shared_bytes") or 0,
        )
        if m.shared_bytes > m.total_bytes or bool(m.shared_bytes) and not m.refs:
            raise CorruptCheckpointError(f"manifest claims {m.shared_bytes} shared bytes of {m.total_bytes}"
                                         + ("" if m.refs else " but references no step"), step=step, path=path)
        if step is not None and m.step != step:
            raise CorruptCheckpointError(f"manifest is for step {m.step}, found in the folder of step {step}",
                                         step=step, path=path)
        return m


def _cuts(v: Any, data_start: int, size: int, where: str, step: int | None, path: str | None) -> tuple[int, ...]:
    """A referenced file's segment ends: non-decreasing (an empty tensor's segment ends where the one before it
    does), none inside its header, the last one its size."""
    if v is None:
        return ()
    if (not isinstance(v, list) or not v or not all(type(c) is int for c in v)
            or v[0] < data_start or v[-1] != size or any(a > b for a, b in zip(v, v[1:]))):
        raise CorruptCheckpointError(f"{where}: bad cuts {str(v)[:80]}", step=step, path=path)
    return tuple(v)


def _refs(v: Any, own: int, version: int, step: int | None, path: str | None) -> tuple[int, ...]:
    """A step manifest's ``refs``: distinct earlier steps in ascending order (version 3 on)."""
    if v is None:
        return ()
    if (version < REFS_FORMAT_VERSION or not isinstance(v, list) or len(v) > MAX_REFS
            or not all(type(s) is int and 0 <= s < own for s in v) or sorted(set(v)) != v):
        raise CorruptCheckpointError(f"bad refs {str(v)[:80]}", step=step, path=path)
    return tuple(v)


def _mesh_index(v: Any, step: int | None, path: str | None) -> MeshIndex:
    if v is None:
        return ()
    ok = isinstance(v, dict) and len(v) <= MAX_MESHES and all(
        isinstance(k, str) and len(k) <= 256 and isinstance(c, list) and len(c) <= MAX_MESH_DIMS
        and all(type(i) is int and i >= 0 for i in c) for k, c in v.items())
    if not ok:
        raise CorruptCheckpointError("manifest has a malformed mesh index", step=step, path=path)
    return tuple(sorted((k, tuple(c)) for k, c in v.items()))


def _holds_ranks(v: Any, world: int, step: int | None, path: str | None) -> tuple[int, ...] | None:
    if v is None:
        return None
    if (
        not isinstance(v, list)
        or not all(type(r) is int and 0 <= r < world for r in v)
        or sorted(set(v)) != v
        or not v
    ):
        raise CorruptCheckpointError(f"bad holds_ranks {str(v)[:80]}", step=step, path=path)
    return tuple(v)


def _shard(v: Any, shape: tuple[int, ...], where: str, step: int | None, path: str | None) -> dict[str, Any] | None:
    """A sharded tensor's place in its global tensor: ``{"global_shape": [...], "offset": [...]}`` (+ free-form
    ``placements``/``mesh`` strings for humans); the local shard is the box ``offset .. offset + shape``."""
    if v is None:
        return None
    ok = isinstance(v, dict) and isinstance(v.get("global_shape"), list) and isinstance(v.get("offset"), list)
    if ok:
        gs, off = v["global_shape"], v["offset"]
        ok = (
            len(gs) == len(off) == len(shape)
            and all(type(x) is int and 0 <= x < (1 << 48) for x in gs + off)
            and all(o + s <= g for o, s, g in zip(off, shape, gs))
        )
    if not ok:
        raise CorruptCheckpointError(f"{where}: bad shard description {str(v)[:80]}", step=step, path=path)
    shard: dict[str, Any] = v
    return shard


def _shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, in field order, values as they are (what JSON needs: ``dataclasses.asdict``
    deep-copies every value, which costs seconds for a manifest of 10,000 tensors)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _seal(d: dict[str, Any]) -> bytes:
    """The bytes of a manifest: ``{"checksum":"<hex>",`` then the rest of the canonical JSON of every other field,
    whose hash the checksum is. One encoding serves both (for 10,000 tensors each encoding costs tens of ms)."""
    d.pop("checksum", None)
    canon = hashing.canonical_json(d)
    if not canon.startswith(b"{") or canon == b"{}":
        raise ValueError("a manifest is a non-empty JSON object")
    checksum = hashing.digest(canon).hex()
    d["checksum"] = checksum
    return b'{"checksum":"' + checksum.encode() + b'",' + canon[1:]


def check_writable(raw: bytes, what: str, step: int) -> bytes:
    """``raw``, a manifest about to be written, if a reader will read it (its size and its parse's memory within
    the bounds :func:`_unseal` enforces); else ``ValueError`` saying why, so that a save fails instead of
    committing a step no restore can read."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"step {step}: the {what} would be {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} a "
                         "reader accepts: the state holds too many tensors or too large plain Python values for one "
                         "rank (store large lists as tensors or numpy arrays)")
    try:
        check_json_memory(raw, f"the {what}")
    except CorruptCheckpointError as exc:
        raise ValueError(f"step {step}: {exc.detail}; a reader would refuse it: the state's plain Python values are "
                         "too many small ones (store large lists as tensors or numpy arrays)") from None
    return raw


def _out_of_memory(raw: bytes, step: int | None, path: str | None) -> CorruptCheckpointError:
    need = json_memory_estimate(raw)
    return CorruptCheckpointError(f"manifest of {len(raw)} bytes could not be parsed in the memory available "
                                  f"(estimated {need >> 20} MiB, {need / max(len(raw), 1):.0f} bytes per byte; at most "
                                  f"{JSON_MEMORY_PER_BYTE} are allowed)", step=step, path=path)


def _unseal(raw: bytes, kind: str, *, step: int | None, path: str | None, check: bool = True) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", step=step, path=path)
    check_json_memory(raw, "manifest", step=step, path=path)
    try:
        d = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"unreadable manifest: {exc}", step=step, path=path) from None
    if not isinstance(d, dict) or d.get("format") != kind:
        raise CorruptCheckpointError(f"not a {kind} manifest", step=step, path=path)
    version = d.get("format_version")
    if type(version) is not int or version not in READS_VERSIONS:
        raise CorruptCheckpointError(
            f"manifest format version {version!r} is not supported by tierckpt {__version__} "
            f"(reads up to {READS_VERSIONS[-1]})",
            step=step,
            path=path,
        )
    if d.get("hash_algorithm") != hashing.ALGORITHM:
        raise CorruptCheckpointError(f"unsupported hash algorithm {d.get('hash_algorithm')!r}", step=step, path=path)
    claimed = d.pop("checksum", None)
    if not check:
        if not isinstance(claimed, str):
            raise CorruptCheckpointError("manifest has no checksum", step=step, path=path)
        d.pop("format")
        return d
    try:
        actual = hashing.json_checksum(d)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"manifest not canonical JSON: {exc}", step=step, path=path) from None
    if claimed != actual:
        raise CorruptCheckpointError("manifest checksum mismatch (edited or damaged)", step=step, path=path)
    d.pop("format")
    return d


class _Getter:
    """Typed field access that turns any surprise into a CorruptCheckpointError naming the field."""

    def __init__(self, d: Any, step: int | None, path: str | None, where: str = "") -> None:
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"manifest {where or 'root'} is not an object", step=step, path=path)
        self.d, self.step, self.path, self.where = d, step, path, where

    def _bad(self, key: str, want: str) -> CorruptCheckpointError:
        name = f"{self.where}.{key}" if self.where else key
        return CorruptCheckpointError(f"manifest field {name} missing or not {want}", step=self.step, path=self.path)

    def raw(self, key: str) -> Any:
        if key not in self.d:
            raise self._bad(key, "present")
        return self.d[key]

    def int(self, key: str) -> int:
        v = self.d.get(key)
        if type(v) is not int or v < 0 or v >= 1 << 63:
            raise self._bad(key, "a non-negative integer")
        return v

    def opt_int(self, key: str) -> builtins.int | None:
        return None if self.d.get(key) is None else self.int(key)

    def num(self, key: str) -> float:
        v = self.d.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self._bad(key, "a number")
        return float(v)

    def str(self, key: builtins.str) -> builtins.str:
        v = self.d.get(key)
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        return v

    def opt_str(self, key: builtins.str) -> builtins.str | None:
        return None if self.d.get(key) is None else self.str(key)

    def list(self, key: builtins.str) -> list[Any]:
        v = self.d.get(key)
        if not isinstance(v, list):
            raise self._bad(key, "a list")
        return v
