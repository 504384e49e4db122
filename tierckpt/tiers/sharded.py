"""Multi-rank steps: every rank commits its own shard; a step manifest listing all ranks commits the step.

Local tier (node-local; the ranks of one node share one folder), for each rank:

1. write the rank's data files, then its rank manifest, into ``.tmp-step-<N>-r<rank>-<save id>/`` (each fsync-ed);
2. move them into ``step-<N>/`` (renames within one file system: data files first, the rank manifest last) and
   fsync ``step-<N>/``: the rank's shard is now durable, but no step manifest names it yet;
3. (the ranks agree through the job's c10d store that *every* rank got here; a failure anywhere stops here, for
   everyone);
4. the node's leader (its lowest rank) writes ``step-<N>/manifest.json`` atomically (temporary name, rename, fsync),
   listing the ranks whose shards this node holds (``ranks``, and their numbers in ``holds_ranks``) and the job's
   world size;
5. the leader removes files of older saves of step N from the folder (names carry the save id, which all ranks share).

Remote tier (shared by all ranks), one attempt of one step (:func:`replicate_shards`, every rank at once):

1. rank 0 reads the remote ``manifest.json``: if it holds this save already, every rank skips the step;
2. each rank uploads its data files and its rank manifest into ``step-<N>/`` and reports the rank manifest's name,
   size and checksum (of the bytes written: a rank manifest re-sealed by compression differs from the local one);
3. rank 0 collects the reports, confirms them with one listing of ``step-<N>/`` (names and sizes), writes the
   step's shard index (``shards-<save id>.json``, :mod:`tierckpt.format.shard_index`; for steps with distributed
   tensors), then ``manifest.json`` last, and tells every rank whether the step is committed.

Steps 1-3 talk through a :class:`CommitChannel` (the job's c10d store), never through the remote: no rank polls
storage for another's progress, and rank 0 reads no rank manifest back. Rank 0 reads the W-1 reports in batches
(O(W / 512) requests, none per rank); each rank removes its own report once it has the result.

A step folder without ``manifest.json`` is never a checkpoint, whatever shards it holds.

Resharding restores read the remote's shard index instead of its ``manifest.json`` (:func:`indexed_rank_manifests`):
the few kilobytes that name the saved ranks whose shards overlap a rank's targets, and those ranks' references.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

from .. import faults
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StepConflictError,
    StorageAccessError,
    StorageError,
    UploadError,
)
from ..format import hashing, layout, shard_index
from ..format.manifest import MAX_MANIFEST_BYTES, FileRecord, RankManifest, RankRef, StepManifest, shared_steps
from ..format.shards import mesh_index
from ..storage.base import Store, join
from ..storage.commit import read_step_manifest
from ..storage.fsspec_store import DEFAULT_PART_SIZE
from ..storage.local import LocalStore
from ..storage.retry import RetryPolicy
from .incremental import Incremental, pins
from .reader import read_manifests, read_ranks
from .transfer import TokenBucket, Transfer, TransferFailed, bytes_job, file_job, run_jobs
from .writer import RankSnapshot, write_rank

log = logging.getLogger(__name__)



def persist_shard(store: LocalStore, snap: RankSnapshot, executor: Executor,
                  hash_executor: Executor | None = None,
                  incremental: Incremental | None = None) -> tuple[RankManifest, RankRef]:
    """Steps 1-2: this rank's shard durable inside ``step-<N>/``, not yet part of any committed step.

    ``incremental``: reference the unchanged tensors' bytes in this rank's own shard files of an earlier committed
    step of the node's folder (:mod:`.incremental`); the referenced files stay where they are, only this step's own
    files move into ``step-<N>/``. The step's references reach its ``manifest.json`` through the commit's
    agreement (:func:`tierckpt.engine.sharded.persist`)."""
    tmp = layout.tmp_dir(snap.step, snap.save_id, snap.rank)
    folder = layout.step_dir(snap.step)
    baseline = None if incremental is None or hash_executor is None else incremental.baseline_for(store, snap.step)
    store.makedirs(tmp)
    try:
        with pins(store, () if baseline is None else baseline.steps):
            if baseline is not None and not baseline.still_stored(store):
                log.info("tier local: rank %d: step %d written whole: its baseline step %d is no longer stored",
                         snap.rank, snap.step, baseline.step)
                baseline = None
            if incremental is None or baseline is None:
                rm, raw, rname = write_rank(store, tmp, snap, executor, hash_executor)
            else:
                rm, raw, rname = write_rank(store, tmp, snap, executor, hash_executor,
                                            incremental=(incremental, baseline))
        store.sync_dir(tmp)
        store.makedirs(folder)
        for f in rm.files:
            if f.in_step is None:
                store.move_into(join(tmp, f.name), join(folder, f.name))
        store.move_into(join(tmp, rname), join(folder, rname))
        store.sync_dir(folder)
    finally:
        store.remove(tmp)
    return rm, RankRef(snap.rank, rname, len(raw), hashing.digest(raw).hex(), mesh_index(t.shard for t in rm.tensors))


def discard_shard(store: LocalStore, step: int, rank: int, save_id: str) -> None:
    """After a failed multi-rank save: remove this rank's files of that save, unless a manifest names them."""
    folder = layout.step_dir(step)
    try:
        m = read_step_manifest(store, folder, step)
    except (CorruptCheckpointError, OSError):
        m = None
    if m is not None and m.save_id == save_id:
        return
    prefix = f"r{rank:05d}-"
    for name in store.list(folder):
        if name.startswith(prefix) and f"-{save_id}." in name:
            store.remove(join(folder, name))
    if store.isdir(folder) and not store.list(folder):
        store.remove(folder)


