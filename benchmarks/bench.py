"""Side-by-side checkpoint benchmark: the hardware limits, the peers (torch.save, safetensors, DCP) and tierckpt.

    python benchmarks/bench.py --size-gib 1 --repeats 3 [--quick] [--out results.json] [--markdown table.md]
    python benchmarks/bench.py --scaling [--sizes 0.25,0.5,1,2] [--counts 100,1000,10000] [--plot PNG]

Every case saves and/or loads the same generated state once per repeat, in an order rotated every repeat so that a
drift of the shared disk spreads over all systems. Medians are reported, with ratios to the matching limit (``copy_``
for the stall, raw write + fsync for durability, raw read for loads) and to the best peer. Every system's metrics
have the same names: ``stall`` (training blocked: a synchronous save whole, ``async_save`` until it returns or its
staging completes, ``save()`` until it returns), ``durable`` (until fsynced locally), ``load_cold``/``load_warm``
(``*_inplace``: ``restore(in_place=True)``), ``rss_extra``; ``*_ref``, ``*_vs_ref`` and ``*_pairs``: the raw read or
write of the same bytes timed right before or after a cold load or steady save, in turn (:class:`RefFiles`), and
the ratio to it, which the disk's drift from minute to minute cannot skew. Every timed write and cold read starts
on a quiet disk (:func:`harness.disk_idle`). benchmarks/README.md says what every number means.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import harness as h
import torch
import xxhash
from harness import GiB, Metrics, ratio

Case = Callable[["Ctx"], Metrics]
#: the peers, in table order
PEERS = ["torch.save", "safetensors", "dcp.save(t1)", "dcp.save(t2)", "dcp.async_save", "dcp.async_save+DefaultStager"]


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


def _write_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
    """The N-file raw write: each group's tensors into its file on a thread of its own, fsynced, then the folder."""
    h.parallel(lambda g: h.write_file(paths[g], [ctx.src_list[i] for i in groups[g]]), len(paths))
    h.fsync_path(paths[0])


def _write_direct(paths: list[Path], bufs: list[memoryview]) -> None:
    """The N-file raw write with ``O_DIRECT`` from page-aligned buffers, a thread a file, fsynced."""
    h.parallel(lambda g: h.direct_io(paths[g], bufs[g], write=True), len(paths))
    h.fsync_path(paths[0])


def _read_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
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
        _write_files(ctx, paths, groups)
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
            _write_direct(paths, self.aligned)
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
        _read_files(ctx, self.paths, self.groups)
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


def _loads(ctx: Ctx, out: Metrics, load: Callable[[], Any]) -> None:
    """``load`` timed cold, checked, then warm (before any reference read drops the page cache again)."""
    if ctx.loads:
        with cold(ctx, out, "load_cold"):
            with h.timed(out, "load_cold"):
                load()
            out["load_ok"] = ctx.verify()
            with h.timed(out, "load_warm"):
                load()


# ------------------------------------------------------------------------------------------ limits
def case_memcpy(ctx: Ctx) -> Metrics:
    """``copy_`` of every tensor into its preallocated twin (``time``: the floor of a snapshot), and the same copy with
    streaming stores on ``ctx.threads`` threads, tierckpt's native copy (``time_stream``: this memory's lower floor;
    absent where it is not built); the two go first in turn, by repeat."""
    from tierckpt.snapshot import hostcopy

    out: Metrics = {}

    def plain() -> None:
        with h.timed(out, "time"):
            for s, d in zip(ctx.src_list, ctx.dst_list, strict=True):
                d.copy_(s)

    def stream() -> None:
        if hostcopy.available:
            with h.timed(out, "time_stream"):
                rest, _ = hostcopy.copy_pairs(ctx.dst_list, ctx.src_list, threads=ctx.threads, min_bytes=0)
            assert not rest, "every benchmark tensor is contiguous"

    for fn in (plain, stream) if ctx.repeat % 2 == 0 else (stream, plain):
        fn()
    return out


def case_hash(ctx: Ctx) -> Metrics:
    """xxh3_128 over every tensor's bytes, on one thread and on ``ctx.threads`` threads."""
    out: Metrics = {}
    ts = ctx.src_list
    groups = h.split_balanced(ts, ctx.threads)

    def work(idx: list[int]) -> None:
        for i in idx:
            if ts[i].nbytes:
                xxhash.xxh3_128(h.byte_view(ts[i])).digest()

    with h.timed(out, "time_1t"):
        work(list(range(len(ts))))
    with h.timed(out, "time_nt"):
        h.parallel(lambda g: work(groups[g]), ctx.threads)
    return out


