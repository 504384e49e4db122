"""What this process knows of the remote tier's health: the failure streak, the backoff before it is tried again,
and the log lines an outage earns.

Every path that talks to the remote reports here: each failed request (:meth:`RemoteState.request_failed`, so the
first failure shows in ``health()`` at once, not when a step's retries run out), each failed or successful upload or
listing (:meth:`RemoteState.attempt_failed`, :meth:`RemoteState.succeeded`). From that it answers:

- :meth:`RemoteState.due`: whether the remote may be tried again. After a failed attempt the whole remote waits
  ``retry_delay(failures)`` (5 s doubling to 5 min): one attempt per backoff, however many steps wait, so an
  outage costs one try (and a few log lines) per interval, never a step retried back to back;
- :meth:`RemoteState.known_down`: the error to report at once, without another request, while the remote is known
  to be failing: calls that can answer from another tier (``restore()``, ``latest_step()``, ``steps()``) do so;
- the log: one line when the streak starts (ERROR), one when the remote answers again (WARNING), and a summary
  every ``summary_s`` while it lasts (WARNING); the failures in between are DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from ..errors import StorageError, StorageUnavailableError
from ..storage.failures import describe

log = logging.getLogger(__name__)


def _text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, StorageError) else describe(exc)


def _cause(exc: BaseException | None) -> str:
    """The innermost cause of ``exc`` in one short line (a backend's own error where one is chained)."""
    seen: set[int] = set()
    while exc is not None and exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return "?" if exc is None else describe(exc)


class RemoteState:
    """The remote's failure streak and backoff; see the module docstring. Thread-safe.

    ``retry_delay(failures)``: seconds to wait after ``failures`` consecutive failed attempts (the replication
    policy's). ``clock``: monotonic seconds (tests inject their own)."""

    def __init__(self, url: str, *, retry_delay: Callable[[int], float], clock: Callable[[], float] = time.monotonic,
                 summary_s: float = 60.0) -> None:
        self.url = url
        self._retry_delay = retry_delay
        self._clock = clock
        #: seconds between two summaries of an outage in the log
        self.summary_s = summary_s
        self._lock = threading.Lock()
        self._failures = 0  # failed attempts (uploads, listings) in the current streak: what the backoff counts
        self._requests = 0  # failed requests in the current streak (retried or not): what health() shows
        self._failing_since: float | None = None  # time.time()
        self._down_since: float | None = None  # clock()
        self._next_try = 0.0
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._last_exc: BaseException | None = None
        self._last_summary = 0.0

    # ------------------------------------------------------------------------------------------------ reports
    def request_failed(self, exc: BaseException) -> None:
        """A request to the remote failed (it may still be retried): the streak shows from now on."""
        with self._lock:
            self._requests += 1
            self._note(exc)

    def attempt_failed(self, exc: BaseException, what: str) -> float:
        """An upload or listing failed for good (``what`` names it, e.g. "upload of step 5"); returns the seconds
        before the remote is tried again. The first failure of a streak is logged as an ERROR, later ones at DEBUG
        (see :meth:`summary`)."""
        with self._lock:
            first = self._failures == 0
            self._failures += 1
            self._note(exc)
            now = self._clock()
            self._down_since = now if self._down_since is None else self._down_since
            delay = self._retry_delay(self._failures)
            self._next_try = now + delay
            if first:
                self._last_summary = now
        if first:
            log.error("tier remote: %s at %s failed: %s; local checkpoints are kept, the remote is tried again "
                      "in %.0f s (backoff doubling to its cap), and a summary is logged every %.0f s while it "
                      "fails", what, self.url, _text(exc), delay, self.summary_s)
        else:
            log.debug("tier remote: %s at %s failed again (%d in a row; next try in %.0f s): %s", what, self.url,
                      self._failures, delay, _text(exc))
        return delay

    def succeeded(self) -> bool:
        """A request or attempt succeeded: the streak ends (logged once). Returns True if it had begun."""
        with self._lock:
            was = self._failures > 0 or self._requests > 0
            lasted = None if self._down_since is None else self._clock() - self._down_since
            attempts = self._failures
            self._failures = self._requests = 0
            self._failing_since = self._down_since = None
            self._next_try = 0.0
            self._last_exc = None
        if was and attempts:
            log.warning("tier remote: %s answers again after %.0f s and %d failed attempts", self.url, lasted or 0.0,
                        attempts)
        return was

    def _note(self, exc: BaseException) -> None:
        now = time.time()
        self._failing_since = self._failing_since or now
        self._last_error, self._last_error_time, self._last_exc = _text(exc), now, exc

    # ------------------------------------------------------------------------------------------------ questions
    def down(self) -> bool:
        """True while a failed attempt has not been followed by a success."""
        with self._lock:
            return self._failures > 0

    def due(self) -> bool:
        """Whether the remote may be tried now (not failing, or its backoff has passed)."""
        with self._lock:
            return self._failures == 0 or self._clock() >= self._next_try

    def wait_s(self) -> float | None:
        """Seconds until the remote may be tried again (None: now)."""
        with self._lock:
            if self._failures == 0:
                return None
            left = self._next_try - self._clock()
            return left if left > 0 else None

    def known_down(self) -> StorageError | None:
        """While the remote is known to be failing: the error to report instead of asking it again."""
        with self._lock:
            if self._failures == 0:
                return None
            since = time.time() - (self._failing_since or time.time())
            err = StorageUnavailableError(
                f"known to be failing for {since:.0f} s ({self._failures} failed attempts; last error: "
                f"{_cause(self._last_exc)}); rechecked in the background", tier="remote", path=self.url,
                transient=True)
            err.__cause__ = self._last_exc
            return err

    def summary(self, waiting: Collection[int]) -> None:
        """While the streak lasts, log one WARNING every ``summary_s`` seconds: how long, how many attempts, the
        last error, the steps waiting for the remote (kept locally) and when it is tried next."""
        with self._lock:
            now = self._clock()
            if self._failures == 0 or now - self._last_summary < self.summary_s:
                return
            self._last_summary = now
            lasted = now - (self._down_since or now)
            attempts, err, nxt = self._failures, _cause(self._last_exc), max(0.0, self._next_try - now)
        shown = sorted(waiting)
        log.warning("tier remote: %s failing for %.0f s (%d failed attempts; last error: %s); %d steps kept locally "
                    "wait for it%s; next try in %.0f s", self.url, lasted, attempts, err, len(shown),
                    f" ({', '.join(map(str, shown[-8:]))}{' ...' if len(shown) > 8 else ''})" if shown else "", nxt)

    def fields(self) -> dict[str, Any]:
        """The :class:`~tierckpt.replication.replicator.Health` fields this state owns."""
        with self._lock:
            return {"consecutive_failures": self._failures + self._requests, "failing_since": self._failing_since,
                    "last_error": self._last_error, "last_error_time": self._last_error_time}
