"""The manager's multi-rank paths: agreeing on commits and on the step to restore (see :mod:`.tiers.sharded` for the
protocol on storage and :mod:`.distributed` for the groups the agreements run on)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
    UploadError,
)
from ..format import layout
from ..format.manifest import RankRef, StepManifest
from ..storage.base import Store
from ..storage.commit import read_step_manifest
from ..storage.failures import describe
from ..storage.retry import is_transient
from ..tiers import sharded
from ..tiers.listing import TierListings, list_tiers
from ..tiers.reader import read_step
from ..tiers.writer import RankSnapshot

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
        rm, ref = sharded.persist_shard(eng.local, snap, eng.io, eng.hash)
        outcome = {"ref": (ref.rank, ref.name, ref.size, ref.checksum, ref.mesh), "bytes": rm.total_bytes,
                   "node": topo.node_ranks if topo.is_node_leader else None}
        if topo.rank == 0:
            outcome |= {"created": time.time(), "metadata": snap.metadata}
    except Exception as exc:
        log.error("tier local: rank %d could not write its shard of step %d: %s", topo.rank, step, exc)
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        release()
    verdict = _agree(coord, outcome, _written, step, "shards written")
    if "failed" in verdict:
        try:
            sharded.discard_shard(eng.local, step, topo.rank, sid)
        except Exception as exc:  # best effort: the error that names the failing rank matters more
            log.warning("tier local: rank %d could not remove its shard of failed step %d: %s", topo.rank, step, exc)
        raise CheckpointError(f"step not committed: rank(s) {sorted(verdict['failed'])} failed to save: "
                              + _some(verdict["failed"]), step=step, tier="local", path=eng.local.url)
    ok: dict[str, Any] = {}
    if topo.is_node_leader:
        manifest = StepManifest(
            step=step, world_size=topo.world_size, save_id=sid, ranks=tuple(RankRef(*r) for r in verdict["refs"]),
            total_bytes=verdict["bytes"], metadata=verdict["metadata"], created=verdict["created"],
            holds_ranks=topo.node_ranks,
        )
        try:
            commit_local(eng, manifest)
        except Exception as exc:
            ok = {"error": f"{type(exc).__name__}: {exc}"}
    confirmed = _agree(coord, ok, _committed, step, "committed on every node")
    if "failed" in confirmed:
        raise CheckpointError(f"step not committed on the node(s) of rank(s) {sorted(confirmed['failed'])}: "
                              + _some(confirmed["failed"]), step=step, tier="local", path=eng.local.url)


def _written(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's answers to "shards written": the failures for everyone, or each node leader its node's rank
    references (with the step's size, creation time and metadata); the other ranks just an ok."""
    failed = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
    if failed:
        return [{"failed": failed}] * len(outcomes)
    total, zero = sum(o["bytes"] for o in outcomes), outcomes[0]
    return [{} if o["node"] is None else
            {"refs": [outcomes[n]["ref"] for n in o["node"]], "bytes": total, "created": zero["created"],
             "metadata": zero["metadata"]} for o in outcomes]


