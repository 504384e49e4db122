"""The side-by-side suite that ``bench.py``, ``limits.py``, ``peers.py``, ``save_restore.py`` and ``scaling.py``
run: what a case gets (:class:`Ctx`), the raw read and write timed next to every cold load and steady save
(:class:`RefFiles`, :func:`cold`), and the driver that runs cases interleaved in a rotating order and takes their
medians (:func:`run_suites`, :func:`summarize`, :func:`paired_ratios`). Not a script: the scripts import it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import harness as h
import torch
from harness import Metrics

Case = Callable[["Ctx"], Metrics]


# ------------------------------------------------------------------------------------------ what a case gets
@dataclass
class Ctx:
    """Everything a case needs: the state, a preallocated target of its shape, where to write, and options."""

    state: dict[str, Any]
    dst: dict[str, Any]
    scratch: Path
    threads: int = 2
    check: bool = True  # verify loaded values against the state (untimed, first repeat)
    loads: bool = True  # measure loads and restores as well as saves
    tierckpt: ModuleType | None = None
    tierckpt_kwargs: dict[str, Any] = field(default_factory=dict)
    saves: int = 4  # tierckpt saves per repeat (the first + steady state)
    s3: h.S3 | None = None
    repeat: int = 0
    quiet_wait: float = 0.0  # seconds to wait for other processes to go quiet before each case
    ref: RefFiles | None = None  # reference files for the raw read and write timed next to loads and saves
    ref_turns: int = 0  # pairs so far: the reference goes first on even turns
    restore_pairs: int = 1  # cold in-place restores per repeat in case_tierckpt, each with its adjacent read
    src_list: list[torch.Tensor] = field(init=False)
    dst_list: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.src_list, self.dst_list = h.tensors(self.state), h.tensors(self.dst)

    def clear_dst(self) -> None:
        """Zero the target, so that a load that silently does nothing cannot pass the check."""
        for t in self.dst_list:
            t.zero_()

    def verify(self) -> bool | None:
        """Whether ``dst`` equals ``state`` (None when checks are off, or after the first repeat)."""
        return h.states_equal(self.state, self.dst) if self.check and self.repeat == 0 else None


def write_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
    """The N-file raw write: each group's tensors into its file on a thread of its own, fsynced, then the folder."""
    h.parallel(lambda g: h.write_file(paths[g], [ctx.src_list[i] for i in groups[g]]), len(paths))
    h.fsync_path(paths[0])


def write_direct(paths: list[Path], bufs: list[memoryview]) -> None:
    """The N-file raw write with ``O_DIRECT`` from page-aligned buffers, a thread a file, fsynced."""
    h.parallel(lambda g: h.direct_io(paths[g], bufs[g], write=True), len(paths))
    h.fsync_path(paths[0])


def read_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
    """The N-file raw read: each file into its group's target tensors, a thread each."""
    h.parallel(lambda g: h.read_file_into(paths[g], [ctx.dst_list[i] for i in groups[g]]), len(paths))


