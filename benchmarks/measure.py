"""The measured cases: hardware limits, peer checkpointers and tierckpt, each one run of one repeat.

Every case is a function ``case(ctx) -> dict[str, float | bool | None]`` that saves and/or loads ``ctx.state`` once,
cleans up its files outside the timed regions, and returns its metrics in seconds (bytes for ``rss_*``). The
driver (:mod:`bench`) runs all cases once per repeat, rotating their order, and reports medians.

Metric names shared across systems (so that they line up in one table):

- ``stall``: how long the training loop is blocked before it may change its tensors again. For synchronous savers
  that is the whole save; for DCP ``async_save`` it is the time until the call returns (with ``DefaultStager``,
  until its staging future completes: ``stall_return`` is the bare return); for tierckpt, until ``save()`` returns.
- ``durable``: from the start of the save until the bytes are fsynced on the local disk.
- ``load_cold`` / ``load_warm``: loading into the preallocated state with the page cache dropped / warm
  (tierckpt: the default restore, verified in a staging buffer first; ``load_*_inplace``: ``in_place=True``).
- ``rss_extra``: peak RSS during the case minus RSS before it (sampled every 20 ms).
- ``load_cold_ref`` (and ``load_cold_inplace_ref``): with reference files (:class:`RefFiles`), a raw cold read of
  the same number of bytes timed right next to that cold load, before it or after it in turn; ``*_vs_ref`` is the
  load's time over it, per repeat. The limit is then measured seconds, not minutes, from the load it is compared
  with, so that the disk's drift between cases (this shared disk's reads vary by 10-25% from one minute to the
  next) cancels in the ratio. ``load_cold_inplace_pairs``: (restore, adjacent read) seconds of every cold in-place
  restore of the repeat (``Ctx.restore_pairs`` of them); the driver pools them over the repeats.
- ``durable_pairs`` (tierckpt): (durable, adjacent write) seconds of every steady-state save, the adjacent write
  being the write limit's fastest way here (``O_DIRECT``, N files, fsync; :meth:`RefFiles.write`) timed right
  before or right after that save in turn; pooled over the repeats too.

Before every timed write or cold read the disk is let go quiet (:func:`common.disk_idle`), for every system alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import xxhash
from common import (
    RssSampler,
    disk_idle,
    drop_caches,
    fresh_dir,
    fsync_path,
    fsync_tree,
    median,
    pack_aligned,
    parallel,
    read_file_direct,
    read_file_into,
    read_into_page_cache,
    remove,
    rss_bytes,
    settle,
    split_balanced,
    timed,
    write_file,
    write_file_direct,
)
from state import copy_into, flatten, states_equal, tensors

Metrics = dict[str, Any]


@dataclass
class Ctx:
    """Everything a case needs: the state, a preallocated target of the same shape, where to write, and options."""

    state: dict[str, Any]
    dst: dict[str, Any]
    scratch: Path
    threads: int = 2
    check: bool = True  # verify loaded values against the state (outside the timed region)
    loads: bool = True  # measure loads/restores as well as saves
    tierckpt: ModuleType | None = None
    tierckpt_kwargs: dict[str, Any] = field(default_factory=dict)
    saves: int = 4  # tierckpt saves per repeat (first + steady state)
    s3: dict[str, Any] | None = None  # from common.s3_loopback
    repeat: int = 0
    quiet_wait: float = 0.0  # seconds to wait for other processes to go quiet before each case
    ref: RefFiles | None = None  # reference files for the raw read timed next to every cold load
    ref_turns: int = 0  # loads and saves paired so far (the reference read or write goes first on even turns)
    restore_pairs: int = 1  # cold in-place restores per repeat in case_tierckpt, each with its adjacent read
    _tensors: list[torch.Tensor] | None = None
    _dst_tensors: list[torch.Tensor] | None = None

    @property
    def src_list(self) -> list[torch.Tensor]:
        if self._tensors is None:
            self._tensors = tensors(self.state)
        return self._tensors

    @property
    def dst_list(self) -> list[torch.Tensor]:
        if self._dst_tensors is None:
            self._dst_tensors = tensors(self.dst)
        return self._dst_tensors

    def clear_dst(self) -> None:
        """Zero the target so a load that silently does nothing cannot pass the check."""
        for t in self.dst_list:
            t.zero_()

    def verify(self) -> bool | None:
        """Whether ``dst`` equals ``state`` (``None`` when checks are off or after the first repeat)."""
        if not self.check or self.repeat > 0:
            return None
        return states_equal(self.state, self.dst)


def _write_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
    """The N-file raw write: each group's tensors back to back into its file on a thread of its own, each file
    fsynced, then the folder entry."""
    parallel(lambda g: write_file(paths[g], [ctx.src_list[i] for i in groups[g]]), len(paths))
    fsync_path(paths[0])


def _write_files_direct(paths: list[Path], bufs: list[memoryview]) -> None:
    """The N-file raw write with ``O_DIRECT`` from page-aligned buffers (one a file, a thread each), fsynced."""
    parallel(lambda g: write_file_direct(paths[g], bufs[g]), len(paths))
    fsync_path(paths[0])


def _read_files(ctx: Ctx, paths: list[Path], groups: list[list[int]]) -> None:
    """The N-file raw read: each file into its group's target tensors, a thread each."""
    parallel(lambda g: read_file_into(paths[g], [ctx.dst_list[i] for i in groups[g]]), len(paths))


