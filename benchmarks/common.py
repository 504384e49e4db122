"""Helpers shared by the benchmark scripts: timing, cache control, raw I/O, RSS sampling, S3 loopback, reports.

Importing this module puts the repository root on ``sys.path`` (when it is not there already) so that the scripts
measure the working tree's ``tierckpt`` without an install step. The library is optional: :func:`import_tierckpt`
returns ``None`` and a reason when it is missing or incomplete, and every script skips its tierckpt part cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GiB = 1 << 30
MiB = 1 << 20

# DCP and torch.load emit deprecation/experimental warnings on every call; they clutter the tables.
warnings.filterwarnings("ignore", module=r"torch(\..*)?$")


# --------------------------------------------------------------------------------------------------------------
# tierckpt
# --------------------------------------------------------------------------------------------------------------


def import_tierckpt() -> tuple[ModuleType | None, str]:
    """Import ``tierckpt`` and check that its public entry point exists.

    Returns ``(module, "")`` when ``tierckpt.CheckpointManager`` is importable, else ``(None, reason)``.
    """
    try:
        import tierckpt
    except Exception as exc:  # any import-time failure means "not ready": skip, do not crash the benchmarks
        return None, f"import tierckpt failed: {type(exc).__name__}: {exc}"
    if not hasattr(tierckpt, "CheckpointManager"):
        return None, "tierckpt has no CheckpointManager yet"
    return tierckpt, ""


def tierckpt_version(mod: ModuleType | None) -> str | None:
    """The library version string, or ``None``."""
    if mod is None:
        return None
    return str(
        getattr(mod, "__version__", None) or getattr(getattr(mod, "_version", None), "__version__", "?")
    )


# --------------------------------------------------------------------------------------------------------------
# scratch space and the page cache
# --------------------------------------------------------------------------------------------------------------


def scratch_dir(path: str | os.PathLike[str] | None) -> Path:
    """Create and return the scratch folder (default ``REPO_ROOT/.bench``), refusing tmpfs/ramfs.

    A benchmark of disk writes on a RAM-backed file system would measure memcpy, so this raises ``SystemExit``
    when the chosen folder lives on tmpfs or ramfs.
    """
    root = Path(path) if path else REPO_ROOT / ".bench"
    root.mkdir(parents=True, exist_ok=True)
    fstype = filesystem_type(root)
    if fstype in {"tmpfs", "ramfs"}:
        raise SystemExit(f"scratch dir {root} is on {fstype}; pass --dir on a real disk")
    return root


def filesystem_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or ``"?"``."""
    best, fstype = "", "?"
    resolved = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1]
                    inside = resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/")
                    if inside and len(mnt) > len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def fresh_dir(root: Path, name: str) -> Path:
    """A new, empty, uniquely named folder under ``root``."""
    d = root / f"{name}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


