"""Uploads to S3 with several parts of a file in flight (the remote tier's data files on ``s3://``).

Why: s3fs's buffered file sends a multipart upload's parts one after another, and each ``upload_part`` waits for
its whole transfer and the reply before the caller's next bytes are even read. One connection rarely gets a node's
bandwidth to S3, and a step's last and largest file then uploads alone on one.

How (S3's multipart API through s3fs's ``call_s3``, which adds the filesystem's ``s3_additional_kwargs``, such as
server-side encryption, to every request and retries transient errors):

1. :meth:`S3MultipartStream.write` buffers bytes up to the store's part size (``bytes`` handed in whole are kept,
   not copied). When a part is full, the multipart upload is created (on the first part) and the part goes to the
   store's :class:`PartUploads`, whose threads send it while the caller reads and writes the next one;
2. :meth:`S3MultipartStream.close` sends the rest as the last part, waits for every part and completes the upload
   with the parts in order. A file smaller than one part is a single ``put_object`` instead;
3. a failed part is raised by the stream's next ``write`` or ``close``. Any failure, and :meth:`~S3MultipartStream
   .abort`, aborts the multipart upload, so that no parts linger (S3 bills them until then).

Invariants: at most ``write_concurrency`` parts of one store are in memory beyond the streams' filling buffers
(a permit is taken before a part is handed over and given back when its request has ended, cancelled or not); a
part's bytes are never changed after they are handed over; the object appears under its name only at the
completion (S3's guarantee), and an aborted or failed file whose completion may have reached S3 is removed; no part
request outlives the stream's ``close()`` or ``abort()``. A stream belongs to the thread that writes it (the
uploader's file thread); only its parts run elsewhere. Closing the store refuses new parts at once and does not
wait for those in flight: their streams do.
"""

from __future__ import annotations

import datetime
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import StorageError
from .base import WriteStream

log = logging.getLogger(__name__)

#: S3 numbers a multipart upload's parts 1 to 10,000.
MAX_PARTS = 10_000
#: Parts of one store's uploads in flight at once (their bytes in memory): at the manager's 16 MiB parts, 128 MiB.
#: Against 4 parts of 64 MiB (the earlier defaults: twice the memory), 8 of 16 MiB uploaded a 0.25 GiB step
#: to moto in 0.75x and 0.63x the time under an emulated 30 and 10 MB/s per connection (docs/benchmarks.md).
DEFAULT_WRITE_CONCURRENCY = 8