def commit_step(store: Store, manifest: StepManifest, keep: frozenset[str] = frozenset()) -> None:
    """Steps 4-5 (and the remote commit): ``manifest.json`` last and atomically, then older saves' files go
    (``keep``: files of the step named for an earlier save, carried over into its folder by an incremental upload)."""
    folder = layout.step_dir(manifest.step)
    faults.point("before-rename")
    store.put_atomic(join(folder, layout.STEP_MANIFEST), manifest.to_bytes())
    faults.point("after-rename")
    commit_step_cleanup(store, manifest, keep)


def commit_step_cleanup(store: Store, manifest: StepManifest, keep: frozenset[str] = frozenset()) -> None:
    """Remove files in the step folder that belong to another save of the step (by rank held here), except the
    files in ``keep`` (which the step's rank manifests list)."""
    folder = layout.step_dir(manifest.step)
    holds = set(manifest.holds_ranks) if manifest.holds_ranks is not None else None
    for name in store.list(folder):
        if name == layout.STEP_MANIFEST or f"-{manifest.save_id}." in name or name in keep:
            continue
        rank = _rank_of(name)
        if holds is None or rank in holds:
            store.remove(join(folder, name))


def _rank_of(name: str) -> int | None:
    if len(name) > 6 and name[0] == "r" and name[1:6].isdigit():
        return int(name[1:6])
    return None


