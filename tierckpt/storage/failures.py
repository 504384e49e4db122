"""One translation of storage-backend failures into tierckpt's errors, and deadlines for calls that can hang.

Backends fail in their own vocabularies: botocore (``EndpointConnectionError``, ``ClientError`` with a code),
aiohttp (``ClientConnectorError``, ``ServerTimeoutError``), s3fs and gcsfs (``OSError`` with an errno, or
``PermissionError``), the OS. :func:`translate` turns each into a :class:`~tierckpt.errors.StorageError` that names
the operation, the tier and the URL, says whether a retry may help (``transient``, decided by
:func:`~tierckpt.storage.retry.is_transient`) and chains the original as ``__cause__``. The manager, the replication
component and the CLI all catch these one way.

Invariants:

- a missing file stays :class:`FileNotFoundError` (callers use it for control flow: "not committed yet"), and a
  :class:`~tierckpt.errors.CheckpointError` passes through unchanged;
- messages never carry credentials: URLs lose their ``user:secret@`` part and signed query parameters
  (``Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ...) are masked;
- :func:`bounded` returns or raises within its deadline even when the backend never answers: the call runs on a
  daemon thread that is abandoned at the deadline (its request ends at the backend's own socket timeouts).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ..errors import (
    CheckpointError,
    StorageAccessError,
    StorageError,
    StorageTimeoutError,
    StorageUnavailableError,
)
from .retry import DeadlineExceeded, RetryPolicy, is_transient

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Error codes that mean "you may not", whatever HTTP status carried them.
_ACCESS_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                           "ExpiredToken", "InvalidToken", "AccountProblem", "NoSuchBucket", "403", "401"})
_SECRET_RE = re.compile(
    r"((?:X-Amz-)?(?:Signature|Credential|Security-Token|SignedHeaders|AWSAccessKeyId)=)[^&\s\"']+", re.IGNORECASE)
_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
#: Characters of a backend's message kept in ours.
_MAX_CAUSE = 300


def scrub(text: str) -> str:
    """``text`` without credentials: no ``user:secret@`` in URLs, no signed query parameters' values."""
    return _SECRET_RE.sub(r"\1***", _USERINFO_RE.sub(r"\1", text))


def describe(exc: BaseException) -> str:
    """A one-line, credential-free summary of a backend's exception (its class and message)."""
    msg = " ".join(str(exc).split()) or "(no message)"
    if len(msg) > _MAX_CAUSE:
        msg = msg[: _MAX_CAUSE - 3] + "..."
    return f"{type(exc).__name__}: {scrub(msg)}"


def _denied(exc: BaseException) -> bool:
    e: BaseException | None = exc
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PermissionError):
            return True
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = str((resp.get("Error") or {}).get("Code", ""))
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in _ACCESS_CODES or status in (401, 403):
                return True
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return True
        e = e.__cause__
    return False


def translate(exc: BaseException, *, op: str, tier: str, url: str, step: int | None = None) -> BaseException:
    """The tierckpt error for backend failure ``exc`` of operation ``op`` (e.g. "list") on ``url``; see the module
    docstring. Returns ``exc`` itself for a missing file, a tierckpt error or a non-``Exception``."""
    if not isinstance(exc, Exception) or isinstance(exc, (CheckpointError, FileNotFoundError)):
        return exc
    if isinstance(exc, DeadlineExceeded):
        return StorageTimeoutError(f"{op}: no answer within the deadline ({describe(exc)})", tier=tier, path=url,
                                   step=step, transient=True)
    if _denied(exc):
        return StorageAccessError(f"{op}: access denied ({describe(exc)})", tier=tier, path=url, step=step,
                                  transient=False)
    transient = is_transient(exc)
    names = [c.__name__ for c in type(exc).__mro__]
    if isinstance(exc, TimeoutError) or any("Timeout" in n for n in names):
        cls: type[StorageError] = StorageTimeoutError
    elif isinstance(exc, ConnectionError) or any("Connect" in n for n in names):
        cls = StorageUnavailableError
    else:
        cls = StorageError
    what = "unreachable or failing" if transient else "failed"
    return cls(f"{op}: storage {what} ({describe(exc)})", tier=tier, path=url, step=step, transient=transient)


