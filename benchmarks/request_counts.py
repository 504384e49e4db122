"""How many S3 requests a multi-rank job sends, by operation, and how each count grows with the world size W.

    .venv/bin/python benchmarks/request_counts.py [--ranks 1,2,4,8,16] [--steps 3] [--out request_counts.json] [--trace]
    .venv/bin/python benchmarks/request_counts.py --render request_counts.json      # the tables of an earlier run again

A counting S3 server runs in this process: moto's WSGI app on loopback behind a middleware that counts every
request by HTTP method and operation kind (a listing, a GET of a step ``manifest.json``, of a rank manifest, of a
data file, a PUT, the three calls of a multipart upload, ...), by rank (each rank tags its User-Agent), with the
bytes of request and response bodies. For each world size W, W rank processes (``_request_counts_rank.py``, gloo over a
FileStore, one local folder per rank as on W nodes, all on one fresh remote prefix) are launched three times, one
phase per launch, and the counts of each launch are taken separately:

- ``save``: construct the manager, save steps 1..S (2 MiB per rank), each awaited before the next, close;
- ``restart``: a new manager on the same local folders restores (and checks) step S, close;
- ``restart-wiped``: the same with every local folder deleted first: every shard comes from the remote.

Reported per W and phase: requests by kind, per save, per rank, rank 0's and the busiest other rank's, the bytes
of manifests read per rank and of listings; for each rank (mean, rank 0, busiest other rank) the local tier's
filesystem metadata calls by kind (open, fsync, rename, mkdir, unlink, listdir, stat: counted inside the rank by
wrapping the ``os`` functions for paths under its own local folder, and checked against CPython's audit events),
the bytes it read from its local folder and the bytes of its GETs (manifests, data, listings); the busiest object
key and the busiest prefix (a key up to its step folder, ``run/step-0000000003/``, and the root listing's ``run/``)
with their requests per save and the busiest prefix's request rate over the measured save time, also at 1,024 and
8,192 ranks; then for each count the exponent of a least-squares fit of log(count) against log(W), the better of the
fits a + b*W and a/W + b, and both extrapolated to W = 1,024 and 8,192 (fitted over W >= 2: one rank runs the
single-process protocol). The protocol is meant to cost O(1) requests and local calls per rank per save and per
restart, with rank 0 alone doing the job-wide work.

Time on the 2-core reference VM: W = 1, 2, 4, 8, 16 take about 12, 16, 25, 58 and 133 s (three launches each):
4 minutes in all. A launch whose ranks fail, restore wrong bytes or hang fails the run with each rank's error
and, for a rank still running at the timeout, its threads' stacks (ranks are never left behind).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import unescape

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
RANK_SCRIPT = HERE / "_request_counts_rank.py"
PHASES = ("save", "restart", "restart-wiped")
DEFAULT_RANKS = (1, 2, 4, 8, 16)
EXTRAPOLATE_TO = (1024, 8192)
#: dummy credentials: moto accepts anything, botocore wants something
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}

_RANK_MANIFEST_RE = re.compile(r"^r\d{5}-[0-9a-f]+\.manifest\.json$")
_RANK_TAG_RE = re.compile(r"tierckpt-rank/(\d+)")
_STEP_FOLDER_RE = re.compile(r"^step-\d+$")
_DELETE_KEY_RE = re.compile(r"<Key>(.*?)</Key>", re.DOTALL)
#: a request without a rank tag (this process's own, e.g. creating the bucket)
UNTAGGED = -1


# ------------------------------------------------------------------------------------------------ classification
def key_kind(key: str) -> str:
    """What an object key is in tierckpt's layout: ``step-manifest``, ``rank-manifest``, ``data``, ...."""
    base = key.rsplit("/", 1)[-1]
    if base == "manifest.json":
        return "step-manifest"
    if _RANK_MANIFEST_RE.match(base):
        return "rank-manifest"
    if ".safetensors" in base:
        return "data"
    if base == "manifest.aside.json":
        return "aside-manifest"
    return "other-object"


def key_prefix(key: str) -> str:
    """The prefix that a request on ``key`` counts against: the key up to and including its step folder
    (``run/step-0000000003/``, also for the folder's own name ``run/step-0000000003``); for a key in no step
    folder, its folder (``run/``; ``""``: the bucket's root)."""
    parts = key.split("/")
    for i, part in enumerate(parts):
        if _STEP_FOLDER_RE.match(part):
            return "/".join(parts[: i + 1]) + "/"
    return key.rpartition("/")[0] + "/" if "/" in key else ""


def list_prefix(prefix: str) -> str:
    """The prefix that a listing with ``prefix=...`` counts against: :func:`key_prefix` of it taken as a folder."""
    if not prefix:
        return ""
    return key_prefix(prefix if prefix.endswith("/") else prefix + "/")


def in_step_folder(name: str) -> bool:
    """Whether a key or prefix lies in a step folder (it belongs to that step's save)."""
    return any(_STEP_FOLDER_RE.match(part) for part in name.split("/"))


