"""Replication of committed steps from the local tier to the remote tier.

:func:`replicate_step` copies one committed local step to a remote store; the manager calls it from its upload
thread, ``tierckpt sync`` from the command line. Invariants:

- Only a committed, verified local step is read (its manifests' checksums and its files' sizes are checked first; a
  damaged one raises :class:`CorruptCheckpointError` naming it). The local copy is never modified.
- What is committed on the remote is never re-uploaded nor replaced: a remote ``manifest.json`` with the same
  ``save_id`` means the step is there already; one with another ``save_id`` (another run's, or an earlier save of
  a rolled-back run) raises :class:`~tierckpt.errors.StepConflictError` before anything is written.
- The remote's commit protocol is followed: data files, then rank manifests, then the step's shard index (a
  multi-rank step with distributed tensors, :func:`~tierckpt.format.shard_index.of_copy`: built from the remote
  rank manifests' references, which differ from the local ones where a data file's stored name or form does), then
  ``manifest.json`` last, then ``protocol.commit``. A step is visible on the remote only once every file it names
  is complete and checked (sizes always; re-read and hashed with ``verify=True``). On failure before
  ``manifest.json`` is written, ``protocol.abort`` removes what was written; a failure (or a stall past the
  deadline) *while* ``manifest.json`` is being written leaves the data in place, since the manifest may still
  land, and the next attempt finds either a committed step (skip) or an uncommitted one (upload again).
- On an object store (``Store.spread_keys``) each data file is stored under its fan-out name
  (:func:`~tierckpt.format.layout.spread_name`, so that the step's objects spread over many key prefixes) and the
  remote rank manifests name it so; rank manifests and ``manifest.json`` keep their names in ``step-<N>/``.
- With ``compression="zstd"`` the remote data files are zstd frames of the local files, and the remote rank manifests
  record it (``FileRecord.compression``/``stored_size``); checksums always cover the uncompressed bytes, so restore
  and verify see the same checksums in every tier. The step manifest is re-sealed with the new rank manifests' sizes
  and checksums; everything else in it is unchanged.
- Transient errors are retried per file (see :mod:`tierckpt.storage.retry`); a per-step deadline and a cancel event
  bound the whole step, even when a request hangs: the caller gets :class:`UploadError` at the deadline, and a worker
  still stuck in a request is abandoned (its late write, if any, is never named by a manifest).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

from .. import faults
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StepConflictError, UploadError
from ..format import hashing, layout, shard_index
from ..format.manifest import MAX_MANIFEST_BYTES, FileRecord, RankManifest, StepManifest
from ..storage.base import Store, join
from ..storage.commit import protocol_for, read_step_manifest
from ..storage.fsspec_store import DEFAULT_PART_SIZE
from ..storage.retry import Cancelled, DeadlineExceeded, RetryPolicy, is_transient
from .incremental import pins, with_refs
from .listing import list_remote_steps as list_remote_steps  # step listings and changes, imported from here too
from .listing import list_steps as list_steps
from .reader import check_sizes, read_manifests
from .steps import delete_step as delete_step
from .steps import set_aside as set_aside
from .transfer import (
    TokenBucket,
    Transfer,
    TransferFailed,
    bytes_job,
    file_job,
    run_jobs,
    url_of,
)

log = logging.getLogger(__name__)

#: Bytes read from the local file, compressed and written per call: also the granularity of the bandwidth cap
#: and of cancel/deadline checks. The manager's ``upload_part_mb`` and ``tierckpt sync`` default to the same size.
DEFAULT_CHUNK = DEFAULT_PART_SIZE


@dataclass(frozen=True)
class ReplicationResult:
    """What :func:`replicate_step` did. ``skipped``: the remote already held this save of the step."""

    step: int
    bytes_read: int
    bytes_written: int
    seconds: float
    files: int
    retries: int
    skipped: bool = False
    compression: str | None = None


def _read_local_step(local: Store, step: int) -> tuple[StepManifest, bytes, list[tuple[RankManifest, bytes]]]:
    """The local step's manifests, verified, with their exact bytes; data file sizes checked."""
    manifest, rms = read_manifests(local, step)  # CheckpointNotFoundError / CorruptCheckpointError
    folder = layout.step_dir(step)
    raw_step = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    if StepManifest.from_bytes(raw_step, step=step, path=url_of(local, folder)) != manifest:
        raise CorruptCheckpointError("manifest.json changed while being read", step=step, tier=local.tier,
                                     path=url_of(local, folder))
    out = []
    for ref, rm in zip(manifest.ranks, rms):
        raw = local.read_bytes(join(folder, ref.name), max_size=MAX_MANIFEST_BYTES)
        if len(raw) != ref.size or hashing.digest(raw).hex() != ref.checksum:
            raise CorruptCheckpointError("rank manifest changed while being read", step=step, tier=local.tier,
                                         path=url_of(local, join(folder, ref.name)), bad_files=[ref.name])
        if rm.save_id != manifest.save_id:
            raise CorruptCheckpointError("rank manifest belongs to another save", step=step, tier=local.tier,
                                         path=url_of(local, join(folder, ref.name)), bad_files=[ref.name])
        check_sizes(local, rm)
        out.append((rm, raw))
    return manifest, raw_step, out


