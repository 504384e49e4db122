"""The counting S3 server of ``request_counts.py``: moto's app on loopback behind a WSGI middleware that counts every
request by operation kind (a listing, a GET of a step ``manifest.json``, of a rank manifest, of a data file, a PUT, a
multipart upload's calls, ...), by the rank and phase its User-Agent names (``tierckpt-rank/<rank>
tierckpt-phase/<phase>``), by object key and prefix, with the bytes of request and response bodies. Not a script.
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import unescape

import harness as h

#: the rank of a request without a rank tag (this process's own, e.g. creating the bucket)
UNTAGGED = -1
_RANK_RE, _PHASE_RE = re.compile(r"tierckpt-rank/(\d+)"), re.compile(r"tierckpt-phase/([\w-]+)")
_RANK_MANIFEST_RE, _STEP_RE = re.compile(r"^r\d{5}-[0-9a-f]+\.manifest\.json$"), re.compile(r"^step-\d+$")
_DELETE_KEY_RE = re.compile(r"<Key>(.*?)</Key>", re.DOTALL)


# ------------------------------------------------------------------------------------------ what a request is
def key_kind(key: str) -> str:
    """What an object key is in tierckpt's layout: ``step-manifest``, ``rank-manifest``, ``data``, ...."""
    base = key.rsplit("/", 1)[-1]
    if base == "manifest.json":
        return "step-manifest"
    if _RANK_MANIFEST_RE.match(base):
        return "rank-manifest"
    return "data" if ".safetensors" in base else "aside-manifest" if base == "manifest.aside.json" else "other-object"


def key_prefix(key: str) -> str:
    """The prefix a request on ``key`` counts against: the key up to and including its step folder
    (``run/step-0000000003/``, also for the folder's own name); for a key in no step folder, its folder (``run/``;
    ``""``: the bucket's root)."""
    parts = key.split("/")
    for i, part in enumerate(parts):
        if _STEP_RE.match(part):
            return "/".join(parts[: i + 1]) + "/"
    return key.rpartition("/")[0] + "/" if "/" in key else ""


def list_prefix(prefix: str) -> str:
    """The prefix a listing with ``prefix=...`` counts against: :func:`key_prefix` of it taken as a folder."""
    return key_prefix(prefix if prefix.endswith("/") else prefix + "/") if prefix else ""


def in_step_folder(name: str) -> bool:
    """Whether a key or prefix lies in a step folder (it belongs to that step's save)."""
    return any(_STEP_RE.match(part) for part in name.split("/"))


def root_prefix(remote: str) -> str:
    """The prefix of a job's root listing (``s3://bucket/run`` -> ``run/``)."""
    folder = remote.split("://", 1)[-1].partition("/")[2].strip("/")
    return folder + "/" if folder else ""


