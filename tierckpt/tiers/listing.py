"""Listing the steps a tier's root holds, and the committed steps of several tiers at once for a restore: bounded,
and never mistaking an unreadable tier for an empty one.

:func:`list_root` is the listing of a root: its committed step folders, the leftovers of unfinished saves and
uploads (with the step each belongs to), and anything else. :func:`list_steps` (each step's state) and
:func:`list_tiers` (several tiers) are built on it.

Invariants: every tier but the node-local one is listed with retries of transient failures for at most
``deadline_s`` (an unreachable or silent remote costs a logged, bounded wait); a tier that cannot be listed is
reported in :attr:`TierListings.failed`, and :meth:`TierListings.require` raises instead of answering "no
checkpoint" unless every tier answered: a restore that returned None there would start training from step 0, and
retention could then delete the checkpoints that the unreadable tier holds. A root is listed with one request, then
one per step folder (does it hold a ``manifest.json``, or with ``verify_manifests`` its manifest read), issued
together on an object store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..format import layout
from ..storage.base import Store, join
from ..storage.commit import read_step_manifest
from ..storage.failures import translate, with_deadline
from ..storage.readahead import each

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RootListing:
    """What a tier's root holds (see :func:`list_root`)."""

    #: step -> folder name of each committed step folder: its ``manifest.json`` is there (and, listed with
    #: ``verify_manifests``, verifies)
    steps: dict[int, str]
    #: leftovers of unfinished saves: step folders without a manifest, and our temporary and trash folders
    incomplete: list[str]
    #: anything else but the lock files, the save records and the run identity
    other: list[str]
    #: step -> folder name of each step folder whose ``manifest.json`` does not verify (``verify_manifests`` only;
    #: without it such a folder is in :attr:`steps`)
    corrupt: dict[int, str] = field(default_factory=dict)
    #: step -> the folders of that step that hold no manifest: a manifest-less step folder, and the temporary
    #: folders of a save or upload in progress (or a crash's leftover) of a rename-commit store
    uncommitted: dict[int, list[str]] = field(default_factory=dict)


def list_root(store: Store, *, verify_manifests: bool = False) -> RootListing:
    """List a tier's root (see :class:`RootListing`): one listing, then one request per step folder, issued together
    on object stores: whether its ``manifest.json`` exists, or with ``verify_manifests`` the manifest read and
    verified.

    Raises what the store raises when it cannot be listed or read (a :class:`~tierckpt.errors.StorageError` or an
    ``OSError``); a damaged manifest is listed, never raised."""
    names = store.list("")
    folders = [name for name in names if layout.parse_step_dir(name) is not None]

    def state(name: str) -> str | None:
        if not verify_manifests:
            return "committed" if store.exists(join(name, layout.STEP_MANIFEST)) else None
        try:
            found = read_step_manifest(store, name, layout.parse_step_dir(name))
        except CorruptCheckpointError:
            return "corrupt"
        return None if found is None else "committed"

    states = dict(zip(folders, each(state, folders, concurrency=store.read_concurrency)))
    steps: dict[int, str] = {}
    corrupt: dict[int, str] = {}
    uncommitted: dict[int, list[str]] = {}
    incomplete: list[str] = []
    other: list[str] = []
    for name in names:
        step = layout.parse_step_dir(name)
        if step is not None:
            if states[name] == "committed":
                steps[step] = name
            elif states[name] == "corrupt":
                corrupt[step] = name
            else:
                incomplete.append(name)
                uncommitted.setdefault(step, []).append(name)
        elif layout.is_leftover(name):
            incomplete.append(name)
            final = layout.parse_tmp_dir(name)
            tmp_step = None if final is None else layout.parse_step_dir(final)
            if tmp_step is not None:
                uncommitted.setdefault(tmp_step, []).append(name)
        elif not name.startswith(layout.LOCK_PREFIX) and name not in (layout.RECORDS_FILE, layout.RUN_FILE):
            other.append(name)
    return RootListing(dict(sorted(steps.items())), incomplete, other, dict(sorted(corrupt.items())),
                       dict(sorted(uncommitted.items())))


def list_steps(store: Store) -> dict[int, str]:
    """Every step a store holds, with its state: ``"committed"`` (a verified ``manifest.json``), ``"corrupt"`` (a
    ``manifest.json`` that does not verify) or ``"incomplete"`` (no manifest: an upload in progress or a crash's
    leftover, including ``.tmp-`` folders of rename-commit stores). Raises as :func:`list_root` does."""
    listing = list_root(store, verify_manifests=True)
    out = {step: "committed" for step in listing.steps} | {step: "corrupt" for step in listing.corrupt}
    for step in listing.uncommitted:
        out.setdefault(step, "incomplete")
    return dict(sorted(out.items()))


#: The remote tier's listing; the same function serves every store.
list_remote_steps = list_steps