def replicate_step(
    local: Store,
    remote: Store,
    step: int,
    *,
    threads: int = 4,
    part_size: int = DEFAULT_CHUNK,
    bandwidth_bytes_per_s: float | None = None,
    compression: str | None = None,
    compression_level: int = 3,
    verify: bool = False,
    retry: RetryPolicy | None = None,
    deadline_s: float | None = None,
    progress: Callable[[int], Any] | None = None,
    cancel: threading.Event | None = None,
    bucket: TokenBucket | None = None,
    stall_s: float | None = None,
    on_error: Callable[[BaseException], Any] | None = None,
) -> ReplicationResult:
    """Copy committed step ``step`` from ``local`` to ``remote`` and commit it there (see the module docstring).

    ``threads`` files go in parallel; ``part_size`` bytes are read, (compressed,) throttled and written at a time;
    ``bandwidth_bytes_per_s`` caps the bytes written per second over all threads (``bucket``, a cap shared with
    other steps, such as a manager's, replaces it: a new cap per step would let every step burst); ``compression`` is
    None or ``"zstd"``; ``verify`` re-reads and hashes every uploaded file; ``retry`` applies per file and per manifest;
    ``deadline_s`` bounds the whole step; ``progress(n)`` is called with the bytes read from the local tier as they
    go (resent bytes count again); setting ``cancel`` stops the step within a chunk's time; ``stall_s`` fails the
    step once nothing has moved for that long (no request succeeded, no chunk was handed over), even while a
    request still waits for a silent endpoint; ``on_error(exc)`` is told of every failed request, retried or not.

    Raises :class:`CheckpointNotFoundError` / :class:`CorruptCheckpointError` for a missing / damaged local step,
    :class:`UploadError` (step, file and URL in its message; the cause chained) when it cannot be replicated.
    """
    if compression not in (None, "zstd"):
        raise CheckpointError(f"unknown compression {compression!r} (None or 'zstd')", step=step, tier=remote.tier)
    if threads < 1 or part_size < 1:
        raise CheckpointError("threads and part_size must be positive", step=step, tier=remote.tier)
    t0 = time.monotonic()
    retry = retry or RetryPolicy()
    deadline = t0 + deadline_s if deadline_s is not None else None
    if bucket is None and bandwidth_bytes_per_s:
        bucket = TokenBucket(bandwidth_bytes_per_s, burst=min(part_size, bandwidth_bytes_per_s))
    ctx = Transfer(step, remote, retry, deadline, cancel, bucket, progress, stall_s, on_error)
    folder = layout.step_dir(step)

    manifest, raw_step, ranks = _read_local_step(local, step)
    n_files = sum(len(rm.files) for rm, _ in ranks)

    held = ExitStack()  # the earlier remote steps this one may reference stay while it is uploaded
    held.enter_context(pins(remote, tuple(sorted({f.in_step for rm, _r in ranks for f in rm.files
                                                  if f.in_step is not None}))))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"tierckpt-upload-{step}")
    protocol = protocol_for(remote)
    staging: str | None = None
    manifest_started = False
    try:
        try:
            existing = run_jobs(pool, ctx, [(folder, lambda: ctx.call(
                lambda: _remote_manifest(remote, folder, step), "read manifest of", folder))])[0]
            if existing is not None and existing.save_id == manifest.save_id:
                log.info("step %d, tier %s: already committed at %s (save %s); not uploading again", step,
                         remote.tier, url_of(remote, folder), manifest.save_id)
                return ReplicationResult(step, 0, 0, time.monotonic() - t0, 0, ctx.retries, skipped=True,
                                         compression=compression)
            if existing is not None:
                raise StepConflictError(
                    f"the remote holds a committed copy of this step from another save ({existing.save_id}; this "
                    f"one is {manifest.save_id}): a committed step is never replaced, so it is kept and this save "
                    f"stays in the local tier", step=step, tier=remote.tier, path=url_of(remote, folder),
                    transient=False)
            save_tag = layout.new_save_id()
            staging = run_jobs(pool, ctx, [(folder, lambda: ctx.call(
                lambda: protocol.begin(remote, step, save_tag), "prepare", folder))])[0]
            log.info("step %d, tier %s: uploading %d files (%d bytes) to %s%s", step, remote.tier, n_files,
                     manifest.total_bytes, url_of(remote, staging), f" with {compression}" if compression else "")

            shared = _remote_shares(ctx, remote, [rm for rm, _raw in ranks])
            jobs: list[tuple[str, Callable[[], Any]]] = []
            for rm, _raw in ranks:
                for i, rec in enumerate(rm.files):
                    rel = join(staging, rec.name)
                    there = shared.get((rec.in_step, layout.plain_name(rec.name), rec.checksum))
                    if there is not None:  # stored once: the remote's copy of the earlier step is referenced
                        there = dataclasses.replace(there, in_step=rec.in_step, cuts=rec.cuts)
                        jobs.append((rel, partial(_nothing_sent, there)))
                        continue
                    jobs.append((rel, file_job(local, remote, ctx, rm, i, staging, rel, part_size, compression,
                                                compression_level, verify)))
            # an uploaded file is the step's own there, also one carried over from a step the remote lacks
            results = [(rec if r == 0 and w == 0 and rec.in_step is not None
                        else dataclasses.replace(rec, in_step=None), r, w) for rec, r, w in run_jobs(pool, ctx, jobs)]
            ctx.sent()

            # rank manifests: unchanged bytes unless a file's stored form changed
            pos = 0
            rank_jobs = []
            new_refs = []
            for (rm, raw), ref in zip(ranks, manifest.ranks):
                outcomes = results[pos : pos + len(rm.files)]
                pos += len(rm.files)
                records = tuple(rec for rec, _r, _w in outcomes)
                if records != rm.files:
                    raw = dataclasses.replace(rm, files=records).to_bytes()
                    ref = dataclasses.replace(ref, size=len(raw), checksum=hashing.digest(raw).hex())
                new_refs.append(ref)
                rel = join(staging, ref.name)
                rank_jobs.append((rel, bytes_job(remote, ctx, rel, raw, "write rank manifest", verify)))
            run_jobs(pool, ctx, rank_jobs)

            remote_rms = [dataclasses.replace(rm, files=tuple(rec for rec, _r, _w in results[a:b]))
                          for (rm, _raw), a, b in _spans(ranks)]
            new_manifest = with_refs(dataclasses.replace(manifest, ranks=tuple(new_refs)), remote_rms)
            if new_manifest != manifest:
                raw_step = new_manifest.to_bytes()
            index = shard_index.of_copy(new_manifest)  # of the remote's references, before the manifest names them
            if index is not None:
                rel = join(staging, index[0])
                run_jobs(pool, ctx, [(rel, bytes_job(remote, ctx, rel, index[1], "write shard index", verify))])
            rel = join(staging, layout.STEP_MANIFEST)
            faults.point("before-remote-manifest")
            manifest_started = True
            run_jobs(pool, ctx, [(rel, bytes_job(remote, ctx, rel, raw_step, "write manifest", verify))])
            run_jobs(pool, ctx, [(folder, lambda: _commit(protocol, remote, staging, step))])
        except TransferFailed as failed:
            err = _fail(ctx, protocol, local, remote, staging, step, failed.rel, failed.exc, manifest_started)
            if err is failed.exc:
                raise err from None
            raise err from failed.exc
        except Exception as exc:  # a bug rather than a storage failure: still never leave a half-written step
            err = _fail(ctx, protocol, local, remote, staging, step, folder, exc, manifest_started)
            if err is exc:
                raise
            raise err from exc
    finally:
        ctx.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        held.close()

    bytes_read = sum(r for _rec, r, _w in results)
    bytes_written = sum(w for _rec, _r, w in results)
    seconds = time.monotonic() - t0
    log.info("step %d, tier %s: committed at %s: %d files, %d bytes read, %d written in %.2fs (%d retries)", step,
             remote.tier, url_of(remote, folder), n_files, bytes_read, bytes_written, seconds, ctx.retries)
    return ReplicationResult(step, bytes_read, bytes_written, seconds, n_files, ctx.retries, compression=compression)


