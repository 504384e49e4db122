"""Rollbacks: refusing a save below a newer committed step, and setting the newer steps aside on request."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import RollbackError
from ..tiers import uploader
from ..tiers.listing import list_tiers
from ..tiers.verify import list_root

if TYPE_CHECKING:
    from ..replication import Replicator
    from .core import Engine

log = logging.getLogger(__name__)


def check(step: int, newest: tuple[int, str] | None, path: str) -> None:
    """Refuse ``step`` if ``newest`` (the newest committed step this run did not save, and its tier) is newer.

    Raises:
        RollbackError: saying how to roll back on purpose (``rollback_to``) or to number the steps after it."""
    if newest is not None and step < newest[0]:
        raise RollbackError(
            f"step {step} is below step {newest[0]}, committed in tier {newest[1]} by an earlier run: a restart "
            f"would restore step {newest[0]}, and retention would delete this run's steps first. If you rolled "
            f"back on purpose, call mgr.rollback_to(<the step you restored>) once before saving (it sets the "
            f"newer steps aside in every tier, kept but never restored); otherwise number this run's steps "
            f"after {newest[0]}", step=step, tier=newest[1], path=path)


def newest_committed(floor: int | None, remote_steps: set[int] | None,
                     last_saved: int | None) -> tuple[int, str] | None:
    """The newest committed step this manager did not save itself, and its tier: the local ``floor`` found at
    start-up, or the remote's newest (``remote_steps``, as the replicator listed it) if newer than both the
    floor and the last step saved."""
    best: tuple[int, str] | None = None if floor is None else (floor, "local")
    if remote_steps:
        newest = max(remote_steps)
        if (best is None or newest > best[0]) and (last_saved is None or newest > last_saved):
            best = (newest, "remote")
    return best


def set_aside_newer(eng: Engine, replicator: Replicator | None, step: int) -> list[int]:
    """Set aside every committed step after ``step`` in every tier (rank 0 the remote's, each node's leader its
    folder's; the remote first, so that a kill half-way never leaves a restart a newer step only remotely), once
    the replicator is fenced: it dropped the newer steps and its upload of one, if any, was cancelled and waited
    for, so none lands afterwards. Every rank of a multi-rank job calls it, and none returns before every tier is
    done; calling it again after a kill finishes the job. Returns the steps set aside.

    Raises:
        StorageError: the remote could not be listed within ``remote_timeout_s`` (nothing is set aside then).
        TimeoutError: an upload in progress did not stop in time (nothing is set aside; call it again)."""
    if replicator is not None:  # first: no upload of a newer step may land after the set-aside below
        replicator.fence(step, timeout_s=eng.options.remote_timeout_s + 30.0)
    remote_newer: list[int] = []
    if eng.remote is not None:
        listing = list_tiers([eng.remote], deadline_s=eng.options.remote_timeout_s)
        if listing.failed:
            raise next(iter(listing.failed.values()))
        remote_newer = sorted(s for s in listing.known() if s > step)
    local_newer = sorted(s for s in list_root(eng.local).steps if s > step)
    newer = set(remote_newer) | set(local_newer)
    if replicator is not None:
        replicator.forget(newer)
    coord = eng.coord
    if eng.remote is not None and (coord is None or coord.topology.rank == 0):
        for s in remote_newer:
            uploader.set_aside(eng.remote, s)
    if coord is None or coord.topology.is_node_leader:
        for s in local_newer:
            uploader.set_aside(eng.local, s)
    if coord is not None:
        coord.barrier(coord.main_lane, what=f"rollback to step {step}")  # no rank saves before every tier is done
    if newer:
        log.warning("rollback to step %d: set aside step(s) %s (local %s, remote %s)", step, sorted(newer),
                    local_newer, remote_newer)
    return sorted(newer)
