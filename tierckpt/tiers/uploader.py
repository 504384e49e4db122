"""Replication of committed steps from the local tier to the remote tier, and the remote-side helpers.

:func:`replicate_step` copies one committed local step to a remote store; the manager calls it from its upload
thread, ``tierckpt sync`` from the command line. Invariants:

- Only a committed, verified local step is read (its manifests' checksums and its files' sizes are checked first; a
  damaged one raises :class:`CorruptCheckpointError` naming it). The local copy is never modified.
- What is committed on the remote is never re-uploaded: a remote ``manifest.json`` with the same ``save_id`` means
  the step is there already.
- The remote's commit protocol is followed: data files, then rank manifests, then ``manifest.json`` last, then
  ``protocol.commit``. A step is visible on the remote only once every file it names is complete and checked (sizes
  always; re-read and hashed with ``verify=True``). On failure before ``manifest.json`` is written, ``protocol.abort``
  removes what was written; a failure (or a stall past the deadline) *while* ``manifest.json`` is being written
  leaves the data in place, since the manifest may still land, and the next attempt finds either a committed step
  (skip) or an uncommitted one (upload again).
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
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

from .. import faults
from ..errors import CheckpointError, CorruptCheckpointError, UploadError
from ..format import hashing, layout
from ..format.manifest import MAX_MANIFEST_BYTES, FileRecord, RankManifest, RankRef, StepManifest
from ..storage.base import Store, join
from ..storage.commit import protocol_for, read_step_manifest
from ..storage.fsspec_store import DEFAULT_PART_SIZE
from ..storage.readahead import ReadAhead, each
from ..storage.retry import Cancelled, DeadlineExceeded, RetryPolicy, is_transient
from .reader import check_sizes, read_manifests, segment_ends

log = logging.getLogger(__name__)

#: Bytes read from the local file, compressed and written per call: also the granularity of the bandwidth cap
#: and of cancel/deadline checks. The manager's ``upload_part_mb`` and ``tierckpt sync`` default to the same size.
DEFAULT_CHUNK = DEFAULT_PART_SIZE
_POLL_S = 0.05


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


class TokenBucket:
    """A thread-safe bandwidth cap: ``consume(n)`` returns once ``n`` more bytes fit in ``rate`` bytes/s.

    Debt-based: a caller takes its tokens at once (the balance may go negative) and sleeps off the deficit, so one
    chunk larger than the bucket still passes, and concurrent callers are served in arrival order.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"bandwidth must be positive, got {rate}")
        self.rate = float(rate)
        self.capacity = float(burst if burst is not None else rate / 10)
        self.tokens = self.capacity
        self.clock = clock
        self.last = clock()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Take ``n`` tokens; returns the seconds the caller must wait before sending them."""
        with self._lock:
            now = self.clock()
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= n
            return -self.tokens / self.rate if self.tokens < 0 else 0.0

    def consume(self, n: int, stop: threading.Event | None = None) -> None:
        delay = self.reserve(n)
        if delay > 0:
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                raise Cancelled("bandwidth wait cancelled")


class _Mismatch(OSError):
    """What was written does not read back as what was sent (transient: the file is uploaded again)."""


class _Ctx:
    """Shared state of one step's replication: stop/deadline checks, throttle, counters."""

    def __init__(self, step: int, remote: Store, retry: RetryPolicy, deadline: float | None,
                 cancel: threading.Event | None, bucket: TokenBucket | None,
                 progress: Callable[[int], Any] | None, stall_s: float | None = None) -> None:
        self.step = step
        #: the step fails once nothing moved (no request ended well) for this long, except while data files are
        #: being sent: there a slow link moves nothing visible for as long as the parts in flight take
        self.stall_s = stall_s
        self.moved_at = time.monotonic()
        self.sending = False
        self.remote = remote
        self.retry = retry
        self.deadline = deadline
        self.cancel = cancel
        self.stop = threading.Event()
        self.bucket = bucket
        self.progress = progress
        self.retries = 0
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.stop.is_set() or (self.cancel is not None and self.cancel.is_set()):
            raise Cancelled(f"step {self.step}: cancelled")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceeded(f"step {self.step}: deadline reached")

    def moved(self) -> None:
        """Something of the step got through: a request succeeded, a chunk was handed to the store."""
        self.moved_at = time.monotonic()

    def stalled(self) -> bool:
        return self.stall_s is not None and not self.sending and time.monotonic() - self.moved_at > self.stall_s

    def sent(self) -> None:
        """The data stage is over: requests are watched for a stall again."""
        self.sending = False
        self.moved()

    def throttle(self, n: int) -> None:
        if self.bucket is not None and n:
            self.bucket.consume(n, self.stop)
            self.moved()  # waiting for the cap is not a stall

    def call(self, fn: Callable[[], Any], what: str, rel: str) -> Any:
        """``fn`` with retries on transient errors, each retry logged with step, tier and URL."""

        def on_retry(k: int, exc: BaseException, pause: float) -> None:
            with self._lock:
                self.retries += 1
            log.warning("step %d, tier %s: %s %s failed (%s: %s); retry %d/%d in %.2fs", self.step, self.remote.tier,
                        what, _url(self.remote, rel), type(exc).__name__, exc, k, self.retry.attempts - 1, pause)

        def attempt() -> Any:
            self.check()
            out = fn()
            self.moved()
            return out

        return self.retry.call(attempt, what=f"step {self.step}: {what} {_url(self.remote, rel)}",
                               deadline=self.deadline, cancel=self.stop, on_retry=on_retry)


