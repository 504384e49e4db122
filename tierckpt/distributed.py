"""torch.distributed glue: the agreements a multi-rank job needs, made through the job's c10d store.

The manager runs no collective on any process group and creates none. Every agreement (that each rank's shard of a
step is durable, which step to restore, where a node's ranks are) is an :meth:`Coordinator.exchange` through the
job's c10d store (the TCPStore or FileStore the default process group was created with). Agreement ``n`` of lane
``L`` of manager ``m`` uses the keys under ``tierckpt/m<m>/<L>/<n>/``:

1. each rank but 0 sets ``in/<rank>``, its input (a request with no reply);
2. rank 0 waits for the W-1 inputs and reads them, in batches (:mod:`.store_client`: at most 512 keys and about
   64 KiB per request), computes the answers, sets ``out/<rank>`` for the ranks whose answer differs from the
   common one (in batches), then ``answer``: the common answer, with the number of ranks that will read it;
3. each rank waits for ``answer``, reads it and its ``out/<rank>`` if it has one (one request each:
   :meth:`.StoreOps.get_now`), removes ``out/<rank>`` and ``in/<rank>``, and adds 1 to ``read``; the rank that
   brings ``read`` to the number of readers removes ``answer`` and ``read``.

A rank other than 0 thus makes five requests per agreement, four of which wait for a reply (a wait, a read, a
removal, an addition): on a store shared by thousands of ranks, the replies are what the store and the ranks
spend their time on.

So every rank sends and receives O(1) requests and bytes per agreement, whatever the world size: its input and
answer are bounded (a rank's steps in its node-local tier, a few fields; never a list of ranks or of remote steps),
and an answer common to all is stored once. Rank 0 makes O(W / 512) requests carrying O(W) bytes, none of them
serial per rank. No value exceeds :data:`~tierckpt.store_client.MAX_VALUE_BYTES` (1 MiB; libuv's TCPStore refuses
8 MiB), and no request grows past a batch (libuv's server parses an unfinished request again from its start, so a
large request costs it quadratic time). When the agreement is over, none of its keys is left, whether it succeeded
or failed: a rank rank 0 gave up on (and any rank that gave up on rank 0) removes its own input. No rank holds a
connection to any other rank (a gloo group would connect every rank to every other).

Agreements come in *lanes*, one per thread that makes them (the persist thread; the caller's thread for
construction, restore and rollback): each lane numbers its agreements, and every rank makes the same agreements of
a lane in the same order, so the numbers match without a message. Each lane talks over its own connection to the
store (a blocking wait on a TCPStore client holds that client until it returns). A rank that dies or hangs makes
rank 0's wait run out after ``collective_timeout_s``; rank 0 then answers every rank with an error naming the ranks
that never arrived (the first 64, and the count of the others). If rank 0 itself dies, the others' waits for its
answer run out after twice that time, with an error saying so. A failure of the store itself (its host gone, a
connection reset) is an :class:`AgreementError` naming the rank and the store, on every rank that meets it.

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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .engine.messages import Codec, MessageError
from .errors import CheckpointError
from .format.manifest import RankRef, StepManifest
from .store_client import MAX_VALUE_BYTES, AgreementError, StoreOps
from .tiers.listing import TierListings

__all__ = ["AgreementError", "Coordinator", "Lane", "Split", "StoreChannel", "Topology", "rank_and_world"]

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


class Split:
    """An answer in two parts: ``common``, the same for every rank (set once, under one key that every rank reads),
    and ``own[r]``, more for the few ranks that get more (one key each). Rank r receives ``(common, own.get(r))``;
    indexing a Split gives just that, so it stands wherever a list of W answers does."""

    def __init__(self, common: Any, own: dict[int, Any] | None = None, *, world_size: int) -> None:
        self.common, self.own, self.world_size = common, own or {}, world_size

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, rank: int) -> tuple[Any, Any]:
        return self.common, self.own.get(rank)


class Coordinator:
    """The agreements of one manager's ranks, through the job's c10d store (see the module docstring).

    Lanes: :attr:`persist_lane` (the persist thread: a step's shards are durable, committed on every node) and
    :attr:`main_lane` (the caller's thread: construction, restore, rollback). Operations, each made by every rank
    on the same lane in the same order: :meth:`exchange` (rank 0 answers each rank from everyone's input),
    :meth:`reduce` (one answer for all), :meth:`broadcast`, :meth:`scatter` and :meth:`barrier`.

    ``store``, ``rank`` and ``world_size`` default to the default process group's; given, no process group is
    needed (``benchmarks/restart_sim.py`` runs thousands of ranks' coordinators in a few processes)."""

    def __init__(self, local_dir: str, *, timeout_s: float, store: Any = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if store is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise CheckpointError("a multi-rank CheckpointManager needs torch.distributed to be initialised")
            store = _default_store()
        if rank is None or world_size is None:
            rank, world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._rank, self._world = rank, world_size
        self._store = store
        # the n-th manager this rank creates in this job: every rank creates them in the same order
        n = StoreOps(store, rank, what="start-up").add(f"tierckpt/managers/r{self._rank}", 1)
        self._prefix = f"tierckpt/m{n}/"
        self.persist_lane = Lane("persist", _connection(self._store))
        self.main_lane = Lane("main", _connection(self._store))
        me = (socket.gethostname(), os.path.realpath(local_dir))
        common, own = self.exchange(me, self.main_lane, _nodes, what="start-up")
        block = common["block"]
        node_ranks = own if block is None else range(rank // block * block, rank // block * block + block)
        self.topology = Topology(self._rank, self._world, tuple(node_ranks), common["run"])
        log.info("rank %d of %d: local folder shared with ranks %s; run %s", self._rank, self._world, list(node_ranks),
                 self.topology.run_id)

    # --------------------------------------------------------------------------------------------- agreements
    def exchange(self, obj: Any, lane: Lane, answer: Callable[[list[Any]], Sequence[Any]], *, what: str,
                 step: int | None = None) -> Any:
        """Every rank hands in ``obj``; rank 0 calls ``answer`` with the W objects (in rank order) and each rank
        returns its element of the list it returns (or of the :class:`Split`: ``(common, own)``). Raises
        :class:`AgreementError` naming the ranks that did not arrive within ``timeout_s`` (or saying that rank 0
        did not answer, or that the store failed), on every rank that can still hear it; an exception ``answer``
        raises is raised on every rank. See the module docstring for the keys and their bounds."""
        seq = lane.next()
        base = f"{self._prefix}{lane.name}/{seq}/"
        io = StoreOps(lane.store, self._rank, what=what, step=step)
        try:
            payload = _CODEC.encode(obj)
            if self._rank != 0 and len(payload) > MAX_VALUE_BYTES:  # rank 0's input never goes to the store
                raise TypeError(f"its input is {len(payload)} bytes, over the {MAX_VALUE_BYTES} an agreement carries")
        except TypeError as exc:  # a bug; still hand something in, so that no rank waits for this one
            payload = _CODEC.encode(_Failed(message=f"rank {self._rank}: {exc}"))
        if self._rank == 0:
            kind, raw = self._lead(io, base, payload, answer, what)
        else:
            kind, raw = self._follow(io, base, payload, what, step)
        try:
            reply = _CODEC.decode(raw[0]), None if raw[1] is None else _CODEC.decode(raw[1])
        except MessageError as exc:
            raise CheckpointError(f"ranks could not agree ({what}): rank 0's answer is malformed: {exc}",
                                  step=step) from None
        if isinstance(reply[0], _Failed):
            raise reply[0].error(what, step)
        if kind == _SPLIT:
            return reply
        return reply[0] if reply[1] is None else reply[1]

    def _follow(self, io: StoreOps, base: str, payload: bytes, what: str,
                step: int | None) -> tuple[bytes, tuple[bytes, bytes | None]]:
        """A rank but 0: hand in ``payload``, wait for the common answer, read its own if it has one, and remove
        the keys it set (the last reader of the common answer removes the agreement's shared keys)."""
        mine = f"{base}in/{self._rank}"
        io.set(mine, payload)
        if not io.wait([base + _COMMON], 2 * self.timeout_s):
            self._abandon(io, base)
            raise AgreementError(f"rank 0 did not answer ({what}) within {2 * self.timeout_s:.0f} s; it may have died",
                                 ranks=[0], step=step)
        raw = io.get_now(base + _COMMON)
        if raw is None:  # the other ranks read it and removed it: rank 0 gave up on this rank, which came too late
            self._abandon(io, base)
            raise AgreementError(f"rank {self._rank} reached the agreement ({what}) after rank 0 gave up on it",
                                 ranks=[self._rank], step=step)
        kind, has_own, readers, common = _unpack(raw)
        own = io.get_now(f"{base}out/{self._rank}") if has_own else None
        if own is not None:
            io.delete(f"{base}out/{self._rank}")
        io.delete(mine)
        if common.startswith(_FAILED_TAG) and self._rank in _decode_failed(common):
            pass  # too late: rank 0 gave up on this rank, which is not among the readers (its input is gone)
        elif io.add(base + _READ, 1) >= readers:
            io.delete(base + _COMMON, base + _READ)
        return kind, (common, own)

    def _abandon(self, io: StoreOps, base: str) -> None:
        """A rank that will not read this agreement's answer (rank 0 died, or gave up on this rank): its own input
        goes, best effort."""
        try:
            io.delete(f"{base}in/{self._rank}")
        except AgreementError as exc:
            log.debug("rank %d: cannot remove the keys of an abandoned agreement: %s", self._rank, exc)

    def _lead(self, io: StoreOps, base: str, payload: bytes, answer: Callable[[list[Any]], Sequence[Any]],
              what: str) -> tuple[bytes, tuple[bytes, bytes | None]]:
        """Rank 0: wait for every rank's input and read them, in batches, answer, set the per-rank answers in
        batches and then the common one; return rank 0's own."""
        world = self._world
        keys = [f"{base}in/{r}" for r in range(1, world)]
        missing: list[int] = []
        if not io.wait(keys, self.timeout_s):
            missing = [i + 1 for i in io.absent(keys)]
        own_items: list[tuple[str, bytes]] = []
        if missing:
            log.error("rank(s) %s did not reach the agreement (%s) within %.0f s", _some_ranks(missing), what,
                      self.timeout_s)
            kind, common, mine = _PLAIN, _CODEC.encode(_Failed.of(missing)), None
        else:
            try:
                inputs = [_CODEC.decode(payload)]
                for r, raw in enumerate(io.get_many(keys), start=1):
                    try:
                        inputs.append(_CODEC.decode(raw))
                    except MessageError as exc:
                        raise MessageError(f"rank {r}'s input: {exc}") from None
                failed = next((i for i in inputs if isinstance(i, _Failed)), None)
                replies = [failed] * world if failed is not None else answer(inputs)
                if len(replies) != world:
                    raise RuntimeError(f"{len(replies)} answers for {world} ranks")
                kind, common, mine, own = _encode_answer(replies)
                own_items = [(f"{base}out/{r}", v) for r, v in own.items()]
            except AgreementError:
                raise
            except Exception as exc:
                kind, common, mine, own_items = _PLAIN, _CODEC.encode(
                    _Failed(message=f"rank 0 failed: {type(exc).__name__}: {exc}"[:4096])), None, []
        if world == 1:  # nobody to tell
            return kind, (common, mine)
        io.set_many(own_items)
        readers = world - len(missing)
        io.set(base + _COMMON, _pack(kind, bool(own_items), readers, common))
        if io.add(base + _READ, 1) >= readers:
            io.delete(base + _COMMON, base + _READ)
        return kind, (common, mine)

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
    """Rank 0's answer when an agreement failed: the ranks that never arrived (at most :data:`LISTED_RANKS`, and
    the count of the others), or the error its answer raised (also what a rank hands in when its input cannot be
    sent, so that rank 0 fails the agreement for everyone)."""

    missing: list[int] = field(default_factory=list)
    message: str = ""
    more: int = 0

    @classmethod
    def of(cls, missing: list[int]) -> _Failed:
        return cls(missing=missing[:LISTED_RANKS], more=max(0, len(missing) - LISTED_RANKS))

    def error(self, what: str, step: int | None) -> CheckpointError:
        if self.missing:
            names = ", ".join(f"rank {r}" for r in self.missing)
            more = f" and {self.more} more ranks" if self.more else ""
            return AgreementError(f"ranks could not agree ({what}); {names}{more} never reached it (died or hung)",
                                  ranks=self.missing, step=step)
        return CheckpointError(f"ranks could not agree ({what}): {self.message}", step=step)


#: What agreements carry: JSON with a fixed set of types (:mod:`.engine.messages`), never pickle.
_CODEC = Codec((StepManifest, RankRef, TierListings, _Failed))
#: The start of an encoded :class:`_Failed`.
_FAILED_TAG = b'{"_Failed"'
#: A failed agreement names at most this many ranks (and counts the others).
LISTED_RANKS = 64
#: The keys of agreement ``<prefix><lane>/<seq>/``: besides ``in/<rank>`` (each rank's input, ranks 1..W-1) and
#: ``out/<rank>`` (the ranks whose answer is their own), the common answer and the counter of its readers.
_COMMON, _READ = "answer", "read"
#: How a common answer reads: a plain answer (the rank's own, if any, replaces it) or a :class:`Split`.
_PLAIN, _SPLIT = b"p", b"s"


def _pack(kind: bytes, has_own: bool, readers: int, common: bytes) -> bytes:
    """The common answer's value: ``<kind><0|1 has own answers><readers>\n`` then the encoded answer."""
    return kind + (b"1" if has_own else b"0") + str(readers).encode() + b"\n" + common


def _unpack(raw: bytes) -> tuple[bytes, bool, int, bytes]:
    head, _, body = raw.partition(b"\n")
    try:
        return head[:1], head[1:2] == b"1", int(head[2:]), body
    except ValueError:
        raise CheckpointError(f"ranks could not agree: rank 0's answer is malformed ({head[:32]!r})") from None


def _decode_failed(raw: bytes) -> list[int]:
    """The ranks an encoded :class:`_Failed` names as missing (none if it is malformed)."""
    try:
        failed = _CODEC.decode(raw)
    except MessageError:
        return []
    return failed.missing if isinstance(failed, _Failed) else []


def _encode_answer(replies: Sequence[Any]) -> tuple[bytes, bytes, bytes | None, dict[int, bytes]]:
    """Rank 0's answers as (kind, the common answer, rank 0's own or None, the other ranks' own): a :class:`Split`
    as it is; a list with its most frequent answer common (each distinct object encoded once) and the others
    each rank's own. Raises ValueError for a value over :data:`MAX_VALUE_BYTES`, TypeError for one no message
    carries."""
    if isinstance(replies, Split):
        kind, common = _SPLIT, _CODEC.encode(replies.common)
        own = {r: _CODEC.encode(v) for r, v in replies.own.items()}
    else:
        done: dict[int, bytes] = {}
        encoded = []
        for x in replies:
            if id(x) not in done:
                done[id(x)] = _CODEC.encode(x)
            encoded.append(done[id(x)])
        common = Counter(encoded).most_common(1)[0][0]
        kind, own = _PLAIN, {r: e for r, e in enumerate(encoded) if e != common}
    mine = own.pop(0, None)
    big = max([len(common) + 64, *map(len, own.values())])
    if big > MAX_VALUE_BYTES:
        raise ValueError(f"an answer of {big} bytes exceeds the {MAX_VALUE_BYTES} an agreement carries")
    return kind, common, mine, own


def _some_ranks(ranks: list[int], shown: int = 16) -> str:
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"{ranks[:shown]}{more}"


def _nodes(everyone: list[tuple[str, str]]) -> Split:
    """Start-up, on rank 0: the run's id and each rank's node (the ranks with its host and folder). Where every
    node is a block of ``k`` consecutive ranks (the usual launch), the common answer says so and no rank gets an
    answer of its own; otherwise each rank gets its node's ranks as its own."""
    run_id = secrets.token_hex(8)
    nodes: dict[tuple[str, str], list[int]] = {}
    for r, where in enumerate(everyone):
        nodes.setdefault(tuple(where), []).append(r)  # type: ignore[arg-type]
    world, size = len(everyone), len(nodes[tuple(everyone[0])])  # type: ignore[index]
    if world % size == 0 and all(ranks == list(range(ranks[0], ranks[0] + size)) and ranks[0] % size == 0
                                 for ranks in nodes.values()):
        return Split({"run": run_id, "block": size}, world_size=world)
    return Split({"run": run_id, "block": None},
                 {r: nodes[tuple(where)] for r, where in enumerate(everyone)},  # type: ignore[index]
                 world_size=world)


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
        self._rank = rank
        self._prefix = f"tierckpt/{run_id}/upload/"
        self._followers = world_size - 1
        self._store = _default_store() if store is None else store

    def _io(self) -> StoreOps:
        return StoreOps(self._store, self._rank, what="upload messages")

    def publish(self, seq: int, decision: dict[str, Any]) -> None:
        self.post(str(seq), decision)

    def receive(self, seq: int, timeout_s: float) -> dict[str, Any] | None:
        return self.fetch([str(seq)], timeout_s, readers=self._followers).get(str(seq))

    def post(self, name: str, value: dict[str, Any]) -> None:
        """Set ``name`` (under this run's prefix) to ``value``, as JSON. Raises :class:`AgreementError` if the
        store fails, ValueError for a value over :data:`~tierckpt.store_client.MAX_VALUE_BYTES`."""
        self._io().set(self._prefix + name, json.dumps(value).encode())

    def withdraw(self, name: str) -> None:
        """Remove this rank's message ``name`` (one fetched with ``readers=0``), once its reader is done with it."""
        try:
            self._io().delete(self._prefix + name)
        except AgreementError as exc:
            log.debug("cannot remove the message %s: %s", name, exc)

    def fetch(self, names: list[str], timeout_s: float | None, *, readers: int) -> dict[str, dict[str, Any]]:
        """The values of ``names`` once every one is set, or of those set when ``timeout_s`` ran out (None: the
        store's own timeout), read in batches (O(len(names) / BATCH_KEYS) requests). Each of the ``readers`` ranks
        that fetch a name counts itself and the last removes it; with ``readers=0`` the poster removes it
        (:meth:`withdraw`). Raises :class:`AgreementError` if the store fails."""
        io = self._io()
        keys = [self._prefix + n for n in names]
        if timeout_s is None:
            timeout_s = getattr(self._store, "timeout", datetime.timedelta(seconds=300)).total_seconds()
        if io.wait(keys, timeout_s):
            there = list(range(len(keys)))
        else:  # the wait ran out: some are not set yet
            gone = set(io.absent(keys))
            there = [i for i in range(len(keys)) if i not in gone]
        values = io.get_many([keys[i] for i in there])
        out = {names[i]: json.loads(v) for i, v in zip(there, values)}
        for i in there if readers > 0 else ():
            try:
                if io.add(f"{keys[i]}/read", 1) >= readers:
                    io.delete(keys[i], f"{keys[i]}/read")
            except AgreementError as exc:  # the message was read; the store may hold it a while longer
                log.debug("cannot remove the read message %s: %s", keys[i], exc)
        return out
