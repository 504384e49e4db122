"""Moving a step's files to a remote store: the per-step transfer state (retries, deadline, cancel, stall
detection, bandwidth cap) and the jobs that upload one data file or one small object under it, checked after
writing. :mod:`.uploader` replicates whole steps with them; :mod:`.sharded` uploads one rank's shard.

Invariants: every job of a step shares one :class:`Transfer`, so the first failure, the deadline or a cancel stops
them all (:func:`run_jobs` raises :class:`TransferFailed` naming the file); a job retries transient errors per
file; a file is only ever written under the name the caller gives (a staging name or the final one), and what a
job wrote is checked (sizes always, the bytes re-read and hashed with ``verify``) before it returns. A data file
goes to a store that spreads its keys (``Store.spread_keys``) under its fan-out name
(:func:`~tierckpt.format.layout.spread_name`), and the record a job returns names it so.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from .. import faults
from ..errors import CorruptCheckpointError
from ..format import layout
from ..format.manifest import FileRecord, RankManifest, file_rel
from ..storage.base import Store, join
from ..storage.retry import Cancelled, DeadlineExceeded, RetryPolicy
from .stream import FileStream

log = logging.getLogger(__name__)

_POLL_S = 0.05


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


class Mismatch(OSError):
    """What was written does not read back as what was sent (transient: the file is uploaded again)."""


class Transfer:
    """Shared state of one step's replication: stop/deadline checks, throttle, counters."""

    def __init__(self, step: int, remote: Store, retry: RetryPolicy, deadline: float | None,
                 cancel: threading.Event | None, bucket: TokenBucket | None,
                 progress: Callable[[int], Any] | None, stall_s: float | None = None,
                 on_error: Callable[[BaseException], Any] | None = None) -> None:
        self.step = step
        #: told of every failed request, retried or not (the remote's health shows it at once)
        self.on_error = on_error
        #: the last failed request's error: what a stall or a deadline reports as its cause
        self.last_error: BaseException | None = None
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

    def failed_request(self, exc: BaseException) -> None:
        """A request failed (it may be retried): remember it as the likely cause, and tell ``on_error``."""
        self.last_error = exc
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:  # a health hook never fails an upload
                log.exception("step %d: the request-failure hook raised", self.step)

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
            self.failed_request(exc)
            log.info("step %d, tier %s: %s %s failed (%s: %s); retry %d/%d in %.2fs", self.step, self.remote.tier,
                        what, url_of(self.remote, rel), type(exc).__name__, exc, k, self.retry.attempts - 1, pause)

        def attempt() -> Any:
            self.check()
            out = fn()
            self.moved()
            return out

        return self.retry.call(attempt, what=f"step {self.step}: {what} {url_of(self.remote, rel)}",
                               deadline=self.deadline, cancel=self.stop, on_retry=on_retry)


def url_of(store: Store, rel: str) -> str:
    return f"{store.url}/{rel}" if rel else store.url


