"""The read-only commands: ``tierckpt ls``, ``verify`` and ``inspect``, on a tier root, one step folder or a URL.

They read manifests and data files and never write to a store, so they are safe next to a live job: a step that the
job's retention deletes while ``verify`` reads it is reported as removed, not as corrupt. Like every command here
they load nothing of torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import StorageError
from ..format import layout, shard_index
from ..peers import replicas as _replicas
from ..tiers.memory import job_dir, steps_in_memory
from ._common import (
    EXIT_BAD,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    UsageError,
    add_common_options,
    bounded,
    bounded_list_root,
    clean,
    deadline_for,
    open_root,
    open_target,
    progress_bar,
    report_json,
    say,
    warn,
)


def ranks_held(world_size: int | None, ranks: Any) -> list[int] | None:
    """The ranks whose shards a copy of a step holds, None for all of them: a node's copy that holds every rank's
    reads the same as a remote tier's copy (whose manifest lists none)."""
    if ranks is None or not world_size or set(ranks) >= set(range(world_size)):
        return None
    return sorted(ranks)


def cmd_ls(args: argparse.Namespace) -> int:
    """List the committed steps of ROOT (and where each is with ``--remote``) and the leftovers of unfinished
    saves. With the remote unreachable the local listing is printed anyway, with a warning; exit 3."""
    from ..status import list_steps

    store, only = open_root(args, args.root)
    listing = bounded_list_root(args, store)
    remote = open_target(args, args.remote, tier="remote") if args.remote else None
    remote_error: StorageError | None = None
    try:
        infos = list_steps(store, remote, set(), set(), remote_deadline_s=args.timeout)
    except StorageError as exc:
        where = exc.path or ""
        if remote is None or not (where == remote.url or where.startswith(remote.url + "/")):
            raise
        remote_error = exc
        warn(args, f"tierckpt ls: warning: cannot list the remote {remote.url}: {exc.detail}; "
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
        held = ranks_held(i.world_size, i.ranks_here)
        return f"{i.world_size} (here: {'all' if held is None else held})"

    def shared(i: Any) -> str:  # an incremental step: the bytes it references in earlier steps, and where
        if not i.refs or i.shared_bytes is None:
            return "-"
        steps = ",".join(map(str, i.refs[:3])) + (",..." if len(i.refs) > 3 else "")
        return f"{i.shared_bytes / 2**20:.1f} MiB in {steps}"

    code = EXIT_OK if remote_error is None else EXIT_UNAVAILABLE
    # the memory tier's copies on this node (a job with memory_tier=True that crashed, or is running)
    in_memory = {} if store.local_path is None else steps_in_memory(store.local_path)
    # the replicas this node keeps for its partner nodes (peer_replicas)
    replicas_held = {} if store.local_path is None else replica_steps(store.local_path, only)
    if args.json:
        doc: dict[str, Any] = {
            "ok": remote_error is None, "root": store.url, "remote": remote.url if remote else None,
            "steps": [{"step": i.step, "state": state(i), "local": i.local,
                       "remote": None if remote_error is not None else i.remote, "bytes": i.bytes,
                       "created": i.created, "world_size": i.world_size,
                       "ranks_here": ranks_held(i.world_size, i.ranks_here),
                       "own_bytes": None if i.bytes is None or i.shared_bytes is None else i.bytes - i.shared_bytes,
                       "shared_bytes": i.shared_bytes, "refs": list(i.refs)} for i in infos],
            "incomplete": listing.incomplete,
            "memory": {str(s): r for s, r in sorted(in_memory.items()) if only is None or s == only},
            "replicas": {str(node): steps for node, steps in replicas_held.items()},
        }
        if remote is not None and remote_error is not None:
            doc["remote_error"] = clean(args, f"{remote.url}: {remote_error.detail}")
        print(json.dumps(doc))
        return code
    if not infos and not listing.incomplete and not replicas_held:
        print(f"no checkpoints under {store.url}")
        return code
    print(f"{'STEP':>12}  {'STATE':<13} {'SIZE':>10} {'OWN':>10}  {'SHARED':<22} {'CREATED':<19}  RANKS")
    for i in infos:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created)) if i.created else "?"
        size = f"{i.bytes / 2**20:.1f} MiB" if i.bytes is not None else "?"
        own = f"{(i.bytes - (i.shared_bytes or 0)) / 2**20:.1f} MiB" if i.bytes is not None else "?"
        print(f"{i.step:>12}  {state(i):<13} {size:>10} {own:>10}  {shared(i):<22} {created:<19}  {ranks(i)}")
    for name in listing.incomplete:
        print(f"{'-':>12}  {'incomplete':<12} {'':>10}  {name} (leftover of an unfinished save)")
    for s, held in sorted(in_memory.items()):
        if only is None or s == only:
            print(f"{s:>12}  {'memory':<13} ranks {held} on this node (memory tier: {job_dir(store.local_path or '')})")
    for node, steps in replicas_held.items():
        for s in steps:
            print(f"{s:>12}  {'replica':<13} of node {node} (peer copy: "
                  f"{store.url}/{_replicas.node_dir(node)}/{layout.step_dir(s)})")
    return code


