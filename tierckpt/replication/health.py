"""What the replication component shows and how a multi-rank job's replicators talk: :class:`Health` (a view of
both tiers for operators and dashboards) and :class:`UploadChannel` (the leader's decisions to its followers)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Health:
    """A view of both tiers for operators and dashboards (:meth:`CheckpointManager.health`).

    ``local_step`` / ``remote_step``: newest step committed in each tier, as this manager knows it (the remote's
    from its last successful listing or upload; None if none, or not known yet: see ``remote_listed``).
    ``upload_lag_steps``: committed local steps newer than ``remote_step``; ``upload_lag_s``: seconds since the
    oldest of them was committed locally (0 when none). ``uploading`` / ``waiting``: the step being uploaded and
    those queued. ``consecutive_failures`` / ``failing_since`` (``time.time()``) / ``last_error`` /
    ``last_error_time``: the remote's current failure streak and its last error (kept after the streak ends).
    With ``peer_replicas`` (node leaders): ``peer_step``, the newest step this node copied to a partner;
    ``peer_failures`` / ``peer_last_error``, the copies that failed (logged, never raised) and the last error."""

    local_step: int | None
    remote_step: int | None
    remote_configured: bool
    remote_listed: bool
    upload_lag_steps: int
    upload_lag_s: float
    uploading: int | None
    waiting: tuple[int, ...]
    consecutive_failures: int
    failing_since: float | None
    last_error: str | None
    last_error_time: float | None
    peer_step: int | None = None
    peer_failures: int = 0
    peer_last_error: str | None = None

    @property
    def ok(self) -> bool:
        """True unless the remote tier is failing now."""
        return self.consecutive_failures == 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``waiting`` as a list), with ``ok``."""
        return {**self.__dict__, "waiting": list(self.waiting), "ok": self.ok}


class UploadChannel(Protocol):
    """How the ranks of a multi-rank job share the leader's replication decisions (the c10d store in
    :mod:`tierckpt.distributed`). Decisions are small JSON-able dicts, numbered from 0 without gaps."""

    #: True on the rank that decides (rank 0)
    leader: bool

    def publish(self, seq: int, decision: dict[str, Any]) -> None:
        """Leader: make decision ``seq`` visible to every follower."""

    def receive(self, seq: int, timeout_s: float) -> dict[str, Any] | None:
        """Follower: decision ``seq``, or None if it did not come within ``timeout_s``."""


def health_after_close(health: Callable[[], Health], who: str) -> Health | None:
    """``health()`` of a manager that was just closed, for a trainer plug-in to keep; None (logged as a warning
    naming ``who``) when it cannot be told, so that it never masks what ``close()`` raised."""
    try:
        return health()
    except Exception as exc:
        logging.getLogger(__name__).warning("%s: the manager's health after closing it is not known: %s", who, exc)
        return None