def case_raw_io(ctx: Ctx) -> Metrics:
    """The state's bytes written back to back + fsync: to one file, to N files on N threads, and to N files with
    ``O_DIRECT`` from page-aligned buffers (on 4 KiB pages and, where the kernel has them, on huge pages: 2 MiB DMA
    segments, tierckpt's staging memory; the two first in turn by repeat); read back cold and warm (direct: cold)."""
    from tierckpt.host.memory import huge_pages_available

    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, "raw")
    try:
        one = d / "all.bin"
        h.disk_idle(d)
        with h.timed(out, "write_1f"):
            h.write_file(one, ctx.src_list)
            h.fsync_path(one)
        out["cold_cache"] = h.drop_caches()
        h.disk_idle(d)
        with h.timed(out, "read_cold_1f"):
            h.read_file_into(one, ctx.dst_list)
        with h.timed(out, "read_warm_1f"):
            h.read_file_into(one, ctx.dst_list)
        h.remove(one)

        n = ctx.threads
        groups = h.split_balanced(ctx.src_list, n)
        paths = [d / f"part{g}.bin" for g in range(n)]
        h.disk_idle(d)
        with h.timed(out, "write_nf"):
            _write_files(ctx, paths, groups)
        h.drop_caches()
        h.disk_idle(d)
        with h.timed(out, "read_cold_nf"):
            _read_files(ctx, paths, groups)
        with h.timed(out, "read_warm_nf"):
            _read_files(ctx, paths, groups)
        if ctx.check and ctx.repeat == 0:
            out["read_ok"] = h.states_equal(ctx.state, ctx.dst)
        for p in paths:
            h.remove(p)

        kinds = [("", False)] + ([("_huge", True)] if huge_pages_available() else [])
        for suffix, huge in h.rotate(kinds, ctx.repeat):
            if not hasattr(os, "O_DIRECT"):
                break
            bufs = [h.pack_aligned([ctx.src_list[i] for i in g], huge=huge) for g in groups]  # untimed
            try:
                h.disk_idle(d)
                with h.timed(out, f"write_nf_direct{suffix}"):
                    _write_direct(paths, bufs)
                h.drop_caches()
                h.disk_idle(d)
                with h.timed(out, f"read_cold_nf_direct{suffix}"):
                    h.parallel(lambda g, bufs=bufs: h.direct_io(paths[g], bufs[g], write=False), n)
            except OSError as exc:  # EINVAL: no O_DIRECT on this file system; the buffered limits stand
                out.pop(f"write_nf_direct{suffix}", None)
                out["direct_error"] = str(exc)
                break
            finally:
                del bufs
    finally:
        h.remove(d)
    return out


# ------------------------------------------------------------------------------------------ peers
def _synchronous(ctx: Ctx, name: str, save: Callable[[Path], Any], load: Callable[[Path], Any]) -> Metrics:
    """A synchronous saver: ``save(folder)`` (which fsyncs) timed as both stall and durable, with its extra RSS;
    then ``load(folder)`` into the target, cold and warm (:func:`_loads`)."""
    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, name)
    try:
        h.disk_idle(d)
        base = h.rss_bytes()
        with h.RssSampler() as rss, h.timed(out, "stall"):
            save(d)
        out["durable"], out["rss_extra"] = out["stall"], rss.peak - base
        _loads(ctx, out, lambda: load(d))
    finally:
        h.remove(d)
    return out


def case_torch_save(ctx: Ctx) -> Metrics:
    """``torch.save`` to one file + fsync; ``torch.load(mmap=False)`` then ``copy_`` into the target."""

    def save(d: Path) -> None:
        with open(d / "ckpt.pt", "wb") as f:
            torch.save(ctx.state, f)
            f.flush()
            os.fsync(f.fileno())
        h.fsync_path(d / "ckpt.pt")

    return _synchronous(ctx, "torchsave", save, lambda d: h.copy_into(
        ctx.dst, torch.load(d / "ckpt.pt", mmap=False, weights_only=True)))


def case_safetensors(ctx: Ctx) -> Metrics:
    """``safetensors.torch.save_file`` of the flat state + fsync; ``load_file`` then ``copy_`` into the target."""
    from safetensors.torch import load_file, save_file

    def save(d: Path) -> None:
        save_file(h.flatten(ctx.state), str(d / "ckpt.safetensors"))
        h.fsync_path(d / "ckpt.safetensors")

    return _synchronous(ctx, "safetensors", save,
                        lambda d: h.copy_into(ctx.dst, load_file(str(d / "ckpt.safetensors"))))


def make_case_dcp_save(thread_count: int) -> Case:
    """DCP ``save`` with ``FileSystemWriter(thread_count=...)`` (it fsyncs its files; the metadata file and the
    folder are fsynced too); DCP ``load`` in place."""

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        def save(d: Path) -> None:
            dcp.save(ctx.state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=thread_count), no_dist=True)
            h.fsync_tree(d)

        return _synchronous(ctx, f"dcp{thread_count}", save,
                            lambda d: dcp.load(ctx.dst, checkpoint_id=str(d), no_dist=True))

    return case


def make_case_dcp_async(stager: bool) -> Case:
    """DCP ``async_save``, with its default (synchronous CPU) staging or with ``DefaultStager``: that one returns
    before the copy is done, and the tensors may change only at ``staging_completion``, so ``stall`` is that and
    ``stall_return`` the bare return. Without CUDA, pinned memory and non-blocking copies are off (it refuses them)."""

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        out: Metrics = {}
        d = h.fresh_dir(ctx.scratch, "dcpasync")
        st = None
        try:
            kwargs: dict[str, Any] = {}
            if stager:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                cuda = torch.cuda.is_available()
                st = kwargs["async_stager"] = DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                    use_non_blocking_copy=cuda))
            h.disk_idle(d)
            base = h.rss_bytes()
            with h.RssSampler() as rss:
                t0 = time.perf_counter()
                resp = dcp.async_save(ctx.state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=1),
                                      no_dist=True, **kwargs)
                out.update(h.dcp_async_times(resp, t0))
                h.fsync_tree(d)
                out["durable"] = time.perf_counter() - t0
            out["rss_extra"] = rss.peak - base
            if ctx.check and ctx.repeat == 0 and ctx.loads:
                ctx.clear_dst()
                dcp.load(ctx.dst, checkpoint_id=str(d), no_dist=True)
                out["load_ok"] = ctx.verify()
        finally:
            if st is not None:
                st.close()
            h.remove(d)
        return out

    return case