def request_targets(method: str, path: str, query: str, *, deleted: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """The object keys and the prefixes (:func:`key_prefix`) that one path-style request counts against: an object
    request its key and the key's prefix; a listing (of objects or of uploads) its ``prefix`` parameter's; a
    multi-object delete each key it names (``deleted``, read from its body) and each distinct prefix of those once;
    any other bucket request the bucket's root ``""``; ``/`` nothing."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return [], []
    if key:
        return [key], [key_prefix(key)]
    q = parse_qs(query, keep_blank_values=True)
    if method == "POST" and "delete" in q:
        keys = list(deleted)
        return keys, sorted({key_prefix(k) for k in keys}) or [""]
    if method == "GET":
        return [], [list_prefix(q.get("prefix", [""])[0])]
    return [], [""]


def classify(method: str, path: str, query: str, headers: dict[str, str]) -> str:
    """The operation kind of one path-style S3 request (``/bucket/key?query``).

    Bucket-level: ``list`` (ListObjects[V2]), ``list-uploads``, ``delete-multi``, ``head-bucket``,
    ``create-bucket``, ``bucket-other``; ``service`` for ``/``. Object-level: the key's kind (:func:`key_kind`)
    for a plain GET/HEAD/PUT/DELETE, else ``<op> <key kind>`` where op is ``copy`` or a multipart call
    (``mpu-create``, ``mpu-part``, ``mpu-complete``, ``mpu-abort``, ``mpu-list-parts``).
    """
    q = parse_qs(query, keep_blank_values=True)
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return "service"
    if not key:
        if method == "GET" and "uploads" in q:
            return "list-uploads"
        if method == "GET" and (not q or q.keys() & {"list-type", "prefix", "delimiter", "marker",
                                                     "continuation-token", "start-after", "max-keys"}):
            return "list"
        if method == "POST" and "delete" in q:
            return "delete-multi"
        if method == "HEAD":
            return "head-bucket"
        if method == "PUT" and not q:
            return "create-bucket"
        return "bucket-other"
    target = key_kind(key)
    if method == "POST" and "uploads" in q:
        op = "mpu-create"
    elif method == "PUT" and "partNumber" in q and "uploadId" in q:
        op = "mpu-part"
    elif method == "POST" and "uploadId" in q:
        op = "mpu-complete"
    elif method == "DELETE" and "uploadId" in q:
        op = "mpu-abort"
    elif method == "GET" and "uploadId" in q:
        op = "mpu-list-parts"
    elif method == "PUT" and "x-amz-copy-source" in headers:
        op = "copy"
    else:
        return target  # a plain GET/HEAD/PUT/DELETE: the method says what it is
    return f"{op} {target}"


# ------------------------------------------------------------------------------------------------ counting
@dataclass
class Tally:
    """Requests of one (rank, method, kind): how many, how many answered >= 400, body bytes in and out."""

    n: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def add(self, other: Tally) -> None:
        self.n += other.n
        self.errors += other.errors
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out


@dataclass
class TargetTally:
    """Requests on one object key or one prefix: how many, how many read (GET, HEAD) and how many wrote (PUT,
    POST, DELETE); ``kind``: a key's :func:`key_kind` (empty for a prefix)."""

    kind: str = ""
    n: int = 0
    reads: int = 0
    writes: int = 0

    def copy(self) -> TargetTally:
        """A copy (the counter keeps counting into its own)."""
        return TargetTally(self.kind, self.n, self.reads, self.writes)


def _count_target(tallies: dict[str, TargetTally], name: str, kind: str, method: str) -> None:
    t = tallies.setdefault(name, TargetTally(kind))
    t.n += 1
    t.reads += method in ("GET", "HEAD")
    t.writes += method in ("PUT", "POST", "DELETE")


@dataclass
class Counts:
    """A snapshot of the counter: tallies keyed by (rank, method, kind); rank is :data:`UNTAGGED` when unknown."""

    tallies: dict[tuple[int, str, str], Tally] = field(default_factory=dict)
    #: with ``RequestCounter(trace=True)``: every request as (rank, method, path?query, status), in arrival order
    trace: list[tuple[int, str, str, int]] = field(default_factory=list)
    #: requests by object key (:func:`request_targets`)
    keys: dict[str, TargetTally] = field(default_factory=dict)
    #: requests by prefix (:func:`request_targets`)
    prefixes: dict[str, TargetTally] = field(default_factory=dict)

    def total(self, *, rank: int | None = None, kinds: Iterable[str] | None = None) -> int:
        """Requests of ``rank`` (None: every rank, untagged ones included) whose "METHOD kind" is in ``kinds``."""
        wanted = None if kinds is None else set(kinds)
        return sum(t.n for (r, m, k), t in self.tallies.items()
                   if (rank is None or r == rank) and (wanted is None or f"{m} {k}" in wanted))

    def by_kind(self) -> dict[str, Tally]:
        """Tallies summed over ranks, keyed by "METHOD kind", sorted."""
        out: dict[str, Tally] = {}
        for (_, m, k), t in sorted(self.tallies.items(), key=lambda kv: (kv[0][2], kv[0][1])):
            out.setdefault(f"{m} {k}", Tally()).add(t)
        return out

    def by_rank(self) -> dict[int, int]:
        """Requests per rank."""
        out: dict[int, int] = {}
        for (r, _, _), t in self.tallies.items():
            out[r] = out.get(r, 0) + t.n
        return dict(sorted(out.items()))

    def bytes_out(self, *, kinds: Iterable[str], rank: int | None = None) -> int:
        """Response body bytes of the requests (of ``rank``; None: every rank) whose "METHOD kind" is in ``kinds``."""
        wanted = set(kinds)
        return sum(t.bytes_out for (r, m, k), t in self.tallies.items()
                   if f"{m} {k}" in wanted and (rank is None or r == rank))

    def get_bytes(self, rank: int) -> dict[str, int]:
        """The response body bytes of ``rank``'s GETs, by what was read: ``manifests`` (step, rank and set-aside
        manifests), ``data``, ``listings`` and ``other``."""
        out = dict.fromkeys(("manifests", "data", "listings", "other"), 0)
        for (r, m, k), t in self.tallies.items():
            if r != rank or m != "GET":
                continue
            what = ("manifests" if k.endswith("manifest") else "data" if k == "data"
                    else "listings" if k == "list" else "other")
            out[what] += t.bytes_out
        return out


class RequestCounter:
    """Thread-safe tallies of the requests seen since the last :meth:`take`."""

    def __init__(self, *, trace: bool = False) -> None:
        """``trace``: also keep every request's rank, method, target and status (:attr:`Counts.trace`)."""
        self._lock = threading.Condition()
        self._tallies: dict[tuple[int, str, str], Tally] = {}
        self._keys: dict[str, TargetTally] = {}
        self._prefixes: dict[str, TargetTally] = {}
        self._trace: list[tuple[int, str, str, int]] | None = [] if trace else None
        self._in_flight = 0

    def begin(self) -> None:
        """A request arrived; :meth:`record` ends it (a client may have its answer before the server records it)."""
        with self._lock:
            self._in_flight += 1

    def record(self, rank: int, method: str, kind: str, *, status: int, bytes_in: int, bytes_out: int,
               target: str = "", keys: Iterable[str] = (), prefixes: Iterable[str] = ()) -> None:
        """Count one finished request (``target``: its path and query, for the trace; ``keys``, ``prefixes``: what
        it counts against, :func:`request_targets`)."""
        with self._lock:
            for key in keys:
                _count_target(self._keys, key, key_kind(key), method)
            for prefix in prefixes:
                _count_target(self._prefixes, prefix, "", method)
            self._in_flight -= 1
            self._lock.notify_all()
            t = self._tallies.setdefault((rank, method, kind), Tally())
            t.n += 1
            t.errors += status >= 400
            t.bytes_in += bytes_in
            t.bytes_out += bytes_out
            if self._trace is not None:
                self._trace.append((rank, method, target, status))

    def snapshot(self) -> Counts:
        """The tallies so far (copied), the counter left as it is."""
        with self._lock:
            return Counts({k: Tally(t.n, t.errors, t.bytes_in, t.bytes_out) for k, t in self._tallies.items()},
                          list(self._trace or []), {k: t.copy() for k, t in self._keys.items()},
                          {k: t.copy() for k, t in self._prefixes.items()})

    def take(self, *, settle_s: float = 10.0) -> Counts:
        """The tallies so far, and start again from zero (one phase's counts). Waits up to ``settle_s`` for the
        requests still being answered, so that a request is counted in the phase that sent it."""
        with self._lock:
            self._lock.wait_for(lambda: self._in_flight <= 0, timeout=settle_s)
            out = Counts(self._tallies, list(self._trace or []), self._keys, self._prefixes)
            self._tallies, self._keys, self._prefixes = {}, {}, {}
            if self._trace is not None:
                self._trace = []
        return out


class _CountedBody:
    """A WSGI response iterable that counts the bytes it yields and records the request when closed."""

    def __init__(self, body: Iterable[bytes], done: Callable[[int], None]) -> None:
        self._body = body
        self._done = done
        self._sent = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._body:
            self._sent += len(chunk)
            yield chunk

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._done(self._sent)


class CountingMiddleware:
    """WSGI middleware: every request through ``app`` is classified (:func:`classify`) and counted in ``counter``,
    attributed to the rank named in its User-Agent (``tierckpt-rank/<n>``) and to the keys and prefixes it acts on
    (:func:`request_targets`; a multi-object delete's keys are read from its body, which ``app`` then reads as
    sent)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], counter: RequestCounter) -> None:
        self.app = app
        self.counter = counter

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET").upper()
        headers = {k[5:].lower().replace("_", "-"): v for k, v in environ.items() if k.startswith("HTTP_")}
        kind = classify(method, environ.get("PATH_INFO", "/"), environ.get("QUERY_STRING", ""), headers)
        tag = _RANK_TAG_RE.search(headers.get("user-agent", ""))
        rank = int(tag.group(1)) if tag else UNTAGGED
        size = headers.get("x-amz-decoded-content-length") or environ.get("CONTENT_LENGTH") or "0"
        bytes_in = int(size) if size.isdigit() else 0
        status = [0]
        target = environ.get("PATH_INFO", "/") + ("?" + environ["QUERY_STRING"] if environ.get("QUERY_STRING") else "")
        deleted: list[str] = []
        if kind == "delete-multi" and bytes_in and environ.get("CONTENT_LENGTH", "").isdigit():
            body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
            environ["wsgi.input"] = io.BytesIO(body)
            deleted = [unescape(k) for k in _DELETE_KEY_RE.findall(body.decode("utf-8", "replace"))]
        keys, prefixes = request_targets(method, environ.get("PATH_INFO", "/"), environ.get("QUERY_STRING", ""),
                                         deleted=deleted)

        def counting_start(status_line: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[0] = int(status_line.split(None, 1)[0])
            return start_response(status_line, response_headers, exc_info)

        def done(sent: int) -> None:
            self.counter.record(rank, method, kind, status=status[0], bytes_in=bytes_in, bytes_out=sent,
                                target=target, keys=keys, prefixes=prefixes)

        self.counter.begin()
        try:
            body = self.app(environ, counting_start)
        except BaseException:
            done(0)
            raise
        return _CountedBody(body, done)


@dataclass
class CountingS3Server:
    """moto's S3 server on a loopback port, every request counted; ``endpoint_url`` once started."""

    counter: RequestCounter
    endpoint_url: str
    bucket: str

    def storage_options(self) -> dict[str, Any]:
        """What s3fs (and ``CheckpointManager(storage_options=...)``) needs to reach this server."""
        return {"key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": self.endpoint_url}}


