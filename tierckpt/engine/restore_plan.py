"""Rank 0's plan of a multi-rank restore: which step every rank loads, and who reads it from the remote.

Every rank offers a bounded summary: the steps its node-local tier holds for its shard (at most ``keep_local`` of
them), or that it could not list a tier. Rank 0 alone lists the remote (its steps stay on rank 0, however many there
are). From the offers rank 0 derives the steps every rank can load (the remote's, and those every node holds
locally), newest first, and answers every rank with one small common decision: the step to try, whether the remote
holds it, and whether any rank must read it from there. Each rank derives its own tiers for that step locally (its
node-local tier if it holds the step, then the remote if the decision says the remote holds it), so no answer names
ranks per step: a restart with W ranks and N remote-only steps sends each rank O(1) bytes, not O(N x W).

With peer copies (``peer_replicas``), a rank also offers its node's number and, on a node's leader, the steps its
node holds as replicas for its source nodes (at most ``keep_local`` each, ``keep_local x peer_replicas`` in all):
rank 0 counts a step available to a rank if its node holds it or a partner of its node (one of the ``copies``
nodes after it in the ring) holds it as that node's replica. The answer stays the same O(1) decision; the rank
tries its partners itself (:func:`my_tiers`).

When the step's copy is corrupt for some rank, rank 0's verdict on the load carries the next decision (the next
older step), again O(1). Nothing here does I/O; :func:`tierckpt.engine.sharded.restore` runs the agreements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import StorageError

#: An answer names at most this many ranks (blocked, missing a step, or with a corrupt copy), and counts the rest.
LISTED_RANKS = 64


def offer(local: list[int] | None, blocked: StorageError | None, *, shared_error: bool = False) -> dict[str, Any]:
    """What a rank hands in: its node-local steps that hold its shard (``local``, bounded by local retention), or
    that a tier it needs could not be listed (``blocked``; rank 0 includes its error when ``shared_error``, the
    failed tier being the remote that it alone lists, so that every rank raises the same error)."""
    if blocked is not None:
        return {"blocked": True, "error": blocked if shared_error else None}
    return {"local": sorted(local or [])}


def _listed(ranks: list[int]) -> dict[str, Any]:
    return {"ranks": ranks[:LISTED_RANKS], "count": len(ranks)}


def describe_ranks(named: dict[str, Any]) -> str:
    """``[1, 5]``, or ``[1, 5, ...] and 90 more``, of a bounded list of ranks (:func:`_listed`)."""
    more = named["count"] - len(named["ranks"])
    return f"{named['ranks']}" + (f" and {more} more" if more > 0 else "")


class RestorePlan:
    """Rank 0's state across the agreements of one restore (empty on the other ranks: only rank 0 runs the answer
    functions): the steps every rank holds, newest first, the node-local steps each rank offered and the remote's
    steps. ``step``: the step asked for (None: the newest); ``local_first``: whether the node-local tier is read
    before the remote (the tiers' order); ``shared``: the remote's committed steps (rank 0's listing)."""

    def __init__(self, step: int | None, *, local_first: bool, shared: set[int] | None = None,
                 ring: tuple[int, int] | None = None) -> None:
        self.step, self.local_first, self.shared = step, local_first, set(shared or ())
        #: with peer copies: (the number of nodes, the partners each node copies to)
        self.ring = ring
        self.order: list[int] = []
        self.local: list[set[int]] = []

    # -------------------------------------------------------------------------------------- answers on rank 0
    def plan(self, offers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The common answer to "the step to restore": ``blocked`` (ranks that could not list a tier, and rank
        0's error if it was the remote), or ``missing`` (ranks without the requested step), or ``any`` (whether
        any rank holds any step) and ``next`` (the first decision, or None: no step every rank holds)."""
        world = len(offers)
        blocked = [r for r, o in enumerate(offers) if o.get("blocked")]
        if blocked:
            out: dict[str, Any] = {"blocked": _listed(blocked), "error": offers[0].get("error")}
            return [out] * world
        self.local = [set(o["local"]) for o in offers]
        if self.ring is not None:
            self.local = self._with_replicas(offers)
        # rank 0 could not list the remote, and its node holds nothing of its own: the replicas decide, and if they
        # do not, the remote's failure is every rank's answer (never "no checkpoint" while the remote may hold one)
        deferred = offers[0].get("deferred")
        if self.step is not None:
            missing = [r for r, h in enumerate(self.local) if self.step not in h and self.step not in self.shared]
            if missing and deferred is not None:
                return [{"blocked": _listed([0]), "error": deferred}] * world
            if missing:
                return [{"missing": _listed(missing)}] * world
            self.order = [self.step]
        else:
            everywhere = set.intersection(*self.local) if self.local else set()
            self.order = sorted(self.shared | everywhere, reverse=True)
            if not self.order and deferred is not None:
                return [{"blocked": _listed([0]), "error": deferred}] * world
        answer = {"any": bool(self.shared) or any(self.local), "next": self.decision(0)}
        return [answer] * world

    def _with_replicas(self, offers: Sequence[dict[str, Any]]) -> list[set[int]]:
        """Each rank's steps with those a partner of its node holds as that node's replica (a replica offered by
        a node that is not a partner in this job's ring is not counted: the rank would not ask it)."""
        nodes, copies = self.ring or (1, 0)
        held: dict[int, set[int]] = {}
        for o in offers:
            holder = o.get("node")
            for node, steps in o.get("replicas") or ():
                if holder in {(node + i) % nodes for i in range(1, copies + 1)}:
                    held.setdefault(node, set()).update(steps)
        return [mine | held.get(o.get("node"), set()) for mine, o in zip(self.local, offers)]

    def decision(self, index: int) -> dict[str, Any] | None:
        """The ``index``-th step to try, for every rank: the step, whether the remote holds it, and whether some
        rank reads it from the remote first (then rank 0 shares that step's manifest); None past the last."""
        if index >= len(self.order):
            return None
        s = self.order[index]
        remote = s in self.shared
        return {"step": s, "index": index, "remote": remote, "share": remote and bool(self.readers(s))}

    def readers(self, step: int) -> list[int]:
        """The ranks that read ``step`` from the remote first: those whose node does not hold it (every rank when
        the remote is read first)."""
        if not self.local_first:
            return list(range(len(self.local)))
        return [r for r, held in enumerate(self.local) if step not in held]

    def loaded(self, index: int, outcomes: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
        """Rank 0's verdict on one step's load from every rank's ``(kind, message)``: a rank that could not read
        a tier (or failed otherwise) stops everyone; a state mismatch too; a corrupt copy anywhere moves everyone
        to the next decision (``next``: the next older step, or None); else every rank applies it."""
        world = len(outcomes)
        for kinds in (("storage", "error"), ("mismatch",)):
            for r, (kind, msg) in enumerate(outcomes):
                if kind in kinds:
                    return [{"kind": kind, "rank": r, "message": msg}] * world
        bad = [(r, m) for r, (k, m) in enumerate(outcomes) if k != "ok"]
        if not bad:
            return [{"kind": "ok"}] * world
        shown = "; ".join(f"rank {r}: {m}" for r, m in bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8
                                                                      else "")
        verdict = {"kind": "corrupt", "ranks": _listed([r for r, _ in bad]), "message": shown,
                   "next": self.decision(index + 1)}
        return [verdict] * world


def my_tiers(tiers: Sequence[Any], decision: dict[str, Any], local: set[int], peer: Any = None) -> list[Any]:
    """The tiers this rank tries for the decided step, in the tiers' order: its node-local tier if that holds the
    step for its shard, then ``peer`` (its node's partners, with peer copies), the remote if the decision says the
    remote holds it."""
    s = decision["step"]
    out = []
    for t in tiers:
        if t.tier == "local":
            out += [t] if s in local else []
            out += [peer] if peer is not None else []
        elif decision["remote"]:
            out.append(t)
    return out