# ------------------------------------------------------------------------------------------ tierckpt
def _since(fut: Any, t0: float) -> float:
    """Wait for a stage's future; seconds since ``t0`` on this clock (the library's own number is kept apart)."""
    fut.result()
    return time.perf_counter() - t0


def case_tierckpt(ctx: Ctx) -> Metrics:
    """tierckpt, local tier only: ``ctx.saves`` saves, each awaited, then verified restores, cold and warm, by default
    and in place, from a fresh manager over the same folder. The first save apart from the steady state (p50 and
    max of the rest); RSS growth between the second and the last save (a steady save should allocate nothing
    large); peak extra RSS."""
    tc = ctx.tierckpt
    assert tc is not None
    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, "tierckpt")
    stalls: list[float] = []
    durables: list[float] = []
    lib_durables: list[float] = []
    rss_after: list[int] = []
    durable_pairs: list[tuple[float, float]] = []
    try:
        base = h.rss_bytes()
        with h.RssSampler() as rss, tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs) as mgr:
            for k in range(ctx.saves):
                ref = ctx.ref if k > 0 else None  # steady saves get the write limit next to them, before or after
                first = ref is not None and ctx.ref_turns % 2 == 0
                ctx.ref_turns += ref is not None
                wref = ref.write(ctx) if ref is not None and first else None
                h.disk_idle(d)  # the previous save's retention deleted a step: its discards finish first
                t0 = time.perf_counter()
                handle = mgr.save(k + 1, ctx.state)
                stalls.append(time.perf_counter() - t0)
                durables.append(_since(handle.persisted, t0))
                lib_durables.append(float(handle.persisted.result()))
                mgr.wait()
                rss_after.append(h.rss_bytes())
                if ref is not None and not first:
                    wref = ref.write(ctx)
                if wref is not None:
                    durable_pairs.append((durables[-1], wref))
        steady = stalls[1:] or stalls
        out.update(rss_extra=rss.peak - base, first_stall=stalls[0], first_durable=durables[0],
                   stall=h.median(steady), stall_max=max(steady), durable=h.median(durables[1:] or durables),
                   durable_lib=h.median(lib_durables[1:] or lib_durables),
                   rss_growth_steady=rss_after[-1] - rss_after[1] if len(rss_after) > 2 else None)
        if durable_pairs:
            out["durable_pairs"] = durable_pairs
        del mgr  # its staging memory goes before the restores
        h.settle()
        if ctx.loads:
            with tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs) as mgr:
                _restores(ctx, out, mgr, d / "local")
    finally:
        h.remove(d)
    return out


def _restores(ctx: Ctx, out: Metrics, mgr: Any, folder: Path) -> None:
    """The default restore and ``in_place=True``, each cold (with RSS) and warm (the step's files read into the page
    cache first, untimed: a cold restore reads around the cache and leaves nothing there); then
    ``ctx.restore_pairs - 1`` more cold in-place restores, each with its adjacent read: one pair a repeat cannot
    tell 1.05x from 1.15x on a disk whose reads vary by 10-25% (the default restore gets one pair: its first
    restore in a process, with a fresh staging buffer, is the one a restarting job pays)."""
    for suffix, kwargs in (("", {}), ("_inplace", {"in_place": True})):
        with cold(ctx, out, f"load_cold{suffix}"):
            base = h.rss_bytes()
            with h.RssSampler() as rss, h.timed(out, f"load_cold{suffix}"):
                step = mgr.restore(ctx.dst, **kwargs)
            out[f"rss_extra_restore{suffix}"] = rss.peak - base
            if suffix:
                out["load_inplace_ok"] = step == ctx.saves and ctx.verify() is not False
            else:
                out["restored_step_ok"], out["load_ok"] = step == ctx.saves, ctx.verify()
            h.read_into_page_cache(folder)
            with h.timed(out, f"load_warm{suffix}"):
                mgr.restore(ctx.dst, **kwargs)
    pairs = [(out["load_cold_inplace"], out.get("load_cold_inplace_ref"))]
    for _ in range(ctx.restore_pairs - 1):
        more: Metrics = {}
        with cold(ctx, more, "load_cold_inplace"), h.timed(more, "load_cold_inplace"):
            mgr.restore(ctx.dst, in_place=True)
        pairs.append((more["load_cold_inplace"], more.get("load_cold_inplace_ref")))
    if ctx.ref is not None:
        out["load_cold_inplace_pairs"] = pairs