@dataclass
class RefFiles:
    """The state's bytes in ``len(paths)`` files, written once (buffered, fsynced) before a run's first case and
    kept to its end: what the raw cold read timed next to every cold load reads (:func:`cold`). Both the reads
    and the writes timed next to tierckpt's saves (:meth:`write`) take the fastest raw way here: ``O_DIRECT`` from
    and into page-aligned copies of the state on transparent huge pages (made once here: state-sized memory, held
    to the end of the run; their 2 MiB DMA segments made a direct transfer 0.5-0.65x the time of one from 4 KiB
    pages on the reference VM). Where the file system refuses ``O_DIRECT`` the reads go buffered into the target
    state (``ctx.dst``), as the ``read_cold_nf`` limit's do."""

    paths: list[Path]
    groups: list[list[int]]
    #: the same bytes in page-aligned buffers (on huge pages), made once (before any RSS is sampled)
    aligned: list[memoryview] | None = None

    @classmethod
    def create(cls, ctx: Ctx) -> RefFiles:
        d = fresh_dir(ctx.scratch, "ref")
        groups = split_balanced(ctx.src_list, ctx.threads)
        paths = [d / f"ref{g}.bin" for g in range(len(groups))]
        _write_files(ctx, paths, groups)
        aligned = None
        if hasattr(os, "O_DIRECT"):
            aligned = [pack_aligned([ctx.src_list[i] for i in g], huge=True) for g in groups]
        return cls(paths, groups, aligned)

    def write(self, ctx: Ctx) -> float | None:
        """Seconds for the write limit's fastest way here: the state's bytes written with ``O_DIRECT`` from the
        page-aligned buffers into N new files on N threads, then fsynced, on a quiet disk; the files are removed
        afterwards (untimed). ``None`` where the file system refuses ``O_DIRECT``."""
        if self.aligned is None:
            return None
        aligned = self.aligned
        paths = [self.paths[0].parent / f"w{g}.bin" for g in range(len(aligned))]
        disk_idle(ctx.scratch)
        try:
            t0 = time.perf_counter()
            _write_files_direct(paths, aligned)
            return time.perf_counter() - t0
        except OSError:  # EINVAL: no O_DIRECT on this file system
            self.aligned = None
            return None
        finally:
            for p in paths:
                remove(p)

    def read(self, ctx: Ctx) -> float:
        """Seconds for a cold read of the files (page cache dropped, disk quiet first): ``O_DIRECT`` into the
        aligned copies (the same bytes, so they stay what :meth:`write` writes), else buffered into ``ctx.dst``."""
        drop_caches()
        disk_idle(ctx.scratch)
        aligned = self.aligned
        if aligned is not None:
            try:
                t0 = time.perf_counter()
                parallel(lambda g: read_file_direct(self.paths[g], aligned[g]), len(aligned))
                return time.perf_counter() - t0
            except OSError:  # EINVAL: no O_DIRECT on this file system
                self.aligned = None
                drop_caches()
                disk_idle(ctx.scratch)
        t0 = time.perf_counter()
        _read_files(ctx, self.paths, self.groups)
        return time.perf_counter() - t0

    def remove(self) -> None:
        remove(self.paths[0].parent)


