"""Retention policies: which committed steps a tier keeps. Small value objects; the manager applies them.

Invariants the manager enforces around them: retention runs only after a newer step has committed in that tier;
the newest committed step of a tier is never deleted; a local step is never deleted before its remote copy is
committed (when a remote tier is configured); steps are decommitted (``manifest.json`` first) before their data goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepPolicy:
    """Keep the ``keep_last`` newest steps (None: all) plus every step that is a multiple of ``keep_every``."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {self.keep_last!r}")
        if self.keep_every is not None and (type(self.keep_every) is not int or self.keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {self.keep_every!r}")

    def to_delete(self, steps: Iterable[int]) -> list[int]:
        """Steps this policy would delete, oldest first; never the newest."""
        ordered = sorted(set(steps))
        if self.keep_last is None or not ordered:
            return []
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        keep.add(ordered[-1])
        return [s for s in ordered if s not in keep]
