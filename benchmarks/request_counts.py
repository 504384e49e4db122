"""How many S3 requests a multi-rank job sends, by operation, and how each count grows with the world size W.

    .venv/bin/python benchmarks/request_counts.py [--ranks 1,2,4,8,16] [--steps 3] [--out request_counts.json] [--trace]
    .venv/bin/python benchmarks/request_counts.py --render request_counts.json      # the tables of a saved run again

A counting S3 server runs in this process: moto's app on loopback behind a middleware that counts every request by
operation kind (a listing, a GET of a step ``manifest.json``, of a rank manifest, of a data file, a PUT, a multipart
upload's calls, ...), by rank and phase (each rank tags its User-Agent), by object key and prefix, with the bytes of
request and response bodies. For each W, W rank processes (``_request_counts_rank.py``) are launched once and run
three phases, each counted apart: ``save`` (S saves of 2 MiB per rank, each awaited), ``restart`` (a new manager
restores step S) and ``restart-wiped`` (every local folder deleted first: every shard comes from the remote).

Reported per W and phase: requests by kind, per save, per rank (mean, rank 0, busiest other rank), bytes of
manifests and listings read; each rank's local-tier calls by category and bytes read there and through GETs; the
busiest object key and prefix, and the busiest prefix's request rate at 1,024 and 8,192 ranks; then, for every
count, fits of its growth with W (a power law; a + b*W or a/W + b) extrapolated to 1,024 and 8,192 ranks. The
protocol is meant to cost O(1) requests and local calls per rank per save and per restart, rank 0 alone doing the
job-wide work. A launch whose ranks fail, restore wrong bytes or hang fails the run with each rank's error and, for
a rank still running at the timeout, its threads' stacks (ranks are never left behind).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import secrets
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import unescape

import harness as h

RANK_SCRIPT = Path(__file__).resolve().parent / "_request_counts_rank.py"
PHASES = ("save", "restart", "restart-wiped")
EXTRAPOLATE_TO = (1024, 8192)
#: requests a second per prefix that S3 documents it serves: writes (PUT, COPY, POST, DELETE), reads (GET, HEAD)
S3_PREFIX_WRITES_PER_S, S3_PREFIX_READS_PER_S = 3500, 5500
MANIFEST_GETS = ("GET step-manifest", "GET rank-manifest")
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


# ------------------------------------------------------------------------------------------ launching the ranks
@dataclass
class Launch:
    """One phase of one world size: the requests counted, the ranks' records, its wall time (the first rank's start
    to the last rank's end), the remote (``s3://bucket/folder``), and the launch's requests without a phase tag."""

    phase: str
    world: int
    counts: Counts
    records: list[dict[str, Any]]
    wall_s: float
    remote: str = ""
    untagged: int = 0


class LaunchFailed(RuntimeError):
    """A launch whose ranks failed; ``launches`` holds what was counted and what each rank recorded."""

    def __init__(self, msg: str, launches: dict[str, Launch]) -> None:
        super().__init__(msg)
        self.launches = launches


def launch(server: h.S3, world: int, folder: Path, remote: str, *, steps: int, numel: int,
           phases: Iterable[str] = PHASES, timeout_s: float = 300.0, collective_timeout_s: float = 60.0,
           log_level: str = "WARNING") -> dict[str, Launch]:
    """``world`` rank processes running ``phases`` in turn on ``folder``'s local folders and ``remote``: each phase's
    requests and records. :class:`LaunchFailed` when a rank fails, restores wrong bytes, or the ranks are not done
    after ``timeout_s`` (all are killed then, after each printed its threads' stacks into its log)."""
    phases = list(phases)
    run_dir = folder / f"run-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True)
    cfg = {"phases": phases, "world": world, "steps": steps, "numel": numel, "remote": remote,
           "storage_options": server.storage_options, "local_root": str(folder / "local"), "run_dir": str(run_dir),
           "collective_timeout_s": collective_timeout_s, "log_level": log_level}
    (cfg_path := run_dir / "config.json").write_text(json.dumps(cfg))
    counter: RequestCounter = server.app.counter
    counter.clear()  # nothing from before this launch
    logs = [run_dir / f"log-r{r:05d}.txt" for r in range(world)]
    done = h.launch([[RANK_SCRIPT, r, cfg_path] for r in range(world)], logs, timeout_s=timeout_s, cwd=run_dir,
                    env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **h.S3_ENV})
    untagged = counter.take("").total()
    launches = {}
    for phase in phases:
        paths = [run_dir / f"result-r{r:05d}-{phase}.json" for r in range(world)]
        records = [json.loads(p.read_text()) if p.exists() else {"rank": r, "ok": False} for r, p in enumerate(paths)]
        spans = [(rec["wall_start"], rec["wall_end"]) for rec in records if "wall_end" in rec]
        wall = max(e for _, e in spans) - min(s for s, _ in spans) if spans else done.wall_s
        launches[phase] = Launch(phase, world, counter.take(phase), records, wall, remote, untagged)
    failed = {r: next((launches[p].records[r] for p in phases if not launches[p].records[r].get("ok")), None)
              for r in range(world)}
    bad = [r for r in range(world) if done.returncodes[r] != 0 or failed[r] is not None]
    if done.stuck or bad:
        # the stuck ranks' stacks first, then the errors of phases (a barrier's error follows another rank's)
        first = [*done.stuck, *sorted((r for r in bad if r not in done.stuck),
                                      key=lambda r: (failed[r] or {}).get("stage") != "phase")]
        detail = [f"--- rank {r} (rc {done.returncodes[r]}): {rec.get('mismatch') or rec.get('error')}\n"
                  f"{rec.get('traceback', '')}{logs[r].read_text()[-6000:]}"
                  for r in first[:4] for rec in [failed[r] or {}]]
        why = (f"rank(s) {done.stuck} still running after {timeout_s:.0f} s (stacks in their logs, {run_dir})"
               if done.stuck else f"rank(s) {bad} failed ({run_dir})")
        raise LaunchFailed(f"{'/'.join(phases)} with {world} ranks: {why}\n" + "\n".join(detail), launches)
    return launches


