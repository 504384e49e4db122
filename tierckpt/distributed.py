"""torch.distributed glue: the manager's own gloo groups, node leaders, and the agreements a multi-rank job needs.

The manager never runs a collective on the training process group. It creates two gloo groups of its own at
construction (a collective call every rank makes in the same order, from the main thread): one used only by the
persist thread (to agree that every rank's shard is durable before a step is committed), one used only by the
caller's thread (construction and restore). Each group is used by exactly one thread, in the same order on every rank
(the steps in order), so collectives never interleave. The upload thread runs no collective: it coordinates
through the remote storage and, for rank 0's replication decisions, the job's c10d store (:class:`StoreChannel`).
A rank that dies makes the others' next collective fail after ``collective_timeout_s`` with an error naming the
step; the step is then committed nowhere.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import CheckpointError

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


class Coordinator:
    """The manager's gloo groups and the collectives it runs on them."""

    def __init__(self, local_dir: str, *, timeout_s: float) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("a multi-rank CheckpointManager needs torch.distributed to be initialised")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.persist_group = dist.new_group(backend="gloo", timeout=timeout)
        self.main_group = dist.new_group(backend="gloo", timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        me = (socket.gethostname(), os.path.realpath(local_dir), rank, secrets.token_hex(8))
        everyone = self.gather(me, self.main_group)
        node = tuple(sorted(r for host, path, r, _ in everyone if (host, path) == me[:2]))
        self.topology = Topology(rank, world, node, everyone[0][3])
        log.info("rank %d of %d: local folder shared with ranks %s; run %s", rank, world, list(node),
                 self.topology.run_id)

    def announce(self, sid: str, what: str) -> None:
        """Leave a note in the job's c10d store (TCPStore/FileStore, outside any collective) that this rank reached
        the agreement of save ``sid``, so that if the collective then fails the others can name the rank that
        never arrived. Best effort: without a default store the error just cannot name it."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"tierckpt/{sid}/r{self.topology.rank}", what)
        except Exception:  # pragma: no cover - private API moved, or no store
            pass

    def silent_ranks(self, sid: str) -> list[int]:
        try:
            store = dist.distributed_c10d._get_default_store()
            return [r for r in range(self.topology.world_size) if not store.check([f"tierckpt/{sid}/r{r}"])]
        except Exception:  # pragma: no cover
            return []

    @staticmethod
    def gather(obj: Any, group: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=group)
        return out

    @staticmethod
    def scatter(objs: list[Any] | None, group: Any, *, src: int = 0) -> Any:
        """Rank ``src`` hands rank r ``objs[r]``; every rank returns its own (``objs`` is read on ``src`` only)."""
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if dist.get_rank() == src else None, src=src, group=group)
        return out[0]

    def upload_channel(self) -> StoreChannel:
        """Where rank 0's replicator publishes its decisions and the others read them (see
        :class:`tierckpt.replication.replicator.UploadChannel`)."""
        return StoreChannel(self.topology.run_id, self.topology.rank, self.topology.world_size)

    def destroy(self) -> None:
        for g in (self.persist_group, self.main_group):
            try:
                dist.destroy_process_group(g)
            except Exception:  # the default group may already be gone at interpreter exit
                pass


class StoreChannel:
    """Rank 0's replication decisions, and the messages of each multi-rank upload, shared through the job's c10d
    store (the TCPStore or FileStore the default process group was created with): one key per message under
    ``tierckpt/<run id>/upload/``, set by one rank and read by a known number of others, the last of which deletes
    it, so the store holds only messages not yet read by everyone. Decisions are numbered ``<n>`` and read by every
    rank but 0 in order; an upload's messages are ``a<n>/go`` and ``a<n>/result`` (rank 0 to all) and
    ``a<n>/r<rank>`` (each rank's report to rank 0; :func:`tierckpt.tiers.sharded.replicate_shards`). Not a
    collective: a rank busy uploading reads the next decision when it is done."""

    def __init__(self, run_id: str, rank: int, world_size: int) -> None:
        self.leader = rank == 0
        self._prefix = f"tierckpt/{run_id}/upload/"
        self._followers = world_size - 1
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception as exc:  # pragma: no cover - every initialised default group has a store
            raise CheckpointError("a multi-rank CheckpointManager with a remote tier needs the default process "
                                  f"group's store: {exc}") from exc

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
