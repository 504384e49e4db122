"""Persisting a staged snapshot into a store, committed atomically.

Order of operations for one step (the commit protocol of :mod:`tierckpt.storage.commit`):

1. ``protocol.begin`` gives the folder to write into (a ``.tmp-`` folder on POSIX stores);
2. every data file is written from its staging buffer by a pool of threads, in large chunks, then fsync-ed on close;
   a chunk is written only once the snapshot's copy has reached it (``StagedFile.ready``), so writing starts while
   the copy goes on. Each file is hashed from the same buffer (one pass over memory; xxh3 releases the GIL) on
   separate hashing threads once the copy has finished and ``save()`` has returned (``RankSnapshot.hash_gate``: so
   hashing never slows the copy training waits on, nor the disk), or by the writer right before each chunk is
   written when no hashing threads are given;
3. the rank manifest (with every file's and tensor's checksum) is written and fsync-ed;
4. ``manifest.json`` is written and fsync-ed, LAST;
5. ``protocol.commit`` makes the step visible (rename + fsync of the root on POSIX).

Any failure before 5 calls ``protocol.abort``: what was written goes, and an older committed copy of the same step,
if any, is untouched. This module never imports torch: staged files arrive as memoryviews.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import faults
from ..errors import CheckpointError, StorageError
from ..format import hashing, layout
from ..format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from ..format.plan import HEADER_METADATA
from ..format.safetensors import build_header
from ..host import gcpause as _gc
from ..storage.base import Store, join
from ..storage.commit import protocol_for
from .incremental import Baseline, Incremental, Match, pins, step_refs
from .tasks import results, submit_all

log = logging.getLogger(__name__)

#: Bytes per write call: large sequential writes run at the disk's speed. 32 MiB: on the benchmark host's virtual disk
#: (O_DIRECT, 2 files on 2 threads) 16-128 MiB pieces all wrote 2 GiB 6-10% faster than 8 MiB ones, and a 2 GiB save
#: became durable 9% sooner (docs/benchmarks.md); a writer waits for the copy to reach a whole piece, about 2 ms.
WRITE_CHUNK = 32 << 20


class LeafMeta(NamedTuple):
    """One tensor of a staged snapshot (a tuple: thousands are built per save)."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    part: int
    offset: int
    nbytes: int
    shard: dict[str, Any] | None = None


@dataclass(frozen=True)
class StagedFile:
    part: int
    data: memoryview
    data_start: int
    leaves: tuple[int, ...]  # leaf indices in file order
    #: None when ``data`` is complete; else ``ready(end)`` blocks until bytes ``[0, end)`` are (the snapshot is still
    #: being copied in: pipelined copy and write) and raises if that copy failed
    ready: Callable[[int], None] | None = None


@dataclass(frozen=True)
class PersistResult:
    manifest: StepManifest
    rank_manifest: RankManifest
    seconds: float


def _segment_ends(f: StagedFile, leaves: list[LeafMeta]) -> list[int]:
    ends = [f.data_start]
    for i in f.leaves:
        ends.append(leaves[i].offset + leaves[i].nbytes)
    return ends


def _hash_file(f: StagedFile, leaves: list[LeafMeta], snap: RankSnapshot) -> tuple[str, list[bytes]]:
    """The file's checksum and its segments' digests (header, then each tensor), from the staging buffer."""
    if snap.hash_gate is not None:
        snap.hash_gate()
    for g in snap.files:  # every byte in memory (what the gate implies)
        if g.ready is not None:
            g.ready(len(g.data))
    seg = hashing.SegmentHasher(_segment_ends(f, leaves))
    data = f.data
    for start in range(0, len(data), WRITE_CHUNK):
        seg.feed(data[start : start + WRITE_CHUNK])
    return _sums(seg, f"part {f.part}")


def _sums(seg: hashing.SegmentHasher, what: str) -> tuple[str, list[bytes]]:
    """A fully fed file's checksum and its segments' digests."""
    if not seg.done():
        raise CheckpointError(f"internal error: segments of {what} do not cover the file")
    return seg.file_checksum(), seg.digests


