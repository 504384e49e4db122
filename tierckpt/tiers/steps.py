"""Taking a committed step out of a tier: setting it aside (a rollback) or deleting it (retention).

Invariants: the step stops being a checkpoint before any of its data changes, in one atomic rename on stores that
have one, else by removing its ``manifest.json`` first; so a crash half-way leaves either the committed step or an
uncommitted leftover (removed by start-up recovery or ``tierckpt prune --leftovers``), never a corrupt checkpoint.
A step that is already gone is not an error.
"""

from __future__ import annotations

import logging

from .. import faults
from ..format import layout
from ..format.manifest import MAX_MANIFEST_BYTES
from ..storage.base import Store, join

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


def delete_step(store: Store, step: int) -> None:
    """Remove a step from a store (retention) so that it stops being a checkpoint before any of its data goes.

    POSIX stores: the folder is renamed to a ``.trash-`` name in one atomic step (start-up recovery removes what a
    crash leaves of it). Object stores: ``manifest.json`` first (a crash half-way leaves an incomplete folder, never
    a corrupt checkpoint), then the rest. Raises what the store raises."""
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
