"""The operators' CLI: ``tierckpt ls|verify|inspect|sync|pull|prune``, on local folders and remote URLs.

Exit codes (every command):

- 0 (``EXIT_OK``): success, everything checked is intact;
- 1 (``EXIT_BAD``): corruption found (``verify``, ``pull``) or an operation failed (an upload, a deletion);
- 2 (``EXIT_USAGE``): a usage error, or nothing found (no such folder, step or checkpoint);
- 3 (``EXIT_UNAVAILABLE``): could not check or act: the storage is unreachable, silent past ``--timeout``,
  denies access, or the root is in use by a live job (a running ``CheckpointManager`` or ``tierckpt pull``).
  Nothing is known to be wrong with the checkpoints; try again later. Where some steps failed for a reason of
  their own and others for want of storage, 1 wins.

A storage failure ends a command with one line on stderr (with ``--json``: the ``{"ok": false, "error": ...}``
document on stdout instead) naming the command, the URL and the cause, never a traceback. Stores are named by
their ``url`` (credentials removed); ``--storage-option`` values are never printed. ``--timeout SECONDS``
(default 30) bounds every listing and manifest read of a remote root (retries of transient failures included)
and lowers the S3 backend's own connect/read timeouts to match, unless ``--storage-option config_kwargs.*``
sets them. ``--json`` prints one machine-readable document on stdout and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import CheckpointError, StorageAccessError, StorageError, StorageTimeoutError
from .format import layout
from .storage.base import Store
from .storage.failures import scrub, translate, translated, with_deadline
from .storage.open import is_url, open_store

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
#: Seconds a listing or manifest read of a remote root may take, retries included (``--timeout``).
DEFAULT_TIMEOUT_S = 30.0
#: Longest connect timeout the CLI gives the S3 backend (a reachable endpoint connects in milliseconds).
_CONNECT_TIMEOUT_S = 5.0
#: Packages whose exceptions are storage-backend failures (translated into exit 3, never a traceback).
_BACKEND_MODULES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs",
                              "azure", "fsspec", "urllib3", "requests", "ssl", "socket"})
#: Loggers whose retry chatter below ERROR is hidden without ``-v`` (the CLI reports the outcome in one line).
_CHATTY_LOGGERS = ("tierckpt.storage.failures", "tierckpt.storage.retry", "botocore", "aiobotocore", "s3fs",
                   "fsspec", "urllib3", "aiohttp", "gcsfs")
#: ``--storage-option`` keys whose values are credentials: masked in anything the CLI prints.
_SECRET_KEY_RE = re.compile(r"key|secret|token|password|passwd|credential|signature|sas|auth", re.IGNORECASE)

T = TypeVar("T")


class _Usage(Exception):
    """A usage error: the message is printed after ``tierckpt CMD:``; exit 2."""


class _Unavailable(Exception):
    """The command cannot check or act now (a live job holds the root): the message is printed after
    ``tierckpt CMD:``; exit 3."""


def _seconds(text: str) -> float:
    """argparse type of an option in seconds (``--min-age``): a finite number, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, at least 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    """argparse type of ``--timeout``: a number of seconds, more than 0."""
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds, got 0")
    return value


def _storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """The ``--storage-option KEY=VALUE`` pairs as fsspec storage options (dotted keys nest, values parse as
    JSON); raises ``_Usage`` for a pair without ``=``."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise _Usage(f"--storage-option takes key=value, got {pair!r}")
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


def _open(args: argparse.Namespace, target: str, *, tier: str, create: bool = False, **kw: Any) -> Store:
    """The store of path or URL ``target`` with the command's storage options (see :func:`_options_for`);
    ``kw`` goes to :func:`~tierckpt.storage.open.open_store`. A backend failure while opening raises a
    :class:`StorageError` naming the (credential-free) URL."""
    with translated("open", tier=tier, url=scrub(target)):
        return open_store(target, storage_options=_options_for(args, target), tier=tier, create=create, **kw)


def _open_root(args: argparse.Namespace, target: str, *, tier: str = "cli",
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
        return _open(args, parent, tier=tier, **kw), step
    if not is_url(target) and not os.path.isdir(target.removeprefix("file://")):
        raise FileNotFoundError(target)
    return _open(args, target, tier=tier, **kw), None


def _deadline(args: argparse.Namespace, store: Store) -> float | None:
    """``--timeout`` for a store reached over the network (no local path), None for a path."""
    return getattr(args, "timeout", None) if store.local_path is None else None


def _bounded(args: argparse.Namespace, store: Store, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, a listing or manifest read of ``store``: on a store without a local path retried on transient
    failures for at most ``--timeout`` seconds, each attempt itself bounded
    (:func:`~tierckpt.storage.failures.with_deadline`); on a path run as is. Backend failures leave as
    :class:`StorageError` naming ``what`` and the store's URL; ``FileNotFoundError`` and our own errors (a
    corrupt manifest) pass through unchanged."""
    deadline = _deadline(args, store)
    if deadline is None:
        with translated(what, tier=store.tier, url=store.url):
            return fn()
    return with_deadline(fn, deadline_s=deadline, what=what, tier=store.tier, url=store.url)


