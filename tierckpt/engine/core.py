"""What a :class:`~tierckpt.CheckpointManager` shares with the modules that restore and coordinate for it
(:mod:`.restore`, :mod:`.sharded`): one object built by the manager, so that those modules use its tiers, thread
pools, staging pool and coordinator through named attributes instead of reaching into the manager.

The engine owns one piece of state itself: the in-place restore's bounce buffers, made by the first restore that
reads direct and kept for the next ones (they take memory only once a read uses them); :meth:`Engine.close` drops
them. Everything else it refers to belongs to the manager, which closes it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options import Options
from ..storage.base import Store
from ..tiers.bounce import BounceBuffers
from ..tiers.incremental import Incremental

if TYPE_CHECKING:
    from ..distributed import Coordinator
    from ..snapshot.staging import StagingPool
    from ..storage.local import LocalStore
    from ..tiers.identity import RunIdentity

log = logging.getLogger(__name__)

class Engine:
    """The manager's machinery as its satellite modules see it (attributes, set once by the manager):

    - ``local``, ``remote``: the tiers (``remote`` None without one); ``rank``, ``world_size``; ``options``;
    - ``io``, ``hash``: the io and hashing thread pools (``options.writer_threads`` each);
    - ``pool``: the staging pool; ``huge``: whether large buffers go on transparent huge pages;
    - ``coord``: the gloo groups and collectives of a multi-rank job, or None;
    - ``bounce``: the in-place restore's bounce buffers (owned here; None until a restore makes them);
    - ``identity``, ``continues_remote``: the run identity of the local tier, and whether this job continues the
      remote's run (set by the manager and the run-identity check before the first upload).
    """

    def __init__(self, *, local: LocalStore, remote: Store | None, rank: int, world_size: int, options: Options,
                 io: Executor, hash: Executor, pool: StagingPool, huge: bool, coord: Coordinator | None) -> None:
        self.local, self.remote = local, remote
        self.rank, self.world_size = rank, world_size
        self.options = options
        self.io, self.hash = io, hash
        self.pool, self.huge = pool, huge
        self.coord = coord
        self.bounce: BounceBuffers | None = None
        #: the peer copies of a multi-node job (:class:`tierckpt.peers.Peers`, ``peer_replicas``), else None
        self.peers: Any = None
        #: the run this manager's checkpoints belong to (:mod:`tierckpt.tiers.identity`); set by the manager
        self.identity: RunIdentity | None = None
        #: a restore read a step from the remote: this job continues the remote's run (its identity is adopted)
        self.continues_remote = False
        #: the remote's run identity as last read (None: not read yet, or none recorded)
        self.remote_run: RunIdentity | None = None
        #: the local tier's incremental-save state of this rank (``options.incremental``), else None
        self.incremental: Incremental | None = None
        if options.incremental:
            self.incremental = Incremental(options.full_every, rank=rank, world_size=world_size)

    def close(self) -> None:
        """Drop the bounce buffers (their memory is unmapped with them)."""
        self.bounce = None


@dataclass(frozen=True)
class Components:
    """A manager's components, for diagnostics and tests (:attr:`CheckpointManager.components`): the staging
    pool of host buffers, the save pipeline, the engine (tiers, pools, the restore's bounce buffers), the
    replication component (None without a remote) and the multi-rank coordinator (None in one process). Reading
    their state is safe; driving them bypasses the manager's checks."""

    staging: StagingPool
    pipeline: Any
    engine: Engine
    replicator: Any
    coordinator: Coordinator | None
