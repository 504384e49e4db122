"""What the benchmark scripts share: command line and report, the benchmark state, scratch folders and the page
cache, a quiet disk and machine, raw I/O (the hardware limits), timing, RSS, S3 on loopback, child processes.

Importing it puts the repository root on ``sys.path``: the scripts measure the working tree's ``tierckpt`` without
an install. It imports the standard library and torch only (moto, s3fs and matplotlib where they are used), so that
``gpu_check.py`` runs where only torch and tierckpt are installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
BENCH_DIR = REPO_ROOT / ".bench"  # scratch folders and default results files (git-ignored)
GiB = 1 << 30
Metrics = dict[str, Any]
warnings.filterwarnings("ignore", module=r"torch(\..*)?$")  # DCP and torch.load warn on every call


# ------------------------------------------------------------------------------------------ command line, report
class Cli(argparse.ArgumentParser):
    """A script's command line: its docstring as help, ``--out`` (results JSON, default ``.bench/<script>.json``),
    and where wanted ``--markdown`` and ``--dir`` (the scratch folder)."""

    def __init__(self, doc: str | None, script: str, *, markdown: bool = True, scratch: bool = True) -> None:
        self.script = Path(script).resolve()
        super().__init__(prog=f"benchmarks/{self.script.name}", description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_argument("--out", default=str(BENCH_DIR / f"{self.script.stem}.json"),
                          help=f"write the results as JSON here (default: .bench/{self.script.stem}.json)")
        if markdown:
            self.add_argument("--markdown", help="also write the tables as Markdown here")
        if scratch:
            self.add_argument("--dir", help="scratch folder on a real disk (default: REPO/.bench)")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The options, remembering the command line that gave them (for :func:`finish`)."""
        words = list(sys.argv[1:] if argv is None else argv)
        args = self.parse_args(words)
        args._command = shlex.join([_short(sys.executable), _short(self.script), *words])
        return args


def _short(p: str | Path) -> str:
    """``p`` relative to the current folder where it lies inside it."""
    with contextlib.suppress(ValueError):
        return str(Path(p).relative_to(Path.cwd()))
    return str(p)


def finish(args: argparse.Namespace, result: dict[str, Any], markdown: str | None = None) -> Path:
    """The end of every run: ``result`` with the options (``args``) and the command line (``command``) written as
    JSON to ``--out``, ``markdown`` to ``--markdown`` where asked; prints the results file and how to reproduce it."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    opts = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    write_json(out, {**result, "args": result.get("args", opts), "command": args._command})
    if markdown is not None and getattr(args, "markdown", None):
        Path(args.markdown).write_text(markdown)
    print(f"\nresults: {_short(out.resolve())}\nreproduce: {args._command}", flush=True)
    return out


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """``obj`` as indented JSON, NaN and infinities as null, other objects (paths) as text."""

    def clean(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        return [clean(v) for v in o] if isinstance(o, (list, tuple)) else o

    Path(path).write_text(json.dumps(clean(obj), indent=1, default=str) + "\n")


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fmt(x: Any, digits: int = 3) -> str:
    """A table cell: text as it is, a number with ``digits`` decimals (none from 100 up), ``-`` for nothing."""
    if x is None or isinstance(x, (str, bool)):
        return "-" if x is None else str(x)
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.{digits}f}"


def markdown_table(heads: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table of :func:`fmt` cells that lines up in a terminal too (columns of numbers right-aligned)."""
    cells = [list(heads)] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(heads))]
    right = [all(c.lstrip("+-")[:1].isdigit() for r in cells[1:] if (c := r[i]) not in ("", "-"))
             for i in range(len(heads))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(r, widths, right)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def sections(tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]]) -> str:
    """``(title, heads, rows)`` tables as Markdown under ``####`` headings (as the docs render them)."""
    return "\n\n".join(f"#### {title}\n\n{markdown_table(heads, rows)}" for title, heads, rows in tables) + "\n"


