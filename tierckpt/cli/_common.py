"""What every ``tierckpt`` command shares: exit codes, argument types, stores opened from a path or URL with the
command's storage options and ``--timeout``, and failures reported in one credential-free line.

The exit codes and the reporting rules are described in :mod:`tierckpt.cli`. A command raises :class:`UsageError`
(exit 2) or :class:`Unavailable` (exit 3) with the message to print after ``tierckpt CMD:``; ``tierckpt.cli.main``
turns those, storage failures and checkpoint errors into the exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import StorageAccessError, StorageError, StorageTimeoutError
from ..format import layout
from ..storage.base import Store
from ..storage.failures import scrub, translate, translated, with_deadline
from ..storage.open import is_url, open_store

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
#: Seconds a listing or manifest read of a remote root may take, retries included (``--timeout``).
DEFAULT_TIMEOUT_S = 30.0
#: Longest connect timeout the CLI gives the S3 backend (a reachable endpoint connects in milliseconds).
_CONNECT_TIMEOUT_S = 5.0
#: Packages whose exceptions are storage-backend failures (translated into exit 3, never a traceback).
_BACKEND_MODULES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs",
                              "azure", "fsspec", "urllib3", "requests", "ssl", "socket"})
#: ``--storage-option`` keys whose values are credentials: masked in anything the CLI prints.
_SECRET_KEY_RE = re.compile(r"key|secret|token|password|passwd|credential|signature|sas|auth", re.IGNORECASE)
#: The tier name of the stores a command opens on ROOT (it may be a local or a remote tier): internal, never printed.
CLI_TIER = "cli"
#: Where an error or log message names :data:`CLI_TIER`: the ``tier cli`` of an error's ``[step N, tier cli, path
#: P]`` suffix (the path says more), or a log line's leading ``tier cli:``.
_CLI_TIER_RE = re.compile(rf" \[tier {CLI_TIER}\]|(?<=\[)tier {CLI_TIER}, |, tier {CLI_TIER}(?=[,\]])"
                          rf"|^tier {CLI_TIER}: ")

T = TypeVar("T")


class UsageError(Exception):
    """A usage error: the message is printed after ``tierckpt CMD:``; exit 2."""


class Unavailable(Exception):
    """The command cannot check or act now (a live job holds the root): the message is printed after
    ``tierckpt CMD:``; exit 3."""


def seconds(text: str) -> float:
    """argparse type of an option in seconds (``--min-age``): a finite number, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, at least 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type of ``--timeout``: a number of seconds, more than 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds, got 0")
    return value


def _storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """The ``--storage-option KEY=VALUE`` pairs as fsspec storage options (dotted keys nest, values parse as
    JSON); raises ``UsageError`` for a pair without ``=``."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"--storage-option takes key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            parsed: Any = json.loads(value)  # numbers, booleans, JSON objects (client_kwargs={...})
        except ValueError:
            parsed = value
        cur = out
        parts = key.split(".")  # client_kwargs.endpoint_url=... nests
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = parsed
    return out


def _options_for(args: argparse.Namespace, target: str) -> dict[str, Any] | None:
    """The storage options for ``target``: ``--storage-option``, plus for an ``s3://`` URL the backend's
    connect and read timeouts derived from ``--timeout`` (unless set there), so that one request to a silent
    endpoint cannot outlast the command's deadline by much. None for a path."""
    if not is_url(target):
        return None
    opts = _storage_options(getattr(args, "storage_option", None))
    timeout = getattr(args, "timeout", None)
    if timeout is None or target.split("://", 1)[0] not in ("s3", "s3a"):
        return opts
    opts = dict(opts or {})
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", min(_CONNECT_TIMEOUT_S, timeout))
    cfg.setdefault("read_timeout", timeout)
    opts["config_kwargs"] = cfg
    return opts


def open_target(args: argparse.Namespace, target: str, *, tier: str, create: bool = False, **kw: Any) -> Store:
    """The store of path or URL ``target`` with the command's storage options (see :func:`_options_for`);
    ``kw`` goes to :func:`~tierckpt.storage.open.open_store`. A backend failure while opening raises a
    :class:`StorageError` naming the (credential-free) URL."""
    with translated("open", tier=tier, url=scrub(target)):
        return open_store(target, storage_options=_options_for(args, target), tier=tier, create=create, **kw)


def open_root(args: argparse.Namespace, target: str, *, tier: str = CLI_TIER,
               read_concurrency: int | None = None, direct_io: bool = False,
               huge_pages: bool = False) -> tuple[Store, int | None]:
    """The tier root and, when ``target`` is a single step's folder, that step (``direct_io``, ``huge_pages``:
    for a path). Raises ``FileNotFoundError`` for a missing local folder."""
    stripped = target.rstrip("/")
    base = stripped.rsplit("/", 1)[-1]
    step = layout.parse_step_dir(base)
    kw: dict[str, Any] = {"read_concurrency": read_concurrency, "direct_io": direct_io,
                          "huge_pages": huge_pages}
    if step is not None:
        parent = stripped[: -len(base)].rstrip("/") or "/"
        return open_target(args, parent, tier=tier, **kw), step
    if not is_url(target) and not os.path.isdir(target.removeprefix("file://")):
        raise FileNotFoundError(target)
    return open_target(args, target, tier=tier, **kw), None


def deadline_for(args: argparse.Namespace, store: Store) -> float | None:
    """``--timeout`` for a store reached over the network (no local path), None for a path."""
    return getattr(args, "timeout", None) if store.local_path is None else None