def upload_shard(local: Store, remote: Store, step: int, rank: int,
                 **opts: Any) -> tuple[RankRef, dict[str, int], tuple[tuple[int, ...], int]]:
    """Upload this rank's data files and rank manifest into the remote ``step-<N>/`` (no commit: rank 0's job);
    returns the reference to the rank manifest written (its name, size and checksum), the size of every file
    written, by name, and the earlier remote steps the shard references with the bytes it holds of them (an
    incremental shard: a file of an earlier step is referenced where the remote holds this rank's copy of it,
    else carried over into ``step-<N>/``). No file's size is asked of the store after its PUT: rank 0's one listing
    of the step folder confirms them all before the commit (:func:`replicate_shards`)."""

    threads = opts.get("threads", 4)
    part_size = opts.get("part_size", DEFAULT_PART_SIZE)
    bw = opts.get("bandwidth_bytes_per_s")
    deadline_s = opts.get("deadline_s")
    ctx = Transfer(step, remote, opts.get("retry") or RetryPolicy(),
               None if deadline_s is None else time.monotonic() + deadline_s, opts.get("cancel"),
               opts.get("bucket") or (TokenBucket(bw, burst=min(part_size, bw)) if bw else None), opts.get("progress"),
               opts.get("stall_s"), opts.get("on_error"))
    _manifest, rms = read_manifests(local, step, ranks=[rank])
    if not rms:
        raise CheckpointNotFoundError(f"rank {rank} has no shard of this step locally", step=step, tier=local.tier)
    rm = rms[0]
    folder = layout.step_dir(step)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"tierckpt-upload-{step}")
    try:
        remote.makedirs(folder)
        shared = _remote_shares(remote, rm)
        jobs: list[tuple[str, Callable[[], Any]]] = []
        for i, rec in enumerate(rm.files):
            rel = join(folder, rec.name)
            there = shared.get((rec.in_step, layout.plain_name(rec.name), rec.checksum))
            if there is not None:  # stored once: the remote's copy of this rank's file of the earlier step
                there = dataclasses.replace(there, in_step=rec.in_step, cuts=rec.cuts)
                jobs.append((rel, lambda there=there: (there, 0, 0)))
                continue
            jobs.append((rel, file_job(local, remote, ctx, rm, i, folder, rel, part_size, opts.get("compression"),
                                       opts.get("compression_level", 3), opts.get("verify", False),
                                       check_size=False)))
        # an uploaded file is the step's own there, also one carried over from a step the remote lacks
        results = [(rec if r == 0 and w == 0 and rec.in_step is not None
                    else dataclasses.replace(rec, in_step=None), r, w) for rec, r, w in run_jobs(pool, ctx, jobs)]
        ctx.sent()
        records = tuple(r[0] for r in results)
        new = dataclasses.replace(rm, files=records) if records != rm.files else rm
        raw = new.to_bytes() if new is not rm else local.read_bytes(
            join(folder, layout.rank_manifest_name(rank, rm.save_id)), max_size=MAX_MANIFEST_BYTES)
        rel = join(folder, layout.rank_manifest_name(rank, rm.save_id))
        faults.point("before-remote-manifest")
        run_jobs(pool, ctx, [(rel, bytes_job(remote, ctx, rel, raw, "write rank manifest", opts.get("verify", False),
                                             check_size=False))])
        ref = RankRef(rank, layout.rank_manifest_name(rank, rm.save_id), len(raw), hashing.digest(raw).hex(),
                      mesh_index(t.shard for t in rm.tensors))
        return (ref, {ref.name: ref.size} | {f.name: f.stored_size or f.size for f in new.files if f.in_step is None},
                (shared_steps(new.files), new.shared_bytes))
    except TransferFailed as failed:
        raise UploadError(f"rank {rank}: cannot upload its shard: {failed.exc}", step=step, tier=remote.tier,
                          path=f"{remote.url}/{failed.rel}") from failed.exc
    finally:
        ctx.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


class CommitChannel(Protocol):
    """Messages of one multi-rank upload attempt between its ranks (:class:`tierckpt.distributed.StoreChannel`):
    small JSON-able dicts posted under a name and fetched by name, each by a known number of readers."""

    def post(self, name: str, value: dict[str, Any]) -> None:
        """Make ``value`` readable under ``name``."""

    def fetch(self, names: list[str], timeout_s: float | None, *, readers: int) -> dict[str, dict[str, Any]]:
        """The values posted under ``names`` once all are there, or those there when ``timeout_s`` ran out;
        ``readers``: how many ranks fetch each name (the last one removes it)."""

    def withdraw(self, name: str) -> None:
        """Remove this rank's message ``name``, fetched with ``readers=0`` (its reader is done with it)."""