@contextlib.contextmanager
def counting_s3_server(bucket: str = "bench-requests", *, trace: bool = False) -> Iterator[CountingS3Server]:
    """Start the counting server on a free loopback port (threads of this process), create ``bucket`` through
    s3fs, zero the counter and yield the server. Sets the dummy credentials in ``os.environ`` (kept after, as the
    ranks inherit them). ``trace``: keep every request (:class:`RequestCounter`). Raises ``ImportError`` when
    moto's server extra or s3fs is missing."""
    import s3fs
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    try:  # keeps S3 metadata headers with underscores, as moto's own server does
        from moto.server import MotoRequestHandler as handler
    except ImportError:  # pragma: no cover - older moto
        handler = None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    for k, v in S3_ENV.items():
        os.environ.setdefault(k, v)
    counter = RequestCounter(trace=trace)
    app = CountingMiddleware(DomainDispatcherApplication(create_backend_app), counter)
    kw = {"request_handler": handler} if handler is not None else {}
    server = make_server("127.0.0.1", 0, app, threaded=True, **kw)
    thread = threading.Thread(target=server.serve_forever, name="counting-s3", daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        s3 = CountingS3Server(counter, f"http://{host}:{port}", bucket)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3.storage_options())
        fs.mkdir(bucket)
        counter.take()
        yield s3
    finally:
        server.shutdown()
        thread.join(timeout=10)


# ------------------------------------------------------------------------------------------------ rank launches
def rank_env() -> dict[str, str]:
    """A rank's environment: this checkout's ``tierckpt`` importable, one OpenMP thread, the dummy credentials."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **S3_ENV)
    env.pop("TIERCKPT_FAULT", None)
    return env


class LaunchFailed(RuntimeError):
    """A launch of W ranks that failed: ``launch`` holds what was counted and what each rank recorded."""

    def __init__(self, msg: str, launch: Launch) -> None:
        super().__init__(msg)
        self.launch = launch


@dataclass
class Launch:
    """One phase of one world size: the ranks' records, the requests counted, how long it took, and the remote
    (``s3://bucket/folder``) the ranks used."""

    phase: str
    world: int
    counts: Counts
    records: list[dict[str, Any]]
    wall_s: float
    remote: str = ""


def launch_phase(server: CountingS3Server, phase: str, world: int, folder: Path, remote: str, *, steps: int,
                 numel: int, timeout_s: float = 300.0, collective_timeout_s: float = 60.0,
                 log_level: str = "WARNING") -> Launch:
    """Run ``phase`` as ``world`` rank processes and return the requests they made. Raises :class:`LaunchFailed`
    when a rank fails, restores the wrong bytes, or the ranks are not done after ``timeout_s`` (all are killed
    then, after each printed its threads' stacks into its log). ``log_level``: of the ranks' ``tierckpt`` logger."""
    run_dir = folder / f"{phase}-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True)
    cfg = {"phase": phase, "world": world, "init_method": f"file://{run_dir}/filestore", "steps": steps,
           "numel": numel, "remote": remote, "storage_options": server.storage_options(),
           "local_root": str(folder / "local"), "result_dir": str(run_dir),
           "collective_timeout_s": collective_timeout_s, "log_level": log_level}
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    server.counter.take()  # nothing from before this launch
    env = rank_env()
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(run_dir / f"log-r{r:05d}.txt", "w")) for r in range(world)]
        procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), str(cfg_path)], env=env,
                                  stdout=logs[r], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=run_dir)
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:  # never leave a rank behind (timeout, or interrupted); first ask for its threads' stacks
            stuck = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGUSR1)
            if stuck:
                time.sleep(2.0)
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
    wall = time.perf_counter() - t0
    counts = server.counter.take()
    records = []
    for r in range(world):
        path = run_dir / f"result-r{r:05d}.json"
        records.append(json.loads(path.read_text()) if path.exists() else {"rank": r, "ok": False})
    bad = [r for r, (p, rec) in enumerate(zip(procs, records)) if p.returncode != 0 or not rec.get("ok")]
    if timed_out or bad:
        detail = []
        # the stuck ranks' stacks first, then the errors of phases (a barrier's error follows another rank's)
        first = [*stuck, *sorted((r for r in bad if r not in stuck), key=lambda r: records[r].get("stage") != "phase")]
        for r in first[:4]:
            rec = records[r]
            log = (run_dir / f"log-r{r:05d}.txt").read_text()[-6000:]
            detail.append(f"--- rank {r} (rc {procs[r].returncode}): {rec.get('mismatch') or rec.get('error')}\n"
                          f"{rec.get('traceback', '')}{log}")
        why = (f"rank(s) {stuck} still running after {timeout_s:.0f} s (stacks in their logs, {run_dir})"
               if timed_out else f"rank(s) {bad} failed ({run_dir})")
        raise LaunchFailed(f"{phase} with {world} ranks: {why}\n" + "\n".join(detail),
                           Launch(phase, world, counts, records, wall, remote))
    return Launch(phase, world, counts, records, wall, remote)


