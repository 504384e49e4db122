"""The operators' CLI: ``tierckpt ls|verify|inspect|sync|pull|prune``, on local folders and remote URLs.

Exit codes: 0 success (everything intact); 1 corruption found (``verify``) or an operation failed; 2 usage error or
nothing found. ``--json`` prints one machine-readable document on stdout and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from .errors import CheckpointError
from .format import layout
from .storage.base import Store
from .storage.open import is_url, open_store

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2


class _Usage(Exception):
    pass


def _storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
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


def _open_root(target: str, opts: dict[str, Any] | None, read_concurrency: int | None = None,
               direct_io: bool = False, huge_pages: bool = False) -> tuple[Store, int | None]:
    """The tier root and, when ``target`` is a single step's folder, that step (``direct_io``, ``huge_pages``: for
    a path)."""
    stripped = target.rstrip("/")
    base = stripped.rsplit("/", 1)[-1]
    step = layout.parse_step_dir(base)
    if step is not None:
        parent = stripped[: -len(base)].rstrip("/") or "/"
        return open_store(parent, storage_options=opts, tier="cli", create=False,
                          read_concurrency=read_concurrency, direct_io=direct_io, huge_pages=huge_pages), step
    if not is_url(target) and not os.path.isdir(target.removeprefix("file://")):
        raise FileNotFoundError(target)
    return open_store(target, storage_options=opts, tier="cli", create=False, read_concurrency=read_concurrency,
                      direct_io=direct_io, huge_pages=huge_pages), None


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, file=sys.stderr)


def cmd_ls(args: argparse.Namespace) -> int:
    from .status import list_steps
    from .tiers.verify import list_root

    opts = _storage_options(args.storage_option)
    store, only = _open_root(args.root, opts)
    listing = list_root(store)
    remote = open_store(args.remote, storage_options=opts, tier="remote", create=False) if args.remote else None
    infos = [i for i in list_steps(store, remote, set(), set()) if only is None or i.step == only]

    def state(i: Any) -> str:
        if i.state == "failed":
            return "unreadable"
        return i.state if remote is not None else "committed"

    def ranks(i: Any) -> str:
        if not i.world_size or i.world_size == 1:
            return "1"
        return f"{i.world_size} (here: {'all' if i.ranks_here is None else list(i.ranks_here)})"

    if args.json:
        print(json.dumps({
            "root": store.url, "remote": remote.url if remote else None,
            "steps": [{"step": i.step, "state": state(i), "local": i.local, "remote": i.remote, "bytes": i.bytes,
                       "created": i.created, "world_size": i.world_size,
                       "ranks_here": None if i.ranks_here is None else list(i.ranks_here)} for i in infos],
            "incomplete": listing.incomplete,
        }))
        return EXIT_OK
    if not infos and not listing.incomplete:
        print(f"no checkpoints under {store.url}")
        return EXIT_OK
    print(f"{'STEP':>12}  {'STATE':<13} {'SIZE':>10}  {'CREATED':<19}  RANKS")
    for i in infos:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created)) if i.created else "?"
        size = f"{i.bytes / 2**20:.1f} MiB" if i.bytes is not None else "?"
        print(f"{i.step:>12}  {state(i):<13} {size:>10}  {created:<19}  {ranks(i)}")
    for name in listing.incomplete:
        print(f"{'-':>12}  {'incomplete':<12} {'':>10}  {name} (leftover of an unfinished save)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .tiers.verify import list_root, verify_step

    for name in ("threads", "read_concurrency"):
        if getattr(args, name) < 1:
            raise _Usage(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    store, only = _open_root(args.root, _storage_options(args.storage_option), args.read_concurrency)
    if args.step is not None:
        only = args.step
    listing = list_root(store)
    steps = [s for s in listing.steps if only is None or s == only]
    if only is not None and only not in listing.steps:
        folder_exists = store.exists(layout.step_dir(only))
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
    for step in steps:
        report = verify_step(store, step, threads=args.threads, progress=(lambda n: bar.update(n)) if bar else None)
        reports.append(report)
        if not args.json:
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
        print(f"{len(reports) - len(bad)} of {len(reports)} steps intact" + (f"; corrupt: {bad}" if bad else ""))
    return EXIT_OK if ok else EXIT_BAD


def cmd_inspect(args: argparse.Namespace) -> int:
    from .tiers.reader import read_manifests

    store, only = _open_root(args.root, _storage_options(args.storage_option))
    step = args.step if args.step is not None else only
    if step is None:
        raise _Usage("inspect needs --step N (or a step folder as ROOT)")
    manifest, rms = read_manifests(store, step)
    if args.json:
        print(json.dumps({
            "step": step, "world_size": manifest.world_size, "bytes": manifest.total_bytes, "created": manifest.created,
            "metadata": manifest.metadata, "library_version": manifest.library_version,
            "tensors": [{"rank": rm.rank, "key": t.path, "name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "bytes": t.nbytes, "file": rm.files[t.file].name} for rm in rms for t in rm.tensors],
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


def _say(args: argparse.Namespace, msg: str) -> None:
    if args.json:
        print(json.dumps({"ok": False, "error": msg}))
    else:
        print(msg, file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt", description="Inspect, verify and move tierckpt checkpoints.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec storage option for URLs (repeatable; dotted keys nest, values parse as JSON)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("ls", help="list committed steps and leftovers")
    sp.add_argument("root")
    sp.add_argument("--remote", help="also list this remote tier: each step shows local, remote or local+remote")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args))
    except _Usage as exc:
        print(f"tierckpt {args.cmd}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as exc:
        _say(args, f"tierckpt {args.cmd}: not found: {exc}")
        return EXIT_USAGE
    except CheckpointError as exc:
        _say(args, f"tierckpt {args.cmd}: {exc}")
        return EXIT_BAD
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tierckpt inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