def replicate_shards(local: Store, remote: Store, manifest: StepManifest, rank: int, *, channel: CommitChannel,
                     attempt: str, deadline_s: float | None, **opts: Any) -> bool:
    """One attempt (``attempt``: a name unique to it) at replicating multi-rank step ``manifest`` (the local step
    manifest), run by every rank at once; see the module docstring. Returns False if rank 0 found the step already
    committed remotely (nothing uploaded), True once it is committed. Raises :class:`UploadError` on every rank
    when any rank's shard or the commit failed, or the ranks did not all report within ``deadline_s``."""
    step, world = manifest.step, manifest.world_size
    folder = layout.step_dir(step)
    followers = world - 1
    retry: RetryPolicy = opts.get("retry") or RetryPolicy()

    def failed(msg: str) -> UploadError:
        return UploadError(msg, step=step, tier=remote.tier, path=f"{remote.url}/{folder}")

    def result() -> dict[str, Any]:
        got = channel.fetch([f"{attempt}/result"], deadline_s, readers=followers).get(f"{attempt}/result")
        return {"ok": False, "error": "rank 0 did not commit the step on the remote in time"} if got is None else got

    if rank == 0:
        try:
            there = retry.call(lambda: _committed_manifest(remote, folder, step), what=f"read {remote.url}/{folder}")
        except Exception as exc:
            channel.post(f"{attempt}/go", {"error": f"rank 0: {exc}"})
            raise
        skip = there is not None and there.save_id == manifest.save_id
        if there is not None and not skip:
            conflict = StepConflictError(
                f"the remote holds a committed copy of this step from another save ({there.save_id}; this one is "
                f"{manifest.save_id}): a committed step is never replaced, so it is kept and this save stays in "
                f"the local tier", step=step, tier=remote.tier, path=f"{remote.url}/{folder}", transient=False)
            channel.post(f"{attempt}/go", {"error": f"rank 0: {conflict}"})
            raise conflict
        channel.post(f"{attempt}/go", {"skip": skip})
        if skip:
            return False
    else:
        go = channel.fetch([f"{attempt}/go"], deadline_s, readers=followers).get(f"{attempt}/go")
        if go is None:
            raise failed("rank 0 did not start the upload in time; the step is not committed remotely")
        if "error" in go:
            raise failed(f"the step is not uploaded: {go['error']}")
        if go["skip"]:
            return False
    try:
        ref, sizes, held = upload_shard(local, remote, step, rank, deadline_s=deadline_s, **opts)
    except Exception as exc:
        if rank == 0:
            channel.post(f"{attempt}/result", {"ok": False, "error": f"rank 0: {exc}"})
        else:
            channel.post(f"{attempt}/r{rank}", {"error": str(exc)[:4096]})
            result()  # in step with the others (and the message read by everyone)
            channel.withdraw(f"{attempt}/r{rank}")
        raise
    if rank != 0:
        channel.post(f"{attempt}/r{rank}", {"ref": [ref.rank, ref.name, ref.size, ref.checksum],
                                             "mesh": [[k, list(c)] for k, c in ref.mesh], "sizes": sizes}
                     | ({"refs": list(held[0]), "shared": held[1]} if held[0] else {}))
        outcome = result()
        channel.withdraw(f"{attempt}/r{rank}")  # rank 0 read it, or gave up on it
        if not outcome["ok"]:
            raise failed(f"the step is not committed remotely: {outcome['error']}")
        return True
    try:
        final = _commit_reported(remote, manifest, ref, sizes, channel, attempt, deadline_s, retry, held)
    except Exception as exc:
        channel.post(f"{attempt}/result", {"ok": False, "error": str(exc)[:4096]})  # read by every rank: bounded
        raise
    channel.post(f"{attempt}/result", {"ok": True})
    log.info("step %d, tier %s: committed %d ranks' shards at %s", step, remote.tier, len(final.ranks),
             f"{remote.url}/{folder}")
    return True


def _remote_shares(remote: Store, rm: RankManifest) -> dict[tuple[int | None, str, str], FileRecord]:
    """The files of this rank's incremental shard ``rm`` that the remote holds, committed, in the earlier step
    named, with the same name and checksum: each as the remote's record of it (its stored form there). Reads this
    rank's manifest of each referenced step only (a few: bounded by ``full_every`` and ``keep_local``). A file the
    remote lacks is carried over, so that the remote copy never depends on a step the remote does not hold."""
    wanted: dict[int, set[tuple[str, str]]] = {}
    for f in rm.files:
        if f.in_step is not None:
            wanted.setdefault(f.in_step, set()).add((layout.plain_name(f.name), f.checksum))
    out: dict[tuple[int | None, str, str], FileRecord] = {}
    for s, names in sorted(wanted.items()):
        try:
            _m, found = read_manifests(remote, s, ranks=[rm.rank])
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            log.info("step %d, tier %s: rank %d: referenced step %d not usable there (%s): its files are carried "
                     "over", rm.step, remote.tier, rm.rank, s, exc)
            continue
        for other in found:
            for f in other.files:  # the remote's name may carry a fan-out tag (layout.spread_name)
                if f.in_step is None and (layout.plain_name(f.name), f.checksum) in names:
                    out[(s, layout.plain_name(f.name), f.checksum)] = f
    return out


