"""Listing the committed steps of several tiers at once, for a restore: bounded, and never mistaking an unreadable
tier for an empty one.

Invariants: every tier but the node-local one is listed with retries of transient failures for at most
``deadline_s`` (an unreachable or silent remote costs a logged, bounded wait); a tier that cannot be listed is
reported in :attr:`TierListings.failed`, and :meth:`TierListings.require` raises instead of answering "no
checkpoint" unless every tier answered: a restore that returned None there would start training from step 0, and
retention could then delete the checkpoints that the unreadable tier holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..storage.base import Store
from ..storage.failures import translate, with_deadline
from .verify import list_root

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TierListings:
    """Committed steps per tier name (tiers that answered) and the error of each tier that did not."""

    steps: dict[str, set[int]]
    failed: dict[str, StorageError]

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
        log.warning("restore: tier %s could not be listed; going on with the tiers that answered (%s)", names,
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
                 verb: str = "verifies", suffix: str = "") -> tuple[int, Store, T]:
    """Walk the copies of the newest step (or exactly ``step``) in ``tiers`` order, then the older steps, until
    ``attempt(store, step)`` returns: the rule restore, load and export share. A copy whose attempt raises one of
    ``skip`` is logged (``what`` names the caller; the files at fault) and the next copy is tried.

    ``steps``: the committed steps of each tier (by tier name). Returns (step, store, what ``attempt`` returned).
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
            if failures:
                log.warning("%s: step %d from tier %s (%s) after skipping %d copies", what, s, store.tier, store.url,
                            len(failures))
            else:
                log.info("%s: step %d from tier %s (%s)", what, s, store.tier, store.url)
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