def _url(store: Store, rel: str) -> str:
    return f"{store.url}/{rel}" if rel else store.url


class _StepFailed(Exception):
    def __init__(self, rel: str, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.rel = rel
        self.exc = exc


#: After one job of a step fails, how long the others get to notice ``ctx.stop`` before the step is aborted.
_DRAIN_S = 30.0


def _drain(ctx: _Ctx, pending: set[Future]) -> None:
    """Stop the step's other jobs and let the running ones finish (bounded), so that aborting the step does not race
    a job still writing into its folder."""
    ctx.stop.set()
    for fut in pending:
        fut.cancel()
    limit = _DRAIN_S if ctx.deadline is None else max(0.0, min(_DRAIN_S, ctx.deadline - time.monotonic()))
    wait(pending, timeout=limit)


def _run_all(pool: ThreadPoolExecutor, ctx: _Ctx, jobs: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
    """Run jobs on the pool; return their results in order, or raise :class:`_StepFailed` for the first failure,
    a cancel or the deadline (without waiting for a job stuck in a request)."""
    futures: dict[Future, str] = {pool.submit(fn): rel for rel, fn in jobs}
    order = list(futures)
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
        for fut in done:
            exc = fut.exception()
            if exc is not None:
                _drain(ctx, pending)
                raise _StepFailed(futures[fut], exc)
        if pending:
            if ctx.cancel is not None and ctx.cancel.is_set():
                raise _StepFailed(futures[next(iter(pending))], Cancelled(f"step {ctx.step}: cancelled"))
            if ctx.deadline is not None and time.monotonic() >= ctx.deadline:
                raise _StepFailed(futures[next(iter(pending))], DeadlineExceeded(f"step {ctx.step}: deadline reached"))
            if ctx.stalled():  # a silent endpoint: its requests would wait out the backend's timeouts and retries
                raise _StepFailed(futures[next(iter(pending))], DeadlineExceeded(
                    f"step {ctx.step}: no progress for {ctx.stall_s:g} s (the remote is silent or stalled)"))
    return [f.result() for f in order]


def _read_local_step(local: Store, step: int) -> tuple[StepManifest, bytes, list[tuple[RankManifest, bytes]]]:
    """The local step's manifests, verified, with their exact bytes; data file sizes checked."""
    manifest, rms = read_manifests(local, step)  # CheckpointNotFoundError / CorruptCheckpointError
    folder = layout.step_dir(step)
    raw_step = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    if StepManifest.from_bytes(raw_step, step=step, path=_url(local, folder)) != manifest:
        raise CorruptCheckpointError("manifest.json changed while being read", step=step, tier=local.tier,
                                     path=_url(local, folder))
    out = []
    for ref, rm in zip(manifest.ranks, rms):
        raw = local.read_bytes(join(folder, ref.name), max_size=MAX_MANIFEST_BYTES)
        if len(raw) != ref.size or hashing.digest(raw).hex() != ref.checksum:
            raise CorruptCheckpointError("rank manifest changed while being read", step=step, tier=local.tier,
                                         path=_url(local, join(folder, ref.name)), bad_files=[ref.name])
        if rm.save_id != manifest.save_id:
            raise CorruptCheckpointError("rank manifest belongs to another save", step=step, tier=local.tier,
                                         path=_url(local, join(folder, ref.name)), bad_files=[ref.name])
        check_sizes(local, rm)
        out.append((rm, raw))
    return manifest, raw_step, out


def _upload_file(local: Store, remote: Store, ctx: _Ctx, rm: RankManifest, index: int, staging: str, *,
                 chunk: int, compression: str | None, level: int, verify: bool) -> tuple[FileRecord, int, int]:
    """One attempt at one data file: stream, compress, write, check. Returns (remote record, read, written)."""
    rec = rm.files[index]
    src = join(layout.step_dir(rm.step), rec.name)
    dst = join(staging, rec.name)
    compress = compression == "zstd" and rec.compression is None
    src_hash = hashing.SegmentHasher(segment_ends(rm, index)) if verify and rec.compression is None else None
    cobj = None
    if compress:
        import zstandard

        cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=rec.size)
    expected_src = rec.stored_size if rec.compression else rec.size
    read = written = 0
    w = remote.open_write(dst, size_hint=None if compress else expected_src)
    try:
        for data in local.iter_chunks(src, chunk, reuse=True):  # each chunk is done with before the next
            ctx.check()
            read += len(data)
            if src_hash is not None:
                try:
                    src_hash.feed(data)
                except ValueError:
                    pass  # longer than the manifest says: caught by the size check below
            if ctx.progress is not None:
                ctx.progress(len(data))
            out = cobj.compress(data) if cobj is not None else data
            if out:
                ctx.throttle(len(out))
                ctx.sending = True
                w.write(out)
                written += len(out)
                faults.point("mid-upload")
        if cobj is not None:
            out = cobj.flush()
            ctx.throttle(len(out))
            w.write(out)
            written += len(out)
        if read != expected_src or (src_hash is not None and src_hash.file_checksum() != rec.checksum):
            raise CorruptCheckpointError("local data file does not match its manifest", step=rm.step, tier=local.tier,
                                         path=_url(local, src), bad_files=[rec.name])
        w.close()
    except BaseException:
        w.abort()
        raise
    actual = remote.size(dst)
    if actual != written:
        raise _Mismatch(f"{_url(remote, dst)} is {actual} bytes after upload, {written} were sent")
    new = dataclasses.replace(rec, compression="zstd", stored_size=written) if compress else rec
    if verify:
        _verify_remote(remote, dst, rm, index, new, chunk, ctx)
    return new, read, written


def _verify_remote(remote: Store, rel: str, rm: RankManifest, index: int, rec: FileRecord, chunk: int,
                   ctx: _Ctx) -> None:
    """Re-read an uploaded file and match its (decompressed) two-level checksum; :class:`_Mismatch` if not."""
    seg = hashing.SegmentHasher(segment_ends(rm, index))
    total = 0
    try:
        if rec.compression == "zstd":
            import zstandard

            with remote.open_read(rel) as f:
                reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=chunk)
                while True:
                    ctx.check()
                    data = reader.read(chunk)
                    if not data:
                        break
                    total += len(data)
                    seg.feed(data)
        else:  # one byte more than the record: a longer object fails the segments; reads in flight on object stores
            with ReadAhead(partial(remote.readinto, rel), 0, rec.size + 1, chunk=chunk, window=remote.read_concurrency,
                           check=ctx.check) as chunks:
                for _, view in chunks:
                    total += len(view)
                    seg.feed(view)
    except (ValueError, _zstd_error()) as exc:  # more bytes than the segments cover, or a damaged frame
        raise _Mismatch(f"{_url(remote, rel)} does not read back intact: {exc}") from None
    if total != rec.size or seg.file_checksum() != rec.checksum:
        raise _Mismatch(f"{_url(remote, rel)} reads back with a different checksum")