def _committed_manifest(remote: Store, folder: str, step: int) -> StepManifest | None:
    try:
        return read_step_manifest(remote, folder, step)
    except CorruptCheckpointError:
        return None  # replaced by this upload


def _commit_reported(remote: Store, manifest: StepManifest, ref0: RankRef, sizes0: dict[str, int],
                     channel: CommitChannel, attempt: str, deadline_s: float | None, retry: RetryPolicy,
                     held0: tuple[tuple[int, ...], int] = ((), 0)) -> StepManifest:
    """Rank 0: every rank's reported reference, confirmed by one listing of the step folder, then the commit.
    The step manifest's ``refs`` and ``shared_bytes`` are those of the remote copy: every rank's references to
    earlier remote steps (``held0``: rank 0's), each confirmed committed there right before the commit."""
    step, folder = manifest.step, layout.step_dir(manifest.step)
    names = [f"{attempt}/r{r}" for r in range(1, manifest.world_size)]
    reports = channel.fetch(names, deadline_s, readers=0)  # read in batches; each rank removes its own
    missing = [r for r in range(1, manifest.world_size) if f"{attempt}/r{r}" not in reports]
    if missing:
        more = f" and {len(missing) - 16} more" if len(missing) > 16 else ""
        raise UploadError(f"ranks {missing[:16]}{more} did not upload their shards in time; the step is not committed "
                          "remotely", step=step, tier=remote.tier, path=f"{remote.url}/{folder}")
    errors = {int(n.rsplit("/r", 1)[1]): v["error"] for n, v in reports.items() if "error" in v}
    if errors:
        more = f", and {len(errors) - 8} more" if len(errors) > 8 else ""
        raise UploadError("rank(s) " + ", ".join(f"{r} ({e})" for r, e in sorted(errors.items())[:8]) + more
                          + " could not upload their shards; the step is not committed remotely",
                          step=step, tier=remote.tier, path=f"{remote.url}/{folder}")
    refs = {0: ref0} | {r: _reported(reports[f"{attempt}/r{r}"]) for r in range(1, manifest.world_size)}
    sizes = {0: sizes0} | {r: reports[f"{attempt}/r{r}"].get("sizes") or {refs[r].name: refs[r].size}
                           for r in range(1, manifest.world_size)}
    listed = retry.call(lambda: remote.sizes(folder), what=f"list {remote.url}/{folder}")
    # every file each rank wrote, at the size it wrote (the only check of the sizes: no request per file)
    wrong = [r for r in refs if listed.get(refs[r].name) != refs[r].size
             or any(listed.get(name) != size for name, size in sizes[r].items())]
    if wrong:
        raise UploadError(f"the files of rank(s) {wrong} are not on the remote as reported; the step is not "
                          "committed remotely", step=step, tier=remote.tier, path=f"{remote.url}/{folder}")
    reported = [reports[f"{attempt}/r{r}"] for r in range(1, manifest.world_size)]
    held = tuple(sorted(set(held0[0]) | {s for rep in reported for s in rep.get("refs", ())}))
    final = dataclasses.replace(manifest, ranks=tuple(refs[r] for r in range(manifest.world_size)), holds_ranks=None,
                                refs=held, shared_bytes=held0[1] + sum(rep.get("shared", 0) for rep in reported))
    with pins(remote, held):  # this process applies the remote's retention: the referenced steps stay
        gone = [s for s in held if retry.call(lambda s=s: read_step_manifest(remote, layout.step_dir(s), s),
                                              what=f"read {remote.url}/{layout.step_dir(s)}") is None]
        if gone:
            raise UploadError(f"referenced step(s) {gone} are no longer committed remotely; the step is not "
                              "committed remotely", step=step, tier=remote.tier, path=f"{remote.url}/{folder}")
        _write_index(remote, final, retry)
        faults.point("remote-commit")
        carried = frozenset(n for r in sizes for n in sizes[r] if f"-{manifest.save_id}." not in n)
        retry.call(lambda: commit_step(remote, final, carried),  # throttling retried
                   what=f"commit {remote.url}/{folder}")
    return final


