"""Where each step is: the view behind ``CheckpointManager.steps()`` and ``tierckpt ls``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .format import layout
from .storage.base import Store
from .storage.commit import read_step_manifest
from .storage.failures import with_deadline
from .storage.readahead import each
from .tiers.listing import list_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInfo:
    """One step as :meth:`CheckpointManager.steps <tierckpt.CheckpointManager.steps>` reports it: where it
    is committed and how large it is."""

    step: int
    #: committed in the local tier / the remote tier
    local: bool
    remote: bool
    #: "local", "remote", "local+remote", "uploading" (local, upload queued or running), "upload-failed" (local,
    #: its last upload failed; retried at the next start or by ``tierckpt sync``), "failed" (manifest unreadable)
    state: str
    #: bytes of every rank's shards, the step's creation time (seconds since the epoch) and world size, from its
    #: manifest (None where unreadable)
    bytes: int | None
    created: float | None
    world_size: int | None = None
    #: ranks whose shards the first listed tier holds (None: all of them)
    ranks_here: tuple[int, ...] | None = None
    #: of ``bytes``, those stored in earlier steps' folders and referenced by this (incremental) step, and those
    #: steps (0 and empty for a step that holds all its bytes; None where unreadable)
    shared_bytes: int | None = None
    refs: tuple[int, ...] = ()


def list_steps(local: Store, remote: Store | None, upload_failed: set[int], uploading: set[int], *,
               remote_deadline_s: float | None = None, remote_configured: bool | None = None) -> list[StepInfo]:
    """Every step of ``local`` and ``remote`` with its state (see :class:`StepInfo`). ``remote_configured``: a
    remote tier exists though ``remote`` is None (it could not be listed): local steps still show as
    ``uploading`` / ``upload-failed``.

    The remote is listed with retries of transient failures for at most ``remote_deadline_s`` seconds (None: the
    backend's own timeouts); raises :class:`~tierckpt.errors.StorageError` (``StorageTimeoutError`` at the
    deadline) when a tier cannot be listed, so that a caller never mistakes an unreadable tier for an empty one."""
    loc = list_root(local).steps
    rem: dict[int, str] = {}
    if remote is not None:
        rem = with_deadline(lambda: list_root(remote).steps, deadline_s=remote_deadline_s, what="list",
                            diagnose=remote.diagnose,
                            tier=remote.tier, url=remote.url)
    steps = sorted(set(loc) | set(rem))

    def manifest(step: int) -> tuple[Any, ...]:
        store = local if step in loc else remote
        assert store is not None
        try:
            m = read_step_manifest(store, layout.step_dir(step), step)
        except Exception:
            m = None
        if m is None:
            return None, None, True, None, None, None, ()
        return m.total_bytes, m.created, False, m.world_size, m.holds_ranks, m.shared_bytes, m.refs

    # one manifest read per step: issued together when some steps come from the remote (an object store)
    remote_only = remote is not None and any(step not in loc for step in rem)
    found = each(manifest, steps, concurrency=remote.read_concurrency if remote_only else 1)
    has_remote = remote is not None if remote_configured is None else remote_configured
    out = []
    for step, (size, created, broken, world, held, shared, refs) in zip(steps, found):
        if broken:
            state = "failed"
        elif step in loc and step in rem:
            state = "local+remote"
        elif step in loc and has_remote and step in uploading:
            state = "uploading"
        elif step in loc and has_remote and step in upload_failed:
            state = "upload-failed"
        else:
            state = "local" if step in loc else "remote"
        out.append(StepInfo(step, step in loc, step in rem, state, size, created, world, held, shared, refs))
    return out
