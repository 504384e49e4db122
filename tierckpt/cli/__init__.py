"""The operators' CLI: ``tierckpt ls|verify|inspect|sync|pull|prune|export``, on local folders and remote URLs.

``tierckpt --version`` prints the version; ``tierckpt`` without a command lists the commands (exit 2).

The commands live in :mod:`.readonly` (``ls``, ``verify``, ``inspect``), :mod:`.remote` (``sync``, ``pull``) and
:mod:`.prune`, ``export`` in :mod:`.export`, on the helpers of :mod:`._common`; this module builds the parser and
maps what a command raises to its exit code. None of it imports torch but ``export`` when it runs.

Exit codes (every command):

- 0 (``EXIT_OK``): success, everything checked is intact;
- 1 (``EXIT_BAD``): corruption found (``verify``, ``pull``, ``prune``) or an operation failed (an upload, a deletion,
  one that ran out of memory: one line, never a traceback);
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
import logging
import os
import sys

from .._version import __version__
from ..errors import CheckpointError, StorageError
from . import readonly
from ._common import (
    EXIT_BAD,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Unavailable,
    UsageError,
    backend_failure,
    clean,
    drop_cli_tier,
    say,
    storage_failure,
    target_url,
)

#: Loggers whose retry chatter below ERROR is hidden without ``-v`` (the CLI reports the outcome in one line).
_CHATTY_LOGGERS = ("tierckpt.storage.failures", "tierckpt.storage.retry", "botocore", "aiobotocore", "s3fs",
                   "fsspec", "urllib3", "aiohttp", "gcsfs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt", description="Inspect, verify and move tierckpt checkpoints.",
        epilog="exit codes: 0 ok; 1 corruption found or an operation failed; 2 usage error or nothing found; "
               "3 storage unreachable, access denied or root in use by a live job")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log progress (and storage retries) to stderr")
    p.add_argument("--version", action="version", version=f"tierckpt {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND",
                           help="`tierckpt COMMAND --help` lists its options")
    readonly.add_commands(sub)
    try:
        from . import prune, remote
    except ImportError:  # pragma: no cover - the read-only commands work without them
        return p
    remote.add_commands(sub)
    prune.add_commands(sub)
    from . import export  # torch is imported only when `export` runs

    export.add_commands(sub)
    return p


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-parsers of :func:`build_parser`'s ``parser``, by command name, in the order ``--help`` lists them."""
    return dict(_subcommands(parser).choices)


def _missing_command(parser: argparse.ArgumentParser) -> int:
    """``tierckpt`` without a command: the usage and the commands, on stderr; exit 2."""
    helps = {a.dest: a.help or "" for a in _subcommands(parser)._choices_actions}
    width = max(map(len, helps), default=0)
    lines = [parser.format_usage().rstrip(), "tierckpt: a command is needed, one of:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in helps.items()]
    lines.append("`tierckpt COMMAND --help` lists a command's options; `tierckpt --help` the exit codes")
    print("\n".join(lines), file=sys.stderr)
    return EXIT_USAGE


class _LogFormatter(logging.Formatter):
    """``LEVEL logger: message``, without the internal tier name of the stores opened on ROOT."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        copy = logging.makeLogRecord(record.__dict__)  # other handlers see the record as it was
        copy.msg, copy.args = drop_cli_tier(record.getMessage()), None
        return super().format(copy)


def _setup_logging(verbose: bool) -> None:
    """Log to stderr, as ``logging.basicConfig`` would (and like it, not at all when logging is configured
    already: an embedding program, a test runner). Without ``verbose`` the storage retries' warnings are
    hidden: the command reports the outcome in one line."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormatter())
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
    if args.cmd is None:
        return _missing_command(parser)
    _setup_logging(args.verbose)
    try:
        return int(args.fn(args))
    except UsageError as exc:
        print(clean(args, f"tierckpt {args.cmd}: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except Unavailable as exc:
        say(args, f"tierckpt {args.cmd}: {exc}")
        return EXIT_UNAVAILABLE
    except BrokenPipeError:  # `tierckpt inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except FileNotFoundError as exc:
        say(args, f"tierckpt {args.cmd}: not found: {exc}")
        return EXIT_USAGE
    except StorageError as exc:
        return storage_failure(args, exc)
    except CheckpointError as exc:
        where = "" if exc.path else f" ({target_url(args)})"
        say(args, f"tierckpt {args.cmd}: {exc}{where}")
        return EXIT_BAD
    except KeyboardInterrupt:
        return 130
    except MemoryError:  # a manifest's parse is corruption already; anything else this large is no crash either
        say(args, f"tierckpt {args.cmd}: ran out of memory ({target_url(args)})")
        return EXIT_BAD
    except Exception as exc:
        if not backend_failure(exc):
            raise
        return storage_failure(args, exc)


__all__ = ["EXIT_BAD", "EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE", "build_parser", "commands", "main"]