def _write_file(store: Store, rel: str, f: StagedFile, leaves: list[LeafMeta] | None) -> tuple[str, list[bytes]] | None:
    """Write one file in large chunks as its bytes arrive; with ``leaves``, also hash each chunk right before it is
    written (one thread does both; used when there are no separate hashing threads)."""
    seg = None if leaves is None else hashing.SegmentHasher(_segment_ends(f, leaves))
    data, ready = f.data, f.ready
    with store.open_write(rel, size_hint=len(data)) as w:
        for start in range(0, len(data), WRITE_CHUNK):
            chunk = data[start : start + WRITE_CHUNK]
            if ready is not None:
                ready(start + len(chunk))
            if seg is not None:
                seg.feed(chunk)
            w.write(chunk)
            if start == 0:
                faults.point("mid-file")
    return None if seg is None else _sums(seg, rel)


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's staged snapshot of one step: what the persist thread hands to the writers."""

    step: int
    rank: int
    world_size: int
    save_id: str
    files: list[StagedFile]
    leaves: list[LeafMeta]
    tree: Any
    metadata: Any
    #: None when the bytes are complete; else blocks until the whole snapshot is copied in and the caller no longer
    #: waits for that copy (raises if it failed): hashing starts then, so that it never competes with training for
    #: the CPU while training is blocked
    hash_gate: Callable[[], None] | None = None


def write_rank(store: Store, folder: str, snap: RankSnapshot, executor: Executor,
               hash_executor: Executor | None = None,
               incremental: tuple[Incremental, Baseline] | None = None) -> tuple[RankManifest, bytes, str]:
    """Write one rank's data files (in parallel) and then its rank manifest into ``folder``.

    With ``hash_executor``, files are hashed there while they are written (a writer thread then only writes, so the
    disk never waits for a hash), and the manifest is built while the last bytes go to disk; without it, each writer
    hashes its chunks on the way. Either way the rank manifest is written only after every data file is durable.
    ``incremental``: the manager's incremental state and the baseline whose stored bytes the step may reference
    (:mod:`.incremental`; needs ``hash_executor``).
    """
    names = [layout.data_file_name(snap.rank, f.part, snap.save_id) for f in snap.files]
    if incremental is not None and hash_executor is not None:
        rank_manifest, raw = _write_incremental(store, folder, snap, names, executor, hash_executor, *incremental)
        rname = layout.rank_manifest_name(snap.rank, snap.save_id)
        faults.point("before-manifest")
        store.write_bytes(join(folder, rname), raw)  # only now: every data file is durable
        return rank_manifest, raw, rname
    inline = None if hash_executor is not None else snap.leaves
    writes = submit_all(executor, lambda fn: _write_file(store, join(folder, fn[0]), fn[1], inline),
                        list(zip(names, snap.files)))
    if hash_executor is None:
        sums = results(writes)
        with _gc.paused():  # tens of thousands of small objects for a large manifest, none in cycles (gcpause)
            encoded = _encode_rank_manifest(snap, names, sums)
    else:
        # the hashes are ready long before the disk is done: build and encode the manifest meanwhile
        try:
            sums = results(submit_all(hash_executor, lambda f: _hash_file(f, snap.leaves, snap), snap.files))
            with _gc.paused():
                encoded = _encode_rank_manifest(snap, names, sums)
        except BaseException:
            wait(writes)  # no write may outlive this call: the slot is released after it
            raise
        results(writes)
    rank_manifest, raw = encoded
    rname = layout.rank_manifest_name(snap.rank, snap.save_id)
    faults.point("before-manifest")
    store.write_bytes(join(folder, rname), raw)  # only now: every data file is durable
    return rank_manifest, raw, rname


def _encode_rank_manifest(snap: RankSnapshot, names: list[str],
                          sums: list[tuple[str, list[bytes]]]) -> tuple[RankManifest, bytes]:
    file_records = []
    tensor_sums: dict[int, str] = {}
    for f, name, (checksum, digests) in zip(snap.files, names, sums):
        file_records.append(FileRecord(name=name, size=len(f.data), checksum=checksum, data_start=f.data_start))
        for i, d in zip(f.leaves, digests[1:]):
            tensor_sums[i] = d.hex()
    tensors = tuple(
        TensorRecord(i, m.name, m.path, m.dtype, m.shape, m.part, m.offset, m.nbytes, tensor_sums.get(i, ""), m.kind,
                     m.shard)
        for i, m in enumerate(snap.leaves)
    )
    rank_manifest = RankManifest(
        step=snap.step, rank=snap.rank, world_size=snap.world_size, save_id=snap.save_id, files=tuple(file_records),
        tensors=tensors, tree=snap.tree, metadata=snap.metadata,
    )
    return rank_manifest, rank_manifest.to_bytes()