def _committed(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    failed = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
    return [{"failed": failed} if failed else {}] * len(outcomes)


def _some(failed: dict[int, str], shown: int = 8) -> str:
    """``rank r: error`` for the first ``shown`` ranks of ``failed`` (a job-wide failure names thousands)."""
    items = sorted(failed.items())
    more = f"; and {len(items) - shown} more" if len(items) > shown else ""
    return "; ".join(f"rank {r}: {e}" for r, e in items[:shown]) + more


def commit_local(eng: Engine, manifest: StepManifest) -> None:
    sharded.commit_step(eng.local, manifest)
    log.info("tier local: committed step %d (ranks %s of %d) at %s", manifest.step, list(manifest.holds_ranks or ()),
             manifest.world_size, eng.local.url)


def _agree(coord: Coordinator, obj: Any, answer: Callable[[list[Any]], list[Any]], step: int,
           what: str) -> dict[str, Any]:
    try:
        out: dict[str, Any] = coord.exchange(obj, coord.persist_lane, answer, what=what, step=step)
        return out
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
    listing to every rank, so a restart lists the remote once, not once per rank."""
    coord = eng.coord
    assert coord is not None
    mine = list_tiers([t for t in tiers if t.tier == "local"], deadline_s=deadline_s)
    shared = [t for t in tiers if t.tier != "local"]
    ours = list_tiers(shared, deadline_s=deadline_s) if shared and coord.topology.rank == 0 else None
    theirs = coord.broadcast(ours, coord.main_lane, what="listing the remote") if shared else None
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
    plan = coord.reduce(offer, coord.main_lane, partial(_plan, step), what="the step to restore", step=step)
    if "blocked" in plan:
        if blocked is not None:
            raise blocked
        raise StorageError(f"rank(s) {plan['blocked']} could not list a tier that may hold the checkpoint; "
                           "not restoring", step=step, path=", ".join(t.url for t in tiers), transient=True)
    if "missing" in plan:
        raise CheckpointNotFoundError(f"rank(s) {plan['missing']} find no committed copy of this step", step=step,
                                      path=", ".join(t.url for t in tiers))
    order: list[int] = plan["order"]
    if step is None and not order and not plan["any"]:
        return None
    errors: list[str] = []
    own_error: Exception | None = None
    for s in order:
        prepared = None
        outcome: tuple[str, str] = ("ok", "")
        shared = _share_step_manifest(eng, tiers, s, plan["readers"].get(s, []))
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
        verdict = coord.reduce(outcome if prepared is None else ("ok", ""), coord.main_lane, _loaded,
                               what=f"loading step {s}", step=s)
        if verdict["kind"] in ("storage", "error"):
            if prepared is not None:
                prepared.release()
            if own_error is not None and outcome[0] in ("storage", "error"):
                raise own_error
            cls = StorageError if verdict["kind"] == "storage" else CheckpointError
            raise cls(f"rank {verdict['rank']} could not load this step ({verdict['message']}); no rank restores it",
                      step=s, path=", ".join(t.url for t in tiers))
        if verdict["kind"] == "mismatch":
            if prepared is not None:
                prepared.release()
            raise StateMismatchError(f"rank {verdict['rank']}: {verdict['message']}", step=s)
        if verdict["kind"] == "ok":
            assert prepared is not None
            prepared.apply()
            return s
        if prepared is not None:
            prepared.release()
        errors.append(f"step {s}: {verdict['message']}")
        log.warning("restore: step %d is not intact for rank(s) %s; trying an older step", s, verdict["ranks"])
    if step is None and not order:
        raise CorruptCheckpointError("no step is committed for every rank (ranks hold different steps)",
                                     path=", ".join(t.url for t in tiers))
    raise CorruptCheckpointError("no step is intact for every rank: " + " | ".join(errors),
                                 step=order[0] if order else step, path=", ".join(t.url for t in tiers))


def _plan(step: int | None, offers: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Rank 0's plan of a restore from every rank's offer: the ranks that could not list a tier, or those missing
    the requested ``step``, or the steps every rank holds, newest first, with, per step, the ranks that read it
    from the shared tier (to which rank 0 hands their entry of its manifest)."""
    blocked = [r for r, o in enumerate(offers) if o is None]
    if blocked:
        return {"blocked": blocked}
    held = [set(o["steps"]) for o in offers if o is not None]
    common = set.intersection(*held)
    if step is not None:
        missing = [r for r, h in enumerate(held) if step not in h]
        if missing:
            return {"missing": missing}
        order = [step]
    else:
        order = sorted(common, reverse=True)
    readers: dict[int, list[int]] = {s: [] for s in order}
    for r, o in enumerate(offers):
        assert o is not None
        for s in o["shared_first"]:
            if s in readers:
                readers[s].append(r)
    return {"order": order, "readers": readers, "any": any(held)}


def _loaded(outcomes: list[tuple[str, str]]) -> dict[str, Any]:
    """Rank 0's verdict on one step's load from every rank's outcome: a rank that could not read a tier (or
    failed otherwise) stops everyone; a state mismatch too; a corrupt copy anywhere moves everyone to an older
    step; else every rank applies it."""
    for kinds in (("storage", "error"), ("mismatch",)):
        for r, (kind, msg) in enumerate(outcomes):
            if kind in kinds:
                return {"kind": kind, "rank": r, "message": msg}
    bad = [(r, m) for r, (k, m) in enumerate(outcomes) if k != "ok"]
    if not bad:
        return {"kind": "ok"}
    return {"kind": "corrupt", "ranks": [r for r, _ in bad], "message": _some(dict(bad))}


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
    mine = coord.scatter(parts, coord.main_lane, what=f"the manifest of step {step}")
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
    coord.barrier(coord.main_lane, what="start-up clean-up")