class TransferFailed(Exception):
    def __init__(self, rel: str, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.rel = rel
        self.exc = exc


#: After one job of a step fails, how long the others get to notice ``ctx.stop`` before the step is aborted.
_DRAIN_S = 30.0


def _drain(ctx: Transfer, pending: set[Future]) -> None:
    """Stop the step's other jobs and let the running ones finish (bounded), so that aborting the step does not race
    a job still writing into its folder."""
    ctx.stop.set()
    for fut in pending:
        fut.cancel()
    limit = _DRAIN_S if ctx.deadline is None else max(0.0, min(_DRAIN_S, ctx.deadline - time.monotonic()))
    wait(pending, timeout=limit)


def run_jobs(pool: ThreadPoolExecutor, ctx: Transfer, jobs: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
    """Run jobs on the pool; return their results in order, or raise :class:`TransferFailed` for the first failure,
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
                raise TransferFailed(futures[fut], exc)
        if pending:
            if ctx.cancel is not None and ctx.cancel.is_set():
                raise TransferFailed(futures[next(iter(pending))], Cancelled(f"step {ctx.step}: cancelled"))
            if ctx.deadline is not None and time.monotonic() >= ctx.deadline:
                raise TransferFailed(futures[next(iter(pending))], DeadlineExceeded(
                    f"step {ctx.step}: deadline reached"))
            if ctx.stalled():  # a silent endpoint: its requests would wait out the backend's timeouts and retries
                stall = DeadlineExceeded(
                    f"step {ctx.step}: no request succeeded for {ctx.stall_s:g} s ("
                    + (f"last error: {ctx.last_error}" if ctx.last_error is not None
                       else "no answer: the remote is silent or stalled") + ")")
                stall.__cause__ = ctx.last_error  # the refused or failing request is the cause, if there was one
                raise TransferFailed(futures[next(iter(pending))], stall)
    return [f.result() for f in order]


def _upload_file(local: Store, remote: Store, ctx: Transfer, rm: RankManifest, index: int, staging: str, *,
                 chunk: int, compression: str | None, level: int, verify: bool,
                 check_size: bool = True) -> tuple[FileRecord, int, int]:
    """One attempt at one data file: stream, compress, write, check. Returns (remote record, read, written).
    ``check_size``: ask the store for the written file's size (one request; a caller that confirms every size with
    one listing later passes False)."""
    rec = rm.files[index]
    src = file_rel(rm.step, rec)
    name = layout.stored_name(rec.name, remote.spread_keys)  # on object stores: under its fan-out prefix
    dst = join(staging, name)
    compress = compression == "zstd" and rec.compression is None
    # the local bytes are read the uploader's way (page-aligned, around the page cache) and checked as they go
    src_check = FileStream(local, rm, index) if verify and rec.compression is None else None
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
            if src_check is not None:
                try:
                    src_check.feed(data)
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
        if read != expected_src or (src_check is not None and not src_check.matches()):
            raise CorruptCheckpointError("local data file does not match its manifest", step=rm.step, tier=local.tier,
                                         path=url_of(local, src), bad_files=[rec.name])
        w.close()
    except BaseException:
        w.abort()
        raise
    actual = remote.size(dst) if check_size else written
    if actual != written:
        raise Mismatch(f"{url_of(remote, dst)} is {actual} bytes after upload, {written} were sent")
    new = dataclasses.replace(rec, compression="zstd", stored_size=written) if compress else rec
    if new.name != name:
        new = dataclasses.replace(new, name=name)
    if verify:
        _verify_remote(remote, dst, rm, index, new, chunk, ctx)
    return new, read, written


def _verify_remote(remote: Store, rel: str, rm: RankManifest, index: int, rec: FileRecord, chunk: int,
                   ctx: Transfer) -> None:
    """Re-read an uploaded file (its stored form ``rec`` at ``rel``) and match its (decompressed) two-level
    checksum; :class:`Mismatch` if not (the file is uploaded again)."""
    stream = FileStream(remote, rm, index, record=rec, rel=rel)
    try:
        stream.run(chunk=chunk, check=ctx.check)  # reads in flight on object stores; a longer object fails
    except CorruptCheckpointError as exc:  # short, long, or a damaged frame
        raise Mismatch(f"{url_of(remote, rel)} does not read back intact: {exc.detail}") from None
    if not stream.matches():
        raise Mismatch(f"{url_of(remote, rel)} reads back with a different checksum")


def file_job(local: Store, remote: Store, ctx: Transfer, rm: RankManifest, index: int, staging: str, rel: str,
              chunk: int, compression: str | None, level: int, verify: bool,
              check_size: bool = True) -> Callable[[], Any]:
    return lambda: ctx.call(lambda: _upload_file(local, remote, ctx, rm, index, staging, chunk=chunk,
                                                 compression=compression, level=level, verify=verify,
                                                 check_size=check_size), "upload", rel)


def bytes_job(remote: Store, ctx: Transfer, rel: str, raw: bytes, what: str, verify: bool,
              check_size: bool = True) -> Callable[[], Any]:
    def once() -> None:
        remote.write_bytes(rel, raw)
        actual = remote.size(rel) if check_size else len(raw)
        if actual != len(raw):
            raise Mismatch(f"{url_of(remote, rel)} is {actual} bytes after upload, {len(raw)} were sent")
        if verify and remote.read_bytes(rel, max_size=len(raw)) != raw:
            raise Mismatch(f"{url_of(remote, rel)} reads back different bytes")

    return lambda: ctx.call(once, what, rel)
