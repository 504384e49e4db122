"""The manager's multi-rank paths: agreeing on commits and on the step to restore (see :mod:`.tiers.sharded` for the
protocol on storage and :mod:`.distributed` for the groups the agreements run on)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import xxhash

from ..distributed import Split
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
    UploadError,
)
from ..format import layout
from ..format.manifest import RankRef, StepManifest, shared_steps
from ..storage.base import Store
from ..storage.commit import read_step_manifest
from ..storage.failures import describe
from ..storage.retry import is_transient
from ..tiers import sharded
from ..tiers.listing import TierListings, list_tiers
from ..tiers.reader import read_step
from ..tiers.writer import RankSnapshot
from . import restore_plan
from .restore_plan import RestorePlan, describe_ranks, my_tiers

if TYPE_CHECKING:
    from ..distributed import Coordinator
    from .core import Engine

log = logging.getLogger(__name__)


def save_id(run_id: str, step: int) -> str:
    """The same on every rank without a message: a hash of the run's id (agreed at start-up) and the step."""
    return xxhash.xxh3_64_hexdigest(f"{run_id}:{step}".encode())


def persist(eng: Engine, snap: RankSnapshot, *, release: Callable[[], None]) -> None:
    """Write this rank's shard, agree with every rank that all are durable, commit on this node (its leader
    writes the step manifest of the node's ranks), agree that every node committed. Raises on every rank if any
    rank failed, naming it. Two agreements on the persist lane, O(1) requests and bytes per rank."""
    coord = eng.coord
    assert coord is not None
    topo = coord.topology
    step, sid = snap.step, snap.save_id
    outcome: dict[str, Any]
    try:
        rm, ref = sharded.persist_shard(eng.local, snap, eng.io, eng.hash, eng.incremental)
        outcome = {"ref": (ref.rank, ref.name, ref.size, ref.checksum, ref.mesh), "bytes": rm.total_bytes,
                   "node": topo.node_ranks if topo.is_node_leader else None}
        if rm.shared_bytes:  # an incremental shard: the few earlier steps it references (bounded by keep_local)
            outcome |= {"refs": list(shared_steps(rm.files)), "shared": rm.shared_bytes}
        if topo.rank == 0:
            outcome |= {"created": time.time(), "metadata": snap.metadata}
    except Exception as exc:
        log.error("tier local: rank %d could not write its shard of step %d: %s", topo.rank, step, exc)
        outcome = {"error": f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]}
    finally:
        release()
    verdict, refs = _agree(coord, outcome, _written, step, "shards written")
    if "failed" in verdict:
        try:
            sharded.discard_shard(eng.local, step, topo.rank, sid)
        except Exception as exc:  # best effort: the error that names the failing rank matters more
            log.warning("tier local: rank %d could not remove its shard of failed step %d: %s", topo.rank, step, exc)
        raise CheckpointError(f"step not committed: rank(s) {_ranks(verdict)} failed to save: "
                              + _some(verdict["failed"], verdict.get("count")), step=step, tier="local",
                              path=eng.local.url)
    ok: dict[str, Any] = {}
    if topo.is_node_leader:
        manifest = StepManifest(
            step=step, world_size=topo.world_size, save_id=sid, ranks=tuple(RankRef(*r) for r in refs),
            total_bytes=verdict["bytes"], metadata=verdict["metadata"], created=verdict["created"],
            holds_ranks=topo.node_ranks, refs=tuple(verdict.get("refs", ())), shared_bytes=verdict.get("shared", 0),
        )
        try:
            commit_local(eng, manifest)
        except Exception as exc:
            ok = {"error": f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]}
    confirmed, _ = _agree(coord, ok, _committed, step, "committed on every node")
    if "failed" in confirmed:
        raise CheckpointError(f"step not committed on the node(s) of rank(s) {_ranks(confirmed)}: "
                              + _some(confirmed["failed"], confirmed.get("count")), step=step, tier="local",
                              path=eng.local.url)
    if eng.incremental is not None:  # the next save's baseline: this rank's shard of the committed step
        eng.incremental.committed(rm, full=not rm.shared_bytes)


#: A rank's error travels cut to this many characters; a failure names at most :data:`_LISTED` ranks' errors.
_ERROR_CHARS, _LISTED = 1024, 8


