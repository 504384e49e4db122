"""``tierckpt prune``: retention by hand, and the leftovers of unfinished saves and uploads.

``prune ROOT --keep N [--keep-every K]`` applies a :class:`~tierckpt.retention.KeepPolicy`, deleting each step
``manifest.json`` first. The newest step is never deleted, nor the newest *intact* step: before deleting anything,
the steps are verified newest first (every byte of every file against the manifests' checksums, the stream of
:func:`~tierckpt.tiers.verify.verify_step`) until one is intact, and that step is kept even where the policy would
drop it, so a newest step that rotted cannot cost the last good one. Usually that reads the newest step in full
(and each corrupt step newer than the intact one); no intact step at all deletes no step. A corrupt step found is
reported and makes the exit code 1, after the safe deletions. ``--no-verify`` reads no data: the step kept is the
newest whose manifests verify and whose files have their recorded sizes. ``--dry-run`` verifies the same way and
prints the plan. ``--leftovers`` also runs the commit protocol's recovery on ROOT (unfinished uploads and saves,
files no manifest names). Without ``--keep`` no step is deleted (nor read): ``prune ROOT --leftovers`` removes the
leftovers only; with neither option (a dry run included) there is nothing to do, a usage error (exit 2).

Next to a live job: a local root whose lock a live manager (or ``tierckpt pull``) holds is refused (exit 3),
whatever the options, ``--dry-run`` included; on a remote root (a URL, or a folder without lock files), which
writers on other hosts use without a lock here and whose uploads look exactly like leftovers, ``--leftovers`` keeps
whatever may still be in progress: leftovers younger than ``--min-age`` (default 1 h; S3 multipart uploads by their
start, folders by their newest file, files of a committed step by their own time), or of unknown age, are kept and
listed as possibly in progress, unless ``--min-age 0``. Exit codes are :mod:`tierckpt.cli`'s.

Incremental steps: a step that a kept step references is kept (newest first, so a referencing step that goes frees
the steps it references), and so is a step that a running job's upload references: such a job keeps a lease at the
root (:mod:`tierckpt.tiers.leases`), and a step a fresh lease pins is kept with a message naming the lease.
``--force`` deletes pinned steps all the same: the running job's upload then fails, or its step is committed
referencing bytes that are gone (unreadable there: its local copy stays good). ``--leftovers`` also removes leases
expired for more than ``--min-age``, and finishes deletions a kill interrupted (a step folder with
``manifest.deleting.json`` and no ``manifest.json``): committed again if a step references it or a lease pins it,
removed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, cast

from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..format import layout
from ..storage import folder_lock
from ..storage.base import Store, join
from ..storage.failures import translate
from ._common import (
    EXIT_USAGE,
    Unavailable,
    UsageError,
    add_common_options,
    bounded,
    bounded_list_root,
    clean,
    deadline_for,
    exit_for,
    open_root,
    progress_bar,
    report_json,
    say,
    seconds,
    url_of,
)

#: Seconds a remote root's leftover must have been left alone before ``prune --leftovers`` removes it.
DEFAULT_MIN_AGE_S = 3600.0


def _manifests_ok(args: argparse.Namespace, store: Store, step: int) -> bool:
    """Cheap integrity check: the manifests verify and every data file has its recorded size. Raises
    :class:`~tierckpt.errors.StorageError` when the store cannot be read (that says nothing about the
    step)."""
    from ..tiers.reader import check_sizes, read_manifests

    def check() -> None:
        _manifest, rms = read_manifests(store, step)
        for rm in rms:
            check_sizes(store, rm)

    try:
        bounded(args, store, "read manifests of", check)
    except StorageError:
        raise
    except (CheckpointError, OSError):
        return False
    return True


def _newest_intact(args: argparse.Namespace, store: Store, steps: list[int]) -> tuple[int | None, list[Any]]:
    """Verify ``steps`` newest first, every byte against the checksums, until one is intact (printing each
    report unless ``--json``); returns that step (None if none is) and the reports, newest first. A step deleted
    while it is read (a writer elsewhere) counts as not intact. Raises
    :class:`~tierckpt.errors.StorageError` when the store cannot be read: nothing is known about the steps then,
    and nothing has been deleted."""
    from ..tiers.verify import verify_step
    from .readonly import print_report

    bar = progress_bar(0, sys.stderr.isatty() and not args.json, "verify")
    reports: list[Any] = []
    try:
        for step in reversed(steps):
            report = verify_step(store, step, threads=args.threads, deadline_s=deadline_for(args, store),
                                 seen_committed=True, progress=(lambda n: bar.update(n)) if bar else None)
            reports.append(report)
            if not args.json:
                print_report(args, report)
            if report.ok and not report.removed:
                return step, reports
    finally:
        if bar:
            bar.close()
    return None, reports


def _refuse_if_live(store: Store) -> None:
    """``Unavailable`` (exit 3) when ``store`` is a local folder whose lock a live process holds (a running
    ``CheckpointManager`` or ``tierckpt pull``): its retention and recovery own the folder while it runs."""
    if store.local_path is None:
        return
    ranks = folder_lock.live_holders(store.local_path)
    if ranks:
        raise Unavailable(f"{store.url} is in use by a live CheckpointManager (ranks {ranks}); stop it "
                           "first (its own retention prunes this folder while it runs), then prune")


def _is_local_tier(store: Store) -> bool:
    """Whether ``store`` is a folder that a manager uses as its local tier (it holds lock files, whose holders
    :func:`_refuse_if_live` checks); any other root is a remote tier, which writers on other hosts may be
    uploading to without a lock here."""
    if store.local_path is None:
        return False
    try:
        return any(n.startswith(layout.LOCK_PREFIX) for n in os.listdir(store.local_path))
    except OSError:
        return False


class _OldLeftoversOnly:
    """``store`` as the commit protocol's recovery sees it in ``prune --leftovers`` on a remote root: whatever
    a live writer may still be writing is hidden, so recovery (and the dry run's listing) cannot touch it.

    Hidden: leftover folders (``.tmp-``, ``.trash-``, step folders without ``manifest.json``) whose newest
    file is younger than ``min_age_s`` or of unknown age, such files of committed step folders (a new save of
    the step being written next to the old one), and unfinished multipart uploads started less than
    ``min_age_s`` ago. :attr:`kept` describes each hidden leftover (folders and uploads). Everything else is
    ``store``'s own."""

    def __init__(self, store: Store, times: dict[str, float | None], min_age_s: float, now: float) -> None:
        self._store = store
        self._times = times
        self._min_age_s = min_age_s
        self._cutoff = now - min_age_s
        self._under: dict[str, list[float | None]] = {}  # a top-level name -> the times of all it holds
        for path, t in times.items():
            self._under.setdefault(path.split("/", 1)[0], []).append(t)
        self.kept: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _young(self, rel: str) -> str | None:
        """Why ``rel`` (a top-level folder, or a file in one) must be kept: None if it and all it holds are
        older than the cutoff."""
        if "/" not in rel:
            times = self._under.get(rel, [])
        else:
            times = [self._times[rel]] if rel in self._times else []
        if not times or any(t is None for t in times):
            return "its age is unknown"
        return "younger than --min-age" if max(cast(list[float], times)) > self._cutoff else None

    def _keep(self, what: str, why: str) -> None:
        line = f"kept {what} (may be in progress; {why})"
        if line not in self.kept:
            self.kept.append(line)

    def list(self, rel: str = "") -> list[str]:
        names = self._store.list(rel)
        rel = join(rel)
        if not rel:
            shown = []
            for name in names:
                manifest_less = (layout.parse_step_dir(name) is not None
                                 and join(name, layout.STEP_MANIFEST) not in self._times)
                leftover = layout.is_leftover(name) or manifest_less
                why = self._young(name) if leftover else None
                if why is None:
                    shown.append(name)
                else:
                    self._keep(url_of(self._store, name), why)
            return shown
        if layout.parse_step_dir(rel) is not None:  # a committed step's folder: its young files stay unlisted
            return [n for n in names if self._young(join(rel, n)) is None]
        return names

    def discard_unfinished_uploads(self, *, dry_run: bool = False, older_than_s: float | None = None) -> list[str]:
        lines = self._store.discard_unfinished_uploads(dry_run=dry_run, older_than_s=self._min_age_s)
        for line in lines:
            if line.startswith("kept ") and line not in self.kept:
                self.kept.append(line)
        return [line for line in lines if not line.startswith("kept ")]


def _finish_deletions(args: argparse.Namespace, store: Store, view: Any, listing: Any) -> list[str]:
    """Leases expired for more than ``--min-age`` and deletions a kill interrupted (see the module docstring), as
    seen through ``view`` (young leftovers hidden); ``listing``: the root's listing. Returns what was done (with
    ``--dry-run``: what would be). Raises what the store raises."""
    from ..tiers import leases
    from ..tiers.steps import DELETING_MANIFEST, holds, recommit_if_held, remove_decommitted

    names = list(listing.steps.values()) + list(listing.other)
    visible = set(view.list(""))
    actions: list[str] = []
    for name in sorted(n for n in listing.other if leases.is_lease(n) and n in visible):
        try:
            lease = leases.read(store, name)
        except ValueError as exc:
            actions.append(f"kept malformed lease {url_of(store, name)} ({exc})")
            continue
        if lease is not None and not lease.fresh(time.time() - args.min_age):
            if not args.dry_run:
                store.remove(name)
            actions.append(f"{'would remove' if args.dry_run else 'removed'} expired lease {url_of(store, name)}")
    for step in sorted(listing.uncommitted):
        folder = layout.step_dir(step)
        if folder not in visible or not store.exists(join(folder, DELETING_MANIFEST)):
            continue
        where = url_of(store, folder)
        if args.dry_run:
            why = holds(store, step, names)
        else:
            why = recommit_if_held(store, step, names)
        if why is not None:
            actions.append(f"{'would commit' if args.dry_run else 'committed'} step {step} again ({where}): "
                           f"its deletion was interrupted and {why}")
        else:
            if not args.dry_run:
                remove_decommitted(store, step)
            actions.append(f"{'would remove' if args.dry_run else 'removed'} {where}: an interrupted deletion")
    return actions


def _prune_leftovers(args: argparse.Namespace, store: Store, failures: list[BaseException],
                     errors: list[str]) -> tuple[list[str], list[str]]:
    """Run the store's commit-protocol recovery (or, with ``--dry-run``, list what it would touch): unfinished
    uploads and saves, and files no manifest names. On a remote root only what is older than ``--min-age``
    (see :class:`_OldLeftoversOnly`). Returns (what was done, or with ``--dry-run`` the leftovers' names and
    the uploads it would abort; what was kept as possibly in progress); a failure is appended to ``failures``
    and ``errors`` and reported on stderr."""
    from ..storage.commit import protocol_for
    from ..tiers.listing import list_root

    view: Any = store
    try:
        if args.min_age > 0 and not _is_local_tier(store):
            times = bounded(args, store, "list", store.modified_times)
            view = _OldLeftoversOnly(store, times, args.min_age, time.time())
        listing = bounded(args, store, "list", lambda: list_root(store))
        finished = bounded(args, store, "finish interrupted deletions of",
                           lambda: _finish_deletions(args, store, view, listing))
        if not args.json:
            for line in finished:
                print(f"leftover: {line}")
        if args.dry_run:
            found = bounded(args, store, "list", lambda: list_root(view).incomplete)
            uploads = bounded(args, store, "list unfinished uploads",
                               lambda: view.discard_unfinished_uploads(dry_run=True))
            if not args.json:
                for name in found:
                    print(f"would remove leftover {url_of(store, name)}")
                for line in uploads:
                    print(line)
            actions = finished + found + uploads
        else:
            actions = finished + protocol_for(store).recover(view)
            if not args.json:
                for action in actions:
                    print(f"leftover: {action}")
    except (CheckpointError, OSError) as exc:
        failures.append(translate(exc, op="clean leftovers", tier=store.tier, url=store.url))
        msg = clean(args, f"FAILED to clean leftovers under {store.url}: {exc}")
        errors.append(f"leftovers: {msg}")
        print(msg, file=sys.stderr)
        actions = []
    kept = list(getattr(view, "kept", []))
    if not args.json:
        for line in kept:
            print(line)
    return actions, kept


def cmd_prune(args: argparse.Namespace) -> int:
    """Apply retention by hand: keep the newest ``--keep`` steps plus every ``--keep-every``-th step, and the
    newest intact step (see the module docstring)."""
    from ..retention import KeepPolicy
    from ..tiers import leases
    from ..tiers.steps import delete_step, plan

    for name in ("keep", "keep_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.keep is None and args.keep_every is not None:
        raise UsageError("--keep-every K needs --keep N: it names the steps kept beyond the newest N")
    if args.keep is None and not args.leftovers:
        raise UsageError("nothing to do: --keep N deletes all but the newest N steps, --leftovers removes what "
                         "unfinished saves and uploads left; pass either or both"
                         + ("" if args.dry_run else " (and --dry-run to see the plan first)"))
    policy = KeepPolicy(keep_last=args.keep, keep_every=args.keep_every)
    for name in ("threads", "read_concurrency"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    store, only = open_root(args, args.root, read_concurrency=args.read_concurrency)
    if only is not None:
        raise UsageError("prune takes a tier root, not a step folder")
    errors: list[str] = []
    failures: list[BaseException] = []
    reports: list[Any] = []
    try:
        _refuse_if_live(store)
        listing = bounded_list_root(args, store)
        steps = sorted(listing.steps)
        if not steps and args.keep is not None:
            say(args, f"no committed checkpoints under {store.url}")
            return EXIT_USAGE
        doomed = policy.to_delete(steps)
        protected: int | None = None
        why = ""
        if args.keep is None:
            pass  # --leftovers alone: no step is deleted, so none is read
        elif args.verify:  # every byte of the steps it keeps, newest first until one is intact, before any deletion
            protected, reports = _newest_intact(args, store, steps)
            why = "the newest intact step"
        else:
            protected = next((s for s in reversed(steps) if _manifests_ok(args, store, s)), None)
            why = "the newest step whose manifests verify (--no-verify: its data was not read)"
        for report in reports:
            if not report.ok:
                where = url_of(store, layout.step_dir(report.step))
                failures.append(CorruptCheckpointError(f"step {report.step} is corrupt", step=report.step,
                                                       tier=store.tier, path=where, bad_files=report.bad_files))
                errors.append(clean(args, f"step {report.step}: CORRUPT: {'; '.join(report.errors)}"))
        if args.verify and protected is None and doomed:
            msg = clean(args, f"tierckpt prune: no step under {store.url} verifies intact (corrupt: "
                              f"{[r.step for r in reports if not r.ok]}): deleting no step; `tierckpt verify` names "
                              "the bad files")
            errors.append(msg)
            print(msg, file=sys.stderr)
            doomed = []
        if protected in doomed:
            doomed.remove(protected)
            if not args.json:
                print(f"keeping step {protected}: {why}")
        kept = [s for s in steps if s not in doomed]
        deleted: list[int] = []
        pinned = bounded(args, store, "read the leases of", lambda: leases.pinned_by(store, listing.other))
        if pinned and doomed and not args.json:
            verb = "would delete" if args.dry_run else "deleting"
            print(("--force: " + verb + " steps that a running job's upload references ({}): that upload then "
                   "fails, or commits a step whose referenced bytes are gone from this root" if args.force else
                   "keeping the steps a running job's upload references ({}); --force deletes them, which breaks "
                   "that upload").format("; ".join(f"step {s}: lease {lease.describe()}"
                                               for s, lease in sorted(pinned.items()) if s in doomed)))
        # newest first: an incremental step goes before the steps it references, which are then free to go
        would: set[int] = set()
        held_now = bounded(args, store, "check the references of", lambda: plan(store, doomed, force=args.force)) \
            if args.dry_run else {}
        for step in sorted(doomed, reverse=True):
            where = url_of(store, layout.step_dir(step))
            if args.dry_run:
                if step not in held_now:
                    would.add(step)
                    if not args.json:
                        print(f"would delete step {step} ({where})")
                elif not args.json:
                    print(f"would keep step {step}: {held_now[step]}")
                continue
            try:
                gone = delete_step(store, step, force=True) if args.force else delete_step(store, step)
            except (CheckpointError, OSError) as exc:
                failures.append(translate(exc, op="delete", tier=store.tier, url=where, step=step))
                msg = clean(args, f"step {step}: FAILED to delete {where}: {exc}")
                errors.append(msg)
                print(msg, file=sys.stderr)
                continue
            if not gone:  # a kept step references its bytes, or a running job's upload (incremental steps)
                kept = sorted([*kept, step])
                if not args.json:
                    print(f"keeping step {step}: " + ("a running job's upload references it (lease "
                                                      f"{pinned[step].describe()})" if step in pinned and not
                                                      args.force else "a step kept references its bytes"))
                continue
            deleted.append(step)
            if not args.json:
                print(f"deleted step {step} ({where})")
        deleted.sort()
        leftovers, young = _prune_leftovers(args, store, failures, errors) if args.leftovers else ([], [])
    finally:
        store.close()
    if args.json:
        doc: dict[str, Any] = {"root": store.url, "dry_run": args.dry_run, "ok": not errors, "kept": kept,
                               "deleted": deleted, "errors": errors, "leftovers": leftovers,
                               "kept_leftovers": young, "newest_intact": protected if args.verify else None,
                               "verified": [report_json(args, r) for r in reports]}
        if args.dry_run:
            doc["would_delete"] = sorted(would)
        print(json.dumps(doc))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(would) if args.dry_run else len(deleted)} step(s)"
              + (" (no --keep)" if args.keep is None else "") + f"; keeping {kept}")
    return exit_for(failures)


def add_commands(sub: Any) -> None:
    """Register ``prune`` on the ``tierckpt`` sub-parsers."""
    sp = sub.add_parser("prune", help="apply retention by hand (manifest first; never the newest step, nor the "
                                      "newest intact one)")
    sp.add_argument("root", help="tier root: a path or an fsspec URL")
    sp.add_argument("--keep", type=int, default=None, metavar="N",
                    help="keep the N newest steps, delete the others (without it no step is deleted: "
                         "--leftovers alone)")
    sp.add_argument("--keep-every", type=int, default=None, metavar="K", help="also keep every K-th step")
    sp.add_argument("--dry-run", action="store_true",
                    help="verify as a prune would, print what would be kept and deleted (and with --leftovers "
                         "the leftovers it would remove), delete nothing")
    sp.add_argument("--no-verify", dest="verify", action="store_false",
                    help="read no data: keep the newest step whose manifests verify and whose files have their "
                         "sizes, not the newest whose bytes match their checksums (by default the steps are read "
                         "in full, newest first, until one is intact)")
    sp.add_argument("--threads", type=int, default=4, metavar="N", help="files verified at once (default 4)")
    sp.add_argument("--read-concurrency", type=int, default=8, metavar="N",
                    help="URLs: ranged reads of one file in flight while verifying (default 8; each holds an "
                         "8 MiB buffer)")
    sp.add_argument("--leftovers", action="store_true",
                    help="also remove leftovers of unfinished saves/uploads (on a remote root: those older "
                         "than --min-age only)")
    sp.add_argument("--force", action="store_true",
                    help="also delete steps a running job's upload references (a fresh lease at the root pins "
                         "them): that upload then fails, or commits a step whose referenced bytes are gone")
    sp.add_argument("--min-age", type=seconds, default=DEFAULT_MIN_AGE_S, metavar="SECONDS",
                    help="remote roots: leftovers younger than this may be a live writer's upload in "
                         f"progress and are kept (default {DEFAULT_MIN_AGE_S:g}; 0 removes every leftover)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_prune)