@dataclass(frozen=True)
class TierListings:
    """Committed steps per tier name (tiers that answered) and the error of each tier that did not."""

    steps: dict[str, set[int]]
    failed: dict[str, StorageError]
    #: tiers of ``failed`` not asked this time: known to be failing, and reported as such already (logged at DEBUG)
    known_down: frozenset[str] = frozenset()

    def known(self) -> set[int]:
        """Every step committed in a tier that answered."""
        return set().union(*self.steps.values()) if self.steps else set()

    def require(self, step: int | None, urls: str) -> None:
        """Raise :class:`StorageError` when the answer would depend on a tier that could not be listed: no step
        at all was found (``step`` None), or ``step`` was not found, while some tier failed. Otherwise log which
        tiers are skipped, if any."""
        if not self.failed:
            return
        names = ", ".join(f"{t} ({e})" for t, e in self.failed.items())
        found = self.known() if step is None else self.known() & {step}
        if not found:
            what = "no other tier holds a checkpoint" if step is None else f"no other tier holds step {step}"
            first = next(iter(self.failed.values()))
            raise StorageError(f"cannot list tier {names}, and {what}: refusing to report 'no checkpoint' (training "
                               "would start from scratch); retry when the tier is reachable, or restore with "
                               "source= naming a tier that answers", step=step, tier="+".join(self.failed),
                               path=urls if first.path is None else first.path, transient=first.transient)
        log.log(logging.DEBUG if set(self.failed) <= self.known_down else logging.WARNING,
                "tier %s could not be listed; going on with the tiers that answered (%s)", names,
                ", ".join(sorted(self.steps)))


def list_tiers(tiers: list[Store], *, deadline_s: float | None) -> TierListings:
    """List each tier's committed steps (see the module docstring); never raises for a tier that fails."""
    steps: dict[str, set[int]] = {}
    failed: dict[str, StorageError] = {}
    for store in tiers:
        try:
            if store.tier == "local":
                steps[store.tier] = set(list_root(store).steps)
            else:
                steps[store.tier] = set(with_deadline(lambda s=store: list_root(s).steps, deadline_s=deadline_s,
                                                      diagnose=store.diagnose,
                                                      what="list", tier=store.tier, url=store.url))
        except CheckpointError as exc:
            failed[store.tier] = exc if isinstance(exc, StorageError) else StorageError(
                str(exc), tier=store.tier, path=store.url, transient=False)
        except Exception as exc:
            err = translate(exc, op="list", tier=store.tier, url=store.url)
            failed[store.tier] = err if isinstance(err, StorageError) else StorageError(
                f"list: {exc}", tier=store.tier, path=store.url, transient=None)
        if store.tier in failed:
            log.warning("tier %s: cannot list %s: %s", store.tier, store.url, failed[store.tier])
    return TierListings(steps, failed)


def first_intact(attempt: Callable[[Store, int], T], tiers: list[Store], steps: dict[str, set[int]],
                 step: int | None, *, what: str, skip: tuple[type[CheckpointError], ...] = (CorruptCheckpointError,),
                 verb: str = "verifies", suffix: str = "",
                 tier_of: Callable[[T], str] | None = None) -> tuple[int, Store, T]:
    """Walk the copies of the newest step (or exactly ``step``) in ``tiers`` order, then the older steps, until
    ``attempt(store, step)`` returns: the rule restore, load and export share. A copy whose attempt raises one of
    ``skip`` is logged (``what`` names the caller; the files at fault) and the next copy is tried.

    ``steps``: the committed steps of each tier (by tier name). Returns (step, store, what ``attempt`` returned).
    ``tier_of``: the tier that served an attempt's result, for the log line (a faster copy than ``store``'s).
    Raises :class:`CheckpointNotFoundError` when no tier holds a step (or ``step``), or every copy went missing;
    :class:`CorruptCheckpointError` when copies exist but none succeeds (its message ends with ``suffix``)."""
    held = {store.tier: steps.get(store.tier, set()) for store in tiers}
    urls = ", ".join(t.url for t in tiers)
    candidates = [step] if step is not None else sorted(set().union(*held.values()), reverse=True)
    if not candidates:
        raise CheckpointNotFoundError("no committed checkpoint in any tier", tier="+".join(held) or None, path=urls)
    failures: list[CheckpointError] = []
    for s in candidates:
        holders = [store for store in tiers if s in held[store.tier]]
        for store in holders:
            try:
                out = attempt(store, s)
            except skip as exc:
                exc.step = s if exc.step is None else exc.step
                exc.tier = exc.tier or store.tier
                failures.append(exc)
                kind = "corrupt" if isinstance(exc, CorruptCheckpointError) else "missing"
                log.warning("%s: step %d in tier %s is %s (%s); files: %s; trying the next copy", what, s,
                            store.tier, kind, exc, ", ".join(getattr(exc, "bad_files", ())) or "?")
                continue
            served = store.tier if tier_of is None else tier_of(out)
            if failures:
                log.warning("%s: step %d from tier %s (%s) after skipping %d copies", what, s, served, store.url,
                            len(failures))
            else:
                log.info("%s: step %d from tier %s (%s)", what, s, served, store.url)
            return s, store, out
        if step is not None:
            if not holders:
                raise CheckpointNotFoundError("no tier holds this step", step=s, tier="+".join(held) or None,
                                              path=urls)
            raise _none_succeeds(f"no copy of this step {verb}: " + "; ".join(map(str, failures)) + suffix,
                                 failures, s, "+".join(h.tier for h in holders))
    raise _none_succeeds(f"no committed step ({len(candidates)}) {verb}; newest error: {failures[0]}" + suffix,
                         failures, candidates[0], failures[0].tier)


def _none_succeeds(msg: str, failures: list[CheckpointError], step: int, tier: str | None) -> CheckpointError:
    """The error when every copy failed: corrupt if any copy was, else not found (all went missing meanwhile)."""
    bad = [f for e in failures for f in getattr(e, "bad_files", ())]
    path = failures[-1].path if failures else None
    if any(isinstance(e, CorruptCheckpointError) for e in failures):
        return CorruptCheckpointError(msg, step=step, tier=tier, path=path, bad_files=bad)
    return CheckpointNotFoundError(msg, step=step, tier=tier, path=path)