def part_size_for(part_size: int, size_hint: int | None) -> int:
    """The part size for a file of ``size_hint`` bytes: ``part_size``, or, where that would take more than S3's
    :data:`MAX_PARTS` parts, the smallest whole number of MiB that does not (a 200 GiB file at 16 MiB parts gets
    21 MiB parts). Without a hint the file may still run out of part numbers; it then fails naming the option."""
    if size_hint is None or size_hint <= part_size * MAX_PARTS:
        return part_size
    mib = 1 << 20
    return -(-size_hint // (MAX_PARTS * mib)) * mib


def supports_parallel_parts(fs: Any, scheme: str) -> bool:
    """Whether ``fs`` is s3fs-like: it signs and sends single S3 requests (``call_s3``) and splits paths."""
    return scheme in ("s3", "s3a") and callable(getattr(fs, "call_s3", None)) and callable(
        getattr(fs, "split_path", None))


def invalidate(fs: Any, path: str) -> None:
    """Drop ``path`` and its folder from ``fs``'s listing cache, if it keeps one (after every write and removal)."""
    try:
        fs.invalidate_cache(path)
        fs.invalidate_cache(fs._parent(path))
    except Exception:  # pragma: no cover - a cache that cannot be invalidated is only a missed optimisation
        pass


def remove_quietly(fs: Any, path: str, tier: str, url: str) -> None:
    """Remove an aborted upload's object if it became visible; a failure is only logged (the upload is being
    thrown away, and the step folder's cleanup removes what remains)."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning("tier %s: removing aborted %s failed: %s", tier, url, exc)
    invalidate(fs, path)


class PartUploads:
    """A store's threads for sending parts, and the permits that bound the parts in memory.

    Thread-safe; threads are started on first use and stopped by :meth:`close` (the store's ``close``).
    """

    def __init__(self, concurrency: int, tier: str) -> None:
        self.concurrency = concurrency
        self._permits = threading.BoundedSemaphore(concurrency)
        self._tier = tier
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn`` on an upload thread, once fewer than ``concurrency`` parts are in flight (blocks until then)."""
        self._permits.acquire()
        try:
            with self._lock:
                if self._closed:
                    raise StorageError("store is closed: no more uploads", tier=self._tier)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"tierckpt-{self._tier}-part")
                fut = self._pool.submit(fn, *args, **kwargs)
        except BaseException:
            self._permits.release()
            raise
        fut.add_done_callback(lambda _: self._permits.release())  # also when cancelled before it ran
        return fut

    def close(self) -> None:
        """Refuse new parts and let the threads end after the parts they are sending; returns at once (each
        stream's own ``close()``/``abort()`` waits for its parts, so a manager's ``close(timeout=)`` is not held
        up by a stalled request here)."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class S3MultipartStream(WriteStream):
    """One object uploaded as a multipart upload with parts in flight (see the module docstring)."""

    def __init__(self, fs: Any, path: str, *, part_size: int, uploads: PartUploads, tier: str, url: str) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size = part_size
        self.uploads = uploads
        self.tier = tier
        self.url = url
        self._chunks: list[bytes] = []
        self._filled = 0
        self._upload_id: str | None = None
        self._checksum_key = "ChecksumSHA256"
        self._parts: list[Future[dict[str, Any]]] = []
        self._done = False
        self._aborted = False
        self._finishing = False  # the completion (or the single PUT) was sent: the object may exist

    # --- WriteStream ---------------------------------------------------------------------------------------------
    def write(self, data: memoryview | bytes) -> None:
        if self._done:
            raise StorageError("write to a closed upload", tier=self.tier, path=self.url)
        self._raise_failed()
        whole = type(data) is bytes
        view = memoryview(data).cast("B") if not whole else memoryview(data)
        while len(view):
            room = self.part_size - self._filled
            if whole and not self._filled and len(view) <= room:
                piece = data if len(view) == len(data) else bytes(view)  # the caller's bytes object, kept as is
            else:
                piece = bytes(view[:room])
            self._chunks.append(piece)  # type: ignore[arg-type]
            self._filled += len(piece)
            view = view[len(piece):]
            if self._filled >= self.part_size:
                self._send()

    def close(self) -> None:
        if self._aborted:
            raise StorageError("close() of an aborted upload", tier=self.tier, path=self.url)
        if self._done:
            return
        try:
            self._raise_failed()
            if self._upload_id is None:  # smaller than one part: one PUT
                body = self._take()
                self._finishing = True
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body)
            else:
                if self._filled:
                    self._send()
                wait(self._parts)
                self._raise_failed()  # the first failed part, in part order
                parts = [f.result() for f in self._parts]
                self._finishing = True
                self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._done = True
            self._parts = []  # their results hold nothing large, but nothing needs them any more
        except BaseException:
            self.abort()
            raise
        finally:
            invalidate(self.fs, self.path)

    def abort(self) -> None:
        """Discard the file: wait for the parts in flight, abort the multipart upload, and remove the object if a
        completion may have reached S3. Like every method here, for the thread that writes the stream."""
        if self._done:
            return
        self._done = self._aborted = True
        self._chunks, self._filled = [], 0
        for f in self._parts:
            f.cancel()
        wait(self._parts)  # no request may still be sending after this returns
        # a failed part's exception holds its frame, and so its bytes, in a reference cycle: drop it now
        self._parts = []
        if self._upload_id is not None:
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            except Exception as exc:  # the upload is being thrown away; S3's lifecycle rules remove what remains
                log.warning("tier %s: aborting the multipart upload of %s failed: %s", self.tier, self.url, exc)
        if self._finishing:  # e.g. a completion that S3 carried out but whose reply was lost
            remove_quietly(self.fs, self.path, self.tier, self.url)
        else:
            invalidate(self.fs, self.path)

    # --- internals -----------------------------------------------------------------------------------------------
    def _take(self) -> bytes:
        chunks, self._chunks, self._filled = self._chunks, [], 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _send(self) -> None:
        if self.uploads.closed:
            raise StorageError("store is closed: no more uploads", tier=self.tier, path=self.url)
        if self._upload_id is None:
            out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self._upload_id = out["UploadId"]
            # an upload created with a checksum algorithm (the user's s3_additional_kwargs) must name each part's
            # checksum of it at completion; s3fs forwards a SHA-256 one when a part's reply has it, and so do we
            algo = out.get("ChecksumAlgorithm")
            self._checksum_key = f"Checksum{algo}" if algo else "ChecksumSHA256"
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise StorageError(f"more than S3's {MAX_PARTS} parts of {self.part_size >> 20} MiB in one file: raise "
                               "the part size (upload_part_mb) or lower the file size (file_size_mb)", tier=self.tier,
                               path=self.url)
        self._parts.append(self.uploads.submit(self._upload_part, number, self._take()))

    def _upload_part(self, number: int, body: bytes) -> dict[str, Any]:
        out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                              PartNumber=number, Body=body)
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if self._checksum_key in out:
            part[self._checksum_key] = out[self._checksum_key]
        return part

    def _raise_failed(self) -> None:
        """Raise the first failed part's exception (see :func:`_reraise` for why no local may keep its future)."""
        failed = next((f for f in self._parts if f.done() and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            try:
                _reraise(failed)
            finally:
                failed = None


def unfinished_uploads(fs: Any, root: str, *, page_size: int = 1000,
                       with_start: bool = False) -> list[tuple[Any, ...]]:
    """(bucket, key, upload id) of every multipart upload in progress under folder ``root`` (``bucket/prefix``),
    all pages of S3's listing (``page_size`` uploads a request, S3's most). ``with_start``: a fourth element, when
    the upload was started (seconds since the epoch; None if S3 does not say)."""
    bucket, prefix, _ = fs.split_path(root)
    prefix = prefix.rstrip("/") + "/" if prefix else ""  # run-4/ must not match run-42/
    found: list[tuple[Any, ...]] = []
    markers: dict[str, str] = {}
    while True:
        out = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, MaxUploads=page_size, **markers)
        found += [(bucket, u["Key"], u["UploadId"], timestamp({"Initiated": u.get("Initiated")})) if with_start
                  else (bucket, u["Key"], u["UploadId"]) for u in out.get("Uploads", [])]
        if not out.get("IsTruncated"):
            return found
        markers = {"KeyMarker": out["NextKeyMarker"], "UploadIdMarker": out["NextUploadIdMarker"]}


def timestamp(info: dict[str, Any]) -> float | None:
    """A modification or start time (seconds since the epoch) in a backend's ``info`` dict, whatever the backend
    calls it (s3fs ``LastModified``, S3's ``Initiated``, a local ``mtime``, memory ``created``, gcsfs
    ``updated``); None if it has none."""
    for key in ("LastModified", "Initiated", "mtime", "last_modified", "updated", "created", "timeCreated"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return (value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)).timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        try:
            parsed = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            continue
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


def _reraise(failed: Future[Any]) -> None:
    """Raise a failed part's exception without a frame of ours holding its future: the exception's traceback holds
    the part's frame and bytes, and a future held by a frame in that traceback would keep them in a cycle that only
    the garbage collector frees (a part, 16 MiB by default, per failed attempt)."""
    exc = failed.exception()
    try:
        raise exc  # type: ignore[misc]
    finally:
        exc = failed = None  # type: ignore[assignment]


__all__ = ["DEFAULT_WRITE_CONCURRENCY", "PartUploads", "S3MultipartStream", "invalidate", "part_size_for",
           "remove_quietly", "supports_parallel_parts", "timestamp", "unfinished_uploads"]
