"""Taking a committed step out of a tier: setting it aside (a rollback) or deleting it (retention).

Invariants: a step that a later committed step references (incremental steps) is never deleted, nor one that a save
or upload in any process is about to reference (pinned in memory in this process, by a lease in others: see
:mod:`.leases`); the step stops being a checkpoint before any of its data changes, in one atomic rename on stores
that have one, else by removing its ``manifest.json`` first; so a crash half-way leaves either the committed step or
an uncommitted leftover (removed by start-up recovery or ``tierckpt prune --leftovers``), never a corrupt checkpoint.
A step that is already gone is not an error.

How a deletion checks the references (:func:`delete_steps`), without holding the process-wide lock across a request:

1. under :data:`.incremental.LOCK`, the steps no save in this process has pinned are *claimed*: until the deletion
   ends, a save that would pin one waits (:func:`.incremental.pins`), so it then finds the step gone;
2. the references of the later steps come from what this process knows of them (its uploads record the steps it
   committed; a manifest read once is remembered), so a job that never saved incrementally reads no manifest;
3. on the local tier (which only this job writes: its lock keeps other processes out) the root is listed after the
   claim, so a save that committed before it is seen, and a step nothing references is deleted;
4. on any other tier (a remote that other processes write and prune) each remaining step is first *decommitted*, its
   ``manifest.json`` moved to ``manifest.deleting.json`` (a process checking whether the step is committed now finds
   it is not), then the root is listed once: the leases found there and the later steps' references are checked
   again, and a step that turned out pinned or referenced is committed again from ``manifest.deleting.json``. A
   process that referenced the step had written its lease before it checked that the step was committed, hence
   before the decommit: its lease, or its committed step, is in that listing. A kill between the decommit and the
   check leaves the step with ``manifest.deleting.json`` and no ``manifest.json``: ``tierckpt prune --leftovers``
   commits it again if a step references it or a lease pins it, and removes it otherwise.

What this process remembers of a remote step's references is keyed by the tier and the step number: a step is
committed once per remote root (a committed remote step is never replaced), an upload records what it committed,
and this process forgets a step it deletes or sets aside. The local tier's manifests are read afresh (file reads).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import faults
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import layout
from ..format.manifest import MAX_MANIFEST_BYTES, StepManifest
from ..storage.base import Store, join
from ..storage.commit import read_step_manifest
from . import leases
from .incremental import claim, unclaim

log = logging.getLogger(__name__)

#: a step's ``manifest.json`` while a deletion checks that nothing references the step (see the module docstring)
DELETING_MANIFEST = "manifest.deleting.json"
#: references of a damaged later step: it may reference any earlier step
_ANY: tuple[int, ...] = (-1,)
#: the most steps whose references are remembered per process (then forgotten all at once)
_MAX_KNOWN = 100_000
_known_lock = threading.Lock()  # guards _KNOWN only (never held across a request)
_KNOWN: dict[tuple[str, int], tuple[int, ...]] = {}


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
    forget(store, step)
    log.warning("step %d, tier %s: set aside at %s/%s (rollback): no longer a checkpoint, data kept", step,
                store.tier, store.url, folder)
    faults.point("rollback")


def record(store: Store, step: int, refs: Iterable[int]) -> None:
    """Remember that committed ``step`` of ``store`` references ``refs`` (or at most those: a superset only keeps
    more), so that retention need not read its manifest."""
    with _known_lock:
        if len(_KNOWN) >= _MAX_KNOWN:
            _KNOWN.clear()
        _KNOWN[(store.url, step)] = tuple(sorted(set(refs)))


def forget(store: Store, step: int) -> None:
    """Forget what is remembered of ``step`` of ``store`` (deleted, set aside)."""
    with _known_lock:
        _KNOWN.pop((store.url, step), None)


def refs_of(store: Store, step: int) -> tuple[int, ...] | None:
    """The steps committed ``step`` of ``store`` references (remembered, else read from its manifest once); None
    when it is not committed (a step another deletion decommitted counts as committed: it may be committed again);
    every earlier step when its manifest is damaged and may reference steps (keeping bytes is the safe side). Raises
    what the store raises."""
    with _known_lock:
        known = _KNOWN.get((store.url, step)) if store.tier != "local" else None
    if known is not None:
        return known
    try:
        m = read_step_manifest(store, layout.step_dir(step), step)
    except CorruptCheckpointError as exc:
        if b'"refs"' not in _raw_manifest(store, step):
            return ()  # a damaged step of the version-2 form references nothing
        log.warning("step %d, tier %s: its manifest is unreadable, it may reference any earlier step (%s)", step,
                    store.tier, exc)
        return _ANY
    if m is None:
        return _being_deleted(store, step)
    if store.tier != "local":  # the local tier's manifests are file reads: read afresh every time
        record(store, step, m.refs)
    return m.refs


def _being_deleted(store: Store, step: int) -> tuple[int, ...] | None:
    """The references of a step another deletion has decommitted (it may commit it again), from its
    :data:`DELETING_MANIFEST`; None when it has none (an upload in progress, a leftover)."""
    try:
        raw = store.read_bytes(join(layout.step_dir(step), DELETING_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    try:
        return StepManifest.from_bytes(raw, step=step, path=f"{store.url}/{layout.step_dir(step)}").refs
    except CheckpointError:
        return _ANY


def _raw_manifest(store: Store, step: int) -> bytes:
    try:
        return store.read_bytes(join(layout.step_dir(step), layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    except (OSError, CheckpointError):
        return b""


@dataclass
class Deletion:
    """What :func:`delete_steps` did: the steps deleted (or gone already), and the steps kept, each with why."""

    deleted: list[int] = field(default_factory=list)
    held: dict[int, str] = field(default_factory=dict)


def _holds(store: Store, doomed: list[int], names: list[str], *, use_leases: bool,
           gone_steps: frozenset[int] = frozenset()) -> dict[int, str]:
    """Of ``doomed`` (newest first), the steps something holds, with why: a lease among ``names`` (a listing of the
    root) pinning it, or a later committed step in ``names`` that references it and is not deleted itself (a doomed
    step that is not held counts as deleted, as do ``gone_steps``). Raises what the store raises."""
    pinned = leases.pinned_by(store, names) if use_leases else {}
    listed = sorted({s for s in (layout.parse_step_dir(n) for n in names) if s is not None}, reverse=True)
    held: dict[int, str] = {}
    gone = set(gone_steps)
    for step in doomed:
        if step in pinned:
            held[step] = f"a running job's upload references it (lease {pinned[step].describe()})"
            continue
        for later in listed:
            if later <= step:
                break
            if later in gone:
                continue
            refs = refs_of(store, later)
            if refs is not None and (step in refs or refs is _ANY):
                held[step] = f"step {later} references its bytes"
                break
        if step not in held:
            gone.add(step)
    return held


def plan(store: Store, steps: Iterable[int], *, force: bool = False) -> dict[int, str]:
    """What :func:`delete_steps` would keep of ``steps`` now, with why (a dry run: nothing changes; one listing,
    and the manifests of later steps this process does not know). ``force``: leases pin nothing."""
    doomed = sorted(set(steps), reverse=True)
    return _holds(store, doomed, store.list(""), use_leases=not force) if doomed else {}


def delete_step(store: Store, step: int, *, force: bool = False) -> bool:
    """Delete one step (see :func:`delete_steps`); True when it is deleted (or was gone), False when it is kept
    (logged)."""
    return not delete_steps(store, [step], force=force).held


def delete_steps(store: Store, steps: Iterable[int], *, listed: Iterable[int] | None = None,
                 other: Iterable[str] = (), force: bool = False) -> Deletion:
    """Delete ``steps`` from a store (retention), each so that it stops being a checkpoint before any of its data
    goes, newest first (an incremental step goes before the steps it references, which are then free to go).

    A step that a later committed step references, that a save in this process is about to reference, or that a
    fresh lease of another process pins is kept (logged) and listed in :attr:`Deletion.held`: retention deletes it
    once nothing holds it any more. ``listed``: the committed steps as the caller just listed them, and ``other``
    the listing's other names (the leases among them): they save a listing on a remote tier, and a pinned step is
    then not decommitted at all (the check after the decommit lists again). ``force``: leases pin nothing (what a
    running job is uploading may then lose the bytes it references). See the module docstring for the protocol.

    POSIX stores: the folder is renamed to a ``.trash-`` name in one atomic step (start-up recovery removes what a
    crash leaves of it). Object stores: ``manifest.json`` first (a crash half-way leaves an incomplete folder, never
    a corrupt checkpoint), then the rest. Raises what the store raises (the steps deleted before stay deleted)."""
    out = Deletion()
    doomed = sorted(set(steps), reverse=True)
    if not doomed:
        return out
    claimed, pinned = claim(store, doomed)
    for s in pinned:
        out.held[s] = "a save in this process is about to reference it"
    try:
        if store.tier == "local":
            # only this job writes its local tier: a listing after the claim sees every step committed before it
            out.held.update(_holds(store, claimed, store.list(""), use_leases=False))
            for s in claimed:
                if s not in out.held:
                    _remove(store, s, decommitted=False)
                    out.deleted.append(s)
        else:
            _delete_shared(store, claimed, listed, list(other), force, out)
    finally:
        unclaim(store, claimed)
    for s, why in sorted(out.held.items()):
        log.info("step %d, tier %s: kept at %s/%s: %s", s, store.tier, store.url, layout.step_dir(s), why)
    return out


def _delete_shared(store: Store, claimed: list[int], listed: Iterable[int] | None, other: list[str], force: bool,
                   out: Deletion) -> None:
    """:func:`delete_steps` on a tier other processes may write: decommit, check again, then delete or recommit."""
    if listed is not None:  # first what is known already: a step held now is not decommitted at all
        names = [layout.step_dir(s) for s in listed] + other
        out.held.update(_holds(store, claimed, names, use_leases=not force))
    else:
        out.held.update(_holds(store, claimed, store.list(""), use_leases=not force))
    todo = [s for s in claimed if s not in out.held]
    for s in todo:
        refs_of(store, s)  # known before the decommit: a recommitted step keeps holding what it references
    decommitted: list[int] = []
    try:
        for s in todo:
            if _decommit(store, s):
                decommitted.append(s)
        gone_already = [s for s in todo if s not in decommitted]
        again = _holds(store, decommitted, store.list(""), use_leases=not force,
                       gone_steps=frozenset(gone_already))
    except BaseException:  # the store failed mid-way: what was decommitted is committed again, as far as it can be
        for s in decommitted:
            try:
                _recommit(store, s)
            except Exception as exc:  # left for `tierckpt prune --leftovers` (see the module docstring)
                log.warning("step %d, tier %s: cannot commit it again at %s/%s after a failed deletion: %s", s,
                            store.tier, store.url, layout.step_dir(s), exc)
        raise
    for s in decommitted:
        if s in again:
            _recommit(store, s)
            out.held[s] = again[s]
    out.deleted.extend(gone_already)
    for s in decommitted:
        if s not in again:
            faults.point("retention")
            _remove(store, s, decommitted=True)
            out.deleted.append(s)


def _decommit(store: Store, step: int) -> bool:
    """Move committed ``step``'s ``manifest.json`` to :data:`DELETING_MANIFEST`; False if it has none."""
    folder = layout.step_dir(step)
    manifest, aside = join(folder, layout.STEP_MANIFEST), join(folder, DELETING_MANIFEST)
    if store.atomic_rename:
        if not store.exists(manifest):
            return False
        store.replace_dir(manifest, aside)
        store.sync_dir(folder)
        return True
    try:
        raw = store.read_bytes(manifest, max_size=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return False
    store.write_bytes(aside, raw)
    store.remove(manifest)
    return True


def _recommit(store: Store, step: int) -> None:
    """Commit a decommitted ``step`` again from its :data:`DELETING_MANIFEST` (see :func:`_decommit`)."""
    folder = layout.step_dir(step)
    manifest, aside = join(folder, layout.STEP_MANIFEST), join(folder, DELETING_MANIFEST)
    if store.atomic_rename:
        store.replace_dir(aside, manifest)
        store.sync_dir(folder)
    else:
        store.write_bytes(manifest, store.read_bytes(aside, max_size=MAX_MANIFEST_BYTES))
        store.remove(aside)
    log.warning("step %d, tier %s: committed again at %s/%s (it became referenced while it was being deleted, or "
                "the deletion failed)", step, store.tier, store.url, folder)


def holds(store: Store, step: int, names: list[str]) -> str | None:
    """Why ``step`` of ``store`` must stay (a committed step in ``names``, a listing of the root, references it, or
    a fresh lease there pins it), or None. Raises what the store raises."""
    return _holds(store, [step], names, use_leases=True).get(step)


def remove_decommitted(store: Store, step: int) -> None:
    """Remove the folder of ``step``, which a deletion decommitted (see :func:`_decommit`) and nothing holds."""
    _remove(store, step, decommitted=True)


def recommit_if_held(store: Store, step: int, names: list[str]) -> str | None:
    """A step folder with :data:`DELETING_MANIFEST` and no ``manifest.json`` (a deletion killed half-way): commit
    it again if a committed step references it or a fresh lease pins it (``names``: the root's listing); returns
    why, or None when nothing holds it (the folder is then a leftover). Raises what the store raises."""
    folder = layout.step_dir(step)
    if store.exists(join(folder, layout.STEP_MANIFEST)) or not store.exists(join(folder, DELETING_MANIFEST)):
        return None
    why = holds(store, step, names)
    if why is not None:
        _recommit(store, step)
    return why


def _remove(store: Store, step: int, *, decommitted: bool) -> None:
    folder = layout.step_dir(step)
    forget(store, step)
    if store.atomic_rename:
        if not store.exists(folder):
            return
        trash = layout.trash_dir(folder)
        store.replace_dir(folder, trash)
        store.sync_dir("")
        if not decommitted:
            faults.point("retention")
        store.remove(trash)
        log.info("step %d, tier %s: deleted %s/%s", step, store.tier, store.url, folder)
        return
    if not decommitted:
        store.remove(join(folder, layout.STEP_MANIFEST))
        try:
            store.sync_dir(folder)
        except FileNotFoundError:
            pass
        faults.point("retention")
    store.remove(folder)
    store.sync_dir("")
    log.info("step %d, tier %s: deleted %s/%s", step, store.tier, store.url, folder)