def run_world(server: h.S3, world: int, scratch: Path, *, steps: int, numel: int, timeout_s: float = 300.0,
              phases: Iterable[str] = PHASES) -> dict[str, Launch]:
    """Every phase for ``world`` ranks, in one launch, on a fresh remote prefix and fresh local folders."""
    folder = scratch / f"w{world:05d}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    return launch(server, world, folder, f"s3://{server.bucket}/{folder.name}", steps=steps, numel=numel,
                  phases=phases, timeout_s=timeout_s)


# ------------------------------------------------------------------------------------------ summaries
def _spread(values: list[float], w: int, per: float) -> dict[str, float | None]:
    """Of one number per rank (rank order): the mean, rank 0's and the largest other rank's, each / ``per``."""
    return {"per_rank": sum(values) / w / per, "rank0": values[0] / per,
            "max_other_rank": max(values[1:]) / per if w > 1 else None}


def summarize_local_ops(records: list[dict[str, Any]], w: int, per: float) -> dict[str, Any]:
    """The ranks' local-tier calls per save (``per``: the saves) or per restart: each category's and all calls'
    :func:`_spread`, the mean of every function's count (``by_call``), of the opens that may create a file, the bytes
    read locally; ``audit``: over all ranks, each audited category's wrapped calls against CPython's audit events.
    Empty when the records hold no counts."""
    ops = [rec.get("local_ops") for rec in records]
    if len(ops) != w or not all(ops):
        return {}
    cats = [o["categories"] for o in ops]
    calls = sorted({k for o in ops for k in o["calls"]})
    return {"categories": {c: _spread([x.get(c, 0) for x in cats], w, per) for c in cats[0]},
            "all": _spread([sum(x.values()) for x in cats], w, per),
            "creates": sum(o["creates"] for o in ops) / w / per,
            "read_bytes": _spread([o["read_bytes"] for o in ops], w, per),
            "by_call": {k: sum(o["calls"].get(k, 0) for o in ops) / w / per for k in calls},
            "failed": {k: n for k in calls if (n := sum(o["failed"].get(k, 0) for o in ops))},
            "audit": {c: {"wrapped": sum(o["audit_wrapped"][c] for o in ops),
                          "audited": sum(o["audit"].get(c, 0) for o in ops)} for c in ops[0]["audit_wrapped"]}}


