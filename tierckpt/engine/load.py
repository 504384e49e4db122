"""Template-free loading: a committed step read back as plain Python values, with no state to load into
(:meth:`CheckpointManager.load`).

Choosing the copy is restore's rule (:mod:`.restore`): newest step first (or exactly the one asked for), the local
tier before the remote; a copy that is corrupt or missing (its manifest gone, a data file short, a checksum wrong,
this rank's shard not held there) is logged with the files at fault and the next copy, then the next older step, is
tried. A key that the step does not hold is not corruption: it raises at once.

Reading: every record the result needs is read straight into the tensor or array that is returned, allocated
for it once the files' sizes on the store match the manifest, the records wanted from each file are known not to
overlap, and a file whose size is not backed by stored bytes (a sparse file) has matched its checksum
(:mod:`.tiers.backing`): so a damaged manifest cannot make this allocate more than the files hold. A data file
is read whole by the restore's reader (:func:`.tiers.reader.read_file_into`, which checks the file's checksum)
where it is compressed (decompressed into a scratch buffer of its size, copied out once
verified), or where it lies on a local path and every tensor in it is wanted (read scattered into the tensors;
only the header lands in a scratch buffer whose other pages are never touched). Otherwise only the byte ranges of
the wanted tensors are read, adjacent ones together (one vectored read, or one ranged request of an object store,
per :data:`RUN_BYTES`), and each tensor's bytes are matched against its own checksum in the rank manifest (the
digest that file's checksum is made of). So ``keys=["model"]`` reads no byte of the optimizer's tensors (unless a
file is compressed), and a load holds one copy of what it returns, plus at most one compressed file, or
:data:`RUN_BYTES`, per io thread while it reads.

Invariants: nothing is unpickled or imported (the tree is JSON, decoded by :func:`.snapshot.decode.decode_tree`); no
byte reaches the caller unverified; no collective call is made (each rank of a multi-rank job loads its own saved
tree independently, so calling this on one rank or on all cannot deadlock).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from ..format import hashing, layout
from ..format.manifest import RankManifest, StepManifest, TensorRecord, file_rel
from ..snapshot.decode import decode_tree
from ..snapshot.dtypes import CODE_TO_NUMPY, CODE_TO_TORCH
from ..snapshot.loaded import byte_view
from ..snapshot.staging import aligned_empty
from ..storage.base import Store
from ..storage.readahead import ReadAhead
from ..tiers.backing import prove_backed
from ..tiers.listing import TierListings, first_intact
from ..tiers.memory_restore import MemoryStore, try_memory
from ..tiers.reader import MAX_IOV, READ_CHUNK, check_sizes, read_file_into, read_ranks, read_step
from ..tiers.stream import ends_early_error
from ..tiers.tasks import run_all

log = logging.getLogger(__name__)


class Readers(Protocol):
    """What the readers here need: whose saved part to read and the io and hashing thread pools (a manager's
    :class:`~tierckpt.engine.core.Engine`, or :class:`tierckpt.readonly.Reader` beside a job that owns the root)."""

    rank: int
    io: Executor
    hash: Executor

#: Adjacent wanted tensors of a file read in part are read together up to this many bytes (one ``preadv`` on a
#: local path, one ranged request on an object store); a larger tensor is read on its own, straight into its memory.
RUN_BYTES = READ_CHUNK
#: Tags whose value is an index into the tensor table (see :mod:`.snapshot.tree`).
_RECORD_TAGS = ("$tensor", "$ndarray", "$npscalar", "$generator")

Value = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`CheckpointManager.load` returns (a frozen dataclass; read its fields by name).

    Attributes:
        step: the step that was loaded.
        tier: the tier its bytes came from: ``"memory"`` (this rank's memory copy, ``memory_tier=True``),
            ``"local"`` or ``"remote"``.
        state: the saved state (only the selected top-level keys with ``keys=``) as plain values: nested
            dicts/lists/tuples of CPU tensors, numpy arrays and Python values, each stateful object (a module, an
            optimizer) as its ``state_dict()`` tree.
        metadata: the ``metadata`` that ``save(step, state, metadata=...)`` stored with this rank's part of the
            step (None where none was given).
    """

    step: int
    tier: str
    state: dict
    metadata: Any


def load(eng: Readers, step: int | None, tiers: list[Store], *, keys: Sequence[str] | None,
         listing: TierListings) -> LoadResult:
    """The newest intact step of ``listing`` (or exactly ``step``) from ``tiers``, this rank's saved tree as plain
    values; see the module docstring. ``listing``: the tiers' committed steps; a tier that could not be listed was
    checked by the caller (:meth:`TierListings.require`).

    Raises :class:`CheckpointNotFoundError` when no tier holds a step (or ``step``), or every copy went missing
    while it was read; :class:`CorruptCheckpointError` when copies exist but none verifies;
    :class:`StateMismatchError` (a ``KeyError``) for a key of ``keys`` the step does not hold."""
    s, _store, (tier, state, metadata) = first_intact(
        lambda store, s: _load_served(eng, store, s, keys), tiers, listing.steps, step, what="load",
        skip=(CorruptCheckpointError, CheckpointNotFoundError), verb="loads", tier_of=lambda out: out[0])
    return LoadResult(s, tier, state, metadata)