def request_targets(method: str, path: str, query: str, *, deleted: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """The object keys and prefixes one path-style request counts against: an object request its key and the key's
    prefix; a listing its ``prefix`` parameter's; a multi-object delete each key it names (``deleted``, from its
    body) and each of their prefixes once; any other bucket request the root ``""``; ``/`` nothing."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return [], []
    if key:
        return [key], [key_prefix(key)]
    q = parse_qs(query, keep_blank_values=True)
    if method == "POST" and "delete" in q:
        keys = list(deleted)
        return keys, sorted({key_prefix(k) for k in keys}) or [""]
    return [], [list_prefix(q.get("prefix", [""])[0]) if method == "GET" else ""]


def classify(method: str, path: str, query: str, headers: dict[str, str]) -> str:
    """The operation kind of one path-style S3 request (``/bucket/key?query``). Bucket-level: ``list``,
    ``list-uploads``, ``delete-multi``, ``head-bucket``, ``create-bucket``, ``bucket-other``; ``service`` for ``/``.
    Object-level: the key's kind (:func:`key_kind`) for a plain GET/HEAD/PUT/DELETE, else ``<op> <key kind>``, op
    being ``copy`` or a multipart call (``mpu-create``, ``mpu-part``, ``mpu-complete``, ``mpu-abort``,
    ``mpu-list-parts``)."""
    q = parse_qs(query, keep_blank_values=True)
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return "service"
    if not key:
        listing = {"list-type", "prefix", "delimiter", "marker", "continuation-token", "start-after", "max-keys"}
        if method == "GET":
            return "list-uploads" if "uploads" in q else "list" if not q or q.keys() & listing else "bucket-other"
        if method == "POST" and "delete" in q:
            return "delete-multi"
        return {"HEAD": "head-bucket", "PUT": "create-bucket" if not q else "bucket-other"}.get(method, "bucket-other")
    ops = [(method == "POST" and "uploads" in q, "mpu-create"),
           (method == "PUT" and "partNumber" in q and "uploadId" in q, "mpu-part"),
           (method == "POST" and "uploadId" in q, "mpu-complete"),
           (method == "DELETE" and "uploadId" in q, "mpu-abort"),
           (method == "GET" and "uploadId" in q, "mpu-list-parts"),
           (method == "PUT" and "x-amz-copy-source" in headers, "copy")]
    op = next((name for match, name in ops if match), None)
    return f"{op} {key_kind(key)}" if op else key_kind(key)  # a plain GET/HEAD/PUT/DELETE: the method says it


# ------------------------------------------------------------------------------------------ counting
@dataclass
class Tally:
    """Requests of one (rank, method, kind): how many, how many answered >= 400, body bytes in and out."""

    n: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class TargetTally:
    """Requests on one object key (``kind``: :func:`key_kind`) or prefix: how many, reads (GET, HEAD), writes."""

    kind: str = ""
    n: int = 0
    reads: int = 0
    writes: int = 0


@dataclass
class Counts:
    """Tallies keyed by (rank, method, kind), rank :data:`UNTAGGED` when unknown; by object key and by prefix
    (:func:`request_targets`); with tracing, every request as (rank, method, path?query, status)."""

    tallies: dict[tuple[int, str, str], Tally] = field(default_factory=dict)
    trace: list[tuple[int, str, str, int]] = field(default_factory=list)
    keys: dict[str, TargetTally] = field(default_factory=dict)
    prefixes: dict[str, TargetTally] = field(default_factory=dict)

    def total(self, *, rank: int | None = None, kinds: Iterable[str] | None = None) -> int:
        """Requests of ``rank`` (None: all, untagged ones included) whose "METHOD kind" is in ``kinds`` (None: any)."""
        wanted = None if kinds is None else set(kinds)
        return sum(t.n for (r, m, k), t in self.tallies.items()
                   if (rank is None or r == rank) and (wanted is None or f"{m} {k}" in wanted))

    def by_kind(self) -> dict[str, Tally]:
        """Tallies summed over ranks, keyed by "METHOD kind", sorted by kind."""
        out: dict[str, Tally] = {}
        for (_, m, k), t in sorted(self.tallies.items(), key=lambda kv: (kv[0][2], kv[0][1])):
            s = out.setdefault(f"{m} {k}", Tally())
            s.n += t.n
            s.errors += t.errors
            s.bytes_in += t.bytes_in
            s.bytes_out += t.bytes_out
        return out

    def by_rank(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (r, _, _), t in self.tallies.items():
            out[r] = out.get(r, 0) + t.n
        return dict(sorted(out.items()))

    def bytes_out(self, *, kinds: Iterable[str], rank: int | None = None) -> int:
        """Response body bytes of the requests (of ``rank``; None: all) whose "METHOD kind" is in ``kinds``."""
        wanted = set(kinds)
        return sum(t.bytes_out for (r, m, k), t in self.tallies.items()
                   if f"{m} {k}" in wanted and (rank is None or r == rank))

    def get_bytes(self, rank: int) -> dict[str, int]:
        """The response body bytes of ``rank``'s GETs by what was read: manifests, data, listings, other."""
        out = dict.fromkeys(("manifests", "data", "listings", "other"), 0)
        for (r, m, k), t in self.tallies.items():
            if r == rank and m == "GET":
                what = ("manifests" if k.endswith("manifest") else "data" if k == "data"
                        else "listings" if k == "list" else "other")
                out[what] += t.bytes_out
        return out


class RequestCounter:
    """Thread-safe :class:`Counts` per phase (``""``: requests without a phase tag) since they were last taken."""

    def __init__(self, *, trace: bool = False) -> None:
        self._lock = threading.Condition()
        self._phases: dict[str, Counts] = {}
        self._trace, self._in_flight = trace, 0

    def begin(self) -> None:
        """A request arrived; :meth:`record` ends it (a client may have its answer before the server records it)."""
        with self._lock:
            self._in_flight += 1

    def record(self, phase: str, rank: int, method: str, kind: str, *, status: int, bytes_in: int, bytes_out: int,
               target: str = "", keys: Iterable[str] = (), prefixes: Iterable[str] = ()) -> None:
        """Count one finished request (``target``: its path and query, for the trace)."""
        with self._lock:
            c = self._phases.setdefault(phase, Counts())
            for tallies, names, kind_of in ((c.keys, keys, key_kind), (c.prefixes, prefixes, lambda _: "")):
                for name in names:
                    tally = tallies.setdefault(name, TargetTally(kind_of(name)))
                    tally.n += 1
                    tally.reads += method in ("GET", "HEAD")
                    tally.writes += method in ("PUT", "POST", "DELETE")
            t = c.tallies.setdefault((rank, method, kind), Tally())
            t.n += 1
            t.errors += status >= 400
            t.bytes_in += bytes_in
            t.bytes_out += bytes_out
            if self._trace:
                c.trace.append((rank, method, target, status))
            self._in_flight -= 1
            self._lock.notify_all()

    def take(self, phase: str = "", *, settle_s: float = 10.0) -> Counts:
        """The counts of ``phase`` so far, which start again from zero; waits up to ``settle_s`` for the requests
        still being answered, so that each is counted."""
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight <= 0, timeout=settle_s)
            return self._phases.pop(phase, Counts())

    def clear(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight <= 0, timeout=10.0)
            self._phases.clear()


