"""The manager's read calls (``restore()``, ``load()``, ``latest_step()``) from their arguments to the step read:
the checks of ``step``, ``source`` and ``keys``, the listing each call waits for (bounded by ``remote_timeout_s``;
one listing agreed by every rank for a multi-rank restore), the garbage collector paused while tensors are read,
and, once a step came from the remote, the job continuing the remote's run (:func:`.uploads.note_restored`)."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from ..host import gcpause as _gc
from ..storage.base import Store
from . import load as _load
from . import restore as _restore
from . import sharded as _sharded
from . import uploads as _uploads

if TYPE_CHECKING:
    from ..replication import Replicator
    from .core import Engine


def check_source(step: int | None, source: str, remote: Store | None) -> None:
    """Raises ``ValueError`` for a ``step`` that is neither None nor a non-negative int, or a ``source`` that is
    not ``"auto"``, ``"local"`` or ``"remote"`` (``"remote"`` only with a remote tier)."""
    if step is not None and (type(step) is not int or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    if source not in ("auto", "local", "remote"):
        raise ValueError(f"source must be 'auto', 'local' or 'remote', got {source!r}")
    if source == "remote" and remote is None:
        raise ValueError("source='remote' but this manager has no remote tier")


def check_keys(keys: Sequence[str] | None) -> None:
    """Raises ``ValueError`` unless ``keys`` is None or a non-empty list or tuple of str."""
    if keys is not None:
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"keys must be None or a list or tuple of str, got {keys!r}")
        if not keys:
            raise ValueError("keys must name at least one top-level key (None loads them all)")


def restore(eng: Engine, replicator: Replicator | None, state: MutableMapping[str, Any], step: int | None,
            tiers: list[Store], *, strict: bool, in_place: bool) -> int | None:
    """Restore the newest intact step (or exactly ``step``) of ``tiers`` into ``state``; returns the step, or None
    when no tier holds one. Raises what :meth:`tierckpt.CheckpointManager.restore` documents."""
    if eng.coord is None:
        listing = _uploads.list_for_call(eng, replicator, tiers, step)
    else:
        listing = _sharded.list_tiers_shared(eng, tiers, deadline_s=eng.options.remote_timeout_s)
    with _gc.paused():
        if eng.coord is not None:
            done = _sharded.restore(eng, state, step, tiers, strict=strict, listing=listing,
                                    load=lambda *a: _restore.prepare(eng, *a, in_place=in_place))
        else:
            listing.require(step, ", ".join(t.url for t in tiers))
            done = _restore.restore(eng, state, step, tiers, strict=strict, in_place=in_place, listing=listing)
    _uploads.note_restored(eng, replicator, done, listing)
    return done


def load(eng: Engine, replicator: Replicator | None, step: int | None, tiers: list[Store],
         keys: Sequence[str] | None) -> _load.LoadResult:
    """The newest intact step (or exactly ``step``) of ``tiers`` as plain values, each rank on its own. Raises what
    :meth:`tierckpt.CheckpointManager.load` documents."""
    listing = _uploads.list_for_call(eng, replicator, tiers, step)
    listing.require(step, ", ".join(t.url for t in tiers))
    with _gc.paused():
        out = _load.load(eng, step, tiers, keys=None if keys is None else list(keys), listing=listing)
    _uploads.note_restored(eng, replicator, out.step, listing)
    return out


def latest_step(eng: Engine, replicator: Replicator | None, tiers: list[Store]) -> int | None:
    """The newest committed step in ``tiers``, or None when every tier answered and none holds a step. Raises
    :class:`~tierckpt.errors.StorageError` when a tier could not be listed and no other holds a step."""
    listing = _uploads.list_for_call(eng, replicator, tiers, None)
    listing.require(None, ", ".join(t.url for t in tiers))
    known = listing.known()
    return max(known) if known else None
