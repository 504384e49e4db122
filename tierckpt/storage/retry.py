"""Retries with exponential backoff and jitter, for remote storage operations.

Invariants:

- Only *transient* errors are retried (:func:`is_transient`): connection resets, timeouts, throttling (``SlowDown``,
  HTTP 429/5xx) and plain I/O errors. Errors that a retry cannot fix are raised at once: a missing file, a refused
  permission, an invalid request, a full disk, and every :class:`~tierckpt.errors.CheckpointError` (they are
  deliberate decisions, such as a corrupt manifest) except a translated :class:`~tierckpt.errors.StorageError`,
  whose ``transient`` says.
- A retry never sleeps past the deadline: when the next attempt could not start before it, the last error is raised
  instead of waiting for nothing.
- Time is read through injectable ``clock``/``sleep`` functions, so tests run the whole schedule on a fake clock.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CheckpointError, StorageError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values that no retry fixes.
_PERMANENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOENT",
        "EACCES",
        "EPERM",
        "EEXIST",
        "EISDIR",
        "ENOTDIR",
        "EINVAL",
        "ENOSYS",
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "ENAMETOOLONG",
        "EBADF",
        "ENOTEMPTY",
    )
    if hasattr(errno, name)
)
#: Error codes of S3-like services that mean "try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
        "429",
    }
)
#: Fragments of exception class names (botocore, aiohttp, urllib3, requests) that mean a connection-level failure.
_TRANSIENT_NAME_PARTS = ("Timeout", "Connection", "Disconnected", "IncompleteRead", "ResponseStreaming", "Throttl")


def _client_error_code(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ``ClientError``-like exception, without importing botocore."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, dict):
        return None, None
    code = (resp.get("Error") or {}).get("Code")
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code is not None else None), (int(status) if isinstance(status, int) else None)


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is worth retrying (see the module docstring); follows ``__cause__`` of wrapped errors."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        verdict = _classify(e)
        if verdict is not None:
            return verdict
        e = e.__cause__
    return False


def _classify(exc: BaseException) -> bool | None:
    """True/False when ``exc`` alone decides; None to look at its cause."""
    if isinstance(exc, StorageError) and exc.transient is not None:
        return exc.transient  # a backend failure already translated (storage.failures)
    if isinstance(exc, (CheckpointError, DeadlineExceeded, Cancelled)):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    code, status = _client_error_code(exc)
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
        return True
    if code is not None or status is not None:
        return False  # a service answered with a definite error (AccessDenied, NoSuchBucket, InvalidRange...)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = [c.__name__ for c in type(exc).__mro__]
    if any(part in name for name in names for part in _TRANSIENT_NAME_PARTS):
        return True
    if isinstance(exc, OSError):
        # s3fs turns ClientErrors into OSError(errno): EINVAL, EACCES... are definite; EIO, EBUSY (SlowDown),
        # EREMOTEIO (5xx) and no errno at all are worth another try
        return exc.errno not in _PERMANENT_ERRNOS
    return None


class DeadlineExceeded(TimeoutError):
    """The deadline passed before the operation could succeed."""


class Cancelled(Exception):
    """The operation was cancelled through its cancel event."""


@dataclass(frozen=True)
class RetryPolicy:
    """How to retry one operation: ``attempts`` tries in all, sleeping ``base_delay_s * 2**k`` (capped at
    ``max_delay_s``) between them, each sleep shortened at random by up to ``jitter`` of itself (so retries of many
    workers spread out), and never beyond ``deadline_s`` after the first try (None: no deadline of its own) nor
    ``window_s`` after the first failure (None: no limit; a storage that keeps failing for that long is down, and
    each further try against a silent endpoint would wait out its request timeouts again)."""

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0
    jitter: float = 0.5
    deadline_s: float | None = None
    window_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to sleep before retry number ``retry`` (1 for the first retry)."""
        d = min(self.max_delay_s, self.base_delay_s * (2 ** (retry - 1)))
        if self.jitter:
            d *= 1.0 - self.jitter * (rng or random).random()
        return float(d)

    def call(
        self,
        fn: Callable[[], T],
        *,
        what: str = "operation",
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        on_retry: Callable[[int, BaseException, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        classify: Callable[[BaseException], bool] = is_transient,
    ) -> T:
        """Run ``fn`` until it succeeds, a permanent error occurs, the attempts run out or the deadline passes.

        ``deadline`` is an absolute ``clock()`` time (the earlier of it and ``deadline_s`` applies). ``cancel``
        interrupts the sleeps (raising :class:`Cancelled`). ``on_retry(retry, error, delay)`` is called before each
        sleep. Raises the last error, or :class:`DeadlineExceeded` chained to it when the deadline cut retries short.
        """
        start = clock()
        if self.deadline_s is not None:
            own = start + self.deadline_s
            deadline = own if deadline is None else min(deadline, own)
        retry = 0
        first_failure: float | None = None
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"{what}: cancelled")
            try:
                return fn()
            except BaseException as exc:
                if not isinstance(exc, Exception) or not classify(exc):
                    raise
                retry += 1
                if retry >= self.attempts:
                    raise
                pause = self.delay(retry, rng)
                now = clock()
                first_failure = now if first_failure is None else first_failure
                if deadline is not None and now + pause >= deadline:
                    raise DeadlineExceeded(f"{what}: deadline reached after {retry} attempt(s): {exc}") from exc
                if self.window_s is not None and now + pause - first_failure >= self.window_s:
                    raise DeadlineExceeded(f"{what}: still failing {now - first_failure:.1f} s after the first "
                                           f"failure, {retry} attempt(s): {exc}") from exc
                if on_retry is not None:
                    on_retry(retry, exc, pause)
                log.debug("%s: retry %d/%d in %.2fs after %s", what, retry, self.attempts - 1, pause, exc)
                _pause(pause, cancel, sleep, what)


def _pause(seconds: float, cancel: threading.Event | None, sleep: Callable[[float], None] | None, what: str) -> None:
    if sleep is not None:
        sleep(seconds)
    elif cancel is not None:
        if cancel.wait(seconds):
            raise Cancelled(f"{what}: cancelled")
        return
    else:
        time.sleep(seconds)
    if cancel is not None and cancel.is_set():
        raise Cancelled(f"{what}: cancelled")
