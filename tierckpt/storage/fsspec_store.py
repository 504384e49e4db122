"""Stores on anything fsspec reaches: object stores (``s3://``, ``gs://``, ``az://``), ``memory://``, and the rest.

Invariants and choices:

- ``atomic_rename`` is False: object stores cannot rename a folder atomically, so steps are committed with
  :class:`~tierckpt.storage.commit.ManifestLastCommit` (data first, ``manifest.json`` last; a whole-object PUT is
  atomic on S3/GCS/Azure). ``local_path`` is None: callers never bypass the store with OS calls.
- ``spread_keys`` is True: data files are stored under names that start with a fan-out tag, so a step's objects
  spread over 256 key prefixes (object stores limit request rates per prefix; docs/format.md, section 14).
- Folders are implicit on object stores: ``makedirs`` may create nothing, a folder "exists" once a file is in it,
  and :meth:`FsspecStore.list` of a missing folder is an empty list.
- ``open_write`` streams: bytes are buffered up to ``part_size`` and sent as parts (a file larger than one part
  becomes a multipart upload). On S3 up to ``write_concurrency`` parts of the store's uploads are in flight at
  once (:mod:`.s3upload`); elsewhere, and with ``write_concurrency=1``, the backend's buffered file sends them
  one after another. ``close()`` returns once the object is complete (the final PUT or the multipart
  completion); ``abort()`` discards the upload (``discard()`` aborts an S3 multipart upload) and removes whatever
  became visible, so an aborted file never lingers under its name.
- Reads are stateless ranged reads (``cat_file(path, start=, end=)``), so any number of threads may read the same
  file at once (fsspec's ``memory://`` hands every opener the same file object, which is not thread-safe). Readers
  keep ``read_concurrency`` of them in flight per file (:mod:`.readahead`; default
  :data:`DEFAULT_READ_CONCURRENCY`), because each is a request that waits a round trip before its first byte.
- Listings are never served from a cache (``use_listings_cache=False``, a fresh filesystem instance per store, and
  invalidation after every write), so a commit made by another process is seen at once.
- Messages and logs show :attr:`FsspecStore.url` only: the URL without any ``user:password@`` part, and never the
  ``storage_options`` (they may hold keys).
- Every backend failure leaves a method as a :class:`~tierckpt.errors.StorageError` (or ``FileNotFoundError`` for a
  missing file) naming the operation and URL, with ``transient`` set (:mod:`.failures`).
- A bucket is never created: on object stores ``makedirs`` writes nothing (folders are implicit), so a mistyped
  bucket fails with an access error instead of creating a new one. ``create_bucket=True`` creates a missing one.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import re
import socket
import time
import urllib.parse
from typing import Any, BinaryIO

from ..errors import CheckpointError, StorageError
from .base import Store, WriteStream, join
from .failures import translated
from .s3upload import (
    DEFAULT_WRITE_CONCURRENCY,
    PartUploads,
    S3MultipartStream,
    invalidate,
    part_size_for,
    remove_quietly,
    supports_parallel_parts,
    timestamp,
    unfinished_uploads,
)

log = logging.getLogger(__name__)

#: Bytes buffered per part of a streamed upload. S3 wants >= 5 MiB per part (except the last) and at most 10,000
#: parts, so 16 MiB allows objects up to ~156 GiB; raise it for bigger files.
DEFAULT_PART_SIZE = 16 << 20
#: Ranged reads of one file kept in flight by a reader (``read_concurrency``): each ranged GET waits a round trip
#: before its first byte and one connection rarely gets a node's bandwidth. 8 x 8 MiB chunks: 64 MiB in flight a file.
DEFAULT_READ_CONCURRENCY = 8
#: S3 connections per read in flight: files read at once (a manager's 2 io threads, the CLI's 4 files at a time)
#: times ``read_concurrency`` each, so that reads in flight do not queue for a connection (8 -> a pool of 32).
POOL_PER_READ = 4
#: S3's smallest part (every part of a multipart upload but the last); smaller parts go through the backend's file.
S3_MIN_PART = 5 << 20
#: Seconds one request may wait for an answer where the backend lets us set it (s3fs: botocore's read timeout);
#: connecting gets at most :data:`CONNECT_TIMEOUT_S`. With :data:`BACKEND_ATTEMPTS` tries by botocore and none more
#: by s3fs, a request to a silent endpoint ends within a minute, not the quarter hour of the backends' defaults;
#: callers that must not wait that long bound their calls further (:func:`tierckpt.storage.failures.bounded`).
DEFAULT_REQUEST_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 5.0
#: Tries per request by botocore (its "standard" mode retries throttling, connection errors and timeouts, with
#: backoff); s3fs's own loop around it, which retries the same errors, is cut to one try.
BACKEND_ATTEMPTS = 3
#: Schemes whose folders are implicit: ``makedirs`` writes nothing there (and so never creates a bucket).
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci"})

#: URL scheme -> the package that implements it, for an actionable message when it is missing.
_BACKEND_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
    "oci": "ocifs",
    "hdfs": "pyarrow",
    "webhdfs": "fsspec",
    "sftp": "paramiko",
    "ssh": "paramiko",
}

_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """The URL without a ``user:secret@`` part, for messages and logs."""
    return _USERINFO_RE.sub(r"\1", url)


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


class _FsspecWriteStream(WriteStream):
    """One object being uploaded through an fsspec file opened for writing."""

    def __init__(self, store: FsspecStore, rel: str, path: str) -> None:
        self.store = store
        self.rel = rel
        self.path = path
        self.f = store.fs.open(path, "wb", block_size=store.part_size)
        self.written = 0
        self.done = False

    def write(self, data: memoryview | bytes) -> None:
        if self.done:
            raise StorageError("write to a closed upload", tier=self.store.tier, path=self.store.display(self.rel))
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.f.write(view)
        self.written += len(view)

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.f.close()  # the final part / the one-shot PUT / the multipart completion
        except BaseException:
            self._discard()
            raise
        finally:
            self.store._invalidate(self.path)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self._discard()

    def _discard(self) -> None:
        f = self.f
        discard = getattr(f, "discard", None)
        try:
            if callable(discard) and hasattr(f, "buffer"):
                # fsspec buffered files (s3fs, gcsfs, adlfs): abort the multipart upload, drop the buffer, and mark
                # the file closed so that neither close() nor __del__ ever completes the upload.
                discard()
                f.closed = True
            else:
                f.close()
        except Exception as exc:  # the upload is being thrown away; a failure to discard it is only logged
            log.warning("tier %s: discarding upload %s failed: %s", self.store.tier, self.store.display(self.rel), exc)
        remove_quietly(self.store.fs, self.path, self.store.tier, self.store.display(self.rel))


class _RangeReader(io.RawIOBase):
    """A sequential, seekable reader made of ranged reads: thread-safe on every backend, no shared file object."""

    def __init__(self, store: FsspecStore, rel: str) -> None:
        super().__init__()
        self.store = store
        self.rel = rel
        self.size = store.size(rel)  # FileNotFoundError now rather than on the first read
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if not len(view) or self.pos >= self.size:
            return 0
        n = self.store.readinto(self.rel, self.pos, view[: self.size - self.pos])
        self.pos += n
        return n


class FsspecStore(Store):
    """A tier's root on any fsspec filesystem; see the module docstring for the guarantees."""

    atomic_rename = False
    local_path = None
    parallel_writes = True
    #: request rates are limited per key prefix (S3: 3,500 writes and 5,500 reads per second)
    spread_keys = True

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        tier: str = "remote",
        fs: Any = None,
        part_size: int = DEFAULT_PART_SIZE,
        request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
        read_concurrency: int = DEFAULT_READ_CONCURRENCY,
        write_concurrency: int = DEFAULT_WRITE_CONCURRENCY,
        create_bucket: bool = False,
    ) -> None:
        """Open ``url`` (e.g. ``s3://bucket/prefix``). ``storage_options`` go to the backend (credentials, endpoint);
        ``fs`` supplies a ready filesystem instead (tests wrap one in a fault injector), ``url`` then only names the
        root. ``request_timeout_s`` bounds each request where the backend supports it (s3fs: connect and read).
        ``read_concurrency``: ranged reads of one file in flight at once (see the module docstring); on S3 the
        connection pool is raised to match (:data:`POOL_PER_READ` x it) unless ``config_kwargs`` set it.
        ``write_concurrency``: parts of this store's uploads in flight at once on S3 (their bytes in memory: times
        ``part_size``); 1 sends each file's parts one after another. ``create_bucket``: create the bucket of an
        object-store URL if it is missing (a request to the store, here); by default a missing bucket is an error
        at the first write, so that a mistyped name never creates one."""
        self.tier = tier
        self.url = redact_url(url).rstrip("/")
        self.part_size = int(part_size)
        if self.part_size <= 0:
            raise CheckpointError(f"part_size must be positive, got {part_size}", tier=tier, path=self.url)
        for name, value in (("read_concurrency", read_concurrency), ("write_concurrency", write_concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{name} must be a positive int, got {value!r}", tier=tier, path=self.url)
        self.read_concurrency = read_concurrency
        self.write_concurrency = write_concurrency
        scheme = _scheme(url)
        if fs is None:
            fs, root = self._connect(url, scheme, dict(storage_options or {}), request_timeout_s)
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.scheme = scheme
        root = root.rstrip("/")
        self.root = root if root else getattr(fs, "root_marker", "")
        if not self.root or self.root in ("/", ""):
            # refusing a bare bucket-less root keeps remove() and recover() away from a whole file system
            raise CheckpointError("a remote tier needs a folder, not the file system's root", tier=tier, path=self.url)
        self._s3_requests = supports_parallel_parts(fs, scheme)  # single S3 requests: multipart calls, listings
        self.exclusive_create = self._s3_requests  # a conditional PUT (If-None-Match: *)
        self._part_uploads = (PartUploads(write_concurrency, tier) if self._s3_requests and write_concurrency > 1
                              and self.part_size >= S3_MIN_PART else None)
        self._implicit_folders = scheme in _OBJECT_STORES
        if create_bucket and self._implicit_folders:
            with translated("create bucket", tier=tier, url=self.url):
                bucket = self.root.split("/", 1)[0]
                if not fs.exists(bucket):
                    fs.mkdir(bucket)

    def _connect(
        self, url: str, scheme: str, options: dict[str, Any], request_timeout_s: float | None
    ) -> tuple[Any, str]:
        try:
            import fsspec.core  # type: ignore[import-untyped]
        except ImportError as exc:  # pragma: no cover - fsspec is a dependency
            raise StorageError("remote tiers need fsspec: pip install fsspec", tier=self.tier, path=self.url) from exc
        options.setdefault("skip_instance_cache", True)
        options.setdefault("use_listings_cache", False)
        endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
        self._endpoint = endpoint if isinstance(endpoint, str) else None
        if scheme in ("s3", "s3a"):
            cfg = dict(options.get("config_kwargs") or {})
            if request_timeout_s:
                cfg.setdefault("connect_timeout", min(CONNECT_TIMEOUT_S, request_timeout_s))
                cfg.setdefault("read_timeout", request_timeout_s)
            cfg.setdefault("retries", {"max_attempts": BACKEND_ATTEMPTS, "mode": "standard"})
            # botocore's pool holds 10 connections: fewer than a few files' reads, or the parts, in flight
            cfg.setdefault("max_pool_connections",
                           max(10, POOL_PER_READ * self.read_concurrency, 2 * self.write_concurrency))
            options["config_kwargs"] = cfg
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
            if scheme in ("s3", "s3a") and "retries" not in options and isinstance(getattr(fs, "retries", None), int):
                fs.retries = 1  # s3fs's own loop around botocore's, which already retries
            return fs, root
        except ImportError as exc:
            pkg = _BACKEND_PACKAGES.get(scheme, f"the fsspec backend for {scheme}://")
            raise StorageError(f"{scheme}:// needs {pkg}: pip install {pkg}", tier=self.tier, path=self.url) from exc
        except ValueError as exc:
            # "Protocol not known" and bad options; the message may echo options, so it is not included
            raise StorageError(
                f"cannot open {scheme}:// ({type(exc).__name__}); check the URL and storage_options",
                tier=self.tier,
                path=self.url,
            ) from None

    # --- paths -------------------------------------------------------------------------------------------------
    def _p(self, rel: str) -> str:
        rel = join(rel)
        return f"{self.root}/{rel}" if rel else self.root

    def display(self, rel: str) -> str:
        """The URL of ``rel`` for messages."""
        rel = join(rel)
        return f"{self.url}/{rel}" if rel else self.url

    def _invalidate(self, path: str) -> None:
        invalidate(self.fs, path)

    def _cat(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, short at its end (S3 refuses a range that starts at or past EOF)."""
        try:
            data: bytes = self.fs.cat_file(path, start=start, end=end)
            return data
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) or exc.errno != errno.EINVAL:
                raise
            if start >= self.fs.size(path):
                return b""
            raise

    # --- listing and reading -----------------------------------------------------------------------------------
    def _guard(self, op: str, rel: str) -> Any:
        return translated(op, tier=self.tier, url=self.display(rel))

    def list(self, rel: str = "") -> list[str]:
        p = self._p(rel)
        try:
            with self._guard("list", rel):
                entries = self.fs.ls(p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for e in entries:
            name = (e["name"] if isinstance(e, dict) else str(e)).rstrip("/")
            if name == p or name.lstrip("/") == p.lstrip("/"):
                continue  # ls of a file lists the file itself
            names.add(name.rsplit("/", 1)[-1])
        return sorted(names)

    def sizes(self, rel: str = "") -> dict[str, int]:
        p = self._p(rel)
        try:
            with self._guard("list", rel):
                entries = self.fs.ls(p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries
                if isinstance(e, dict) and e.get("type") != "directory" and e.get("size") is not None
                and e["name"].rstrip("/").lstrip("/") != p.lstrip("/")}

    def exists(self, rel: str) -> bool:
        with self._guard("exists", rel):
            return bool(self.fs.exists(self._p(rel)))

    def size(self, rel: str) -> int:
        with self._guard("size of", rel):
            info = self.fs.info(self._p(rel))
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "is a folder", self.display(rel))
        return int(info["size"])

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        with self._guard("read", rel):
            data = self._cat(self._p(rel), 0, max_size + 1)
        if len(data) > max_size:
            raise CheckpointError(f"file is more than the {max_size} bytes allowed", tier=self.tier,
                                  path=self.display(rel))
        return bytes(data)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        if not len(view):
            return 0
        with self._guard("read", rel):
            data = self._cat(self._p(rel), offset, offset + len(view))
        n = min(len(data), len(view))
        view[:n] = data[:n]
        return n

    def open_read(self, rel: str) -> BinaryIO:
        return io.BufferedReader(_RangeReader(self, rel), buffer_size=min(self.part_size, 8 << 20))

    # --- writing -----------------------------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self._implicit_folders:
            return  # folders appear with their first object; s3fs's makedirs would create a missing bucket
        try:
            with self._guard("create folder", rel):
                self.fs.makedirs(self._p(rel), exist_ok=True)
        except FileExistsError:
            pass

    def open_write(self, rel: str, *, size_hint: int | None = None) -> WriteStream:
        p = self._p(rel)
        log.debug("tier %s: upload %s (%s bytes expected)", self.tier, self.display(rel), size_hint)
        if self._part_uploads is not None:
            return S3MultipartStream(self.fs, p, part_size=part_size_for(self.part_size, size_hint),
                                     uploads=self._part_uploads, tier=self.tier, url=self.display(rel))
        with self._guard("open for writing", rel):
            return _FsspecWriteStream(self, rel, p)

    def write_bytes(self, rel: str, data: bytes) -> None:
        p = self._p(rel)
        try:
            with self._guard("write", rel):
                self.fs.pipe_file(p, bytes(data))
        finally:
            self._invalidate(p)

    def diagnose(self) -> BaseException | None:
        """A TCP connection to the configured endpoint (``endpoint_url``) within half a second: the error if it is
        refused or its name does not resolve; None if it connects (then the endpoint is silent or slow) or no
        endpoint is configured (a cloud's own, not probed)."""
        endpoint = getattr(self, "_endpoint", None)
        if not endpoint:
            return None
        parts = urllib.parse.urlsplit(endpoint)
        if not parts.hostname:
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=0.5).close()
        except (ConnectionRefusedError, socket.gaierror) as exc:
            return ConnectionRefusedError(exc.errno, f"{parts.hostname}:{port}: {exc.strerror or exc}") \
                if isinstance(exc, ConnectionRefusedError) else exc
        except OSError:
            return None  # no TCP answer either: silent
        return None

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        if not self.exclusive_create:
            return super().create_exclusive(rel, data)
        p = self._p(rel)
        try:
            with self._guard("create", rel):
                try:
                    self.fs.pipe_file(p, bytes(data), mode="create")
                except FileExistsError:  # s3fs's answer to 412 Precondition Failed
                    return False
        finally:
            self._invalidate(p)
        return True

    def remove(self, rel: str) -> None:
        if not join(rel):
            raise CheckpointError("refusing to remove the root of a tier", tier=self.tier, path=self.url)
        p = self._p(rel)
        try:
            with self._guard("remove", rel):
                self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
        finally:
            self._invalidate(p)

    def discard_unfinished_uploads(self, *, dry_run: bool = False,
                                   older_than_s: float | None = None) -> builtins.list[str]:
        if not self._s3_requests:
            return []
        lines = []
        prefix = len(self.fs.split_path(self.root)[1])
        with self._guard("list unfinished uploads", ""):
            found = unfinished_uploads(self.fs, self.root, with_start=True)
        cutoff = None if older_than_s is None else time.time() - older_than_s
        for bucket, key, upload_id, started in found:
            where = f"{self.url}/{key[prefix:].lstrip('/')}"
            if cutoff is not None and (started is None or started > cutoff):
                why = "its age is unknown" if started is None else f"younger than {older_than_s:g} s"
                lines.append(f"kept the unfinished upload of {where} (may be in progress; {why})")
                continue
            if not dry_run:
                with self._guard("abort unfinished upload", key[prefix:].lstrip("/")):
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            lines.append(f"{'would abort' if dry_run else 'aborted'} the unfinished upload of {where}")
        return lines

    def modified_times(self) -> dict[str, float | None]:
        with self._guard("list", ""):
            found = self.fs.find(self.root, detail=True)
        return {path[len(self.root) + 1 :]: timestamp(info) for path, info in found.items()
                if path.startswith(self.root + "/")}

    def close(self) -> None:
        if self._part_uploads is not None:
            self._part_uploads.close()
        self.fs = _Closed(self.url)

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r}, tier={self.tier!r})"


class _Closed:
    """Stands in for the filesystem after :meth:`FsspecStore.close`, so a late call fails clearly."""

    def __init__(self, url: str) -> None:
        self._url = url

    def __getattr__(self, name: str) -> Any:
        raise StorageError("store is closed", path=self._url)