def _hottest(tallies: dict[str, TargetTally], phase: str, steps: int) -> dict[str, Any] | None:
    """The key or prefix with the most requests per save (per restart outside the save phase): a name in a step
    folder belongs to one save, any other is spread over every save; the first in name order on a tie."""
    if not tallies:
        return None

    def spans(name: str) -> int:
        return 1 if phase != "save" or in_step_folder(name) else steps

    name = max(sorted(tallies), key=lambda k: tallies[k].n / spans(k))
    return _target(name, tallies[name], spans(name))


def _target(name: str, t: TargetTally, spans: int) -> dict[str, Any]:
    return {"name": name, "kind": t.kind, "requests": t.n / spans, "reads": t.reads / spans,
            "writes": t.writes / spans, "total": t.n, "saves": spans}


def phase_window_s(launch: Launch) -> float | None:
    """The seconds a phase's requests are spread over, for a rate: in the save phase the median over saves of the
    slowest rank's save (from ``save()`` until durable and committed on every tier), else the slowest restore."""
    if launch.phase == "save":
        times = [rec.get("save_s") for rec in launch.records]
        if not times or not all(times) or len({len(t) for t in times}) != 1:
            return None
        return statistics.median(max(t[i] for t in times) for i in range(len(times[0])))
    restores = [rec.get("restore_s") for rec in launch.records]
    return max(restores) if restores and all(r is not None for r in restores) else None


def summarize_launch(launch: Launch, steps: int) -> dict[str, Any]:
    """The numbers reported for one phase of one world size (JSON-able); the save phase's per save."""
    c, w, save = launch.counts, launch.world, launch.phase == "save"
    per = steps if save else 1
    by_rank = c.by_rank()
    others = [by_rank.get(r, 0) for r in range(1, w)]
    gets = [c.get_bytes(r) for r in range(w)]
    read = _spread([sum(b.values()) for b in gets], w, per)
    out: dict[str, Any] = {
        "world": w, "phase": launch.phase, "wall_s": round(launch.wall_s, 3),
        "phase_s": round(max(rec.get("phase_s", 0.0) for rec in launch.records), 3), "total": c.total(),
        "per_save" if save else "per_restart": c.total() / per, "per_rank": c.total() / per / w,
        "rank0": by_rank.get(0, 0) / per, "max_other_rank": max(others) / per if others else None,
        "untagged": by_rank.get(UNTAGGED, 0) + launch.untagged,
        "manifest_get_bytes_per_rank": c.bytes_out(kinds=MANIFEST_GETS) / per / w,
        "list_bytes": c.bytes_out(kinds=["GET list"]) / per,
        **{f"read_bytes_{k}": v for k, v in read.items()},
        "read_bytes_by_what": {k: sum(b[k] for b in gets) / w / per for k in gets[0]},
    }
    if ops := summarize_local_ops(launch.records, w, per):
        out["local_ops"] = ops
        for name, spread in (("local_ops", ops["all"]), ("local_read_bytes", ops["read_bytes"])):
            out.update({f"{name}_{k}": v for k, v in spread.items()})
    key, prefix = _hottest(c.keys, launch.phase, steps), _hottest(c.prefixes, launch.phase, steps)
    root = _target(root_prefix(launch.remote), c.prefixes.get(root_prefix(launch.remote), TargetTally()), per)
    window = phase_window_s(launch)
    out.update(busiest_key=key, busiest_key_requests=key and key["requests"], busiest_prefix=prefix,
               **{f"busiest_prefix_{k}": prefix and prefix[k] for k in ("requests", "reads", "writes")},
               root_prefix=root, root_prefix_requests=root["requests"], window_s=window,
               busiest_prefix_rate_per_s=prefix["requests"] / window if window and prefix else None,
               by_kind={k: vars(t) for k, t in c.by_kind().items()}, by_rank={str(r): n for r, n in by_rank.items()})
    if c.trace:
        out["trace"] = [list(t) for t in c.trace]
    return out