def bounded(args: argparse.Namespace, store: Store, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, a listing or manifest read of ``store``: on a store without a local path retried on transient
    failures for at most ``--timeout`` seconds, each attempt itself bounded
    (:func:`~tierckpt.storage.failures.with_deadline`); on a path run as is. Backend failures leave as
    :class:`StorageError` naming ``what`` and the store's URL; ``FileNotFoundError`` and our own errors (a
    corrupt manifest) pass through unchanged."""
    deadline = deadline_for(args, store)
    if deadline is None:
        with translated(what, tier=store.tier, url=store.url):
            return fn()
    return with_deadline(fn, deadline_s=deadline, what=what, tier=store.tier, url=store.url, diagnose=store.diagnose)


def bounded_list_root(args: argparse.Namespace, store: Store) -> Any:
    """``tiers.listing.list_root(store)`` within ``--timeout`` (see :func:`bounded`)."""
    from ..tiers.listing import list_root

    return bounded(args, store, "list", lambda: list_root(store))


def _is_unavailable(exc: BaseException) -> bool:
    """Whether failure ``exc`` means "could not reach or use the storage" (exit 3) rather than "the operation
    failed" (exit 1): an access or timeout error, or a transient storage failure, itself or as a cause."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (StorageAccessError, StorageTimeoutError)):
            return True
        if isinstance(e, StorageError) and e.transient:
            return True
        e = e.__cause__
    return False


def exit_for(failures: list[BaseException]) -> int:
    """The exit code of a command whose per-step ``failures`` these are: 0 none, 3 all of them for want of
    storage (:func:`_is_unavailable`), else 1."""
    if not failures:
        return EXIT_OK
    return EXIT_UNAVAILABLE if all(_is_unavailable(f) for f in failures) else EXIT_BAD


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False,
                file=sys.stderr)


def _secrets(args: argparse.Namespace) -> list[str]:
    """The credential values among ``--storage-option`` (longest first), to be masked in output."""
    found: list[str] = []

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(str(k), v)
        elif _SECRET_KEY_RE.search(key) and isinstance(value, str) and len(value) >= 6:
            found.append(value)

    try:
        walk("", _storage_options(getattr(args, "storage_option", None)) or {})
    except UsageError:
        pass
    return sorted(set(found), key=len, reverse=True)


def drop_cli_tier(text: str) -> str:
    """``text`` without the internal tier name of the stores opened on ROOT (:data:`CLI_TIER`)."""
    return _CLI_TIER_RE.sub("", text)


def clean(args: argparse.Namespace, text: str) -> str:
    """``text`` on one line, without credentials (no URL user info, no signed parameters, no credential given
    as a ``--storage-option``) and without the internal tier name (:func:`drop_cli_tier`)."""
    text = drop_cli_tier(scrub(" ".join(text.split())))
    for secret in _secrets(args):
        text = text.replace(secret, "***")
    return text


def say(args: argparse.Namespace, msg: str, **extra: Any) -> None:
    """Report a failure: one line on stderr, or with ``--json`` the ``{"ok": false, "error": msg, **extra}``
    document on stdout."""
    msg = clean(args, msg)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": msg, **extra}))
    else:
        print(msg, file=sys.stderr)


def warn(args: argparse.Namespace, msg: str) -> None:
    """One warning line on stderr (credential-free); nothing with ``--json``, whose document carries it."""
    if not getattr(args, "json", False):
        print(clean(args, msg), file=sys.stderr)


def target_url(args: argparse.Namespace) -> str:
    """The URL a command mainly works on (for a failure that names none): the remote of ``sync``/``pull``,
    else ROOT; credential-free."""
    for name in ("remote", "root", "local"):
        value = getattr(args, name, None)
        if value:
            return scrub(str(value))
    return "?"


def storage_failure(args: argparse.Namespace, exc: BaseException) -> int:
    """Report storage failure ``exc`` in one line (command, URL, cause) and return exit 3. ``exc`` that is not
    yet a :class:`StorageError` (a backend's own exception) is translated first."""
    if not isinstance(exc, StorageError):
        url = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
        exc = translate(exc, op=args.cmd, tier=CLI_TIER, url=str(url) if url else target_url(args))
    assert isinstance(exc, StorageError)
    url = exc.path or target_url(args)
    say(args, f"tierckpt {args.cmd}: {url}: {exc.detail}", url=clean(args, url))
    return EXIT_UNAVAILABLE


def report_json(args: argparse.Namespace, report: Any) -> dict[str, Any]:
    """A :class:`~tierckpt.tiers.verify.StepReport` as JSON, its errors as :func:`clean` prints them."""
    doc: dict[str, Any] = report.to_json()
    doc["errors"] = [clean(args, e) for e in doc["errors"]]
    return doc


def backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a storage backend's failure (an ``OSError``, or an exception of a backend package),
    as opposed to a bug that should show its traceback."""
    if isinstance(exc, OSError):
        return True
    return any(c.__module__.split(".", 1)[0] in _BACKEND_MODULES for c in type(exc).__mro__)


def url_of(store: Store, rel: str) -> str:
    """The (credential-free) URL of ``rel`` under ``store``'s root; the root's own for ``""``."""
    return f"{store.url}/{rel}" if rel else store.url


def add_common_options(sp: argparse.ArgumentParser) -> None:
    """The options every command takes: ``--storage-option``, ``--timeout`` and ``--json``."""
    sp.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                    help="fsspec storage option for URLs (repeatable; dotted keys nest, values parse "
                         "as JSON)")
    sp.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help="URLs: most seconds a listing or manifest read may take, retries included, and "
                         f"the backend's per-request timeouts (default {DEFAULT_TIMEOUT_S:g}); exit 3 "
                         "past it")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
