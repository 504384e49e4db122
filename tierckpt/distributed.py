"""torch.distributed glue: the agreements a multi-rank job needs, made through the job's c10d store.

The manager runs no collective on any process group and creates none. Every agreement (that each rank's shard of a
step is durable, which step to restore, where a node's ranks are) is an :meth:`Coordinator.exchange` through the
job's c10d store (the TCPStore or FileStore the default process group was created with): each rank sets one key,
rank 0 waits for the W keys, reads them in one request, computes each rank's answer and sets one key per rank; each
rank waits for its own answer and removes both of its keys. A rank therefore sends O(1) requests and bytes per
agreement whatever the world size, rank 0 O(1) requests (its multi-key wait, get and set) carrying O(W) bytes, and
no rank holds a connection to any other rank (a gloo group would connect every rank to every other).

Agreements come in *lanes*, one per thread that makes them (the persist thread; the caller's thread for
construction, restore and rollback): each lane numbers its agreements, and every rank makes the same agreements of
a lane in the same order, so the numbers match without a message. Each lane talks over its own connection to the
store (a blocking wait on a TCPStore client holds that client until it returns). A rank that dies or hangs makes
rank 0's wait run out after ``collective_timeout_s``; rank 0 then answers every rank with an error naming the ranks
that never arrived. If rank 0 itself dies, the others' waits for its answer run out after twice that time, with an
error saying so.

Agreements carry JSON of a fixed set of types (:mod:`.engine.messages`): nothing a rank reads from the store is
unpickled.

The upload thread coordinates through the same store (:class:`StoreChannel`): rank 0's replication decisions and
each multi-rank upload's messages.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .engine.messages import Codec, MessageError
from .errors import CheckpointError
from .format.manifest import RankRef, StepManifest
from .tiers.listing import TierListings

log = logging.getLogger(__name__)


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the job's size: as given, else from an initialised default process group, else a
    single-process job (0, 1); refused unless ``0 <= rank < world_size``."""
    if (rank is None or world_size is None) and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if type(rank) is not int or type(world_size) is not int or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank/world_size: {rank!r}/{world_size!r}")
    return rank, world_size


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    #: ranks that share this rank's local folder (same host and path), this rank included, sorted
    node_ranks: tuple[int, ...]
    #: an id shared by every rank of this run of the job; save ids derive from it and the step
    run_id: str

    @property
    def is_node_leader(self) -> bool:
        return self.rank == self.node_ranks[0]