def _list_root(args: argparse.Namespace, store: Store) -> Any:
    """``tiers.verify.list_root(store)`` within ``--timeout`` (see :func:`_bounded`)."""
    from .tiers.verify import list_root

    return _bounded(args, store, "list", lambda: list_root(store))


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


def _exit_for(failures: list[BaseException]) -> int:
    """The exit code of a command whose per-step ``failures`` these are: 0 none, 3 all of them for want of
    storage (:func:`_is_unavailable`), else 1."""
    if not failures:
        return EXIT_OK
    return EXIT_UNAVAILABLE if all(_is_unavailable(f) for f in failures) else EXIT_BAD


def _progress(total: int, enabled: bool, desc: str) -> Any:
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
    except _Usage:
        pass
    return sorted(set(found), key=len, reverse=True)


def _clean(args: argparse.Namespace, text: str) -> str:
    """``text`` on one line, without credentials: no URL user info, no signed parameters, no credential given
    as a ``--storage-option``."""
    text = scrub(" ".join(text.split()))
    for secret in _secrets(args):
        text = text.replace(secret, "***")
    return text


def _say(args: argparse.Namespace, msg: str, **extra: Any) -> None:
    """Report a failure: one line on stderr, or with ``--json`` the ``{"ok": false, "error": msg, **extra}``
    document on stdout."""
    msg = _clean(args, msg)
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": msg, **extra}))
    else:
        print(msg, file=sys.stderr)


def _warn(args: argparse.Namespace, msg: str) -> None:
    """One warning line on stderr (credential-free); nothing with ``--json``, whose document carries it."""
    if not getattr(args, "json", False):
        print(_clean(args, msg), file=sys.stderr)


def _target_url(args: argparse.Namespace) -> str:
    """The URL a command mainly works on (for a failure that names none): the remote of ``sync``/``pull``,
    else ROOT; credential-free."""
    for name in ("remote", "root", "local"):
        value = getattr(args, name, None)
        if value:
            return scrub(str(value))
    return "?"


def _storage_failure(args: argparse.Namespace, exc: BaseException) -> int:
    """Report storage failure ``exc`` in one line (command, URL, cause) and return exit 3. ``exc`` that is not
    yet a :class:`StorageError` (a backend's own exception) is translated first."""
    if not isinstance(exc, StorageError):
        url = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
        exc = translate(exc, op=args.cmd, tier="cli", url=str(url) if url else _target_url(args))
    assert isinstance(exc, StorageError)
    url = exc.path or _target_url(args)
    _say(args, f"tierckpt {args.cmd}: {url}: {exc.detail}", url=_clean(args, url))
    return EXIT_UNAVAILABLE