def case_tierckpt_copy_first(ctx: Ctx) -> Metrics:
    """tierckpt with ``overlap_writes=False`` (the whole copy, then the writes), saves only: the other side of the
    trade-off from the default, which writes while it copies."""
    kwargs = {**ctx.tierckpt_kwargs, "overlap_writes": False}
    return case_tierckpt(dataclasses.replace(ctx, loads=False, tierckpt_kwargs=kwargs))


def make_case_tierckpt_remote(kind: str) -> Case:
    """tierckpt with a remote tier (``posix``: a folder on the same disk; ``s3``: moto on loopback): two saves, the
    second reported: ``stall``, ``durable`` (local), ``remote_durable`` (until ``handle.uploaded``, from the start of
    the save) and ``upload`` (remote minus local)."""

    def case(ctx: Ctx) -> Metrics:
        tc = ctx.tierckpt
        assert tc is not None
        if kind == "s3" and ctx.s3 is None:
            return {"skipped": "no S3 server"}
        out: Metrics = {}
        d = h.fresh_dir(ctx.scratch, f"tierckpt-{kind}")
        kwargs = {"keep_remote": 1, **ctx.tierckpt_kwargs}
        if kind == "posix":
            remote = str(d / "remote")
        else:
            remote = f"s3://{ctx.s3.bucket}/{d.name}"  # type: ignore[union-attr]
            kwargs["storage_options"] = ctx.s3.storage_options  # type: ignore[union-attr]
        try:
            base = h.rss_bytes()
            with h.RssSampler() as rss, tc.CheckpointManager(d / "local", remote=remote, **kwargs) as mgr:
                for k in range(2):
                    h.disk_idle(d)
                    t0 = time.perf_counter()
                    handle = mgr.save(k + 1, ctx.state)
                    stall = time.perf_counter() - t0
                    durable, remote_durable = _since(handle.persisted, t0), _since(handle.uploaded, t0)
                    mgr.wait()
                    if k == 0:
                        out["first_stall"], out["first_remote_durable"] = stall, remote_durable
            out.update(stall=stall, durable=durable, remote_durable=remote_durable, upload=remote_durable - durable)
            if kind != "s3":  # moto's server runs in this process and holds the objects in memory
                out["rss_extra"] = rss.peak - base
        finally:
            h.remove(d)
            if kind == "s3":
                ctx.s3.rm(d.name)  # type: ignore[union-attr]
        return out

    return case


# ------------------------------------------------------------------------------------------ running the cases
def build_cases(*, tierckpt: bool, remote: bool, s3: bool, peers: list[str] | None = None, limits: bool = True,
                overlap: bool = False) -> dict[str, Case]:
    """The cases of one suite by display name (``overlap``: also tierckpt copying first)."""
    cases: dict[str, Case] = {"memcpy": case_memcpy, "hash": case_hash, "raw": case_raw_io} if limits else {}
    every: dict[str, Case] = {"torch.save": case_torch_save, "safetensors": case_safetensors,
                              "dcp.save(t1)": make_case_dcp_save(1), "dcp.save(t2)": make_case_dcp_save(2),
                              "dcp.async_save": make_case_dcp_async(stager=False)}
    if h.default_stager_available():
        every["dcp.async_save+DefaultStager"] = make_case_dcp_async(stager=True)
    cases.update({name: every[name] for name in (PEERS if peers is None else peers) if name in every})
    if tierckpt:
        cases["tierckpt"] = case_tierckpt
        if overlap:
            cases["tierckpt copy-first"] = case_tierckpt_copy_first
        if remote:
            cases["tierckpt+posix"] = make_case_tierckpt_remote("posix")
        if s3:
            cases["tierckpt+s3"] = make_case_tierckpt_remote("s3")
    return cases


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


RAW_LIMITS = ("write_1f", "write_nf", "write_nf_direct", "write_nf_direct_huge", "read_cold_1f", "read_cold_nf",
              "read_cold_nf_direct", "read_cold_nf_direct_huge", "read_warm_1f", "read_warm_nf")