@contextmanager
def translated(op: str, *, tier: str, url: str, step: int | None = None) -> Iterator[None]:
    """Re-raise any backend failure inside the block as :func:`translate` says, chained to the original."""
    try:
        yield
    except Exception as exc:
        err = translate(exc, op=op, tier=tier, url=url, step=step)
        if err is exc:
            raise
        raise err from exc


def bounded(fn: Callable[[], T], *, timeout_s: float | None, what: str, tier: str, url: str,
            diagnose: Callable[[], BaseException | None] | None = None) -> T:
    """``fn()``, but return or raise within ``timeout_s`` seconds (None: wait as long as it takes, on this thread).

    ``fn`` runs on a daemon thread; at the deadline :class:`StorageTimeoutError` is raised and the thread is left
    to end on its own (see the module docstring). Exceptions of ``fn`` are re-raised translated. ``diagnose()``
    (a store's :meth:`~tierckpt.storage.base.Store.diagnose`) says at the deadline why no answer came, where it can
    tell: a refused connection is then a :class:`StorageUnavailableError` naming it, not a silent endpoint."""
    if timeout_s is None:
        with translated(what, tier=tier, url=url):
            return fn()
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="tierckpt-bounded", daemon=True).start()
    if not done.wait(timeout_s):
        why = None if diagnose is None else diagnose()
        if why is not None:  # the backend is still retrying an error it has not handed back yet
            raise StorageUnavailableError(f"{what}: no answer within {timeout_s:g} s ({describe(why)})", tier=tier,
                                          path=url, transient=True) from why
        raise StorageTimeoutError(f"{what}: no answer within {timeout_s:g} s (endpoint silent or very slow)",
                                  tier=tier, path=url, transient=True)
    ok, value = box[0]
    if ok:
        return value  # type: ignore[no-any-return]
    err = translate(value, op=what, tier=tier, url=url)
    if err is value:
        raise value
    raise err from value


def with_deadline(fn: Callable[[], T], *, deadline_s: float | None, what: str, tier: str, url: str,
                  policy: RetryPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                  diagnose: Callable[[], BaseException | None] | None = None) -> T:
    """``fn()`` retried on transient failures (backoff with jitter) until ``deadline_s`` seconds have passed, each
    attempt itself :func:`bounded` by the time left; each retry is logged with ``what``, tier and URL. Raises the
    last translated error, a :class:`StorageTimeoutError` when the time ran out."""
    policy = policy or RetryPolicy(attempts=1_000_000, base_delay_s=0.25, max_delay_s=5.0)
    end = None if deadline_s is None else clock() + deadline_s

    def attempt() -> T:
        left = None if end is None else max(0.001, end - clock())
        return bounded(fn, timeout_s=left, what=what, tier=tier, url=url, diagnose=diagnose)

    answered: list[BaseException] = []  # the last error the endpoint itself gave (not a wait cut short)

    def on_retry(k: int, exc: BaseException, pause: float) -> None:
        if type(exc) is not StorageTimeoutError:
            answered[:] = [exc]
        log.warning("tier %s: %s %s failed (%s); retry %d in %.1f s", tier, what, url, exc, k, pause)

    try:
        return policy.call(attempt, what=f"{what} {url}", deadline=end, on_retry=on_retry, clock=clock)
    except DeadlineExceeded as exc:
        cause = exc.__cause__
        if type(cause) is StorageTimeoutError and answered:
            cause = answered[0]  # the last attempt was only cut short by the deadline: name the real failure
        cls = StorageUnavailableError if isinstance(cause, StorageUnavailableError) else StorageTimeoutError
        raise cls(f"{what}: still failing when its {deadline_s:g} s deadline passed ({cause})",
                  tier=tier, path=url, transient=True) from cause