def _backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a storage backend's failure (an ``OSError``, or an exception of a backend package),
    as opposed to a bug that should show its traceback."""
    if isinstance(exc, OSError):
        return True
    return any(c.__module__.split(".", 1)[0] in _BACKEND_MODULES for c in type(exc).__mro__)


def cmd_ls(args: argparse.Namespace) -> int:
    """List the committed steps of ROOT (and where each is with ``--remote``) and the leftovers of unfinished
    saves. With the remote unreachable the local listing is printed anyway, with a warning; exit 3."""
    from .status import list_steps

    store, only = _open_root(args, args.root)
    listing = _list_root(args, store)
    remote = _open(args, args.remote, tier="remote") if args.remote else None
    remote_error: StorageError | None = None
    try:
        infos = list_steps(store, remote, set(), set(), remote_deadline_s=args.timeout)
    except StorageError as exc:
        where = exc.path or ""
        if remote is None or not (where == remote.url or where.startswith(remote.url + "/")):
            raise
        remote_error = exc
        _warn(args, f"tierckpt ls: warning: cannot list the remote {remote.url}: {exc.detail}; "
                    f"showing {store.url} only")
        infos = list_steps(store, None, set(), set())
    infos = [i for i in infos if only is None or i.step == only]

    def state(i: Any) -> str:
        if i.state == "failed":
            return "unreadable"
        if remote is None:
            return "committed"
        return i.state if remote_error is None else f"{i.state} (remote ?)"

    def ranks(i: Any) -> str:
        if not i.world_size or i.world_size == 1:
            return "1"
        return f"{i.world_size} (here: {'all' if i.ranks_here is None else list(i.ranks_here)})"

    code = EXIT_OK if remote_error is None else EXIT_UNAVAILABLE
    if args.json:
        doc: dict[str, Any] = {
            "ok": remote_error is None, "root": store.url, "remote": remote.url if remote else None,
            "steps": [{"step": i.step, "state": state(i), "local": i.local,
                       "remote": None if remote_error is not None else i.remote, "bytes": i.bytes,
                       "created": i.created, "world_size": i.world_size,
                       "ranks_here": None if i.ranks_here is None else list(i.ranks_here)} for i in infos],
            "incomplete": listing.incomplete,
        }
        if remote is not None and remote_error is not None:
            doc["remote_error"] = _clean(args, f"{remote.url}: {remote_error.detail}")
        print(json.dumps(doc))
        return code
    if not infos and not listing.incomplete:
        print(f"no checkpoints under {store.url}")
        return code
    print(f"{'STEP':>12}  {'STATE':<13} {'SIZE':>10}  {'CREATED':<19}  RANKS")
    for i in infos:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created)) if i.created else "?"
        size = f"{i.bytes / 2**20:.1f} MiB" if i.bytes is not None else "?"
        print(f"{i.step:>12}  {state(i):<13} {size:>10}  {created:<19}  {ranks(i)}")
    for name in listing.incomplete:
        print(f"{'-':>12}  {'incomplete':<12} {'':>10}  {name} (leftover of an unfinished save)")
    return code


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every file of every committed step (or one) against its manifests. A step that a live job's
    retention deletes while it is checked is reported as removed, not as corrupt."""
    from .tiers.verify import verify_step

    for name in ("threads", "read_concurrency"):
        if getattr(args, name) < 1:
            raise _Usage(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    store, only = _open_root(args, args.root, read_concurrency=args.read_concurrency)
    if args.step is not None:
        only = args.step
    listing = _list_root(args, store)
    steps = [s for s in listing.steps if only is None or s == only]
    if only is not None and only not in listing.steps:
        folder_exists = _bounded(args, store, "exists", lambda: store.exists(layout.step_dir(only)))
        if not folder_exists:
            _say(args, f"step {only} not found under {store.url}")
            return EXIT_USAGE
        steps = [only]
    if not steps:
        if args.json:
            print(json.dumps({"root": store.url, "ok": False, "steps": [], "incomplete": listing.incomplete,
                              "error": "no committed checkpoints found"}))
        else:
            print(f"no committed checkpoints under {store.url}", file=sys.stderr)
        return EXIT_USAGE
    bar = _progress(0, sys.stderr.isatty() and not args.json, "verify")
    reports = []
    try:
        for step in steps:
            report = verify_step(store, step, threads=args.threads, deadline_s=_deadline(args, store),
                                 seen_committed=step in listing.steps,
                                 progress=(lambda n: bar.update(n)) if bar else None)
            reports.append(report)
            if not args.json:
                _print_report(report)
    finally:
        if bar:
            bar.close()
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"root": store.url, "ok": ok, "steps": [r.to_json() for r in reports],
                          "incomplete": listing.incomplete}))
    else:
        for name in listing.incomplete:
            print(f"leftover: {name} (incomplete save, not a checkpoint)")
        bad = [r.step for r in reports if not r.ok]
        removed = [r.step for r in reports if r.removed]
        checked = len(reports) - len(removed)
        print(f"{checked - len(bad)} of {checked} steps intact" + (f"; corrupt: {bad}" if bad else "")
              + (f"; removed during the check: {removed}" if removed else ""))
    return EXIT_OK if ok else EXIT_BAD