def derive(med: dict[str, Metrics], nbytes: int) -> dict[str, Any]:
    """The limits (each the fastest raw way: buffered or ``O_DIRECT``, 1 file or N), a row per system with its
    ratios to them and to the best peer, and the pooled adjacent pairs, from the per-case medians."""
    raw, mem = med.get("raw", {}), med.get("memcpy", {})

    def fastest(prefix: str) -> float | None:
        return min((raw[k] for k in RAW_LIMITS if k.startswith(prefix) and raw.get(k)), default=None)

    limits = {"memcpy": mem.get("time"), "memcpy_stream": mem.get("time_stream"), "write": fastest("write"),
              "read_cold": fastest("read_cold"), "read_warm": fastest("read_warm"),
              "hash_1t": med.get("hash", {}).get("time_1t"), "hash_nt": med.get("hash", {}).get("time_nt"),
              **{k: raw.get(k) for k in RAW_LIMITS},
              # the reads and writes timed next to loads and saves: the median of the systems' medians
              "read_cold_adjacent": h.median([v for m in med.values() for k, v in m.items()
                                              if k.endswith("_ref") and not k.endswith("_vs_ref")
                                              and v is not None]),
              "write_adjacent": h.median([w for m in med.values() for _, w in m.get("durable_pairs") or []])}
    systems = [n for n in med if n not in ("memcpy", "hash", "raw")]
    peers = [n for n in systems if n in PEERS and "error" not in med[n]]
    best_peer = {}
    for metric in ("stall", "durable", "load_cold", "load_warm"):
        vals = [(med[p][metric], p) for p in peers if med[p].get(metric) is not None]
        best_peer[metric] = min(vals)[::-1] if vals else (None, None)
    rows: dict[str, Metrics] = {}

    def row(m: Metrics, **known: Any) -> Metrics:
        r = {k: m.get(k) for k in ("stall", "durable", "remote_durable", "load_cold", "load_warm", "rss_extra")}
        r.update(stall_vs_memcpy=ratio(r["stall"], limits["memcpy"]),
                 stall_vs_stream=ratio(r["stall"], limits["memcpy_stream"]),
                 durable_vs_write=ratio(r["durable"], limits["write"]),
                 load_cold_vs_read=ratio(r["load_cold"], limits["read_cold"]),
                 load_cold_vs_ref=m.get("load_cold_vs_ref"),
                 load_warm_vs_read=ratio(r["load_warm"], limits["read_warm"]),
                 **{f"{k}_vs_best_peer": ratio(r[k], best_peer[k][1]) for k in best_peer}, error=m.get("error"))
        return {**r, **known}

    for n in systems:
        pooled = paired_ratios(med[n].get("durable_pairs"))
        rows[n] = row(med[n], durable_vs_ref=pooled["median"] if pooled else None, durable_pairs=pooled)
    tk = med.get("tierckpt", {})
    inplace = paired_ratios(tk.get("load_cold_inplace_pairs"))
    if tk.get("load_cold_inplace") is not None:  # restore(in_place=True) as a row of its own, loads only
        rows["tierckpt in_place restore"] = row(
            {"load_cold": tk["load_cold_inplace"], "load_warm": tk.get("load_warm_inplace"),
             "load_cold_vs_ref": inplace["median"] if inplace else tk.get("load_cold_inplace_vs_ref")})
    return {"bytes": nbytes, "inplace_pairs": inplace, "limits": limits,
            "limits_gbps": {k: (nbytes / v / 1e9 if v else None) for k, v in limits.items()},
            "best_peer": {k: {"system": p, "seconds": v} for k, (p, v) in best_peer.items()}, "systems": rows}


# ------------------------------------------------------------------------------------------ reports
LIMIT_LABELS = {
    "memcpy": "memcpy into preallocated tensors (copy_)",
    "memcpy_stream": "memcpy into preallocated tensors, streaming stores, N threads (tierckpt's native copy)",
    "write_1f": "raw write + fsync, 1 file",
    "write_nf": "raw write + fsync, N files on N threads",
    "write_nf_direct": "raw write O_DIRECT + fsync, N files on N threads",
    "write_nf_direct_huge": "raw write O_DIRECT + fsync, N files on N threads, from huge pages",
    "read_cold_1f": "raw read, cold cache, 1 file",
    "read_cold_nf": "raw read, cold cache, N files",
    "read_cold_nf_direct": "raw read O_DIRECT, N files",
    "read_cold_nf_direct_huge": "raw read O_DIRECT, N files, into huge pages",
    "read_warm_1f": "raw read, warm cache, 1 file",
    "read_warm_nf": "raw read, warm cache, N files",
    "read_cold_adjacent": "raw read O_DIRECT into huge pages, N files, next to each cold load (median)",
    "write_adjacent": "raw write O_DIRECT + fsync from huge pages, N files, next to each steady tierckpt save (median)",
    "hash_1t": "xxh3_128, 1 thread",
    "hash_nt": "xxh3_128, N threads",
}


def _quartiles(p: dict[str, float] | None) -> str:
    return "-" if not p else "{median:.3f} ({q1:.3f}-{q3:.3f}; {n})".format(**p)


def _mib(v: float | None) -> float | None:
    return None if v is None else v / (1 << 20)