@contextlib.contextmanager
def cold(ctx: Ctx, out: Metrics, key: str) -> Iterator[None]:
    """Around one cold load that the body times as ``out[key]`` (and checks, before this returns): the target
    cleared, the page cache dropped and the disk let go quiet first; with ``ctx.ref``, the reference read timed
    as ``out[key + "_ref"]`` right before the load or right after it (every other time), and their ratio as
    ``out[key + "_vs_ref"]``."""
    first = ctx.ref is not None and ctx.ref_turns % 2 == 0
    ctx.ref_turns += 1
    if first:
        assert ctx.ref is not None
        out[f"{key}_ref"] = ctx.ref.read(ctx)
    ctx.clear_dst()
    settle()
    out["cold_cache"] = drop_caches()
    disk_idle(ctx.scratch)
    yield
    if ctx.ref is not None and not first:
        out[f"{key}_ref"] = ctx.ref.read(ctx)  # overwrites the target: the body has checked it already
    if f"{key}_ref" in out and key in out:
        out[f"{key}_vs_ref"] = out[key] / out[f"{key}_ref"]


def _loads(ctx: Ctx, out: Metrics, load: Callable[[], None]) -> None:
    """Time ``load`` twice, with the page cache dropped and then warm; verify the first result."""
    if not ctx.loads:
        return
    with cold(ctx, out, "load_cold"):
        with timed(out, "load_cold"):
            load()
        out["load_ok"] = ctx.verify()
        # inside: a reference read after the cold load drops the page cache (a warm load after it was cold)
        with timed(out, "load_warm"):
            load()


# --------------------------------------------------------------------------------------------------------------
# limits
# --------------------------------------------------------------------------------------------------------------


def case_memcpy(ctx: Ctx) -> Metrics:
    """``copy_`` every tensor into its preallocated twin (``time``: the floor of a snapshot), and the same copy
    with streaming stores on ``ctx.threads`` threads (``time_stream``: tierckpt's native copy, the lower floor of
    this memory; absent where it is not built). The two go in turn first, by repeat."""
    from tierckpt.snapshot import hostcopy

    out: Metrics = {}

    def plain() -> None:
        with timed(out, "time"):
            for s, d in zip(ctx.src_list, ctx.dst_list, strict=True):
                d.copy_(s)

    def stream() -> None:
        if hostcopy.available:
            with timed(out, "time_stream"):
                rest, _ = hostcopy.copy_pairs(ctx.dst_list, ctx.src_list, threads=ctx.threads, min_bytes=0)
            assert not rest, "every benchmark tensor is contiguous"

    for fn in (plain, stream) if ctx.repeat % 2 == 0 else (stream, plain):
        fn()
    return out


def case_hash(ctx: Ctx) -> Metrics:
    """xxh3_128 over every tensor's bytes, on one thread and on ``ctx.threads`` threads."""
    from common import byte_view

    out: Metrics = {}
    ts = ctx.src_list
    with timed(out, "time_1t"):
        for t in ts:
            if t.nbytes:
                xxhash.xxh3_128(byte_view(t)).digest()
    groups = split_balanced(ts, ctx.threads)

    def work(g: int) -> None:
        for i in groups[g]:
            if ts[i].nbytes:
                xxhash.xxh3_128(byte_view(ts[i])).digest()

    with timed(out, "time_nt"):
        parallel(work, ctx.threads)
    return out


