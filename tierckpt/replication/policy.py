"""What replication does next, and what local retention may delete: pure decisions, no I/O, no clock of their own.

The :class:`~tierckpt.replication.replicator.Replicator` asks :class:`ReplicationPolicy` three questions, each
answered from step numbers alone, so that they are tested without storage or threads:

1. :meth:`ReplicationPolicy.plan_uploads`: of the steps waiting for upload, which goes next (the newest one the
   remote's retention would keep) and which are no longer wanted (superseded: the remote's retention would delete
   them as soon as they landed, or their local copy is gone);
2. :meth:`ReplicationPolicy.local_deletions`: which committed local steps retention may delete. The newest
   ``keep_local`` steps always stay; an older step goes once the remote holds it, or once it is no longer owed to
   the remote; steps still owed (unreplicated and kept by the remote's retention: ``keep_every`` milestones first,
   then the newest) stay up to ``max_backlog`` of them, so the local tier never holds more than ``keep_local +
   max_backlog`` steps, whatever the remote does;
3. :meth:`ReplicationPolicy.retry_delay`: how long a failed upload waits before it is tried again (exponential,
   capped), while newer steps go first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ..retention import KeepPolicy

#: Reasons a step is deleted from the local tier, as :meth:`ReplicationPolicy.local_deletions` gives them.
REPLICATED = "replicated"
SUPERSEDED = "superseded"
OVER_BACKLOG = "over-backlog"


@dataclass(frozen=True)
class UploadPlan:
    """:meth:`ReplicationPolicy.plan_uploads`'s answer: the step to upload next (None: nothing to do), and the
    waiting steps that will never be uploaded, each with why (``"superseded by step N"``, ``"deleted locally"``)."""

    next: int | None
    dropped: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class ReplicationPolicy:
    """Retention of both tiers and the replication backlog; see the module docstring.

    Args:
        keep_local: newest committed steps the local tier always keeps.
        keep_remote / keep_every: the remote's retention (newest N, and every K-th step); None keeps every step.
        max_backlog: unreplicated steps kept locally beyond ``keep_local`` while the remote is down or slow. The
            local tier holds at most ``keep_local + max_backlog`` committed steps.
        retry_initial_s / retry_max_s: a failed upload is tried again after ``retry_initial_s``, doubling with each
            further failure of the remote up to ``retry_max_s``.
    """

    keep_local: int = 2
    keep_remote: int | None = None
    keep_every: int | None = None
    max_backlog: int = 2
    retry_initial_s: float = 5.0
    retry_max_s: float = 300.0

    def __post_init__(self) -> None:
        KeepPolicy(keep_last=self.keep_local)  # the same checks and messages
        KeepPolicy(keep_last=self.keep_remote, keep_every=self.keep_every)
        if type(self.max_backlog) is not int or self.max_backlog < 0:
            raise ValueError(f"max_upload_backlog must be an int >= 0, got {self.max_backlog!r}")
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError("retry delays must satisfy 0 < retry_initial_s <= retry_max_s")

    def remote_keeps(self, steps: Iterable[int]) -> set[int]:
        """Of ``steps`` (all the remote would hold), those the remote's retention keeps."""
        everything = set(steps)
        return everything - set(KeepPolicy(keep_last=self.keep_remote, keep_every=self.keep_every)
                                .to_delete(everything))

    def _milestone(self, step: int) -> bool:
        return bool(self.keep_every) and step % self.keep_every == 0  # type: ignore[operator]

    def plan_uploads(self, waiting: Collection[int], *, remote: Collection[int],
                     local: Collection[int]) -> UploadPlan:
        """The next upload among ``waiting`` and the waiting steps to drop (see :class:`UploadPlan`).

        ``remote``: steps committed on the remote; ``local``: steps committed locally. The newest wanted step
        goes first, so that after an outage the newest checkpoint is durable remotely before older ones."""
        if not waiting:
            return UploadPlan(None)
        keep = self.remote_keeps(set(remote) | set(local) | set(waiting))
        newest = max(waiting)
        dropped: list[tuple[int, str]] = []
        wanted: list[int] = []
        for step in sorted(waiting):
            if step not in local:
                dropped.append((step, "deleted from the local tier before it could be uploaded"))
            elif step not in keep:
                dropped.append((step, f"superseded by step {max(keep, default=newest)}"))
            else:
                wanted.append(step)
        return UploadPlan(max(wanted) if wanted else None, tuple(dropped))

    def local_deletions(self, local: Collection[int], *, replicated: Collection[int] | None,
                        remote: Collection[int] = ()) -> list[tuple[int, str]]:
        """Committed local steps that retention deletes now, oldest first, each with its reason
        (:data:`REPLICATED`, :data:`SUPERSEDED`, :data:`OVER_BACKLOG`).

        ``replicated``: the local steps whose remote copy is committed; None when there is no remote tier (then
        only ``keep_local`` applies). The newest ``keep_local`` steps are never deleted."""
        ordered = sorted(set(local))
        keep = set(ordered[-self.keep_local:])
        older = [s for s in ordered if s not in keep]
        if replicated is None:
            return [(s, REPLICATED) for s in older]
        done = set(replicated)
        owed_keep = self.remote_keeps(set(remote) | set(ordered))
        owed = [s for s in older if s not in done and s in owed_keep]
        # milestones first, then the newest: what the remote's retention would keep longest
        owed.sort(key=lambda s: (self._milestone(s), s), reverse=True)
        kept = set(owed[: self.max_backlog])
        out = []
        for s in older:
            if s in done:
                out.append((s, REPLICATED))
            elif s in kept:
                continue
            elif s in owed:
                out.append((s, OVER_BACKLOG))
            else:
                out.append((s, SUPERSEDED))
        return out

    def retry_delay(self, failures: int) -> float:
        """Seconds before the next try after ``failures`` consecutive failed uploads (>= 1)."""
        return min(self.retry_max_s, self.retry_initial_s * 2 ** max(0, failures - 1))


def remote_summary(remote: Collection[int], local: Collection[int], *, newest: int = 8,
                   most: int = 256) -> list[int]:
    """The remote steps a multi-rank job's leader tells its followers at start-up (the followers apply the same
    decisions from them): the remote steps from the oldest local step on (what decides which local steps are
    replicated and which the remote's retention keeps; at most ``most`` of them, the newest) and the ``newest``
    newest ones, sorted. Bounded however many steps the remote holds."""
    floor = min(local, default=None)
    ordered = sorted(remote)
    wanted = [s for s in ordered if floor is not None and s >= floor][-most:]
    return sorted(set(wanted) | set(ordered[-newest:]))