def _write_index(remote: Store, final: StepManifest, retry: RetryPolicy) -> None:
    """Rank 0, before the commit: the step's shard index next to where ``manifest.json`` goes (none for a step
    without distributed tensors). A failure to write it fails the commit as any other write does; a step committed
    without one (an older library's, or one whose index would be too large) is resharded from ``manifest.json``."""
    found = shard_index.of_copy(final)
    if found is None:
        return
    rel = join(layout.step_dir(final.step), found[0])
    retry.call(lambda: remote.put_atomic(rel, found[1]), what=f"write {remote.url}/{rel}")


def _reported(report: dict[str, Any]) -> RankRef:
    """A rank's report of its uploaded shard (JSON through the channel) as its reference in the step manifest."""
    return RankRef(*report["ref"], mesh=tuple((k, tuple(c)) for k, c in report.get("mesh", ())))


def holds_rank(store: Store, step: int, rank: int) -> bool:
    """Whether ``store`` has a committed ``step`` whose manifest says it holds ``rank``'s shard."""
    try:
        m = read_step_manifest(store, layout.step_dir(step), step)
    except (CheckpointError, OSError):
        return True  # let the loader find out and report it
    return m is not None and (m.holds_ranks is None or rank in m.holds_ranks)


# ------------------------------------------------------------------------------------------ resharding restores
def indexed_rank_manifests(tiers: list[Store], manifest: StepManifest, layouts: list[shard_index.Layout],
                           have: dict[int, tuple[Store, RankManifest]],
                           manifest_of: Callable[[Store], StepManifest | None]) -> bool:
    """Put into ``have`` (rank -> (tier, its manifest)) the manifest of every saved rank whose shards overlap the
    targets ``layouts`` describe (:func:`.format.shard_index.ranks_overlapping`), found through the first of
    ``tiers`` holding the shard index of ``manifest``'s save (the remote): its head, then only the blocks naming
    those ranks. Each rank's manifest comes from the first tier holding it intact: the index's tier through the
    index's reference, any other (a node's local copy) through ``manifest_of`` (its own, small ``manifest.json``).
    Returns False, having read no rank manifest, where no tier holds an index (a step saved before indexes, or
    without distributed tensors), where it cannot tell, or where it is damaged (logged, naming the step, tier and
    file), or where a tier could not be read for it (the caller's own reads, which may not need that tier, then
    meet the error if they do): the caller then reads as without one. ``manifest`` may be cut down to any rank
    (only its step, save id and world size are used). A storage error reading a rank's manifest propagates."""
    try:
        found = next((f for f in (index_head(t, manifest) for t in tiers) if f is not None), None)
        if found is None:
            return False
        tier, head, prefix = found
        for rank, (_t, rm) in have.items():  # the ranks already read must stand where the index puts them
            for key, coord in mesh_index(t.shard for t in rm.tensors):
                mesh = head.meshes.get(key)
                if mesh is not None and rank not in mesh.at(coord):
                    raise CorruptCheckpointError(f"shard index: it does not place rank {rank} at {list(coord)} "
                                                 f"of mesh {key}, where its manifest does", step=head.step,
                                                 tier=tier.tier, path=f"{tier.url}/{layout.step_dir(head.step)}/"
                                                 f"{shard_index.index_name(head.save_id)}")
        wanted = shard_index.ranks_overlapping(head, layouts)
        if wanted is None:
            log.info("restore: step %d: the shard index in tier %s cannot tell which ranks to read; reading the "
                     "step manifest", manifest.step, tier.tier)
            return False
        need = sorted(wanted - set(have))
        refs = _index_refs(tier, head, prefix, need) if need else {}
    except CorruptCheckpointError as exc:
        log.warning("restore: step %d: %s; reading the step manifest instead", manifest.step, exc)
        return False
    except StorageError as exc:  # the remote is down: a node's own copy may still hold every rank needed
        log.info("restore: step %d: cannot read a shard index (%s); reading the step manifests", manifest.step, exc)
        return False
    for rank in need:
        for t in tiers:
            if t is tier:
                listing: StepManifest | None = dataclasses.replace(manifest, ranks=(refs[rank],), holds_ranks=None)
            else:
                listing = manifest_of(t)
                if listing is None or not any(ref.rank == rank for ref in listing.ranks):
                    continue
            try:
                assert listing is not None
                rms = read_ranks(t, listing, [rank])
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                log.info("restore: step %d: rank %d's manifest in tier %s is not usable: %s", manifest.step, rank,
                         t.tier, exc)
                continue
            if rms and rms[0].save_id == manifest.save_id:
                have[rank] = (t, rms[0])
                break
    return True