def _load_served(eng: Readers, store: Store, step: int, keys: Sequence[str] | None) -> tuple[str, dict, Any]:
    """:func:`load_copy`, and the tier that served the bytes: ``"memory"`` where this rank's memory copy of the
    local tier's ``step`` was intact (tried first), else ``store``'s."""
    pool = getattr(eng, "pool", None)
    if pool is not None and pool.memory is not None and store is getattr(eng, "local", None):
        def from_memory(mem: MemoryStore, _disk: Any) -> tuple[dict, Any]:  # this rank's memory copy first
            try:
                return load_copy(eng, mem, step, keys)
            finally:
                mem.close()  # the values are fresh tensors: nothing refers to the mapping

        found = try_memory(pool.memory, store, step, None, from_memory, eng.rank, pool.hold, what="load")
        if found is not None:
            return (MemoryStore.tier, *found)  # type: ignore[misc]
    return (store.tier, *load_copy(eng, store, step, keys))


def load_copy(eng: Readers, store: Store, step: int, keys: Sequence[str] | None) -> tuple[dict, Any]:
    """This rank's saved tree of ``step`` in ``store`` (rank 0's where the saving job had fewer ranks, as restore
    does) as plain values, and its metadata. Raises :class:`CorruptCheckpointError` or
    :class:`CheckpointNotFoundError` for this copy, :class:`StateMismatchError` for a key it does not hold."""
    manifest = read_step(store, step)
    src = eng.rank if eng.rank < manifest.world_size else 0
    rms = read_ranks(store, manifest, [src])
    if not rms:
        raise CheckpointNotFoundError(f"rank {src} is not in the checkpoint", step=step, tier=store.tier,
                                      path=f"{store.url}/{layout.step_dir(step)}")
    rm = rms[0]
    root = select(rm.tree, keys, step=step, tier=store.tier, where=f"{store.url}/{layout.step_dir(step)}")
    shards = {rec.path: rec.index for rec in rm.tensors if rec.shard is not None}
    if keys is None:
        wanted: set[int] = set(range(len(rm.tensors)))
    else:
        wanted, paths = referenced(root, len(rm.tensors))
        wanted.update(shards[p] for p in paths if p in shards)
    values = read_records(eng, store, rm, wanted)
    unsaved: list[str] = []

    def local_shard(path: str) -> Any:
        i = shards.get(path)
        if i is None:  # a replicated shard that another rank stored
            unsaved.append(path)
            return None
        return values[i]

    state = decode_tree(root, rm.tensors, values.__getitem__, step=step, dtensor=local_shard)
    if unsaved:
        log.warning("load: step %d in tier %s (%s): rank %d stored no shard of %d distributed tensor(s) (a replicated "
                    "shard is stored by one rank only); they load as None: %s", step, store.tier, store.url, src,
                    len(unsaved), ", ".join(unsaved[:5]) + (" ..." if len(unsaved) > 5 else ""))
    return state, rm.metadata


def select(tree: Any, keys: Sequence[str] | None, *, step: int, tier: str, where: str) -> Any:
    """The root node of ``tree`` cut down to the top-level ``keys`` (all of it for None), in saved order. Raises
    :class:`StateMismatchError` naming a key the tree does not hold and the keys it does."""
    tag = next((t for t in ("$dict", "$odict") if isinstance(tree, dict) and len(tree) == 1 and t in tree), None)
    if tag is None or not isinstance(tree[tag], list):
        raise CorruptCheckpointError("malformed state tree: root is not a mapping", step=step, tier=tier, path=where)
    if keys is None:
        return tree
    pairs = [p for p in tree[tag] if isinstance(p, list) and len(p) == 2]
    saved = [p[0] for p in pairs]
    missing = [k for k in keys if k not in saved]
    if missing:
        shown = ", ".join(repr(k) if isinstance(k, (str, int)) else "<non-str key>" for k in saved)
        raise StateMismatchError(f"key {missing[0]!r} is not in the saved state; its top-level keys are: "
                                 f"{shown or '(none)'}", step=step, tier=tier, path=where)
    chosen = set(keys)
    return {tag: [p for p in pairs if type(p[0]) is str and p[0] in chosen]}