def _nothing_sent(rec: FileRecord) -> tuple[FileRecord, int, int]:
    """The outcome of a file the remote holds already: its record there, nothing read, nothing written."""
    return rec, 0, 0


def _spans(ranks: list[tuple[RankManifest, bytes]]) -> list[tuple[tuple[RankManifest, bytes], int, int]]:
    """Each rank with the span of its files in the flat list of a step's files."""
    out, pos = [], 0
    for r in ranks:
        out.append((r, pos, pos + len(r[0].files)))
        pos += len(r[0].files)
    return out


def _remote_shares(ctx: Transfer, remote: Store,
                   rms: list[RankManifest]) -> dict[tuple[int | None, str, str], FileRecord]:
    """The files an incremental local step references in earlier steps that the remote holds too, committed, with
    the same name and checksum: each as the remote step's record of it (its stored form there), naming that step.
    Those are not uploaded again. A referenced file the remote lacks is uploaded into the step's own folder (carried
    over), so the remote copy never depends on a step the remote does not hold."""
    wanted: dict[int, set[tuple[str, str]]] = {}
    for rm in rms:
        for f in rm.files:
            if f.in_step is not None:
                wanted.setdefault(f.in_step, set()).add((layout.plain_name(f.name), f.checksum))
    out: dict[tuple[int | None, str, str], FileRecord] = {}
    for s, names in sorted(wanted.items()):
        try:  # retried, but not a job of the transfer: a step the remote lacks is an answer, not a failure
            found = ctx.call(partial(read_manifests, remote, s), "read manifests of", layout.step_dir(s))
        except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
            log.info("step %d, tier %s: referenced step %d not usable there (%s): its files are carried over",
                     ctx.step, remote.tier, s, exc)
            continue
        for rm in found[1]:
            for f in rm.files:  # the remote's name may carry a fan-out tag (layout.spread_name): matched without
                plain = layout.plain_name(f.name)
                if f.in_step is None and (plain, f.checksum) in names:
                    out[(s, plain, f.checksum)] = f
    return out