def replica_steps(root: str, only: int | None = None) -> dict[int, list[int]]:
    """The committed replica steps kept under ``root`` for each partner node (``replicas/node-<k>/``)."""
    out = {}
    for node in _replicas.held_nodes(root):
        steps = [s for s in _replicas.committed_steps(root, node) if only is None or s == only]
        if steps:
            out[node] = steps
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every file of every committed step (or one) against its manifests. A step that a live job's
    retention deletes while it is checked is reported as removed, not as corrupt."""
    from ..tiers.verify import verify_step

    for name in ("threads", "read_concurrency"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    store, only = open_root(args, args.root, read_concurrency=args.read_concurrency)
    if args.step is not None:
        only = args.step
    listing = bounded_list_root(args, store)
    steps = [s for s in listing.steps if only is None or s == only]
    peer_roots = _replica_roots(store, only, args)
    if only is not None and only not in listing.steps:
        folder_exists = bounded(args, store, "exists", lambda: store.exists(layout.step_dir(only)))
        if not folder_exists:
            say(args, f"step {only} not found under {store.url}")
            return EXIT_USAGE
        steps = [only]
    if not steps and not peer_roots:
        if args.json:
            print(json.dumps({"root": store.url, "ok": False, "steps": [], "incomplete": listing.incomplete,
                              "error": "no committed checkpoints found"}))
        else:
            print(f"no committed checkpoints under {store.url}", file=sys.stderr)
        return EXIT_USAGE
    bar = progress_bar(0, sys.stderr.isatty() and not args.json, "verify")
    reports = []
    try:
        for step in steps:
            report = verify_step(store, step, threads=args.threads, deadline_s=deadline_for(args, store),
                                 seen_committed=step in listing.steps,
                                 progress=(lambda n: bar.update(n)) if bar else None)
            reports.append(report)
            if not args.json:
                print_report(args, report)
        for peer_store, peer_steps in peer_roots:  # the replicas this node keeps for its partners
            for step in peer_steps:
                report = verify_step(peer_store, step, threads=args.threads, deadline_s=deadline_for(args, store),
                                     seen_committed=True)
                reports.append(report)
                if not args.json:
                    print(f"replica under {peer_store.url}:")
                    print_report(args, report)
    finally:
        if bar:
            bar.close()
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"root": store.url, "ok": ok, "steps": [report_json(args, r) for r in reports],
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


def _replica_roots(store: Any, only: int | None, args: argparse.Namespace) -> list[tuple[Any, list[int]]]:
    """Each partner node's replica folder under a local ROOT (``replicas/node-<k>/``, a tier root of its own) with
    its committed steps (only ``only``, if given)."""
    if store.local_path is None:
        return []
    from ..storage.local import LocalStore

    return [(LocalStore(f"{store.local_path}/{_replicas.node_dir(node)}", tier="peer", create=False), steps)
            for node, steps in replica_steps(store.local_path, only).items()]


def print_report(args: argparse.Namespace, report: Any) -> None:
    """One step's ``verify`` result, as text (its errors :func:`~._common.clean`)."""
    step = report.step
    if report.removed:
        print(f"step {step}: removed during the check (deleted while it was read, e.g. by a live job's "
              "retention)")
        return
    status = "OK" if report.ok else "CORRUPT"
    ranks = ""
    if report.world_size and report.world_size > 1:
        held = ranks_held(report.world_size, report.ranks)
        ranks = f", {report.world_size} ranks, shards here: {'all' if held is None else held}"
        if report.index is not None and report.ok:
            ranks += ", shard index checked"
    print(f"step {step}: {status} ({report.bytes / 2**20:.1f} MiB{ranks})")
    for err in report.errors:
        print(f"  error: {clean(args, err)}")
    for name in report.extra_files:
        print(f"  warning: unexpected file {name} (not in the manifest)")


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a step's tensors (key, dtype, shape, bytes) and metadata."""
    from ..tiers.reader import read_manifests

    store, only = open_root(args, args.root)
    step = args.step if args.step is not None else only
    if step is None:
        raise UsageError("inspect needs --step N (or a step folder as ROOT)")
    manifest, rms = bounded(args, store, "read manifests of", lambda: read_manifests(store, step))
    # a multi-rank step's shard index (docs/format.md section 15): one request, only for a copy of every rank
    index: str | None = shard_index.index_name(manifest.save_id)
    if len(manifest.ranks) < 2 or not bounded(args, store, "exists",
                                               lambda: store.exists(f"{layout.step_dir(step)}/{index}")):
        index = None
    if args.json:
        print(json.dumps({
            "ok": True, "root": store.url, "step": step, "world_size": manifest.world_size,
            "bytes": manifest.total_bytes, "created": manifest.created, "metadata": manifest.metadata,
            "library_version": manifest.library_version, "shard_index": index,
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
    if index is not None:
        print(f"shard index: {index} (not checked here; `tierckpt verify` checks it)")
    for rm in rms:
        print(f"rank {rm.rank}: {len(rm.files)} file(s), {len(rm.tensors)} tensor(s)")
        for t in rm.tensors:
            print(f"  {t.path:<60} {t.dtype:<8} {str(list(t.shape)):<20} {t.nbytes:>12}")
    return EXIT_OK


def add_commands(sub: Any) -> None:
    """Register ``ls``, ``verify`` and ``inspect`` on the ``tierckpt`` sub-parsers."""
    sp = sub.add_parser("ls", help="list committed steps and leftovers")
    sp.add_argument("root", help="tier root, a single step folder, or a URL")
    sp.add_argument("--remote",
                    help="also list this remote tier: each step shows local, remote or local+remote")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_ls)
    sp = sub.add_parser("verify", help="re-hash every file of every committed step against its manifest")
    sp.add_argument("root", help="tier root, a single step folder, or a URL")
    sp.add_argument("--step", type=int, metavar="N", help="verify this step only (default: every committed step)")
    sp.add_argument("--threads", type=int, default=4, metavar="N", help="files verified at once (default 4)")
    sp.add_argument("--read-concurrency", type=int, default=8, metavar="N",
                    help="URLs: ranged reads of one file in flight (default 8; each holds an 8 MiB buffer)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_verify)
    sp = sub.add_parser("inspect", help="print a step's tensors and metadata")
    sp.add_argument("root", help="tier root, a single step folder, or a URL")
    sp.add_argument("--step", type=int, metavar="N", help="the step (needed unless ROOT is a step folder)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_inspect)