def case_raw_io(ctx: Ctx) -> Metrics:
    """Raw sequential write+fsync of the state's bytes (one file; N files on N threads; N files with ``O_DIRECT`` from
    page-aligned buffers), then cold and warm reads (the direct files: cold only)."""
    out: Metrics = {}
    d = fresh_dir(ctx.scratch, "raw")
    try:
        one = d / "all.bin"
        disk_idle(d)
        with timed(out, "write_1f"):
            write_file(one, ctx.src_list)
            fsync_path(one)
        out["cold_cache"] = drop_caches()
        disk_idle(d)
        with timed(out, "read_cold_1f"):
            read_file_into(one, ctx.dst_list)
        with timed(out, "read_warm_1f"):
            read_file_into(one, ctx.dst_list)
        remove(one)

        n = ctx.threads
        groups = split_balanced(ctx.src_list, n)
        paths = [d / f"part{g}.bin" for g in range(n)]
        disk_idle(d)
        with timed(out, "write_nf"):
            _write_files(ctx, paths, groups)
        drop_caches()
        disk_idle(d)
        with timed(out, "read_cold_nf"):
            _read_files(ctx, paths, groups)
        with timed(out, "read_warm_nf"):
            _read_files(ctx, paths, groups)
        if ctx.check and ctx.repeat == 0:
            out["read_ok"] = states_equal(ctx.state, ctx.dst)
        for p in paths:
            remove(p)

        # the same N files with O_DIRECT from page-aligned buffers (no page cache): on 4 KiB pages, and on
        # transparent huge pages where the kernel offers them (2 MiB DMA segments; tierckpt's staging memory), the
        # two in turn first by repeat
        from tierckpt._memory import huge_pages_available

        kinds = [("", False)] + ([("_huge", True)] if huge_pages_available() else [])
        for suffix, huge in kinds if ctx.repeat % 2 == 0 else kinds[::-1]:
            if not hasattr(os, "O_DIRECT") or "direct_error" in out:
                break
            bufs = [pack_aligned([ctx.src_list[i] for i in groups[g]], huge=huge) for g in range(n)]  # not timed
            try:
                disk_idle(d)
                with timed(out, f"write_nf_direct{suffix}"):
                    _write_files_direct(paths, bufs)
                drop_caches()
                disk_idle(d)
                with timed(out, f"read_cold_nf_direct{suffix}"):
                    parallel(lambda g, bufs=bufs: read_file_direct(paths[g], bufs[g]), n)
            except OSError as exc:  # EINVAL: this file system has no O_DIRECT; the buffered limits stand
                out.pop(f"write_nf_direct{suffix}", None)
                out["direct_error"] = str(exc)
            del bufs
    finally:
        remove(d)
    return out


# --------------------------------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------------------------------