def case_rows(label: str, runs: dict[str, list[float]], base: str, peer: str, nbytes: int,
              summary: dict[str, Any]) -> list[list[str]]:
    """Rows of cases timed against one another in one setting (``label``): median seconds, GB/s over ``nbytes``,
    ratios to the ``base`` and ``peer`` cases; ``summary["<label> <case>"]`` gets the median and every time."""
    b, p = median(runs[base]), median(runs[peer])
    rows = []
    for case, times in runs.items():
        m = median(times)
        rows.append([label, case, f"{m:.3f}", f"{nbytes / m / 1e9:.2f}", f"{ratio(m, b):.2f}x", f"{ratio(m, p):.2f}x"])
        summary[f"{label} {case}"] = {"median_s": m, "all_s": times}
    return rows


def machine(scratch: Path) -> dict[str, Any]:
    """The machine and software of a run, for its results file."""
    info: dict[str, Any] = {"cpu": platform.processor() or "?", "ram_gib": 0.0}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), info["cpu"])
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        info["ram_gib"] = round(int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) / (1 << 20), 1)
    for name in ("numpy", "safetensors"):
        with contextlib.suppress(ImportError):
            info[name] = __import__(name).__version__
    return {**info, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "scratch_dir": str(scratch), "scratch_fs": filesystem_type(scratch),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def rotate(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` starting at ``r`` (modulo their count): repeat ``r``'s order, so that none always goes first."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


# ------------------------------------------------------------------------------------------ tierckpt, torch
def import_tierckpt() -> tuple[ModuleType | None, str]:
    """``(tierckpt, "")``, or ``(None, why)`` where it does not import or lacks ``CheckpointManager``: the scripts
    then skip its part and say why."""
    try:
        import tierckpt
    except Exception as exc:  # any import-time failure means "not ready"
        return None, f"import tierckpt failed: {type(exc).__name__}: {exc}"
    return (tierckpt, "") if hasattr(tierckpt, "CheckpointManager") else (None, "tierckpt has no CheckpointManager")


def need_tierckpt(what: str) -> ModuleType:
    """tierckpt, or exit 0 saying that ``what`` (which measures nothing without it) was skipped."""
    tc, why = import_tierckpt()
    if tc is None:
        print(f"{what} skipped: {why}")
        raise SystemExit(0)
    return tc


def default_stager_available() -> bool:
    """Whether this torch has DCP's ``DefaultStager``."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    except ImportError:
        return False
    return True



def dcp_async_times(resp: Any, t0: float) -> dict[str, float]:
    """The times of one ``dcp.async_save`` started at ``t0`` that has just returned ``resp``: ``stall_return`` (the
    bare return), ``stall`` (until its stager's ``staging_completion``, where it returned an ``AsyncSaveResponse``:
    only then may the tensors change) and ``durable`` (its write completed; the caller fsyncs where it must)."""
    out = {"stall_return": time.perf_counter() - t0}
    fut = resp
    if hasattr(resp, "staging_completion"):
        resp.staging_completion.result()
        fut = resp.upload_completion
    out["stall"] = time.perf_counter() - t0 if fut is not resp else out["stall_return"]
    fut.result()
    out["durable"] = time.perf_counter() - t0
    return out

# ------------------------------------------------------------------------------------------ the state
BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight + fp32 master weight, exp_avg, exp_avg_sq
CONTEXT, BASE_VOCAB = 1024, 32000


def layers_for(n_tensors: int) -> int:
    """The layer count whose state has about ``n_tensors`` tensors."""
    return max(1, round((n_tensors / 4 - 3) / 12))


def plan_shapes(total_bytes: int, n_layer: int = 12) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-2-shaped decoder's parameters whose training state is about ``total_bytes``: the hidden size from the
    bytes and layers, then the vocabulary so that the total lands within one embedding row."""
    params = total_bytes / BYTES_PER_PARAM
    a, b = 12 * n_layer, 13 * n_layer + BASE_VOCAB + CONTEXT + 2  # per layer 12 d^2 + 13 d; outside (V + C + 2) d
    d = max(64, int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)) // 64 * 64)
    while True:
        vocab = int((params - (12 * n_layer * d * d + (13 * n_layer + CONTEXT + 2) * d)) // d)
        if vocab >= 256 or d == 64:
            break
        d -= 64
    layer = [("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (3 * d, d)),
             ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
             ("ln_2.weight", (d,)), ("ln_2.bias", (d,)), ("mlp.c_fc.weight", (4 * d, d)), ("mlp.c_fc.bias", (4 * d,)),
             ("mlp.c_proj.weight", (d, 4 * d)), ("mlp.c_proj.bias", (d,))]
    return [("wte.weight", (max(vocab, 1), d)), ("wpe.weight", (CONTEXT, d)),
            *((f"h.{i}.{name}", shape) for i in range(n_layer) for name, shape in layer),
            ("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def gpt_state(total_bytes: int, *, n_layer: int | None = None, n_tensors: int | None = None, seed: int = 0,
              device: str = "cpu", zeros: bool = False) -> dict[str, Any]:
    """The benchmark state, about ``total_bytes``: per parameter of :func:`plan_shapes` the bf16 weight (``model``)
    and the fp32 master weight and AdamW moments (``optimizer``): 14 bytes a parameter, ``4 * (3 + 12 * n_layer)``
    tensors (592 with the default 12 layers; ``n_tensors`` picks the layers) from a few hundred bytes to hundreds of
    MiB. Random with a fixed seed, or ``zeros`` (what a restarted job holds before it restores). String keys, so that
    every peer stores it unchanged."""
    n_layer = n_layer or (layers_for(n_tensors) if n_tensors else 12)
    gen = torch.Generator(device=device).manual_seed(seed)
    tree: dict[str, Any] = {"model": {}, "optimizer": {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}}
    opt = tree["optimizer"]
    for name, shape in plan_shapes(total_bytes, n_layer):
        if zeros:
            w, m1, m2 = (torch.zeros(shape, device=device) for _ in range(3))
        else:
            w = torch.randn(shape, generator=gen, device=device) * 0.02
            m1 = torch.randn(shape, generator=gen, device=device) * 1e-3
            m2 = torch.rand(shape, generator=gen, device=device) * 1e-6
        tree["model"][name], opt["master"][name], opt["exp_avg"][name], opt["exp_avg_sq"][name] = (
            w.to(torch.bfloat16), w, m1, m2)
    return tree


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted key, tensor)`` of every tensor of a nested dict, in order."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(tree)]


def flatten(tree: Any) -> dict[str, torch.Tensor]:
    """The state as one ``{dotted key: tensor}`` dict (what safetensors stores)."""
    return dict(iter_tensors(tree))


def empty_like_state(tree: Any) -> Any:
    """A zero-filled state of the same structure (pages touched: nothing timed faults them in)."""
    if isinstance(tree, dict):
        return {k: empty_like_state(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def copy_into(dst: Any, src: Any) -> None:
    """Copy a nested state, or the flat dict of one, into ``dst`` in place."""
    flat = flatten(src) if any(isinstance(v, dict) for v in src.values()) else src
    for k, t in iter_tensors(dst):
        t.copy_(flat[k])


def state_bytes(tree: Any) -> int:
    return sum(t.nbytes for t in tensors(tree))


def states_equal(a: Any, b: Any) -> bool:
    """Whether two states hold bit-identical tensors under the same keys."""
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k].to(fa[k].device)) for k in fa)


def describe(tree: Any) -> dict[str, Any]:
    """Bytes, tensors, bytes by dtype, the smallest, median and largest tensor."""
    ts = tensors(tree)
    sizes = sorted(t.nbytes for t in ts)
    dtypes: dict[str, int] = {}
    for t in ts:
        dtypes[str(t.dtype).removeprefix("torch.")] = dtypes.get(str(t.dtype).removeprefix("torch."), 0) + t.nbytes
    return {"bytes": sum(sizes), "gib": sum(sizes) / GiB, "tensors": len(ts), "bytes_by_dtype": dtypes,
            "smallest_tensor_bytes": sizes[0], "median_tensor_bytes": sizes[len(sizes) // 2],
            "largest_tensor_bytes": sizes[-1]}


# ------------------------------------------------------------------------------------------ scratch, page cache, quiet
def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (``/proc/mounts``), or ``?``."""
    best, fstype, where = "", "?", str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for _dev, mnt, kind, *_ in (line.split() for line in f):
            if (where == mnt or where.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, kind
    return fstype


def scratch_dir(path: str | os.PathLike[str] | None) -> Path:
    """The scratch folder (default ``.bench``), made; tmpfs or ramfs is refused: a disk benchmark there measures
    memcpy."""
    root = Path(path) if path else BENCH_DIR
    root.mkdir(parents=True, exist_ok=True)
    if (fstype := filesystem_type(root)) in {"tmpfs", "ramfs"}:
        raise SystemExit(f"scratch dir {root} is on {fstype}; pass --dir on a real disk")
    return root


def fresh_dir(root: Path, name: str) -> Path:
    """A new, empty, uniquely named folder under ``root``."""
    (d := root / f"{name}-{uuid.uuid4().hex[:8]}").mkdir(parents=True)
    return d


def remove(path: Path) -> None:
    """Delete a file or folder (where there) and flush the deletion, outside any timed region."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    os.sync()


_DROPS: dict[str, Any] = {"ok": None, "error": ""}


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); whether it worked. A failure is remembered
    (:func:`drop_caches_status`) so that the reports say "cold" numbers were warm."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        ok = True
    except OSError as exc:
        ok, _DROPS["error"] = False, f"{type(exc).__name__}: {exc}"
    if _DROPS["ok"] is None or not ok:
        _DROPS["ok"] = ok
    return ok


def drop_caches_status() -> dict[str, Any]:
    """``ok``: whether every page-cache drop worked (None: none asked); ``error``: the first failure."""
    return dict(_DROPS)


def drop_files(folder: Path) -> None:
    """Drop the (fsynced, clean) files under ``folder`` from the page cache, the rest of the machine's cache kept."""
    for p in (p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(folder: Path) -> None:
    """Read every file under ``folder`` through the page cache: what a warm load needs after a load that read around
    the cache (``O_DIRECT``)."""
    for p in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def disk_idle(path: Path, max_wait: float = 5.0, quiet: float = 0.2) -> float:
    """Flush dirty pages, then wait (up to ``max_wait`` s) until the disk of ``path`` has had no request in flight and
    completed none for ``quiet`` s (``/sys/dev/block/MAJ:MIN/stat``); the seconds waited.

    Every timed write and cold read calls it first, so that no measurement pays for the one before: its write-back,
    or (on a file system mounted with ``discard``, like the reference VM's) the discards of files it deleted, which
    the disk works through after the deleting call returned. Checkpoints minutes apart see a settled disk too."""
    t0 = time.perf_counter()
    os.sync()
    try:
        dev = os.stat(path).st_dev
        stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")

        def sample() -> tuple[int, tuple[int, ...]]:  # in flight; reads, writes, discards completed (Linux >= 4.18)
            f = [int(x) for x in stat.read_text().split()]
            return f[8], (f[0], f[4], f[11] if len(f) > 11 else 0)

        last, still_since = sample()[1], time.perf_counter()
    except OSError:  # no block device statistics here: flushing is all
        return time.perf_counter() - t0
    while time.perf_counter() - t0 < max_wait:
        time.sleep(0.02)
        inflight, done = sample()
        if inflight or done != last:
            last, still_since = done, time.perf_counter()
        elif time.perf_counter() - still_since >= quiet:
            break
    return time.perf_counter() - t0


def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall, busy CPU seconds of the machine, CPU seconds of this process)`` now."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    t = os.times()
    busy = sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # less idle and iowait
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def foreign_cpu(since: tuple[float, float, float]) -> float:
    """The mean number of cores that other processes kept busy since ``since``."""
    now = cpu_snapshot()
    wall = now[0] - since[0]
    return max(0.0, ((now[1] - since[1]) - (now[2] - since[2])) / wall) if wall > 0 else 0.0


def wait_for_quiet(max_wait: float, threshold: float = 0.3, probe: float = 0.5) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until other processes use under ``threshold`` cores, so that a shared machine's
    bursts (a test suite next door) hit fewer measurements; ``(seconds waited, their load)``."""
    t0 = time.perf_counter()
    while True:
        snap = cpu_snapshot()
        time.sleep(probe)
        load, waited = foreign_cpu(snap), time.perf_counter() - t0
        if load < threshold or waited >= max_wait:
            return waited, load
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------ raw I/O: the limits
#: O_DIRECT wants page-aligned buffers, offsets and lengths. 32 MiB pieces, as tierckpt's writers: on the reference
#: VM 16-128 MiB wrote 6-10% faster than 8 MiB, and the limit must be the fastest raw write, not one beaten by size
DIRECT_ALIGN, DIRECT_CHUNK = 4096, 32 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def split_balanced(ts: Sequence[torch.Tensor], n: int) -> list[list[int]]:
    """Tensor indices in ``n`` groups of nearly equal bytes (largest first, greedy), each group in order."""
    groups: list[list[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in sorted(range(len(ts)), key=lambda i: -ts[i].nbytes):
        g = sizes.index(min(sizes))
        groups[g].append(i)
        sizes[g] += ts[i].nbytes
    return [sorted(g) for g in groups]


def parallel(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``fn(0)`` ... ``fn(n - 1)`` on ``n`` threads (an exception propagates)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def write_file(path: Path, ts: Sequence[torch.Tensor]) -> None:
    """The tensors' bytes back to back into ``path`` with ``os.write``, fsynced: the buffered raw write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for mv in (byte_view(t) for t in ts if t.nbytes):
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off : off + GiB])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file_into(path: Path, ts: Sequence[torch.Tensor]) -> None:
    """``path`` read back into preallocated tensors with ``readinto``: the buffered raw read."""
    with open(path, "rb", buffering=0) as f:
        for mv in (byte_view(t) for t in ts if t.nbytes):
            off = 0
            while off < len(mv):
                if not (n := f.readinto(mv[off:])):
                    raise EOFError(path)
                off += n


def pack_aligned(ts: Sequence[torch.Tensor], *, huge: bool = False) -> memoryview:
    """The tensors' bytes in one new page-aligned buffer (what ``O_DIRECT`` needs); ``huge``: on transparent huge
    pages where the kernel has them, tierckpt's staging memory, whose 2 MiB DMA segments transfer faster."""
    from tierckpt.snapshot.staging import aligned_empty

    buf = aligned_empty(sum(t.nbytes for t in ts), pin=False, huge=huge)
    off = 0
    for t in ts:
        buf[off : off + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        off += t.nbytes
    return memoryview(buf.numpy())


def direct_io(path: Path, buf: memoryview, *, write: bool) -> None:
    """Write (and fsync) or read ``path`` from or into a page-aligned buffer with ``O_DIRECT`` in
    :data:`DIRECT_CHUNK` pieces, an unaligned tail through the page cache; ``OSError`` where there is no O_DIRECT."""
    o_direct = getattr(os, "O_DIRECT", 0)
    fd = os.open(path, ((os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY) | o_direct, 0o644)
    try:
        aligned = len(buf) - len(buf) % DIRECT_ALIGN
        spans = [(s, min(s + DIRECT_CHUNK, aligned)) for s in range(0, aligned, DIRECT_CHUNK)]
        for start, end in spans + ([(aligned, len(buf))] if aligned < len(buf) else []):
            if start == aligned:  # the unaligned tail
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~o_direct)
            piece = buf[start:end]
            if (os.pwrite(fd, piece, start) if write else os.preadv(fd, [piece], start)) != len(piece):
                raise OSError(f"short transfer on {path}")
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path, *, folder: bool = True) -> None:
    """fsync a file (or folder) that someone else wrote, then (``folder``) the folder holding it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if folder:
        fsync_path(path.parent, folder=False)


def fsync_tree(root: Path) -> None:
    """fsync every file below ``root`` (two threads), each with its folder, then ``root``."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(fsync_path, [p for p in root.rglob("*") if p.is_file()]))
    fsync_path(root, folder=False)


# ------------------------------------------------------------------------------------------ time, memory
@contextlib.contextmanager
def timed(out: dict[str, Any], key: str) -> Iterator[None]:
    """``out[key]`` = the wall seconds of the block."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out[key] = time.perf_counter() - t0


def median(xs: Sequence[Any]) -> float | None:
    """The median of the finite numbers, None without any."""
    vals = [x for x in xs if isinstance(x, (int, float)) and x == x]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0."""
    return None if a is None or not b else a / b


def settle() -> None:
    """Collect garbage, so that a case's memory is gone before the next starts."""
    gc.collect()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    """This process's peak RSS (``getrusage``: KiB on Linux)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class RssSampler:
    """Within ``with``: RSS sampled every 20 ms on a thread; ``peak`` is the highest seen."""

    def __enter__(self) -> RssSampler:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# ------------------------------------------------------------------------------------------ S3 on loopback
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3:
    """A moto S3 server on loopback with one bucket; ``app``: the WSGI app serving it here (None in its own
    process)."""

    endpoint_url: str
    bucket: str
    app: Any = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """What s3fs and ``CheckpointManager(storage_options=...)`` need to reach it."""
        return {"key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def fs(self) -> Any:
        """A fresh s3fs filesystem on it (no instance or listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True, use_listings_cache=False)

    def rm(self, prefix: str) -> None:
        """Delete everything under ``bucket/prefix`` (untimed)."""
        if (fs := self.fs()).exists(path := f"{self.bucket}/{prefix}"):
            fs.rm(path, recursive=True)


@contextlib.contextmanager
def s3_server(bucket: str = "bench", *, own_process: bool = False,
              middleware: Callable[[Any], Any] | None = None) -> Iterator[S3]:
    """moto's S3 server on a free loopback port with ``bucket`` made: in threads of this process (its app wrapped in
    ``middleware`` where given), or ``own_process`` (``python -m moto.server``: its request handling then shares no
    GIL with what is measured). Sets dummy credentials in ``os.environ`` (child processes inherit them)."""
    import logging
    import socket

    import s3fs  # noqa: F401  (fail before anything starts)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a log line per request otherwise
    for k, v in S3_ENV.items():
        os.environ.setdefault(k, v)
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
        s3, stop = S3(f"http://{host}:{port}", bucket), proc.terminate
    else:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        app = middleware(app) if middleware is not None else app
        server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        threading.Thread(target=server.serve_forever, name="s3-loopback", daemon=True).start()
        s3, stop = S3(f"http://127.0.0.1:{server.server_address[1]}", bucket, app), server.shutdown
    try:
        s3.fs().mkdir(bucket)
        yield s3
    finally:
        stop()
        if own_process:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def try_s3(stack: contextlib.ExitStack, **kwargs: Any) -> S3 | None:
    """:func:`s3_server` entered on ``stack``, or None (logged) where it cannot start: the S3 cases then skip."""
    try:
        return stack.enter_context(s3_server(**kwargs))
    except Exception as exc:
        log(f"S3 loopback server unavailable, S3 skipped: {type(exc).__name__}: {exc}")
        return None


def plain_put_s3(src: Path, url: str, storage_options: dict[str, Any]) -> float:
    """The peer of tierckpt's uploads: seconds of one recursive s3fs ``fs.put`` of ``src`` to ``url``, nothing
    checked; the objects removed after (untimed)."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options, skip_instance_cache=True)
    t0 = time.perf_counter()
    fs.put(str(src), url, recursive=True)
    dt = time.perf_counter() - t0
    fs.rm(url, recursive=True)
    return dt


# ------------------------------------------------------------------------------------------ child processes
@dataclass
class Launched:
    """:func:`launch`'s processes: exit codes in order, those still running at the timeout, the seconds taken."""

    returncodes: list[int]
    stuck: list[int]
    wall_s: float


def popen(argv: list[str], log: Path, cwd: Path | None, env: dict[str, str]) -> Any:
    """``python ARGV`` with stdout and stderr to the file ``log``: how :func:`launch` starts each process, unless
    :data:`start_process` says otherwise (a test may start them from a forkserver that has imported torch)."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env)


#: ``(argv, log, cwd, env) -> process`` with ``pid``, ``wait(timeout)``, ``poll()``, ``kill()``, ``returncode``
start_process: Callable[[list[str], Path, Path | None, dict[str, str]], Any] = popen


def launch(argvs: Sequence[Sequence[Any]], logs: Sequence[Path], *, timeout_s: float, cwd: Path | None = None,
           env: dict[str, str] | None = None) -> Launched:
    """One process of this interpreter per argv, all at once, each writing stdout and stderr to its log, the
    repository importable and ``env`` added; waits up to ``timeout_s`` for all. One still running then gets SIGUSR1
    (a script with ``faulthandler`` registered for it prints its threads' stacks) and 2 s later SIGKILL: none is left
    behind."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    full.pop("TIERCKPT_FAULT", None)
    t0 = time.perf_counter()
    procs = [start_process([str(a) for a in argv], Path(log), cwd, full) for argv, log in zip(argvs, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:  # a timeout, or an interruption: the stacks, then kill
        stuck = [i for i, p in enumerate(procs) if p.poll() is None]
        for i in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[i].pid, signal.SIGUSR1)
        if stuck:
            time.sleep(2.0)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return Launched([p.returncode for p in procs], stuck, time.perf_counter() - t0)
