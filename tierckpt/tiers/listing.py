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
from dataclasses import dataclass

from ..errors import CheckpointError, StorageError
from ..storage.base import Store
from ..storage.failures import translate, with_deadline
from .verify import list_root

log = logging.getLogger(__name__)


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
