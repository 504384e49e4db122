"""The manager's multi-rank paths: agreeing on commits and on the step to restore (see :mod:`.tiers.sharded` for the
protocol on storage and :mod:`.distributed` for the groups the agreements run on)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import xxhash

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
    UploadError,
)
from .format import layout
from .format.manifest import RankRef, StepManifest
from .storage.base import Store
from .storage.commit import read_step_manifest
from .storage.failures import describe
from .storage.retry import is_transient
from .tiers import sharded
from .tiers.listing import TierListings, list_tiers
from .tiers.reader import read_step
from .tiers.writer import RankSnapshot

if TYPE_CHECKING:
    from ._engine import Engine
    from .distributed import Coordinator

log = logging.getLogger(__name__)


def save_id(run_id: str, step: int) -> str:
    """The same on every rank without a message: a hash of the run's id (agreed at start-up) and the step."""
    return xxhash.xxh3_64_hexdigest(f"{run_id}:{step}".encode())


def persist(eng: Engine, snap: RankSnapshot, *, release: Callable[[], None]) -> StepManifest:
    """Write this rank's shard, agree with every rank, commit on this node. Raises if any rank failed."""
    coord = eng.coord
    assert coord is not None
    topo = coord.topology
    step, sid = snap.step, snap.save_id
    outcome: tuple[Any, ...]
    written = False
    try:
        rm, ref = sharded.persist_shard(eng.local, snap, eng.io, eng.hash)
        outcome = (True, (ref.rank, ref.name, ref.size, ref.checksum), rm.total_bytes, time.time(), snap.metadata)
        written = True
    except Exception as exc:
        log.error("tier local: rank %d could not write its shard of step %d: %s", topo.rank, step, exc)
        outcome = (False, f"{type(exc).__name__}: {exc}", 0, 0.0, None)
    finally:
        release()
    coord.announce(sid, "written" if written else "failed")
    everyone = _gather(coord, outcome, step, "shards written", sid)
    failed = {r: o[1] for r, o in enumerate(everyone) if not o[0]}
    if failed:
        try:
            sharded.discard_shard(eng.local, step, topo.rank, sid)
        except Exception as exc:  # best effort: the error that names the failing rank matters more
            log.warning("tier local: rank %d could not remove its shard of failed step %d: %s", topo.rank, step, exc)
        raise CheckpointError(f"step not committed: rank(s) {sorted(failed)} failed to save: "
                              + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())), step=step, tier="local",
                              path=eng.local.url)
    manifest = StepManifest(
        step=step, world_size=topo.world_size, save_id=sid,
        ranks=tuple(RankRef(*o[1]) for o in everyone), total_bytes=sum(o[2] for o in everyone),
        metadata=everyone[0][4], created=everyone[0][3], holds_ranks=topo.node_ranks,
    )
    ok: tuple[bool, str] = (True, "")
    if topo.is_node_leader:
        try:
            commit_local(eng, manifest)
        except Exception as exc:
            ok = (False, f"{type(exc).__name__}: {exc}")
    confirmed = _gather(coord, ok, step, "committed on every node", sid)
    bad = {r: o[1] for r, o in enumerate(confirmed) if not o[0]}
    if bad:
        raise CheckpointError(f"step not committed on the node(s) of rank(s) {sorted(bad)}: {bad}", step=step,
                              tier="local", path=eng.local.url)
    return manifest


def commit_local(eng: Engine, manifest: StepManifest) -> None:
    sharded.commit_step(eng.local, manifest)
    log.info("tier local: committed step %d (ranks %s of %d) at %s", manifest.step, list(manifest.holds_ranks or ()),
             manifest.world_size, eng.local.url)


def _gather(coord: Any, obj: Any, step: int, what: str, sid: str) -> list[Any]:
    try:
        return coord.gather(obj, coord.persist_group)
    except Exception as exc:  # a rank died or hung: gloo times out
        silent = coord.silent_ranks(sid)
        who = (", ".join(f"rank {r}" for r in silent) + " never reached it (died or hung)") if silent \
            else "a rank may have died"
        raise CheckpointError(f"step not committed: ranks could not agree ({what}); {who}: {exc}", step=step) from exc