def _print_report(report: Any) -> None:
    """One step's ``verify`` result, as text."""
    step = report.step
    if report.removed:
        print(f"step {step}: removed during the check (deleted while it was read, e.g. by a live job's "
              "retention)")
        return
    status = "OK" if report.ok else "CORRUPT"
    ranks = ""
    if report.world_size and report.world_size > 1:
        held = report.ranks if len(report.ranks) < report.world_size else "all"
        ranks = f", {report.world_size} ranks, shards here: {held}"
    print(f"step {step}: {status} ({report.bytes / 2**20:.1f} MiB{ranks})")
    for err in report.errors:
        print(f"  error: {err}")
    for name in report.extra_files:
        print(f"  warning: unexpected file {name} (not in the manifest)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a step's tensors (key, dtype, shape, bytes) and metadata."""
    from .tiers.reader import read_manifests

    store, only = _open_root(args, args.root)
    step = args.step if args.step is not None else only
    if step is None:
        raise _Usage("inspect needs --step N (or a step folder as ROOT)")
    manifest, rms = _bounded(args, store, "read manifests of", lambda: read_manifests(store, step))
    if args.json:
        print(json.dumps({
            "step": step, "world_size": manifest.world_size, "bytes": manifest.total_bytes,
            "created": manifest.created, "metadata": manifest.metadata,
            "library_version": manifest.library_version,
            "tensors": [{"rank": rm.rank, "key": t.path, "name": t.name, "dtype": t.dtype,
                         "shape": list(t.shape), "bytes": t.nbytes, "file": rm.files[t.file].name}
                        for rm in rms for t in rm.tensors],
            "files": [{"rank": rm.rank, "name": f.name, "bytes": f.size, "compression": f.compression}
                      for rm in rms for f in rm.files],
        }))
        return EXIT_OK
    print(f"step {step}: {manifest.world_size} rank(s), {manifest.total_bytes / 2**20:.2f} MiB, "
          f"tierckpt {manifest.library_version}")
    print(f"metadata: {json.dumps(manifest.metadata)}")
    for rm in rms:
        print(f"rank {rm.rank}: {len(rm.files)} file(s), {len(rm.tensors)} tensor(s)")
        for t in rm.tensors:
            print(f"  {t.path:<60} {t.dtype:<8} {str(list(t.shape)):<20} {t.nbytes:>12}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt", description="Inspect, verify and move tierckpt checkpoints.",
        epilog="exit codes: 0 ok; 1 corruption found or an operation failed; 2 usage error or nothing found; "
               "3 storage unreachable, access denied or root in use by a live job")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log progress (and storage retries) to stderr")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec storage option for URLs (repeatable; dotted keys nest, values parse "
                             "as JSON)")
        sp.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="URLs: most seconds a listing or manifest read may take, retries included, and "
                             f"the backend's per-request timeouts (default {DEFAULT_TIMEOUT_S:g}); exit 3 "
                             "past it")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("ls", help="list committed steps and leftovers")
    sp.add_argument("root")
    sp.add_argument("--remote",
                    help="also list this remote tier: each step shows local, remote or local+remote")
    common(sp)
    sp.set_defaults(fn=cmd_ls)
    sp = sub.add_parser("verify", help="re-hash every file of every committed step against its manifest")
    sp.add_argument("root", help="tier root, a single step folder, or a URL")
    sp.add_argument("--step", type=int)
    sp.add_argument("--threads", type=int, default=4, help="files verified at once (default 4)")
    sp.add_argument("--read-concurrency", type=int, default=8, metavar="N",
                    help="URLs: ranged reads of one file in flight (default 8; each holds an 8 MiB buffer)")
    common(sp)
    sp.set_defaults(fn=cmd_verify)
    sp = sub.add_parser("inspect", help="print a step's tensors and metadata")
    sp.add_argument("root")
    sp.add_argument("--step", type=int)
    common(sp)
    sp.set_defaults(fn=cmd_inspect)
    try:
        from . import cli_remote
    except ImportError:  # pragma: no cover
        cli_remote = None  # type: ignore[assignment]
    if cli_remote is not None:
        cli_remote.add_commands(sub, common)
    return p


def _setup_logging(verbose: bool) -> None:
    """Log to stderr, as ``logging.basicConfig`` would (and like it, not at all when logging is configured
    already: an embedding program, a test runner). Without ``verbose`` the storage retries' warnings are
    hidden: the command reports the outcome in one line."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(lambda r: r.levelno >= logging.ERROR or not r.name.startswith(_CHATTY_LOGGERS))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run ``tierckpt ARGV``; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    _setup_logging(args.verbose)
    try:
        return int(args.fn(args))
    except _Usage as exc:
        print(_clean(args, f"tierckpt {args.cmd}: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except _Unavailable as exc:
        _say(args, f"tierckpt {args.cmd}: {exc}")
        return EXIT_UNAVAILABLE
    except BrokenPipeError:  # `tierckpt inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except FileNotFoundError as exc:
        _say(args, f"tierckpt {args.cmd}: not found: {exc}")
        return EXIT_USAGE
    except StorageError as exc:
        return _storage_failure(args, exc)
    except CheckpointError as exc:
        where = "" if exc.path else f" ({_target_url(args)})"
        _say(args, f"tierckpt {args.cmd}: {exc}{where}")
        return EXIT_BAD
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _backend_failure(exc):
            raise
        return _storage_failure(args, exc)