def referenced(node: Any, n_records: int) -> tuple[set[int], set[str]]:
    """The tensor-table indices (in range) and the distributed tensors' key paths that ``node`` refers to.
    Iterative, so a deep tree cannot exhaust the stack; a malformed reference is left for decoding to report."""
    idx: set[int] = set()
    paths: set[str] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, list):
            stack.extend(cur)
        elif isinstance(cur, dict):
            for tag in _RECORD_TAGS:
                i = cur.get(tag)
                if type(i) is int and 0 <= i < n_records:
                    idx.add(i)
            if isinstance(cur.get("$dtensor"), str):
                paths.add(cur["$dtensor"])
            stack.extend(v for v in cur.values() if isinstance(v, (list, dict)))
    return idx, paths


def read_records(eng: Readers, store: Store, rm: RankManifest, wanted: set[int]) -> dict[int, Value]:
    """Records ``wanted`` of ``rm`` read from ``store`` into fresh tensors and arrays (the caller's to keep), every
    byte verified (see the module docstring); the files are read on the manager's io threads."""
    recs = rm.tensors
    by_file: dict[int, list[TensorRecord]] = {}
    for i in sorted(wanted, key=lambda i: (recs[i].file, recs[i].offset)):
        if recs[i].nbytes:
            by_file.setdefault(recs[i].file, []).append(recs[i])
    # nothing is allocated before: the records' ranges in each file are disjoint, so they add up to at most the file;
    # the sizes on the store match the manifest's; and a file whose size is not backed by data matched its checksum
    _check_disjoint(store, rm, by_file)
    check_sizes(store, dataclasses.replace(rm, files=tuple(rm.files[f] for f in by_file)))
    prove_backed(store, rm, by_file)
    values = {i: _empty(recs[i]) for i in wanted}
    dests = {i: _bytes_of(values[i]) for i in wanted if recs[i].nbytes}
    in_file = [0] * len(rm.files)
    for rec in recs:
        in_file[rec.file] += rec.nbytes > 0
    jobs: list[Callable[[], None]] = []
    for index, file_recs in by_file.items():
        f = rm.files[index]
        if f.compression or (store.local_path is not None and len(file_recs) == in_file[index]):
            jobs.append(partial(_read_whole, eng, store, rm, index, dests))
        else:
            jobs += [partial(_read_run, store, rm, index, run, dests) for run in _runs(file_recs)]
    run_all(eng.io, lambda job: job(), jobs)
    return values


def _check_disjoint(store: Store, rm: RankManifest, by_file: dict[int, list[TensorRecord]]) -> None:
    """:class:`CorruptCheckpointError` when two records of one file (each list sorted by offset) share bytes: every
    byte of a data file belongs to one record (tied tensors are one record referenced twice), and records over the
    same bytes would make a load allocate them again and again."""
    for index, file_recs in by_file.items():
        for prev, rec in zip(file_recs, file_recs[1:]):
            if rec.offset < prev.offset + prev.nbytes:
                name = rm.files[index].name
                raise CorruptCheckpointError(f"tensors {prev.path} and {rec.path} overlap in {name}", step=rm.step,
                                             tier=store.tier, bad_files=[name],
                                             path=f"{store.url}/{file_rel(rm.step, rm.files[index])}")


def _empty(rec: TensorRecord) -> Value:
    if rec.kind == "numpy":
        return np.empty(rec.shape, dtype=CODE_TO_NUMPY[rec.dtype])
    return torch.empty(rec.shape, dtype=CODE_TO_TORCH[rec.dtype])


def _bytes_of(value: Value) -> memoryview:
    """A writable view of a fresh (contiguous) tensor's or array's bytes."""
    if isinstance(value, np.ndarray):
        return memoryview(value.reshape(-1).view(np.uint8))
    return byte_view(value)


def _read_whole(eng: Readers, store: Store, rm: RankManifest, index: int,
                dests: dict[int, memoryview]) -> None:
    """File ``index`` through the restore's reader: its checksum verified, its tensors' bytes in ``dests``."""
    scratch = aligned_empty(rm.files[index].size, pin=False)  # a header only, unless the file is not scattered
    read_file_into(store, rm, index, memoryview(scratch.numpy()), dests, hash_executor=eng.hash)


def _runs(recs: list[TensorRecord]) -> Iterator[list[TensorRecord]]:
    """``recs`` (sorted by offset) cut into runs of adjacent records, each at most :data:`RUN_BYTES` (or one
    larger record) and :data:`MAX_IOV` records."""
    run: list[TensorRecord] = []
    size = 0
    for rec in recs:
        if run and (rec.offset != run[-1].offset + run[-1].nbytes or size + rec.nbytes > RUN_BYTES
                    or len(run) >= MAX_IOV):
            yield run
            run, size = [], 0
        run.append(rec)
        size += rec.nbytes
    if run:
        yield run