def upload(eng: Engine, step: int, opts: dict[str, Any], *, channel: Any = None,
           attempt: str | None = None) -> None:
    """This rank's shard to the remote; rank 0 commits the step there once every shard is in. With a
    ``channel`` (the job's c10d store) and the leader's decision as ``attempt``, the ranks coordinate through it
    (:func:`tiers.sharded.replicate_shards`); without, through the remote storage (the polling protocol)."""
    assert eng.remote is not None and eng.coord is not None
    rank = eng.coord.topology.rank
    local_manifest = read_step_manifest(eng.local, layout.step_dir(step), step)
    if local_manifest is None:
        raise CheckpointNotFoundError("no committed local copy to upload", step=step, tier="local", path=eng.local.url)
    if channel is not None and attempt is not None:
        try:
            sharded.replicate_shards(eng.local, eng.remote, local_manifest, rank, channel=channel, attempt=attempt,
                                     **opts)
        except CheckpointError:
            raise
        except Exception as exc:
            raise UploadError(f"rank {rank}: cannot replicate to {eng.remote.url}: {describe(exc)}", step=step,
                              tier=eng.remote.tier, path=eng.remote.url, transient=is_transient(exc)) from exc
        return
    try:
        remote_manifest = read_step_manifest(eng.remote, layout.step_dir(step), step)
    except CorruptCheckpointError:
        remote_manifest = None
    if remote_manifest is not None and remote_manifest.save_id == local_manifest.save_id:
        return
    try:
        sharded.upload_shard(eng.local, eng.remote, step, rank, **opts)
        if rank == 0:
            sharded.commit_remote(eng.remote, local_manifest, deadline_s=opts.get("deadline_s"))
        else:
            sharded.wait_remote_commit(eng.remote, step, local_manifest.save_id, deadline_s=opts.get("deadline_s"))
    except CheckpointError:
        raise
    except Exception as exc:  # a storage failure outside the per-file retries (creating the folder, polling)
        raise UploadError(f"rank {rank}: cannot replicate to {eng.remote.url}: {describe(exc)}", step=step,
                          tier=eng.remote.tier, path=eng.remote.url, transient=is_transient(exc)) from exc


def candidates(eng: Engine, tiers: list[Store], listing: TierListings) -> dict[int, list[Store]]:
    """Steps committed in some tier that holds this rank's shard, with the tiers to try, local first."""
    rank = eng.coord.topology.rank if eng.coord is not None else eng.rank
    out: dict[int, list[Store]] = {}
    for store in tiers:
        for s in sorted(listing.steps.get(store.tier, ())):
            # a remote step holds every rank's shard (its manifest says so: no request per step and rank)
            if store.tier != "local" or sharded.holds_rank(store, s, rank):
                out.setdefault(s, []).append(store)
    return out


def list_tiers_shared(eng: Engine, tiers: list[Store], *, deadline_s: float | None) -> TierListings:
    """Each rank lists its node's local tier; rank 0 alone lists the shared tiers (the remote) and hands its
    listing to every rank in one gather, so a restart lists the remote once, not once per rank."""
    coord = eng.coord
    assert coord is not None
    mine = list_tiers([t for t in tiers if t.tier == "local"], deadline_s=deadline_s)
    shared = [t for t in tiers if t.tier != "local"]
    ours = list_tiers(shared, deadline_s=deadline_s) if shared and coord.topology.rank == 0 else None
    theirs = coord.gather(ours, coord.main_group)[0] if shared else None
    if not isinstance(theirs, TierListings):
        return mine
    return TierListings({**mine.steps, **theirs.steps}, {**mine.failed, **theirs.failed})