def _failures(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The failed ranks of ``outcomes``, bounded: the first :data:`_LISTED` ranks' errors and the count of all
    (an answer common to every rank: a job-wide failure must not send every rank every rank's error)."""
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if not failed:
        return {}
    return {"failed": dict(failed[:_LISTED]), "count": len(failed)}


def _written(outcomes: list[dict[str, Any]]) -> Split:
    """Rank 0's answer to "shards written": common, the failures, or the step's size, creation time and metadata;
    each node leader's own, its node's rank references (O(ranks per node))."""
    world = len(outcomes)
    failed = _failures(outcomes)
    if failed:
        return Split(failed, world_size=world)
    total, zero = sum(o["bytes"] for o in outcomes), outcomes[0]
    common = {"bytes": total, "created": zero["created"], "metadata": zero["metadata"]}
    refs = sorted({s for o in outcomes for s in o.get("refs", ())})  # incremental shards: every rank's references
    if refs:
        common |= {"refs": refs, "shared": sum(o.get("shared", 0) for o in outcomes)}
    return Split(common,
                 {r: [outcomes[n]["ref"] for n in o["node"]] for r, o in enumerate(outcomes) if o["node"] is not None},
                 world_size=world)


def _committed(outcomes: list[dict[str, Any]]) -> Split:
    return Split(_failures(outcomes), world_size=len(outcomes))


def _ranks(verdict: dict[str, Any]) -> str:
    """The failed ranks a verdict names (``[1, 5]``, or ``[1, 5, ...] and 90 more``)."""
    listed = sorted(verdict["failed"])
    more = verdict.get("count", len(listed)) - len(listed)
    return f"{listed}" + (f" and {more} more" if more > 0 else "")


def _some(failed: dict[int, str], count: int | None = None, shown: int = 8) -> str:
    """``rank r: error`` for the first ``shown`` ranks of ``failed`` (a job-wide failure names thousands), of
    ``count`` in all."""
    items = sorted(failed.items())
    n = len(items) if count is None else count
    more = f"; and {n - shown} more" if n > shown else ""
    return "; ".join(f"rank {r}: {e}" for r, e in items[:shown]) + more


def commit_local(eng: Engine, manifest: StepManifest) -> None:
    sharded.commit_step(eng.local, manifest)
    log.info("tier local: committed step %d (ranks %s of %d) at %s", manifest.step, list(manifest.holds_ranks or ()),
             manifest.world_size, eng.local.url)


def _agree(coord: Coordinator, obj: Any, answer: Callable[[list[Any]], Split], step: int,
           what: str) -> tuple[dict[str, Any], Any]:
    """``(common, own)`` of an agreement on the persist lane; a failed agreement fails the step."""
    try:
        common, own = coord.exchange(obj, coord.persist_lane, answer, what=what, step=step)
        return common, own
    except CheckpointError as exc:  # a rank died or hung, or rank 0 never answered
        raise CheckpointError(f"step not committed: {exc.detail}", step=step) from exc


def upload(eng: Engine, step: int, opts: dict[str, Any], *, channel: Any, attempt: str) -> None:
    """This rank's shard to the remote; rank 0 commits the step there once every shard is in. The ranks talk
    through ``channel`` (the job's c10d store), the attempt named by rank 0's decision
    (:func:`tiers.sharded.replicate_shards`). Raises :class:`UploadError` naming the rank and the remote."""
    assert eng.remote is not None and eng.coord is not None
    rank = eng.coord.topology.rank
    local_manifest = read_step_manifest(eng.local, layout.step_dir(step), step)
    if local_manifest is None:
        raise CheckpointNotFoundError("no committed local copy to upload", step=step, tier="local", path=eng.local.url)
    try:
        sharded.replicate_shards(eng.local, eng.remote, local_manifest, rank, channel=channel, attempt=attempt, **opts)
    except CheckpointError:
        raise
    except Exception as exc:  # a storage failure outside the per-file retries (creating the folder)
        raise UploadError(f"rank {rank}: cannot replicate to {eng.remote.url}: {describe(exc)}", step=step,
                          tier=eng.remote.tier, path=eng.remote.url, transient=is_transient(exc)) from exc


def local_steps(eng: Engine, tiers: list[Store], listing: TierListings) -> set[int]:
    """The steps committed in this rank's node-local tier (if it is read) that hold this rank's shard: at most
    ``keep_local`` of them, read from the node's step manifests."""
    rank = eng.coord.topology.rank if eng.coord is not None else eng.rank
    local = next((t for t in tiers if t.tier == "local"), None)
    if local is None:
        return set()
    return {s for s in listing.steps.get(local.tier, ()) if sharded.holds_rank(local, s, rank)}


def list_tiers_shared(eng: Engine, tiers: list[Store], *, deadline_s: float | None) -> TierListings:
    """Each rank lists its node's local tier; rank 0 alone lists the shared tiers (the remote), so a restart lists
    the remote once, not once per rank, and no rank but 0 ever holds the remote's steps (the restore plan hands
    every rank only the decision it needs: :mod:`.restore_plan`)."""
    coord = eng.coord
    assert coord is not None
    mine = list_tiers([t for t in tiers if t.tier == "local"], deadline_s=deadline_s)
    shared = [t for t in tiers if t.tier != "local"]
    if not shared or coord.topology.rank != 0:
        return mine
    ours = list_tiers(shared, deadline_s=deadline_s)
    return TierListings({**mine.steps, **ours.steps}, {**mine.failed, **ours.failed})


def restore(eng: Engine, state: MutableMapping[str, Any], step: int | None, tiers: list[Store], *,
            strict: bool, load: Callable[..., Any], listing: TierListings) -> int | None:
    """Every rank loads the same step: the newest that every rank can load intact from some tier (see
    :mod:`.restore_plan` for what the ranks tell each other). A rank whose listing depends on a tier it could not
    read (:meth:`TierListings.require`) makes every rank raise."""
    coord = eng.coord
    assert coord is not None
    rank = coord.topology.rank
    urls = ", ".join(t.url for t in tiers)
    try:
        listing.require(step, urls)
        blocked = None
    except StorageError as exc:
        blocked = exc
    peers = eng.peers if any(t.tier == "local" for t in tiers) else None  # a replaced node's shards, on partners
    deferred = None
    if blocked is not None and peers is not None and rank == 0 and "local" not in listing.failed:
        deferred, blocked = blocked, None  # only the remote failed: a partner may hold this node's steps
    local = local_steps(eng, tiers, listing) if blocked is None else set()
    shared = {s for t in tiers if t.tier != "local" for s in listing.steps.get(t.tier, ())}
    planner = RestorePlan(step, local_first=bool(tiers) and tiers[0].tier == "local", shared=shared,
                          ring=None if peers is None else (peers.ring.nodes, peers.ring.copies))
    shared_error = rank == 0 and any(t != "local" for t in listing.failed)
    mine = restore_plan.offer(sorted(local), blocked, shared_error=shared_error)
    if peers is not None and blocked is None:
        mine |= peers.offer() | ({"deferred": deferred} if deferred is not None else {})
    plan = coord.reduce(mine, coord.main_lane,
                        lambda offers: planner.plan(offers)[0], what="the step to restore", step=step)
    if "blocked" in plan:
        if blocked is not None:
            raise blocked
        if plan["error"] is not None:
            raise plan["error"]
        raise StorageError(f"rank(s) {describe_ranks(plan['blocked'])} could not list a tier that may hold the "
                           "checkpoint; not restoring", step=step, path=urls, transient=True)
    if "missing" in plan:
        raise CheckpointNotFoundError(f"rank(s) {describe_ranks(plan['missing'])} find no committed copy of this "
                                      "step", step=step, path=urls)
    decision = plan["next"]
    if step is None and decision is None and not plan["any"]:
        return None
    first = None if decision is None else decision["step"]
    errors: list[str] = []
    own_error: Exception | None = None
    while decision is not None:
        s, index = decision["step"], decision["index"]
        prepared = None
        outcome: tuple[str, str] = ("ok", "")
        shared_manifest = _share_step_manifest(eng, tiers, decision, planner)
        for store in my_tiers(tiers, decision, local, peers):
            try:
                if store is peers:  # fetched from a partner, verified on receipt; read and verified as any copy
                    store = peers.fetch(s)
                if shared_manifest is not None and store is shared_manifest[0]:
                    prepared = load(store, s, state, strict, shared_manifest[1])
                else:
                    prepared = load(store, s, state, strict)
                break
            except StateMismatchError as exc:
                outcome = ("mismatch", exc.detail)
                break
            except CorruptCheckpointError as exc:
                log.warning("restore: rank %d: step %d in tier %s is corrupt (%s); files: %s", rank, s,
                            store.tier, exc, ", ".join(exc.bad_files) or "?")
                outcome = ("corrupt", str(exc)[:1024])
            except Exception as exc:  # a tier that cannot be read, a bug: every rank stops, none waits for this one
                own_error = exc
                outcome = ("storage" if isinstance(exc, StorageError) else "error",
                           f"{type(exc).__name__}: {exc}"[:1024])
                break
        if prepared is None and outcome[0] == "ok":
            outcome = ("corrupt", "no tier holds an intact copy")
        verdict = coord.reduce(outcome if prepared is None else ("ok", ""), coord.main_lane,
                               lambda outcomes, i=index: planner.loaded(i, outcomes)[0],
                               what=f"loading step {s}", step=s)
        if verdict["kind"] in ("storage", "error"):
            if prepared is not None:
                prepared.release()
            if own_error is not None and outcome[0] in ("storage", "error"):
                raise own_error
            cls = StorageError if verdict["kind"] == "storage" else CheckpointError
            raise cls(f"rank {verdict['rank']} could not load this step ({verdict['message']}); no rank restores it",
                      step=s, path=urls)
        if verdict["kind"] == "mismatch":
            if prepared is not None:
                prepared.release()
            raise StateMismatchError(f"rank {verdict['rank']}: {verdict['message']}", step=s)
        if verdict["kind"] == "ok":
            assert prepared is not None
            prepared.apply()
            return int(s)
        if prepared is not None:
            prepared.release()
        errors.append(f"step {s}: {verdict['message']}")
        log.warning("restore: step %d is not intact for rank(s) %s; trying an older step", s,
                    describe_ranks(verdict["ranks"]))
        decision = verdict["next"]
    if step is None and first is None:
        raise CorruptCheckpointError("no step is committed for every rank (ranks hold different steps)", path=urls)
    raise CorruptCheckpointError("no step is intact for every rank: " + " | ".join(errors),
                                 step=first if first is not None else step, path=urls)


def _share_step_manifest(eng: Engine, tiers: list[Store], decision: dict[str, Any],
                         planner: RestorePlan) -> tuple[Store, StepManifest] | None:
    """Where some rank reads the decided step from the remote first (``decision["share"]``), rank 0 reads the
    remote's ``manifest.json`` of it once and hands each such rank the manifest cut down to the one rank manifest
    it needs: the step's fields once, common to all, and one rank reference per reader, so that a restart of W
    ranks from the remote reads the W-rank list once, not once per rank (O(W^2) in all), and no rank receives
    more than its own reference. Returns this rank's (tier, manifest), or None: not a reader, or rank 0 could not
    read it (the rank then reads the manifest itself and meets the same error, if any, on its own). A collective:
    every rank calls it for the same decisions."""
    coord = eng.coord
    assert coord is not None
    remote = next((t for t in tiers if t.tier != "local"), None)
    if remote is None or not decision["share"]:
        return None
    step = decision["step"]
    full: StepManifest | None = None
    if coord.topology.rank == 0:
        try:
            full = read_step(remote, step)
        except Exception as exc:  # never skip the agreement: the other ranks wait in it
            log.info("restore: step %d: rank 0 could not read %s's manifest for the other ranks: %s", step,
                     remote.tier, exc)
    common, own = coord.exchange(None, coord.main_lane, lambda inputs: _manifest_parts(full, planner, step,
                                                                                        len(inputs)),
                                 what=f"the manifest of step {step}", step=step)
    if common is None or own is None:
        return None
    return remote, dataclasses.replace(common, ranks=(own,))


def _manifest_parts(full: StepManifest | None, planner: RestorePlan, step: int, world: int) -> Split:
    """Rank 0: the step's manifest with one rank reference (common), and each reader's own reference (a rank the
    step was not saved with, in a resharding restart, gets rank 0's)."""
    if full is None:
        return Split(None, world_size=world)
    refs = {ref.rank: ref for ref in full.ranks}
    own = {}
    for r in planner.readers(step):
        ref = refs.get(r if r < full.world_size else 0)
        if ref is not None:
            own[r] = ref
    return Split(dataclasses.replace(full, ranks=full.ranks[:1]), own, world_size=world)


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
    coord.barrier(coord.main_lane, what="start-up clean-up")