def _zstd_error() -> type[BaseException]:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a dependency
        return ValueError
    return zstandard.ZstdError


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
) -> ReplicationResult:
    """Copy committed step ``step`` from ``local`` to ``remote`` and commit it there (see the module docstring).

    ``threads`` files go in parallel; ``part_size`` bytes are read, (compressed,) throttled and written at a time;
    ``bandwidth_bytes_per_s`` caps the bytes written per second over all threads (``bucket``, a cap shared with
    other steps, such as a manager's, replaces it: a new cap per step would let every step burst); ``compression`` is None or
    ``"zstd"``; ``verify`` re-reads and hashes every uploaded file; ``retry`` applies per file and per manifest;
    ``deadline_s`` bounds the whole step; ``progress(n)`` is called with the bytes read from the local tier as they
    go (resent bytes count again); setting ``cancel`` stops the step within a chunk's time; ``stall_s`` fails the
    step once nothing has moved for that long (no request succeeded, no chunk was handed over), even while a
    request still waits for a silent endpoint.

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
    ctx = _Ctx(step, remote, retry, deadline, cancel, bucket, progress, stall_s)
    folder = layout.step_dir(step)

    manifest, raw_step, ranks = _read_local_step(local, step)
    n_files = sum(len(rm.files) for rm, _ in ranks)

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"tierckpt-upload-{step}")
    protocol = protocol_for(remote)
    staging: str | None = None
    manifest_started = False
    try:
        try:
            existing = _run_all(pool, ctx, [(folder, lambda: ctx.call(
                lambda: _remote_manifest(remote, folder, step), "read manifest of", folder))])[0]
            if existing is not None and existing.save_id == manifest.save_id:
                log.info("step %d, tier %s: already committed at %s (save %s); not uploading again", step,
                         remote.tier, _url(remote, folder), manifest.save_id)
                return ReplicationResult(step, 0, 0, time.monotonic() - t0, 0, ctx.retries, skipped=True,
                                         compression=compression)
            save_tag = layout.new_save_id()
            staging = _run_all(pool, ctx, [(folder, lambda: ctx.call(
                lambda: protocol.begin(remote, step, save_tag), "prepare", folder))])[0]
            log.info("step %d, tier %s: uploading %d files (%d bytes) to %s%s", step, remote.tier, n_files,
                     manifest.total_bytes, _url(remote, staging), f" with {compression}" if compression else "")

            jobs = []
            for rm, _raw in ranks:
                for i, rec in enumerate(rm.files):
                    rel = join(staging, rec.name)
                    jobs.append((rel, _file_job(local, remote, ctx, rm, i, staging, rel, part_size, compression,
                                                compression_level, verify)))
            results = _run_all(pool, ctx, jobs)
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
                    ref = RankRef(ref.rank, ref.name, len(raw), hashing.digest(raw).hex())
                new_refs.append(ref)
                rel = join(staging, ref.name)
                rank_jobs.append((rel, _bytes_job(remote, ctx, rel, raw, "write rank manifest", verify)))
            _run_all(pool, ctx, rank_jobs)

            if tuple(new_refs) != manifest.ranks:
                raw_step = dataclasses.replace(manifest, ranks=tuple(new_refs)).to_bytes()
            rel = join(staging, layout.STEP_MANIFEST)
            faults.point("before-remote-manifest")
            manifest_started = True
            _run_all(pool, ctx, [(rel, _bytes_job(remote, ctx, rel, raw_step, "write manifest", verify))])
            _run_all(pool, ctx, [(folder, lambda: _commit(protocol, remote, staging, step))])
        except _StepFailed as failed:
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

    bytes_read = sum(r for _rec, r, _w in results)
    bytes_written = sum(w for _rec, _r, w in results)
    seconds = time.monotonic() - t0
    log.info("step %d, tier %s: committed at %s: %d files, %d bytes read, %d written in %.2fs (%d retries)", step,
             remote.tier, _url(remote, folder), n_files, bytes_read, bytes_written, seconds, ctx.retries)
    return ReplicationResult(step, bytes_read, bytes_written, seconds, n_files, ctx.retries, compression=compression)


def _file_job(local: Store, remote: Store, ctx: _Ctx, rm: RankManifest, index: int, staging: str, rel: str,
              chunk: int, compression: str | None, level: int, verify: bool) -> Callable[[], Any]:
    return lambda: ctx.call(lambda: _upload_file(local, remote, ctx, rm, index, staging, chunk=chunk,
                                                 compression=compression, level=level, verify=verify), "upload", rel)


def _bytes_job(remote: Store, ctx: _Ctx, rel: str, raw: bytes, what: str, verify: bool) -> Callable[[], Any]:
    def once() -> None:
        remote.write_bytes(rel, raw)
        actual = remote.size(rel)
        if actual != len(raw):
            raise _Mismatch(f"{_url(remote, rel)} is {actual} bytes after upload, {len(raw)} were sent")
        if verify and remote.read_bytes(rel, max_size=len(raw)) != raw:
            raise _Mismatch(f"{_url(remote, rel)} reads back different bytes")

    return lambda: ctx.call(once, what, rel)


def _remote_manifest(remote: Store, folder: str, step: int) -> StepManifest | None:
    try:
        return read_step_manifest(remote, folder, step)
    except CorruptCheckpointError as exc:
        log.warning("step %d, tier %s: damaged manifest at %s will be replaced: %s", step, remote.tier,
                    _url(remote, folder), exc)
        return None


def _commit(protocol: Any, remote: Store, staging: str, step: int) -> None:
    if remote.atomic_rename:
        protocol.commit(remote, staging, step)  # the rename is the commit: its failure is the step's
        return
    try:  # manifest-last: the step is committed already; this only removes an older save's files
        protocol.commit(remote, staging, step)
    except Exception as exc:
        log.warning("step %d, tier %s: committed, but cleaning up older files in %s failed: %s", step, remote.tier,
                    _url(remote, staging), exc)


def _abort(protocol: Any, remote: Store, staging: str | None, step: int, manifest_started: bool) -> None:
    if staging is None:
        return
    if manifest_started and not remote.atomic_rename:
        log.warning("step %d, tier %s: manifest write at %s may still land; leaving the data in place", step,
                    remote.tier, _url(remote, staging))
        return
    try:
        protocol.abort(remote, staging, step)
    except Exception as exc:
        log.warning("step %d, tier %s: removing the partial upload at %s failed (recovery will): %s", step,
                    remote.tier, _url(remote, staging), exc)


def _fail(ctx: _Ctx, protocol: Any, local: Store, remote: Store, staging: str | None, step: int, rel: str,
          exc: BaseException, manifest_started: bool) -> BaseException:
    ctx.stop.set()
    _abort(protocol, remote, staging, step, manifest_started)
    if isinstance(exc, CorruptCheckpointError) and exc.tier == local.tier != remote.tier:
        return exc  # the local copy is damaged: say so, not "upload failed"
    if isinstance(exc, Cancelled):
        why = "cancelled"
    elif isinstance(exc, DeadlineExceeded):
        why = f"deadline passed: {exc}"
    else:
        why = f"{type(exc).__name__}: {exc}" + ("" if is_transient(exc) else " (not retried)")
    url = _url(remote, rel)
    log.error("step %d, tier %s: replication failed at %s: %s", step, remote.tier, url, why)
    return UploadError(f"cannot replicate to {remote.url}: {why} ({url})", step=step, tier=remote.tier, path=url)


# --- reading and managing steps on a store --------------------------------------------------------------------------
def list_steps(store: Store) -> dict[int, str]:
    """Every step a store holds, with its state: ``"committed"`` (a verified ``manifest.json``), ``"corrupt"`` (a
    ``manifest.json`` that does not verify) or ``"incomplete"`` (no manifest: an upload in progress or a crash's
    leftover, including ``.tmp-`` folders of rename-commit stores)."""
    names = store.list("")
    folders = {step: name for name in names if (step := layout.parse_step_dir(name)) is not None}

    def state(item: tuple[int, str]) -> str:
        try:
            return "committed" if read_step_manifest(store, item[1], item[0]) is not None else "incomplete"
        except CorruptCheckpointError:
            return "corrupt"

    # one manifest read per step, issued together on an object store
    out = dict(zip(folders, each(state, list(folders.items()), concurrency=store.read_concurrency)))
    for name in names:  # temporary folders of rename-commit stores: an upload in progress or a leftover
        final = layout.parse_tmp_dir(name)
        tmp_step = None if final is None else layout.parse_step_dir(final)
        if tmp_step is not None:
            out.setdefault(tmp_step, "incomplete")
    return dict(sorted(out.items()))


#: The remote tier's listing; the same function serves every store.
list_remote_steps = list_steps


def set_aside(store: Store, step: int) -> None:
    """Make committed ``step`` of ``store`` stop being a checkpoint, keeping its data (a rollback).

    Rename-commit stores: the folder becomes ``aside-step-<N>-<id>`` in one atomic rename. Object stores:
    ``manifest.json`` is copied to ``manifest.aside.json`` and then removed (the folder is then an uncommitted
    leftover that ``tierckpt prune --leftovers`` removes)."""
    folder = layout.step_dir(step)
    if store.atomic_rename:
        if store.exists(folder):
            store.replace_dir(folder, layout.aside_dir(folder))
            store.sync_dir("")
    else:
        manifest = join(folder, layout.STEP_MANIFEST)
        try:
            raw = store.read_bytes(manifest, max_size=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return
        store.write_bytes(join(folder, layout.ASIDE_MANIFEST), raw)
        store.remove(manifest)
    log.warning("step %d, tier %s: set aside at %s (rollback): no longer a checkpoint, data kept", step, store.tier,
                _url(store, folder))


def delete_step(store: Store, step: int) -> None:
    """Remove a step from a store (retention) so that it stops being a checkpoint before any of its data goes.

    POSIX stores: the folder is renamed to a ``.trash-`` name in one atomic step (start-up recovery removes what a
    crash leaves of it). Object stores: ``manifest.json`` first (a crash half-way leaves an incomplete folder, never
    a corrupt checkpoint), then the rest."""
    folder = layout.step_dir(step)
    if store.atomic_rename:
        if not store.exists(folder):
            return
        trash = layout.trash_dir(folder)
        store.replace_dir(folder, trash)
        store.sync_dir("")
        faults.point("retention")
        store.remove(trash)
        log.info("step %d, tier %s: deleted %s", step, store.tier, _url(store, folder))
        return
    store.remove(join(folder, layout.STEP_MANIFEST))
    try:
        store.sync_dir(folder)
    except FileNotFoundError:
        pass
    faults.point("retention")
    store.remove(folder)
    store.sync_dir("")
    log.info("step %d, tier %s: deleted %s", step, store.tier, _url(store, folder))
