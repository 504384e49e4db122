"""Taking a committed step out of a tier: setting it aside (a rollback) or deleting it (retention).

Invariants: a step that a later committed step references (incremental steps) is never deleted; the step stops
being a checkpoint before any of its data changes, in one atomic rename on stores that
have one, else by removing its ``manifest.json`` first; so a crash half-way leaves either the committed step or an
uncommitted leftover (removed by start-up recovery or ``tierckpt prune --leftovers``), never a corrupt checkpoint.
A step that is already gone is not an error.
"""

from __future__ import annotations

import logging

from .. import faults
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import layout
from ..format.manifest import MAX_MANIFEST_BYTES
from ..storage.base import Store, join
from ..storage.commit import read_step_manifest
from .incremental import LOCK, pinned

log = logging.getLogger(__name__)


def set_aside(store: Store, step: int) -> None:
    """Make committed ``step`` of ``store`` stop being a checkpoint, keeping its data (a rollback).

    Rename-commit stores: the folder becomes ``aside-step-<N>-<id>`` in one atomic rename. Object stores:
    ``manifest.json`` is copied to ``manifest.aside.json`` and then removed (the folder is then an uncommitted
    leftover that ``tierckpt prune --leftovers`` removes). Raises what the store raises."""
    folder = layout.step_dir(step)
    if store.atomic_rename:
        if store.exists(folder):
            store.replace_dir(folder, layout.aside_dir(folder))
            store.sync_dir("")
    else:
        manifest = join(folder, layout.STEP_MANIFEST)
        try:
            raw = store.read_bytes(manifest, max_size=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return
        store.write_bytes(join(folder, layout.ASIDE_MANIFEST), raw)
        store.remove(manifest)
    log.warning("step %d, tier %s: set aside at %s/%s (rollback): no longer a checkpoint, data kept", step,
                store.tier, store.url, folder)
    faults.point("rollback")


def holder(store: Store, step: int, gone: frozenset[int] = frozenset()) -> int | None:
    """A step that keeps ``step`` of ``store`` from being deleted: a committed later step whose manifest references
    it (an incremental step), or ``step`` itself while a save in this process is about to reference it; None when
    nothing holds it. A later step whose ``manifest.json`` cannot be read holds it too: its references are unknown,
    and keeping bytes is the safe side. ``gone``: steps to treat as deleted already (a dry run's plan). Call under
    :data:`.incremental.LOCK`."""
    if pinned(store, step):
        return step
    later = sorted((s for s in (layout.parse_step_dir(n) for n in store.list(""))
                    if s is not None and s > step and s not in gone), reverse=True)
    for s in later:
        try:
            m = read_step_manifest(store, layout.step_dir(s), s)
        except FileNotFoundError:
            continue
        except CorruptCheckpointError as exc:
            if b'"refs"' not in _raw_manifest(store, s):
                continue  # a damaged step of the version-2 form references nothing
            log.warning("step %d, tier %s: kept: step %d's manifest is unreadable, it may reference it (%s)", step,
                        store.tier, s, exc)
            return s
        if m is not None and step in m.refs:
            return s
    return None


def _raw_manifest(store: Store, step: int) -> bytes:
    try:
        return store.read_bytes(join(layout.step_dir(step), layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    except (OSError, CheckpointError):
        return b""


def delete_step(store: Store, step: int) -> bool:
    """Remove a step from a store (retention) so that it stops being a checkpoint before any of its data goes.

    A step that a later committed step references (an incremental step's shared bytes), or that a save in this
    process is about to reference, is kept (:func:`holder`; logged) and False returned: retention deletes it once
    nothing references it any more. Returns True otherwise (also when the step was gone already).

    POSIX stores: the folder is renamed to a ``.trash-`` name in one atomic step (start-up recovery removes what a
    crash leaves of it). Object stores: ``manifest.json`` first (a crash half-way leaves an incomplete folder, never
    a corrupt checkpoint), then the rest. Raises what the store raises."""
    with LOCK:
        by = holder(store, step)
        if by is not None:
            log.info("step %d, tier %s: kept at %s/%s: %s", step, store.tier, store.url, layout.step_dir(step),
                     "a save is about to reference it" if by == step else f"step {by} references its bytes")
            return False
        _delete(store, step)
    return True


def _delete(store: Store, step: int) -> None:
    folder = layout.step_dir(step)
    if store.atomic_rename:
        if not store.exists(folder):
            return
        trash = layout.trash_dir(folder)
        store.replace_dir(folder, trash)
        store.sync_dir("")
        faults.point("retention")
        store.remove(trash)
        log.info("step %d, tier %s: deleted %s/%s", step, store.tier, store.url, folder)
        return
    store.remove(join(folder, layout.STEP_MANIFEST))
    try:
        store.sync_dir(folder)
    except FileNotFoundError:
        pass
    faults.point("retention")
    store.remove(folder)
    store.sync_dir("")
    log.info("step %d, tier %s: deleted %s/%s", step, store.tier, store.url, folder)