def restore(eng: Engine, state: MutableMapping[str, Any], step: int | None, tiers: list[Store], *,
            strict: bool, load: Callable[..., Any], listing: TierListings) -> int | None:
    """Every rank loads the same step: the newest that every rank can load intact from some tier. A rank whose
    listing depends on a tier it could not read (:meth:`TierListings.require`) makes every rank raise."""
    coord = eng.coord
    assert coord is not None
    try:
        listing.require(step, ", ".join(t.url for t in tiers))
        blocked = None
    except StorageError as exc:
        blocked = exc
    mine = candidates(eng, tiers, listing)
    # each rank's steps, and those it will read from a shared tier first (its node does not hold its shard)
    offer = None if blocked is not None else {
        "steps": sorted(mine), "shared_first": [s for s, st in mine.items() if st[0].tier != "local"]}
    reports = coord.gather(offer, coord.main_group)  # None: blocked
    everyone = [None if r is None else r["steps"] for r in reports]
    if any(c is None for c in everyone):
        if blocked is not None:
            raise blocked
        ranks = [r for r, c in enumerate(everyone) if c is None]
        raise StorageError(f"rank(s) {ranks} could not list a tier that may hold the checkpoint; not restoring",
                           step=step, path=", ".join(t.url for t in tiers), transient=True)
    common = set(everyone[0]).intersection(*map(set, everyone[1:]))
    if step is not None:
        if step not in common:
            missing = [r for r, c in enumerate(everyone) if step not in c]
            raise CheckpointNotFoundError(f"rank(s) {missing} find no committed copy of this step", step=step,
                                          path=", ".join(t.url for t in tiers))
        order = [step]
    else:
        if not any(everyone):
            return None
        order = sorted(common, reverse=True)
    errors: list[str] = []
    own_error: Exception | None = None
    for s in order:
        prepared = None
        outcome: tuple[str, str] = ("ok", "")
        shared = _share_step_manifest(eng, tiers, s, [r for r, rep in enumerate(reports) if s in rep["shared_first"]])
        for store in mine.get(s, []):
            try:
                if shared is not None and store is shared[0]:
                    prepared = load(store, s, state, strict, shared[1])
                else:
                    prepared = load(store, s, state, strict)
                break
            except StateMismatchError as exc:
                outcome = ("mismatch", exc.detail)
                break
            except CorruptCheckpointError as exc:
                log.warning("restore: rank %d: step %d in tier %s is corrupt (%s); files: %s", coord.topology.rank, s,
                            store.tier, exc, ", ".join(exc.bad_files) or "?")
                outcome = ("corrupt", str(exc))
            except Exception as exc:  # a tier that cannot be read, a bug: every rank stops, none waits for this one
                own_error = exc
                outcome = ("storage" if isinstance(exc, StorageError) else "error", f"{type(exc).__name__}: {exc}")
                break
        if prepared is None and outcome[0] == "ok":
            outcome = ("corrupt", "no tier holds an intact copy")
        results = coord.gather(outcome if prepared is None else ("ok", ""), coord.main_group)
        failed = [(r, k, m) for r, (k, m) in enumerate(results) if k in ("storage", "error")]
        if failed:
            if prepared is not None:
                prepared.release()
            if own_error is not None and outcome[0] in ("storage", "error"):
                raise own_error
            r, kind, msg = failed[0]
            cls = StorageError if kind == "storage" else CheckpointError
            raise cls(f"rank {r} could not load this step ({msg}); no rank restores it", step=s,
                      path=", ".join(t.url for t in tiers))
        mismatches = [(r, m) for r, (k, m) in enumerate(results) if k == "mismatch"]
        if mismatches:
            if prepared is not None:
                prepared.release()
            raise StateMismatchError(f"rank {mismatches[0][0]}: {mismatches[0][1]}", step=s)
        bad = [(r, m) for r, (k, m) in enumerate(results) if k != "ok"]
        if not bad:
            assert prepared is not None
            prepared.apply()
            return s
        if prepared is not None:
            prepared.release()
        errors.append(f"step {s}: " + "; ".join(f"rank {r}: {m}" for r, m in bad))
        log.warning("restore: step %d is not intact for rank(s) %s; trying an older step", s, [r for r, _ in bad])
    if step is None and not order:
        raise CorruptCheckpointError("no step is committed for every rank (ranks hold different steps)",
                                     path=", ".join(t.url for t in tiers))
    raise CorruptCheckpointError("no step is intact for every rank: " + " | ".join(errors),
                                 step=order[0] if order else step, path=", ".join(t.url for t in tiers))


def _share_step_manifest(eng: Engine, tiers: list[Store], step: int,
                         readers: list[int]) -> tuple[Store, StepManifest] | None:
    """Rank 0 reads the shared tier's ``manifest.json`` of ``step`` once and hands each rank in ``readers`` (those
    that read their shard from that tier) the manifest cut down to the one rank manifest it needs, so that a
    restart of W ranks from the remote reads W*117 bytes of rank list once, not once per rank (O(W^2) in all).
    Returns this rank's (tier, manifest), or None: not a reader, or rank 0 could not read it (the rank then reads
    the manifest itself and meets the same error, if any, on its own). A collective: every rank calls it for the
    same steps."""
    coord = eng.coord
    assert coord is not None
    remote = next((t for t in tiers if t.tier != "local"), None)
    if remote is None or not readers:
        return None
    parts: list[Any] | None = None
    if coord.topology.rank == 0:
        parts = [None] * coord.topology.world_size
        try:
            full = read_step(remote, step)
        except Exception as exc:  # never skip the scatter: the other ranks wait in it
            log.info("restore: step %d: rank 0 could not read %s's manifest for the other ranks: %s", step,
                     remote.tier, exc)
        else:
            refs = {ref.rank: ref for ref in full.ranks}
            for r in readers:
                ref = refs.get(r if r < full.world_size else 0)
                if ref is not None:
                    parts[r] = dataclasses.replace(full, ranks=(ref,))
    mine = coord.scatter(parts, coord.main_group)
    return None if mine is None else (remote, mine)


def recover_local(store: Store, coord: Coordinator | None) -> None:
    """Start-up cleanup of a node-local folder shared by several ranks: each rank removes its own temporary
    folders; the node's leader removes trash, manifest-less step folders and files of failed saves. A barrier
    follows, so that no rank starts saving into a folder the leader is still cleaning."""
    assert coord is not None
    topo = coord.topology
    for name in store.list(""):
        if layout.parse_tmp_dir(name) is not None and layout.tmp_dir_rank(name) == topo.rank:
            store.remove(name)
            log.info("tier local: rank %d removed its leftover %s", topo.rank, name)
    if topo.is_node_leader:
        for name in store.list(""):
            if name.startswith(layout.TRASH_PREFIX):
                store.remove(name)
                continue
            step = layout.parse_step_dir(name)
            if step is None:
                continue
            try:
                m = read_step_manifest(store, name, step)
            except CorruptCheckpointError:
                continue  # damaged: leave it for an operator; restore skips it
            if m is None:
                store.remove(name)
                log.info("tier local: removed incomplete multi-rank step folder %s", name)
            else:
                sharded.commit_step_cleanup(store, m)
    coord.gather(None, coord.main_group)