class _CountedBody:
    """A WSGI response that counts the bytes it yields and records the request when closed."""

    def __init__(self, body: Iterable[bytes], done: Callable[[int], None]) -> None:
        self._body, self._done, self._sent = body, done, 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._body:
            self._sent += len(chunk)
            yield chunk

    def close(self) -> None:
        try:
            getattr(self._body, "close", lambda: None)()
        finally:
            self._done(self._sent)


class CountingMiddleware:
    """WSGI middleware: every request through ``app`` is classified (:func:`classify`) and counted in ``counter``
    under the rank and phase its User-Agent names and the keys and prefixes it acts on (a multi-object delete's
    keys read from its body, which ``app`` then reads as sent)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], counter: RequestCounter) -> None:
        self.app, self.counter = app, counter

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path, query = environ.get("PATH_INFO", "/"), environ.get("QUERY_STRING", "")
        headers = {k[5:].lower().replace("_", "-"): v for k, v in environ.items() if k.startswith("HTTP_")}
        kind = classify(method, path, query, headers)
        agent = headers.get("user-agent", "")
        rank, phase = _RANK_RE.search(agent), _PHASE_RE.search(agent)
        size = headers.get("x-amz-decoded-content-length") or environ.get("CONTENT_LENGTH") or "0"
        bytes_in = int(size) if size.isdigit() else 0
        deleted: list[str] = []
        if kind == "delete-multi" and bytes_in and environ.get("CONTENT_LENGTH", "").isdigit():
            body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
            environ["wsgi.input"] = io.BytesIO(body)
            deleted = [unescape(k) for k in _DELETE_KEY_RE.findall(body.decode("utf-8", "replace"))]
        keys, prefixes = request_targets(method, path, query, deleted=deleted)
        status = [0]

        def counting_start(status_line: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[0] = int(status_line.split(None, 1)[0])
            return start_response(status_line, response_headers, exc_info)

        def done(sent: int) -> None:
            self.counter.record(phase.group(1) if phase else "", int(rank.group(1)) if rank else UNTAGGED, method,
                                kind, status=status[0], bytes_in=bytes_in, bytes_out=sent,
                                target=path + (f"?{query}" if query else ""), keys=keys, prefixes=prefixes)

        self.counter.begin()
        try:
            body = self.app(environ, counting_start)
        except BaseException:
            done(0)
            raise
        return _CountedBody(body, done)


@contextlib.contextmanager
def counting_s3_server(bucket: str = "bench-requests", *, trace: bool = False) -> Iterator[h.S3]:
    """The counting server (:func:`harness.s3_server` in this process): ``server.app.counter`` counts, from zero."""
    counter = RequestCounter(trace=trace)
    with h.s3_server(bucket, middleware=lambda app: CountingMiddleware(app, counter)) as s3:
        counter.clear()
        yield s3