def run_world(server: CountingS3Server, world: int, scratch: Path, *, steps: int, numel: int,
              timeout_s: float = 300.0, phases: Iterable[str] = PHASES) -> dict[str, Launch]:
    """Every phase, in order, for ``world`` ranks on a fresh remote prefix and fresh local folders."""
    folder = scratch / f"w{world:05d}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    remote = f"s3://{server.bucket}/{folder.name}"
    return {phase: launch_phase(server, phase, world, folder, remote, steps=steps, numel=numel,
                                timeout_s=timeout_s) for phase in phases}


# ------------------------------------------------------------------------------------------------ summaries
MANIFEST_GETS = ("GET step-manifest", "GET rank-manifest")
#: requests a second per prefix that S3 documents it serves: writes (PUT, COPY, POST, DELETE), reads (GET, HEAD)
S3_PREFIX_WRITES_PER_S, S3_PREFIX_READS_PER_S = 3500, 5500


def _spread(values: list[float], w: int, per: float) -> dict[str, float | None]:
    """Of one number per rank (rank order): the mean, rank 0's and the largest of the other ranks', each / ``per``."""
    return {"per_rank": sum(values) / w / per, "rank0": values[0] / per,
            "max_other_rank": max(values[1:]) / per if w > 1 else None}


def summarize_local_ops(records: list[dict[str, Any]], w: int, per: float) -> dict[str, Any]:
    """The ranks' local-tier calls (their records' ``local_ops``), per save in the save phase (``per``: the number
    of saves), per restart otherwise: for each category and for all of them, the mean over ranks, rank 0's and the
    busiest other rank's (for each row its own busiest); the mean of every function's count (``by_call``), of the
    opens that may create a file, and the bytes read from the local tier (mean, rank 0, busiest other). ``audit``:
    over all ranks, each audited category's wrapped calls against CPython's audit events for it (they differ only
    where some call went around the wrappers). Empty when the records hold no counts."""
    ops = [rec.get("local_ops") for rec in records]
    if len(ops) != w or not all(ops):
        return {}
    names = list(ops[0]["categories"])  # the rank script's LOCAL_OP_CATEGORIES, in its order
    cats = [{c: o["categories"].get(c, 0) for c in names} for o in ops]
    out: dict[str, Any] = {"categories": {c: _spread([x[c] for x in cats], w, per) for c in names},
                           "all": _spread([sum(x.values()) for x in cats], w, per),
                           "creates": sum(o["creates"] for o in ops) / w / per,
                           "read_bytes": _spread([o["read_bytes"] for o in ops], w, per)}
    calls = sorted({k for o in ops for k in o["calls"]})
    out["by_call"] = {k: sum(o["calls"].get(k, 0) for o in ops) / w / per for k in calls}
    out["failed"] = {k: sum(o["failed"].get(k, 0) for o in ops) for k in calls if any(o["failed"].get(k) for o in ops)}
    out["audit"] = {c: {"wrapped": sum(o["audit_wrapped"][c] for o in ops),
                        "audited": sum(o["audit"].get(c, 0) for o in ops)} for c in ops[0]["audit_wrapped"]}
    return out


def _hottest(tallies: dict[str, TargetTally], phase: str, steps: int) -> tuple[str, TargetTally, int] | None:
    """The key or prefix with the most requests per save (per restart outside the save phase), with its tally and
    the number of saves it spans: one for a name in a step folder (it belongs to that step's save), every save
    otherwise. The first in name order on a tie; None without any."""
    if not tallies:
        return None

    def spans(name: str) -> int:
        return 1 if phase != "save" or in_step_folder(name) else steps

    name = max(sorted(tallies), key=lambda k: tallies[k].n / spans(k))
    return name, tallies[name], spans(name)


def _target(name: str, t: TargetTally, spans: int) -> dict[str, Any]:
    return {"name": name, "kind": t.kind, "requests": t.n / spans, "reads": t.reads / spans,
            "writes": t.writes / spans, "total": t.n, "saves": spans}


def root_prefix(remote: str) -> str:
    """The prefix of a job's root listing (``s3://bucket/run`` -> ``run/``)."""
    path = remote.split("://", 1)[-1]
    folder = path.partition("/")[2].strip("/")
    return folder + "/" if folder else ""


def phase_window_s(launch: Launch) -> float | None:
    """The seconds over which a phase's requests are spread for a rate: in the save phase the median over saves of
    the slowest rank's save (from ``save()`` until it is durable and committed on every tier), else the slowest
    rank's restore; None where the records lack the times."""
    recs = launch.records
    if launch.phase == "save":
        times = [rec.get("save_s") for rec in recs]
        if not times or not all(times) or len({len(t) for t in times}) != 1:
            return None
        return statistics.median(max(t[i] for t in times) for i in range(len(times[0])))
    restores = [rec.get("restore_s") for rec in recs]
    return max(restores) if restores and all(r is not None for r in restores) else None


