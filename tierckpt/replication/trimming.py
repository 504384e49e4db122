"""Retention of both tiers as the replication component applies it: local steps deleted as the policy allows
(never one of the newest ``keep_local``; an unreplicated one only when superseded or past the backlog, logged),
remote steps the remote's retention does not keep (see :mod:`tierckpt.replication.replicator`, whose
:class:`Replicator` this mixin is part of)."""

from __future__ import annotations

import logging
from typing import Any

from ..tiers.listing import list_root
from ..tiers.steps import delete_step, delete_steps
from .policy import OVER_BACKLOG, REPLICATED, SUPERSEDED

log = logging.getLogger(__name__)


class Trimming:
    """The retention side of :class:`~tierckpt.replication.replicator.Replicator` (its state is the
    replicator's)."""

    def apply_local_retention(self) -> None:
        """Delete the local steps :meth:`ReplicationPolicy.local_deletions` allows (see the module docstring)."""
        if not self._local_retention:
            return
        with self._retention_lock:
            try:
                local = list(list_root(self.local).steps)
                with self._cond:
                    replicated = set(self._replicated)
                    remote = set(self._remote_steps or ())
                    current = self._current
                deletions = self.policy.local_deletions(local, replicated=replicated, remote=remote)
                doomed = []
                for step, why in deletions:
                    if why != REPLICATED and (self._channel is not None or step == current):
                        continue  # multi-rank: unreplicated steps go only when the leader's decision says so
                    self._log_deletion(step, why)
                    doomed.append(step)
                # newest first: an incremental step goes before the steps it references, which can then go too
                delete_steps(self.local, doomed, listed=local)
            except Exception as exc:
                log.warning("tier local: retention failed under %s: %s", self.local.url, exc)

    def _log_deletion(self, step: int, why: str) -> None:
        if why == OVER_BACKLOG:
            log.warning("step %d, tier local: deleting it although the remote does not hold it: more than "
                        "max_upload_backlog=%d older steps are waiting for the remote (%s)", step,
                        self.policy.max_backlog, self.local.url)
        elif why == SUPERSEDED:
            log.info("step %d, tier local: deleting it unreplicated: superseded by newer steps, the remote's "
                     "retention would not keep it (%s)", step, self.local.url)

    def _apply_remote_retention(self) -> None:
        if not self._remote_retention:
            return
        try:
            listing = list_root(self.remote)
            steps = set(listing.steps)
            keep = self.policy.remote_keeps(steps)
            # newest first: a step an incremental step references (or another process pins) is held until it goes
            held = set(delete_steps(self.remote, steps - keep, listed=steps, other=listing.other).held)
            with self._cond:
                self._listed(set(keep) | held)
        except Exception as exc:
            log.warning("tier remote: retention failed under %s: %s", self.remote.url, exc)

    def _delete_local(self, deletes: list[tuple[int, str]] | list[list[Any]]) -> None:
        """Delete unreplicated local steps a decision gave up on (logged); this node's leader only."""
        if not deletes or not self._local_retention:
            return
        with self._retention_lock:
            local = self._local_steps()
            for step, why in deletes:
                if step not in local or step == self._current:
                    continue
                self._log_deletion(step, why)
                try:
                    delete_step(self.local, step)
                except Exception as exc:
                    log.warning("step %d, tier local: deleting it failed under %s: %s", step, self.local.url, exc)