def _remote_manifest(remote: Store, folder: str, step: int) -> StepManifest | None:
    try:
        return read_step_manifest(remote, folder, step)
    except CorruptCheckpointError as exc:
        log.warning("step %d, tier %s: damaged manifest at %s will be replaced: %s", step, remote.tier,
                    url_of(remote, folder), exc)
        return None


def _commit(protocol: Any, remote: Store, staging: str, step: int) -> None:
    if remote.atomic_rename:
        protocol.commit(remote, staging, step)  # the rename is the commit: its failure is the step's
        return
    try:  # manifest-last: the step is committed already; this only removes an older save's files
        protocol.commit(remote, staging, step)
    except Exception as exc:
        log.warning("step %d, tier %s: committed, but cleaning up older files in %s failed: %s", step, remote.tier,
                    url_of(remote, staging), exc)


def _abort(protocol: Any, remote: Store, staging: str | None, step: int, manifest_started: bool) -> None:
    if staging is None:
        return
    if manifest_started and not remote.atomic_rename:
        log.warning("step %d, tier %s: manifest write at %s may still land; leaving the data in place", step,
                    remote.tier, url_of(remote, staging))
        return
    try:
        protocol.abort(remote, staging, step)
    except Exception as exc:
        log.warning("step %d, tier %s: removing the partial upload at %s failed (recovery will): %s", step,
                    remote.tier, url_of(remote, staging), exc)


def _fail(ctx: Transfer, protocol: Any, local: Store, remote: Store, staging: str | None, step: int, rel: str,
          exc: BaseException, manifest_started: bool) -> BaseException:
    ctx.stop.set()
    _abort(protocol, remote, staging, step, manifest_started)
    if isinstance(exc, StepConflictError) or (isinstance(exc, CorruptCheckpointError)
                                              and exc.tier == local.tier != remote.tier):
        return exc  # another save's committed step, or a damaged local copy: say so, not "upload failed"
    if isinstance(exc, Cancelled):
        why = "cancelled"
    elif isinstance(exc, DeadlineExceeded):
        why = f"deadline passed: {exc}"
    else:
        why = f"{type(exc).__name__}: {exc}" + ("" if is_transient(exc) else " (not retried)")
    url = url_of(remote, rel)
    log.info("step %d, tier %s: replication failed at %s: %s", step, remote.tier, url, why)  # the caller reports it
    return UploadError(f"cannot replicate to {remote.url}: {why} ({url})", step=step, tier=remote.tier, path=url)