def summarize_targets(launch: Launch, steps: int) -> dict[str, Any]:
    """The busiest object key and the busiest prefix (:func:`_hottest`: per save in the save phase, a name outside
    the step folders spread over every save) with their kind and reads and writes, the requests on the root
    listing's prefix, the phase's window (:func:`phase_window_s`) and the busiest prefix's requests per second over
    it (JSON-able)."""
    c = launch.counts
    per = steps if launch.phase == "save" else 1
    out: dict[str, Any] = {"busiest_key": None, "busiest_key_requests": None, "busiest_prefix": None,
                           "busiest_prefix_requests": None, "busiest_prefix_reads": None,
                           "busiest_prefix_writes": None}
    hot_key = _hottest(c.keys, launch.phase, steps)
    if hot_key is not None:
        out["busiest_key"] = _target(*hot_key)
        out["busiest_key_requests"] = out["busiest_key"]["requests"]
    hot_prefix = _hottest(c.prefixes, launch.phase, steps)
    if hot_prefix is not None:
        hot = out["busiest_prefix"] = _target(*hot_prefix)
        out.update(busiest_prefix_requests=hot["requests"], busiest_prefix_reads=hot["reads"],
                   busiest_prefix_writes=hot["writes"])
    root = root_prefix(launch.remote)
    out["root_prefix"] = _target(root, c.prefixes.get(root, TargetTally()), per)
    out["root_prefix_requests"] = out["root_prefix"]["requests"]
    window = phase_window_s(launch)
    out["window_s"] = window
    out["busiest_prefix_rate_per_s"] = (out["busiest_prefix_requests"] / window
                                        if window and out["busiest_prefix_requests"] is not None else None)
    return out


def summarize_launch(launch: Launch, steps: int) -> dict[str, Any]:
    """The numbers reported for one phase of one world size (JSON-able): requests by kind and rank, bytes, the
    ranks' local-tier calls (:func:`summarize_local_ops`), the busiest key and prefix (:func:`summarize_targets`)
    and the bytes each rank read through GETs (``read_bytes_*``: manifests, data, listings)."""
    c, w = launch.counts, launch.world
    by_rank = c.by_rank()
    ranked = {r: n for r, n in by_rank.items() if r != UNTAGGED}
    per = steps if launch.phase == "save" else 1  # the save phase is reported per save
    others = [ranked.get(r, 0) for r in range(1, w)]
    return {
        "world": w,
        "phase": launch.phase,
        "wall_s": round(launch.wall_s, 3),
        "phase_s": round(max(rec.get("phase_s", 0.0) for rec in launch.records), 3),
        "total": c.total(),
        "per_save" if launch.phase == "save" else "per_restart": c.total() / per,
        "per_rank": c.total() / per / w,
        "rank0": ranked.get(0, 0) / per,
        "max_other_rank": max(others) / per if others else None,
        "untagged": by_rank.get(UNTAGGED, 0),
        "manifest_get_bytes_per_rank": c.bytes_out(kinds=MANIFEST_GETS) / per / w,
        "list_bytes": c.bytes_out(kinds=["GET list"]) / per,
        **_read_bytes(c, w, per),
        **_local_fields(summarize_local_ops(launch.records, w, per)),
        **summarize_targets(launch, steps),
        "by_kind": {k: {"n": t.n, "errors": t.errors, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out}
                    for k, t in c.by_kind().items()},
        "by_rank": {str(r): n for r, n in by_rank.items()},
        **({"trace": [list(t) for t in c.trace]} if c.trace else {}),
    }


def _read_bytes(c: Counts, w: int, per: float) -> dict[str, Any]:
    """The response bytes of each rank's GETs (:meth:`Counts.get_bytes`) per save or restart: all of them as mean,
    rank 0's and the busiest other rank's (``read_bytes_per_rank``, ``read_bytes_rank0``,
    ``read_bytes_max_other_rank``), and the mean by what was read (``read_bytes_by_what``)."""
    ranks = [c.get_bytes(r) for r in range(w)]
    spread = _spread([sum(b.values()) for b in ranks], w, per)
    return {"read_bytes_per_rank": spread["per_rank"], "read_bytes_rank0": spread["rank0"],
            "read_bytes_max_other_rank": spread["max_other_rank"],
            "read_bytes_by_what": {k: sum(b[k] for b in ranks) / w / per for k in ranks[0]}}


def _local_fields(ops: dict[str, Any]) -> dict[str, Any]:
    """:func:`summarize_local_ops` under ``local_ops``, and its totals flat (the fitted fields): ``local_ops_*``
    (every category's calls) and ``local_read_bytes_*``, each per rank (mean), rank 0 and busiest other rank."""
    if not ops:
        return {}
    out: dict[str, Any] = {"local_ops": ops}
    for name, spread in (("local_ops", ops["all"]), ("local_read_bytes", ops["read_bytes"])):
        out.update({f"{name}_{k}": v for k, v in spread.items()})
    return out