@dataclass
class RefFiles:
    """The state's bytes in ``len(paths)`` files, written once (buffered, fsynced) before a run's first case and kept
    to its end: what the raw cold read next to every cold load reads (:func:`cold`). Reads, and the writes next to
    tierckpt's saves (:meth:`write`), take the fastest raw way here: ``O_DIRECT`` from and into page-aligned copies
    of the state on transparent huge pages (made once: state-sized memory held to the end of the run; their 2 MiB
    DMA segments made a direct transfer 0.5-0.65x the time of one from 4 KiB pages on the reference VM). Where the
    file system refuses ``O_DIRECT``, reads go buffered into the target state, as the ``read_cold_nf`` limit's do."""

    paths: list[Path]
    groups: list[list[int]]
    aligned: list[memoryview] | None = None

    @classmethod
    def create(cls, ctx: Ctx) -> RefFiles:
        d = h.fresh_dir(ctx.scratch, "ref")
        groups = h.split_balanced(ctx.src_list, ctx.threads)
        paths = [d / f"ref{g}.bin" for g in range(len(groups))]
        write_files(ctx, paths, groups)
        aligned = None
        if hasattr(os, "O_DIRECT"):
            aligned = [h.pack_aligned([ctx.src_list[i] for i in g], huge=True) for g in groups]
        return cls(paths, groups, aligned)

    def write(self, ctx: Ctx) -> float | None:
        """Seconds of the write limit's fastest way: the aligned copies into N new files with ``O_DIRECT`` on N
        threads, fsynced, on a quiet disk (the files removed after, untimed); None without ``O_DIRECT``."""
        if self.aligned is None:
            return None
        paths = [self.paths[0].parent / f"w{g}.bin" for g in range(len(self.aligned))]
        h.disk_idle(ctx.scratch)
        try:
            t0 = time.perf_counter()
            write_direct(paths, self.aligned)
            return time.perf_counter() - t0
        except OSError:  # EINVAL: no O_DIRECT on this file system
            self.aligned = None
            return None
        finally:
            for p in paths:
                h.remove(p)

    def read(self, ctx: Ctx) -> float:
        """Seconds of a cold read of the files (page cache dropped, quiet disk): ``O_DIRECT`` into the aligned copies
        (the same bytes, so that they stay what :meth:`write` writes), else buffered into ``ctx.dst``."""
        if (aligned := self.aligned) is not None:
            h.drop_caches()
            h.disk_idle(ctx.scratch)
            try:
                t0 = time.perf_counter()
                h.parallel(lambda g: h.direct_io(self.paths[g], aligned[g], write=False), len(aligned))
                return time.perf_counter() - t0
            except OSError:  # EINVAL: no O_DIRECT on this file system
                self.aligned = None
        h.drop_caches()
        h.disk_idle(ctx.scratch)
        t0 = time.perf_counter()
        read_files(ctx, self.paths, self.groups)
        return time.perf_counter() - t0

    def remove(self) -> None:
        h.remove(self.paths[0].parent)


@contextlib.contextmanager
def cold(ctx: Ctx, out: Metrics, key: str) -> Iterator[None]:
    """Around one cold load that the body times as ``out[key]`` (and checks, before this returns): the target cleared,
    the page cache dropped, a quiet disk; with ``ctx.ref``, the reference read timed as ``out[key + "_ref"]`` right
    before the load or right after it, in turn, and their ratio as ``out[key + "_vs_ref"]``."""
    first = ctx.ref is not None and ctx.ref_turns % 2 == 0
    ctx.ref_turns += 1
    if first:
        out[f"{key}_ref"] = ctx.ref.read(ctx)  # type: ignore[union-attr]
    ctx.clear_dst()
    h.settle()
    out["cold_cache"] = h.drop_caches()
    h.disk_idle(ctx.scratch)
    yield
    if ctx.ref is not None and not first:
        out[f"{key}_ref"] = ctx.ref.read(ctx)  # overwrites the target: the body has checked it already
    if f"{key}_ref" in out and key in out:
        out[f"{key}_vs_ref"] = out[key] / out[f"{key}_ref"]


def timed_loads(ctx: Ctx, out: Metrics, load: Callable[[], Any]) -> None:
    """``load`` timed cold, checked, then warm (before any reference read drops the page cache again)."""
    if ctx.loads:
        with cold(ctx, out, "load_cold"):
            with h.timed(out, "load_cold"):
                load()
            out["load_ok"] = ctx.verify()
            with h.timed(out, "load_warm"):
                load()


# ------------------------------------------------------------------------------------------ running the cases
def run_suite(ctx: Ctx, cases: dict[str, Case], repeats: int, label: str = "") -> dict[str, Any]:
    """Every case ``repeats`` times in a rotating order: per-case medians and raw runs."""
    return run_suites([(label, ctx, cases)], repeats)[0]