def remove(path: Path) -> None:
    """Delete a file or folder (if present) and flush the deletion to disk, outside any timed region."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    os.sync()


_DROP_STATE: dict[str, Any] = {"ok": None, "error": ""}


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (``/proc/sys/vm/drop_caches``). Returns whether it worked.

    The first failure is remembered (:func:`drop_caches_status`) so reports can say that "cold" numbers were not
    really cold.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        ok = True
    except OSError as exc:
        ok = False
        _DROP_STATE["error"] = f"{type(exc).__name__}: {exc}"
    if _DROP_STATE["ok"] is None or not ok:
        _DROP_STATE["ok"] = ok
    return ok


def drop_caches_status() -> dict[str, Any]:
    """Whether dropping the page cache worked every time it was asked (``None``: never asked)."""
    return dict(_DROP_STATE)


# --------------------------------------------------------------------------------------------------------------
# raw bytes of tensors
# --------------------------------------------------------------------------------------------------------------


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def split_balanced(tensors: Sequence[torch.Tensor], n: int) -> list[list[int]]:
    """Partition tensor indices into ``n`` groups of nearly equal total bytes (largest first, greedy)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].nbytes)
    groups: list[list[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in order:
        g = sizes.index(min(sizes))
        groups[g].append(i)
        sizes[g] += tensors[i].nbytes
    for g in groups:
        g.sort()
    return groups


def write_all(fd: int, mv: memoryview) -> None:
    """``os.write`` until every byte of ``mv`` is written (large writes may be partial)."""
    off, n = 0, len(mv)
    while off < n:
        off += os.write(fd, mv[off : off + (1 << 30)])


def write_file(path: Path, tensors: Sequence[torch.Tensor]) -> None:
    """Write the tensors' bytes back to back into ``path`` and fsync it (the raw-write limit)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            if t.nbytes:
                write_all(fd, byte_view(t))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file_into(path: Path, tensors: Sequence[torch.Tensor]) -> None:
    """Read ``path`` back into preallocated tensors, in order (the raw-read limit)."""
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            if not t.nbytes:
                continue
            mv = byte_view(t)
            off = 0
            while off < len(mv):
                n = f.readinto(mv[off:])
                if not n:
                    raise EOFError(path)
                off += n


#: O_DIRECT needs page-aligned buffers, offsets and lengths; the pieces of a direct transfer. 32 MiB, the size
#: tierckpt's writers use: on the benchmark host 16-128 MiB pieces wrote 6-10% faster than 8 MiB ones (reads: no
#: difference), and the write limit must be the fastest raw write, not one tierckpt beats by its piece size
DIRECT_ALIGN = 4096
DIRECT_CHUNK = 32 << 20


def pack_aligned(tensors: Sequence[torch.Tensor], *, huge: bool = False) -> memoryview:
    """The tensors' bytes back to back in one new page-aligned buffer (what an ``O_DIRECT`` transfer needs).

    ``huge``: on transparent huge pages where the kernel offers them (the same memory tierckpt's staging buffers
    use by default): a direct transfer of it moves 2 MiB DMA segments instead of 4 KiB pages, the faster raw way."""
    from tierckpt.snapshot.staging import aligned_empty  # the memory tierckpt stages in, either way

    total = sum(t.nbytes for t in tensors)
    buf = aligned_empty(total, pin=False, huge=huge)
    off = 0
    for t in tensors:
        if t.nbytes:
            buf[off : off + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            off += t.nbytes
    return memoryview(buf.numpy())


def _direct_transfer(path: Path, buf: memoryview, write: bool) -> None:
    """Move ``buf`` to/from ``path`` with ``O_DIRECT`` in 8 MiB pieces; the unaligned tail goes buffered."""
    o_direct = getattr(os, "O_DIRECT", 0)
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | o_direct, 0o644)
    try:
        aligned = len(buf) - len(buf) % DIRECT_ALIGN
        for start in range(0, aligned, DIRECT_CHUNK):
            piece = buf[start : min(start + DIRECT_CHUNK, aligned)]
            done = os.pwrite(fd, piece, start) if write else os.preadv(fd, [piece], start)
            if done != len(piece):
                raise OSError(f"short direct transfer on {path}")
        if aligned < len(buf):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~o_direct)
            tail = buf[aligned:]
            if (os.pwrite(fd, tail, aligned) if write else os.preadv(fd, [tail], aligned)) != len(tail):
                raise OSError(f"short tail transfer on {path}")
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_file_direct(path: Path, buf: memoryview) -> None:
    """Write a page-aligned buffer with ``O_DIRECT`` and fsync it (the raw-write limit without the page cache)."""
    _direct_transfer(path, buf, write=True)


def read_file_direct(path: Path, buf: memoryview) -> None:
    """Read ``path`` into a page-aligned buffer with ``O_DIRECT`` (the raw-read limit without the page cache)."""
    _direct_transfer(path, buf, write=False)


def read_into_page_cache(folder: Path) -> None:
    """Read every file under ``folder`` through the page cache (buffered, untimed): what a "warm" load needs where
    the load before it read around the cache (``O_DIRECT``) and so left nothing there."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def fsync_path(path: Path) -> None:
    """fsync a file written by someone else (e.g. a library that does not fsync), then its folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a folder so that the entries created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file below ``root`` and every folder, with two threads."""
    files = [p for p in root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(fsync_path, files))
    fsync_dir(root)


def parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """Run ``fn(0..n-1)`` on ``n`` threads and return the results (exceptions propagate)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


# --------------------------------------------------------------------------------------------------------------
# timing and statistics
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def timed(out: dict[str, float], key: str) -> Iterator[None]:
    """Store the wall time of the block (perf_counter seconds) in ``out[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out[key] = time.perf_counter() - t0


def median(xs: Sequence[float]) -> float | None:
    """Median of the finite values, ``None`` when there are none."""
    vals = [x for x in xs if isinstance(x, (int, float)) and x == x]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` or ``None`` when either is missing or ``b`` is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def settle() -> None:
    """Collect garbage so that a previous case's memory is released before the next one starts."""
    gc.collect()


# --------------------------------------------------------------------------------------------------------------
# other processes' CPU use (the machine may be shared)
# --------------------------------------------------------------------------------------------------------------


def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall, busy CPU seconds of the whole machine, CPU seconds of this process)`` right now."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.perf_counter(), (sum(fields[:8]) - idle) / hz, t.user + t.system


def foreign_cpu(since: tuple[float, float, float]) -> float:
    """Mean number of cores that *other* processes kept busy since the snapshot ``since`` (0 = quiet machine)."""
    now = cpu_snapshot()
    wall = now[0] - since[0]
    if wall <= 0:
        return 0.0
    return max(0.0, ((now[1] - since[1]) - (now[2] - since[2])) / wall)


def _block_stat(path: Path) -> Path | None:
    """``/sys/dev/block/MAJ:MIN/stat`` of the device holding ``path`` (Linux), or None."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def disk_idle(path: Path, max_wait: float = 5.0, quiet: float = 0.2) -> float:
    """Flush dirty pages, then wait (up to ``max_wait`` s) until the disk holding ``path`` has had no request in
    flight and has completed none for ``quiet`` seconds; returns the seconds waited.

    Every timed write and cold read calls this first, so that no measurement pays for the one before it: the
    write-back of its pages, or (on a file system mounted with ``discard``, like the reference VM's) the discards
    of the files it deleted, which the disk processes after the deleting call has returned. Checkpoints minutes
    apart in a training run see a settled disk, too. Without the block device's statistics (not Linux; an overlay
    file system) it only flushes.
    """
    t0 = time.perf_counter()
    os.sync()
    stat = _block_stat(path)
    if stat is None:
        return time.perf_counter() - t0

    def sample() -> tuple[int, tuple[int, ...]]:
        f = [int(x) for x in stat.read_text().split()]
        # completed reads, writes, discards (fields 1, 5, 12; 12 exists since Linux 4.18), and in flight (9)
        return f[8], (f[0], f[4], f[11] if len(f) > 11 else 0)

    last = sample()[1]
    still_since = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        time.sleep(0.02)
        inflight, done = sample()
        now = time.perf_counter()
        if inflight or done != last:
            last, still_since = done, now
        elif now - still_since >= quiet:
            break
    return time.perf_counter() - t0


def wait_for_quiet(max_wait: float, threshold: float = 0.3, probe: float = 0.5) -> tuple[float, float]:
    """Wait (up to ``max_wait`` seconds) until other processes use under ``threshold`` cores over ``probe`` s.

    Returns ``(seconds waited, foreign cores in the last probe)``. The benchmarks call it before each case so
    that a shared machine's bursts (a test suite next door) hit fewer measurements; the returned load is recorded.
    """
    t0 = time.perf_counter()
    while True:
        snap = cpu_snapshot()
        time.sleep(probe)
        load = foreign_cpu(snap)
        waited = time.perf_counter() - t0
        if load < threshold or waited >= max_wait:
            return waited, load
        time.sleep(1.0)


# --------------------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is in the bench extra
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    """Peak RSS of this process over its lifetime (``getrusage``; Linux reports KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class RssSampler:
    """Sample RSS every ``interval`` seconds in a thread; ``peak`` is the highest value seen while running."""

    interval: float = 0.01
    peak: int = 0
    samples: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            v = rss_bytes()
            self.peak = max(self.peak, v)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# --------------------------------------------------------------------------------------------------------------
# S3 on loopback
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_loopback(bucket: str = "bench", *, own_process: bool = False) -> Iterator[dict[str, Any]]:
    """Start moto's S3 server on a free loopback port, create ``bucket``, and yield connection details.

    Yields ``{"endpoint_url", "bucket", "storage_options"}`` where ``storage_options`` is what fsspec/s3fs (and
    ``CheckpointManager(storage_options=...)``) needs. ``own_process``: run the server in a process of its own
    (``python -m moto.server``), so that its request handling does not share this process's GIL with what is
    measured; else in threads of this process. Raises ``ImportError`` when moto or s3fs is missing.
    """
    import logging
    import socket
    import subprocess

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "y")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    proc: subprocess.Popen[bytes] | None = None
    server: ThreadedMotoServer | None = None
    if own_process:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            host, port = sock.getsockname()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's server did not start")
            time.sleep(0.1)
    else:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
    try:
        endpoint = f"http://{host}:{port}"
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "x", "secret": "y"}
        import s3fs

        fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
        fs.mkdir(bucket)
        yield {"endpoint_url": endpoint, "bucket": bucket, "storage_options": opts}
    finally:
        if server is not None:
            server.stop()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


# --------------------------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------------------------


def machine_description(scratch: Path) -> dict[str, Any]:
    """CPU, cores, RAM, kernel, file system and software versions, for the report."""
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
                break
    try:
        import numpy

        np_version = numpy.__version__
    except ImportError:  # pragma: no cover
        np_version = None
    try:
        import safetensors

        st_version = safetensors.__version__
    except ImportError:  # pragma: no cover
        st_version = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(mem / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np_version,
        "safetensors": st_version,
        "cuda": torch.cuda.is_available(),
        "scratch_dir": str(scratch),
        "scratch_fs": filesystem_type(scratch),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def fmt(x: float | None, digits: int = 3) -> str:
    """Format a number for a table cell ('-' when missing)."""
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned numeric columns."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [row[i].rjust(widths[i]) for i in range(1, len(row))]
        lines.append("  ".join(parts))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table as GitHub-flavoured Markdown."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |")
    return "\n".join(out)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON (NaN/inf become null)."""

    def clean(o: Any) -> Any:
        if isinstance(o, float) and (o != o or o in (float("inf"), float("-inf"))):
            return None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    Path(path).write_text(json.dumps(clean(obj), indent=2) + "\n")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The ``--dir``, ``--out`` and ``--markdown`` options every benchmark script takes."""
    p.add_argument("--dir", help="scratch folder on a real disk (default: REPO/.bench)")
    p.add_argument("--out", help="write results as JSON here")
    p.add_argument("--markdown", help="write the table as Markdown here")


def emit_table(args: argparse.Namespace, kind: str, table: str, scratch: Path, tc: ModuleType,
               **fields: Any) -> None:
    """Print a script's one-table report; write it as JSON (with the arguments, the machine, the library's version
    and ``fields``) to ``args.out`` and as Markdown to ``args.markdown`` where asked."""
    print(table)
    if args.out:
        write_json(args.out, {"kind": kind, "args": vars(args), **fields, "machine": machine_description(scratch),
                              "tierckpt_version": tc.__version__, "markdown": table})
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


def case_rows(label: str, runs: dict[str, list[float]], base: str, peer: str, nbytes: int,
              summary: dict[str, Any]) -> list[list[str]]:
    """Table rows for one setting (``label``) of a script that times cases against one another: each case's median
    seconds, GB/s over ``nbytes``, and its ratio to the ``base`` case and to the ``peer`` case; each case's median and
    all its times also go into ``summary`` under ``"<label> <case>"``."""
    b, p = median(runs[base]), median(runs[peer])
    rows = []
    for case, times in runs.items():
        m = median(times)
        rows.append([label, case, f"{m:.3f}", f"{nbytes / m / 1e9:.2f}", f"{ratio(m, b):.2f}x", f"{ratio(m, p):.2f}x"])
        summary[f"{label} {case}"] = {"median_s": m, "all_s": times}
    return rows


def plain_put_s3(src: Path, url: str, storage_options: dict[str, Any]) -> float:
    """The peer of tierckpt's uploads: one recursive s3fs ``fs.put`` of folder ``src`` to ``url``, nothing checked;
    seconds. The objects are removed afterwards (not timed)."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options, skip_instance_cache=True)
    t0 = time.perf_counter()
    fs.put(str(src), url, recursive=True)
    dt = time.perf_counter() - t0
    fs.rm(url, recursive=True)
    return dt