def _read_run(store: Store, rm: RankManifest, index: int, run: list[TensorRecord],
              dests: dict[int, memoryview]) -> None:
    """Read one run of adjacent records of file ``index`` into ``dests`` and match each record's bytes, where they
    landed, against its checksum."""
    f = rm.files[index]
    rel = file_rel(rm.step, f)
    start = run[0].offset
    views = [dests[rec.index] for rec in run]
    want = sum(v.nbytes for v in views)
    if store.local_path is not None:
        got = store.readinto_many(rel, start, views)
    else:  # one record: straight into its memory; several (small) ones: into one buffer, then copied out
        into = views[0] if len(views) == 1 else memoryview(bytearray(want))
        got = 0
        with ReadAhead(partial(store.readinto, rel), start, start + want, chunk=READ_CHUNK,
                       window=store.read_concurrency, into=into) as chunks:
            for _, chunk in chunks:
                got += len(chunk)
        if len(views) > 1 and got == want:
            pos = 0
            for v in views:
                v[:] = into[pos : pos + v.nbytes]
                pos += v.nbytes
    if got != want:
        raise ends_early_error(store, rm, index, start + got)
    for rec, view in zip(run, views):
        if hashing.digest(view).hex() != rec.checksum:
            raise CorruptCheckpointError(f"checksum mismatch in {f.name} (tensor {rec.path})", step=rm.step,
                                         tier=store.tier, path=f"{store.url}/{rel}", bad_files=[f.name])


def load_rank_entries(eng: Readers, store: Store, manifest: StepManifest, rank: int, key: str,
                      names: Collection[str] | None = None) -> dict[str, Any]:
    """Entries ``names`` (all with None) of the top-level mapping ``key`` of rank ``rank``'s saved tree, from the
    copy of step ``manifest.step`` in ``store``, as plain values: only those entries' records are read, every byte
    verified as in :func:`load_copy` (used by :mod:`tierckpt.dcp`, whose ranks read other ranks' records).

    Raises :class:`CheckpointNotFoundError` when this copy does not hold ``rank``'s shard,
    :class:`CorruptCheckpointError` for a damaged copy or a name the mapping does not hold (a reader asks only for
    names its step's metadata says were written), :class:`StateMismatchError` when the tree has no key ``key``."""
    step = manifest.step
    rm, where = _rank_manifest(store, manifest, rank)
    root = select(rm.tree, [key], step=step, tier=store.tier, where=where)
    pairs = root[next(iter(root))]
    node = pairs[0][1] if pairs else None
    tag = next((t for t in ("$dict", "$odict") if isinstance(node, dict) and len(node) == 1 and t in node), None)
    if tag is None or not isinstance(node[tag], list):
        raise CorruptCheckpointError(f"rank {rank}'s {key!r} is not a mapping", step=step, tier=store.tier, path=where)
    entries = [p for p in node[tag] if isinstance(p, list) and len(p) == 2 and type(p[0]) is str]
    if names is not None:
        wanted_names = set(names)
        entries = [p for p in entries if p[0] in wanted_names]
        missing = wanted_names - {p[0] for p in entries}
        if missing:
            raise CorruptCheckpointError(f"rank {rank}'s {key!r} lacks {len(missing)} entries its metadata names, "
                                         f"e.g. {sorted(missing)[0]!r}", step=step, tier=store.tier, path=where)
    sub = {"$dict": entries}
    wanted, _ = referenced(sub, len(rm.tensors))
    values = read_records(eng, store, rm, wanted)
    return decode_tree(sub, rm.tensors, values.__getitem__, step=step)


def load_rank_keys(eng: Readers, store: Store, manifest: StepManifest, rank: int,
                   keys: Sequence[str]) -> dict[str, Any]:
    """Top-level ``keys`` of rank ``rank``'s saved tree in the copy of step ``manifest.step`` in ``store``, as plain
    values (every byte verified; no DTensor assembly: a ``$dtensor`` entry decodes as None). Raises as
    :func:`load_rank_entries` does, and :class:`StateMismatchError` for a key the tree does not hold."""
    step = manifest.step
    rm, where = _rank_manifest(store, manifest, rank)
    root = select(rm.tree, keys, step=step, tier=store.tier, where=where)
    wanted, _ = referenced(root, len(rm.tensors))
    values = read_records(eng, store, rm, wanted)
    return decode_tree(root, rm.tensors, values.__getitem__, step=step, dtensor=lambda path: None)


def _rank_manifest(store: Store, manifest: StepManifest, rank: int) -> tuple[RankManifest, str]:
    """Rank ``rank``'s verified manifest in this copy of the step, and the copy's folder URL (for messages)."""
    where = f"{store.url}/{layout.step_dir(manifest.step)}"
    rms = read_ranks(store, manifest, [rank])
    if not rms:
        raise CheckpointNotFoundError(f"rank {rank} is not in the checkpoint", step=manifest.step, tier=store.tier,
                                      path=where)
    return rms[0], where
