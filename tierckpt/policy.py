"""When to save: interval policies and preemption signals, behind ``CheckpointManager.should_save(step)``.

Slurm sends SIGTERM (or the signal named by ``--signal``, commonly SIGUSR1) some time before it kills a job. The
handler only sets a flag: no I/O and no locks inside a signal handler. The training loop sees ``should_save(step)``
turn true at its next step boundary, takes one last checkpoint, and ``close()`` makes it durable.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class SavePolicy:
    """Save every ``every_steps`` steps and/or every ``every_seconds`` seconds (either may be None)."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and (type(self.every_steps) is not int or self.every_steps < 1):
            raise ValueError(f"save_every_steps must be an int >= 1 or None, got {self.every_steps!r}")
        if self.every_seconds is not None and (
            isinstance(self.every_seconds, bool) or not isinstance(self.every_seconds, (int, float))
            or self.every_seconds <= 0
        ):
            raise ValueError(f"save_every_seconds must be a positive number or None, got {self.every_seconds!r}")


class Preemption:
    """A flag set by signal handlers; chains to any handler that was installed before."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_signal_handlers() must be called from the main thread")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.event.set()
        prev = self._previous.get(signum)
        if callable(prev) and prev not in (signal.SIG_IGN, signal.SIG_DFL):
            prev(signum, frame)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()


class Clock:
    """Tracks the last save for interval policies."""

    def __init__(self) -> None:
        self.last_step: int | None = None
        self.last_time = time.monotonic()

    def due(self, policy: SavePolicy, step: int) -> bool:
        if policy.every_steps is not None and step % policy.every_steps == 0 and step != self.last_step:
            return True
        return policy.every_seconds is not None and time.monotonic() - self.last_time >= policy.every_seconds

    def saved(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()


#: Seconds a save's time to durable must reach before it can count as slow: the milliseconds of a small save vary by
#: several times their median without anything being wrong.
SLOW_SAVE_MIN_S = 1.0
#: Seconds between two slow-save warnings at most; the slow saves in between are counted in the next warning.
SLOW_SAVE_WARN_INTERVAL_S = 60.0


class SlowSaveMonitor:
    """Warns when a save's time to durable is slow: at least ``min_seconds`` and more than ``factor`` x the running
    median of the ``window`` earlier saves (once ``min_history`` saves are known). At most one warning per
    ``interval_s`` seconds (of ``clock``); the next one says how many slow saves went unreported meanwhile."""

    def __init__(self, factor: float = 1.5, window: int = 50, min_history: int = 3, *,
                 min_seconds: float = SLOW_SAVE_MIN_S, interval_s: float = SLOW_SAVE_WARN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.factor, self.window, self.min_history = factor, window, min_history
        self.min_seconds, self.interval_s, self._clock = min_seconds, interval_s, clock
        self.history: list[float] = []
        self._last_warning: float | None = None
        self._suppressed = 0

    def observe(self, step: int, seconds: float, nbytes: int, tier: str) -> bool:
        """Record one save's time to durable; whether it was slow (warned about, or counted for the next
        warning)."""
        slow = False
        if len(self.history) >= self.min_history and seconds >= self.min_seconds:
            ordered = sorted(self.history)
            median = ordered[len(ordered) // 2]
            if seconds > self.factor * median:
                slow = True
                self._warn(step, seconds, median, nbytes, tier)
        self.history.append(seconds)
        del self.history[: -self.window]
        return slow

    def _warn(self, step: int, seconds: float, median: float, nbytes: int, tier: str) -> None:
        now = self._clock()
        if self._last_warning is not None and now - self._last_warning < self.interval_s:
            self._suppressed += 1
            return
        more = (f"; {self._suppressed} more slow save{'s' if self._suppressed > 1 else ''} since the last warning"
                if self._suppressed else "")
        self._last_warning, self._suppressed = now, 0
        ratio = f"{seconds / median:.1f}x" if median > 0 else "far above"
        log.warning("tier %s: step %d took %.3f s to become durable, %s the running median %.3f s (%.2f GB/s)%s",
                    tier, step, seconds, ratio, median, nbytes / seconds / 1e9, more)