def run_suites(suites: list[tuple[str, Ctx, dict[str, Case]]], repeats: int) -> list[dict[str, Any]]:
    """Suites (``(label, ctx, cases)``, e.g. one state per tensor count) run interleaved: each repeat runs every
    suite once, the suites and each suite's cases in an order rotated every repeat, so that a drift of the machine
    falls on every suite alike. Per suite, per-case medians (:func:`summarize`) and the raw runs. Before each case
    the driver waits up to ``ctx.quiet_wait`` s for a quiet machine and records the cores that other processes
    kept busy during it (``foreign_cores``)."""
    raws: list[dict[str, list[Metrics]]] = [{name: [] for name in cases} for _, _, cases in suites]
    for r in range(repeats):
        for i in h.rotate(range(len(suites)), r):
            (label, ctx, cases), raw = suites[i], raws[i]
            ctx.repeat = r
            for name in h.rotate(list(cases), r):
                h.settle()
                waited, before = h.wait_for_quiet(ctx.quiet_wait) if ctx.quiet_wait > 0 else (0.0, None)
                t0, snap = time.perf_counter(), h.cpu_snapshot()
                try:
                    m = cases[name](ctx)
                except Exception as exc:  # one broken system must not take the run down; it is reported
                    m = {"error": f"{type(exc).__name__}: {exc}"}
                    h.log(f"{label}{name} repeat {r + 1}: FAILED {m['error']}")
                m["foreign_cores"], m["foreign_cores_before"] = h.foreign_cpu(snap), before
                raw[name].append(m)
                busy = f", other processes busy {m['foreign_cores']:.2f} cores" if m["foreign_cores"] > 0.2 else ""
                wait = f", waited {waited:.0f}s for quiet" if waited > 1 else ""
                h.log(f"{label}{name} repeat {r + 1}/{repeats} ({time.perf_counter() - t0:.1f}s{busy}{wait})")
    return [{"medians": {name: summarize(runs) for name, runs in raw.items()}, "runs": raw} for raw in raws]


def summarize(runs: list[Metrics]) -> Metrics:
    """Each metric over the repeats: numbers their median (and ``<metric>__min``), lists pooled, booleans AND-ed,
    text (errors) kept."""
    out: Metrics = {}
    for k in sorted({k for m in runs for k in m}):
        vals = [m[k] for m in runs if k in m]
        if all(isinstance(v, list) for v in vals):
            out[k] = [x for v in vals for x in v]
        elif all(isinstance(v, bool) or v is None for v in vals):
            known = [v for v in vals if v is not None]
            out[k] = all(known) if known else None
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = h.median(vals)
            if len(vals) > 1:
                out[f"{k}__min"] = min(vals)
        else:
            out[k] = next((v for v in vals if isinstance(v, str)), vals[0])
    return out


def paired_ratios(pairs: list[list[float]] | None) -> dict[str, float] | None:
    """Median, quartiles (linear between ranks), min and max of a / b over ``(a, b)`` pairs; None without any."""
    ratios = sorted(a / b for a, b in pairs or [] if a and b)
    if not ratios:
        return None

    def q(f: float) -> float:
        x = f * (len(ratios) - 1)
        lo = int(x)
        return ratios[lo] + (ratios[min(lo + 1, len(ratios) - 1)] - ratios[lo]) * (x - lo)

    return {"n": len(ratios), "median": q(0.5), "q1": q(0.25), "q3": q(0.75), "min": ratios[0], "max": ratios[-1]}



# ------------------------------------------------------------------------------------------ options
def parse_kv(items: list[str]) -> dict[str, Any]:
    """``["writer_threads=4", "x=true"]`` -> ``{"writer_threads": 4, "x": True}`` (ints, floats, bools, None)."""
    out: dict[str, Any] = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = {"true": True, "false": False, "none": None}.get(v.lower(), v)
        for conv in (int, float):
            with contextlib.suppress(ValueError):
                out[k] = conv(v)
                break
    return out

