"""The commands that move checkpoints between tiers: ``tierckpt sync`` and ``pull``.

They follow the conventions of :mod:`tierckpt.cli`: exit 0 on success, 1 when an operation failed or a step is
corrupt, 2 for a usage error or nothing found, 3 when the storage could not be reached or used (unreachable, silent
past ``--timeout``, access denied) or a live job holds the root; where some steps failed for a reason of their own
and others for want of storage, 1 wins. ``--json`` prints one document on stdout and nothing else; a progress bar
goes to stderr on a terminal only. Messages, failure lines included, name stores by their ``url`` (credentials
removed), never by the ``--storage-option`` values.

- ``sync LOCAL REMOTE`` replicates every committed local step that the remote does not hold committed, through
  :func:`tierckpt.tiers.uploader.replicate_step` (data, then rank manifests, then the shard index of a multi-rank
  step with distributed tensors, then ``manifest.json`` last). It
  is resumable: an interrupted run leaves only uncommitted files, which the next run replaces. A remote step
  committed from another save (a different ``save_id``) is left alone and reported.
- ``pull REMOTE LOCAL --step N`` streams one step into a local tier root, hashing every byte against the
  remote manifests as it arrives; compressed remote files are decompressed, and the rank manifests re-sealed
  without the compression fields, so the local copy is plain safetensors with the same checksums and
  ``save_id``. A multi-rank step with distributed tensors gets a shard index of the pulled copy's own references
  (:func:`tierckpt.format.shard_index.of_copy`), so a resharding restore from it reads only the rank manifests it
  needs. It is written into a temporary folder and renamed into place (the local commit protocol), so a
  failed pull leaves nothing visible. The local root's lock is taken for the duration, so a pull never races a
  live manager (exit 3 while one runs). A local copy of the step from another save (which may exist nowhere
  else) is replaced only with ``--force``; a damaged one, or one of the same save, is replaced by the verified
  copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from ..format import hashing, layout, shard_index
from ..format.manifest import FileRecord, RankManifest, StepManifest
from ..host.memory import huge_pages_available
from ..storage import folder_lock
from ..storage.base import Store, join
from ..storage.failures import translate, with_deadline
from ..storage.open import is_url
from ..storage.s3upload import DEFAULT_WRITE_CONCURRENCY
from ._common import (
    EXIT_BAD,
    EXIT_OK,
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
    open_target,
    progress_bar,
    say,
    url_of,
)

log = logging.getLogger(__name__)

#: Bytes streamed per read while pulling.
_CHUNK = 8 << 20


def _bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    return progress_bar(total, sys.stderr.isatty() and not args.json, desc)


def _emit(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(doc))


# -------------------------------------------------------------------------------------------------- sync
def cmd_sync(args: argparse.Namespace) -> int:
    """Replicate committed local steps that the remote lacks; exit 1 if a step failed (3 if every failure was
    for want of storage)."""
    from ..storage.commit import read_step_manifest
    from ..tiers.listing import list_steps
    from ..tiers.reader import read_manifests
    from ..tiers.uploader import replicate_step

    if args.threads < 1:
        raise UsageError("--threads must be >= 1")
    if args.write_concurrency < 1:
        raise UsageError("--write-concurrency must be >= 1")
    # the uploader's read buffer on huge pages where direct reads use it (as the manager's, huge_pages auto)
    local, only = open_root(args, args.local, tier="local", direct_io=args.direct_io,
                             huge_pages=args.direct_io and huge_pages_available())
    local_steps = [s for s in bounded_list_root(args, local).steps if only is None or s == only]
    if not local_steps:
        say(args, f"no committed checkpoints under {local.url}"
             + (f" for step {only}" if only is not None else ""))
        return EXIT_USAGE
    remote = open_target(args, args.remote, tier="remote", create=True, write_concurrency=args.write_concurrency,
                   direct_io=args.direct_io)
    failures: list[BaseException] = []
    try:
        remote_state = bounded(args, remote, "list", lambda: list_steps(remote))
        todo: list[int] = []
        results: list[dict[str, Any]] = []
        for step in local_steps:
            if remote_state.get(step) != "committed":
                todo.append(step)
                continue
            folder = layout.step_dir(step)
            mine = bounded(args, local, "read manifest of",
                            partial(read_step_manifest, local, folder, step))
            theirs = bounded(args, remote, "read manifest of",
                              partial(read_step_manifest, remote, folder, step))
            same = mine is not None and theirs is not None and mine.save_id == theirs.save_id
            entry: dict[str, Any] = {"step": step, "status": "skipped", "url": url_of(remote, folder)}
            if not same:
                entry["note"] = "the remote holds another save of this step; kept it"
            results.append(entry)
            if not args.json:
                print(f"step {step}: already in {remote.url}"
                      + ("" if same else " (another save of it; kept)"))
        total = 0
        for step in todo:
            try:
                total += read_manifests(local, step)[0].total_bytes
            except CheckpointError:
                pass  # replicate_step reports it
        bar = _bar(args, total, "sync")
        try:
            for step in todo:
                where = url_of(remote, layout.step_dir(step))
                try:
                    res = replicate_step(local, remote, step, threads=args.threads,
                                         compression=args.compression, verify=args.verify,
                                         progress=(lambda n: bar.update(n)) if bar else None)
                except (CheckpointError, OSError) as exc:
                    failures.append(translate(exc, op="replicate", tier=remote.tier, url=where, step=step))
                    msg = clean(args, str(exc))
                    results.append({"step": step, "status": "failed", "url": where, "error": msg})
                    if bar:
                        bar.clear()
                    print(f"step {step}: FAILED to replicate to {where}: {msg}", file=sys.stderr)
                    continue
                results.append({"step": step, "status": "skipped" if res.skipped else "uploaded",
                                "url": where, "bytes_read": res.bytes_read,
                                "bytes_written": res.bytes_written,
                                "seconds": round(res.seconds, 3), "retries": res.retries})
                if not args.json:
                    if bar:
                        bar.clear()
                    verb = "already in" if res.skipped else "uploaded to"
                    print(f"step {step}: {verb} {where} ({res.bytes_written / 2**20:.1f} MiB written, "
                          f"{res.seconds:.2f} s)")
        finally:
            if bar:
                bar.close()
    finally:
        remote.close()
    results.sort(key=lambda r: r["step"])
    _emit(args, {"local": local.url, "remote": remote.url, "ok": not failures, "steps": results})
    if not args.json:
        done = sum(r["status"] == "uploaded" for r in results)
        print(f"{done} uploaded, {len(results) - done - len(failures)} already there, {len(failures)} failed")
    return exit_for(failures)


# -------------------------------------------------------------------------------------------------- pull
def _lock_local(root: str) -> int:
    """Take the rank-0 lock of a local tier root, as a manager would; ``Unavailable`` (exit 3) if a live
    manager or pull holds it."""
    try:
        return folder_lock.acquire(root, 0)
    except CheckpointLockedError:
        raise Unavailable(f"{root} is in use by a live CheckpointManager or pull (it holds the folder's "
                           "lock); stop it or pull elsewhere") from None


def _pull_file(remote: Store, local: Store, rm: RankManifest, index: int, staging: str,
               progress: Callable[[int], Any] | None) -> FileRecord:
    """Stream one remote data file into ``staging``, decompressed, hashing every byte
    (:func:`~tierckpt.tiers.stream.stream_file`; a file that does not verify is removed); the local record."""
    from ..tiers.stream import stream_file

    rec = rm.files[index]
    name = layout.plain_name(rec.name)  # the local tier's name: without an object store's fan-out tag
    w = local.open_write(join(staging, name), size_hint=rec.size)

    def sink(view: memoryview) -> None:
        w.write(view)
        if progress is not None:
            progress(len(view))

    try:
        # the remote's ranged reads kept in flight, handed over in order (a compressed file: one stream)
        stream_file(remote, rm, index, sink=sink, chunk=_CHUNK)
        w.close()
    except BaseException:
        w.abort()
        raise
    # a file an incremental step references in an earlier step's folder is carried into the pulled step's own
    return dataclasses.replace(rec, name=name, compression=None, stored_size=None, in_step=None)


def pull_step(remote: Store, local: Store, step: int, *, threads: int = 4,
              progress: Callable[[int], Any] | None = None, deadline_s: float | None = None) -> StepManifest:
    """Copy committed step ``step`` of ``remote`` into the local tier ``local`` (an ``atomic_rename`` store),
    every byte verified, committed by renaming its temporary folder. Returns the local step manifest.
    ``deadline_s``: the remote manifests' reads and size checks are retried on transient failures for at most
    that long (None: as the store does).

    Raises :class:`CheckpointNotFoundError` when ``remote`` does not hold the step committed, and
    :class:`CorruptCheckpointError` (naming the files) when its copy there does not verify; nothing becomes
    visible in ``local`` then. :class:`~tierckpt.errors.StorageError` when a store cannot be read or
    written."""
    from ..storage.commit import protocol_for
    from ..tiers.incremental import with_refs
    from ..tiers.reader import check_sizes, read_manifests

    def manifests() -> tuple[StepManifest, list[RankManifest]]:
        found = read_manifests(remote, step)
        for rm in found[1]:
            check_sizes(remote, rm)
        return found

    if deadline_s is None:
        manifest, rms = manifests()
    else:
        manifest, rms = with_deadline(manifests, deadline_s=deadline_s, what="read manifests of",
                                      tier=remote.tier, url=url_of(remote, layout.step_dir(step)))
    for rm in rms:
        if rm.save_id != manifest.save_id:
            raise CorruptCheckpointError("rank manifest belongs to another save", step=step, tier=remote.tier,
                                         path=url_of(remote, layout.step_dir(step)))
    protocol = protocol_for(local)
    staging = protocol.begin(local, step, layout.new_save_id())
    try:
        jobs = [(rm, i) for rm in rms for i in range(len(rm.files))]
        workers = max(1, min(threads, len(jobs) or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="tierckpt-pull") as pool:
            records = list(pool.map(lambda j: _pull_file(remote, local, j[0], j[1], staging, progress), jobs))
        pos = 0
        refs = []
        pulled = []
        for rm, ref in zip(rms, manifest.ranks):
            files = tuple(records[pos : pos + len(rm.files)])
            pos += len(rm.files)
            new_rm = rm if files == rm.files else dataclasses.replace(rm, files=files)
            pulled.append(new_rm)
            raw = new_rm.to_bytes() if new_rm is not rm else remote.read_bytes(
                join(layout.step_dir(step), ref.name), max_size=ref.size)
            if new_rm is rm and (len(raw) != ref.size or hashing.digest(raw).hex() != ref.checksum):
                raise CorruptCheckpointError("rank manifest changed while being pulled", step=step,
                                             tier=remote.tier,
                                             path=url_of(remote, join(layout.step_dir(step), ref.name)),
                                             bad_files=[ref.name])
            refs.append(dataclasses.replace(ref, size=len(raw), checksum=hashing.digest(raw).hex()))
            local.write_bytes(join(staging, ref.name), raw)
        out = manifest if tuple(refs) == manifest.ranks else dataclasses.replace(manifest, ranks=tuple(refs))
        out = with_refs(out, pulled)  # what was referenced is the pulled step's own now
        index = shard_index.of_copy(out)  # of the pulled references (re-sealed rank manifests differ from the remote's)
        if index is not None:
            local.write_bytes(join(staging, index[0]), index[1])
        local.write_bytes(join(staging, layout.STEP_MANIFEST), out.to_bytes())
        protocol.commit(local, staging, step)
    except BaseException:
        try:
            protocol.abort(local, staging, step)
        except Exception as exc:  # pragma: no cover - the leftover is removed by the next manager's recovery
            log.warning("step %d: removing the partial pull %s failed: %s", step, url_of(local, staging), exc)
        raise
    return out


def cmd_pull(args: argparse.Namespace) -> int:
    """Bring one step of REMOTE back into the local tier root LOCAL."""
    from ..storage.commit import read_step_manifest
    from ..tiers.reader import read_manifests

    if is_url(args.local):
        raise UsageError(f"LOCAL must be a local folder, got the URL {args.local!r}")
    if args.threads < 1:
        raise UsageError("--threads must be >= 1")
    if args.read_concurrency < 1:
        raise UsageError("--read-concurrency must be >= 1")
    remote, only = open_root(args, args.remote, tier="remote", read_concurrency=args.read_concurrency)
    step = args.step if args.step is not None else only
    if step is None:
        raise UsageError("pull needs --step N (or a step folder as REMOTE)")
    try:
        local = open_target(args, args.local, tier="local", create=True)
        fd = _lock_local(local.local_path or args.local.removeprefix("file://"))
        try:
            total = 0
            try:
                theirs = bounded(args, remote, "read manifests of", lambda: read_manifests(remote, step)[0])
                total = theirs.total_bytes
            except CheckpointNotFoundError:
                say(args, f"step {step} is not committed in {remote.url}")
                return EXIT_USAGE
            except CorruptCheckpointError:
                theirs = None  # pull_step reports the damage
            try:
                mine = read_step_manifest(local, layout.step_dir(step), step)
            except CorruptCheckpointError:
                mine = None  # a damaged local copy is what a pull repairs
            if mine is not None and theirs is not None and mine.save_id != theirs.save_id and not args.force:
                say(args, f"{url_of(local, layout.step_dir(step))} holds another save of step {step} "
                           f"(save {mine.save_id}, the remote has {theirs.save_id}); --force replaces it")
                return EXIT_USAGE
            bar = _bar(args, total, f"pull {step}")
            try:
                manifest = pull_step(remote, local, step, threads=args.threads,
                                     deadline_s=deadline_for(args, remote),
                                     progress=(lambda n: bar.update(n)) if bar else None)
            except CorruptCheckpointError as exc:
                say(args, f"step {step} in {remote.url} is corrupt, nothing pulled: {exc}")
                return EXIT_BAD
            finally:
                if bar:
                    bar.close()
        finally:
            folder_lock.release(fd)
    finally:
        remote.close()
    where = url_of(local, layout.step_dir(step))
    if args.json:
        print(json.dumps({"ok": True, "step": step, "remote": remote.url, "local": where,
                          "bytes": manifest.total_bytes, "save_id": manifest.save_id}))
    else:
        print(f"step {step}: pulled from {remote.url} into {where} "
              f"({manifest.total_bytes / 2**20:.1f} MiB, verified)")
    return EXIT_OK


# -------------------------------------------------------------------------------------------------- parser
def add_commands(sub: Any) -> None:
    """Register ``sync`` and ``pull`` on the ``tierckpt`` sub-parsers."""
    sp = sub.add_parser("sync", help="replicate committed local steps that the remote lacks (resumable)")
    sp.add_argument("local", help="local tier root (or one step folder)")
    sp.add_argument("remote", help="remote tier: a path or an fsspec URL such as s3://bucket/run")
    sp.add_argument("--threads", type=int, default=4, metavar="N", help="files uploaded in parallel (default 4)")
    sp.add_argument("--write-concurrency", type=int, default=DEFAULT_WRITE_CONCURRENCY, metavar="N",
                    help="s3:// only: parts of the uploads in flight at once "
                         f"(default {DEFAULT_WRITE_CONCURRENCY}; each holds a part in memory)")
    sp.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                    help="read the local files and write a path remote through the page cache (default: "
                         "O_DIRECT where the file system accepts it, as the manager's direct_io)")
    sp.add_argument("--compression", choices=["zstd"], default=None, help="store the remote copy compressed")
    sp.add_argument("--verify", action="store_true",
                    help="re-read and hash every uploaded file before committing")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_sync)

    sp = sub.add_parser("pull", help="bring one step of a remote tier back into a local tier root (verified)")
    sp.add_argument("remote", help="remote tier root (or one step folder): a path or an fsspec URL")
    sp.add_argument("local", help="local tier root (created if missing)")
    sp.add_argument("--step", type=int, metavar="N", help="the step to pull (needed unless REMOTE is a step folder)")
    sp.add_argument("--threads", type=int, default=4, metavar="N",
                    help="files downloaded in parallel (default 4)")
    sp.add_argument("--read-concurrency", type=int, default=8, metavar="N",
                    help="URLs: ranged reads of one file in flight (default 8; each holds an 8 MiB buffer)")
    sp.add_argument("--force", action="store_true",
                    help="replace a local copy of the step that comes from another save")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_pull)