def _least_squares(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through ``pts``; None without two distinct x."""
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - slope * mx, slope


def fit_growth(values: dict[int, float | None]) -> dict[str, Any]:
    """Least-squares fits of ``values`` (W -> count), each extrapolated to :data:`EXTRAPOLATE_TO`, over the W >= 2
    when there are two of them (``fitted_over``): a single rank runs the single-process protocol (no commit
    channel), not a point on the multi-rank curve; else over every W.

    - ``exponent``: e of log(count) = log(c) + e*log(W) over those W whose count is above 0 (None with fewer than
      two), extrapolated as ``power``; ``exponent_tail``: the slope between the two largest of them (a constant
      plus a linear term shows an exponent that climbs towards 1 with W: this is the nearer one);
    - ``a``, ``b``: count = a + b*W or count = a/W + b (a per-rank mean of a constant total), whichever fits with
      the smaller squared error (``model``; the first on a tie), extrapolated as ``linear``.
    """
    pts = [(w, v) for w, v in sorted(values.items()) if v is not None]
    if len([w for w, _ in pts if w >= 2]) >= 2:
        pts = [(w, v) for w, v in pts if w >= 2]
    out: dict[str, Any] = {"fitted_over": [w for w, _ in pts], "exponent": None, "exponent_tail": None,
                           "power": {}, "model": None, "a": None, "b": None, "linear": {}}
    pos = [(math.log(w), math.log(v)) for w, v in pts if v > 0]
    power = _least_squares(pos)
    if power is not None:
        log_c, e = power
        out["exponent"] = e
        out["power"] = {str(n): math.exp(log_c) * n ** e for n in EXTRAPOLATE_TO}
        (x1, y1), (x2, y2) = pos[-2:]
        out["exponent_tail"] = (y2 - y1) / (x2 - x1)
    best: tuple[float, str, float, float] | None = None
    for model, x_of in (("a + b*W", lambda w: w), ("a/W + b", lambda w: 1 / w)):
        line = _least_squares([(x_of(w), v) for w, v in pts])
        if line is None:
            continue
        icept, slope = line
        sse = sum((icept + slope * x_of(w) - v) ** 2 for w, v in pts)
        a, b = (icept, slope) if model == "a + b*W" else (slope, icept)
        if best is None or sse < best[0] - 1e-9 * (1 + best[0]):
            best = (sse, model, a, b)
    if best is not None:
        _, model, a, b = best
        out.update(model=model, a=a, b=b, linear={str(n): (a + b * n if model == "a + b*W" else a / n + b)
                                                  for n in EXTRAPOLATE_TO})
    return out


#: (label, phase, field of :func:`summarize_launch`) of the counts whose growth is fitted
FITTED = [
    ("save: requests per save", "save", "per_save"),
    ("save: per rank per save (mean)", "save", "per_rank"),
    ("save: rank 0 per save", "save", "rank0"),
    ("save: busiest other rank per save", "save", "max_other_rank"),
    ("save: manifest GET bytes per rank per save", "save", "manifest_get_bytes_per_rank"),
    ("save: LIST response bytes per save", "save", "list_bytes"),
    ("restart: requests", "restart", "per_restart"),
    ("restart: per rank (mean)", "restart", "per_rank"),
    ("restart: rank 0", "restart", "rank0"),
    ("restart: busiest other rank", "restart", "max_other_rank"),
    ("restart: manifest GET bytes per rank", "restart", "manifest_get_bytes_per_rank"),
    ("restart: LIST response bytes", "restart", "list_bytes"),
    ("restart-wiped: requests", "restart-wiped", "per_restart"),
    ("restart-wiped: per rank (mean)", "restart-wiped", "per_rank"),
    ("restart-wiped: rank 0", "restart-wiped", "rank0"),
    ("restart-wiped: busiest other rank", "restart-wiped", "max_other_rank"),
    ("restart-wiped: manifest GET bytes per rank", "restart-wiped", "manifest_get_bytes_per_rank"),
    ("restart-wiped: LIST response bytes", "restart-wiped", "list_bytes"),
]
#: the busiest key and prefix, the local tier's calls and the bytes read, for each phase (same form as above)
FITTED += [(f"{phase}: {what}{' per save' if phase == 'save' else ''}{' (mean)' if key.endswith('per_rank') else ''}",
            phase, key)
           for phase in PHASES
           for what, key in (("busiest key requests", "busiest_key_requests"),
                             ("busiest prefix requests", "busiest_prefix_requests"),
                             ("root listing prefix requests", "root_prefix_requests"),
                             ("local ops per rank", "local_ops_per_rank"),
                             ("local ops, rank 0", "local_ops_rank0"),
                             ("local ops, busiest other rank", "local_ops_max_other_rank"),
                             ("local bytes read per rank", "local_read_bytes_per_rank"),
                             ("local bytes read, rank 0", "local_read_bytes_rank0"),
                             ("local bytes read, busiest other rank", "local_read_bytes_max_other_rank"),
                             ("S3 bytes read per rank", "read_bytes_per_rank"),
                             ("S3 bytes read, rank 0", "read_bytes_rank0"),
                             ("S3 bytes read, busiest other rank", "read_bytes_max_other_rank"))]


def fit_all(summary: dict[int, dict[str, dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
    """Growth fits of :data:`FITTED`, of every kind's count (per save in the save phase) and of every local-tier
    call category's mean per rank, over the worlds; a field that no world has is left out."""
    worlds = sorted(summary)
    rows = []
    for label, phase, key in FITTED:
        values = {w: summary[w][phase].get(key) for w in worlds if phase in summary[w]}
        if any(v is not None for v in values.values()):
            rows.append({"metric": label, "values": values, **fit_growth(values)})
    for phase in PHASES:
        kinds = sorted({k for w in worlds if phase in summary[w] for k in summary[w][phase]["by_kind"]})
        per = steps if phase == "save" else 1
        for kind in kinds:
            values = {w: summary[w][phase]["by_kind"].get(kind, {"n": 0})["n"] / per
                      for w in worlds if phase in summary[w]}
            what = "per save" if phase == "save" else "total"
            rows.append({"metric": f"{phase}: {kind} ({what})", "values": values, **fit_growth(values)})
    for phase in PHASES:
        local = {w: summary[w][phase]["local_ops"]["categories"] for w in worlds
                 if phase in summary[w] and summary[w][phase].get("local_ops")}
        for cat in next(iter(local.values()), {}):
            values = {w: c[cat]["per_rank"] for w, c in local.items()}
            what = "per rank per save" if phase == "save" else "per rank"
            rows.append({"metric": f"{phase}: local {cat} {what} (mean)", "values": values, **fit_growth(values)})
    return rows


def busiest_prefix_at_scale(summary: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """For each phase and W in :data:`EXTRAPOLATE_TO`: the requests per save (per restart) on the busiest prefix,
    its reads and its writes, each from the better linear model of :func:`fit_growth` over the measured W, and the
    rates they make if they are spread over the phase's window (:func:`phase_window_s`) measured at the largest W
    (``window_s``, ``at_w``): the assumption that a save's upload phase at that scale takes the time it took here."""
    worlds = sorted(summary)
    out = []
    for phase in PHASES:
        have = [w for w in worlds
                if phase in summary[w] and summary[w][phase].get("busiest_prefix_requests") is not None]
        if not have:
            continue
        window = summary[have[-1]][phase].get("window_s")
        fitted = {key: fit_growth({w: summary[w][phase][key] for w in have})
                  for key in ("busiest_prefix_requests", "busiest_prefix_reads", "busiest_prefix_writes")}
        for n in EXTRAPOLATE_TO:
            row: dict[str, Any] = {"phase": phase, "world": n, "window_s": window, "at_w": have[-1]}
            for key, f in fitted.items():
                v = f["linear"].get(str(n))
                name = key.removeprefix("busiest_prefix_")
                row[name] = v
                row[f"{name}_per_s"] = v / window if v is not None and window else None
            row["model"] = fitted["busiest_prefix_requests"]["model"]
            out.append(row)
    return out


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v - round(v)) < 1e-9:
        return f"{int(round(v))}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _size(v: float | None) -> str:
    """A byte count in decimal units (k = 1,000, M = 1,000,000)."""
    if v is None:
        return "-"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return _num(v)


def _trio(spread: dict[str, Any] | None, fmt: Callable[[float | None], str] = _num) -> str:
    """A :func:`_spread` as "mean / rank 0 / busiest other rank"."""
    if not spread:
        return ""
    return " / ".join(fmt(spread.get(k)) for k in ("per_rank", "rank0", "max_other_rank"))


def _table(first: str, worlds: list[int], rows: list[tuple[str, list[str]]]) -> list[str]:
    """A markdown table: a first column of labels, then one column per W."""
    heads = [f"W={w}" for w in worlds]
    wl = max([len(first)] + [len(label) for label, _ in rows])
    wc = [max([len(h)] + [len(cells[i]) for _, cells in rows]) for i, h in enumerate(heads)]
    out = [f"| {first:<{wl}} | " + " | ".join(f"{h:>{n}}" for h, n in zip(heads, wc)) + " |",
           f"|{'-' * (wl + 2)}|" + "|".join("-" * (n + 2) for n in wc) + "|"]
    out += [f"| {label:<{wl}} | " + " | ".join(f"{c:>{n}}" for c, n in zip(cells, wc)) + " |" for label, cells in rows]
    return out


def _per_rank_rows(s: dict[str, Any]) -> dict[str, str]:
    """The cells of one phase of one W in the per-rank table (label -> cell)."""
    ops = s.get("local_ops") or {}
    cells = {f"local {cat}": _trio(spread) for cat, spread in ops.get("categories", {}).items()}
    if ops:
        cells["local: all calls"] = _trio(ops["all"])
        cells["local: opens that may create (mean)"] = _num(ops["creates"])
        cells["local: bytes read"] = _trio(ops["read_bytes"], _size)
        off = [f"{c} {a['wrapped']}!={a['audited']}" for c, a in ops["audit"].items() if a["wrapped"] != a["audited"]]
        cells["local: audit events = wrapped calls"] = ", ".join(off) if off else "yes"
    if s.get("read_bytes_per_rank") is not None:
        cells["S3 bytes read"] = _trio({k: s[f"read_bytes_{k}"] for k in ("per_rank", "rank0", "max_other_rank")},
                                       _size)
        for what, v in s.get("read_bytes_by_what", {}).items():
            cells[f"S3 bytes read: {what} (mean)"] = _size(v)
    return cells


def _target_rows(s: dict[str, Any]) -> dict[str, str]:
    """The cells of one phase of one W in the busiest key and prefix table (label -> cell)."""
    cells: dict[str, str] = {}
    key, prefix, root = s.get("busiest_key"), s.get("busiest_prefix"), s.get("root_prefix")
    if key:
        cells["busiest key: requests"] = _num(key["requests"])
        cells["busiest key: kind"] = key["kind"]
        cells["busiest key: reads / writes"] = f"{_num(key['reads'])} / {_num(key['writes'])}"
    if prefix:
        cells["busiest prefix: requests"] = _num(prefix["requests"])
        name = prefix["name"]
        if in_step_folder(name):
            which = "step folder"
        elif root and name == root["name"]:
            which = "root listing"
        else:
            which = name or "bucket"
        cells["busiest prefix: which"] = which
        cells["busiest prefix: reads / writes"] = f"{_num(prefix['reads'])} / {_num(prefix['writes'])}"
    if root:
        cells["root listing prefix: requests"] = _num(root["requests"])
    if "window_s" in s:
        cells["window s"] = _num(s["window_s"])
        cells["busiest prefix: requests / s"] = _num(s["busiest_prefix_rate_per_s"])
    return cells


def _by_phase(summary: dict[int, dict[str, dict[str, Any]]], steps: int, title: str,
              cells_of: Callable[[dict[str, Any]], dict[str, str]]) -> list[str]:
    """One table per phase of ``cells_of``'s rows over the W (rows in first-seen order; none: no table)."""
    worlds = sorted(summary)
    lines: list[str] = []
    for phase in PHASES:
        cells = {w: cells_of(summary[w][phase]) for w in worlds if phase in summary[w]}
        labels = list(dict.fromkeys(label for c in cells.values() for label in c))
        if not labels:
            continue
        per = f"per save (total / {steps})" if phase == "save" else "per restart"
        lines += ["", f"### {phase}: {title}, {per}", ""]
        lines += _table("what", worlds, [(label, [cells.get(w, {}).get(label, "") for w in worlds])
                                         for label in labels])
    return lines


def render_scale(rows: list[dict[str, Any]]) -> list[str]:
    """The busiest prefix at :data:`EXTRAPOLATE_TO` (:func:`busiest_prefix_at_scale`) as a table, with its
    assumption."""
    if not rows:
        return []
    out = ["", "### busiest prefix at scale", "",
           "Requests per save (per restart) on the busiest prefix from the better linear fit (a + b*W or a/W + b) over "
           "the measured W; rates assume that these requests arrive spread evenly over the phase's window measured at "
           "the largest W run (save: the median over saves of the slowest rank's time from save() until durable and "
           "committed on every tier; restart: the slowest rank's restore), i.e. that a save's upload phase at that "
           f"scale takes the measured time. S3 documents {S3_PREFIX_WRITES_PER_S:,} writes (PUT, COPY, POST, DELETE) "
           f"and {S3_PREFIX_READS_PER_S:,} reads (GET, HEAD) a second per prefix.", ""]
    table = [("phase", "W", "model", "requests", "reads", "writes", "window s", "at W", "req/s", "reads/s",
              "writes/s")]
    table += [(r["phase"], str(r["world"]), r["model"] or "-", _num(r["requests"]), _num(r["reads"]),
               _num(r["writes"]), _num(r["window_s"]), str(r["at_w"]), _num(r["requests_per_s"]),
               _num(r["reads_per_s"]), _num(r["writes_per_s"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    out.append("| " + " | ".join(f"{c:<{n}}" for c, n in zip(table[0], widths)) + " |")
    out.append("|" + "|".join("-" * (n + 2) for n in widths) + "|")
    out += ["| " + " | ".join(f"{c:>{n}}" for c, n in zip(row, widths)) + " |" for row in table[1:]]
    return out


def render(summary: dict[int, dict[str, dict[str, Any]]], fits: list[dict[str, Any]], steps: int) -> str:
    """The tables printed to stdout: each phase's counts by kind for every W; each rank's local-tier calls and
    bytes read; the busiest key and prefix, and the busiest prefix at scale; then the fitted growth laws."""
    worlds = sorted(summary)
    lines: list[str] = []
    head = " | ".join(f"W={w:>5}" for w in worlds)
    for phase in PHASES:
        rows = [s[phase] for s in summary.values() if phase in s]
        if not rows:
            continue
        per = steps if phase == "save" else 1
        title = f"{phase}: requests per save (total / {steps})" if phase == "save" else f"{phase}: requests (total)"
        lines += ["", f"## {title}", "", f"| {'kind':<34} | {head} |",
                  f"|{'-' * 36}|" + "|".join("-" * 9 for _ in worlds) + "|"]
        kinds = sorted({k for r in rows for k in r["by_kind"]})

        cells: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
            (kind, lambda s, k=kind, d=per: s["by_kind"].get(k, {"n": 0})["n"] / d) for kind in kinds]
        cells += [
            ("**all**", lambda s, d=per: s["total"] / d),
            ("per rank", lambda s: s["per_rank"]),
            ("rank 0", lambda s: s["rank0"]),
            ("busiest other rank", lambda s: s["max_other_rank"]),
            ("manifest GET bytes per rank", lambda s: s["manifest_get_bytes_per_rank"]),
            ("LIST response bytes", lambda s: s["list_bytes"]),
            ("untagged (not a rank's)", lambda s: s["untagged"]),
            ("wall s (launch, all ranks)", lambda s: s["wall_s"]),
            ("phase s (slowest rank)", lambda s: s["phase_s"]),
        ]
        for label, fn in cells:
            row = " | ".join(f"{_num(fn(summary[w][phase])) if phase in summary[w] else '':>7}" for w in worlds)
            lines.append(f"| {label:<34} | {row} |")
    per_rank = _by_phase(summary, steps, "per rank", _per_rank_rows)
    if per_rank:
        lines += ["", "## per rank: local-tier calls, bytes read", "",
                  "Local: counted inside each rank on its own local folder, the calls of the os functions (and open) "
                  "on paths there or on descriptors of files there, failed ones included: open (os.open, open), fsync "
                  "(fsync, fdatasync), rename (rename, replace, renameat2), mkdir, unlink (unlink, remove, rmdir), "
                  "listdir (listdir, scandir), stat (stat, lstat, fstat; os.path.exists and the like call stat); "
                  "bytes read: through os reads and open() there. S3: the response bodies of the rank's GETs. Each "
                  "cell with three numbers: the mean over ranks / rank 0 / the busiest other rank (of that row). "
                  "k = 1,000 bytes, M = 1,000,000.", *per_rank]
    targets = _by_phase(summary, steps, "busiest key and prefix", _target_rows)
    if targets:
        lines += ["", "## busiest object key and prefix", "",
                  "A request counts against its object key and the key's prefix: the key up to and including its "
                  "step folder (run/step-0000000003/); a listing against its prefix parameter's (the root listing: "
                  "run/); a multi-object delete against each key it names. In the save phase a key or prefix in a "
                  "step folder belongs to that step's save, one outside (the root listing) is spread over the saves. "
                  "Window: the seconds the rate is taken over (save: the median over saves of the slowest rank's "
                  "time from save() until durable and committed on every tier; restart: the slowest rank's "
                  "restore).", *targets, *render_scale(busiest_prefix_at_scale(summary))]
    n1, n2 = EXTRAPOLATE_TO
    wm = max([46] + [len(f["metric"]) for f in fits])
    lines += ["", "## growth with W", "",
              "Fitted over W >= 2 (W = 1 runs the single-process protocol) when there are two such W. e: exponent "
              "of count ~ c*W^e (least squares over the W with count > 0); e tail: between the two largest W; "
              "pow@N: that power law at W = N. model: the better least-squares fit of a + b*W and a/W + b; "
              "lin@N: that model at W = N.", "",
              f"| {'metric':<{wm}} | {'e':>5} | {'e tail':>6} | {'pow@' + str(n1):>9} | {'pow@' + str(n2):>9} | "
              f"{'model':<7} | {'a':>8} | {'b':>7} | {'lin@' + str(n1):>9} | {'lin@' + str(n2):>9} |",
              "|" + "|".join("-" * (n + 2) for n in (wm, 5, 6, 9, 9, 7, 8, 7, 9, 9)) + "|"]
    for f in fits:
        e, tail = ("-" if v is None else f"{v:+.2f}" for v in (f["exponent"], f["exponent_tail"]))
        p = [_num(f["power"].get(str(n))) for n in EXTRAPOLATE_TO]
        lin = [_num(f["linear"].get(str(n))) for n in EXTRAPOLATE_TO]
        a, b = ("-" if v is None else f"{v:.3g}" for v in (f["a"], f["b"]))
        lines.append(f"| {f['metric']:<{wm}} | {e:>5} | {tail:>6} | {p[0]:>9} | {p[1]:>9} | "
                     f"{f['model'] or '-':<7} | {a:>8} | {b:>7} | {lin[0]:>9} | {lin[1]:>9} |")
    return "\n".join(lines)


def run(worlds: Iterable[int], *, steps: int = 3, numel: int = 512 * 1024, scratch: Path | None = None,
        timeout_s: float = 300.0, trace: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark: a counting server, every world size's phases, the summaries and the fits (JSON-able).
    ``scratch``: where the ranks' local folders go (a fresh temporary folder, removed after, by default);
    ``trace``: every request (rank, method, path?query, status) in each phase's summary too."""
    worlds = sorted(set(worlds))
    summary: dict[int, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierckpt-requests-")))
        scratch.mkdir(parents=True, exist_ok=True)
        server = stack.enter_context(counting_s3_server(trace=trace))
        for w in worlds:
            t0 = time.perf_counter()
            launches = run_world(server, w, scratch, steps=steps, numel=numel, timeout_s=timeout_s)
            summary[w] = {p: summarize_launch(launch, steps) for p, launch in launches.items()}
            if log is not None:
                log(f"W={w}: {time.perf_counter() - t0:.1f} s ("
                    + ", ".join(f"{p} {s['wall_s']:.1f} s" for p, s in summary[w].items()) + ")")
    fits = fit_all(summary, steps)
    return {"kind": "requests", "ranks": worlds, "steps": steps, "numel": numel,
            "state_bytes_per_rank": 4 * numel, "summary": {str(w): s for w, s in summary.items()}, "fits": fits,
            "busiest_prefix_at_scale": busiest_prefix_at_scale(summary), "table": render(summary, fits, steps)}


def main(argv: list[str] | None = None) -> int:
    """Command line: run the benchmark, print the tables, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                    help="world sizes, comma-separated (default %(default)s; 16 ranks take ~2 min on 2 cores)")
    ap.add_argument("--steps", type=int, default=3, help="saves per world size (default %(default)s)")
    ap.add_argument("--numel", type=int, default=512 * 1024,
                    help="float32 values per rank (default %(default)s: 2 MiB)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch of W ranks (default %(default)s)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder for the local tiers (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--trace", action="store_true", help="every request (rank, method, path, status) in the JSON")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="run nothing: fit and print the tables of a JSON that --out wrote")
    args = ap.parse_args(argv)
    if args.render is not None:
        old = json.loads(args.render.read_text())
        summary = {int(w): s for w, s in old["summary"].items()}
        for phases in summary.values():  # written before list_bytes was reported
            for phase, s in phases.items():
                per = old["steps"] if phase == "save" else 1
                s.setdefault("list_bytes", s["by_kind"].get("GET list", {"bytes_out": 0})["bytes_out"] / per)
        print(render(summary, fit_all(summary, old["steps"]), old["steps"]))
        return 0
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not worlds or min(worlds) < 1 or args.steps < 1:
        ap.error("--ranks needs positive world sizes and --steps a positive count")
    report = run(worlds, steps=args.steps, numel=args.numel, scratch=args.dir, timeout_s=args.timeout,
                 trace=args.trace, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(report["table"])
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