def persist(store: Store, snap: RankSnapshot, executor: Executor,
            hash_executor: Executor | None = None, incremental: Incremental | None = None) -> PersistResult:
    """Write, checksum and commit one rank's snapshot as step ``step`` (single-rank steps commit here).
    ``incremental``: reference the unchanged tensors' bytes in an earlier committed step (:mod:`.incremental`)."""
    t0 = time.perf_counter()
    step, rank, save_id = snap.step, snap.rank, snap.save_id
    protocol = protocol_for(store)
    folder = layout.tmp_dir(step, save_id)
    baseline = None if incremental is None else incremental.baseline_for(store, step)
    try:
        with pins(store, () if baseline is None else baseline.steps):
            if baseline is not None and not baseline.still_stored(store):
                log.info("tier %s: step %d written whole: its baseline step %d is no longer stored", store.tier, step,
                         baseline.step)
                baseline = None
            folder = protocol.begin(store, step, save_id)
            if incremental is None or baseline is None:
                rank_manifest, raw, rname = write_rank(store, folder, snap, executor, hash_executor)
            else:
                rank_manifest, raw, rname = write_rank(store, folder, snap, executor, hash_executor,
                                                       incremental=(incremental, baseline))
            refs, shared = step_refs([rank_manifest])
            manifest = StepManifest(
                step=step, world_size=snap.world_size, save_id=save_id,
                ranks=(RankRef(rank, rname, len(raw), hashing.digest(raw).hex()),),
                total_bytes=rank_manifest.total_bytes, metadata=snap.metadata, refs=refs, shared_bytes=shared,
            )
            store.write_bytes(join(folder, layout.STEP_MANIFEST), manifest.to_bytes())
            faults.point("after-manifest")
            faults.point("before-rename")
            protocol.commit(store, folder, step)
            faults.point("after-rename")
    except BaseException as exc:
        try:
            protocol.abort(store, folder, step)
        except Exception as cleanup_exc:  # pragma: no cover - best effort
            log.warning("tier %s: cleanup after failed save of step %d failed: %s", store.tier, step, cleanup_exc)
        if isinstance(exc, CheckpointError):
            raise
        if isinstance(exc, OSError):
            raise StorageError(f"writing the checkpoint failed: {exc}", step=step, tier=store.tier,
                               path=getattr(exc, "filename", None) or f"{store.url}/{folder}") from exc
        raise
    if incremental is not None:  # the next save's baseline
        incremental.committed(rank_manifest, full=not refs)
    seconds = time.perf_counter() - t0
    where = f" ({shared / 2**20:.1f} MiB of them referenced in steps {list(refs)})" if refs else ""
    log.info("tier %s: committed step %d (%.1f MiB%s) at %s/%s in %.3f s", store.tier, step,
             rank_manifest.total_bytes / 2**20, where, store.url, layout.step_dir(step), seconds)
    return PersistResult(manifest, rank_manifest, seconds)


class _Done(NamedTuple):
    """What became of one staged file in an incremental save."""

    #: the file as written in this step's folder (None: every tensor of it is referenced)
    record: FileRecord | None
    #: each leaf's place: (its leaf index, the referenced file or None for this step's own, offset in that file)
    places: list[tuple[int, FileRecord | None, int]]
    #: each leaf's checksum (hex), by leaf index
    sums: dict[int, str]
    #: whether some of its tensors were (or, written whole, could have been) referenced
    skippable: bool


def _matches(f: StagedFile, leaves: list[LeafMeta], digests: list[bytes], baseline: Baseline) -> list[Match | None]:
    """For each leaf of ``f`` (file order) where the baseline stores the same bytes, or None."""
    return [baseline.match(leaves[i].name, leaves[i].dtype, leaves[i].shape, leaves[i].nbytes, d.hex(),
                           leaves[i].shard)
            for i, d in zip(f.leaves, digests[1:])]