def report_tables(d: dict[str, Any], med: dict[str, Metrics]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, heads, rows) of the limits, the systems with their ratios, tierckpt against the best peer, and
    tierckpt's details."""
    nbytes, lim, bp = d["bytes"], d["limits"], d["best_peer"]
    heads = ["system", "stall s", "durable s", "remote s", "load cold s", "load warm s", "extra RSS GiB",
             "stall/memcpy", "stall/streaming memcpy", "durable/write", "durable/adjacent write", "cold/read",
             "cold/adjacent read", "warm/read"]
    systems = []
    for n, r in d["systems"].items():
        if r.get("error"):
            systems.append([n, "ERROR: " + str(r["error"])[:60]] + [""] * (len(heads) - 2))
            continue
        systems.append([n, r["stall"], r["durable"], r["remote_durable"], r["load_cold"], r["load_warm"],
                        None if r.get("rss_extra") is None else r["rss_extra"] / GiB, r["stall_vs_memcpy"],
                        r.get("stall_vs_stream"), r["durable_vs_write"], r.get("durable_vs_ref"),
                        r["load_cold_vs_read"], r.get("load_cold_vs_ref"), r["load_warm_vs_read"]])
    against = [[f"{n} {metric}", r[metric], bp[metric]["system"], bp[metric]["seconds"], r[f"{metric}_vs_best_peer"]]
               for n in ("tierckpt", "tierckpt copy-first", "tierckpt in_place restore", "tierckpt+posix",
                         "tierckpt+s3")
               if (r := d["systems"].get(n)) and not r.get("error")
               for metric in ("stall", "durable", "load_cold", "load_warm")
               if r.get(metric) is not None and bp[metric]["seconds"] is not None]
    details = []
    tk = med.get("tierckpt", {})
    if tk and "error" not in tk:
        details += [
            ["first save: stall s", tk.get("first_stall")],
            ["first save: durable s", tk.get("first_durable")],
            ["steady save: stall p50 s", tk.get("stall")],
            ["steady save: stall max s", tk.get("stall_max")],
            ["steady save: durable p50 s", tk.get("durable")],
            ["steady save: durable (library's own clock) s", tk.get("durable_lib")],
            ["steady save: durable / raw write next to it, all pairs: median (quartiles; pairs)",
             _quartiles(d["systems"].get("tierckpt", {}).get("durable_pairs"))],
            ["restore cold s (verified)", tk.get("load_cold")],
            ["restore cold / raw read next to it (median of the repeats' ratios)", tk.get("load_cold_vs_ref")],
            ["restore warm s (verified)", tk.get("load_warm")],
            ["restore returned the last step, values equal", f"{tk.get('restored_step_ok')}, {tk.get('load_ok')}"],
            ["peak extra RSS during saves / state bytes", ratio(tk.get("rss_extra"), nbytes)],
            ["RSS growth 2nd -> last save MiB", _mib(tk.get("rss_growth_steady"))],
            ["peak extra RSS during restore MiB", _mib(tk.get("rss_extra_restore"))],
            ["restore in_place=True cold s (verified)", tk.get("load_cold_inplace")],
            ["restore in_place=True cold / raw read next to it (median of the repeats' ratios)",
             tk.get("load_cold_inplace_vs_ref")],
            ["restore in_place=True cold / raw read next to it, all pairs: median (quartiles; pairs)",
             _quartiles(d.get("inplace_pairs"))],
            ["restore in_place=True warm s (verified)", tk.get("load_warm_inplace")],
            ["restore in_place=True: right step, values equal", tk.get("load_inplace_ok")],
            ["peak extra RSS during in_place restore MiB", _mib(tk.get("rss_extra_restore_inplace"))],
        ]
    for n in ("tierckpt+posix", "tierckpt+s3"):
        m = med.get(n, {})
        if m and "error" not in m and "skipped" not in m:
            details += [[f"{n}: remote durable s (2nd save)", m.get("remote_durable")],
                        [f"{n}: upload after local durable s", m.get("upload")],
                        [f"{n}: upload GB/s", nbytes / m["upload"] / 1e9 if m.get("upload") else None],
                        [f"{n}: remote durable / raw write", ratio(m.get("remote_durable"), lim.get("write"))]]
    out = [("Limits (median seconds for the whole state, GB/s)", ["limit", "seconds", "GB/s"],
            [[label, lim.get(k), d["limits_gbps"].get(k)] for k, label in LIMIT_LABELS.items()]),
           ("Systems (median seconds; ratios to the matching limit)", heads, systems)]
    if against:
        out.append(("tierckpt against the best peer", ["tierckpt metric", "seconds", "best peer", "peer s", "ratio"],
                    against))
    if details:
        out.append(("tierckpt details", ["metric", "value"], details))
    return out


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


# ------------------------------------------------------------------------------------------ the runs
def main_bench(args: Any) -> tuple[dict[str, Any], str]:
    """The side-by-side benchmark at one size: the results and their Markdown."""
    scratch = h.scratch_dir(args.dir)
    tc, why = h.import_tierckpt()
    if tc is None:
        h.log(f"tierckpt skipped: {why}")
    h.log(f"generating a {args.size_gib} GiB state")
    state = h.gpt_state(int(args.size_gib * GiB), n_layer=args.layers)
    desc = h.describe(state)
    h.log(f"state: {desc['tensors']} tensors, {desc['gib']:.3f} GiB")
    peers = None if args.peers is None else [p.strip() for p in args.peers.split(",") if p.strip()]
    with contextlib.ExitStack() as stack:
        s3 = h.try_s3(stack) if tc is not None and not args.no_s3 else None
        ctx = Ctx(state, h.empty_like_state(state), scratch, threads=args.threads, tierckpt=tc,
                  tierckpt_kwargs=parse_kv(args.tierckpt_opt), saves=args.saves, s3=s3, quiet_wait=args.quiet_wait,
                  restore_pairs=args.restore_pairs)
        cases = build_cases(tierckpt=tc is not None, remote=not args.no_remote, s3=s3 is not None, peers=peers,
                            overlap=True)
        if not args.no_adjacent_read:
            h.log("writing the reference files for the raw read next to each cold load")
            ctx.ref = RefFiles.create(ctx)
            stack.callback(ctx.ref.remove)
        res = run_suite(ctx, cases, args.repeats)
    d = derive(res["medians"], desc["bytes"])
    drop = h.drop_caches_status()
    notes = [f"tierckpt not measured: {why}"] if tc is None else []
    if drop["ok"] is False:
        notes.append(f"could not drop the page cache ({drop['error']}): 'cold' numbers are warm")
    if not h.default_stager_available():
        notes.append("DefaultStager not in this torch: that DCP variant skipped")
    tables = h.sections(report_tables(d, res["medians"]))
    md = (f"state: {desc['tensors']} tensors, {desc['gib']:.3f} GiB; repeats: {args.repeats} (medians)\n\n{tables}"
          + "".join(f"\nnote: {n}\n" for n in notes))
    return {"kind": "bench", "machine": h.machine(scratch), "tierckpt_version": getattr(tc, "__version__", None),
            "state": desc, "drop_caches": drop, "notes": notes, "derived": d, "medians": res["medians"],
            "runs": res["runs"], "markdown": tables, "max_rss_bytes": h.max_rss_bytes()}, md