# ------------------------------------------------------------------------------------------ growth fits
def _least_squares(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through ``pts``; None without two distinct x."""
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - slope * mx, slope


def fit_growth(values: dict[int, float | None]) -> dict[str, Any]:
    """Least-squares fits of ``values`` (W -> count), extrapolated to :data:`EXTRAPOLATE_TO`, over the W >= 2 when
    there are two (``fitted_over``; one rank runs the single-process protocol, no point of the multi-rank curve):
    ``exponent`` of count ~ c*W^e over the counts above 0 (``power``), ``exponent_tail`` between the two largest W
    (a constant plus a linear term shows an exponent that climbs towards 1: this is the nearer one); and ``a``,
    ``b`` of count = a + b*W or a/W + b (a per-rank mean of a constant total), whichever fits with the smaller
    squared error (``model``, the first on a tie; ``linear``)."""
    pts = [(w, v) for w, v in sorted(values.items()) if v is not None]
    if len([w for w, _ in pts if w >= 2]) >= 2:
        pts = [(w, v) for w, v in pts if w >= 2]
    out: dict[str, Any] = {"fitted_over": [w for w, _ in pts], "exponent": None, "exponent_tail": None,
                           "power": {}, "model": None, "a": None, "b": None, "linear": {}}
    pos = [(math.log(w), math.log(v)) for w, v in pts if v > 0]
    if (power := _least_squares(pos)) is not None:
        (x1, y1), (x2, y2) = pos[-2:]
        out.update(exponent=power[1], exponent_tail=(y2 - y1) / (x2 - x1),
                   power={str(n): math.exp(power[0]) * n ** power[1] for n in EXTRAPOLATE_TO})
    best: tuple[float, str, float, float] | None = None
    for model, x_of in (("a + b*W", lambda w: w), ("a/W + b", lambda w: 1 / w)):
        if (line := _least_squares([(x_of(w), v) for w, v in pts])) is not None:
            sse = sum((line[0] + line[1] * x_of(w) - v) ** 2 for w, v in pts)
            a, b = line if model == "a + b*W" else line[::-1]
            if best is None or sse < best[0] - 1e-9 * (1 + best[0]):
                best = (sse, model, a, b)
    if best is not None:
        _, model, a, b = best
        out.update(model=model, a=a, b=b, linear={str(n): a + b * n if model == "a + b*W" else a / n + b
                                                  for n in EXTRAPOLATE_TO})
    return out


#: (label, phase, field of :func:`summarize_launch`) of the counts whose growth is fitted
FITTED = [(f"{phase}: {label}", phase, key) for phase in PHASES for label, key in (
    (("requests per save", "per_save"), ("per rank per save (mean)", "per_rank"), ("rank 0 per save", "rank0"),
     ("busiest other rank per save", "max_other_rank"),
     ("manifest GET bytes per rank per save", "manifest_get_bytes_per_rank"),
     ("LIST response bytes per save", "list_bytes")) if phase == "save" else
    (("requests", "per_restart"), ("per rank (mean)", "per_rank"), ("rank 0", "rank0"),
     ("busiest other rank", "max_other_rank"), ("manifest GET bytes per rank", "manifest_get_bytes_per_rank"),
     ("LIST response bytes", "list_bytes")))]
FITTED += [(f"{phase}: {what}{' per save' if phase == 'save' else ''}{' (mean)' if key.endswith('per_rank') else ''}",
            phase, key) for phase in PHASES for what, key in (
    ("busiest key requests", "busiest_key_requests"), ("busiest prefix requests", "busiest_prefix_requests"),
    ("root listing prefix requests", "root_prefix_requests"), ("local ops per rank", "local_ops_per_rank"),
    ("local ops, rank 0", "local_ops_rank0"), ("local ops, busiest other rank", "local_ops_max_other_rank"),
    ("local bytes read per rank", "local_read_bytes_per_rank"), ("local bytes read, rank 0", "local_read_bytes_rank0"),
    ("local bytes read, busiest other rank", "local_read_bytes_max_other_rank"),
    ("S3 bytes read per rank", "read_bytes_per_rank"), ("S3 bytes read, rank 0", "read_bytes_rank0"),
    ("S3 bytes read, busiest other rank", "read_bytes_max_other_rank"))]


def fit_all(summary: dict[int, dict[str, dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
    """Growth fits of :data:`FITTED`, of every kind's count (per save in the save phase) and of every local-tier call
    category's mean per rank, over the worlds; a field that no world has is left out."""
    worlds = sorted(summary)
    rows = []

    def fit(metric: str, values: dict[int, Any]) -> None:
        rows.append({"metric": metric, "values": values, **fit_growth(values)})

    for label, phase, key in FITTED:
        values = {w: summary[w][phase].get(key) for w in worlds if phase in summary[w]}
        if any(v is not None for v in values.values()):
            fit(label, values)
    for phase in PHASES:
        have = [w for w in worlds if phase in summary[w]]
        per, what = (steps, "per save") if phase == "save" else (1, "total")
        for kind in sorted({k for w in have for k in summary[w][phase]["by_kind"]}):
            fit(f"{phase}: {kind} ({what})", {w: summary[w][phase]["by_kind"].get(kind, {"n": 0})["n"] / per
                                              for w in have})
    for phase in PHASES:
        local = {w: summary[w][phase]["local_ops"]["categories"] for w in worlds
                 if phase in summary[w] and summary[w][phase].get("local_ops")}
        what = "per rank per save" if phase == "save" else "per rank"
        for cat in next(iter(local.values()), {}):
            fit(f"{phase}: local {cat} {what} (mean)", {w: c[cat]["per_rank"] for w, c in local.items()})
    return rows


def busiest_prefix_at_scale(summary: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """For each phase and W of :data:`EXTRAPOLATE_TO`: the requests per save (per restart) on the busiest prefix, its
    reads and writes, each from the better linear model of :func:`fit_growth`, and the rates they make spread over
    the phase's window measured at the largest W (``window_s``, ``at_w``): the assumption that a save's upload
    phase at that scale takes the time it took here."""
    out = []
    for phase in PHASES:
        have = [w for w in sorted(summary)
                if phase in summary[w] and summary[w][phase].get("busiest_prefix_requests") is not None]
        if not have:
            continue
        window = summary[have[-1]][phase].get("window_s")
        fits = {k: fit_growth({w: summary[w][phase][f"busiest_prefix_{k}"] for w in have})
                for k in ("requests", "reads", "writes")}
        for n in EXTRAPOLATE_TO:
            row: dict[str, Any] = {"phase": phase, "world": n, "window_s": window, "at_w": have[-1],
                                   "model": fits["requests"]["model"]}
            for k, f in fits.items():
                v = row[k] = f["linear"].get(str(n))
                row[f"{k}_per_s"] = v / window if v is not None and window else None
            out.append(row)
    return out


# ------------------------------------------------------------------------------------------ tables
def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v - round(v)) < 1e-9:
        return f"{int(round(v))}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _size(v: float | None) -> str:
    """A byte count in decimal units (k = 1,000, M = 1,000,000)."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if v is not None and abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return _num(v)


def _trio(spread: dict[str, Any] | None, fmt: Callable[[float | None], str] = _num) -> str:
    """A :func:`_spread` as "mean / rank 0 / busiest other rank"."""
    return " / ".join(fmt(spread.get(k)) for k in ("per_rank", "rank0", "max_other_rank")) if spread else ""


def _per_rank_rows(s: dict[str, Any]) -> dict[str, str]:
    """One phase of one W in the per-rank table (label -> cell)."""
    ops = s.get("local_ops") or {}
    cells = {f"local {cat}": _trio(spread) for cat, spread in ops.get("categories", {}).items()}
    if ops:
        off = [f"{c} {a['wrapped']}!={a['audited']}" for c, a in ops["audit"].items() if a["wrapped"] != a["audited"]]
        cells.update({"local: all calls": _trio(ops["all"]),
                      "local: opens that may create (mean)": _num(ops["creates"]),
                      "local: bytes read": _trio(ops["read_bytes"], _size),
                      "local: audit events = wrapped calls": ", ".join(off) if off else "yes"})
    if s.get("read_bytes_per_rank") is not None:
        cells["S3 bytes read"] = _trio({k: s[f"read_bytes_{k}"] for k in ("per_rank", "rank0", "max_other_rank")},
                                       _size)
        cells.update({f"S3 bytes read: {what} (mean)": _size(v) for what, v in s.get("read_bytes_by_what", {}).items()})
    return cells


def _target_rows(s: dict[str, Any]) -> dict[str, str]:
    """One phase of one W in the busiest key and prefix table (label -> cell)."""
    cells: dict[str, str] = {}
    key, prefix, root = s.get("busiest_key"), s.get("busiest_prefix"), s.get("root_prefix")
    if key:
        cells.update({"busiest key: requests": _num(key["requests"]), "busiest key: kind": key["kind"],
                      "busiest key: reads / writes": f"{_num(key['reads'])} / {_num(key['writes'])}"})
    if prefix:
        name = prefix["name"]
        which = ("step folder" if in_step_folder(name) else "root listing" if root and name == root["name"]
                 else name or "bucket")
        cells.update({"busiest prefix: requests": _num(prefix["requests"]), "busiest prefix: which": which,
                      "busiest prefix: reads / writes": f"{_num(prefix['reads'])} / {_num(prefix['writes'])}"})
    if root:
        cells["root listing prefix: requests"] = _num(root["requests"])
    if "window_s" in s:
        cells["window s"] = _num(s["window_s"])
        cells["busiest prefix: requests / s"] = _num(s["busiest_prefix_rate_per_s"])
    return cells


def _by_phase(summary: dict[int, dict[str, dict[str, Any]]], steps: int, title: str,
              cells_of: Callable[[dict[str, Any]], dict[str, str]]) -> list[str]:
    """One table per phase of ``cells_of``'s rows (in first-seen order), a column per W; none without rows."""
    worlds, lines = sorted(summary), []
    for phase in PHASES:
        cells = {w: cells_of(summary[w][phase]) for w in worlds if phase in summary[w]}
        if labels := list(dict.fromkeys(label for c in cells.values() for label in c)):
            per = f"per save (total / {steps})" if phase == "save" else "per restart"
            lines += ["", f"### {phase}: {title}, {per}", "", h.markdown_table(
                ["what", *(f"W={w}" for w in worlds)], [[lb, *(cells.get(w, {}).get(lb, "") for w in worlds)]
                                                         for lb in labels])]
    return lines


def render_scale(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`busiest_prefix_at_scale` as a table, with its assumption."""
    if not rows:
        return []
    heads = ["phase", "W", "model", "requests", "reads", "writes", "window s", "at W", "req/s", "reads/s", "writes/s"]
    return ["", "### busiest prefix at scale", "",
            "Requests per save (per restart) on the busiest prefix from the better linear fit (a + b*W or a/W + b) "
            "over the measured W; rates assume that these requests arrive spread evenly over the phase's window "
            "measured at the largest W run (save: the median over saves of the slowest rank's time from save() until "
            "durable and committed on every tier; restart: the slowest rank's restore), i.e. that a save's upload "
            f"phase at that scale takes the measured time. S3 documents {S3_PREFIX_WRITES_PER_S:,} writes (PUT, COPY, "
            f"POST, DELETE) and {S3_PREFIX_READS_PER_S:,} reads (GET, HEAD) a second per prefix.", "",
            h.markdown_table(heads, [[r["phase"], str(r["world"]), r["model"] or "-",
                                      *(_num(r[k]) for k in ("requests", "reads", "writes", "window_s")),
                                      str(r["at_w"]), *(_num(r[k]) for k in ("requests_per_s", "reads_per_s",
                                                                             "writes_per_s"))] for r in rows])]


def render(summary: dict[int, dict[str, dict[str, Any]]], fits: list[dict[str, Any]], steps: int) -> str:
    """The tables: each phase's counts by kind for every W; each rank's local-tier calls and bytes read; the
    busiest key and prefix, and the busiest prefix at scale; the fitted growth laws."""
    worlds, lines = sorted(summary), []
    for phase in PHASES:
        rows = [summary[w][phase] for w in worlds if phase in summary[w]]
        if not rows:
            continue
        per = steps if phase == "save" else 1
        cells: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
            (kind, lambda s, k=kind, d=per: s["by_kind"].get(k, {"n": 0})["n"] / d)
            for kind in sorted({k for r in rows for k in r["by_kind"]})]
        cells += [("**all**", lambda s, d=per: s["total"] / d), ("per rank", lambda s: s["per_rank"]),
                  ("rank 0", lambda s: s["rank0"]), ("busiest other rank", lambda s: s["max_other_rank"]),
                  ("manifest GET bytes per rank", lambda s: s["manifest_get_bytes_per_rank"]),
                  ("LIST response bytes", lambda s: s["list_bytes"]),
                  ("untagged (not a rank's)", lambda s: s["untagged"]), ("wall s (all ranks)", lambda s: s["wall_s"]),
                  ("phase s (slowest rank)", lambda s: s["phase_s"])]
        title = f"{phase}: requests per save (total / {steps})" if phase == "save" else f"{phase}: requests (total)"
        lines += ["", f"## {title}", "", h.markdown_table(
            ["kind", *(f"W={w}" for w in worlds)],
            [[label, *(_num(fn(summary[w][phase])) if phase in summary[w] else "" for w in worlds)]
             for label, fn in cells])]
    if per_rank := _by_phase(summary, steps, "per rank", _per_rank_rows):
        lines += ["", "## per rank: local-tier calls, bytes read", "",
                  "Local: counted inside each rank on its own local folder, the calls of the os functions (and open) "
                  "on paths there or on descriptors of files there, failed ones included: open (os.open, open), fsync "
                  "(fsync, fdatasync), rename (rename, replace, renameat2), mkdir, unlink (unlink, remove, rmdir), "
                  "listdir (listdir, scandir), stat (stat, lstat, fstat; os.path.exists and the like call stat); "
                  "bytes read: through os reads and open() there. S3: the response bodies of the rank's GETs. Each "
                  "cell with three numbers: the mean over ranks / rank 0 / the busiest other rank (of that row). "
                  "k = 1,000 bytes, M = 1,000,000.", *per_rank]
    if targets := _by_phase(summary, steps, "busiest key and prefix", _target_rows):
        lines += ["", "## busiest object key and prefix", "",
                  "A request counts against its object key and the key's prefix: the key up to and including its "
                  "step folder (run/step-0000000003/); a listing against its prefix parameter's (the root listing: "
                  "run/); a multi-object delete against each key it names. In the save phase a key or prefix in a "
                  "step folder belongs to that step's save, one outside (the root listing) is spread over the saves. "
                  "Window: the seconds the rate is taken over (save: the median over saves of the slowest rank's "
                  "time from save() until durable and committed on every tier; restart: the slowest rank's "
                  "restore).", *targets, *render_scale(busiest_prefix_at_scale(summary))]
    n1, n2 = EXTRAPOLATE_TO
    lines += ["", "## growth with W", "",
              "Fitted over W >= 2 (W = 1 runs the single-process protocol) when there are two such W. e: exponent "
              "of count ~ c*W^e (least squares over the W with count > 0); e tail: between the two largest W; "
              "pow@N: that power law at W = N. model: the better least-squares fit of a + b*W and a/W + b; "
              "lin@N: that model at W = N.", "",
              h.markdown_table(["metric", "e", "e tail", f"pow@{n1}", f"pow@{n2}", "model", "a", "b", f"lin@{n1}",
                                f"lin@{n2}"],
                               [[f["metric"], *("-" if v is None else f"{v:+.2f}"
                                                for v in (f["exponent"], f["exponent_tail"])),
                                 *(_num(f["power"].get(str(n))) for n in EXTRAPOLATE_TO), f["model"] or "-",
                                 *("-" if v is None else f"{v:.3g}" for v in (f["a"], f["b"])),
                                 *(_num(f["linear"].get(str(n))) for n in EXTRAPOLATE_TO)] for f in fits])]
    return "\n".join(lines)


def run(worlds: Iterable[int], *, steps: int = 3, numel: int = 512 * 1024, scratch: Path | None = None,
        timeout_s: float = 300.0, trace: bool = False) -> dict[str, Any]:
    """The whole benchmark (JSON-able): a counting server, every world size's phases, the summaries and the fits.
    ``scratch``: the ranks' local folders (a temporary folder by default); ``trace``: every request in each phase's
    summary too."""
    worlds = sorted(set(worlds))
    summary: dict[int, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierckpt-requests-")))
        scratch.mkdir(parents=True, exist_ok=True)
        server = stack.enter_context(counting_s3_server(trace=trace))
        for w in worlds:
            launches = run_world(server, w, scratch, steps=steps, numel=numel, timeout_s=timeout_s)
            summary[w] = {p: summarize_launch(launch, steps) for p, launch in launches.items()}
            h.log(f"W={w}: " + ", ".join(f"{p} {s['wall_s']:.1f} s" for p, s in summary[w].items()))
    fits = fit_all(summary, steps)
    return {"kind": "requests", "ranks": worlds, "steps": steps, "numel": numel, "state_bytes_per_rank": 4 * numel,
            "summary": {str(w): s for w, s in summary.items()}, "fits": fits,
            "busiest_prefix_at_scale": busiest_prefix_at_scale(summary), "table": render(summary, fits, steps)}


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__, markdown=False, scratch=False)
    p.add_argument("--dir", help="folder for the ranks' local tiers (default: a temporary folder)")
    p.add_argument("--ranks", default="1,2,4,8,16", help="world sizes, comma-separated (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="saves per world size (default %(default)s)")
    p.add_argument("--numel", type=int, default=512 * 1024, help="float32 values per rank (default %(default)s: 2 MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch of W ranks (default %(default)s)")
    p.add_argument("--trace", action="store_true", help="every request (rank, method, path, status) in the JSON")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="run nothing: fit and print the tables of a JSON that --out wrote")
    args = p.parse(argv)
    if args.render is not None:
        old = json.loads(args.render.read_text())
        summary = {int(w): s for w, s in old["summary"].items()}
        print(render(summary, fit_all(summary, old["steps"]), old["steps"]))
        return 0
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not worlds or min(worlds) < 1 or args.steps < 1:
        p.error("--ranks needs positive world sizes and --steps a positive count")
    report = run(worlds, steps=args.steps, numel=args.numel, scratch=Path(args.dir) if args.dir else None,
                 timeout_s=args.timeout, trace=args.trace)
    print(report["table"])
    h.finish(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