def _write_incremental(store: Store, folder: str, snap: RankSnapshot, names: list[str], executor: Executor,
                       hash_executor: Executor, inc: Incremental, baseline: Baseline) -> tuple[RankManifest, bytes]:
    """Write the files of an incremental save (see :mod:`.incremental`): a file whose last save skipped tensors (or
    that has no history) is hashed first, and only its changed tensors are written, as a smaller safetensors file
    of the same name (none when nothing changed); any other file is written whole while it is hashed, as in a full
    save. Returns the rank manifest and its bytes, built while the last writes run; waits for every write before
    returning or raising."""
    leaves = snap.leaves

    def hash_first(k: int) -> _Done:
        f, rel = snap.files[k], join(folder, names[k])
        checksum, digests = hash_executor.submit(_hash_file, f, leaves, snap).result()
        refs = _matches(f, leaves, digests, baseline)
        sums = {i: d.hex() for i, d in zip(f.leaves, digests[1:])}
        if not any(r is not None for r in refs):
            _write_file(store, rel, f, None)
            rec = FileRecord(name=names[k], size=len(f.data), checksum=checksum, data_start=f.data_start)
            return _Done(rec, [(i, None, leaves[i].offset) for i in f.leaves], sums, False)
        changed = [(i, d) for i, d, r in zip(f.leaves, digests[1:], refs) if r is None]
        places: list[tuple[int, FileRecord | None, int]] = [
            (i, r.file, r.offset) for i, r in zip(f.leaves, refs) if r is not None]
        own: FileRecord | None = None
        if changed:
            header = build_header([(leaves[i].name, leaves[i].dtype, leaves[i].shape, leaves[i].nbytes)
                                   for i, _d in changed], HEADER_METADATA)
            pos = len(header)
            with store.open_write(rel, size_hint=pos + sum(leaves[i].nbytes for i, _d in changed)) as w:
                w.write(header)
                for i, _d in changed:
                    m = leaves[i]
                    for start in range(m.offset, m.offset + m.nbytes, WRITE_CHUNK):
                        w.write(f.data[start : min(start + WRITE_CHUNK, m.offset + m.nbytes)])
                    places.append((i, None, pos))
                    pos += m.nbytes
            own = FileRecord(name=names[k], size=pos, checksum=hashing.file_checksum(
                [hashing.digest(header), *(d for _i, d in changed)]), data_start=len(header))
        return _Done(own, places, sums, True)

    def straight(k: int) -> _Done:
        f = snap.files[k]
        checksum, digests = hashed[k].result()
        refs = _matches(f, leaves, digests, baseline)
        rec = FileRecord(name=names[k], size=len(f.data), checksum=checksum, data_start=f.data_start)
        return _Done(rec, [(i, None, leaves[i].offset) for i in f.leaves],
                     {i: d.hex() for i, d in zip(f.leaves, digests[1:])}, any(r is not None for r in refs))

    with inc.lock:
        first = [inc.hash_first.get(f.part, True) for f in snap.files]
    hashed = {k: hash_executor.submit(_hash_file, f, leaves, snap) for k, f in enumerate(snap.files) if not first[k]}
    jobs: list[Future[Any]] = [executor.submit(hash_first, k) if first[k]
            else executor.submit(_write_file, store, join(folder, names[k]), f, None)
            for k, f in enumerate(snap.files)]
    try:
        # the straight files' hashes are ready long before the disk is done: the manifest is built meanwhile
        done: list[_Done] = [jobs[k].result() if first[k] else straight(k) for k in range(len(snap.files))]
        with _gc.paused():  # tens of thousands of small objects for a large manifest, none in cycles (gcpause)
            encoded = _encode_places(snap, names, done)
    finally:
        wait([*jobs, *hashed.values()])  # no write may outlive this call: the slot is released after it
    for job in jobs:
        job.result()  # a failed write fails the save
    with inc.lock:
        for f, d in zip(snap.files, done):
            inc.hash_first[f.part] = d.skippable
    return encoded


def _encode_places(snap: RankSnapshot, names: list[str], done: list[_Done]) -> tuple[RankManifest, bytes]:
    """The rank manifest of an incremental save: this step's own files first (in part order), then each referenced
    file once, and every tensor at its place in one of them."""
    files: list[FileRecord] = []
    index: dict[tuple[int | None, str], int] = {}
    for d in done:
        if d.record is not None:
            index[(None, d.record.name)] = len(files)
            files.append(d.record)
    for d in done:
        for _i, ref, _o in d.places:
            if ref is not None and (ref.in_step, ref.name) not in index:
                index[(ref.in_step, ref.name)] = len(files)
                files.append(ref)
    where: dict[int, tuple[int, int]] = {}
    sums: dict[int, str] = {}
    for d in done:
        own = None if d.record is None else index[(None, d.record.name)]
        for i, ref, off in d.places:
            where[i] = (own if ref is None else index[(ref.in_step, ref.name)], off)  # type: ignore[assignment]
        sums.update(d.sums)
    tensors = tuple(
        TensorRecord(i, m.name, m.path, m.dtype, m.shape, where[i][0], where[i][1], m.nbytes, sums.get(i, ""), m.kind,
                     m.shard)
        for i, m in enumerate(snap.leaves)
    )
    rank_manifest = RankManifest(
        step=snap.step, rank=snap.rank, world_size=snap.world_size, save_id=snap.save_id, files=tuple(files),
        tensors=tensors, tree=snap.tree, metadata=snap.metadata,
    )
    return rank_manifest, rank_manifest.to_bytes()