class AgreementError(CheckpointError):
    """The ranks could not agree: a rank never reached the agreement (it died or hung) or rank 0 never answered.
    ``ranks`` names the ranks that never arrived, where rank 0 could tell."""

    def __init__(self, message: str, *, ranks: list[int] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.ranks = ranks or []


class Lane:
    """The agreements one thread makes, numbered in order; the same numbers on every rank."""

    def __init__(self, name: str, store: Any) -> None:
        self.name = name
        self.store = store
        self.seq = 0
        self.thread: int | None = None

    def next(self) -> int:
        me = threading.get_ident()
        if self.thread is None:
            self.thread = me
        elif self.thread != me:  # a programming error: two threads would interleave their numbers
            raise RuntimeError(f"lane {self.name} is used by two threads")
        self.seq += 1
        return self.seq


def _connection(store: Any) -> Any:
    """A connection of its own to ``store`` (a blocking wait holds a TCPStore client until it returns), or the
    store itself where it cannot be cloned (a FileStore's waits poll without holding it)."""
    try:
        return store.clone()
    except Exception:  # torch < 2.5, or a store without clone
        return store


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as exc:  # pragma: no cover - every initialised default group has a store
        raise CheckpointError(f"a multi-rank CheckpointManager needs the default process group's store: {exc}") from exc


def _wait(store: Any, keys: list[str], timeout_s: float) -> list[str]:
    """The keys of ``keys`` that are set once all are, or when ``timeout_s`` ran out."""
    try:
        store.wait(keys, datetime.timedelta(seconds=max(0.001, timeout_s)))
        return keys
    except Exception:  # the store's timeout error: some are not set
        return [k for k in keys if store.check([k])]


def _get_many(store: Any, keys: list[str]) -> list[bytes]:
    try:
        return list(store.multi_get(keys))
    except AttributeError:  # torch < 2.4
        return [store.get(k) for k in keys]


def _set_many(store: Any, keys: list[str], values: list[bytes]) -> None:
    try:
        store.multi_set(keys, values)
    except AttributeError:  # torch < 2.4
        for k, v in zip(keys, values):
            store.set(k, v)


class Coordinator:
    """The agreements of one manager's ranks, through the job's c10d store (see the module docstring).

    Lanes: :attr:`persist_lane` (the persist thread: a step's shards are durable, committed on every node) and
    :attr:`main_lane` (the caller's thread: construction, restore, rollback). Operations, each made by every rank
    on the same lane in the same order: :meth:`exchange` (rank 0 answers each rank from everyone's input),
    :meth:`reduce` (one answer for all), :meth:`broadcast`, :meth:`scatter` and :meth:`barrier`."""

    def __init__(self, local_dir: str, *, timeout_s: float) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("a multi-rank CheckpointManager needs torch.distributed to be initialised")
        self.timeout_s = timeout_s
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._store = _default_store()
        # the n-th manager this rank creates in this job: every rank creates them in the same order
        n = self._store.add(f"tierckpt/managers/r{self._rank}", 1)
        self._prefix = f"tierckpt/m{n}/"
        self.persist_lane = Lane("persist", _connection(self._store))
        self.main_lane = Lane("main", _connection(self._store))
        me = (socket.gethostname(), os.path.realpath(local_dir))
        node_ranks, run_id = self.exchange(me, self.main_lane, _nodes, what="start-up")
        self.topology = Topology(self._rank, self._world, tuple(node_ranks), run_id)
        log.info("rank %d of %d: local folder shared with ranks %s; run %s", self._rank, self._world, list(node_ranks),
                 run_id)

    # --------------------------------------------------------------------------------------------- agreements
    def exchange(self, obj: Any, lane: Lane, answer: Callable[[list[Any]], list[Any]], *, what: str,
                 step: int | None = None) -> Any:
        """Every rank hands in ``obj``; rank 0 calls ``answer`` with the W objects (in rank order) and each rank
        returns its element of the list it returns. Raises :class:`AgreementError` naming the ranks that did not
        arrive within ``timeout_s`` (or saying that rank 0 did not answer), on every rank that can still hear it;
        an exception ``answer`` raises is raised on every rank."""
        seq = lane.next()
        base = f"{self._prefix}{lane.name}/{seq}/"
        mine, out = f"{base}in/{self._rank}", f"{base}out/{self._rank}"
        try:
            payload = _CODEC.encode(obj)
        except TypeError as exc:  # a bug; still hand something in, so that no rank waits for this one
            payload = _CODEC.encode(_Failed(message=f"rank {self._rank}: {exc}"))
        lane.store.set(mine, payload)
        if self._rank == 0:
            self._answer(lane.store, base, answer, what, step)
        if not _wait(lane.store, [out], 2 * self.timeout_s):
            raise AgreementError(f"rank 0 did not answer ({what}) within {2 * self.timeout_s:.0f} s; it may have died",
                                 ranks=[0], step=step)
        raw = lane.store.get(out)
        for key in (mine, out):
            lane.store.delete_key(key)
        try:
            reply = _CODEC.decode(raw)
        except MessageError as exc:
            raise CheckpointError(f"ranks could not agree ({what}): rank 0's answer is malformed: {exc}",
                                  step=step) from None
        if isinstance(reply, _Failed):
            raise reply.error(what, step)
        return reply

    def _answer(self, store: Any, base: str, answer: Callable[[list[Any]], list[Any]], what: str,
                step: int | None) -> None:
        keys = [f"{base}in/{r}" for r in range(self._world)]
        there = set(_wait(store, keys, self.timeout_s))
        if len(there) < len(keys):
            missing = [r for r, k in enumerate(keys) if k not in there]
            log.error("rank(s) %s did not reach the agreement (%s) within %.0f s", missing, what, self.timeout_s)
            payloads = [_CODEC.encode(_Failed(missing=missing))] * self._world
        else:
            try:
                inputs = []
                for r, raw in enumerate(_get_many(store, keys)):
                    try:
                        inputs.append(_CODEC.decode(raw))
                    except MessageError as exc:
                        raise MessageError(f"rank {r}'s input: {exc}") from None
                failed = next((i for i in inputs if isinstance(i, _Failed)), None)
                replies = [failed] * self._world if failed is not None else answer(inputs)
                if len(replies) != self._world:
                    raise RuntimeError(f"{len(replies)} answers for {self._world} ranks")
                payloads = [_CODEC.encode(r) for r in replies]
            except Exception as exc:
                payloads = [_CODEC.encode(_Failed(message=f"rank 0 failed: {type(exc).__name__}: {exc}"))] * self._world
        _set_many(store, [f"{base}out/{r}" for r in range(self._world)], payloads)

    def reduce(self, obj: Any, lane: Lane, combine: Callable[[list[Any]], Any], *, what: str,
               step: int | None = None) -> Any:
        """Every rank gets ``combine`` of the W objects, computed once by rank 0."""
        return self.exchange(obj, lane, lambda objs: [combine(objs)] * len(objs), what=what, step=step)

    def broadcast(self, obj: Any, lane: Lane, *, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (the others' are ignored)."""
        return self.reduce(obj if self._rank == 0 else None, lane, lambda objs: objs[0], what=what)

    def scatter(self, objs: list[Any] | None, lane: Lane, *, what: str) -> Any:
        """Rank 0 hands rank r ``objs[r]`` (``objs`` is read on rank 0 only); every rank returns its own."""
        return self.exchange(objs if self._rank == 0 else None, lane, lambda all_: list(all_[0]), what=what)

    def barrier(self, lane: Lane, *, what: str) -> None:
        self.reduce(None, lane, lambda _objs: None, what=what)

    def upload_channel(self) -> StoreChannel:
        """Where rank 0's replicator publishes its decisions and the others read them (see
        :class:`tierckpt.replication.replicator.UploadChannel`)."""
        return StoreChannel(self.topology.run_id, self._rank, self._world, store=_connection(self._store))

    def destroy(self) -> None:
        """Nothing to release: the manager holds no process group (kept for callers that close a coordinator)."""


@dataclass(frozen=True)
class _Failed:
    """Rank 0's answer when an agreement failed: the ranks that never arrived, or the error its answer raised (also
    what a rank hands in when its input cannot be sent, so that rank 0 fails the agreement for everyone)."""

    missing: list[int] = field(default_factory=list)
    message: str = ""

    def error(self, what: str, step: int | None) -> CheckpointError:
        if self.missing:
            names = ", ".join(f"rank {r}" for r in self.missing)
            return AgreementError(f"ranks could not agree ({what}); {names} never reached it (died or hung)",
                                  ranks=self.missing, step=step)
        return CheckpointError(f"ranks could not agree ({what}): {self.message}", step=step)


#: What agreements carry: JSON with a fixed set of types (:mod:`.engine.messages`), never pickle.
_CODEC = Codec((StepManifest, RankRef, TierListings, _Failed))


def _nodes(everyone: list[tuple[str, str]]) -> list[tuple[list[int], str]]:
    """Start-up, on rank 0: each rank's node (the ranks with its host and folder) and the run's id."""
    run_id = secrets.token_hex(8)
    nodes: dict[tuple[str, str], list[int]] = {}
    for r, where in enumerate(everyone):
        nodes.setdefault(tuple(where), []).append(r)  # type: ignore[arg-type]
    return [(nodes[tuple(where)], run_id) for where in everyone]  # type: ignore[index]


class StoreChannel:
    """Rank 0's replication decisions, and the messages of each multi-rank upload, shared through the job's c10d
    store (the TCPStore or FileStore the default process group was created with): one key per message under
    ``tierckpt/<run id>/upload/``, set by one rank and read by a known number of others, the last of which deletes
    it, so the store holds only messages not yet read by everyone. Decisions are numbered ``<n>`` and read by every
    rank but 0 in order; an upload's messages are ``a<n>/go`` and ``a<n>/result`` (rank 0 to all) and
    ``a<n>/r<rank>`` (each rank's report to rank 0; :func:`tierckpt.tiers.sharded.replicate_shards`). Not a
    collective: a rank busy uploading reads the next decision when it is done."""

    def __init__(self, run_id: str, rank: int, world_size: int, *, store: Any = None) -> None:
        self.leader = rank == 0
        self._prefix = f"tierckpt/{run_id}/upload/"
        self._followers = world_size - 1
        self._store = _default_store() if store is None else store

    def publish(self, seq: int, decision: dict[str, Any]) -> None:
        self.post(str(seq), decision)

    def receive(self, seq: int, timeout_s: float) -> dict[str, Any] | None:
        return self.fetch([str(seq)], timeout_s, readers=self._followers).get(str(seq))

    def post(self, name: str, value: dict[str, Any]) -> None:
        """Set ``name`` (under this run's prefix) to ``value``, as JSON."""
        self._store.set(self._prefix + name, json.dumps(value))

    def fetch(self, names: list[str], timeout_s: float | None, *, readers: int) -> dict[str, dict[str, Any]]:
        """The values of ``names`` once every one is set, or of those set when ``timeout_s`` ran out (None: the
        store's own timeout). Each of the ``readers`` ranks that fetch a name counts itself; the last removes it."""
        keys = [self._prefix + n for n in names]
        try:
            if timeout_s is None:
                self._store.wait(keys)
            else:
                self._store.wait(keys, datetime.timedelta(seconds=max(0.001, timeout_s)))
            there = keys
        except Exception:  # the store's timeout error: some are not set yet
            there = [k for k in keys if self._store.check([k])]
        out = {}
        for name, key in zip(names, keys):
            if key not in there:
                continue
            out[name] = json.loads(self._store.get(key))
            try:
                if self._store.add(f"{key}/read", 1) >= readers:
                    self._store.delete_key(key)
                    self._store.delete_key(f"{key}/read")
            except Exception as exc:  # a store without delete_key keeps a few bytes per message
                log.debug("cannot remove the read message %s: %s", key, exc)
        return out
