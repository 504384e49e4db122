"""Choosing and loading a step: newest first, local tier before remote, every copy verified before use.

A step is tried in each tier that lists it as committed; a copy that fails verification is logged (naming the files)
and the next copy, then the next older step, is tried. State mismatches (keys, shapes, dtypes) are not corruption:
they are raised before the state changes (a staged restore, whose reads into its staging buffer start while the
state is checked, stops them first; an in-place or guarded one checks the state before it reads), and the state is
left untouched.

By default a restore that fails leaves the state as it was. Where the files are local and uncompressed, the
default restore is *guarded*: the bytes of CPU tensors of at least :data:`DIRECT_READ_MIN_BYTES` are read straight
into the tensors, and each range's old bytes are first saved into the staging slot, at the range's place in its
file (:class:`~tierckpt.tiers.undo.UndoLog`); a restore that fails (a checksum, a short file, an interrupt, another
rank that cannot load the step) puts them back before it returns or raises. Elsewhere (remote files, compressed
files, a remote restore cached locally) every byte is read into the slot and verified before the state changes.
Either way the tensors hold the new bytes only once every byte is verified.

``in_place=True`` reads the same large tensors in place without saving anything (no second copy and no state-sized
slot; what DCP users expect at start-up) and copies the smaller ones in from the buffer once verified: the bytes
are still verified before ``restore`` returns, a corrupt copy is still skipped and the next one loaded over it, but
a restore that finds no intact copy leaves the large tensors partly overwritten, and its error says so.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from collections.abc import Callable, MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from ..format import hashing, layout
from ..format.manifest import RankManifest, RankRef, StepManifest, file_rel
from ..format.shards import UnknownPlacement, mesh_key, overlaps, same_box, saved_box
from ..snapshot import hostcopy
from ..snapshot.dtensor import assemble, index_layouts, saved_layouts, target_box, to_live_layout
from ..snapshot.load import plan_restore
from ..snapshot.loaded import LoadedBuffer, byte_view, tensor_view_factory
from ..snapshot.staging import aligned_empty
from ..storage.base import Store, join
from ..storage.commit import protocol_for
from ..tiers.bounce import BOUNCE_PER_THREAD, BOUNCE_SIZE, BounceBuffers
from ..tiers.listing import TierListings, first_intact
from ..tiers.memory_restore import MemoryStore, try_memory
from ..tiers.reader import PendingLoad, buffer_layout, fetch_file, read_ranks, read_step, start_load
from ..tiers.sharded import indexed_rank_manifests
from ..tiers.undo import UndoLog

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger(__name__)

#: ``in_place=True``: live tensors at least this large get their bytes straight from the file (copied out of the
#: bounce buffers, or vectored reads from the page cache; hashed where they land); smaller ones are read with the
#: rest into the buffer and copied in once verified. Below it a scattered read costs more per tensor (its own I/O
#: vector or copy, hash call and byte view: about 7 us) than copying its bytes.
DIRECT_READ_MIN_BYTES = 256 << 10
#: ``in_place=True``: where the bytes not read straight into live tensors (headers, small tensors) are at most this
#: share of the files and no staging slot of the size is ready, they land in a private buffer on small pages,
#: freed after the restore, instead of a fresh staging slot (a fresh slot took 3.1x the time cold and 20x warm at 0.5
#: GiB, 1.3x and 3.8x at 2 GiB: benchmarks/restore_paths.py). Either way they lie at their file offsets, scattered
#: over a state-sized range: in a slot on huge pages each small tensor faulted in a fresh 2 MiB page (the 2 GiB
#: benchmark state touched 132 of them, 264 MiB for 2 MiB of bytes, 4-8 ms each on the benchmark VM), on small pages
#: it faults in 4 KiB ones (511 of them). A slot that is ready costs nothing and is used.
SPARSE_MAX_SHARE = 0.25
#: A default restore is guarded (see the module docstring) where the tensors of at least
#: :data:`DIRECT_READ_MIN_BYTES` hold at least this share of the bytes: it saves their copy after the last read (2
#: GiB: about 90 ms on the benchmark VM) but plans before it reads, where a staged restore plans while the disk
#: works (the benchmark state's 592 tensors: 0.5 ms; more at many small tensors, whose bytes are staged anyway).
#: Measured against staged (benchmarks/restore_paths.py, slot faulted in): 0.85-0.92x cold at 592 tensors, 1.3-1.6x
#: warm, both within the spread two identical paths show on the benchmark VM.
GUARD_MIN_SHARE = 0.5


def restore(eng: Engine, state: MutableMapping[str, Any], step: int | None, tiers: list[Store], *,
            strict: bool, in_place: bool = False, listing: TierListings) -> int | None:
    """Load the newest intact step of ``listing`` (or exactly ``step``) from ``tiers``; see the module docstring.
    ``listing`` is the tiers' committed steps; a tier that could not be listed was checked by the caller
    (:meth:`TierListings.require`)."""
    if step is None and not listing.known():
        return None

    def attempt(store: Store, s: int) -> str:
        prepared = prepare(eng, store, s, state, strict, in_place=in_place)
        prepared.apply()
        return prepared.tier

    found, _store, _ = first_intact(attempt, tiers, listing.steps, step, what="restore",
                                    suffix=_overwritten(in_place), tier_of=str)
    return found


def _overwritten(in_place: bool) -> str:
    return (" (in_place=True: tensors of the state were partly overwritten by the unverified bytes)" if in_place
            else " (the state was not changed)")


class Prepared:
    """A step read and verified into a buffer, not yet applied: ``apply()`` loads it into the state (once),
    ``release()`` gives the buffer back (always; idempotent). A guarded restore's ``undo`` puts the tensors'
    old bytes back on a release without ``apply`` (the other ranks could not load the step). ``tier``: the tier
    whose bytes were read (``"memory"`` for a memory copy of a local step)."""

    def __init__(self, release: Callable[[], None], run: Callable[[], None], undo: UndoLog | None = None, *,
                 tier: str = "") -> None:
        self.tier = tier
        self._release: Callable[[], None] | None = release
        self._run = run
        self._undo = undo

    def apply(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo.discard()
        try:
            self._run()
        finally:
            self.release()

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            undo, self._undo = self._undo, None
            try:
                if undo is not None:
                    undo.rollback()
            finally:
                release()


def prepare(eng: Engine, store: Store, step: int, state: MutableMapping[str, Any], strict: bool,
            given: StepManifest | None = None, *, in_place: bool = False) -> Prepared:
    """Read and verify this rank's part of ``step`` from ``store`` and check it against ``state``; nothing changes
    in ``state`` until :meth:`Prepared.apply`, except the CPU tensors the bytes are read into: with ``in_place``,
    and in a guarded restore (the default on a store of local, uncompressed files), whose :class:`UndoLog` puts
    their old bytes back if the restore fails or is released unapplied. ``given``: the step's ``manifest.json`` in
    ``store`` as another rank read it, cut down to the rank manifest this rank reads (``manifest.json`` is not
    read again, except where this rank needs other ranks' shards)."""
    memory = eng.pool.memory
    if memory is not None and store is eng.local:  # this rank's memory copy of the chosen step first, if intact
        found = try_memory(memory, store, step, given, lambda mem, disk: prepare(
            eng, mem, step, state, strict, disk, in_place=in_place), eng.rank, eng.pool.hold)
        if isinstance(found, Prepared):
            return found
    manifest = given if given is not None else read_step(store, step)
    # Resharding: a job of another size reads the per-rank (non-distributed) values of the same rank, or rank 0's
    # for ranks the saving job did not have; distributed tensors are assembled from whichever shards overlap.
    src = eng.rank if eng.rank < manifest.world_size else 0
    cache = store is not eng.local and eng.options.cache_remote_restores and manifest.world_size == 1
    # caching writes the loaded files from the staging buffer, so it needs every byte there: no direct reads then
    in_place = in_place and not cache
    # the default restore is guarded where its files can be read straight into the tensors: the reads go there, as
    # with ``in_place``, each range's old bytes saved into the staging buffer first, which saves the copy of every
    # byte from the buffer into the tensors after the last read (see .tiers.undo)
    guardable = not in_place and not cache and store.local_path is not None
    # Reads into the staging buffer do not depend on the plan, so they start first and the plan (long at many
    # tensors: it pairs every live tensor, the optimizer's included) runs while the disk works. Direct reads need
    # the plan's targets first, so they start after it. The disk is not asked to read ahead meanwhile
    # (``posix_fadvise(WILLNEED)`` of the files while the plan is made): in place through the page cache
    # (``direct_io=False``), 0.5 GiB cold, restores with it took 1.01x the time of those without at 592 and at
    # 10,000 tensors (4 interleaved rounds), and with ``direct_io`` it would fill the cache the reads then go
    # buffered from.
    holder: dict[str, Any] = {}
    # in place: the reads put all but a small rest straight into live tensors (SPARSE_MAX_SHARE; known before
    # ``alloc`` is called)
    sparse = [False]
    undo: UndoLog | None = None

    def alloc(n: int) -> memoryview:
        mapped = store.staging_buffer(n) if isinstance(store, MemoryStore) else None
        if mapped is not None:  # the memory tier: its bytes are verified where they lie, then copied into the state
            holder["buffer"] = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
            holder["release"] = store.close
            return mapped
        if sparse[0] and not eng.pool.ready(n):
            # only the small rest of the files lands here: a private buffer on small pages, of which only those
            # pages are touched, rather than a fresh state-sized staging slot (see SPARSE_MAX_SHARE)
            buffer = aligned_empty(n, pin=False)
            holder["buffer"], holder["release"] = buffer, lambda: None
            return memoryview(buffer.numpy())
        # a fresh buffer's pages fault in beside the reads that fill it (not beside in-place reads, which leave
        # most of it untouched; a guarded restore saves the old bytes there)
        slot = eng.pool.acquire(n, populate=not in_place)
        slot._headers_for = None  # the checkpoint's bytes will overwrite the headers a save left there
        assert slot.buffer is not None
        holder["buffer"], holder["release"] = slot.buffer, partial(eng.pool.release, slot)
        return memoryview(slot.buffer[:n].numpy())

    pending: PendingLoad | None = None
    direct: dict[int, torch.Tensor] = {}  # record -> live tensor that receives its bytes (in place or guarded)
    scatter: dict[int, memoryview] = {}  # the part of ``direct`` the reads go straight into
    try:
        early: CorruptCheckpointError | None = None
        rms = read_ranks(store, manifest, [src])
        if not rms:
            raise CheckpointNotFoundError(f"rank {src} is not in the checkpoint", step=step, tier=store.tier)
        rm = rms[0]
        direct_reads = in_place or (guardable and _worth_guarding(rm))
        if not direct_reads:
            try:
                pending = start_load(store, rm, alloc, executor=eng.io, hash_executor=eng.hash)
            except CorruptCheckpointError as exc:
                early = exc  # a state mismatch, found by the plan, is the error to report first
        plan = plan_restore(state, rm.tree, rm.tensors, strict=strict, step=step, in_place=direct_reads)
        if early is not None:
            raise early
        if rm.world_size != eng.world_size and not plan.dtensor_targets:
            raise StateMismatchError(
                f"checkpoint was saved by {rm.world_size} ranks, this job has {eng.world_size}: only distributed "
                "tensors (DTensor/FSDP2 state) can be resharded", step=step, tier=store.tier)
        if pending is None:  # the large live tensors' own bytes (plan.direct keeps them alive)
            direct = plan.direct
            # the plan matched each target's dtype and shape to its record: the record's size is the tensor's
            recs = rm.tensors
            scatter = {i: byte_view(t) for i, t in direct.items() if recs[i].nbytes >= DIRECT_READ_MIN_BYTES}
            total = buffer_layout(rm)[1]
            # a guarded restore saves the old bytes at their file offsets: it needs the whole buffer
            sparse[0] = (in_place and bool(scatter)
                         and total - sum(recs[i].nbytes for i in scatter) <= total * SPARSE_MAX_SHARE)
            bounce = None
            if scatter and store.direct_reads:
                bounce = _bounce_buffers(eng, rm, holder, borrow=sparse[0])
            undo = UndoLog() if scatter and not in_place else None
            pending = start_load(store, rm, alloc, executor=eng.io, hash_executor=eng.hash, direct=scatter,
                                 bounce=bounce, undo=undo)
        views, offsets = pending.result()
    except BaseException:
        if pending is not None:
            pending.cancel()  # a state mismatch: stop reading (a failed read: every read has ended already)
        try:
            if undo is not None:  # no read runs any more: the tensors get their old bytes back
                undo.rollback()
        finally:
            if "release" in holder:
                holder["release"]()
        raise
    finally:
        if "bounce_release" in holder:  # every read has ended: the slot the bounce buffers were cut from goes back
            holder.pop("bounce_release")()
    buf: torch.Tensor = holder["buffer"]
    # records read straight into live tensors are not in the buffer
    loaded = LoadedBuffer(buf, tuple(offsets), frozenset(scatter))
    small = {i: t for i, t in direct.items() if i not in loaded.skip}

    def raw(i: int) -> torch.Tensor:
        if i in direct:  # the live tensor itself: the copy in ``apply`` finds nothing to do
            return direct[i].reshape(-1).view(torch.uint8)
        return loaded.bytes_of(rm.tensors[i])

    def run() -> None:
        if small:  # the small targets, from the verified bytes, before anything reads them
            _fill_small_targets(rm, small, loaded)
        # a live target's value is the live tensor itself (``raw``), never a view of the buffer that goes back to
        # the pool: the small targets' bytes are in both, but an optimizer may keep the tensor it is handed
        views_of = tensor_view_factory(rm.tensors, raw, buffer=buf, file_starts=offsets, skip=frozenset(direct))
        plan.apply(rm.tensors, views_of, step=step,
                   dtensor=lambda key: to_live_layout(plan.dtensor_targets[key][0], assembled[key]),
                   loaded=loaded)
        if cache:
            _cache_locally(eng.local, manifest, rm, views)
        elif store.tier == "peer" and eng.peers is not None:  # a replaced node's shard: the node's own step again
            eng.peers.adopt(step)

    prepared = Prepared(holder["release"], run, undo, tier=store.tier)
    try:
        assembled = _assemble_dtensors(eng, store, manifest, plan.dtensor_targets, own=(src, rm, raw),
                                       complete=given is None)
    except BaseException:
        prepared.release()  # a guarded restore's tensors get their old bytes back
        raise
    return prepared


def _worth_guarding(rm: RankManifest) -> bool:
    """Whether a default restore of ``rm`` from local files is guarded (:data:`GUARD_MIN_SHARE`)."""
    if any(f.compression for f in rm.files):
        return False  # a compressed file is decompressed into the buffer: nothing of it can go straight in
    large = sum(t.nbytes for t in rm.tensors if t.nbytes >= DIRECT_READ_MIN_BYTES)
    return large > 0 and large >= GUARD_MIN_SHARE * sum(t.nbytes for t in rm.tensors)


def _fill_small_targets(rm: RankManifest, small: dict[int, torch.Tensor], loaded: LoadedBuffer) -> None:
    """Copy the verified bytes of the in-place targets below :data:`DIRECT_READ_MIN_BYTES` from the loaded buffer
    into their live tensors, in one native call where it is built (else one torch copy each)."""
    idx = list(small)
    dsts = list(small.values())
    ranges = loaded.ranges(rm.tensors, idx) if hostcopy.available else None
    if ranges is not None and hostcopy.copy_from_addresses(dsts, *ranges):
        return

    views = tensor_view_factory(rm.tensors, lambda i: loaded.bytes_of(rm.tensors[i]), buffer=loaded.buffer,
                                file_starts=loaded.file_starts, skip=loaded.skip)
    with torch.no_grad():
        for i, t in small.items():
            t.copy_(views(i))


def _bounce_buffers(eng: Engine, rm: RankManifest, holder: dict[str, Any], *,
                    borrow: bool) -> BounceBuffers:
    """Bounce buffers for in-place direct reads (``BOUNCE_PER_THREAD`` per io thread, so every reader has one to
    read into while one is copied out), no larger than this rank's largest file needs. The manager's own where an
    earlier restore made them; else, with ``borrow`` (the restore's other bytes go to a private buffer), cut from a
    staging slot that is ready (faulted in by a save, on huge pages where the pool is), held until the reads end
    (``holder["bounce_release"]``): no memory of their own and no fresh pages; else the manager's own, made here and
    kept for later restores (they take memory only once a read uses them). Borrowing: fresh buffers of their own
    took 1.2-1.8x the restore's time (per-round medians, 0.5 and 2 GiB cold; benchmarks/restore_paths.py)."""
    page = mmap.PAGESIZE
    need = min(BOUNCE_SIZE, -(-max((f.size for f in rm.files), default=1) // page) * page)
    count = BOUNCE_PER_THREAD * eng.options.writer_threads
    if eng.bounce is not None and eng.bounce.size >= need:
        return eng.bounce
    if borrow and eng.pool.ready(count * need):
        slot = eng.pool.acquire(count * need)
        slot._headers_for = None  # about to be overwritten
        holder["bounce_release"] = partial(eng.pool.release, slot)
        assert slot.buffer is not None
        return BounceBuffers(count, need, memory=memoryview(slot.buffer[: count * need].numpy()))
    eng.bounce = BounceBuffers(count, need, huge=eng.huge)
    return eng.bounce


def _cache_locally(local: Store, manifest: StepManifest, rm: RankManifest, views: tuple[memoryview, ...]) -> None:
    """Commit a step restored from the remote tier into the local tier, from the verified bytes already in memory,
    so that the next restart on this node reads it locally. Failures only log: the restore itself succeeded."""
    step = rm.step
    if local.exists(join(layout.step_dir(step), layout.STEP_MANIFEST)):
        return
    protocol = protocol_for(local)
    # every file is written into the cached step's own folder, those an incremental step referenced included
    plain = dataclasses.replace(rm, files=tuple(dataclasses.replace(f, name=layout.plain_name(f.name), compression=None,
                                                                    stored_size=None, in_step=None)
                                                for f in rm.files))
    raw = plain.to_bytes()
    name = layout.rank_manifest_name(rm.rank, rm.save_id)
    step_manifest = dataclasses.replace(manifest, ranks=(RankRef(rm.rank, name, len(raw), hashing.digest(raw).hex()),),
                                        refs=(), shared_bytes=0)
    folder = layout.tmp_dir(step, rm.save_id)
    try:
        folder = protocol.begin(local, step, rm.save_id)
        for f, view in zip(plain.files, views):
            with local.open_write(join(folder, f.name), size_hint=f.size) as w:
                w.write(view)
        local.write_bytes(join(folder, name), raw)
        local.write_bytes(join(folder, layout.STEP_MANIFEST), step_manifest.to_bytes())
        protocol.commit(local, folder, step)
        log.info("restore: cached step %d from the remote tier into %s", step, local.url)
    except Exception as exc:
        protocol.abort(local, folder, step)
        log.warning("restore: could not cache step %d into the local tier %s: %s", step, local.url, exc)


def _assemble_dtensors(eng: Engine, store: Store, manifest: StepManifest,
                       targets: dict[str, tuple[Any, str, tuple[int, ...]]], *,
                       own: tuple[int, RankManifest, Any], complete: bool = True) -> dict[str, torch.Tensor]:
    """Each distributed-tensor target's box, from the saved shards that overlap it (read whole and verified).

    Shards of this rank's own saved manifest come from the bytes already loaded. When they are exactly its targets
    (the same world size and placements) no other manifest is read. Otherwise the ranks whose shards overlap the
    targets are found from the step manifest's mesh index (:mod:`.format.shards`) and only their manifests are
    read, each from the first tier that holds its rank (the local tier of a node holds its own ranks; the remote
    holds all); every rank's, where the index cannot tell (a checkpoint without one, a placement it does not know)
    or the ranks it named leave part of a target uncovered. ``complete``: whether ``manifest`` lists every rank
    ``store`` holds (else it is read again if other ranks are needed)."""
    if not targets:
        return {}
    src, own_rm, own_raw = own
    tiers = list(dict.fromkeys(t for t in (store, eng.local, eng.remote) if t is not None))
    # each tier's manifest.json, read once
    step_manifests: dict[int, StepManifest | None] = {id(store): manifest} if complete else {}

    def step_manifest_of(tier: Store) -> StepManifest | None:
        if id(tier) not in step_manifests:
            try:
                step_manifests[id(tier)] = read_step(tier, manifest.step)
            except (CheckpointNotFoundError, CorruptCheckpointError):
                step_manifests[id(tier)] = None
        return step_manifests[id(tier)]

    manifests: dict[int, tuple[Store, RankManifest]] = {src: (store, own_rm)}
    own_boxes = {rec.path: (tuple(rec.shard["offset"]), tuple(rec.shape)) for rec in own_rm.tensors
                 if rec.shard is not None and rec.path in targets}
    if all(own_boxes.get(path) == target_box(live)[1:] for path, (live, _c, _g) in targets.items()):
        # the same sharding as when saved: this rank's own shards are its targets (O(1) requests a rank)
        return _assembled(targets, manifests, src, own_raw, manifest.step)
    # resharding: the step's shard index names the ranks to read, O(1) bytes a rank (tiers.sharded)
    layouts = index_layouts(own_rm, targets)
    if layouts is not None and indexed_rank_manifests(tiers, manifest, layouts, manifests, step_manifest_of):
        return _assembled(targets, manifests, src, own_raw, manifest.step)
    # every rank of the step (a node's copy lists only its own ranks: then the remote's manifest lists them all)
    listing = next((m for m in (step_manifest_of(t) for t in tiers) if m is not None
                    and len(m.ranks) == m.world_size), None) or step_manifest_of(store) or manifest
    everyone = [ref.rank for ref in listing.ranks]
    wanted = _overlapping(listing, own_rm, targets)
    for attempt in ([r for r in everyone if r in wanted], everyone) if wanted is not None else (everyone,):
        for rank in attempt:
            if rank not in manifests:
                _find_rank_manifest(rank, tiers, step_manifest_of, own_rm.save_id, manifests)
        try:
            return _assembled(targets, manifests, src, own_raw, manifest.step)
        except CorruptCheckpointError:
            if len(manifests) >= len(everyone) or attempt is everyone:
                raise
            log.info("restore: step %d: the ranks the mesh index named leave a target uncovered; reading every "
                     "rank's manifest", manifest.step)
    raise AssertionError("unreachable")  # pragma: no cover


def _overlapping(listing: StepManifest, own_rm: RankManifest,
                 targets: dict[str, tuple[Any, str, tuple[int, ...]]]) -> set[int] | None:
    """The saved ranks whose shards overlap some target, from the step manifest's mesh index and the layouts in
    this rank's saved tree; None where that cannot be told (then every rank is read)."""
    if not any(ref.mesh for ref in listing.ranks):
        return None  # a checkpoint without a mesh index
    saved = saved_layouts(own_rm.tree)
    # the index must reproduce this rank's own boxes, or its arithmetic does not match how the shards were cut
    try:
        for rec in own_rm.tensors:
            if rec.shard is not None and rec.path in targets and not same_box(rec.shard, rec.shape):
                return None
        wanted: set[int] = set()
        for path, (live, _code, gshape) in targets.items():
            layout_ = saved.get(path)
            if layout_ is None or "placements" not in layout_:
                return None
            _g, offset, shape = target_box(live)
            key = mesh_key(layout_["mesh_shape"], layout_.get("mesh_dims"))
            for ref in listing.ranks:
                coord = dict(ref.mesh).get(key)
                if coord is None:
                    continue
                box = saved_box(gshape, layout_["placements"], layout_["mesh_shape"], coord)
                if box is not None and overlaps(box, (offset, shape)):
                    wanted.add(ref.rank)
    except (UnknownPlacement, KeyError, TypeError):
        return None
    return wanted


def _find_rank_manifest(rank: int, tiers: list[Store], step_manifest_of: Callable[[Store], StepManifest | None],
                        save_id: str, manifests: dict[int, tuple[Store, RankManifest]]) -> None:
    """``rank``'s manifest of this save from the first tier that holds it intact (into ``manifests``)."""
    for tier in tiers:
        tier_manifest = step_manifest_of(tier)
        if tier_manifest is None or not any(ref.rank == rank for ref in tier_manifest.ranks):
            continue
        try:
            rms = read_ranks(tier, tier_manifest, [rank])
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue
        if rms and rms[0].save_id == save_id:
            manifests[rank] = (tier, rms[0])
            return


def _assembled(targets: dict[str, tuple[Any, str, tuple[int, ...]]], manifests: dict[int, tuple[Store, RankManifest]],
               src: int, own_raw: Any, step: int) -> dict[str, torch.Tensor]:
    by_path: dict[str, list[tuple[Any, Any]]] = {}
    for rank, (tier, rm) in sorted(manifests.items()):
        for rec in rm.tensors:
            if rec.shard is None or rec.path not in targets:
                continue
            reader = partial(own_raw, rec.index) if rank == src else partial(_read_record, tier, rm, rec)
            by_path.setdefault(rec.path, []).append((rec, reader))
    out = {}
    for path, (live, code, gshape) in targets.items():
        _g, offset, shape = target_box(live)
        out[path] = assemble(path, code, gshape, offset, shape, by_path.get(path, []), step=step)
    return out


def _read_record(store: Store, rm: RankManifest, rec: Any) -> torch.Tensor:
    """One tensor's bytes from a rank's data file, verified against its checksum."""
    f = rm.files[rec.file]
    rel = file_rel(rm.step, f)  # an incremental step's file may lie in an earlier step's folder
    if f.compression:
        whole = bytearray(f.size)
        fetch_file(store, layout.step_dir(rm.step if f.in_step is None else f.in_step), f, memoryview(whole))
        data = bytes(memoryview(whole)[rec.offset : rec.offset + rec.nbytes])
    else:
        buf = bytearray(rec.nbytes)
        if store.readinto(rel, rec.offset, memoryview(buf)) != rec.nbytes:
            raise CorruptCheckpointError(f"{f.name} ends inside tensor {rec.path}", step=rm.step, tier=store.tier,
                                         path=f"{store.url}/{rel}", bad_files=[f.name])
        data = bytes(buf)
    if hashing.digest(data).hex() != rec.checksum:
        raise CorruptCheckpointError(f"checksum mismatch in {f.name} (tensor {rec.path})", step=rm.step,
                                     tier=store.tier, path=f"{store.url}/{rel}", bad_files=[f.name])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