def index_head(store: Store, manifest: StepManifest) -> tuple[Store, shard_index.IndexHead, bytes] | None:
    """``store``'s shard index of ``manifest``'s save: (store, its verified head, the file's first bytes read), or
    None if it has none. Reads :data:`~.format.shard_index.HEAD_READ` bytes, more only for a head that long. Raises
    :class:`CorruptCheckpointError` naming the file for one that is cut short, vanishes or cannot be parsed, and
    :class:`~tierckpt.errors.StorageError` (access denied included) where the store cannot be read."""
    name = shard_index.index_name(manifest.save_id)
    rel = join(layout.step_dir(manifest.step), name)
    where = f"{store.url}/{rel}"
    prefix = b""
    ask = shard_index.HEAD_READ
    while True:
        buf = bytearray(ask)
        try:
            n = store.readinto(rel, len(prefix), memoryview(buf))
        except FileNotFoundError:
            if prefix:
                raise CorruptCheckpointError("shard index: it vanished while read", step=manifest.step,
                                             tier=store.tier, path=where, bad_files=[name]) from None
            return None
        except StorageError:
            raise
        except PermissionError as exc:
            raise StorageAccessError(f"read: access denied ({exc})", tier=store.tier, path=where,
                                     step=manifest.step, transient=False) from None
        except Exception as exc:
            raise CorruptCheckpointError(f"shard index: unreadable: {exc}", step=manifest.step, tier=store.tier,
                                         path=where, bad_files=[name]) from None
        prefix += bytes(buf[:n])
        end = shard_index.head_line(prefix, step=manifest.step, tier=store.tier, path=where)
        if end is not None:
            break
        if n < ask:
            raise CorruptCheckpointError("shard index: its head ends before its line does (truncated?)",
                                         step=manifest.step, tier=store.tier, path=where, bad_files=[name])
        ask = min(ask * 2, shard_index.MAX_HEAD_BYTES)
    head = shard_index.parse_head(prefix[:end], step=manifest.step, save_id=manifest.save_id,
                                  world_size=manifest.world_size, tier=store.tier, path=where)
    return store, head, prefix


def _index_refs(store: Store, head: shard_index.IndexHead, prefix: bytes, ranks: list[int]) -> dict[int, RankRef]:
    """The manifest references of ``ranks`` from the index's blocks: those in ``prefix`` (already read) from there,
    the others with one ranged read each."""
    rel = join(layout.step_dir(head.step), shard_index.index_name(head.save_id))
    where = f"{store.url}/{rel}"
    out: dict[int, RankRef] = {}
    for b in head.blocks_of(ranks):
        at, size = head.block_span(b)
        if at + size <= len(prefix):
            raw = prefix[at : at + size]
        else:
            buf = bytearray(size)
            try:
                n = store.readinto(rel, at, memoryview(buf))
            except StorageError:
                raise
            except Exception as exc:  # a missing range, a vanished file
                raise CorruptCheckpointError(f"shard index: block {b} unreadable: {exc}", step=head.step,
                                             tier=store.tier, path=where) from None
            raw = bytes(buf[:n])
        out.update((ref.rank, ref) for ref in shard_index.parse_block(raw, head, b, tier=store.tier, path=where))
    missing = [r for r in ranks if r not in out]
    if missing:
        raise CorruptCheckpointError(f"shard index: no reference of rank(s) {missing[:8]}", step=head.step,
                                     tier=store.tier, path=where)
    return out