def case_torch_save(ctx: Ctx) -> Metrics:
    """``torch.save`` to one file + fsync; ``torch.load(mmap=False)`` then ``copy_`` into the target."""
    out: Metrics = {}
    d = fresh_dir(ctx.scratch, "torchsave")
    path = d / "ckpt.pt"
    try:
        disk_idle(d)
        base = rss_bytes()
        with RssSampler(0.02) as rss, timed(out, "stall"):
            with open(path, "wb") as f:
                torch.save(ctx.state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(path)
        out["durable"] = out["stall"]
        out["rss_extra"] = rss.peak - base

        def load() -> None:
            loaded = torch.load(path, mmap=False, weights_only=True)
            copy_into(ctx.dst, loaded)
            del loaded

        _loads(ctx, out, load)
    finally:
        remove(d)
    return out


def case_safetensors(ctx: Ctx) -> Metrics:
    """``safetensors.torch.save_file`` of the flat state + fsync; ``load_file`` then ``copy_`` into the target."""
    from safetensors.torch import load_file, save_file

    out: Metrics = {}
    d = fresh_dir(ctx.scratch, "safetensors")
    path = d / "ckpt.safetensors"
    try:
        disk_idle(d)
        base = rss_bytes()
        with RssSampler(0.02) as rss, timed(out, "stall"):
            save_file(flatten(ctx.state), str(path))
            fsync_path(path)
        out["durable"] = out["stall"]
        out["rss_extra"] = rss.peak - base

        def load() -> None:
            loaded = load_file(str(path))
            copy_into(ctx.dst, loaded)
            del loaded

        _loads(ctx, out, load)
    finally:
        remove(d)
    return out


def _dcp_load(ctx: Ctx, out: Metrics, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    def load() -> None:
        dcp.load(ctx.dst, checkpoint_id=str(path), no_dist=True)

    _loads(ctx, out, load)


def make_case_dcp_save(thread_count: int) -> Callable[[Ctx], Metrics]:
    """DCP ``save`` with ``FileSystemWriter(thread_count=...)`` (it fsyncs by default); DCP ``load`` in place."""

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        out: Metrics = {}
        d = fresh_dir(ctx.scratch, f"dcp{thread_count}")
        try:
            disk_idle(d)
            base = rss_bytes()
            with RssSampler(0.02) as rss, timed(out, "stall"):
                dcp.save(
                    ctx.state,
                    storage_writer=dcp.FileSystemWriter(str(d), thread_count=thread_count),
                    no_dist=True,
                )
                fsync_tree(d)  # DCP fsyncs its data files; this adds the metadata file and the folder
            out["durable"] = out["stall"]
            out["rss_extra"] = rss.peak - base
            _dcp_load(ctx, out, d)
        finally:
            remove(d)
        return out

    case.__name__ = f"case_dcp_save_t{thread_count}"
    return case


def default_stager_available() -> bool:
    """Whether this torch has ``torch.distributed.checkpoint.staging.DefaultStager``."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    except ImportError:
        return False
    return True


def make_case_dcp_async(stager: bool, thread_count: int = 1) -> Callable[[Ctx], Metrics]:
    """DCP ``async_save``: with its default (synchronous CPU staging) or with ``DefaultStager`` (async staging).

    With ``DefaultStager`` the call returns before the copy is done; the tensors may change only after
    ``staging_completion``, so ``stall`` is that and ``stall_return`` is the bare return. On a machine without
    CUDA pinned memory and non-blocking copies are turned off (DefaultStager refuses them there).
    """

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        out: Metrics = {}
        d = fresh_dir(ctx.scratch, "dcpasync")
        st = None
        try:
            kwargs: dict[str, Any] = {}
            if stager:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                cuda = torch.cuda.is_available()
                st = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=cuda,
                    )
                )
                kwargs["async_stager"] = st
            disk_idle(d)
            base = rss_bytes()
            with RssSampler(0.02) as rss:
                t0 = time.perf_counter()
                resp = dcp.async_save(
                    ctx.state,
                    storage_writer=dcp.FileSystemWriter(str(d), thread_count=thread_count),
                    no_dist=True,
                    **kwargs,
                )
                out["stall_return"] = time.perf_counter() - t0
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    out["stall"] = time.perf_counter() - t0
                    fut = resp.upload_completion
                else:
                    out["stall"] = out["stall_return"]
                    fut = resp
                fut.result()
                fsync_tree(d)
                out["durable"] = time.perf_counter() - t0
            out["rss_extra"] = rss.peak - base
            if ctx.check and ctx.repeat == 0 and ctx.loads:
                import torch.distributed.checkpoint as dcp2

                ctx.clear_dst()
                dcp2.load(ctx.dst, checkpoint_id=str(d), no_dist=True)
                out["load_ok"] = ctx.verify()
        finally:
            if st is not None:
                st.close()
            remove(d)
        return out

    case.__name__ = "case_dcp_async_stager" if stager else "case_dcp_async"
    return case


# --------------------------------------------------------------------------------------------------------------
# tierckpt
# --------------------------------------------------------------------------------------------------------------


def _future_seconds(fut: Any, t0: float) -> float:
    """Wait for a stage future; seconds since ``t0`` on our clock (the library's own number is kept separately)."""
    fut.result()
    return time.perf_counter() - t0


def case_tierckpt(ctx: Ctx) -> Metrics:
    """tierckpt, local tier only: ``ctx.saves`` saves (each awaited), then verified restores cold and warm.

    Reports the first save's stall and durable time separately from the steady state (p50 and max over the
    rest), RSS growth between the second and the last save (a steady-state save should allocate nothing large),
    peak extra RSS, and the restore times from a fresh manager over the same folder.
    """
    tc = ctx.tierckpt
    assert tc is not None
    out: Metrics = {}
    d = fresh_dir(ctx.scratch, "tierckpt")
    try:
        stalls: list[float] = []
        durables: list[float] = []
        lib_durables: list[float] = []
        rss_after: list[int] = []
        durable_pairs: list[tuple[float, float]] = []
        base = rss_bytes()
        with RssSampler(0.02) as rss:
            mgr = tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs)
            try:
                for k in range(ctx.saves):
                    # steady-state saves get the write limit timed next to them, before or after in turn
                    ref = ctx.ref if k > 0 else None
                    first = ref is not None and ctx.ref_turns % 2 == 0
                    ctx.ref_turns += ref is not None
                    wref = ref.write(ctx) if ref is not None and first else None
                    disk_idle(d)  # the previous save's retention deleted a step: its discards finish first
                    t0 = time.perf_counter()
                    h = mgr.save(k + 1, ctx.state)
                    stalls.append(time.perf_counter() - t0)
                    durables.append(_future_seconds(h.persisted, t0))
                    lib_durables.append(float(h.persisted.result()))
                    mgr.wait()
                    rss_after.append(rss_bytes())
                    if ref is not None and not first:
                        wref = ref.write(ctx)
                    if wref is not None:
                        durable_pairs.append((durables[-1], wref))
            finally:
                mgr.close()
        out["rss_extra"] = rss.peak - base
        out["first_stall"] = stalls[0]
        out["first_durable"] = durables[0]
        steady = stalls[1:] or stalls
        out["stall"] = median(steady)
        out["stall_max"] = max(steady)
        out["durable"] = median(durables[1:] or durables)
        out["durable_lib"] = median(lib_durables[1:] or lib_durables)
        out["rss_growth_steady"] = rss_after[-1] - rss_after[1] if len(rss_after) > 2 else None
        if durable_pairs:
            out["durable_pairs"] = durable_pairs
        del mgr
        settle()
        if ctx.loads:
            mgr = tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs)
            try:
                with cold(ctx, out, "load_cold"):
                    base = rss_bytes()
                    with RssSampler(0.02) as rss2, timed(out, "load_cold"):
                        step = mgr.restore(ctx.dst)
                    out["rss_extra_restore"] = rss2.peak - base
                    out["restored_step_ok"] = step == ctx.saves
                    out["load_ok"] = ctx.verify()
                    # before a reference read drops the page cache again; the cold restore read around the cache,
                    # so the files are read into it first (untimed): a warm restore is one from cached files
                    read_into_page_cache(d / "local")
                    with timed(out, "load_warm"):
                        mgr.restore(ctx.dst)
                # in_place=True: bytes read straight into the destination tensors (still verified)
                with cold(ctx, out, "load_cold_inplace"):
                    base = rss_bytes()
                    with RssSampler(0.02) as rss3, timed(out, "load_cold_inplace"):
                        step = mgr.restore(ctx.dst, in_place=True)
                    out["rss_extra_restore_inplace"] = rss3.peak - base
                    out["load_inplace_ok"] = step == ctx.saves and ctx.verify() is not False
                    read_into_page_cache(d / "local")
                    with timed(out, "load_warm_inplace"):
                        mgr.restore(ctx.dst, in_place=True)
                # more cold in-place restores, each with its own adjacent read: one pair per repeat cannot tell
                # 1.05x from 1.15x on a disk whose reads vary by 10-25% (the default restore gets one pair: its
                # first restore in a process, with a fresh staging buffer, is the one that matters)
                pairs = [(out["load_cold_inplace"], out.get("load_cold_inplace_ref"))]
                for _ in range(ctx.restore_pairs - 1):
                    more: Metrics = {}
                    with cold(ctx, more, "load_cold_inplace"), timed(more, "load_cold_inplace"):
                        mgr.restore(ctx.dst, in_place=True)
                    pairs.append((more["load_cold_inplace"], more.get("load_cold_inplace_ref")))
                if ctx.ref is not None:
                    out["load_cold_inplace_pairs"] = pairs
            finally:
                mgr.close()
    finally:
        remove(d)
    return out


def case_tierckpt_copy_first(ctx: Ctx) -> Metrics:
    """tierckpt with ``overlap_writes=False`` (the whole copy first, then the writes), saves only: the other side of
    the trade-off from the default (auto), which writes while copying with the native copy or enough cores."""
    kwargs = {**ctx.tierckpt_kwargs, "overlap_writes": False}
    return case_tierckpt(dataclasses.replace(ctx, loads=False, tierckpt_kwargs=kwargs))


def make_case_tierckpt_remote(kind: str) -> Callable[[Ctx], Metrics]:
    """tierckpt with a remote tier (``"posix"``: a folder on the same disk; ``"s3"``: moto on loopback).

    Two saves; the second (steady state) is reported: ``stall``, ``durable`` (local), ``remote_durable`` (until
    ``handle.uploaded`` completes, from the start of the save) and ``upload`` (remote minus local).
    """

    def case(ctx: Ctx) -> Metrics:
        tc = ctx.tierckpt
        assert tc is not None
        out: Metrics = {}
        d = fresh_dir(ctx.scratch, f"tierckpt-{kind}")
        s3_prefix = None
        try:
            kwargs = dict(ctx.tierckpt_kwargs)
            kwargs.setdefault("keep_remote", 1)
            if kind == "posix":
                remote: str = str(d / "remote")
            else:
                if ctx.s3 is None:
                    return {"skipped": "no S3 server"}
                s3_prefix = f"{ctx.s3['bucket']}/{d.name}"
                remote = f"s3://{s3_prefix}"
                kwargs["storage_options"] = ctx.s3["storage_options"]
            base = rss_bytes()
            rss = RssSampler(0.02).__enter__()
            mgr = tc.CheckpointManager(d / "local", remote=remote, **kwargs)
            try:
                for k in range(2):
                    disk_idle(d)
                    t0 = time.perf_counter()
                    h = mgr.save(k + 1, ctx.state)
                    stall = time.perf_counter() - t0
                    durable = _future_seconds(h.persisted, t0)
                    remote_durable = _future_seconds(h.uploaded, t0)
                    mgr.wait()
                    if k == 0:
                        out["first_stall"], out["first_remote_durable"] = stall, remote_durable
                out["stall"], out["durable"], out["remote_durable"] = stall, durable, remote_durable
                out["upload"] = remote_durable - durable
            finally:
                mgr.close()
                rss.__exit__()
                if kind != "s3":  # moto's server runs in this process and holds the objects in memory
                    out["rss_extra"] = rss.peak - base
        finally:
            remove(d)
            if s3_prefix is not None and ctx.s3 is not None:
                import s3fs

                fs = s3fs.S3FileSystem(**ctx.s3["storage_options"], skip_instance_cache=True)
                if fs.exists(s3_prefix):
                    fs.rm(s3_prefix, recursive=True)
        return out

    case.__name__ = f"case_tierckpt_{kind}"
    return case