#: the systems of the state-size sweep
SCALING_SYSTEMS = ["torch.save", "safetensors", "dcp.save(t2)", "dcp.async_save", "dcp.async_save+DefaultStager"]
#: tierckpt's metrics compared across tensor counts: (key of the medians, label)
COUNT_METRICS = [("stall", "stall"), ("durable", "durable"), ("load_cold", "restore cold"),
                 ("load_cold_inplace", "in place cold"), ("load_warm", "restore warm"),
                 ("load_warm_inplace", "in place warm")]


def _count_ratio(e: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """``"1.23x (45/55 ms)"``: tierckpt's ``key`` at this count against the fewest tensors'."""
    a, b = base["medians"]["tierckpt"].get(key), e["medians"]["tierckpt"].get(key)
    r = ratio(b, a)
    return "-" if r is None else f"{r:.2f}x ({a * 1e3:.0f}/{b * 1e3:.0f} ms)"


def main_scaling(args: Any) -> tuple[dict[str, Any], str]:
    """The state-size sweep (stall and durable time of every system) and the tensor-count sweep (the same bytes in
    more tensors): the results and their Markdown."""
    scratch = h.scratch_dir(args.dir)
    tc, why = h.import_tierckpt()
    if tc is None:
        h.log(f"tierckpt skipped: {why}")
    kw = parse_kv(args.tierckpt_opt)

    def suite(label: str, state: dict[str, Any], where: Path, loads: bool, peers: list[str]) -> tuple:
        ctx = Ctx(state, h.empty_like_state(state), where, threads=args.threads, loads=loads, check=False,
                  tierckpt=tc, tierckpt_kwargs=kw, saves=3, quiet_wait=args.quiet_wait)
        cases = build_cases(tierckpt=tc is not None, remote=False, s3=False, peers=peers)
        cases.pop("hash")
        return label, ctx, cases

    def entry(desc: dict[str, Any], res: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**extra, "state": desc, "medians": res["medians"], "derived": derive(res["medians"], desc["bytes"])}

    by_size = []
    for gib in (float(s) for s in args.sizes.split(",") if s):
        label, ctx, cases = suite(f"[{gib} GiB] ", h.gpt_state(int(gib * GiB), n_layer=args.layers), scratch, False,
                                  SCALING_SYSTEMS)
        by_size.append(entry(h.describe(ctx.state), run_suite(ctx, cases, args.repeats, label), gib=gib))
        del ctx, cases
        h.settle()
    # every count's state is in memory at once, so that the repeats interleave them: a ratio between two counts is
    # then not a ratio between two stretches of the machine's drift
    suites = []
    for n in (int(c) for c in args.counts.split(",") if c):
        (where := scratch / f"n{n}").mkdir(parents=True, exist_ok=True)
        state = h.gpt_state(int(args.count_size_gib * GiB), n_tensors=n)
        suites.append(suite(f"[{h.describe(state)['tensors']} tensors] ", state, where, True,
                            ["torch.save", "dcp.async_save"]))
    by_count = [entry(h.describe(ctx.state), res, tensors=len(ctx.src_list))
                for (_, ctx, _), res in zip(suites, run_suites(suites, args.repeats))]
    del suites
    h.settle()

    size_rows = []
    for e in by_size:
        m = e["medians"]
        size_rows.append([f"{e['gib']}", "memcpy (limit)", m["memcpy"].get("time"), None])
        size_rows.append([f"{e['gib']}", "raw write+fsync (limit)", None, e["derived"]["limits"]["write"]])
        size_rows += [[f"{e['gib']}", s, m[s].get("stall"), m[s].get("durable")]
                      for s in (*SCALING_SYSTEMS, "tierckpt") if s in m]
    count_rows = []
    for e in by_count:
        m, base = e["medians"], by_count[0]
        for s in ("memcpy", "raw", "torch.save", "dcp.async_save", "tierckpt"):
            if s not in m or "error" in m[s]:
                continue
            if s == "memcpy":
                vals, ref = [m[s].get("time"), None, None], base["medians"].get(s, {}).get("time")
            elif s == "raw":
                lim = e["derived"]["limits"]
                vals, ref = [None, lim["write"], lim["read_cold"]], base["derived"]["limits"]["write"]
            else:
                vals = [m[s].get(k) for k in ("stall", "durable", "load_cold")]
                ref = base["medians"].get(s, {}).get("stall")
            count_rows.append([str(e["tensors"]), s, *vals, ratio(vals[0] if vals[0] is not None else vals[1], ref)])
    tables = [("State-size sweep (median seconds)", ["GiB", "system", "stall s", "durable s"], size_rows),
              (f"Tensor-count sweep at {args.count_size_gib} GiB (median seconds; ratio to the fewest-tensors run)",
               ["tensors", "system", "stall s", "durable s", "load cold s", "ratio"], count_rows)]
    if len(by_count) > 1 and all("tierckpt" in e["medians"] for e in by_count):
        tables.append(("tierckpt per tensor count: each metric's median against the fewest-tensors run's (the "
                       "target: < 1.5x)", ["tensors", *(label for _, label in COUNT_METRICS)],
                       [[str(e["tensors"]), *(_count_ratio(e, by_count[0], k) for k, _ in COUNT_METRICS)]
                        for e in by_count[1:]]))
    if args.plot and by_size:  # a count-only sweep leaves the size plot alone
        plot_scaling(by_size, Path(args.plot))
        h.log(f"plot written to {args.plot}")
    md = h.sections(tables) + (f"\nnote: tierckpt not measured: {why}\n" if tc is None else "")
    return {"kind": "scaling", "machine": h.machine(scratch), "tierckpt_version": getattr(tc, "__version__", None),
            "drop_caches": h.drop_caches_status(), "by_size": by_size, "by_count": by_count, "markdown": md}, md


def plot_scaling(by_size: list[dict[str, Any]], path: Path) -> None:
    """Stall and durable time against state size, one line per system, the limits dashed (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = [e["gib"] for e in by_size]
    names = [n for n in [*SCALING_SYSTEMS, "tierckpt"] if any(n in e["medians"] for e in by_size)]
    for ax, metric, limit, title in ((axes[0], "stall", "memcpy", "stall: training blocked per save"),
                                     (axes[1], "durable", "write", "time until durable on local disk")):
        ax.plot(xs, [e["derived"]["limits"][limit] for e in by_size], "k--", linewidth=2,
                label="memcpy (limit)" if limit == "memcpy" else "raw write+fsync (limit)")
        for n in names:
            ys = [e["medians"].get(n, {}).get(metric) for e in by_size]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-" if n == "tierckpt" else ".-", label=n,
                    linewidth=2.5 if n == "tierckpt" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set(xlabel="state size (GiB)", ylabel="seconds (median)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Checkpoint stall and durability vs state size (CPU, bf16 params + fp32 AdamW state)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> Any:
    """The command line."""
    p = h.Cli(__doc__, __file__)
    p.add_argument("--size-gib", type=float, default=None, help="state size (default 1; 0.25 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, interleaved (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repeat, 2 tierckpt saves")
    p.add_argument("--threads", type=int, default=2, help="threads/files of the N-file limits (default 2)")
    p.add_argument("--layers", type=int, default=12, help="transformer layers of the generated state (default 12)")
    p.add_argument("--saves", type=int, default=None, help="tierckpt saves per repeat (default 4)")
    p.add_argument("--peers", help=f"comma list of peers to run (default all: {','.join(PEERS)})")
    p.add_argument("--no-remote", action="store_true", help="skip tierckpt's remote tier cases")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 loopback case")
    p.add_argument("--tierckpt-opt", action="append", default=[], metavar="K=V",
                   help="extra CheckpointManager keyword (repeatable), e.g. writer_threads=4")
    p.add_argument("--no-adjacent-read", action="store_true",
                   help="do not time a raw read next to every cold load (saves a raw read per load)")
    p.add_argument("--restore-pairs", type=int, default=None,
                   help="cold in-place restores per repeat, each next to a raw read (default 4; 1 with --quick)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="before each case wait up to this many s for other processes to go quiet (0: never)")
    p.add_argument("--scaling", action="store_true", help="run the size and tensor-count sweeps instead")
    p.add_argument("--sizes", default="0.25,0.5,1,2", help="GiB sizes of the size sweep")
    p.add_argument("--counts", default="100,1000,10000", help="tensor counts of the count sweep")
    p.add_argument("--count-size-gib", type=float, default=0.5, help="state size of the count sweep (default 0.5)")
    p.add_argument("--plot", default=None, help="PNG of the size sweep (default docs/bench_scaling.png with --scaling)")
    p.add_argument("--plot-from", metavar="JSON", help="only redraw --plot from a saved --scaling --out JSON")
    a = p.parse(argv)
    for key, quick, default in (("size_gib", 0.25, 1.0), ("repeats", 1, 1 if a.scaling else 3), ("saves", 2, 4),
                                ("restore_pairs", 1, 4)):
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else default)
    if a.restore_pairs < 1:
        p.error("--restore-pairs must be at least 1")
    if a.plot is None and (a.scaling or a.plot_from):
        a.plot = str(h.REPO_ROOT / "docs" / "bench_scaling.png")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        plot_scaling(json.loads(Path(args.plot_from).read_text())["by_size"], Path(args.plot))
        print(f"plot written to {args.plot}")
        return 0
    t0 = time.perf_counter()
    result, md = main_scaling(args) if args.scaling else main_bench(args)
    result["wall_s"] = time.perf_counter() - t0
    print(md)
    h.finish(args, result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
